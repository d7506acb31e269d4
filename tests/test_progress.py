"""The progress line: shown at a terminal, silent in a pipe or with --quiet."""

import io
from functools import partial

from rlkit_core.progress import Progress

METRICS = {"time/iteration": 2.0, "score/mean": 0.4123, "kl/ref": 1.5, "kl/beta": 0.05}


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_terminal_gets_iteration_eta_score_kl_and_beta():
    stream = Terminal()
    progress = Progress(total=10, stream=stream)
    progress.update(1, METRICS)
    progress.close()
    text = stream.getvalue()
    assert "iter 1/10" in text and "ETA" in text and "score 0.4123" in text and "KL 1.500" in text and "β 0.0500" in text
    assert text.endswith("\n")


def test_pipe_and_quiet_print_nothing():
    for stream, quiet in ((io.StringIO(), False), (Terminal(), True)):
        progress = Progress(total=10, stream=stream, quiet=quiet)
        progress.update(1, METRICS)
        progress.close()
        assert stream.getvalue() == ""


def test_warm_start_shows_its_steps_and_loss(tmp_path):
    from rlkit_plugins.guess_number import GuesserConfig, WarmStartGuesser
    from rlkit_plugins.warm_start import build_warm_start

    stream = Terminal()
    config = GuesserConfig()
    build_warm_start(tmp_path / "ws", partial(WarmStartGuesser.examples, config), WarmStartGuesser.corpus(config), n_layer=1, n_embd=16,
                     n_head=2, sft_steps=3, batch_size=4, corpus_size=20, progress=Progress(3, stream=stream, label="warm-start step"))
    text = stream.getvalue()
    assert "warm-start step 3/3" in text and "ETA" in text and "loss " in text and text.endswith("\n")
