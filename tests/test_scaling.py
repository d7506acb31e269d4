"""Scaling out: several processes, gradient accumulation, mixed precision.

Several processes on a CPU are two gloo ranks under torchrun, which accelerate's `Accelerator`
picks up as it does under `accelerate launch` on GPUs. Those tests and the mixed-precision ones
start real subprocesses (accelerate's settings are fixed once per process), so the model is tiny
and the runs are one or two iterations."""

import io
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import attrs
import distributed_worker
import fsdp_on_cpu
import pytest
import torch

from rlkit_core.errors import RlkitError, RunError
from rlkit_core.recipe.document import parse_recipe
from rlkit_core.runtime import checkpoint
from rlkit_core.runtime.run import run_recipe
from rlkit_core.runtime.trainer import Trainer
from tests.test_trainer import advantages_with, rollout_with, update_with

WORKER = Path(__file__).with_name("distributed_worker.py")


FSDP_ON_CPU = Path(__file__).with_name("fsdp_on_cpu.py")


def torchrun(*args: str, processes: int = 2, environment: dict | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, **(environment or {})})
    first_error = done.stderr.find("Traceback")  # a process's own, before the launcher's
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[first_error:first_error + 3000] + done.stderr[-1000:]
    return done


def rlkit_script() -> str:
    return str(Path(sys.executable).with_name("rlkit"))


@pytest.fixture(params=["full", "lora-separate-critic-accumulating", "padless-gpt2-separate-critic",
                        "grpo-sequence-mean-kl-loss-accumulating", "token-budgets", "packed-separate-critic", "episodes",
                        "episodes-turn-lambda-target-kl"])
def two_process_document(request, recipe_document, tiny_reward_model, tmp_path):
    # one minibatch per epoch: one process's minibatch of 16 is two processes' minibatches of 8
    recipe_document["ppo"].update({"batch_size": 16, "minibatch_size": 16})
    if request.param == "grpo-sequence-mean-kl-loss-accumulating":  # groups over processes; per-response averages of the loss and KL
        recipe_document["ppo"].update({"samples_per_prompt": 4, "gradient_accumulation_steps": 2, "kl_penalty": "loss"})
        recipe_document["advantage"] = {"type": "grpo"}
        recipe_document["loss"] = {"type": "ppo-clip", "aggregation": "seq-mean-token-mean"}
    if request.param == "lora-separate-critic-accumulating":  # DDP's no_sync and the global token count together
        recipe_document["ppo"]["gradient_accumulation_steps"] = 2
        recipe_document["policy"]["lora_r"] = 4
        recipe_document["value_head"] = {"type": "separate", "model": str(tiny_reward_model)}
    if request.param == "token-budgets":  # micro-batches of a few rollouts each, as many in every process; global token counts
        recipe_document["ppo"].update({"max_tokens_per_microbatch": 40, "max_tokens_per_forward": 60})
    if request.param == "packed-separate-critic":  # several rollouts a row, in the policy's and the critic's passes
        recipe_document["ppo"].update({"pack_sequences": True, "max_tokens_per_microbatch": 60, "max_tokens_per_forward": 100})
        recipe_document["value_head"] = {"type": "separate", "model": str(tiny_reward_model)}
    if request.param.startswith("episodes"):  # multi-turn episodes of guess-number, environment tokens inside the rows
        from tests.test_episodes import ending_model, episode_document

        episode_document(recipe_document, ending_model(tmp_path / "ending"))
    if request.param == "episodes-turn-lambda-target-kl":  # λ between turns; every process ends the update at the same step
        recipe_document["advantage"] = {"type": "gae", "lam": 0.9, "lam_per_turn": True}
        recipe_document["ppo"]["target_kl"] = 1e-7
    if request.param == "padless-gpt2-separate-critic":  # an added, suppressed PAD and a critic that never sees it
        from rlkit_core.testing.offline_models import write_tiny_model

        recipe_document["policy"]["model"] = str(write_tiny_model(tmp_path / "gpt2-style", "gpt2"))
        recipe_document["value_head"] = {"type": "separate", "model": str(write_tiny_model(tmp_path / "critic", "gpt2", classifier=True))}
    return recipe_document


