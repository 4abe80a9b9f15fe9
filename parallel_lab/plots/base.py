"""What the plots share: the palette, byte units, and readers for their inputs.

A timeline comes from a `RunResult`, a list of event dicts, or a Chrome trace
(our own `save_chrome_trace` files, or `torch.profiler`'s `export_chrome_trace`).
Invariant: whatever the source, the plots get events `{"rank", "name", "kind",
"start", "end", "args"}` in seconds with `kind` in `trace.KINDS`, and samples
`{"rank", "t", "label", "bytes": {category: int}}` (plus "high_water", the highest total
since the sample before, when the tracker gave one).
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

import matplotlib.pyplot as plt

from parallel_lab.runtime.trace import KINDS

KIND_COLORS: dict[str, str] = {
    "compute": "#4C72B0",
    "comm": "#DD8452",
    "optimizer": "#55A868",
    "idle": "#D9D9D9",
    "bubble": "#F4B6B6",
    "memcpy": "#8172B3",
    "other": "#937860",
}
CATEGORY_COLORS: dict[str, str] = {
    "param": "#4C72B0",
    "grad": "#CCB974",
    "optim": "#55A868",
    "activation": "#C44E52",
    "comm": "#DD8452",
    "other": "#8C8C8C",
}
# The same kinds in a saved trace (`RunResult.save_chrome_trace`). chrome://tracing colours an
# event only by a reserved colour name ("cname"), so each kind takes the reserved colour nearest
# its hue above (RGB in the comments, from the trace viewer's colour scheme). Perfetto colours
# slices by name and ignores cname.
KIND_TRACE_COLORS: dict[str, str] = {
    "compute": "thread_state_runnable",  # (133, 160, 210) blue
    "comm": "thread_state_iowait",  # (255, 140, 0) orange
    "optimizer": "thread_state_running",  # (126, 200, 148) green
    "idle": "grey",  # (221, 221, 221)
    "bubble": "rail_animation",  # (244, 74, 63) red
    "memcpy": "detailed_memory_dump",  # (180, 0, 180) purple
    "other": "thread_state_unknown",  # (199, 155, 125) brown
}
# Communication split by collective, warm colours so "comm" still reads as one family.
COMM_OP_COLORS: dict[str, str] = {
    "all_reduce": "#DD8452",
    "all_gather": "#EDB93B",
    "reduce_scatter": "#A9441F",
    "all_to_all": "#D65F9E",
    "send/recv": "#B07AA1",
    "broadcast": "#8C6D31",
    "gather": "#F3D37E",
    "scatter": "#E3A587",
    "reduce": "#F1A66A",
}
_OP_WORDS = [("reduce_scatter", "reduce_scatter"), ("reducescatter", "reduce_scatter"), ("all_gather", "all_gather"),
             ("allgather", "all_gather"), ("all_to_all", "all_to_all"), ("alltoall", "all_to_all"),
             ("dispatch", "all_to_all"), ("combine", "all_to_all"), ("all_reduce", "all_reduce"),
             ("allreduce", "all_reduce"), ("bucket", "all_reduce"),
             ("broadcast", "broadcast"), ("send", "send/recv"), ("recv", "send/recv"), ("p2p", "send/recv"),
             ("gather", "gather"), ("scatter", "scatter"), ("reduce", "reduce")]  # fmt: skip


def comm_op(name: str) -> str | None:
    """The collective a comm span's name stands for ("ring_all_reduce", "torch bucket 3" ->
    "all_reduce"; "isend" -> "send/recv"), or None when the name says none."""
    low = name.lower().replace("-", "_")
    return next((op for word, op in _OP_WORDS if word in low), None)


# Forward and backward keep their colours in every lesson (DP, ZeRO, pipeline, 3D, recompute),
# as shades of the compute blue, so "compute" still reads as one family next to comm's orange.
# Interleaved pipelines draw chunk c in the c-th shade. A zero-bubble pipeline's W (weight gradients,
# split from B) is gold: it is the block that moves.
PHASE_COLORS: dict[str, tuple[str, ...]] = {
    "forward": ("#4C72B0", "#86A3D6", "#B9CBEA", "#2E4A7D"),
    "backward": ("#2A7F7F", "#5FB3B3", "#9ED3D3", "#174D4D"),
    "recompute": ("#8172B3", "#A99DD1", "#CFC8E8", "#54478A"),
    "weight gradients": ("#B8860B", "#D9B54A", "#EBD58F", "#7A5A07"),  # a pipeline's W, split from its B
}
_PHASE_NAMES = {"f": "forward", "fwd": "forward", "forward": "forward", "b": "backward",
                "bwd": "backward", "backward": "backward", "recompute": "recompute", "w": "weight gradients"}  # fmt: skip


def phase_color(name: str) -> str | None:
    """The palette colour of a span named for a training phase ("F", "B.c1", "forward",
    "backward", "recompute block 3", "F mb2"), or None for any other name."""
    head = re.split(r"[ ._:]", name.strip(), maxsplit=1)[0].lower()
    phase = _PHASE_NAMES.get(head)
    if phase is None:
        return None
    chunk = re.search(r"\.c(\d+)", name)
    shades = PHASE_COLORS[phase]
    return shades[int(chunk.group(1)) % len(shades)] if chunk else shades[0]


UNITS = {
    "B": 1,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
    "KB": 1e3,
    "MB": 1e6,
    "GB": 1e9,
    "TB": 1e12,
}


def byte_unit(nbytes: float, unit: str = "auto") -> tuple[float, str]:
    """(divisor, name) for showing `nbytes`: 'auto' picks B/KiB/MiB/GiB/TiB by size."""
    if unit != "auto":
        if unit not in UNITS:
            raise ValueError(f"unit must be 'auto' or one of {sorted(UNITS)}, got {unit!r}")
        return float(UNITS[unit]), unit
    for name in ("TiB", "GiB", "MiB", "KiB"):
        if abs(nbytes) >= UNITS[name]:
            return float(UNITS[name]), name
    return 1.0, "B"


def time_window(t_min: float, t_max: float) -> tuple[float, float]:
    """x limits in ms: from 0, unless the data starts late (start-up before the first
    span, e.g. imports), then from the first point so the run fills the plot."""
    if t_max <= t_min:
        return (0.0, max(t_max, 1.0))
    pad = 0.01 * (t_max - t_min)
    left = 0.0 if t_min <= 0.05 * t_max else t_min - pad
    return (left, t_max + pad)


def new_axes(ax: Any, **fig_kw: Any) -> tuple[Any, Any]:
    """(figure, axes): a new pyplot figure when `ax` is None, else the given axes' figure."""
    if ax is None:
        fig, ax = plt.subplots(layout="constrained", **fig_kw)
        return fig, ax
    return ax.figure, ax


