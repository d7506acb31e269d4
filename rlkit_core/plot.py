"""A PNG of score and KL per iteration, saved next to metrics.jsonl for a quick look without a UI."""

from __future__ import annotations

from pathlib import Path


def plot_curves(history: list[dict], path: Path) -> Path | None:
    """Returns the PNG's path, or None when matplotlib is not installed (it comes with mlflow)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    iterations = [h["iteration"] for h in history]
    figure, (score_axis, kl_axis) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    score_axis.plot(iterations, [h["score/mean"] for h in history])
    score_axis.set_ylabel("mean score")
    kl_axis.plot(iterations, [h["kl/ref"] for h in history], color="tab:red")
    kl_axis.set_ylabel("KL to reference")
    kl_axis.set_xlabel("iteration")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
