"""The run context every rank receives, and the errors a launch can raise.

`Context` is the one explicit object passed down to every technique: who this
rank is, where it computes, where it records. `_make_context` builds it the same
way for `launch` (forked ranks) and `run_from_env` (torchrun / accelerate).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from parallel_lab.runtime import device as mesh
from parallel_lab.runtime.trace import Recorder


class RankError(RuntimeError):
    """A rank raised: carries the rank and its formatted traceback."""

    def __init__(self, rank: int, exc_type: str, message: str, tb: str, consequences: list[int] | tuple = ()):
        self.rank, self.exc_type, self.remote_traceback = rank, exc_type, tb
        self.consequences = sorted(
            consequences
        )  # peers that failed after this rank did (their errors follow)
        self.timeline: list[dict] = []  # what the ranks recorded before the failure (launch fills it)
        self.memory: list[dict] = []
        then = ""
        if self.consequences:  # on a line of its own: which peers report in time varies from run to run
            who = ", ".join(map(str, self.consequences))
            then = f"\n(then rank{'s' if len(self.consequences) > 1 else ''} {who} failed as a consequence)"
        super().__init__(
            f"rank {rank} raised {exc_type}: {message}{then}\n\n--- traceback from rank {rank} ---\n{tb}"
        )


class LaunchTimeout(TimeoutError):
    """The run did not finish in time: says what each unfinished rank was doing, as far as the
    traced comms layer saw it, and guesses no cause it cannot know.

    `stuck`: {rank: last collective it entered, or None}; `inside`: {rank: collectives it was in
    when time ran out (an async op counts until it is waited on)}; `starting`: ranks whose
    process group never came up. `backend`: under NCCL a collective call returns once its kernel is
    queued, so "finished" can only be said of the host's call (the kernel may still wait for a peer)."""

    def __init__(
        self,
        timeout: float,
        stuck: dict[int, str | None],
        starting: set[int] | frozenset = frozenset(),
        inside: dict[int, list[str]] | None = None,
        backend: str = "gloo",
    ):
        self.stuck, self.starting, self.backend = stuck, set(starting), backend
        self.timeline: list[dict] = []  # what the ranks recorded before time ran out (launch fills it)
        self.memory: list[dict] = []
        self.inside = {r: list((inside or {}).get(r, [])) for r in stuck}
        parts = [f"rank {r} {self.doing(r)}" for r in sorted(stuck)]
        waiting = [r for r in stuck if self.inside[r]]
        if len(self.starting) == len(stuck):
            hint = " No rank finished joining the process group; on a busy machine a larger timeout may help."
        elif waiting:
            hint = (
                " A collective finishes only when every rank of its group calls it with the same arguments."
            )
        else:
            hint = " No rank is inside a traced collective: they are all running their own code."
        super().__init__(f"run did not finish within timeout={timeout:g} s; " + "; ".join(parts) + "." + hint)

    def doing(self, rank: int) -> str:
        """What `rank` was doing when time ran out, in words."""
        if rank in self.starting:
            return "was still joining the process group"
        if self.inside[rank]:
            return "was inside " + ", ".join(self.inside[rank])
        last = self.stuck[rank]
        ended = (
            "been queued on the GPU (an NCCL call returns once queued: it may still wait for a peer)"
            if self.backend == "nccl"
            else "finished"
        )
        done = f"its last traced collective, {last}, had {ended}" if last else "no traced collective yet"
        return f"was running its own code ({done})"


@dataclass
class Context:
    """What every rank's function receives as its first argument."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    recorder: Recorder
    seed: int = 0
    group: Any = None  # None means the default (world) group
    memory: Any = None  # memory.MemoryTracker when launched with track_memory=True
    check_shapes: bool = True  # comms verify shapes agree across ranks before a collective
    mesh: Any = None  # ParallelDims / device mesh for lessons that build one

    def print(self, *args: Any, **kwargs: Any) -> None:
        """Print from rank 0 only."""
        if self.rank == 0:
            print(*args, **kwargs, flush=True)

    def span(self, name: str, kind: str = "compute", **args: Any):
        """Time a region on this rank's timeline (context manager)."""
        return self.recorder.span(name, kind, **args)


def _make_context(
    rank, world_size, local_rank, backend, t0, seed, sink, check_shapes, track_memory, device=None
):
    device = device if device is not None else mesh.device_for(backend, local_rank)
    rec = Recorder(rank=rank, t0=t0, sink=sink)
    rec.clock = mesh.clock_for(device, rec.now)
    ctx = Context(rank, world_size, local_rank, device, backend, rec, seed=seed, check_shapes=check_shapes)
    if track_memory:
        from parallel_lab.runtime.memory import MemoryTracker

        ctx.memory = rec.memory = MemoryTracker(device)
    torch.manual_seed(seed)  # replicated weights share a seed; data should use seed + rank
    return ctx


def _run_fn(ctx: Context, fn, args, kwargs):
    try:
        if ctx.memory is None:
            return fn(ctx, *args, **kwargs)
        ctx.memory.start()
        try:
            ctx.recorder.sample_memory("start")
            out = fn(ctx, *args, **kwargs)
            ctx.recorder.sample_memory("end")
            return out
        finally:
            ctx.memory.stop()
    finally:
        ctx.recorder.resolve()  # device-timed spans (GPU) join the timeline


def _to_cpu(x: Any) -> Any:
    """Results travel to the parent; CUDA tensors must not (they would init CUDA there).

    Walks lists, tuples (NamedTuples too), dicts and dataclass instances; other objects go as
    they are."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a NamedTuple
        return type(x)(*(_to_cpu(v) for v in x))
    if isinstance(x, (list, tuple)):
        items = [_to_cpu(v) for v in x]
        return items if type(x) is list else tuple(items) if type(x) is tuple else type(x)(items)
    if isinstance(x, dict):
        out = {k: _to_cpu(v) for k, v in x.items()}
        if type(x) is dict:
            return out
        try:
            y = copy.copy(x)  # a dict subclass (defaultdict, OrderedDict) keeps its type
            y.update(out)
            return y
        except Exception:
            return out
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        y = copy.copy(x)  # field by field, so neither __init__ nor a frozen check runs again
        for f in dataclasses.fields(x):
            object.__setattr__(y, f.name, _to_cpu(getattr(x, f.name)))
        return y
    return x
