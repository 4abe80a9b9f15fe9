"""One table from every benchmark's last run: measure, ours / theirs, goal, met.

    python benchmarks/summary.py

Reads `benchmarks/results/<bench>.json` (written by each benchmark) and writes the same table
to `benchmarks/results/summary.json`, so two runs can be compared. Every ratio is ours / theirs,
time or bytes, measured in the same run: lower is better. A row without a goal is reported only
(for example 4 ranks on a 2-core machine, where the ranks outnumber the cores).
"""

from __future__ import annotations

import json
import sys

from _results import RESULTS


def main() -> int:
    files = sorted(p for p in RESULTS.glob("*.json") if p.name != "summary.json") if RESULTS.exists() else []
    if not files:
        print(f"no results in {RESULTS}: run the benchmarks first (make bench)", file=sys.stderr)
        return 1
    rows = []
    for f in files:
        data = json.loads(f.read_text())
        for r in data["rows"]:
            met = None if r["goal"] is None else r["ratio"] <= r["goal"]
            rows.append({"bench": data["bench"], "when": data["when"], **r, "met": met})
    head = f"{'benchmark':<16} {'measure':<66} {'ours/theirs':>11} {'goal':>6} {'met':>5}"
    print("\nSummary: ours / theirs, time or bytes, same run; lower is better")
    print(head)
    print("-" * len(head))
    for r in rows:
        goal = "-" if r["goal"] is None else f"<={r['goal']:g}"
        met = "-" if r["met"] is None else ("yes" if r["met"] else "NO")
        print(f"{r['bench']:<16} {r['measure']:<66} {r['ratio']:>10.2f}x {goal:>6} {met:>5}")
    gated = [r for r in rows if r["met"] is not None]
    print(f"{sum(r['met'] for r in gated)} of {len(gated)} goals met")
    (RESULTS / "summary.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
