# pyright: standard
"""A PNG of score and KL per iteration, and score against KL, saved next to metrics.jsonl for a
quick look without a UI. The held-out score sits beside the training score, and the score-against-KL
panel shows over-optimisation: training reward still rising while the held-out score stalls, at a
growing KL."""

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
    training = [h for h in history if "score/mean" in h]
    evaluations = [h for h in history if "eval/score" in h]
    iterations = [h["iteration"] for h in training]
    figure, (score_axis, kl_axis, tradeoff_axis) = plt.subplots(3, 1, figsize=(7, 8))
    score_axis.plot(iterations, [h["score/mean"] for h in training], label="training batch")
    if evaluations:
        score_axis.plot([h["iteration"] for h in evaluations], [h["eval/score"] for h in evaluations], "o-", label="held-out")
        score_axis.legend()
    score_axis.set_ylabel("mean score")
    kl_axis.plot(iterations, [h["kl/ref"] for h in training], color="tab:red")
    kl_axis.set_ylabel("KL to reference")
    kl_axis.set_xlabel("iteration")
    points = tradeoff_axis.scatter([h["kl/ref"] for h in training], [h["score/mean"] for h in training], c=iterations, s=10)
    figure.colorbar(points, ax=tradeoff_axis, label="iteration")
    tradeoff_axis.set_xlabel("KL to reference")
    tradeoff_axis.set_ylabel("mean score")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
