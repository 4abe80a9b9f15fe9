"""Backend and device choice: the one place that talks to `torch.cuda`.

Everything else takes `ctx.device` and stays device-agnostic. On a machine with
at least `world_size` GPUs a launch uses NCCL with one GPU per rank (NCCL refuses
two ranks on one GPU); otherwise gloo on CPU.

Process groups for DP x TP x PP meshes are built here too (`ParallelDims`).
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "gloo", "nccl")


def gpu_count() -> int:
    """Number of visible CUDA GPUs (0 on a CPU-only machine)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_names() -> list[str]:
    return [torch.cuda.get_device_name(i) for i in range(gpu_count())]


def cuda_initialized() -> bool:
    """True when this process already created a CUDA context (then fork is unsafe)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def default_backend(world_size: int | None = None) -> str:
    """NCCL when there is one GPU per rank, else gloo."""
    n = gpu_count()
    if n > 0 and torch.distributed.is_nccl_available() and (world_size is None or n >= world_size):
        return "nccl"
    return "gloo"


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


def device_for(backend: str, local_rank: int) -> torch.device:
    """The device a rank computes on: its own GPU under NCCL, the CPU under gloo."""
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def is_cuda(device: torch.device) -> bool:
    return torch.device(device).type == "cuda"


def device_memory_allocated(device: torch.device) -> int | None:
    """Bytes the caching allocator has handed out on a CUDA device; None on CPU."""
    if is_cuda(device):
        return torch.cuda.memory_allocated(device)
    return None


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels so timings are honest (no-op on CPU)."""
    if is_cuda(device):
        torch.cuda.synchronize(device)


def cpu_cores() -> int:
    """Cores this process may run on (respects affinity / cgroups where visible)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1
