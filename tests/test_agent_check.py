"""`rlkit check` on an agent recipe plays a few episodes as a run would (the policy's generator, the
harness, the endpoint, `EpisodeRunner`) and reports what each did to the training samples: merged
turns and splits (the harness's history rewrites apart from the template's), tool-call round trips,
refusals, status and reward, and whether each sample's ids are its conversation rendered at once.
A harness that rewrites the history on every turn is named with its cost; one that fails is a
problem with its status and reason."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlkit_core.runtime import agent_check
from rlkit_core.runtime.cli import main
from rlkit_core.runtime.episodes import EnvironmentFault
from rlkit_core.testing.offline_models import write_tiny_model
from tests.test_agents import PROMPT, RECORDS, agent_trainer, harness, turn_ids
from tests.test_episodes import render_ids

pytest.importorskip("openai")


ROOT = Path(__file__).resolve().parents[1]


def played(recipe_document, registry, chatml, name: str, text: str, **environment):
    """The checks of two episodes of the harness `name`, the model answering `text` every turn."""
    path, tokenizer = chatml
    trainer = agent_trainer(recipe_document, registry, path, tokenizer, [turn_ids(tokenizer, text)], **harness(name), **environment)
    checks = agent_check.play(trainer.engine, trainer.components, trainer.recipe, RECORDS)
    return checks, agent_check.describe(checks, f"tests.agent_harnesses:{name}", False)


@pytest.mark.parametrize("barrier", [True, False], ids=["turn-barrier", "as-ready"])
def test_a_harness_that_keeps_the_conversation_makes_one_sample_its_render(recipe_document, builtin_registry, chatml, barrier):
    checks, lines = played(recipe_document, builtin_registry, chatml, "talk", "7", turn_barrier=barrier)
    c = checks[0]
    assert (c.status, c.reward, c.requests, c.refused, c.rewrites, c.turns, c.merged, c.splits) == ("ok", 1.0, 3, 0, 0, 3, 2, 0)
    assert [s.matches for s in c.samples] == [True]
    assert "  turns             3: 2 merged into the stream, 0 started a new sample (0 by history rewrites of the harness, 0 by the chat " \
           "template)" in lines
    assert lines[-1] == "harness             kept the conversation as the endpoint returned it in each of its 4 later turn(s)"


def test_a_harness_that_rewrites_the_history_every_turn_is_named_with_its_cost(recipe_document, builtin_registry, chatml):
    """`forgetful` drops the model's turn before its second request: each turn is a sample of its
    own, the second's prompt the changed conversation rendered again."""
    checks, lines = played(recipe_document, builtin_registry, chatml, "forgetful", "7")
    _, tokenizer = chatml
    again = len(render_ids(tokenizer, [{"role": "user", "content": PROMPT}, {"role": "user", "content": "again"}], generation_prompt=True))
    for c in checks:
        assert (c.rewrites, c.splits, c.template_splits, c.merged, c.every_turn_rewritten) == (1, 1, 0, 0, True)
        assert all(s.matches for s in c.samples) and c.rendered_again == again
    assert lines[-1].startswith("harness             REWRITES THE HISTORY ON EVERY TURN: tests.agent_harnesses:forgetful changed what "
                                "came before in each of its 2 later turn(s), so every turn starts a training sample of its own: 4 samples "
                                f"for 2 episode(s), one an episode when turns extend the stream; {2 * again} prompt ids rendered again")


def test_a_harness_that_rewrites_some_turns_is_counted_not_named(recipe_document, builtin_registry, chatml):
    checks, lines = played(recipe_document, builtin_registry, chatml, "summarises", "7")
    assert [(c.turns, c.rewrites, c.merged, c.splits) for c in checks] == [(3, 1, 1, 1)] * 2
    assert lines[-1].startswith("harness             changed the history in 2 of its 4 later turn(s)")


