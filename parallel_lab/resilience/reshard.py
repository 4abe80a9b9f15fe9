"""Re-sharding a sharded optimizer state from N ranks to N' (elastic resume on fewer ranks).

ZeRO-1 keeps rank r's slice [r*S, (r+1)*S) of one flat buffer of Psi elements, S = ceil(Psi/N);
the order of the elements does not depend on N, only where the cuts fall (and the zero
padding after Psi). So on N' ranks, new rank r' needs [r'*S', (r'+1)*S') and reads, from every
old shard k that overlaps it, just the overlapping range: no rank ever assembles the whole
state. `torch.distributed.checkpoint` does the same on load: its metadata records which byte
ranges of each tensor every file holds, and each loading rank reads the ranges its new sharding
needs (the PyTorch docs for `torch.distributed.checkpoint`, the format that saves and loads the
sharded state dicts of PyTorch FSDP: Zhao et al. 2023, *PyTorch FSDP: Experiences on Scaling
Fully Sharded Data Parallel*).

Invariant: concatenating the new shards, in rank order and cut to Psi, gives exactly the
concatenation of the old ones cut to Psi.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def overlaps(numel: int, old_world: int, new_world: int, rank: int) -> list[tuple[int, int, int, int, int]]:
    """Which pieces new rank `rank` of `new_world` reads: (old rank, its lo, its hi, our lo, our hi),
    offsets local to the old and the new shard, within [0, numel) (padding is never read)."""
    for name, v in (("numel", numel), ("old_world", old_world), ("new_world", new_world)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if not 0 <= rank < new_world:
        raise ValueError(f"rank must be in [0, {new_world}), got {rank!r}")
    s_old, s_new = math.ceil(numel / old_world), math.ceil(numel / new_world)
    lo, hi = rank * s_new, min((rank + 1) * s_new, numel)
    out = []
    for k in range(old_world):
        a, b = max(lo, k * s_old), min(hi, (k + 1) * s_old, numel)
        if a < b:
            out.append((k, a - k * s_old, b - k * s_old, a - lo, b - lo))
    return out


def reshard(numel: int, old_world: int, new_world: int, rank: int, read: Callable[[int], dict[str, torch.Tensor]],
            like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:  # fmt: skip
    """New rank `rank`'s shard of every (S,)-shaped tensor in `like` (its new shape and dtype), filled from
    `read(old_rank)` (that old rank's dict of the same names): padding stays zero."""
    out = {name: torch.zeros_like(t) for name, t in like.items()}
    for k, a, b, c, d in overlaps(numel, old_world, new_world, rank):
        old = read(k)
        for name in out:
            out[name][c:d] = old[name][a:b]
    return out


__all__ = ["overlaps", "reshard"]
