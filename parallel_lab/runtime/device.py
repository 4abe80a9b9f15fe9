"""Backend and device choice: the one place that talks to `torch.cuda`.

Everything else takes `ctx.device` and stays device-agnostic. On a machine with
at least `world_size` GPUs a launch uses NCCL with one GPU per rank (NCCL refuses
two ranks on one GPU); otherwise gloo on CPU.

Counting GPUs must not create a CUDA context here: a notebook kernel that did so (even
through `torch.cuda.is_available()`, which initialises the driver) can no longer fork a
rank that uses CUDA, so launches that use NCCL never fork (see `launch`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import torch

BACKENDS = ("auto", "gloo", "nccl")


def gpu_count() -> int:
    """Visible CUDA GPUs (respecting CUDA_VISIBLE_DEVICES), counted without initialising CUDA here.

    A CPU build of torch has none. Otherwise NVML answers (what `torch.cuda.device_count`
    itself uses when asked to stay fork-safe); without NVML a child process counts."""
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return 0
    if torch.cuda.is_initialized():
        return torch.cuda.device_count()
    return _uninitialised_gpu_count(os.environ.get("CUDA_VISIBLE_DEVICES"))


@functools.lru_cache(maxsize=4)
def _uninitialised_gpu_count(visible: str | None) -> int:
    try:
        n = torch.cuda._device_count_nvml()  # -1 when NVML is unavailable
    except Exception:
        n = -1
    if n >= 0:
        return n
    code = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        return int(out.stdout.strip() or 0)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return 0


def gpu_names() -> list[str]:
    """Names of the visible GPUs (initialises CUDA in this process: for `doctor`, not a notebook)."""
    return [torch.cuda.get_device_name(i) for i in range(gpu_count())]


def cuda_initialized() -> bool:
    """True when this process already created a CUDA context (then fork is unsafe for any rank)."""
    return torch.cuda.is_initialized()


def wants_cpu() -> bool:
    """ACCELERATE_USE_CPU=true (accelerate's own switch) asks for gloo on CPU even on a GPU node."""
    return os.environ.get("ACCELERATE_USE_CPU", "").strip().lower() in ("1", "true", "yes")


def local_cuda_index(local_rank: int | None) -> int:
    """The GPU a rank drives: its LOCAL_RANK, or 0 when the launcher shows each rank one GPU
    (Slurm's --gpus-per-task=1). A clear error instead of every rank piling onto GPU 0."""
    n = gpu_count()
    local_world = local_world_size()
    if local_world is not None and local_world > n:
        raise RuntimeError(
            f"LOCAL_WORLD_SIZE={local_world} ranks on this machine but {n} GPU(s) visible: NCCL needs one GPU "
            "per rank (two ranks on one GPU fail in NCCL's init); run fewer ranks or backend='gloo'"
        )
    if n == 1:
        return 0
    if local_rank is None:
        raise RuntimeError(
            f"LOCAL_RANK is not set and {n} GPUs are visible: NCCL needs to know which GPU is this rank's "
            "(torchrun and accelerate launch set it; with srun, set LOCAL_RANK=$SLURM_LOCALID)"
        )
    if not 0 <= local_rank < n:
        raise RuntimeError(f"LOCAL_RANK={local_rank} but only {n} GPU(s) are visible to this rank")
    return local_rank


def local_world_size() -> int | None:
    """Ranks on this machine, when they all see the same GPUs: LOCAL_WORLD_SIZE as torch elastic sets
    it (torchrun, and accelerate launch, which runs on it: TORCHELASTIC_RUN_ID is set). None otherwise:
    under srun or submitit (which also export LOCAL_WORLD_SIZE) each task may be shown a GPU of its
    own (--gpus-per-task=1), so a count of tasks against the GPUs one task sees proves nothing."""
    v = os.environ.get("LOCAL_WORLD_SIZE")
    if "TORCHELASTIC_RUN_ID" not in os.environ or not v or not v.strip().isdigit():
        return None
    return int(v)


def auto_backend(local_ranks: int | None) -> tuple[str, str]:
    """The one rule behind backend="auto" (launch and launcher-started ranks alike): (backend, why).

    NCCL needs a GPU for each rank on this machine, and every tensor a rank communicates on it
    (`ctx.device`). So: gloo when ACCELERATE_USE_CPU asks for the CPU, when no GPU or no NCCL is
    here, or when this machine runs more ranks (`local_ranks`: launch's world size, a launcher's
    LOCAL_WORLD_SIZE) than it has GPUs; NCCL otherwise, world size 1 included (one rank, one GPU)."""
    return backend_rule(local_ranks, gpu_count(), torch.distributed.is_nccl_available(), wants_cpu())


def backend_rule(local_ranks: int | None, gpus: int, nccl: bool, cpu_asked: bool) -> tuple[str, str]:
    """`auto_backend` with the machine given (the doctor asks it about lessons and machines)."""
    if cpu_asked:
        return "gloo", "ACCELERATE_USE_CPU asks for the CPU"
    if gpus == 0:
        return "gloo", "no GPU visible"
    if not nccl:
        return "gloo", "this torch build has no NCCL"
    if local_ranks is not None and local_ranks > gpus:
        return "gloo", f"{local_ranks} ranks on this machine but {gpus} GPU(s): NCCL needs one GPU per rank"
    return "nccl", "one GPU per rank"


def default_backend(world_size: int | None = None) -> str:
    """What backend="auto" picks for `world_size` ranks on this machine (see `auto_backend`)."""
    return auto_backend(world_size)[0]


def resolve_backend(backend: str, world_size: int) -> str:
    """Turn "auto" into a concrete backend and check the request can work here."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return default_backend(world_size)
    if backend == "nccl" and gpu_count() < world_size:
        raise ValueError(
            f"backend='nccl' needs one GPU per rank: world_size={world_size} but {gpu_count()} GPU(s) visible"
        )
    return backend


def device_for(backend: str, local_rank: int | None) -> torch.device:
    """The device a rank computes on: its own GPU under NCCL (made current here, before the
    process group exists), the CPU under gloo."""
    if backend == "nccl":
        index = local_cuda_index(local_rank)
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def group_kwargs(device: torch.device) -> dict:
    """`init_process_group` arguments for this rank's device: NCCL binds its communicator to the
    GPU made current by `device_for` (`device_id`), so no collective guesses the device."""
    return {"device_id": device} if is_cuda(device) else {}


def is_cuda(device: torch.device) -> bool:
    return torch.device(device).type == "cuda"


def device_memory_allocated(device: torch.device) -> int | None:
    """Bytes the caching allocator has handed out on a CUDA device; None on CPU."""
    if is_cuda(device):
        return torch.cuda.memory_allocated(device)
    return None


def device_memory_stats(device: torch.device) -> dict[str, int] | None:
    """The caching allocator's own counts on a CUDA device (None on CPU): bytes handed out
    now and at their peak, and bytes reserved from the driver (handed out + cached)."""
    if not is_cuda(device):
        return None
    return {
        "allocated": torch.cuda.memory_allocated(device),
        "max_allocated": torch.cuda.max_memory_allocated(device),
        "reserved": torch.cuda.memory_reserved(device),
    }


def gemm_workspace_bytes(device: torch.device) -> int:
    """Bytes of cuBLAS's workspace that the caching allocator counts as allocated on `device` (0 on a
    CPU): torch allocates it at a stream's first GEMM and keeps it, so `memory_allocated` includes
    memory that is no tensor's (32 MiB a stream on Hopper). Measured: cleared, then one GEMM."""
    if not is_cuda(device):
        return 0
    torch._C._cuda_clearCublasWorkspaces()
    a = torch.ones(16, 16, device=device)
    before = torch.cuda.memory_allocated(device)
    a @ a  # the product is freed at once; the workspace stays
    return torch.cuda.memory_allocated(device) - before


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels so timings are honest (no-op on CPU)."""
    if is_cuda(device):
        torch.cuda.synchronize(device)


def spin(device: torch.device, seconds: float) -> None:
    """Keep `device` busy for about `seconds` of its own time without blocking the host (an emulated
    compute cost): `torch.cuda._sleep` spins a kernel for a number of clock cycles, and the cycles a
    second of this GPU are measured once (`_cycles_per_second`). On a CPU: time.sleep."""
    if seconds <= 0:
        return
    if not is_cuda(device):
        time.sleep(seconds)
        return
    torch.cuda._sleep(int(seconds * _cycles_per_second(torch.device(device).index or 0)))


@functools.lru_cache(maxsize=8)
def _cycles_per_second(index: int) -> float:
    """Clock cycles a second of GPU `index`, measured on a 50M-cycle spin (synchronises once)."""
    with torch.cuda.device(index):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # wake the clocks up first
        start.record()
        torch.cuda._sleep(50_000_000)
        end.record()
        end.synchronize()
        return 50_000_000 / (start.elapsed_time(end) / 1e3)


class Stopwatch:
    """Adds up intervals of the work's own time: `with watch(): ...`, then `watch.seconds`.

    On a CPU the host clock. On a GPU the host returns from a kernel launch (or from an NCCL
    work's wait(), which only makes the stream wait) long before the work is done, so a host clock
    measures the launch: there each interval is a pair of CUDA events on the current stream, read
    (synchronising) only when `seconds` is asked for, so read it outside a hot loop. An interval that
    starts on an idle stream also counts the host time until the first kernel is queued."""

    def __init__(self, device: torch.device):
        self.cuda, self.done, self.pending = is_cuda(device), 0.0, []

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        if not self.cuda:
            t0 = time.perf_counter()
            yield
            self.done += time.perf_counter() - t0
            return
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        while self.pending and self.pending[0][1].query():  # done already: fold in without a sync
            s, e = self.pending.pop(0)
            self.done += s.elapsed_time(e) / 1e3
        self.pending.append((start, end))

    @property
    def seconds(self) -> float:
        for start, end in self.pending:
            end.synchronize()
            self.done += start.elapsed_time(end) / 1e3
        self.pending.clear()
        return self.done


class CudaEventClock:
    """Device time for the Recorder: a CUDA event per mark, read back as host seconds.

    The first mark synchronises once and records a reference event at a known host time;
    every later event's time is that host time plus the GPU's elapsed time since the
    reference. Reading (`seconds`) waits for the event, so it happens at `resolve()`."""

    def __init__(self, device: torch.device, host_now):
        self.device, self.host_now, self.ref = device, host_now, None

    def mark(self) -> torch.cuda.Event:
        if self.ref is None:
            torch.cuda.synchronize(self.device)
            self.ref = torch.cuda.Event(enable_timing=True)
            self.ref.record()
            torch.cuda.synchronize(self.device)
            self.ref_host = self.host_now()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def done(self, mark) -> bool:
        """Has the GPU passed this mark (so `seconds` will not wait)?"""
        return isinstance(mark, float) or mark.query()

    def seconds(self, mark) -> float:
        if isinstance(mark, float):
            return mark
        mark.synchronize()
        return self.ref_host + self.ref.elapsed_time(mark) / 1e3


def clock_for(device: torch.device, host_now):
    """The Recorder's clock for this device: CUDA events on a GPU, None (the host clock) on a CPU."""
    return CudaEventClock(device, host_now) if is_cuda(device) else None


def bind_thread(device: torch.device) -> None:
    """Make `device` current in this thread (a new Python thread starts on GPU 0: NCCL calls
    issued from it would use the wrong device and can hang)."""
    if is_cuda(device):
        torch.cuda.set_device(device)


def side_stream(device: torch.device):
    """A CUDA stream of its own for work that should overlap the compute stream; None on a CPU."""
    return torch.cuda.Stream(device) if is_cuda(device) else None


@contextlib.contextmanager
def on_stream(stream) -> Iterator[None]:
    """Run the block's kernels on `stream` (no-op for None)."""
    if stream is None:
        yield
    else:
        with torch.cuda.stream(stream):
            yield


def stream_point(device: torch.device):
    """An event at the current stream's position (None on a CPU): hand it to `wait_for` on
    another stream so that stream's later kernels start after everything queued before it."""
    if not is_cuda(device):
        return None
    ev = torch.cuda.Event()
    ev.record()
    return ev


def wait_for(point) -> None:
    """Make the current stream wait for a `stream_point` (no-op for None)."""
    if point is not None:
        torch.cuda.current_stream().wait_event(point)


def host_buffer(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` in page-locked host memory when `device` is a GPU (copies from it can run on a stream
    while kernels run; from pageable memory they cannot); as it is on a CPU."""
    return t.pin_memory() if is_cuda(device) else t


def used_here(t: torch.Tensor) -> None:
    """Tell the caching allocator that the current stream uses `t` (made on another stream), so its
    memory is not handed out again before this stream is done with it (no-op on a CPU)."""
    if t.is_cuda:
        t.record_stream(torch.cuda.current_stream(t.device))


def cpu_cores() -> int:
    """Cores this process may run on (respects affinity / cgroups where visible)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1
