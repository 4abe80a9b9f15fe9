"""How the sequence is laid out over the ranks of a context-parallel group.

Contiguous: rank r holds tokens [r*T/N, (r+1)*T/N). With a causal mask that is unfair: the
first rank's queries see only their own block, the last rank's see every block.
Zigzag (the load-balanced layout used with ring attention; Llama 3's context parallelism,
Dubey et al. 2024, balances the same way): cut the sequence into 2N chunks and give rank r
chunks r and 2N-1-r, an early one and a late one, so every rank sees the same number of
visible (query, key) pairs.

Invariant: `unshard_sequence([shard_sequence(x, r, N, dim=d, zigzag=z) for r in range(N)],
dim=d, zigzag=z)` equals x, and `positions` gives the absolute position of every local token.
"""

from __future__ import annotations

import torch


def _check_world(rank: int, world_size: int) -> None:
    for name, v in (("world_size", world_size), ("rank", rank)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name} must be an int, got {v!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size) = [0, {world_size}), got rank={rank}")


def check_splittable(length: int, world_size: int, zigzag: bool) -> None:
    """ValueError naming the length and the rule when the layout cannot split it evenly."""
    parts = 2 * world_size if zigzag else world_size
    if length % parts:
        rule = (
            f"2 x world_size = {parts} (zigzag gives each rank two chunks)"
            if zigzag
            else f"world_size = {parts}"
        )
        raise ValueError(f"sequence length {length} cannot be split: it must be divisible by {rule}")


def chunk_ids(rank: int, world_size: int, zigzag: bool = False) -> list[int]:
    """The chunks rank `rank` holds, in the order they sit in its part: [r], or [r, 2N-1-r] with zigzag."""
    _check_world(rank, world_size)
    return [rank, 2 * world_size - 1 - rank] if zigzag else [rank]


def shard_sequence(
    x: torch.Tensor, rank: int, world_size: int, *, dim: int, zigzag: bool = False
) -> torch.Tensor:
    """This rank's part of `x` along `dim`: one contiguous chunk, or chunks r and 2N-1-r concatenated."""
    _check_world(rank, world_size)
    length = x.shape[dim]
    check_splittable(length, world_size, zigzag)
    if not zigzag:
        n = length // world_size
        return x.narrow(dim, rank * n, n)
    c = length // (2 * world_size)
    return torch.cat([x.narrow(dim, i * c, c) for i in chunk_ids(rank, world_size, True)], dim=dim)


def unshard_sequence(parts: list[torch.Tensor], *, dim: int, zigzag: bool = False) -> torch.Tensor:
    """The ranks' parts (in rank order) put back into the whole sequence along `dim`."""
    if not parts or any(p.shape != parts[0].shape for p in parts):
        raise ValueError(
            f"parts must be one tensor per rank, all of one shape; got shapes {[tuple(p.shape) for p in parts]}"
        )
    if not zigzag:
        return torch.cat(list(parts), dim=dim)
    n = len(parts)
    if parts[0].shape[dim] % 2:
        raise ValueError(
            f"a zigzag part holds two equal chunks: its length {parts[0].shape[dim]} must be even"
        )
    chunks: list[torch.Tensor | None] = [None] * (2 * n)
    for r, part in enumerate(parts):
        early, late = part.chunk(2, dim=dim)
        chunks[r], chunks[2 * n - 1 - r] = early, late
    return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]


def positions(rank: int, world_size: int, seq_len: int, *, zigzag: bool = False, device=None) -> torch.Tensor:
    """Absolute positions (0..seq_len-1) of the tokens this rank holds, in its local order."""
    return shard_sequence(torch.arange(seq_len, device=device), rank, world_size, dim=0, zigzag=zigzag)


def causal_work(rank: int, world_size: int, seq_len: int, *, zigzag: bool = False) -> int:
    """Visible (query, key) pairs of this rank's queries under a causal mask: its share of the work.

    Counted from the positions, independently of any attention code: query at position i sees i+1 keys."""
    return int((positions(rank, world_size, seq_len, zigzag=zigzag) + 1).sum())


__all__ = ["causal_work", "check_splittable", "chunk_ids", "positions", "shard_sequence", "unshard_sequence"]
