"""Held-out evaluation: set-aside prompts never trained on, before/after figures in the report,
and no effect on the training random stream (so resume stays exact)."""

import json
import time
from pathlib import Path

import pytest

from rlkit_core.errors import RecipeError
from rlkit_core.interfaces import Environment
from rlkit_core.messages import Reset, Step
from rlkit_core.recipe.document import parse_recipe
from rlkit_core.runtime.episodes import EnvironmentFault
from rlkit_core.runtime.evaluation import hold_out
from rlkit_core.runtime.run import run_recipe
from rlkit_core.runtime.trainer import Trainer
from tests.test_trainer import make_trainer


def with_eval(document, steps=3, **settings):
    return dict(document, run={**document["run"], "steps": steps}, eval={"size": 8, **settings})


def rows(output_dir):
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def training_rows(output_dir):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "eval/"))} for r in rows(output_dir) if "score/mean" in r]


def test_hold_out_is_seeded_and_disjoint():
    records = [{"prompt": str(i)} for i in range(20)]
    held, training = hold_out(records, 5, seed=3)
    assert len(held) == 5 and len(training) == 15
    assert {r["prompt"] for r in held}.isdisjoint(r["prompt"] for r in training)
    assert hold_out(records, 5, seed=3) == (held, training)
    assert hold_out(records, 0, seed=3) == ([], records)
    with pytest.raises(RecipeError, match=r"\$\.eval\.size: 20 held-out prompts would leave none of the 20"):
        hold_out(records, 20, seed=3)


def test_held_out_prompts_never_reach_a_training_batch(recipe_document, builtin_registry):
    trainer = Trainer(parse_recipe(with_eval(recipe_document), builtin_registry))
    held = {r["prompt"] for r in trainer.prompts.held_out}
    assert len(held) == 8
    seen = {r["prompt"] for i in range(20) for r in trainer.stream.batch(i)}  # several passes over the data
    assert seen and held.isdisjoint(seen)


def test_run_evaluates_before_and_after_and_reports_both(recipe_document, builtin_registry, tmp_path):
    data = tmp_path / "with_references.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"say {w}", "reference": w, "letter": "e"}) + "\n"
                            for w in ["cat", "dog", "egg", "fig", "hat", "ink", "jam", "kit"] * 4))
    document = with_eval(recipe_document, every=2, metrics=["rouge"])
    document["data"] = {"type": "jsonl", "path": str(data)}
    document["run"]["output_dir"] = str(tmp_path / "run")
    out = tmp_path / "report.txt"
    with out.open("w") as report:
        run_recipe(parse_recipe(document, builtin_registry), quiet=True, out=report)
    logged = rows(tmp_path / "run")
    evaluated = [r["iteration"] for r in logged if "eval/score" in r]
    assert evaluated == [0, 2, 3]  # before training, every 2, and after the last
    assert set(logged[0]) == {"iteration", "eval/score", "eval/length", "eval/eos_rate", "eval/rouge"}
    text = out.read_text()
    assert "held-out evaluation, iteration 0 → 3:" in text and "  score " in text
    samples = json.loads((tmp_path / "run" / "samples_before.json").read_text())
    trainer = Trainer(parse_recipe(document, builtin_registry))
    assert [s["prompt"] for s in samples] == [r["prompt"] for r in trainer.prompts.held_out]  # all 8, fixed before training
    assert "greedy responses to 8 held-out prompts, after training: " in text
    assert text.count("\nsample ") == 5 and "(score " in text


def test_report_counts_the_samples_that_scored_higher_lower_and_the_same():
    import io

    from rlkit_core.runtime.report import print_report

    history = [{"iteration": 1, "score/mean": 0.5, "kl/ref": 0.0, "time/iteration": 1.0}]
    changes = [(0.2, 0.9), (0.5, 0.5), (0.9, 0.4), (0.1, 0.3), (0.3, 0.3 + 1e-9), (0.0, 1.0), (0.6, 0.7)]
    samples = [{"prompt": f"p{i}", "before": "b", "after": "a", "before_score": b, "after_score": a}
               for i, (b, a) in enumerate(changes)]
    out = io.StringIO()
    print_report(history, samples, True, "m.jsonl", "ckpt", None, out=out)
    text = out.getvalue()
    assert "greedy responses to 7 held-out prompts, after training: 4 score higher, 1 lower, 2 the same" in text
    assert text.count("\nsample ") == 5 and "sample 6" not in text
    assert "  before: 'b' (score 0.200)\n  after:  'a' (score 0.900)" in text


def test_a_reward_failing_on_the_reports_samples_leaves_them_unscored(recipe_document, builtin_registry, tmp_path, capsys):
    """The run has finished when the report's samples are scored: a failure there is a warning."""
    from rlkit_core.runtime.run import _scored

    broken = tmp_path / "late_failure.py"
    broken.write_text("def score(prompts, responses, **columns):\n    raise ConnectionError('reward server went away')\n")
    recipe_document["reward"]["function"] = f"{broken}:score"
    trainer = Trainer(parse_recipe(with_eval(recipe_document), builtin_registry))
    samples = [{"prompt": r["prompt"], "before": "x", "after": "y"} for r in trainer.prompts.held_out]
    assert _scored(trainer.recipe, trainer.components, trainer.prompts.held_out, samples) == samples
    warning = capsys.readouterr().err
    assert "rlkit run: warning: " in warning and "reward server went away" in warning and "shown unscored" in warning


