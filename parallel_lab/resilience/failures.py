"""Failure arithmetic: why a large job fails often, and how often to checkpoint.

- If each of n devices fails independently with probability p over some period, the job (which
  needs all of them) survives it with probability (1 - p)^n and fails with 1 - (1 - p)^n.
- A failure costs the work since the last checkpoint plus the restart. Checkpointing every
  T seconds at cost C each, with mean time between failures M, Young (1974) and Daly (2006)
  give the interval that wastes least: T* ~ sqrt(2 C M) (first order, C << M).
- `simulate_goodput` measures the same trade-off on a simulated failure process (exponential
  times between failures), so the formula can be checked against a run instead of trusted.

Invariant: every function is pure arithmetic on its arguments (no global RNG: the simulation
takes a seed), and refuses probabilities outside [0, 1] and non-positive times.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


def _prob(name: str, p: float) -> float:
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
        raise ValueError(f"{name} must be a probability in [0, 1], got {p!r}")
    return float(p)


def _positive(name: str, x: float) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {x!r}")
    return float(x)


def _count(name: str, n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{name} must be a positive int, got {n!r}")
    return n


def job_failure_probability(p: float, n: int, periods: int = 1) -> float:
    """P(at least one of `n` devices fails within `periods` periods), each failing with
    probability `p` per period, independently: 1 - (1 - p)^(n * periods)."""
    p, n, periods = _prob("p", p), _count("n", n), _count("periods", periods)
    return 1.0 - (1.0 - p) ** (n * periods)


def per_period_rate(p_total: float, periods: int) -> float:
    """The per-period probability that compounds to `p_total` over `periods` periods
    (e.g. 8% a month -> about 0.28% a day over 30 days): 1 - (1 - p_total)^(1/periods)."""
    p_total, periods = _prob("p_total", p_total), _count("periods", periods)
    return 1.0 - (1.0 - p_total) ** (1.0 / periods)


def mtbf(p: float, n: int, period: float = 1.0) -> float:
    """Mean time between failures of a job on `n` devices, each failing with probability `p`
    per `period` (as a rate: -n ln(1 - p) failures per period)."""
    p, n, period = _prob("p", p), _count("n", n), _positive("period", period)
    if p == 0.0:
        return math.inf
    if p == 1.0:
        return 0.0
    return period / (-n * math.log1p(-p))


def young_daly_interval(checkpoint_cost: float, mtbf_seconds: float) -> float:
    """Checkpoint interval that wastes least time, first order: sqrt(2 * C * M)."""
    c, m = _positive("checkpoint_cost", checkpoint_cost), _positive("mtbf_seconds", mtbf_seconds)
    return math.sqrt(2.0 * c * m)


def expected_goodput(
    interval: float, checkpoint_cost: float, restart_cost: float, mtbf_seconds: float
) -> float:
    """First-order fraction of time spent on useful work: every interval pays C, every failure
    (rate 1/M) pays the restart R plus on average half an interval of lost work."""
    t, c = _positive("interval", interval), _positive("checkpoint_cost", checkpoint_cost)
    r, m = float(restart_cost), _positive("mtbf_seconds", mtbf_seconds)
    if r < 0 or not math.isfinite(r):
        raise ValueError(f"restart_cost must be a finite number >= 0, got {restart_cost!r}")
    return max(0.0, (t / (t + c)) * (1.0 - (r + (t + c) / 2.0) / m))


@dataclass
class GoodputRun:
    """What `simulate_goodput` measured: useful work over wall time, and how it was spent."""

    interval: float
    goodput: float
    failures: int
    lost_work: float
    checkpoint_time: float
    restart_time: float
    wall: float


def simulate_goodput(interval: float, checkpoint_cost: float, restart_cost: float, mtbf_seconds: float,
                     work: float, seed: int = 0) -> GoodputRun:  # fmt: skip
    """Run a job needing `work` seconds of compute, checkpointing after every `interval` seconds
    of work (cost `checkpoint_cost`), under failures with exponential gaps of mean `mtbf_seconds`
    (a failure during work or a checkpoint loses everything since the last completed checkpoint,
    then costs `restart_cost`). Returns the measured goodput = work / wall time."""
    t, c = _positive("interval", interval), _positive("checkpoint_cost", checkpoint_cost)
    m, w = _positive("mtbf_seconds", mtbf_seconds), _positive("work", work)
    r = float(restart_cost)
    if r < 0 or not math.isfinite(r):
        raise ValueError(f"restart_cost must be a finite number >= 0, got {restart_cost!r}")
    rng = random.Random(seed)
    wall = done = lost = ckpt = restarts = 0.0
    failures = 0
    next_failure = rng.expovariate(1.0 / m)
    while done < w:
        segment = min(t, w - done)
        need = segment + (c if done + segment < w else 0.0)  # the last segment needs no checkpoint
        if wall + need <= next_failure:
            wall += need
            done += segment
            ckpt += need - segment
            continue
        # a failure inside this segment or its checkpoint: the segment is lost
        spent = next_failure - wall
        lost += spent
        wall = next_failure + r
        restarts += r
        failures += 1
        next_failure = wall + rng.expovariate(1.0 / m)
    return GoodputRun(t, w / wall, failures, lost, ckpt, restarts, wall)


__all__ = [
    "GoodputRun",
    "expected_goodput",
    "job_failure_probability",
    "mtbf",
    "per_period_rate",
    "simulate_goodput",
    "young_daly_interval",
]
