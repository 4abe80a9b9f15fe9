"""A data sampler whose position is part of the checkpoint, so a resumed run neither skips nor
repeats a sample, even on another number of ranks.

Every epoch is one permutation of the dataset drawn from (seed, epoch); a step takes the next
`global_batch` positions of it, and rank r of N takes the r-th of N equal slices. The state is
three integers (seed, epoch, offset), the same on every rank, so it is saved once. After a
restart on N' ranks the next step takes the same positions, sliced N' ways: over an epoch every
sample is used exactly once, whatever happened. (torch's `DistributedSampler` instead fixes the
rank's share of the epoch up front, by rank and world size, and keeps no position: a resumed
run starts its epoch over, and a run on a different world size reads different shares.)

Invariant: the concatenation of what the ranks take at a step is the next `global_batch`
positions of the epoch's permutation (an epoch's tail continues into the next epoch).
"""

from __future__ import annotations

import torch


class ResumableSampler:
    """`take(global_batch)` -> the step's indices; `state_dict()` / `load_state_dict()` resume it."""

    def __init__(self, n_samples: int, seed: int = 0) -> None:
        for name, v, low in (("n_samples", n_samples, 1), ("seed", seed, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
        self.n, self.seed = n_samples, seed
        self.epoch, self.offset = 0, 0

    def order(self, epoch: int) -> torch.Tensor:
        """The epoch's permutation of range(n): the same for every rank and every world size."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.n, generator=g)  # (n,)

    def take(self, global_batch: int) -> list[tuple[int, int]]:
        """The next `global_batch` (epoch, index) pairs, in order; advances the position."""
        if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
            raise ValueError(f"global_batch must be a positive int, got {global_batch!r}")
        out: list[tuple[int, int]] = []
        while len(out) < global_batch:
            perm = self.order(self.epoch)
            k = min(global_batch - len(out), self.n - self.offset)
            out += [(self.epoch, int(i)) for i in perm[self.offset : self.offset + k]]
            self.offset += k
            if self.offset == self.n:
                self.epoch, self.offset = self.epoch + 1, 0
        return out

    def rank_slice(self, batch: list, rank: int, world_size: int) -> list:
        """Rank `rank`'s share of a step's batch: equal contiguous slices (the batch must divide)."""
        if len(batch) % world_size:
            raise ValueError(
                f"world_size {world_size} must divide the global batch ({len(batch)}): every rank takes an equal share"
            )
        b = len(batch) // world_size
        return batch[rank * b : (rank + 1) * b]

    def state_dict(self) -> dict:
        return {"n_samples": self.n, "seed": self.seed, "epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        if state.get("n_samples") != self.n or state.get("seed") != self.seed:
            raise ValueError(
                f"state is for a sampler over {state.get('n_samples')} samples with seed {state.get('seed')}, "
                f"this one has {self.n} and seed {self.seed}"
            )
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])


__all__ = ["ResumableSampler"]
