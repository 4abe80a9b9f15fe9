"""Recorder: per-rank timeline spans, memory samples and byte counts.

Every rank owns one `Recorder`. Spans are written in the Chrome trace event model
(complete events, "X") so a run can be opened in Perfetto; the same events stream
to the parent process while the run goes, which is what the live plots draw.

Invariant: every timestamp is seconds since the launch's common `t0` on one
monotonic clock (CLOCK_MONOTONIC is system-wide on Linux, so forked ranks on one
machine agree; scripts align ranks with one broadcast at start-up).

Which clock: on a CPU the host clock is the work's clock (an op runs when it is called).
On a GPU the host only queues kernels, so a host-clock span would show launch times. There
a `clock` (`runtime.device.CudaEventClock`) records a CUDA event at each span boundary on the
current stream; spans stay pending until `resolve()` (at the end of the run, or of a step)
turns the events into the same seconds-since-t0, and carry `args["clock"] == "cuda_event"`.
A comm span ends with an event recorded after `work.wait()`, which makes the stream wait for
the collective: so it ends when the collective is done, not when it was queued.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

#: Span kinds the plots know how to colour; anything else is drawn as "other".
KINDS = ("compute", "comm", "optimizer", "idle", "bubble", "memcpy", "other")

#: Memory categories (runtime/memory.py tracks these; plots stack them in this order).
CATEGORIES = ("param", "grad", "optim", "activation", "comm", "other")


@dataclass
class Recorder:
    """Collects what one rank did and when.

    `sink` (set by the launcher) receives every finished event and memory sample
    as it happens, so the parent can redraw live; `memory` (a `memory.MemoryTracker`
    or anything with `.snapshot() -> dict[str, int]`) is sampled at span
    boundaries when present.
    """

    rank: int = 0
    t0: float = field(default_factory=time.perf_counter)
    sink: Callable[[str, dict], None] | None = None
    memory: Any = None
    enabled: bool = True
    events: list[dict] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)
    comm: dict[str, dict[str, int]] = field(default_factory=dict)
    last_comm: str | None = None
    clock: Any = None  # a device clock on a GPU (runtime.device.CudaEventClock); None: the host clock
    pending: list[dict] = field(default_factory=list)  # spans whose ends are device marks

    def now(self) -> float:
        """Seconds since the launch's common t0 (host clock)."""
        return time.perf_counter() - self.t0

    def mark(self) -> Any:
        """A point on the work's clock: `now()` on a CPU, a CUDA event on the current stream on a GPU."""
        return self.now() if self.clock is None else self.clock.mark()

    def seconds(self, mark: Any) -> float:
        """A `mark()` as seconds since t0 (on a GPU this waits for its event)."""
        return mark if self.clock is None or isinstance(mark, float) else self.clock.seconds(mark)

    def resolve(self) -> None:
        """Turn pending device-timed spans into timeline events (waits for their events)."""
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        for ev in pending:
            ev["start"], ev["end"] = self.clock.seconds(ev["start"]), self.clock.seconds(ev["end"])
            ev["args"]["clock"] = "cuda_event"
            self.events.append(ev)
            self._emit("event", ev)

    def resolve_ready(self) -> None:
        """Emit the oldest pending device-timed spans whose events the GPU has passed, without
        waiting: a live view draws GPU spans while the run goes on, and a rank that dies later
        has already sent them. Stops at the first span still queued (spans mostly end in order)."""
        while self.pending and all(self.clock.done(self.pending[0][k]) for k in ("start", "end")):
            ev = self.pending.pop(0)
            ev["start"], ev["end"] = self.clock.seconds(ev["start"]), self.clock.seconds(ev["end"])
            ev["args"]["clock"] = "cuda_event"
            self.events.append(ev)
            self._emit("event", ev)

    # -- spans -----------------------------------------------------------------
    @contextlib.contextmanager
    def span(self, name: str, kind: str = "compute", **args: Any) -> Iterator[dict]:
        """Time a region. Yields the event's `args` dict so callers can add to it."""
        if not self.enabled:
            yield args
            return
        if kind == "comm":
            self.enter_comm(name)
        self.sample_memory(f"{name}:begin")
        start = self.mark()
        try:
            yield args
        finally:
            end = self.mark()
            if kind == "comm":
                self.leave_comm(name)
            self.add_event(name, kind, start, end, **args)
            self.sample_memory(f"{name}:end")

    def add_event(self, name: str, kind: str, start: Any, end: Any, **args: Any) -> dict:
        """Record a finished span (used directly by async collectives: issue -> wait). `start` and
        `end` are seconds or `mark()`s; spans with device marks wait for `resolve()`."""
        ev = {"rank": self.rank, "name": name, "kind": kind, "start": start, "end": end, "args": args}
        if self.enabled:
            if isinstance(start, (int, float)) and isinstance(end, (int, float)):
                self.events.append(ev)
                self._emit("event", ev)
            else:
                self.pending.append(ev)
                self.resolve_ready()
        return ev

    def enter_comm(self, op: str) -> None:
        """Note that this rank entered a collective (or issued an async one); the launcher reports
        it on a hang. Every `enter_comm` is closed by one `leave_comm`."""
        self.last_comm = op
        self._emit("enter", {"rank": self.rank, "op": op, "t": self.now()})

    def leave_comm(self, op: str) -> None:
        """Note that the collective `op` finished on this rank (a blocking one returned, an async one
        was waited on)."""
        self._emit("leave", {"rank": self.rank, "op": op, "t": self.now()})

    # -- bytes -----------------------------------------------------------------
    def count_bytes(self, op: str, sent: int, recv: int) -> None:
        """Add one call of `op` that sent/received this many payload bytes."""
        c = self.comm.setdefault(op, {"sent": 0, "recv": 0, "calls": 0})
        c["sent"] += int(sent)
        c["recv"] += int(recv)
        c["calls"] += 1

    def comm_totals(self) -> dict:
        """{'sent': n, 'recv': n, 'by_op': {...}} for this rank."""
        return {
            "sent": sum(c["sent"] for c in self.comm.values()),
            "recv": sum(c["recv"] for c in self.comm.values()),
            "by_op": {k: dict(v) for k, v in self.comm.items()},
        }

    def reset(self) -> None:
        """Forget events, samples and counts (e.g. after a warm-up step)."""
        self.events.clear()
        self.pending.clear()
        self.samples.clear()
        self.comm.clear()
        self._emit("reset", {"rank": self.rank})  # the launcher drops what it already streamed

    # -- memory ----------------------------------------------------------------
    def sample_memory(self, label: str = "") -> dict | None:
        """Take one memory sample if a tracker is attached."""
        if self.memory is None or not self.enabled:
            return None
        snap = self.memory.snapshot()
        s = {"rank": self.rank, "t": self.now(), "label": label, "bytes": snap}
        take = getattr(self.memory, "take_high_water", None)
        if take is not None:  # the highest total since the previous sample (temporaries included)
            s["high_water"] = take()
        check = getattr(self.memory, "cross_check", None)
        device = check(snap) if check is not None else None
        if device is not None:  # on CUDA: the allocator's count beside the categories
            s["device"] = device
        self.samples.append(s)
        self._emit("memory", s)
        return s

    def _emit(self, what: str, payload: dict) -> None:
        if self.sink is not None:
            self.sink(what, payload)