def test_tool_calls_answered_by_their_ids_are_round_trips(recipe_document, builtin_registry, chatml):
    path, tokenizer = chatml
    call = turn_ids(tokenizer, '<tool_call>\n{"name": "lookup", "arguments": {"word": "fig"}}\n</tool_call>')
    trainer = agent_trainer(recipe_document, builtin_registry, path, tokenizer, [call, turn_ids(tokenizer, "done")], **harness("tool_user"))
    c = agent_check.play(trainer.engine, trainer.components, trainer.recipe, RECORDS)[0]
    assert (c.tool_calls, c.tool_results, c.turns, c.merged, c.splits) == (1, 1, 2, 1, 0)
    assert c.samples[0].matches


def test_calls_the_model_wrote_unreadably_are_counted_per_episode(recipe_document, builtin_registry, chatml):
    """As env/unreadable_tool_calls counts them in a run: answered as text, with `tool_call_error`."""
    path, tokenizer = chatml
    bad = turn_ids(tokenizer, '<tool_call>\n{"name": "lookup", "arguments": {"word": }\n</tool_call>')
    call = turn_ids(tokenizer, '<tool_call>\n{"name": "lookup", "arguments": {"word": "fig"}}\n</tool_call>')
    turns = [bad, call, turn_ids(tokenizer, "done")]
    trainer = agent_trainer(recipe_document, builtin_registry, path, tokenizer, turns, max_episode_tokens=800,
                            **harness("tells_unreadable_calls"))
    checks = agent_check.play(trainer.engine, trainer.components, trainer.recipe, RECORDS)
    assert [(c.status, c.turns, c.unreadable, c.tool_calls, c.tool_results) for c in checks] == [("ok", 3, 1, 1, 1)] * 2
    lines = agent_check.describe(checks, "tells_unreadable_calls", False)
    assert ("  tool calls        1 made by the model, 1 answered by the harness with a tool result, 1 unreadable "
            "(answered as text, with choices[0].tool_call_error)") in lines


@pytest.mark.parametrize("kept", [False, True], ids=["rendered", "kept"])
def test_the_templates_splits_are_told_apart_and_a_stream_kept_as_sampled_differs_from_the_render(recipe_document, builtin_registry,
                                                                                                   chatml, kept):
    """The chatml template strips earlier think blocks: as rendered, each later turn starts a sample
    (the template's split, not the harness's) equal to its render; kept as sampled, one sample goes
    on with a think block the render of its conversation has not, and the check says where."""
    setting = {"thinking_in_history": "kept"} if kept else {}
    checks, lines = played(recipe_document, builtin_registry, chatml, "talk", "<think>hm</think>7", **setting)
    c = checks[0]
    assert (c.rewrites, c.splits, c.template_splits) == ((0, 0, 0) if kept else (0, 2, 2))
    if not kept:
        assert all(s.matches for s in c.samples)
        return
    [sample] = c.samples
    assert not sample.matches and "the sample has '<think>'" in sample.parting
    assert f"sample 1's ids are not its conversation rendered at once ({sample.parting})" in lines[4]


@pytest.mark.parametrize(("name", "status", "said"), [
    ("raises", "error", "the environment's step raised HarnessFailed: the harness raised ValueError: the harness broke"),
    ("never_asks", "error", "the environment's reset raised HarnessFailed: the harness ended before its first request: it sent none"),
    ("hangs", "timeout", "the environment's step timed out: the harness neither sent a request nor ended within 1.9 s "
                         "(environment.step_timeout_s = 2 s)"),
])
def test_a_harness_that_fails_is_a_problem_with_its_status_and_reason(recipe_document, builtin_registry, chatml, name, status, said):
    with pytest.warns(EnvironmentFault, match=re.escape(said.split(": ", 1)[1])):  # as a run warns of it
        checks, _ = played(recipe_document, builtin_registry, chatml, name, "7", step_timeout_s=2.0)
    problems = agent_check.failures(checks)
    assert [c.status for c in checks] == [status] * 2 and len(problems) == 2
    assert problems[0].startswith(f"$.environment: agent episode 1 of 2 (record 1 of the data) ended with status {status}: {said}")
    assert problems[0].endswith(f"a run keeps such episodes out of training (env/status_{status})")