@pytest.mark.slow
def test_two_processes_make_one_update_identical_everywhere(two_process_document, tmp_path):
    assert assert_two_processes_update_as_one(two_process_document, tmp_path, WORKER)["held"] == 1  # DDP: every weight everywhere


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["full", "separate-critic-checkpointing", "lora", "bf16", "padless-gpt2", "packed-token-budgets"])
def test_two_fsdp_processes_make_the_update_of_one(variant, recipe_document, tiny_reward_model, tmp_path):
    """FSDP2 shards the policy's blocks, the rest of it and the critic over two processes; the
    update must still be the one a single process makes on the whole batch (with LoRA the
    reference is the sharded base with the adapters off)."""
    recipe_document["ppo"].update({"batch_size": 16, "minibatch_size": 16, "gradient_accumulation_steps": 2})
    if variant == "separate-critic-checkpointing":  # and the blocks recomputed inside FSDP's backward
        recipe_document["value_head"] = {"type": "separate", "model": str(tiny_reward_model)}
        recipe_document["policy"]["gradient_checkpointing"] = True
    if variant == "lora":
        recipe_document["policy"]["lora_r"] = 4
    if variant == "packed-token-budgets":  # FSDP's gathers pair up only if every process runs as many micro-batches
        recipe_document["ppo"].update({"gradient_accumulation_steps": 1, "max_tokens_per_microbatch": 40, "max_tokens_per_forward": 60,
                                       "pack_sequences": True})
    if variant == "padless-gpt2":  # the added PAD row is sharded with the embedding and stays suppressed
        from rlkit_core.testing.offline_models import write_tiny_model

        recipe_document["policy"]["model"] = str(write_tiny_model(tmp_path / "gpt2-style", "gpt2"))
    if variant == "bf16":  # float32 shards and gathered weights, bf16 compute under autocast, as without FSDP
        recipe_document["run"]["mixed_precision"] = "bf16"
    fsdp = fsdp_on_cpu.launch_environment()
    # bf16 rounds differently when the batch is split: Adam's normalised steps then differ by up to
    # about the learning rate (1e-3) for weights whose gradient is near zero
    two = assert_two_processes_update_as_one(recipe_document, tmp_path, FSDP_ON_CPU, "worker", environment=fsdp,
                                             **({"weights": 5e-3, "metrics": 2e-2} if variant == "bf16" else {}))
    assert 0.45 < two["held"] < 0.55  # sharded: each process holds about half (a tensor's odd row goes to the first)
    assert two["computed_in"] == ["torch.bfloat16" if variant == "bf16" else "torch.float32"]


