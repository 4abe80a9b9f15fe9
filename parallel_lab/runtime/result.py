"""RunResult: what a launch (or a script run) hands back, and its trace file.

A trace file is a Chrome/Perfetto trace with our own records riding along under
the "parallel_lab" key, so `RunResult.load(path)` restores exactly what was saved.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from parallel_lab.runtime.trace import chrome_trace


@dataclass
class RunResult:
    """Per-rank return values, merged timeline, memory samples and byte counts."""

    values: list[Any]
    timeline: list[dict] = field(default_factory=list)
    memory: list[dict] = field(default_factory=list)
    comm_bytes: list[dict] = field(default_factory=list)
    wall_time: float = 0.0
    world_size: int = 1
    backend: str = "gloo"

    def save_chrome_trace(self, path: str) -> str:
        """Write a trace Perfetto (ui.perfetto.dev) and chrome://tracing open; returns the path."""
        meta = {
            "world_size": self.world_size,
            "backend": self.backend,
            "wall_time": self.wall_time,
            "comm_bytes": self.comm_bytes,
            "timeline": self.timeline,
            "memory": self.memory,
            "values": [_plain(v) for v in self.values],
        }
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise ValueError(f"path must be the name of a file to write, got {path!r}")
        from parallel_lab.plots import KIND_TRACE_COLORS  # the lessons' palette, in the viewer's names

        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as f:
                json.dump(chrome_trace(self.timeline, self.memory, meta, KIND_TRACE_COLORS), f, default=str)
        except OSError as e:
            raise OSError(f"cannot write the trace to {path}: {e.strerror or e}") from None
        return path

    @classmethod
    def load(cls, path: str) -> RunResult:
        """Read a trace written by `save_chrome_trace` (e.g. by a torchrun script)."""
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise ValueError(f"path must be the name of a trace file, got {path!r}")
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"trace file not found: {path}") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path} is not a JSON trace ({type(e).__name__}: {str(e)[:80]})") from None
        except OSError as e:
            raise OSError(f"cannot read trace file {path}: {e.strerror or e}") from None
        meta = data.get("parallel_lab") if isinstance(data, dict) else None
        if not meta:
            raise ValueError(f"{path} is not a parallel_lab trace (no 'parallel_lab' key)")
        missing = [
            k
            for k in ("timeline", "memory", "comm_bytes", "wall_time", "world_size", "backend")
            if k not in meta
        ]
        if missing:
            raise ValueError(
                f"{path} is a parallel_lab trace without {', '.join(missing)} (written by another version?)"
            )
        return cls(
            values=meta.get("values", []),
            timeline=meta["timeline"],
            memory=meta["memory"],
            comm_bytes=meta["comm_bytes"],
            wall_time=meta["wall_time"],
            world_size=meta["world_size"],
            backend=meta["backend"],
        )

    # -- summaries -------------------------------------------------------------
    def spans(self, kind: str | None = None, rank: int | None = None, name: str | None = None) -> list[dict]:
        """Timeline events filtered by kind, rank and/or name."""
        return [
            e
            for e in self.timeline
            if (kind is None or e["kind"] == kind)
            and (rank is None or e["rank"] == rank)
            and (name is None or e["name"] == name)
        ]

    def peak_memory(self, rank: int = 0) -> dict[str, int]:
        """The sample with the largest total on `rank` ({} when memory was not tracked)."""
        best: dict[str, int] = {}
        for s in self.memory:
            if s["rank"] == rank and sum(s["bytes"].values()) > sum(best.values()):
                best = dict(s["bytes"])
        return best

    # -- plots -----------------------------------------------------------------
    def plot_timeline(self, **kw: Any):
        from parallel_lab.plots import plot_timeline

        return plot_timeline(self, **kw)

    def plot_memory(self, **kw: Any):
        from parallel_lab.plots import plot_memory

        return plot_memory(self, **kw)

    def plot_comm_bytes(self, **kw: Any):
        from parallel_lab.plots import plot_comm_bytes

        return plot_comm_bytes(self, **kw)

    def __repr__(self) -> str:
        return (
            f"RunResult(world_size={self.world_size}, backend={self.backend!r}, wall_time={self.wall_time:.3f}s, "
            f"events={len(self.timeline)}, memory_samples={len(self.memory)})"
        )


def _plain(v: Any) -> Any:
    """Make a return value JSON-friendly (tensors become lists)."""
    try:
        import torch

        if isinstance(v, torch.Tensor):
            return v.tolist()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v
