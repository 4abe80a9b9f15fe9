"""GPUs and the nodes they ship in: the physics the planner's time model starts from.

Every number is a vendor specification (dense, no sparsity) with its source beside it; the planner
never fits a constant per training run. Three numbers are not on a datasheet and are stated once per
GPU kind instead:
- `gemm_efficiency`: the fraction of peak a large bf16 matrix multiply reaches once it is
  compute-bound. 0.7 on the A100 (set before the validation table was assembled, and not changed);
  0.6 on the H100, an assumption the validation does not test (it has no H100 row);
- `link_efficiency`: the fraction of a link's bandwidth a ring collective moves, 0.8 (nccl-tests'
  bus bandwidth stays below the link's rate: protocol overhead and the ring's pipeline);
- `overlap_slowdown`: how much slower two things run when a collective and compute share the GPU.
  NCCL's collectives are kernels too: each channel holds an SM, and their copies and reductions take
  memory bandwidth. 0.15, chosen with the validation's ZeRO-3 rows in view (the one place where
  overlap decides the time), then used for every row.

Invariant: a preset is frozen; a `ClusterSpec` names one and never copies its numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel_lab.costmodel.formulas import _number


@dataclass(frozen=True)
class GPU:
    """One accelerator: dense bf16 peak, memory and its bandwidth, and the per-GPU links of its node."""

    name: str
    peak_flops: float  # dense bf16 tensor-core FLOP/s
    memory: float  # bytes of HBM
    hbm_bw: float  # bytes/s
    nvlink_bw: float  # bytes/s per direction, per GPU, inside a node
    network_bw: float  # bytes/s per direction, per GPU, across nodes (one NIC per GPU)
    gemm_efficiency: float = 0.7
    link_efficiency: float = 0.8
    overlap_slowdown: float = 0.15

    def __post_init__(self) -> None:
        for name in ("peak_flops", "memory", "hbm_bw", "nvlink_bw", "network_bw"):
            _number(name, getattr(self, name), 0.0, strict=True)
        for name in ("gemm_efficiency", "link_efficiency"):
            if not 0 < _number(name, getattr(self, name)) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if not 0 <= _number("overlap_slowdown", self.overlap_slowdown) < 1:
            raise ValueError(f"overlap_slowdown must be in [0, 1), got {self.overlap_slowdown}")

    @property
    def ridge(self) -> float:
        """FLOPs per byte above which a kernel is compute-bound at the achievable peak (the roofline's knee)."""
        return self.peak_flops * self.gemm_efficiency / self.hbm_bw


# NVIDIA A100 Tensor Core GPU datasheet (2021): bf16 312 TFLOP/s dense; 40 GB HBM2 at 1,555 GB/s,
# 80 GB HBM2e at 2,039 GB/s; NVLink 3: 12 links x 25 GB/s = 300 GB/s per direction (600 GB/s total).
# DGX A100 user guide: eight 200 Gb/s HDR InfiniBand adapters for compute, one per GPU: 25 GB/s.
A100_40GB = GPU("A100 40GB", peak_flops=312e12, memory=40e9, hbm_bw=1555e9, nvlink_bw=300e9, network_bw=25e9)
A100_80GB = GPU("A100 80GB", peak_flops=312e12, memory=80e9, hbm_bw=2039e9, nvlink_bw=300e9, network_bw=25e9)
# NVIDIA H100 Tensor Core GPU datasheet (SXM5): bf16 989 TFLOP/s dense; 80 GB HBM3 at 3.35 TB/s;
# NVLink 4: 18 links x 25 GB/s = 450 GB/s per direction (900 GB/s total).
# DGX H100 user guide: eight 400 Gb/s NDR ConnectX-7 adapters for compute, one per GPU: 50 GB/s.
H100_SXM = GPU(
    "H100 SXM", peak_flops=989e12, memory=80e9, hbm_bw=3350e9, nvlink_bw=450e9, network_bw=50e9,
    gemm_efficiency=0.6,
)  # fmt: skip

GPUS = {g.name: g for g in (A100_40GB, A100_80GB, H100_SXM)}

__all__ = ["A100_40GB", "A100_80GB", "GPU", "GPUS", "H100_SXM"]
