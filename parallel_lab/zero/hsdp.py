"""HSDP: shard the model inside a group of neighbouring ranks, replicate it across the groups.

Lesson 20. Zhao et al. 2023 ("PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel",
VLDB, hybrid sharding) and MiCS (Zhang et al. 2022, "MiCS: Near-linear Scaling for Training
Gigantic Model on Public Cloud"): a flat ZeRO-3 over N ranks gathers and reduce-scatters every
layer across all N, so past one node every layer's traffic crosses the slow network. Hybrid
sharding splits the N = R x S data-parallel ranks into R replicas of S ranks each:

- inside a replica (the shard group, S neighbouring ranks: one node's fast links) the model is
  ZeRO-3: each unit's parameters all-gathered before use and freed after, its gradients
  reduce-scattered into each rank's (P/S,) slice (`Zero3(group=shard group)`);
- across replicas (the replicate group: the ranks holding the same slice, one per replica) the
  slice's gradient is all-reduced on P/S elements (the lab's ring, averaged), and each rank updates
  its slice with its optimizer states. The lab does it once, after the backward, exposed; FSDP2
  all-reduces each unit's slice right after that unit's reduce-scatter, on a stream of its own,
  overlapped with the rest of the backward (MiCS at the gradient-accumulation boundary): the same
  bytes and the same mean in a step of one micro-batch, while over several micro-batches FSDP2
  all-reduces after every backward unless `set_requires_all_reduce(False)` is set on all but the
  last (the lab: once per step).

Layout: rank = replica x S + s, so a shard group is S consecutive ranks; the same layout as
torch's `init_device_mesh(device, (R, S), mesh_dim_names=("replicate", "shard"))`. FSDP2's
`fully_shard(model, mesh=...)` reads a 2D mesh by position, whatever the names: dim 0 replicated,
dim 1 sharded.

Per rank per step, in elements: shard axis 3(P - P/S) (a gather in forward, again in backward,
a reduce-scatter), replicate axis 2(R-1)/R x P/S (a ring all-reduce of the slice), in the working
dtype. Memory: the model states of ZeRO-3 on S ranks, 16P/S bytes with mixed-precision Adam, R times
ZeRO-3 on N.

Every replica runs a backward before each `step()`, as every rank must under DDP: a replica that
skipped one would skip the all-reduce its replicate peers wait in.

Invariant: after every step the parameters equal one process training on the union of the N
ranks' batches (up to summation order), and the ranks of a replicate group hold bit-identical
slices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from parallel_lab import comms
from parallel_lab.zero.stage3 import Zero3

__all__ = ["HSDP", "HSDPGroups", "HSDPMesh"]


@dataclass(frozen=True)
class HSDPMesh:
    """R replicas of S ranks: `replicate` x `shard` ranks, shard groups of neighbours."""

    replicate: int = 2
    shard: int = 2

    def __post_init__(self) -> None:
        for name in ("replicate", "shard"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"HSDPMesh.{name} must be an int >= 1, got {v!r}")

    @property
    def size(self) -> int:
        return self.replicate * self.shard

    def coords(self, rank: int) -> dict[str, int]:
        """{'replicate': which replica, 'shard': which slice} of a global rank."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank must be in [0, {self.size}), got {rank}")
        r, s = divmod(rank, self.shard)
        return {"replicate": r, "shard": s}

    def groups(self, axis: str) -> list[list[int]]:
        """The groups along `axis`: "shard" (S neighbours each) or "replicate" (one rank per replica)."""
        R, S = self.replicate, self.shard
        if axis == "shard":
            return [[r * S + s for s in range(S)] for r in range(R)]
        if axis == "replicate":
            return [[r * S + s for r in range(R)] for s in range(S)]
        raise ValueError(f"axis must be 'shard' or 'replicate', got {axis!r}")

    def build(self, ctx: Any) -> HSDPGroups:
        """Create both axes' process groups (every rank calls this, in the same order); this rank's view."""
        import torch.distributed as dist

        if ctx.world_size != self.size:
            raise ValueError(
                f"HSDPMesh: replicate x shard = {self.replicate} x {self.shard} = {self.size} must equal "
                f"world_size = {ctx.world_size}"
            )
        mine = {}
        for axis in ("shard", "replicate"):
            for ranks in self.groups(axis):
                # a one-rank group too: comms read group=None as the whole world
                g = dist.group.WORLD if len(ranks) == self.size else dist.new_group(ranks)
                if ctx.rank in ranks:
                    mine[axis] = (g, ranks)
        return HSDPGroups(self, ctx.rank, mine)


@dataclass
class HSDPGroups:
    """One rank's view of an `HSDPMesh`: its coordinates and its group (handle, ranks) on each axis."""

    mesh: HSDPMesh
    rank: int
    handles: dict

    def group(self, axis: str) -> Any:
        return self.handles[axis][0]

    def ranks(self, axis: str) -> list[int]:
        return self.handles[axis][1]

    @property
    def coords(self) -> dict[str, int]:
        return self.mesh.coords(self.rank)


class HSDP(Zero3):
    """ZeRO-3 inside this rank's shard group, the gradient slice all-reduced across its replicate group.

    `HSDP(ctx, model, HSDPMesh(2, 2).build(ctx), optimizer="adam", lr=1e-3)`, then as `Zero3`:
    `loss = model(...)`, `loss.backward()`, `hsdp.step()`, `hsdp.zero_grad()`. Keyword arguments
    are Zero3's (units, prefetch, precision, ...)."""

    def __init__(
        self, ctx, model: nn.Module, groups: HSDPGroups, optimizer: Any = "adam", **kwargs: Any
    ) -> None:
        if not isinstance(groups, HSDPGroups):
            raise TypeError(
                f"groups must be the HSDPGroups of HSDPMesh(...).build(ctx), got {type(groups).__name__}"
            )
        if "group" in kwargs:
            raise ValueError("HSDP takes its shard group from `groups`; pass no `group`")
        super().__init__(ctx, model, optimizer, group=groups.group("shard"), **kwargs)
        self.mesh_groups = groups
        self.replicas = groups.mesh.replicate

    def _step_optimizer(self, grad: torch.Tensor) -> None:
        """Zero3.step's (S,) slice gradient, the mean over this replica's ranks, averaged over the
        replicas (once per step), then the update. Collective over the replicate group: `step()` runs
        on every rank, after a backward on every replica."""
        if self.replicas > 1:  # the slow axis: P/S elements, once per step
            grad = comms.ring_all_reduce(self.ctx, grad, self.mesh_groups.group("replicate"), op="avg")
        super()._step_optimizer(grad)
