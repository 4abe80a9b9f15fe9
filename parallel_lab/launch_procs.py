"""Process bookkeeping for `launch`: draining rank events, naming the rank to blame, reaping.

Kept apart from launch.py so the launcher reads top to bottom as the happy path.
Invariant: `_reap` returns only when every rank process has exited (killed if need be).
"""

from __future__ import annotations

import queue
import time

from .context import RankError


def _drain(q, wait: float = 0.05, limit: int = 10_000) -> list:
    """Everything waiting on the queue (blocking up to `wait` for the first message).

    Draining in batches matters: a live redraw between every two messages would let a
    chatty run fall minutes behind."""
    try:
        batch = [q.get(timeout=wait)]
    except queue.Empty:
        return []
    while len(batch) < limit:
        try:
            batch.append(q.get_nowait())
        except queue.Empty:
            break
    return batch


_SECONDARY = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Socket closed")


def _root_cause(first: dict, q, procs) -> RankError:
    """When one rank fails its peers soon fail too ("connection reset"): blame the rank that
    failed first for a real reason, preferring one that died outright or raised a non-network error."""
    errors = [first]
    end = time.perf_counter() + 0.3
    while time.perf_counter() < end:
        try:
            what, msg = q.get(timeout=0.05)
        except queue.Empty:
            continue
        if what == "error":
            errors.append(msg)
    reported = {e["rank"] for e in errors}
    for r, p in enumerate(procs):
        if r not in reported and not p.is_alive() and p.exitcode not in (0, 1, None):
            return RankError(r, "ProcessDied", f"exited with code {p.exitcode} without returning",
                             "(no Python traceback: the process was killed or crashed)")  # fmt: skip
    real = [e for e in errors if not any(s in e["message"] for s in _SECONDARY)]
    e = (real or errors)[0]
    return RankError(e["rank"], e["type"], e["message"], e["traceback"])


def _reap(procs, graceful: bool) -> None:
    """After success give ranks a moment to exit cleanly; then (or at once on failure) kill the rest."""
    end = time.perf_counter() + (2.0 if graceful else 0.0)
    for p in procs:
        if p.pid is None:
            continue
        p.join(timeout=max(0.0, end - time.perf_counter()))
    for p in procs:
        if p.pid is not None and p.is_alive():
            p.kill()
    for p in procs:
        if p.pid is not None:
            p.join(timeout=5.0)
