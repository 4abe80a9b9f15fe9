"""Process bookkeeping for `launch`: draining rank events, naming the rank to blame, reaping.

Kept apart from runtime/launch.py so the launcher reads top to bottom as the happy path.
Invariant: `_reap` returns only when every rank process has exited (killed if need be).
"""

from __future__ import annotations

import queue
import sys
import time

from parallel_lab.runtime.context import RankError


def _drain(q, wait: float = 0.05, limit: int = 10_000) -> list:
    """Everything waiting on the queue (blocking up to `wait` for the first message).

    Draining in batches matters: a live redraw between every two messages would let a
    chatty run fall minutes behind."""
    try:
        got = [q.get(timeout=wait)]
    except queue.Empty:
        return []
    while len(got) < limit:
        try:
            got.append(q.get_nowait())
        except queue.Empty:
            break
    batch = []
    for what, msg in got:  # a rank's trace arrives in batches (launch._Batched): opened here
        if what == "batch":
            batch.extend(msg)
        else:
            batch.append((what, msg))
    return batch


_SECONDARY = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Socket closed")


def _root_cause(first: dict, q, procs, returned: set[int], later: list = ()) -> RankError:
    """When one rank fails its peers soon fail too ("connection reset"): blame the rank that
    failed first for a real reason.

    A rank that died without a word (killed, crashed, or `os._exit` with any code) is the cause
    whatever its peers report: every rank sends its result or its error before it exits, so a
    dead rank missing from both, once the queue is drained, never spoke. Otherwise prefer an
    error that is not a peer's broken connection; the first such error came first in the queue
    (a rank's message is flushed before its exit closes the sockets its peers then see fail).
    `later`: the messages drained together with `first`, after it."""
    errors = [first]
    reported = set(returned) | {first["rank"]}

    def take(what: str, msg: dict) -> None:
        if what == "error":
            errors.append(msg)
            reported.add(msg["rank"])
        elif what == "result":
            reported.add(msg["rank"])
        elif what == "text":  # a failing rank's last prints still reach the cell
            (sys.stdout if msg["stream"] == "stdout" else sys.stderr).write(msg["text"])

    for what, msg in later:
        take(what, msg)
    end = time.perf_counter() + 0.3  # the peers' own errors, to choose among
    while time.perf_counter() < end:
        try:
            take(*q.get(timeout=0.05))
        except queue.Empty:
            continue
    dead = {r for r, p in enumerate(procs) if p.pid is not None and not p.is_alive()} - reported
    for what, msg in _drain(q, wait=0.0):  # whatever a dead rank said is in the pipe by now
        take(what, msg)
    silent = sorted(dead - reported)

    def then(cause: int) -> list[int]:  # the peers that failed after the cause: consequences, not causes
        return sorted({e["rank"] for e in errors} - {cause})

    if silent:
        r = silent[0]
        return RankError(r, "ProcessDied", f"exited with code {procs[r].exitcode} without returning",
                         "(no Python traceback: the process was killed, crashed or called os._exit)",
                         then(r))  # fmt: skip
    real = [e for e in errors if not any(s in e["message"] for s in _SECONDARY)]
    e = (real or errors)[0]
    return RankError(e["rank"], e["type"], e["message"], e["traceback"], then(e["rank"]))


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