def assert_two_processes_update_as_one(document, tmp_path, *launch, environment=None, weights=1e-5, metrics=1e-4):
    document_path = tmp_path / "document.json"
    document_path.write_text(json.dumps(document))
    torchrun(*map(str, launch), str(document_path), str(tmp_path), processes=2, environment=environment)
    if document["run"].get("mixed_precision", "no") == "no":
        distributed_worker.main(str(document_path), str(tmp_path))  # one process: this one
    else:  # accelerate fixes the precision once per process
        done = subprocess.run([sys.executable, str(WORKER), str(document_path), str(tmp_path)], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    two = json.loads((tmp_path / "result-2.json").read_text())
    one = json.loads((tmp_path / "result-1.json").read_text())

    assert two["agreed"] == [True, True]  # after the shared update and after an iteration
    weights_two, weights_one = torch.tensor(two["weights"]), torch.tensor(one["weights"])
    assert (weights_one - torch.tensor(one["start"])).abs().max() > 1e-3  # the update did move the weights
    apart = (weights_one - weights_two).abs().max()
    assert apart < weights, f"two processes updated differently from one on the same global batch (max diff {apart})"
    for name, value in one["metrics"].items():  # every logged training metric is the global one
        assert two["metrics"][name] == pytest.approx(value, rel=metrics, abs=metrics / 100), name
    return two


@pytest.mark.slow
def test_two_process_run_writes_once_and_resumes_exactly(recipe_document, write_recipe, tmp_path):
    output_dir = tmp_path / "run"
    recipe_document["run"].update({"output_dir": str(output_dir), "checkpoint_every": 1})
    recipe_document["tracker"] = {"type": "mlflow", "uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    recipe_document["eval"] = {"size": 8, "every": 1, "greedy": False}  # sampled: it draws random numbers too
    recipe = write_recipe(recipe_document)
    torchrun(rlkit_script(), "run", recipe, "--quiet")

    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in rows] == [0, 1, 2]  # the held-out evaluation before training, then each iteration
    assert all("eval/kl" in row for row in rows)
    assert sorted(p.name for p in (output_dir / "checkpoints").iterdir()) == ["iter_000001", "iter_000002"]
    meta = json.loads((output_dir / "checkpoints" / "iter_000002" / "meta.json").read_text())
    assert meta["processes"] == 2
    with sqlite3.connect(tmp_path / "mlflow.db") as db:
        assert db.execute("select count(*) from runs").fetchone()[0] == 1
        assert db.execute("select value from params where key = 'processes'").fetchall() == [("2",)]

    # Interrupted after iteration 1, then resumed with --resume auto: the same metrics.
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(output_dir, resumed_dir)
    shutil.rmtree(resumed_dir / "checkpoints" / "iter_000002")
    recipe_document["run"]["output_dir"] = str(resumed_dir)
    recipe_document["tracker"] = {"type": "none"}
    torchrun(rlkit_script(), "run", write_recipe(recipe_document, "resumed.toml"), "--quiet", "--resume", "auto")
    resumed = [json.loads(line) for line in (resumed_dir / "metrics.jsonl").read_text().splitlines()]
    assert without_timing(resumed) == without_timing(rows)


@pytest.mark.slow
@pytest.mark.parametrize("barrier", [True, False], ids=["turn-barrier", "as-ready"])
def test_two_fsdp_processes_play_episodes_of_uneven_lengths(recipe_document, write_recipe, tmp_path, barrier):
    """Multi-turn episodes under FSDP: every process gathers the weights once a rollout, however
    many turns and generations its own episodes take (with the barrier and without, where each
    process serves its turns as they come), so neither waits on a gather the other never makes."""
    from tests.test_episodes import ending_model, episode_document

    output_dir = tmp_path / "run"
    episode_document(recipe_document, ending_model(tmp_path / "ending"), turn_barrier=barrier)
    recipe_document["run"].update({"output_dir": str(output_dir), "steps": 2})
    torchrun(str(FSDP_ON_CPU), "rlkit", "run", write_recipe(recipe_document), "--quiet", environment=fsdp_on_cpu.launch_environment())
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in rows if "score/mean" in row] == [1, 2]
    assert all(row["env/turns"] > 1 for row in rows if "score/mean" in row)