def test_a_commands_start_is_timed_as_a_run_starts_it(recipe_document, builtin_registry, chatml, tmp_path, monkeypatch):
    """As many commands launched at once as a run launches (a batch's 16 episodes, at most
    max_starting = 3), each timed from its launch to its first request; one past start_timeout_s is a
    problem at that setting."""
    monkeypatch.setenv("RLKIT_TEST_AGENT_LOG", str(tmp_path))
    path, tokenizer = chatml

    def starts(start_s: str, budget: float):
        monkeypatch.setenv("RLKIT_TEST_START_S", start_s)
        trainer = agent_trainer(dict(recipe_document), builtin_registry, path, tokenizer, [turn_ids(tokenizer, "7")], start_timeout_s=budget,
                                max_starting=3, command=[sys.executable, str(ROOT / "tests" / "agent_harnesses.py"), "slow_start"])
        return agent_check.command_starts(trainer.recipe, trainer.components, RECORDS)

    lines, problems = starts("0", 60.0)
    assert problems == [] and len(list(tmp_path.glob("*.start"))) == 3
    assert lines[0].startswith("command start       3 launched at once as a run launches them (a batch's 16 episodes, "
                               "environment.max_starting = 3 at a time): ")
    assert lines[0].endswith(" s from launch to first request, within environment.start_timeout_s = 60 s")
    lines, problems = starts("30", 1.0)
    assert lines == [] and problems == ["$.environment.start_timeout_s: 3 of 3 commands launched at once as a run launches them (a batch's "
                                        "16 episodes, environment.max_starting = 3 at a time) sent no first request within 1 s of their launch; "
                                        "in a run such episodes end as timeouts before their first turn: raise "
                                        "environment.start_timeout_s, or lower environment.max_starting"]


def agent_recipe(recipe_document, write_recipe, model: Path | str, name: str) -> str:
    recipe_document["policy"]["model"] = str(model)
    recipe_document.pop("reward")
    recipe_document["environment"] = {"type": "agent", "harness": f"tests.agent_harnesses:{name}", "max_turns": 3, "step_timeout_s": 60.0}
    recipe_document["data"] = {"type": "guess-number-games", "size": 8, "seed": 0}
    return write_recipe(recipe_document)


def test_an_agent_recipe_is_told_by_its_environments_class(recipe_document, builtin_registry, chatml):
    from rlkit_core.recipe.document import parse_recipe

    path, tokenizer = chatml
    agent = agent_trainer(recipe_document, builtin_registry, path, tokenizer, [[1]], **harness("talk")).recipe
    game = parse_recipe({**recipe_document, "environment": {"type": "guess-number"}}, builtin_registry)
    assert agent_check.is_agent_recipe(agent) and not agent_check.is_agent_recipe(game)


def test_no_agent_episodes_builds_no_policy_and_resets_once(recipe_document, write_recipe, chatml, monkeypatch, capsys):
    """The data's first record through `reset` alone, as for any environment; the session it
    opened (the harness waiting on its first answer) is closed."""
    from rlkit_core.endpoint import agent_endpoint

    def agent_episodes(*args):
        raise AssertionError("--agent-episodes 0 plays nothing")

    monkeypatch.setattr(agent_check, "agent_episodes", agent_episodes)
    monkeypatch.setenv("RLKIT_PLUGINS", "none")
    open_before = set(agent_endpoint().sessions)
    assert main(["check", agent_recipe(recipe_document, write_recipe, chatml[0], "talk"), "--agent-episodes", "0"]) == 0
    out = capsys.readouterr().out
    assert "reset               on the first record of the data: 1 opening message(s), ok" in out and "agent episodes" not in out
    assert set(agent_endpoint().sessions) == open_before


