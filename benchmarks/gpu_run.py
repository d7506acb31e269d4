"""The GPU run (issue 64) in one script: every step a child process with a time limit, every measure one
JSON line, on stdout and in `OUT/gpu_run.jsonl`; a step that fails records its error and the rest go on.

    python3 benchmarks/gpu_run.py --device cuda --wheels .gpu-wheels --out "$OUT"   # one H100, no network: < 8 min
    python benchmarks/gpu_run.py --device cpu --out /tmp/gpu-run                     # the same steps, tiny shapes

On `cuda` the model is a random-initialised Qwen2 of Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads,
2 KV heads, MLP 4864, tied 151,936-row embedding: 494 M parameters), built from its config in bfloat16 with
`offline_models.build_wide_chatml_tokenizer`: ChatML's specials and template over 151,936 ids (bytes, then
fillers that only sampling produces), so the LM head costs what the real one does and every sampled id decodes.
On `cpu` the same architecture with 2 layers, width 64 and 512 ids. Steps (benchmarks/README.md, "The GPU run"):

1. install: the wheels of `benchmarks/gpu_wheels.sh`, offline, then rlkit editable, no dependencies;
2. model: the model folder and the recipes; 3. pytest: `pytest -m gpu` (tests/test_gpu.py);
4. rlkit: `rlkit run` of PPO and GRPO with the `hf` generator, full weights and LoRA, gradient checkpointing
   on and off, each a few iterations: tokens/s per phase, time per iteration, peak memory against `rlkit check`'s;
5. bench: bench_ppo.py on the model, standard shape (MFU against the chip's peak and an in-process matmul),
   then ragged (packed, GPU-sized token budgets); 6. episodes: episodes.py, 4 turns against one;
7. fsdp and ddp: one iteration each under `accelerate launch` (CPU: two gloo processes under torchrun).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve()
PEAK_TFLOPS = 989.0  # H100 / H200 SXM, dense bf16, by the datasheet
# per device: the model's size, the runs' shape, and each step's time limit (seconds)
SHAPES = {
    "cuda": {"size": "0.5b", "dtype": "bfloat16", "batch": 32, "minibatch": 16, "response": 64, "prompt": (32, 96),
             "steps": 3, "budget": 470, "mean_length": 16, "turn": 48},
    "cpu": {"size": "tiny", "dtype": "float32", "batch": 16, "minibatch": 8, "response": 8, "prompt": (8, 24),
            "steps": 2, "budget": 1500, "mean_length": 4, "turn": 12},
}
# the `rlkit run` variants: (name, GRPO, LoRA, gradient checkpointing): each option on and off at least once
VARIANTS = [("ppo-full", False, False, False), ("ppo-lora-ckpt", False, True, True),
            ("grpo-full-ckpt", True, False, True), ("grpo-lora", True, True, False)]
PHASES = ("generate", "score", "forward", "train")


def count_e(prompts, responses, **columns):
    """The runs' reward: the count of the letter e (a random model's fillers hold none: rewards are mostly 0)."""
    return [float(r.count("e") + r.count("w1")) for r in responses]


class Recorder:
    """One JSON line per measure, printed and appended to the output file as it comes."""

    def __init__(self, path: Path):
        self.path, self.failed = path, []
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")

    def __call__(self, record: dict) -> None:
        line = json.dumps(record)
        if record.get("status") == "failed":
            self.failed.append(record["step"])
        print(line, flush=True)
        with self.path.open("a") as out:
            out.write(line + "\n")


def child(command: list[str], limit: float, environment: dict | None = None) -> tuple[int, list[dict], str]:
    """(exit code, the JSON lines it printed, its output's tail); 124 when it ran out of time."""
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=limit,
                              env={**os.environ, "PYTHONUNBUFFERED": "1", **(environment or {})})
        code, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        code = 124
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
    lines = []
    for line in out.splitlines():
        if line.startswith("{"):
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    error_at = err.find("Traceback")  # a process's own traceback, before a launcher's
    tail = (err[error_at:error_at + 2000] + "\n...\n" if error_at >= 0 else "") + (out + err)[-2000:]
    return code, lines, tail