@pytest.mark.slow
def test_two_fsdp_processes_checkpoint_their_shards_and_resume_exactly(recipe_document, write_recipe, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    output_dir = tmp_path / "run"
    recipe_document["run"].update({"output_dir": str(output_dir), "checkpoint_every": 1})
    recipe_document["tracker"] = {"type": "mlflow", "uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    recipe_document["eval"] = {"size": 8, "every": 1, "greedy": False}  # sampled: generation and the no-grad passes
    fsdp = fsdp_on_cpu.launch_environment()
    torchrun(str(FSDP_ON_CPU), "rlkit", "run", write_recipe(recipe_document), "--quiet", environment=fsdp)

    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in rows] == [0, 1, 2] and all("eval/kl" in row for row in rows)
    with sqlite3.connect(tmp_path / "mlflow.db") as db:
        assert db.execute("select count(*) from runs").fetchone()[0] == 1
    last = output_dir / "checkpoints" / "iter_000002"
    assert sorted(p.name for p in last.parent.iterdir()) == ["iter_000001", "iter_000002"]
    assert json.loads((last / "meta.json").read_text())["sharded"] is True
    shards = sorted(p.name for p in (last / "state").rglob("*.distcp"))
    assert len(shards) == 4  # weights and optimiser state, one file from each process
    listed = json.loads((last / "manifest.json").read_text())["files"]  # every process's shards, verified on resume
    assert sorted(n for n in listed if n.endswith(".distcp")) == sorted(p.relative_to(last).as_posix() for p in (last / "state").rglob("*.distcp"))
    assert "optimizer" not in torch.load(last / "trainer.pt", weights_only=False)  # the optimiser state is in the shards
    # the final model is whole: every weight loads, equal to the (gathered) weights of the last checkpoint
    final = AutoModelForCausalLM.from_pretrained(output_dir / "final_model").state_dict()
    for name, value in load_file(last / "policy.safetensors").items():
        assert torch.equal(final[name], value), name

    resumed_dir = tmp_path / "resumed"
    shutil.copytree(output_dir, resumed_dir)
    shutil.rmtree(resumed_dir / "checkpoints" / "iter_000002")
    recipe_document["run"]["output_dir"] = str(resumed_dir)
    recipe_document["tracker"] = {"type": "none"}
    torchrun(str(FSDP_ON_CPU), "rlkit", "run", write_recipe(recipe_document, "resumed.toml"), "--quiet", "--resume", "auto",
             environment=fsdp)
    resumed = [json.loads(line) for line in (resumed_dir / "metrics.jsonl").read_text().splitlines()]
    assert without_timing(resumed) == without_timing(rows)

    # a sharded checkpoint cannot be resumed without sharding, nor the other way round
    with pytest.raises(subprocess.CalledProcessError) as refused:
        subprocess.run([rlkit_script(), "run", write_recipe(recipe_document, "resumed.toml"), "--quiet", "--resume", "auto"],
                       check=True, capture_output=True, text=True, timeout=300)
    assert "written under FSDP (configs/accelerate/fsdp.yaml) and this run is launched without sharding" in refused.value.stderr


def without_timing(table: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in table]


def test_a_checkpoint_resumes_only_with_the_number_of_processes_that_wrote_it(recipe_document, builtin_registry, tmp_path):
    recipe_document["run"].update(steps=1, output_dir=str(tmp_path / "run"))
    run_recipe(parse_recipe(recipe_document, builtin_registry), quiet=True, out=io.StringIO())
    meta_path = tmp_path / "run" / "checkpoints" / "iter_000001" / "meta.json"
    meta = json.loads(meta_path.read_text())
    assert meta["processes"] == 1
    meta_path.write_text(json.dumps({**meta, "processes": 2}))
    checkpoint.write_manifest(meta_path.parent)  # as a two-process run would have written it, not damaged
    recipe_document["run"]["steps"] = 2
    with pytest.raises(RlkitError, match="written by 2 processes and this run has 1; resume with 2 processes"):
        run_recipe(parse_recipe(recipe_document, builtin_registry), quiet=True, resume="auto", out=io.StringIO())


@pytest.mark.parametrize("steps, aggregation", [(2, "token-mean"), (4, "token-mean"), (2, "seq-mean-token-mean"),
                                               (4, "seq-mean-token-sum-norm")])
def test_gradient_accumulation_gives_the_same_update(recipe_document, builtin_registry, steps, aggregation):
    recipe_document["loss"] = {"type": "ppo-clip", "aggregation": aggregation, "entropy_coef": 0.01}
    if aggregation != "token-mean":  # the β·KL the loop adds aggregates as the loss does
        recipe_document["ppo"]["kl_penalty"] = "loss"

    def update(accumulation):
        document = {table: dict(body) for table, body in recipe_document.items()}
        document["ppo"].update({"minibatch_size": 16, "batch_size": 16, "gradient_accumulation_steps": accumulation})
        trainer = Trainer(parse_recipe(document, builtin_registry))
        gradients = []  # the summed gradient each optimiser step sees
        trainer.engine.optimizer.optimizer.register_step_pre_hook(
            lambda *_: gradients.append(torch.cat([p.grad.flatten() for p in trainer.engine.parameters])))
        torch.manual_seed(5)
        batch = advantages_with(trainer, rollout_with(trainer, trainer.stream.batch(0))[0])
        metrics = update_with(trainer, batch)
        return gradients, metrics

    whole_gradients, whole_metrics = update(1)
    split_gradients, split_metrics = update(steps)
    assert len(whole_gradients) == len(split_gradients) == 2  # two epochs of one minibatch
    for whole, split in zip(whole_gradients, split_gradients):
        assert whole.abs().max() > 1e-3
        assert (whole - split).abs().max() < 1e-6 * whole.abs().max()
    for name, value in whole_metrics.items():
        assert split_metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name


MIXED_PRECISION_SCRIPT = """
import json, math, sys
import torch
from rlkit_core.launch import Launch
from rlkit_core.recipe.document import parse_recipe
from rlkit_core.recipe.plugins import load_registry
from rlkit_core.runtime.trainer import Trainer

launch = Launch.from_environment()
trainer = Trainer(parse_recipe(json.loads(sys.argv[1]), load_registry(environ={"RLKIT_PLUGINS": "none"}), launch=launch), launch=launch)
seen = set()
trainer.components.policy.model.lm_head.register_forward_hook(lambda module, args, out: seen.add(str(out.dtype)))
metrics = [trainer.step() for _ in range(2)]
print(json.dumps({"dtypes": sorted(seen), "weights": sorted({str(p.dtype) for p in trainer.engine.parameters}),
                  "finite": all(math.isfinite(v) for m in metrics for v in m.values()),
                  "logprob_gap": metrics[0]["check/logprob_gap"]}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_autocasts_with_float32_weights(recipe_document, precision):
    if precision == "fp16" and not torch.cuda.is_available():
        pytest.skip("fp16 autocast needs a GPU; on a CPU rlkit refuses it (see test_recipe) and accelerate would run float32")
    recipe_document["run"]["mixed_precision"] = precision
    done = subprocess.run([sys.executable, "-c", MIXED_PRECISION_SCRIPT, json.dumps(recipe_document)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    low = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[precision]
    assert result["dtypes"] == [low]  # every forward pass (sampling, π_old, the update) autocasts
    assert result["weights"] == ["torch.float32"]  # master weights stay float32
    assert result["finite"]
    assert result["logprob_gap"] < 0.1  # the sampler and π_old see the same precision


@pytest.mark.parametrize("name, engine", [("ddp", "MULTI_GPU"), ("fsdp", "FSDP")])
def test_the_shipped_configs_are_ones_accelerate_reads(name, engine):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(Path(__file__).parents[1] / "configs" / "accelerate" / f"{name}.yaml"))
    assert config.distributed_type.value == engine
    assert config.mixed_precision == "no"  # the recipe's run.mixed_precision decides (see launch_problems)
    if name == "fsdp":
        assert config.fsdp_config["fsdp_version"] == 2  # what rlkit runs (see rlkit_core.recipe.launch.sharding_problems)
        environment = fsdp_on_cpu.launch_environment()  # what accelerate launch sets from it
        assert environment["ACCELERATE_USE_FSDP"] == "true" and environment["FSDP_VERSION"] == "2"


@pytest.mark.slow
def test_fsdp_on_cpus_is_refused_at_start_as_accelerate_would_run_ddp(recipe_document, write_recipe):
    done = subprocess.run([rlkit_script(), "run", write_recipe(recipe_document), "--quiet"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **fsdp_on_cpu.launch_environment()})
    assert done.returncode == 1, done.stderr[-2000:]
    assert "accelerate runs FSDP on GPUs only and chose NO here" in done.stderr
    assert not (Path(recipe_document["run"]["output_dir"]) / "metrics.jsonl").exists()


def test_fsdp_needs_a_critic_that_is_one_module():
    from rlkit_core.interfaces import ValueHead
    from rlkit_core.runtime.distributed import critic_problem

    class Parameters(ValueHead):  # a head that is not one module
        def values(self, *args):
            return None

        def parameters(self):
            return []

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    assert critic_problem(None) is None
    assert "Parameters is not one module" in critic_problem(Parameters())


def test_memory_estimate_against_hand_computed_bytes():
    from rlkit_core.memory import ModelShape, Workload, estimate

    shape = ModelShape(parameters=1000, trainable=100, layers=2, hidden=8, heads=2, vocab=10, weight_bytes=4, reference_copy=True)
    work = Workload(micro_batch=2, forward_batch=4, generate_batch=4, prompt_tokens=3, response_tokens=5,
                    checkpointing=False, mixed_precision="no")
    # 8 tokens; a layer keeps 2·8·8·(34 + 5·2·8/8)·4/2 = 11264 bytes for a micro-batch of 2
    assert estimate(shape, work) == {
        "weights": 1000 * 4 * 2, "gradients": 400, "optimiser": 800,
        "update": 2 * 11264 + (2 * 2 * 8 * 10 * 4 + 4 * 2 * 5 * 10 * 4),
        "forward": 2 * 4 * 8 * 10 * 4 + 2 * 4 * 5 * 10 * 4,
        "generate": 2 * 2 * 4 * 8 * 8 * 4 + 4 * 4 * 10 * 4,  # KV cache; 4 copies of one step's [4, 10] scores
        "peak": 9200 + 22528 + 2880,
    }
    checkpointed = estimate(shape, attrs.evolve(work, checkpointing=True))
    assert checkpointed["update"] == 2 * 2 * 8 * 8 * 4 + 11264 + 2880  # layer inputs, one layer in full, the head
    # FSDP over 2 processes: half the policy, gradients and AdamW state; the reference copy whole;
    # the other half gathered for generation and the no-grad passes, one block (of 2) in the update
    sharded = estimate(shape, attrs.evolve(work, shards=2))
    assert sharded == {
        "weights": 2000 + 4000, "gradients": 200, "optimiser": 400,
        "update": 25408 + 2000, "forward": 4160 + 2000, "generate": 4736 + 2000,
        "peak": 6600 + 27408,
    }


@pytest.mark.slow
def test_rlkit_check_plans_for_the_accelerate_config_it_is_given(recipe_document, write_recipe):
    done = subprocess.run([rlkit_script(), "check", write_recipe(recipe_document), "--accelerate-config",
                           str(fsdp_on_cpu.FSDP_CONFIG)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "processes           2, each with 8 rollouts" in done.stdout  # the config's num_processes
    assert "FSDP2: weights, gradients and optimiser state sharded" in done.stdout
    assert "FSDP over 2 processes" in done.stdout
    recipe_document["policy"]["dtype"] = "bfloat16"
    done = subprocess.run([rlkit_script(), "check", write_recipe(recipe_document), "--accelerate-config",
                           str(fsdp_on_cpu.FSDP_CONFIG), "--num-processes", "4"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "$.policy.dtype: 'bfloat16' weights are not run under FSDP" in done.stderr


def test_generation_in_chunks_pads_every_chunk_to_the_longest(recipe_document, builtin_registry, monkeypatch):
    from rlkit_core.interfaces import Generation

    recipe_document["generator"]["batch_size"] = 2
    trainer = Trainer(parse_recipe(recipe_document, builtin_registry))
    generator, pad = trainer.components.generator, trainer.components.policy.tokenizer.pad_token_id

    def fake(prompt_ids, prompt_mask, greedy):  # the first chunk stops after 1 token, the second after 3
        width = 1 if prompt_ids[0, -1] == 10 else 3
        rows = len(prompt_ids)
        return Generation(response_ids=torch.full((rows, width), 7), response_mask=torch.ones(rows, width, dtype=torch.long),
                          logprobs=torch.full((rows, width), -0.5))

    monkeypatch.setattr(generator, "_generate", fake)
    prompts = torch.tensor([[10], [10], [11], [11]])
    out = generator.generate(prompts, torch.ones_like(prompts))
    assert out.response_ids.tolist() == [[7, pad, pad], [7, pad, pad], [7, 7, 7], [7, 7, 7]]
    assert out.response_mask.tolist() == [[1, 0, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]]
    assert out.logprobs.tolist() == [[-0.5, 0, 0], [-0.5, 0, 0], [-0.5] * 3, [-0.5] * 3]


def test_an_fsdp_without_the_state_rlkit_reads_is_refused_by_name():
    """FSDP2's per-unit parameter groups are private torch state; a torch that moved them is refused
    with a message naming the version, not with an AttributeError from deep inside a run."""
    from rlkit_core.runtime.distributed import _reshards_after_forward

    class MovedState:
        def _get_fsdp_state(self):
            return object()

    with pytest.raises(RunError, match=r"torch .*FSDP2 no longer keeps"):
        _reshards_after_forward(MovedState())
