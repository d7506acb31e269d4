"""The benchmark's arithmetic and plumbing (no speed is asserted: see CONTRIBUTING.md)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_ppo.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_ppo", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_iteration_flops_by_hand():
    bench = load_bench()
    config = SimpleNamespace(n_embd=2, n_layer=1, vocab_size=3)
    flops = bench.iteration_flops(config, batch=1, prompt=1, response=1, epochs=1)
    # per token: layers 2·12·2²·1 = 96; per attended key 4·2·1 = 8; LM head 2·2·3 = 12.
    # A 2-token sequence: 96·2 + 8·(1 + 2) keys + 12 at the one response position = 228.
    # Generation runs the model on the prompt only (the sampled last token is never fed back):
    # 96 + 8·1 + 12 = 116. Forward = old + reference = 2·228; train = forward + backward = 3·228.
    assert flops == {"generate": 116, "forward": 456, "train": 684}


def test_a_tiny_run_prints_every_figure(capsys, monkeypatch):
    bench = load_bench()
    monkeypatch.setattr(sys, "argv", ["bench_ppo.py", "--steps", "2", "--batch", "16", "--response-len", "4", "--threads", "1",
                                      "--width", "32", "--layers", "1", "--heads", "2", "--peak-tflops", "1"])
    bench.main()
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report["seconds_in"]) == {"generate", "score", "forward", "train", "tracking"}
    assert report["seconds_per_iteration"] >= sum(report["seconds_in"].values()) * 0.99
    assert float(report["flops_per_iteration"]["total"]) > 0 and report["floor_seconds"] > 0
    assert report["ratio_to_floor"] > 1 and report["cpu_ratio_to_floor"] > 1  # the floor counts the matrix multiplies only
    assert 0 < report["train_mfu"] < 1 and report["peak_rss_mib"] > 0 and report["cpu_seconds_per_iteration"] > 0


def load_robustness():
    spec = importlib.util.spec_from_file_location("robustness", BENCH.parent / "robustness.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_robustness_figures_and_summary_by_hand():
    robustness = load_robustness()
    history = [{"score/mean": float(i)} for i in range(10)] + [{"eval/score": 1.0}]
    # the tail is the last max(5, 10%) training iterations: 5..9, mean 7
    assert robustness.figures("control", history)["train_score_tail"] == 7.0
    rows = [{"seed": s, "x": x} for s, x in enumerate([0.9, 0.5, 1.0, 0.7])]
    summary = robustness.summary("control", "rlkit", "x", rows, 3, [])
    assert (summary["mean"], summary["median"], summary["worst"]) == (0.775, 0.8, 0.5)


def test_robustness_runs_a_warm_started_task_over_two_seeds(tmp_path, monkeypatch):
    robustness = load_robustness()
    monkeypatch.setattr(robustness, "WARM_START_STEPS", 3)
    tiny = ["ppo.batch_size=4", "ppo.minibatch_size=4", "ppo.epochs=1", "run.threads=1"]
    report = robustness.run_task("warm-target", [0, 1], 1, tiny, history_dir=tmp_path)
    assert [row["seed"] for row in report["runs"]] == [0, 1] and report["figure"] == "train_score_tail"
    assert 0 <= report["worst"] <= report["median"] <= 1 and report["worst"] <= report["mean"]
    first = [json.loads(line) for line in (tmp_path / "warm-target_seed0.jsonl").read_text().splitlines()]
    assert len(first) == 1 and "train/grad_clipped" in first[0] and "advantage/raw_std" in first[0]
    assert robustness.peer_settings(robustness.TASKS["warm-target"][0](0, tmp_path / "files", 2))["vf_coef"] == 1.2


def test_curves_figures_by_hand(tmp_path, capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("curves", BENCH.parent / "curves.py")
    curves = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(curves)
    # 30 iterations: KL 6 except 12 at iterations 20..24 and 1 at 25; score 1 for 1..3, 2 for 28..30, 1.5 between
    rows = [{"iteration": 0, "eval/score": 1.0}]
    for i in range(1, 31):
        kl = 12.0 if 20 <= i <= 24 else 1.0 if i == 25 else 6.0
        rows.append({"iteration": i, "score/mean": 1.0 if i <= 3 else 2.0 if i >= 28 else 1.5, "kl/ref": kl, "kl/beta": 0.05})
    rows.append({"iteration": 30, "eval/score": 1.3})
    f = curves.figures(rows, target=6.0)
    assert f["evaluations"] == [1.0, 1.3] and abs(f["gain"] - 0.3) < 1e-12
    assert f["last_over_first"] == 1.0  # the last 3 iterations (10%) at 2 against the first 3 at 1
    assert f["in_band"] == 5 / 11  # iterations 20..30: 12 five times and 1 once lie outside 3..9
    assert f["kl_window_max"] == 12.0  # iterations 20..24
    assert f["kl"] == [6.0, 6.0, 12.0, 6.0] and len(f["beta"]) == 4  # iterations 1, 10, 20, 30
    run = tmp_path / "runs" / "seed0"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(sys, "argv", ["curves.py", f"after={tmp_path / 'runs'}@6", "--plot", str(tmp_path / "curves.png")])
    curves.main()
    assert "| after | seed0 | 1.000 → 1.300 | +30.0% | +100.0% | 45% | 12.0 |" in capsys.readouterr().out
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_the_ragged_shape_stops_at_the_models_own_eos_and_counts_padding(capsys, monkeypatch, tmp_path):
    import argparse

    import torch
    from transformers import GPT2LMHeadModel

    bench = load_bench()
    shape = argparse.Namespace(shape="ragged", seed=0, vocab=384, width=32, layers=1, heads=2, positions=256)
    model = GPT2LMHeadModel.from_pretrained(bench.write_model(tmp_path / "model", shape))
    with torch.no_grad():
        logits = model(torch.randint(3, 259, (4, 64))).logits
    lift = (logits[..., 1] - logits.mean(dim=-1)).mean()  # EOS above the other tokens, at every position
    assert abs(float(lift) - bench.RAGGED["eos_lift"]) < 0.5

    monkeypatch.setattr(sys, "argv", ["bench_ppo.py", "--shape", "ragged", "--model-dir", str(tmp_path / "model"), "--steps", "2",
                                      "--batch", "16", "--threads", "1", "--width", "32", "--layers", "1", "--heads", "2"])
    bench.main()
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 16 <= report["mean_prompt_tokens"] <= 256 and 4 <= report["mean_response_tokens"] < 100  # EOS ended most responses
    padding = report["padding_share"]
    assert padding["forward"]["before"] > 0.3  # about half of a padded batch
    for phase in ("forward", "train"):
        assert padding[phase]["after"] < padding[phase]["before"], phase


def test_the_episodes_benchmark_times_turns_against_one_long_turn(recipe_document, builtin_registry, tmp_path):
    from tests.test_episodes import ending_model, episode_document
    from tests.test_trainer import make_trainer

    spec = importlib.util.spec_from_file_location("episodes_bench", BENCH.with_name("episodes.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    trainer = make_trainer(episode_document(recipe_document, ending_model(tmp_path / "ending")), builtin_registry)
    figures = module.turns_against_one(trainer, repeats=1)
    assert figures["sampled_tokens"] > 0 and figures["rendered_tokens"] > 0 and figures["episode_token_budget"] == 120
    assert figures["one_turn_tokens"] >= figures["sampled_tokens"] / len(trainer.stream.batch(0))
    assert figures["ratio"] == pytest.approx(figures["episodes_seconds"] / figures["one_turn_seconds"], rel=0.02)  # of unrounded seconds
    assert trainer.components.generator.config.max_new_tokens == 6  # the generator's settings are put back


def test_the_async_benchmark_serves_its_reward_with_the_delay_it_was_given():
    import time

    from rlkit_plugins.reward_services import HttpReward, HttpRewardConfig

    spec = importlib.util.spec_from_file_location("async_bench", BENCH.with_name("async_throughput.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    server, url = module.reward_server(0.4)
    try:
        reward = HttpReward(HttpRewardConfig(url=url, timeout=10.0, retries=0))
        started = time.monotonic()
        scores = reward.score(["p"], ["The pilot cooked boxes in Berlin."], reference=["The pilot cooked boxes in Berlin."])
        assert time.monotonic() - started >= 0.4 and scores == [1.5]  # ROUGE-1 F1 1, and the fact's bonus 0.5
    finally:
        server.terminate()
        server.wait()
    assert set(module.RECIPES) == set(module.HELD_OUT) and all(path.is_file() for path in module.RECIPES.values())


@pytest.mark.slow
def test_the_trl_tool_task_scores_the_peers_saves_with_rlkits_own_evaluation(tmp_path):
    """benchmarks/trl_tool_task.py on a tiny warm start, two rounds of TRL with rlkit's update: each
    save is scored, and its round 0 (the warm start, untrained) scores exactly what rlkit's own run
    of the recipe scores before its first update."""
    import subprocess

    pytest.importorskip("trl")
    small = [f'policy.cache_dir="{tmp_path / "cache"}"', "policy.n_embd=32", "policy.n_head=2", "policy.sft_steps=4",
             "policy.sft_examples=16", "policy.sft_batch_size=4", "eval.size=8"]
    script = BENCH.with_name("trl_tool_task.py")
    done = subprocess.run([sys.executable, str(script), "--update", "rlkit", "--rounds", "2", "--every", "1", "--out", str(tmp_path / "peer"),
                           *(f"--set={value}" for value in small)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"update"')]
    assert [line["round"] for line in lines[:-1]] == [0, 1, 2] and lines[-1]["median_seconds_a_round"] > 0
    assert all(0.0 <= line["eval/solved"] <= 1.0 for line in lines[:-1])
    rlkit = Path(sys.executable).with_name("rlkit")
    ran = subprocess.run([str(rlkit), "run", str(BENCH.parents[1] / "recipes" / "ppo_tool_qwen3.toml"), "--quiet", "--set=run.steps=1", "--set=run.threads=1",
                          f"--set=run.output_dir={tmp_path / 'run'}", "--set=tracker.type=none", *(f"--set={value}" for value in small)],
                         capture_output=True, text=True, timeout=900)
    assert ran.returncode == 0, ran.stderr[-3000:]
    before = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert before["iteration"] == 0 and lines[0]["eval/solved"] == before["eval/solved"] and lines[0]["eval/score"] == before["eval/score"]


def test_the_client_floor_benchmark_sends_every_request_and_prices_them():
    """Two agents of three requests through the real `openai` client and server stack; the share is
    the per-request milliseconds times the iteration's requests over its seconds."""
    import subprocess

    pytest.importorskip("openai")
    script = BENCH.with_name("openai_client_floor.py")
    done = subprocess.run([sys.executable, str(script), "--agents", "2", "--requests", "3", "--rounds", "1", "--per-iteration", "500",
                           "--iteration-s", "1.0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout)
    assert figures["agents"] == 2 and figures["requests_each"] == 3 and figures["wall_ms_per_request"] > 0
    assert figures["share_of_an_iteration"] == pytest.approx(figures["wall_ms_per_request"] * 500 / 1000, abs=2e-3)


GPU_RUN = BENCH.with_name("gpu_run.py")


def test_the_flop_count_reads_a_model_folders_own_layers(tmp_path):
    from rlkit_core.testing.offline_models import write_qwen_model

    bench = load_bench()
    model = write_qwen_model(tmp_path / "qwen", "tiny", dtype=torch.float32)
    config = bench.flop_config(SimpleNamespace(model_dir=str(model)))
    # width 64, 4 heads of 16, 2 KV heads (k and v 64 → 32), MLP 128: q 64·64 + k 64·32 + v 64·32 + o 64·64
    # + gate, up, down 3·64·128 = 4096 + 2048 + 2048 + 4096 + 24576 = 36864 matrix weights a layer
    assert (config.layer_weights, config.attention_width, config.n_layer, config.vocab_size) == (36864, 64, 2, 512)


def test_the_wide_tokenizer_decodes_every_id_and_encodes_a_token_a_byte():
    from rlkit_core.testing.offline_models import build_wide_chatml_tokenizer

    tokenizer = build_wide_chatml_tokenizer(1000)
    assert len(tokenizer) == 1000 and tokenizer.decode([999]) == "w999"
    assert len(tokenizer("héllo").input_ids) == 6  # é is two bytes
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert rendered.startswith("<|im_start|>user")


@pytest.mark.slow
def test_the_gpu_run_runs_every_step_on_a_cpu(tmp_path):
    """benchmarks/gpu_run.py end to end on tiny shapes: every step records its measures, and each is ok."""
    out = tmp_path / "out"
    command = [sys.executable, str(GPU_RUN), "--device", "cpu", "--out", str(out), "--work", str(tmp_path / "work")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    lines = [json.loads(line) for line in (out / "gpu_run.jsonl").read_text().splitlines()]
    assert [line for line in lines if line["status"] != "ok"] == [] and done.returncode == 0, done.stderr[-2000:]
    steps = {line["step"]: line for line in lines}
    assert list(steps) == ["install", "model", "pytest", "rlkit:ppo-full", "rlkit:ppo-lora-ckpt",
                           "rlkit:grpo-full-ckpt", "rlkit:grpo-lora", "bench:standard", "bench:ragged", "episodes",
                           "fsdp", "ddp", "total"]
    assert steps["pytest"]["counts"]["skipped"] == 3 and "failed" not in steps["pytest"]["counts"]  # no CUDA here
    for name in ("rlkit:ppo-full", "rlkit:grpo-lora", "fsdp", "ddp"):
        assert steps[name]["seconds_per_iteration"] > 0 and steps[name]["tokens_per_second_in"]["generate"] > 0
        assert steps[name]["estimate_peak_mib"] > 0
    assert steps["fsdp"]["processes"] == steps["ddp"]["processes"] == 2
    assert steps["bench:standard"]["train_vs_matmul"] > 0
    assert steps["bench:ragged"]["padding_share"]["train"]["after"] is not None
    assert steps["episodes"]["turns_vs_one"]["ratio"] > 0 and steps["episodes"]["turns"] > 1
