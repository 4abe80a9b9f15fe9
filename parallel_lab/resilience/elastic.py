"""Restart after a failure, the way torchrun's elastic agent does: stop every rank, start them
again (on as many ranks as are left), and let the training function resume from the newest
complete checkpoint.

`run_with_restarts(fn, world_size, ..., max_restarts=k)` launches `fn(ctx, ..., attempt=i)`; when
a rank dies or raises, it records the failure (which rank, when, what the ranks had done) and
launches again, up to k times. `shrink=True` goes on without the failed rank: 4 ranks become 3,
as when a machine is gone for good (torchrun's `--nnodes=MIN:MAX` rendezvous does the same across
machines, re-numbering the ranks that are left). The training function reads its checkpoint, so
the restart policy and the resume logic stay apart, as in torch elastic.

Invariant: the attempts ran one after another; `timeline()` puts their events on one clock, with
each failure and each restart drawn where it happened.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from parallel_lab.runtime.context import LaunchTimeout, RankError
from parallel_lab.runtime.launch import launch
from parallel_lab.runtime.result import RunResult


@dataclass
class Attempt:
    """One launch: on how many ranks, when (seconds since the first started), and how it ended."""

    world_size: int
    start: float
    end: float
    result: RunResult | None = None
    error: str | None = None
    failed_rank: int | None = None
    timeline: list[dict] = field(default_factory=list)


@dataclass
class ElasticResult:
    """Every attempt, oldest first; `values` are the last (successful) attempt's."""

    attempts: list[Attempt]

    @property
    def values(self) -> list[Any]:
        return self.attempts[-1].result.values

    @property
    def restarts(self) -> int:
        return len(self.attempts) - 1

    def timeline(self) -> list[dict]:
        """All attempts' events on one clock, plus a "failed" span per failure (on the failed rank, from its
        last recorded event to the failure's detection) and a "restart" span on every rank of the next
        attempt (from the detection to the next attempt's first event: process start and resume)."""
        out: list[dict] = []
        for i, a in enumerate(self.attempts):
            out += [{**e, "start": e["start"] + a.start, "end": e["end"] + a.start, "args": {**e.get("args", {}),
                     "attempt": i}} for e in a.timeline]  # fmt: skip
            if a.error is None or i + 1 == len(self.attempts):
                continue
            nxt = self.attempts[i + 1]
            rank = a.failed_rank if a.failed_rank is not None else 0
            last = max((e["end"] for e in a.timeline if e["rank"] == rank), default=0.0) + a.start
            out.append({"rank": rank, "name": f"rank {rank} failed", "kind": "bubble", "start": last, "end": a.end,
                        "args": {"attempt": i, "error": a.error}})  # fmt: skip
            first = min((e["start"] for e in nxt.timeline), default=0.0) + nxt.start
            for r in range(nxt.world_size):
                out.append({"rank": r, "name": "restart and resume", "kind": "idle", "start": a.end, "end": first,
                            "args": {"attempt": i + 1}})  # fmt: skip
        return sorted(out, key=lambda e: (e["start"], e["rank"]))


def run_with_restarts(fn: Callable[..., Any], world_size: int, *args: Any, max_restarts: int = 3,
                      shrink: bool = False, min_world_size: int = 1, **kwargs: Any) -> ElasticResult:  # fmt: skip
    """Launch `fn(ctx, *args, attempt=i, **kwargs)`; after a failure launch again, at most
    `max_restarts` times, on `world_size - 1` ranks if `shrink` (never below `min_world_size`).
    The keyword arguments `launch` knows (timeout, seed, ...) go to it. Raises the last failure
    when no restart is left."""
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
    if isinstance(min_world_size, bool) or not isinstance(min_world_size, int) or min_world_size < 1:
        raise ValueError(f"min_world_size must be a positive int, got {min_world_size!r}")
    attempts: list[Attempt] = []
    t0 = time.perf_counter()
    ws = world_size
    for i in range(max_restarts + 1):
        start = time.perf_counter() - t0
        try:
            res = launch(fn, ws, *args, attempt=i, **kwargs)
        except (RankError, LaunchTimeout) as e:
            end = time.perf_counter() - t0
            rank = e.rank if isinstance(e, RankError) else None
            attempts.append(Attempt(ws, start, end, None, str(e).splitlines()[0], rank, e.timeline))
            if i == max_restarts:
                raise
            if shrink:
                if ws - 1 < min_world_size:
                    raise RuntimeError(
                        f"cannot shrink below min_world_size={min_world_size} after rank {rank} failed"
                    ) from e
                ws -= 1
            continue
        attempts.append(Attempt(ws, start, time.perf_counter() - t0, res, timeline=res.timeline))
        return ElasticResult(attempts)
    raise AssertionError("unreachable")  # the loop returns or raises


__all__ = ["Attempt", "ElasticResult", "run_with_restarts"]
