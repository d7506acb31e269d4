# pyright: standard
"""The end-of-run report: where reward and KL started and ended, and what the policy says now."""

from __future__ import annotations

import statistics
from collections import Counter

SAMPLES = 5  # rows of each sample table the tracker gets (from the trained batch), and the report's default
SAME_SCORE = 1e-6  # scores closer than this count as unchanged


def tenth_means(history: list[dict], key: str) -> tuple[float, float]:
    """Mean of `key` over the first and the last 10% of iterations (at least one each)."""
    n = max(1, len(history) // 10)
    values = [h[key] for h in history]
    return statistics.fmean(values[:n]), statistics.fmean(values[-n:])


def score_changes(samples: list[dict]) -> tuple[int, int, int]:
    """How many samples' greedy responses scored higher, lower and the same after training."""
    differences = [s["after_score"] - s["before_score"] for s in samples]
    return (sum(d > SAME_SCORE for d in differences), sum(d < -SAME_SCORE for d in differences),
            sum(abs(d) <= SAME_SCORE for d in differences))


def staleness_histogram(history: list[dict]) -> str:
    """How many trained batches were how many policy versions old, e.g. 'staleness 0: 1, 1: 29'."""
    counts = Counter(round(h["async/staleness"]) for h in history)
    return "staleness " + ", ".join(f"{age}: {n}" for age, n in sorted(counts.items()))


def print_report(history, samples, held_out, metrics_path, checkpoint_path, tracker, out, shown: int = SAMPLES) -> None:
    """`samples`: prompts with the greedy response and its score before and after training
    (`held_out`: every held-out prompt, else a few training ones; none: `run.report_samples` = 0),
    of which the first `shown` are printed."""
    evaluations = [h for h in history if "eval/score" in h]
    history = [h for h in history if "score/mean" in h]  # rows of training iterations (not the evaluation before them)
    if not history:
        return
    first_score, last_score = tenth_means(history, "score/mean")
    first_kl, last_kl = tenth_means(history, "kl/ref")
    seconds = [h["time/iteration"] for h in history]
    print("\n== rlkit report ==", file=out)
    print(f"iterations: {len(history)}, median {statistics.median(seconds):.2f} s each, {sum(seconds):.0f} s in all", file=out)
    print(f"mean score, first 10% → last 10% of iterations: {first_score:.4f} → {last_score:.4f} ({last_score - first_score:+.4f})", file=out)
    print(f"KL to the reference, first 10% → last 10%: {first_kl:.4f} → {last_kl:.4f}", file=out)
    if len(evaluations) > 1:
        first, last = evaluations[0], evaluations[-1]
        print(f"held-out evaluation, iteration {first['iteration']} → {last['iteration']}:", file=out)
        for name in (k for k in first if k.startswith("eval/")):
            print(f"  {name[5:]:<12} {first[name]:.4f} → {last[name]:.4f} ({last[name] - first[name]:+.4f})", file=out)
    made_ahead = [h for h in history if "async/staleness" in h]
    if made_ahead:
        print(f"batches made ahead: {staleness_histogram(made_ahead)}; regenerated {sum(h['async/regenerated'] for h in made_ahead):.0f}; "
              f"the update waited a median {statistics.median(h['time/trainer_waiting'] for h in made_ahead):.2f} s for its batch",
              file=out)
    tracking = [h["time/tracking"] / h["time/iteration"] for h in history if "time/tracking" in h]
    if tracking:
        print(f"tracking cost: median {100 * statistics.median(tracking):.2f}% of an iteration", file=out)
    if samples and "after_score" in samples[0]:
        higher, lower, same = score_changes(samples)
        print(f"greedy responses to {len(samples)} {'held-out' if held_out else 'training'} prompts, after training: "
              f"{higher} score higher, {lower} lower, {same} the same", file=out)
    for i, sample in enumerate(samples[:shown], start=1):
        print(f"\nsample {i}: {sample['prompt']!r}", file=out)
        for when in ("before", "after"):
            score = f" (score {sample[when + '_score']:.3f})" if when + "_score" in sample else ""
            print(f"  {when + ':':<7} {sample[when]!r}{score}", file=out)
    print(f"\nmetrics: {metrics_path}", file=out)
    print(f"checkpoint: {checkpoint_path} (continue with --resume auto; export with rlkit export)", file=out)
    where = getattr(tracker, "location", None)
    if where:
        print(f"tracker: {where}", file=out)