# Names that mark a span as communication in traces that do not say their kind.
_COMM_WORDS = re.compile(
    r"nccl|gloo|c10d|all_?reduce|all_?gather|reduce_?scatter|broadcast|all_?to_?all|barrier|send|recv",
    re.IGNORECASE,
)


def timeline_of(obj: Any) -> tuple[list[dict], int | None]:
    """(events, world_size or None) from a RunResult, an event list, or a Chrome trace dict/path."""
    if isinstance(obj, (str, os.PathLike)):
        with open(obj) as f:
            obj = json.load(f)
    if isinstance(obj, dict):
        if "traceEvents" not in obj:
            raise TypeError("a dict timeline must be a Chrome trace with a 'traceEvents' list")
        return chrome_events(obj), _meta_world_size(obj)
    if hasattr(obj, "timeline"):
        return [_event(e) for e in obj.timeline], getattr(obj, "world_size", None)
    if isinstance(obj, (list, tuple)):
        return [_event(e) for e in obj], None
    raise TypeError(
        f"expected a RunResult, a list of events or a Chrome trace dict, got {type(obj).__name__}"
    )


def memory_of(obj: Any) -> tuple[list[dict], int | None]:
    """(samples, world_size or None) from a RunResult, a sample list, or a Chrome trace dict/path."""
    if isinstance(obj, (str, os.PathLike)):
        with open(obj) as f:
            obj = json.load(f)
    if isinstance(obj, dict):
        if "traceEvents" not in obj:
            raise TypeError("a dict of memory samples must be a Chrome trace with a 'traceEvents' list")
        samples = [
            {"rank": int(e.get("pid", 0)), "t": e["ts"] / 1e6, "label": "", "bytes": dict(e.get("args", {}))}
            for e in obj["traceEvents"]
            if e.get("ph") == "C" and str(e.get("name", "")).startswith("memory")
        ]
        return [_sample(s) for s in samples], _meta_world_size(obj)
    if hasattr(obj, "memory"):
        return [_sample(s) for s in obj.memory], getattr(obj, "world_size", None)
    if isinstance(obj, (list, tuple)):
        return [_sample(s) for s in obj], None
    raise TypeError(
        f"expected a RunResult, a list of memory samples or a Chrome trace, got {type(obj).__name__}"
    )


