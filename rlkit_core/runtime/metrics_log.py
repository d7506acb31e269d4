# pyright: standard
"""`metrics.jsonl`: one JSON object per iteration under the run's output_dir, written whatever the tracker does."""

from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsLog:
    """The file at `path`, created by the first `append` (making one touches nothing on disk)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def truncate_after(self, iteration: int) -> None:
        """Drop lines past `iteration`, so a resumed run does not duplicate the iterations it redoes."""
        if not self.path.exists():
            return
        kept = [json.dumps(row) for row in self.read() if row["iteration"] <= iteration]
        self.path.write_text("".join(line + "\n" for line in kept))

    def append(self, iteration: int, metrics: dict[str, float], notes: dict | None = None) -> None:
        """`notes`: text beside the numbers (`note/...` keys: a health warning, the settings a
        resumed run changed), which the tracker gets as notes rather than metrics."""
        clean = {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as out:
            out.write(json.dumps({"iteration": iteration, **clean, **(notes or {})}) + "\n")

    def read(self) -> list[dict]:
        """Every complete line; a line cut short by a killed process is dropped."""
        if not self.path.exists():
            return []
        rows = []
        for line in self.path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return rows
