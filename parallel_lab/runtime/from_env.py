"""run_from_env: the script-side twin of `launch`, for torchrun and accelerate launch; run_script: both."""

from __future__ import annotations

import importlib
import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from parallel_lab.runtime import device as mesh
from parallel_lab.runtime.context import _make_context, _run_fn, _to_cpu
from parallel_lab.runtime.launch import launch
from parallel_lab.runtime.result import RunResult


def run_from_env(
    fn: Callable[..., Any],
    *args: Any,
    trace_path: str | None = None,
    backend: str = "auto",
    track_memory: bool = False,
    seed: int = 0,
    check_shapes: bool = True,
    **kwargs: Any,
) -> RunResult | None:
    """The script-side twin of `launch`, for `torchrun` and `accelerate launch`.

    Reads RANK / WORLD_SIZE / LOCAL_RANK (and MASTER_ADDR / MASTER_PORT) from the
    environment, runs `fn(ctx, ...)`, gathers every rank's events to rank 0, which
    writes `trace_path` (loadable with `RunResult.load`) and returns the result.
    Other ranks return None.
    """
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise RuntimeError(
                f"environment variable {var} is not set: start this script with torchrun or accelerate launch"
            )
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"]) if "LOCAL_RANK" in os.environ else None
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    backend = env_backend(backend)
    torch.set_num_threads(max(1, mesh.cpu_cores() // local_world))
    device = mesh.device_for(backend, local_rank)  # under NCCL: set_device before the group exists
    # torch._dynamo (imported by the first optimizer a script builds) keeps a reference to a process
    # group that exists when it is imported, so destroy_process_group no longer joins gloo's worker
    # threads; one of them then frees a finished op's tensors during interpreter shutdown and the
    # rank aborts ("terminate called without an active exception"). Imported first, it holds none.
    importlib.import_module("torch._dynamo")
    dist.init_process_group(backend, **_restart_safe_store(rank, world_size), **mesh.group_kwargs(device))
    # Align clocks: every rank leaves the barrier at (nearly) the same moment.
    dist.barrier()
    t0 = time.perf_counter()
    ctx = _make_context(
        rank, world_size, local_rank or 0, backend, t0, seed, None, check_shapes, track_memory, device=device
    )
    start = time.perf_counter()
    try:
        value = _run_fn(ctx, fn, args, kwargs)
    except Exception as e:
        if _peer_gone(e):
            _say_peer_gone(ctx, e)
        raise
    wall = time.perf_counter() - start
    rec = ctx.recorder
    gathered: list[Any] = [None] * world_size
    dist.gather_object(
        (_to_cpu(value), rec.events, rec.samples, rec.comm_totals()), gathered if rank == 0 else None, dst=0
    )
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return None
    result = RunResult(
        values=[g[0] for g in gathered],
        timeline=sorted((e for g in gathered for e in g[1]), key=lambda e: (e["start"], e["rank"])),
        memory=sorted((s for g in gathered for s in g[2]), key=lambda s: (s["t"], s["rank"])),
        comm_bytes=[g[3] for g in gathered],
        wall_time=wall,
        world_size=world_size,
        backend=backend,
    )
    if trace_path:
        save_trace(result, trace_path)
    return result


# What gloo and the TCP store say when the other end of a connection is gone (its process or node died).
# Under NCCL a lost peer is no error at first: the collective waits until NCCL's watchdog times it out
# (init_process_group's timeout, 10 minutes by default) and, with TORCH_NCCL_ASYNC_ERROR_HANDLING's
# default, tears the process down; only where the timeout reaches Python as an error (blocking wait)
# is it recognised here ("Watchdog caught collective operation timeout").
_GONE = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|Failed to recv|Connection refused|"
                   r"Socket Timeout|connection.*closed|connection to the C10d store has failed|"
                   r"Watchdog caught collective operation timeout",
                   re.IGNORECASE)  # fmt: skip


def _peer_gone(e: BaseException) -> bool:
    return isinstance(e, RuntimeError) and bool(_GONE.search(str(e)))


def _say_peer_gone(ctx, e: BaseException) -> None:
    """One line a learner can act on, before torch's traceback: which rank, where, and what it means."""
    import sys

    node = os.environ.get("GROUP_RANK", "?")
    where = getattr(ctx.recorder, "last_comm", None)
    print(
        f"parallel_lab: rank {ctx.rank} of {ctx.world_size} (node {node}, local rank {ctx.local_rank}) lost a peer"
        f"{f' during {where}' if where else ''}: {str(e).splitlines()[0][:160]}. Another rank stopped (its process "
        "or its machine died), and a collective cannot finish without every rank; this rank stops too. "
        "torchrun --max-restarts N restarts every node, and a script that checkpoints resumes (lesson 13).",
        file=sys.stderr,
        flush=True,
    )


def _restart_safe_store(rank: int, world_size: int) -> dict:
    """`init_process_group` arguments that survive an elastic restart. After torchrun restarts the
    ranks (`--max-restarts`), the rendezvous store still holds the previous attempt's keys, and gloo
    would read the dead ranks' addresses from them ("Connection refused"). Each attempt's keys go
    under their own prefix instead, in the same store."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt in (None, "0"):
        return {"rank": rank, "world_size": world_size}
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=rank == 0 and not agent_store, multi_tenant=not agent_store)  # fmt: skip
    return {"store": dist.PrefixStore(f"/parallel_lab/attempt_{attempt}", store), "rank": rank,
            "world_size": world_size}  # fmt: skip


def save_trace(result: RunResult, trace_path: str) -> None:
    """Write the trace; if that fails (a bad path), say so and keep the run: its result is still returned."""
    try:
        result.save_chrome_trace(trace_path)
    except (OSError, ValueError) as e:
        import sys

        print(f"warning: {e}; the run's result is kept, only the trace is lost", file=sys.stderr, flush=True)


def env_backend(backend: str = "auto") -> str:
    """The backend of a launcher-started rank. An explicit "gloo"/"nccl" wins; "auto" follows the
    one rule `launch` follows too (`device.auto_backend`), with this machine's ranks read from
    LOCAL_WORLD_SIZE: gloo when ACCELERATE_USE_CPU is set, no GPU is seen, or the machine runs more
    ranks than it has GPUs (said once, by local rank 0), else NCCL with each rank on its own GPU."""
    if backend not in mesh.BACKENDS:
        raise ValueError(f"backend must be one of {mesh.BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    chosen, why = mesh.auto_backend(mesh.local_world_size())
    if chosen == "gloo" and mesh.gpu_count() > 0 and os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"backend gloo on the CPU: {why}", file=sys.stderr, flush=True)
    return chosen


def script_world(nproc: int) -> int:
    """The world size a script will run at: the launcher's WORLD_SIZE, else its --nproc."""
    return int(os.environ.get("WORLD_SIZE", nproc))


def scaled_default(flag: str, given: int | None, world: int, rule: Callable[[int], int]) -> int:
    """A script default that divides at any world size: `given` when the learner set the flag,
    else `rule(world)`, said once (by rank 0) when it differs from the 4-rank default."""
    if given is not None:
        return given
    value = rule(world)
    if value != rule(4) and os.environ.get("RANK", "0") == "0":
        print(f"{flag} {value}: the default scaled to {world} ranks", flush=True)
    return value


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is at least `n`."""
    return -(-n // multiple) * multiple


def run_script(
    fn: Callable[..., Any],
    *args: Any,
    nproc: int,
    trace_path: str,
    track_memory: bool = False,
    timeout: float = 120.0,
    threads: int | None = None,
    **kwargs: Any,
) -> RunResult | None:
    """How every lesson script runs `fn(ctx, *args, **kwargs)`, with or without a launcher.

    Under torchrun / accelerate launch (RANK is set) this process is one rank
    (`run_from_env`); run plainly, it starts `nproc` local ranks with `launch`
    (`timeout` and `threads` apply to that case only). Either way rank 0 gets the
    RunResult, its trace written to `trace_path`; the other ranks get None.
    """
    if "RANK" in os.environ:
        return run_from_env(fn, *args, trace_path=trace_path, track_memory=track_memory, **kwargs)
    result = launch(fn, nproc, *args, track_memory=track_memory, timeout=timeout, threads=threads, **kwargs)
    save_trace(result, trace_path)
    return result