def test_unknown_eval_metric_is_located(recipe_document, builtin_registry):
    with pytest.raises(RecipeError, match=r"\$\.eval\.metrics\[1\]: unknown reward 'rogue'"):
        parse_recipe(with_eval(recipe_document, metrics=["rouge", "rogue"]), builtin_registry)
    with pytest.raises(RecipeError, match=r"\$\.eval\.metrics\[0\]: reward 'python' needs settings \(function\)"):
        parse_recipe(with_eval(recipe_document, metrics=["python"]), builtin_registry)


def test_evaluation_does_not_disturb_training(recipe_document, builtin_registry, tmp_path):
    """Evaluating after every iteration (sampled, so it draws random numbers) leaves the training
    figures exactly as with evaluation only before and after."""
    often = with_eval(recipe_document, every=1, greedy=False)
    often["run"]["output_dir"] = str(tmp_path / "often")
    rarely = with_eval(recipe_document, every=0, greedy=False)
    rarely["run"]["output_dir"] = str(tmp_path / "rarely")
    run_recipe(parse_recipe(often, builtin_registry), quiet=True)
    run_recipe(parse_recipe(rarely, builtin_registry), quiet=True)
    assert training_rows(tmp_path / "often") == training_rows(tmp_path / "rarely")
    assert "eval/kl" in rows(tmp_path / "often")[0]


def test_resume_with_evaluation_matches_an_uninterrupted_run(recipe_document, builtin_registry, tmp_path):
    straight = with_eval(recipe_document, steps=4, every=1)
    straight["run"]["output_dir"] = str(tmp_path / "straight")
    run_recipe(parse_recipe(straight, builtin_registry), quiet=True)
    first = with_eval(recipe_document, steps=2, every=1)
    first["run"]["output_dir"] = str(tmp_path / "split")
    run_recipe(parse_recipe(first, builtin_registry), quiet=True)
    second = with_eval(recipe_document, steps=4, every=1)
    second["run"]["output_dir"] = str(tmp_path / "split")
    run_recipe(parse_recipe(second, builtin_registry), quiet=True, resume="auto")
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rs]  # noqa: E731
    assert strip(rows(tmp_path / "split")) == strip(rows(tmp_path / "straight"))


class Reports(Environment):
    """Gives each episode the figures of its record's `figures` column, and ends it after the model's
    first turn (a record with `hangs` takes 5 s to answer)."""

    def tools(self):
        return []

    def reset(self, record, seed):
        return Reset([{"role": "user", "content": "go"}], state=record, info=dict(record["figures"]))

    def step(self, state, reply):
        if state.get("hangs"):
            time.sleep(5)
        return Step(done=True)


def test_an_episodes_figure_is_its_mean_over_every_episode_that_reported_it(recipe_document, builtin_registry,
                                                                            tmp_path):
    """Eight held-out episodes in two chunks of ppo.batch_size = 4. In the first, one episode reports
    solved = 1 and three report nothing; in the second, all four report it and one is solved:
    eval/solved = 2 solved / 5 reporting = 0.4, where the mean of the chunks' means would be
    (1/1 + 1/4) / 2 = 0.625. `rare`, reported by one episode of the first chunk (2.0), is 2.0, not
    2.0 x 4 / 8 = 1.0. A figure of every episode (eval/status_ok) is the mean over all eight. The
    last episode's step hangs past step_timeout_s: a timeout (its reset's figures still count), and
    eval/hung_calls is the count of calls still running after the last chunk (1), not a mean over chunks."""
    import attrs

    from rlkit_core.runtime.evaluation import Evaluator
    from tests.test_episodes import Scripted, ending_model, episode_document

    model = ending_model(tmp_path / "model")
    document = episode_document(recipe_document, model, step_timeout_s=0.5)
    document["ppo"].update(batch_size=4, minibatch_size=4)
    trainer = make_trainer(document, builtin_registry)
    eos = trainer.components.policy.eos_token_ids[0]
    trainer.components = attrs.evolve(trainer.components, environment=Reports(), generator=Scripted([[eos]], eos))
    figures = [{"solved": 1.0, "rare": 2.0}, {}, {}, {}] + [{"solved": 1.0}] + [{"solved": 0.0}] * 3
    records = [{"prompt": f"game {i}", "secret": 1, "figures": f, "hangs": i == 7} for i, f in enumerate(figures)]
    evaluator = Evaluator(trainer.recipe, trainer.engine, trainer.components, trainer.context,
                          attrs.evolve(trainer.prompts, held_out=records))
    with pytest.warns(EnvironmentFault, match="did not return within"):
        outcomes = evaluator()
    assert outcomes["eval/solved"] == pytest.approx(2 / 5)
    assert (outcomes["eval/rare"], outcomes["eval/status_ok"], outcomes["eval/hung_calls"]) == (2.0, 7 / 8, 1.0)