def chrome_events(trace: dict) -> list[dict]:
    """Complete ("X") events of a Chrome trace as timeline events.

    Rows: a process named "rank N" is rank N; otherwise small integer pids are
    ranks; otherwise pids are numbered in order. Kind: the event's `cat` when it is
    one of ours, else "comm" for collective-looking names, "memcpy" for copies,
    "optimizer" for optimizer steps, "compute" for the rest. Foreign traces (no
    "parallel_lab" key) are shifted to start at 0.
    """
    raw = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "ts" in e]
    named: dict[Any, int] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            m = re.fullmatch(r"\s*rank\s*(\d+)\s*", str(e.get("args", {}).get("name", "")))
            if m:
                named[e.get("pid")] = int(m.group(1))
    pids = sorted({e.get("pid", 0) for e in raw}, key=str)
    if pids and all(p in named for p in pids):
        rank_of = named
    elif all(isinstance(p, int) and 0 <= p < 1024 for p in pids):
        rank_of = {p: p for p in pids}
    else:
        rank_of = {p: i for i, p in enumerate(pids)}
    shift = 0.0 if "parallel_lab" in trace or not raw else min(float(e["ts"]) for e in raw)
    out = []
    for e in raw:
        start = (float(e["ts"]) - shift) / 1e6
        out.append(
            {
                "rank": rank_of[e.get("pid", 0)],
                "name": str(e.get("name", "?")),
                "kind": _kind_of(e),
                "start": start,
                "end": start + float(e.get("dur", 0.0)) / 1e6,
                "args": e.get("args", {}),
            }
        )
    return out


def _kind_of(e: dict) -> str:
    cat, name = str(e.get("cat", "")), str(e.get("name", ""))
    if cat in KINDS:
        return cat
    if "memcpy" in cat.lower() or "memcpy" in name.lower():
        return "memcpy"
    if _COMM_WORDS.search(name):
        return "comm"
    if "optimizer" in name.lower():
        return "optimizer"
    return "compute"


def _meta_world_size(trace: dict) -> int | None:
    ws = (trace.get("parallel_lab") or {}).get("world_size")
    return int(ws) if ws else None


def _event(e: Any) -> dict:
    if not isinstance(e, dict) or "start" not in e or "end" not in e:
        raise TypeError(f"a timeline event must be a dict with 'start' and 'end' (seconds), got {e!r:.80}")
    kind = e.get("kind", "other")
    rank = e.get("rank", 0)
    if not isinstance(rank, int) or rank < 0:
        raise ValueError(f"event rank must be an int >= 0, got {rank!r}")
    return {
        "rank": rank,
        "name": str(e.get("name", "?")),
        "kind": kind if kind in KINDS else "other",
        "start": float(e["start"]),
        "end": float(e["end"]),
        "args": e.get("args", {}),
    }


def _sample(s: Any) -> dict:
    if not isinstance(s, dict) or "t" not in s or not isinstance(s.get("bytes"), dict):
        raise TypeError(
            f"a memory sample must be a dict with 't' and 'bytes' {{category: int}}, got {s!r:.80}"
        )
    out = {
        "rank": int(s.get("rank", 0)),
        "t": float(s["t"]),
        "label": s.get("label", ""),
        "bytes": {str(k): int(v) for k, v in s["bytes"].items()},
    }
    if s.get("high_water") is not None:  # the highest total since the sample before
        out["high_water"] = int(s["high_water"])
    if isinstance(s.get("device"), dict):  # CUDA: the caching allocator's own counts
        out["device"] = {str(k): int(v) for k, v in s["device"].items()}
    return out


def bytes_value(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) and not hasattr(v, "__float__"):
        raise TypeError(f"{what} must be a number of bytes, got {type(v).__name__}")
    v = float(v)
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{what} must be a finite number of bytes >= 0, got {v}")
    return v
