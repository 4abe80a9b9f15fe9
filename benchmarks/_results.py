"""Where each benchmark leaves its ratios for `summary.py`: one JSON file per benchmark.

Every ratio is ours / theirs (time or bytes), measured in the same run, so lower is better.
A row's `goal` is the ratio it should stay at or below; None means reported, not gated.
The files go to `benchmarks/results/` (ignored by git): compare two runs by keeping a copy.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

# PARALLEL_LAB_BENCH_RESULTS moves them (the tests do, to leave a learner's results alone)
RESULTS = Path(os.environ.get("PARALLEL_LAB_BENCH_RESULTS") or Path(__file__).resolve().parent / "results")


def record(bench: str, rows: list[dict]) -> Path:
    """Write `rows` ({"measure": str, "ratio": float, "goal": float | None}) for `bench`."""
    for r in rows:
        if set(r) != {"measure", "ratio", "goal"}:
            raise ValueError(f"rows need exactly measure, ratio and goal, got {sorted(r)}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{bench}.json"
    path.write_text(
        json.dumps({"bench": bench, "when": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}, indent=1)
    )
    return path