def chrome_trace(
    timeline: list[dict], memory: list[dict], meta: dict | None = None, cnames: dict[str, str] | None = None
) -> dict:
    """Build a Chrome/Perfetto trace: one process per rank, a compute and a comm track,
    memory as counter tracks. Our own data rides along under "parallel_lab" so
    `RunResult.load` can read the file back losslessly.

    Invariant: on any one track, two events are disjoint or one nests inside the other
    (Perfetto draws nothing else right). Communication that overlaps itself without
    nesting (a send in flight while a receive starts, as on separate CUDA streams) goes
    on extra tracks "comm 2", "comm 3", ...; the same for compute. `cnames` maps an event's
    kind to a chrome://tracing reserved colour name (the plots' palette passes its own).
    """
    ev: list[dict] = []
    tids = _tracks(timeline)
    ranks = sorted({e["rank"] for e in timeline} | {s["rank"] for s in memory})
    for r in ranks:
        ev.append({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"rank {r}"}})
        used = {t for (rank, t) in tids.values() if rank == r} | {1, 2}
        for t in sorted(used):
            name = ("compute", "comm")[(t - 1) % _LANES] + (f" {(t - 1) // _LANES + 1}" if t > _LANES else "")
            ev.append({"ph": "M", "name": "thread_name", "pid": r, "tid": t, "args": {"name": name}})
            ev.append({"ph": "M", "name": "thread_sort_index", "pid": r, "tid": t, "args": {"sort_index": t}})
    for i, e in enumerate(timeline):
        ev.append(
            {
                "ph": "X",
                "name": e["name"],
                "cat": e["kind"],
                "pid": e["rank"],
                "tid": tids[i][1],
                "ts": e["start"] * 1e6,
                "dur": max(0.0, e["end"] - e["start"]) * 1e6,
                "args": _jsonable(e.get("args", {})),
                **({"cname": cnames[e["kind"]]} if cnames and e["kind"] in cnames else {}),
            }
        )
    for s in memory:
        ev.append(
            {
                "ph": "C",
                "name": "memory (bytes)",
                "pid": s["rank"],
                "ts": s["t"] * 1e6,
                "args": dict(s["bytes"]),
            }
        )
    return {"traceEvents": ev, "displayTimeUnit": "ms", "parallel_lab": meta or {}}


_LANES = 2  # tid 1 compute, 2 comm; overflow track k of a lane is tid lane + 2k


def _tracks(timeline: list[dict]) -> dict[int, tuple[int, int]]:
    """event index -> (rank, tid): each event on the first track of its lane where it
    starts after everything open has ended, or nests inside the innermost open event."""
    out: dict[int, tuple[int, int]] = {}
    stacks: dict[tuple[int, int], list[list[float]]] = {}  # (rank, lane) -> per track, open ends
    order = sorted(range(len(timeline)), key=lambda i: (timeline[i]["start"], -timeline[i]["end"]))
    for i in order:
        e = timeline[i]
        lane = 2 if e["kind"] in ("comm", "memcpy") else 1
        tracks = stacks.setdefault((e["rank"], lane), [])
        for k, open_ends in enumerate(tracks + [[]]):
            while open_ends and open_ends[-1] <= e["start"]:
                open_ends.pop()
            if not open_ends or e["end"] <= open_ends[-1]:
                if k == len(tracks):
                    tracks.append(open_ends)
                open_ends.append(e["end"])
                out[i] = (e["rank"], lane + _LANES * k)
                break
    return out


def _jsonable(d: dict) -> dict:
    out = {}
    for k, v in d.items():
        out[k] = v if isinstance(v, (int, float, str, bool, type(None), list, dict)) else str(v)
    return out
