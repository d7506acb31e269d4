"""rlkit against the peer (TRL 0.11.4 classic PPOTrainer) on the standard shape, in one sitting.

    bash benchmarks/peer/setup.sh                    # once: the peer's own virtual environment
    python benchmarks/compare.py                     # 3 runs each, alternating, 3 iterations a run
    python benchmarks/compare.py --rounds 5 --threads 1
    python benchmarks/compare.py --shape ragged --threads 1   # the ragged shape: one model folder, both sides load it

Runs `bench_ppo.py` (this interpreter) and `peer/trl_classic.py` (the peer's interpreter) in
turns, each in a fresh process, swapping which goes first every round so that a change in the
machine's load falls on both alike. Prints every run with the load average before it, then the
median seconds per iteration of each system and the ratio of the medians (peer / rlkit: above 1,
rlkit is faster), the same for the CPU time of each process (steadier than the wall clock when
other work shares the cores, at one thread), and rlkit's median ratio to the compute floor,
measured in its own runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(command: list[str]) -> dict:
    """The JSON line a benchmark prints last; its stderr is shown only when it fails."""
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="runs of each system (at least 3 for a median worth reading)")
    parser.add_argument("--steps", type=int, default=3, help="iterations per run; the first is warm-up")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--response-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shape", default="standard", choices=["standard", "ragged"])
    default_peer = Path(os.environ.get("PEER_VENV", HERE / "peer" / ".venv")) / "bin" / "python"
    parser.add_argument("--peer-python", default=str(default_peer), help="the peer environment's interpreter (benchmarks/peer/setup.sh)")
    args = parser.parse_args()
    if not Path(args.peer_python).exists():
        sys.exit(f"no peer interpreter at {args.peer_python}; run `bash benchmarks/peer/setup.sh` first (or pass --peer-python)")

    with tempfile.TemporaryDirectory() as folder:
        compare(args, folder)


def compare(args, folder: str) -> None:
    shape = ["--steps", str(args.steps), "--batch", str(args.batch), "--response-len", str(args.response_len), "--threads", str(args.threads),
             "--shape", args.shape]
    if args.shape == "ragged":  # the warm-started weights, written once: both sides sample from the same model
        sys.path.insert(0, str(HERE))
        from bench_ppo import write_model

        write_model(Path(folder) / "model", argparse.Namespace(shape="ragged", seed=0, vocab=384, width=256, layers=4, heads=4, positions=256))
        shape += ["--model-dir", str(Path(folder) / "model")]
    commands = {
        "rlkit": [sys.executable, str(HERE / "bench_ppo.py"), *shape],
        "peer": [args.peer_python, str(HERE / "peer" / "trl_classic.py"), *shape],
    }
    results = {"rlkit": [], "peer": []}
    print(f"{'run':>3}  {'system':<6} {'load':>5}  {'s/iter':>7}  {'cpu s':>7}  {'tokens/s':>8}  phases (s)", flush=True)
    for number in range(args.rounds):
        order = ("rlkit", "peer") if number % 2 == 0 else ("peer", "rlkit")
        for system in order:
            load = os.getloadavg()[0]
            result = run(commands[system])
            result["load_before"] = load
            results[system].append(result)
            phases = " ".join(f"{name} {seconds:.2f}" for name, seconds in result["seconds_in"].items())
            print(f"{number + 1:>3}  {system:<6} {load:>5.2f}  {result['seconds_per_iteration']:>7.3f}  {result['cpu_seconds_per_iteration']:>7.3f}  "
                  f"{result['response_tokens_per_second']:>8.1f}  {phases}", flush=True)

    median = {system: statistics.median(r["seconds_per_iteration"] for r in rows) for system, rows in results.items()}
    cpu = {system: statistics.median(r["cpu_seconds_per_iteration"] for r in rows) for system, rows in results.items()}
    summary = {
        "shape": args.shape, "rounds": args.rounds, "steps": args.steps, "batch": args.batch, "response_len": args.response_len, "threads": args.threads,
        "rlkit_seconds_per_iteration": median["rlkit"],
        "peer_seconds_per_iteration": median["peer"],
        "speedup_over_peer": round(median["peer"] / median["rlkit"], 3),
        "rlkit_cpu_seconds_per_iteration": cpu["rlkit"],
        "peer_cpu_seconds_per_iteration": cpu["peer"],
        "cpu_speedup_over_peer": round(cpu["peer"] / cpu["rlkit"], 3),
        "rlkit_response_tokens_per_second": statistics.median(r["response_tokens_per_second"] for r in results["rlkit"]),
        "peer_response_tokens_per_second": statistics.median(r["response_tokens_per_second"] for r in results["peer"]),
        "rlkit_peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in results["rlkit"]),
        "peer_peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in results["peer"]),
        "rlkit_padding_share": results["rlkit"][0].get("padding_share"),
        "rlkit_ratio_to_floor": statistics.median(r["ratio_to_floor"] for r in results["rlkit"]),
        "rlkit_cpu_ratio_to_floor": statistics.median(r["cpu_ratio_to_floor"] for r in results["rlkit"]),
        "rlkit_phase_medians": {phase: round(statistics.median(r["seconds_in"][phase] for r in results["rlkit"]), 4)
                                for phase in results["rlkit"][0]["seconds_in"]},
        "peer_phase_medians": {phase: round(statistics.median(r["seconds_in"][phase] for r in results["peer"]), 4)
                               for phase in results["peer"][0]["seconds_in"]},
        "load_range": [round(min(r["load_before"] for rows in results.values() for r in rows), 2),
                       round(max(r["load_before"] for rows in results.values() for r in rows), 2)],
    }
    print(f"median s/iteration: rlkit {median['rlkit']:.3f}, peer {median['peer']:.3f}; "
          f"rlkit is {summary['speedup_over_peer']:.2f}x the peer's speed; rlkit / floor {summary['rlkit_ratio_to_floor']:.2f}")
    print(f"median CPU s/iteration: rlkit {cpu['rlkit']:.3f}, peer {cpu['peer']:.3f}; "
          f"{summary['cpu_speedup_over_peer']:.2f}x in CPU time (the steadier figure on a shared machine at one thread); "
          f"rlkit / floor in CPU time {summary['rlkit_cpu_ratio_to_floor']:.2f}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
