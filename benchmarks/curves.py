"""Per-seed learning curves of the default recipe, before and after a change: the tables and the plot
of benchmarks/README.md ("Learning that climbs and stays up").

    python benchmarks/robustness.py --task summarize --seeds 5 --set run.threads=1 --history runs/after
    python benchmarks/curves.py before=runs/before@6 after=runs/after@5 --plot benchmarks/learning_curves.png

Each argument is LABEL=PATH@TARGET, PATH a folder of `--history` files (one jsonl per seed) or of
run folders holding metrics.jsonl, TARGET the KL controller's target those runs had (without it,
`--target`). For every run it prints one markdown row: the held-out score at
each evaluation, the KL to the reference and β every 10 iterations, and the figures the targets
read: the share of iterations from 20 on whose KL lies within 0.5–1.5× the target, the highest
mean KL over 5 iterations in a row, the held-out gain, and the training score's last 10% of
iterations against its first 10%.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from rlkit_core.runtime.report import tenth_means

EVERY = 10  # iterations between the curve points of the table


def runs_in(path: Path) -> dict[str, list[dict]]:
    """{run name: its rows, oldest first} of a folder of history files or of run folders."""
    files = sorted(path.glob("*.jsonl")) or sorted(path.glob("*/metrics.jsonl"))
    return {(f.stem if f.name != "metrics.jsonl" else f.parent.name): [json.loads(line) for line in f.read_text().splitlines() if line]
            for f in files}


def figures(rows: list[dict], target: float) -> dict:
    trained = [r for r in rows if "score/mean" in r]
    evaluations = [r["eval/score"] for r in rows if "eval/score" in r]
    first, last = tenth_means(trained, "score/mean")
    late = [r["kl/ref"] for r in trained if r["iteration"] >= 20]
    points = [r for r in trained if r["iteration"] == 1 or r["iteration"] % EVERY == 0]
    windows = [statistics.fmean(late[i:i + 5]) for i in range(len(late) - 4)]
    return {"evaluations": evaluations, "in_band": sum(0.5 * target <= k <= 1.5 * target for k in late) / len(late),
            "kl_window_max": max(windows), "gain": evaluations[-1] / evaluations[0] - 1, "last_over_first": last / first - 1,
            "kl": [r["kl/ref"] for r in points], "beta": [r["kl/beta"] for r in points]}


def table(label: str, runs: dict[str, list[dict]], target: float) -> str:
    lines = []
    for name, rows in runs.items():
        f = figures(rows, target)
        lines.append(f"| {label} | {name} | {' → '.join(f'{s:.3f}' for s in f['evaluations'])} | {f['gain']:+.1%} | "
                     f"{f['last_over_first']:+.1%} | {f['in_band']:.0%} | {f['kl_window_max']:.1f} | "
                     f"{' '.join(f'{k:.1f}' for k in f['kl'])} | {' '.join(f'{b:.3f}' for b in f['beta'])} |")
    return "\n".join(lines)


def plot(groups: dict[str, dict[str, list[dict]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("kl/ref", "KL to the reference (nats)"), ("kl/beta", "β"), ("eval/score", "held-out score")]
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 4))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for (key, title), ax in zip(panels, axes):
        for colour, (label, runs) in zip(colours, groups.items()):
            for i, rows in enumerate(runs.values()):
                points = [(r["iteration"], r[key]) for r in rows if key in r]
                ax.plot(*zip(*points), color=colour, alpha=0.6, lw=1, marker="o" if key == "eval/score" else None,
                        label=label if i == 0 else None)
        ax.set_title(title)
        ax.set_xlabel("iteration")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out, dpi=80)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("groups", nargs="+", metavar="LABEL=PATH[@TARGET]")
    parser.add_argument("--target", type=float, default=6.0, help="the KL target of a group that names none")
    parser.add_argument("--plot", type=Path, help="write the KL, β and held-out curves of every run here (PNG)")
    args = parser.parse_args()
    groups, targets = {}, {}
    for group in args.groups:
        label, where = group.split("=", 1)
        path, _, target = where.partition("@")
        groups[label], targets[label] = runs_in(Path(path)), float(target) if target else args.target
    print("| code | run | held-out at each evaluation | gain | training score, last 10% / first 10% | KL in 0.5–1.5× target "
          "(it. ≥ 20) | highest 5-iteration mean KL | KL at it. 1, 10, 20, … | β at it. 1, 10, 20, … |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, runs in groups.items():
        print(table(label, runs, targets[label]))
    if args.plot:
        plot(groups, args.plot)


if __name__ == "__main__":
    main()