def ending_model(path: Path) -> Path:
    """The tiny chatml policy made to end every turn at once (`<|im_end|>` the only likely token):
    through the real generator, each turn is known without a script. The residual stream's first
    dimension is held at 100 (the embeddings set it, no layer writes it), and only `<|im_end|>`'s
    output row reads it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    write_tiny_model(path, "chatml")
    model, end = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path).convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 100.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[end, 0] = 100.0
    model.save_pretrained(path)
    return path


@pytest.mark.slow
def test_rlkit_check_plays_an_agent_recipe_and_names_a_forgetful_harness(recipe_document, write_recipe, tmp_path):
    model = ending_model(tmp_path / "ending")

    def check(name: str):
        env = {**os.environ, "RLKIT_PLUGINS": "none"}
        return subprocess.run([sys.executable, "-m", "rlkit_core.runtime.cli", "check", agent_recipe(dict(recipe_document), write_recipe,
                                                                                                     model, name)],
                              capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)

    done = check("forgetful")
    assert done.returncode == 0, done.stderr
    episodes = done.stdout[done.stdout.index("\nepisodes:"):done.stdout.index("\ncode this recipe runs")]
    assert "  agent episodes      2, on the data's first 2 record(s)" in episodes
    assert "  episode 2:          status ok, reward 0.5 (the harness's)" in episodes
    assert "    turns             2: 0 merged into the stream, 1 started a new sample (1 by history rewrites of the harness" in episodes
    assert "each one's ids are its conversation rendered at once" in episodes
    assert "REWRITES THE HISTORY ON EVERY TURN: the harness tests.agent_harnesses:forgetful changed" in episodes
    failed = check("raises")
    assert failed.returncode == 2 and failed.stdout == ""
    assert ("$.environment: agent episode 1 of 2 (record 1 of the data) ended with status error: the environment's step raised "
            "HarnessFailed: the harness raised ValueError: the harness broke") in failed.stderr
    assert "Traceback" not in failed.stderr


@pytest.mark.slow
def test_rlkit_check_fails_a_command_that_cannot_start_within_its_budget(recipe_document, write_recipe, tmp_path):
    """A command whose first request comes 4 s after its imports, with start_timeout_s = 2: a run's
    episodes would all time out before their first turn, and the check says so (exit 2)."""
    recipe_document["policy"]["model"] = str(ending_model(tmp_path / "ending"))
    recipe_document.pop("reward")
    recipe_document["environment"] = {"type": "agent", "command": [sys.executable, str(ROOT / "tests" / "agent_harnesses.py"), "slow_start"],
                                      "max_turns": 3, "start_timeout_s": 2.0, "max_starting": 2}
    recipe_document["data"] = {"type": "guess-number-games", "size": 8, "seed": 0}
    env = {**os.environ, "RLKIT_PLUGINS": "none", "RLKIT_TEST_START_S": "4"}
    done = subprocess.run([sys.executable, "-m", "rlkit_core.runtime.cli", "check", write_recipe(recipe_document)], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=300)
    assert done.returncode == 2 and done.stdout == "", done.stderr[-3000:]
    assert ("$.environment.start_timeout_s: 2 of 2 commands launched at once as a run launches them (a batch's 16 episodes, "
            "environment.max_starting = 2 at a time) sent no first request within 2 s of their launch") in done.stderr


def test_offline_a_hub_model_not_in_the_cache_plays_no_episode_and_says_so(recipe_document, write_recipe, tmp_path):
    """Not the recipe's fault: `rlkit check --offline` on an agent recipe whose model only the hub has
    notes why no episode was played, and the check passes (a process of its own: the hub library
    reads HF_HUB_OFFLINE once, when it is first imported)."""
    env = {**os.environ, "RLKIT_PLUGINS": "none", "HF_HUB_CACHE": str(tmp_path / "empty-cache")}
    path = agent_recipe(recipe_document, write_recipe, "rlkit-tests/no-such-model", "talk")
    done = subprocess.run([sys.executable, "-m", "rlkit_core.runtime.cli", "check", path, "--offline"], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "$.policy: no agent episode played: 'rlkit-tests/no-such-model' is a hub name not in the local cache" in done.stdout