class Run:
    """The steps, in order, under one deadline."""

    def __init__(self, args):
        self.args, self.shape = args, SHAPES[args.device]
        self.cuda = args.device == "cuda"
        # not under OUT, which comes back from the device: the model is large
        self.work = Path(args.work or Path(tempfile.gettempdir()) / "rlkit-gpu-run")
        self.model = self.work / "model"
        self.record = Recorder(Path(args.out) / "gpu_run.jsonl")
        self.deadline = time.monotonic() + (args.budget or self.shape["budget"])
        self.python = sys.executable

    def step(self, name: str, limit: float, measure) -> None:
        """Run `measure(limit)` (a list of records, or an exception) and record each with the step's status."""
        left = self.deadline - time.monotonic()
        if self.args.only and name.split(":")[0] not in self.args.only.split(","):
            return
        if left < 15:
            self.record({"step": name, "status": "skipped", "reason": f"out of time ({left:.0f} s left)"})
            return
        started = time.monotonic()
        try:
            records = measure(min(limit, left - 5))
        except Exception as exc:  # noqa: BLE001 - a step's failure is recorded, the rest still run
            tail = getattr(exc, "tail", "")
            self.record({"step": name, "status": "failed", "seconds": round(time.monotonic() - started, 1),
                         "error": f"{type(exc).__name__}: {exc}"[-1000:], "tail": tail[-3000:]})
            return
        for record in records:
            status = record.pop("status", "ok")
            self.record({"step": name, "status": status, "seconds": round(time.monotonic() - started, 1), **record})

    def checked(self, command: list[str], limit: float, environment: dict | None = None) -> list[dict]:
        code, lines, tail = child(command, limit, environment)
        if code:
            failure = RuntimeError(f"exit {code}{' (time limit)' if code == 124 else ''}: {shlex.join(command)[-300:]}")
            failure.tail = tail  # type: ignore[attr-defined]
            raise failure
        return lines

    # -- the steps ----------------------------------------------------------------------------------------------

    def install(self, limit: float) -> list[dict]:
        installed = []
        if self.args.wheels:
            wheels = sorted(str(w) for w in Path(self.args.wheels).glob("*.whl"))
            pip = [self.python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-cache-dir",
                   "--disable-pip-version-check"]
            if wheels:
                self.checked([*pip, *wheels], limit)
                installed = [Path(w).name for w in wheels]
            self.checked([*pip, "--no-build-isolation", "-e", str(ROOT)], limit)
            installed.append("rlkit (editable)")
        versions = self.checked([self.python, str(HERE), "_environment"], limit)
        return [{"installed": installed, **versions[-1]}]

    def prepare(self, limit: float) -> list[dict]:
        return self.checked([self.python, str(HERE), "_prepare", str(self.work), "--device", self.args.device], limit)

    def pytest(self, limit: float) -> list[dict]:
        pytest = [self.python, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_gpu.py"]
        code, _, tail = child(pytest, limit)
        summary = [line for line in tail.splitlines() if " passed" in line or " skipped" in line or " failed" in line]
        last = summary[-1].strip("= ") if summary else ""  # "2 passed, 1 skipped in 3.1s"
        parts = [part.split()[:2] for part in last.split(" in ")[0].split(", ") if part[:1].isdigit()]
        counts = {word: int(number) for number, word in parts}
        record = {"measure": "pytest -m gpu", "counts": counts, "summary": last,
                  "skips": [line for line in tail.splitlines() if line.startswith("SKIPPED")][:5]}
        if code:
            record.update(status="failed", tail=tail[-3000:])
        return [record]

    def rlkit_run(self, variant: str, limit: float, launch: list[str] | None = None, environment: dict | None = None,
                  measure: str = "rlkit run", tag: str = "") -> list[dict]:
        recipe = self.work / "recipes" / f"{variant}.toml"
        output = self.work / "runs" / (tag or variant)
        prompt_tokens = str(self.shape["prompt"][1])
        command = [*(launch or [self.python]), str(HERE), "_rlkit", str(recipe), str(output), prompt_tokens]
        lines = self.checked(command, limit, environment)
        figures = iteration_figures(output / "metrics.jsonl", self.shape["batch"])
        printed = {k: v for line in lines for k, v in line.items()}
        return [{"measure": measure, "variant": variant, **figures, **printed}]

    def bench(self, limit: float, ragged: bool) -> list[dict]:
        # the standard shape samples every response to its length (min_new_tokens): the model that seldom ends
        model = self.model if ragged else self.work / "model-plain"
        command = [self.python, "benchmarks/bench_ppo.py", "--model-dir", str(model), "--device", self.args.device,
                   "--dtype", self.shape["dtype"], "--generator", "hf"]
        if self.cuda:
            command += ["--steps", "3", "--batch", "64", "--response-len", "128",
                        "--peak-tflops", str(self.args.peak_tflops)]
            if ragged:
                command += ["--max-tokens-per-microbatch", "8192", "--max-tokens-per-forward", "16384"]
        else:
            command += ["--steps", "2", "--batch", "16", "--minibatch", "8", "--response-len", "8", "--threads", "1",
                        "--peak-tflops", "1"]
        if ragged:
            command += ["--shape", "ragged"]
        report = self.checked(command, limit)[-1]
        keep = ("seconds_per_iteration", "response_tokens_per_second", "seconds_in", "tokens_per_second_in",
                "mean_prompt_tokens", "mean_response_tokens", "train_tflops", "matmul_peak_tflops", "train_mfu",
                "train_vs_matmul", "estimate_peak_mib", "peak_gpu_memory_mib", "check_logprob_gap", "padding_share",
                "max_tokens_per_microbatch", "max_tokens_per_forward", "pack_sequences", "flops_per_iteration",
                "peak_rss_mib")
        return [{"measure": "bench_ppo " + ("ragged" if ragged else "standard"),
                 "peak_tflops": self.args.peak_tflops if self.cuda else None, **{k: report.get(k) for k in keep}}]

    def episodes(self, limit: float) -> list[dict]:
        command = [self.python, "benchmarks/episodes.py", "--model", str(self.model), "--device", self.args.device,
                   "--dtype", self.shape["dtype"], "--max-turns", "4", "--steps", "1",
                   "--output-dir", str(self.work / "runs" / "episodes")]
        command += ["--max-new-tokens", str(self.shape["turn"])]
        command += (["--batch", "64", "--episode-tokens", "768", "--repeats", "2"] if self.cuda else
                    ["--batch", "16", "--episode-tokens", "384", "--repeats", "1", "--threads", "1"])
        report = self.checked(command, limit)[-1]
        ratio = report["turns_vs_one"]["ratio"]
        return [{"measure": "episodes: 4 turns against one", "target_ratio": 1.3, "met": ratio <= 1.3, **report}]

    def distributed(self, kind: str, limit: float) -> list[dict]:
        variant = "ppo-full-1"  # one iteration
        if self.cuda:
            config = ROOT / "configs" / "accelerate" / f"{kind}.yaml"
            launch = [self.python, "-m", "accelerate.commands.launch", "--config_file", str(config),
                      "--num_processes", "1"]
            return self.rlkit_run(variant, limit, launch, measure=f"{kind} (accelerate launch, 1 GPU, NCCL)", tag=kind)
        torchrun = [self.python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        if kind == "ddp":
            return self.rlkit_run(variant, limit, torchrun, measure="ddp (torchrun, 2 CPU processes, gloo)", tag=kind)
        environment = self.checked([self.python, str(HERE), "_fsdp_environment"], limit)[-1]
        return self.rlkit_run(variant, limit, [*torchrun, str(ROOT / "tests" / "fsdp_on_cpu.py")], environment,
                              measure="fsdp (torchrun, 2 CPU processes, gloo)", tag=kind)

    def all(self) -> None:
        limits = {"install": 120, "model": 90, "pytest": 90, "rlkit": 75, "bench": 100, "episodes": 90, "dist": 60}
        if not self.cuda:
            limits = {k: 4 * v for k, v in limits.items()}
        self.step("install", limits["install"], self.install)
        self.step("model", limits["model"], self.prepare)
        self.step("pytest", limits["pytest"], self.pytest)
        for name, *_ in VARIANTS:
            self.step(f"rlkit:{name}", limits["rlkit"], lambda limit, name=name: self.rlkit_run(name, limit))
        self.step("bench:standard", limits["bench"], lambda limit: self.bench(limit, ragged=False))
        self.step("bench:ragged", limits["bench"], lambda limit: self.bench(limit, ragged=True))
        self.step("episodes", limits["episodes"], self.episodes)
        self.step("fsdp", limits["dist"], lambda limit: self.distributed("fsdp", limit))
        self.step("ddp", limits["dist"], lambda limit: self.distributed("ddp", limit))


def iteration_figures(metrics_path: Path, batch: int) -> dict:
    """From a run's metrics.jsonl: medians over the iterations after the first (all, if one), response tokens/s
    of each phase, seconds per iteration, the log-prob gap to the trainer and the push check's where one ran."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    steady = rows[1:] or rows
    def median(key):
        values = [r[key] for r in steady if isinstance(r.get(key), (int, float))]
        return round(statistics.median(values), 6) if values else None
    tokens = median("response/length")
    tokens = None if tokens is None else tokens * batch
    phases = {phase: median(f"time/{phase}") for phase in PHASES}
    return {"iterations": len(rows), "seconds_per_iteration": median("time/iteration"),
            "response_tokens_per_iteration": tokens,
            "tokens_per_second_in": {p: round(tokens / s, 1) if tokens and s else None for p, s in phases.items()},
            "seconds_in": {p: None if s is None else round(s, 4) for p, s in phases.items()},
            "check_logprob_gap": median("check/logprob_gap"),
            "push_gap": median("check/push_gap")}  # None: no push check (only a vLLM server's pushes are checked)


# -- the children: what runs in a fresh process ---------------------------------------------------------------


def environment_report() -> None:
    import importlib.metadata as metadata

    import torch

    names = ("torch", "transformers", "accelerate", "peft", "cattrs", "attrs", "pluggy", "tokenizers", "mlflow",
             "rlkit")
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    from rlkit_core.recipe.plugins import load_registry

    registry = load_registry()
    cuda = torch.cuda.is_available()
    print(json.dumps({"measure": "environment", "python": sys.version.split()[0], "versions": versions,
                      "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0) if cuda else None,
                      "bf16": cuda and torch.cuda.is_bf16_supported(), "components": len(registry.all()),
                      "broken_plugins": sorted(registry.broken)}))


def prepare(work: Path, device: str) -> None:
    """The model folders (`model` ends after about `mean_length` tokens, `model-plain` seldom: the standard shape
    forbids the end token until its length, which the other would show as a log-prob gap), the prompts and one
    recipe per `rlkit run` variant (and `ppo-full-1`, one iteration)."""
    import torch

    from rlkit_core.testing import recipe_toml
    from rlkit_core.testing.offline_models import write_qwen_model

    shape = SHAPES[device]
    started = time.monotonic()
    built_on = "cuda" if device == "cuda" and torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, shape["dtype"])
    model = write_qwen_model(work / "model", shape["size"], device=built_on, dtype=dtype,
                             mean_length=shape["mean_length"])
    written = time.monotonic() - started
    write_qwen_model(work / "model-plain", shape["size"], device=built_on, dtype=dtype)
    rng = random.Random(0)
    low, high = shape["prompt"]
    prompts = work / "prompts.jsonl"
    with prompts.open("w") as out:
        for _ in range(shape["batch"] * (shape["steps"] + 1)):
            text = "".join(chr(rng.randint(33, 126)) for _ in range(rng.randint(low, high)))
            out.write(json.dumps({"prompt": text}) + "\n")
    (work / "recipes").mkdir(parents=True, exist_ok=True)
    for name, grpo, lora, checkpointing in [*VARIANTS, ("ppo-full-1", False, False, False)]:
        document = {
            "run": {"steps": 1 if name.endswith("-1") else shape["steps"], "seed": 0,
                    "output_dir": str(work / "runs" / name), "device": device, "threads": 0 if device == "cuda" else 1},
            "ppo": {"batch_size": shape["batch"], "minibatch_size": shape["minibatch"], "epochs": 2},
            "optim": {"learning_rate": 1e-5, "max_grad_norm": 1.0},
            "policy": {"type": "hf", "model": str(model), "dtype": shape["dtype"],
                       "gradient_checkpointing": checkpointing, "lora_r": 16 if lora else 0},
            "generator": {"type": "hf", "max_new_tokens": shape["response"], "temperature": 1.0},
            "reward": {"type": "python", "function": f"{HERE}:count_e"},
            "data": {"type": "jsonl", "path": str(prompts)},
            "tracker": {"type": "none"},  # mlflow is not in the wheel bundle (benchmarks/gpu_wheels.sh)
        }
        if grpo:
            document["ppo"].update(samples_per_prompt=4, kl_penalty="loss")
            document["value_head"] = {"type": "none"}
            document["advantage"] = {"type": "grpo"}
            document["loss"] = {"type": "ppo-clip", "aggregation": "seq-mean-token-mean"}
        (work / "recipes" / f"{name}.toml").write_text(recipe_toml(document))
    config = json.loads((model / "config.json").read_text())
    parameters = sum(p.numel() for p in _meta_model(model).parameters())
    print(json.dumps({"measure": "model", "architecture": config["architectures"][0], "size": shape["size"],
                      "parameters": parameters, "mean_length": shape["mean_length"], "hidden": config["hidden_size"],
                      "layers": config["num_hidden_layers"], "vocab": config["vocab_size"],
                      "dtype": shape["dtype"], "built_on": built_on, "write_seconds": round(written, 1)}))


def _meta_model(folder: Path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))


def rlkit_child(recipe: str, output_dir: str, prompt_tokens: int) -> int:
    """`rlkit run` in this process (any launcher's), after `rlkit check`'s memory estimate; then torch's peak."""
    import torch

    from rlkit_core.launch import Launch
    from rlkit_core.recipe.document import load_recipe
    from rlkit_core.recipe.plan import memory_parts
    from rlkit_core.recipe.plugins import load_registry
    from rlkit_core.runtime.cli import main as rlkit

    launch = Launch.from_environment()
    overrides = [f"run.output_dir={output_dir}"]
    parts = memory_parts(load_recipe(recipe, load_registry(), overrides, launch), prompt_tokens, launch)
    if parts is not None and int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"processes": launch.processes, "estimate_peak_mib": round(parts[0]["peak"] / 2**20),
                          "estimate_mib": {k: round(v / 2**20) for k, v in parts[0].items()}}), flush=True)
    code = rlkit(["run", recipe, "--quiet", "--overwrite", "--set", overrides[0]])
    from accelerate.state import PartialState  # what the run's Accelerator set up (one process: several end inside it)

    state = PartialState._shared_state
    peak = round(torch.cuda.max_memory_allocated() / 2**20) if torch.cuda.is_available() else None
    print(json.dumps({"distributed_type": str(state.get("distributed_type")), "backend": state.get("backend"),
                      "peak_gpu_memory_mib": peak}), flush=True)
    return code


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1].startswith("_"):  # a child
        kind, rest = sys.argv[1], sys.argv[2:]
        if kind == "_environment":
            environment_report()
        elif kind == "_prepare":
            prepare(Path(rest[0]), rest[2])
        elif kind == "_rlkit":
            sys.exit(rlkit_child(rest[0], rest[1], int(rest[2])))
        elif kind == "_fsdp_environment":
            sys.path.insert(0, str(ROOT / "tests"))
            from fsdp_on_cpu import launch_environment

            print(json.dumps(launch_environment()))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the same steps on tiny shapes")
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu-run"), help="gpu_run.jsonl's folder ($OUT)")
    parser.add_argument("--work", default="", help="the model, recipes and runs (default: TMPDIR/rlkit-gpu-run)")
    parser.add_argument("--wheels", default="", help="install these wheels offline, then rlkit (gpu_wheels.sh)")
    parser.add_argument("--budget", type=float, default=0, help="seconds for all steps (default: 470 cuda, 1500 cpu)")
    parser.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS, help="the chip's dense bf16 peak (train_mfu)")
    parser.add_argument("--only", default="", help="these steps: install,model,pytest,rlkit,bench,episodes,fsdp,ddp")
    args = parser.parse_args()
    started = time.monotonic()
    run = Run(args)
    run.all()
    run.record({"step": "total", "status": "ok", "seconds": round(time.monotonic() - started, 1), "device": args.device,
                "failed": run.record.failed})
    sys.exit(1 if run.record.failed else 0)


if __name__ == "__main__":
    main()
