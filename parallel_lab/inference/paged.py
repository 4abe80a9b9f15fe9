"""A paged KV cache: fixed-size blocks in one pool, a block table per sequence.

Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with
PagedAttention" (vLLM). A server that gives each sequence one contiguous buffer must reserve the
longest length it may reach, so a batch of short answers wastes most of it (the paper measures
60-80% of KV memory wasted this way). Paging borrows the operating system's answer: the cache is
a pool of blocks of `block_size` tokens; a sequence gets a block when it fills the last one, and
its block table maps position p to (table[p // block_size], p % block_size). The only waste left
is the unfilled tail of each sequence's last block, under block_size tokens per sequence.

`PagedKVCache` holds the pool and the tables; `cache.view(seq_ids)` is a cache the serving model
can run on (the interface of `kv_cache.py`), for a batch of sequences of different lengths.

Invariant: a block belongs to at most one sequence; `free` returns every block of a sequence to
the pool; tokens read back through a table are the ones written (generation through a paged view
gives the tokens of a plain `KVCache`, test).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from parallel_lab.costmodel import kv_cache_bytes
from parallel_lab.inference.attention import causal_attention

__all__ = ["BlockAllocator", "OutOfBlocks", "PagedKVCache", "PagedView", "fragmentation"]


class OutOfBlocks(RuntimeError):
    """The pool has no free block left (a scheduler waits or preempts a sequence)."""


class BlockAllocator:
    """A free list of block ids 0..num_blocks-1."""

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.free_ids = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...

    def allocate(self) -> int:
        if not self.free_ids:
            raise OutOfBlocks(f"all {self.num_blocks} blocks are in use")
        return self.free_ids.pop()

    def free(self, ids: list[int]) -> None:
        self.free_ids.extend(reversed(ids))

    @property
    def used(self) -> int:
        return self.num_blocks - len(self.free_ids)


class PagedKVCache:
    """A pool of `num_blocks` blocks of `block_size` tokens for every layer, shared by sequences."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, block_size: int = 16, num_blocks: int = 64,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):  # fmt: skip
        for name, v in (
            ("layers", layers),
            ("kv_heads", kv_heads),
            ("head_dim", head_dim),
            ("block_size", block_size),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self.layers, self.kv_heads, self.head_dim, self.block_size = layers, kv_heads, head_dim, block_size
        self.allocator = BlockAllocator(num_blocks)
        shape = (layers, num_blocks, block_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (L, blocks, bs, kvh, hd)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    @classmethod
    def for_model(cls, model, block_size: int = 16, num_blocks: int = 64) -> PagedKVCache:
        """A pool shaped for a `ServingGPT` (its layers, KV heads, head size, dtype and device)."""
        w = model.wte.weight
        return cls(
            len(model.blocks), model.kv_heads, model.head_dim, block_size, num_blocks, w.dtype, w.device
        )

    # -- sequences ---------------------------------------------------------------
    def add(self, seq_id: int) -> None:
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} is already in the cache")
        self.tables[seq_id], self.lengths[seq_id] = [], 0

    def reserve(self, seq_id: int, t: int) -> None:
        """Make room for `t` more tokens of `seq_id`, taking blocks from the pool as needed."""
        need = math.ceil((self.lengths[seq_id] + t) / self.block_size) - len(self.tables[seq_id])
        got = []
        try:
            for _ in range(need):
                got.append(self.allocator.allocate())
        except OutOfBlocks:
            self.allocator.free(got)  # all or nothing
            raise
        self.tables[seq_id].extend(got)

    def free(self, seq_id: int) -> None:
        self.allocator.free(self.tables.pop(seq_id))
        del self.lengths[seq_id]

    def blocks_needed(self, seq_id: int | None, t: int) -> int:
        have, length = (0, 0) if seq_id is None else (len(self.tables[seq_id]), self.lengths[seq_id])
        return math.ceil((length + t) / self.block_size) - have

    # -- reading and writing -----------------------------------------------------
    def _slots(self, seq_id: int, start: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, start + t)
        table = torch.tensor(self.tables[seq_id], dtype=torch.long)
        return table[pos // self.block_size], pos % self.block_size  # (t,) block ids, (t,) offsets

    def write(self, layer: int, seq_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store keys/values (kvh, t, hd) of positions lengths[seq_id] .. +t-1 (blocks reserved first)."""
        blocks, offs = self._slots(seq_id, self.lengths[seq_id], k.shape[1])
        blocks, offs = blocks.to(self.k.device), offs.to(self.k.device)
        self.k[layer, blocks, offs] = k.transpose(0, 1)  # (t, kvh, hd) into t slots
        self.v[layer, blocks, offs] = v.transpose(0, 1)

    def read(self, layer: int, seq_id: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (kvh, length, hd) of positions 0..length-1, gathered through the block table."""
        blocks, offs = self._slots(seq_id, 0, length)
        blocks, offs = blocks.to(self.k.device), offs.to(self.k.device)
        return self.k[layer, blocks, offs].transpose(0, 1), self.v[layer, blocks, offs].transpose(0, 1)

    def view(self, seq_ids: list[int]) -> PagedView:
        return PagedView(self, list(seq_ids))

    # -- what it holds -----------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        return kv_cache_bytes(
            self.layers, self.kv_heads, self.head_dim, self.block_size, 1, self.k.element_size()
        )

    def bytes_in_use(self) -> int:
        """Bytes of the blocks that sequences hold (the pool itself is allocated once)."""
        return self.allocator.used * self.block_bytes

    def bytes_filled(self) -> int:
        """Bytes of the tokens actually cached."""
        per_token = self.block_bytes // self.block_size
        return sum(self.lengths.values()) * per_token


class PagedView:
    """The cache interface (`positions`, `attend`, `advance`) for a batch of sequences in the pool.

    Rows of the batch have different lengths, so attention runs row by row over each row's own
    blocks; projections and MLPs still run on the whole batch."""

    def __init__(self, cache: PagedKVCache, seq_ids: list[int]) -> None:
        self.cache, self.seq_ids = cache, seq_ids

    def positions(self, batch: int, t: int, device) -> torch.Tensor:
        if batch != len(self.seq_ids):
            raise ValueError(f"a batch of {batch} rows for a view of {len(self.seq_ids)} sequences")
        starts = torch.tensor([self.cache.lengths[s] for s in self.seq_ids], device=device)
        for s in self.seq_ids:
            self.cache.reserve(s, t)
        return starts[:, None] + torch.arange(t, device=device)  # (B, t)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = []
        for row, s in enumerate(self.seq_ids):
            start, t = self.cache.lengths[s], q.shape[2]
            self.cache.write(layer, s, k[row], v[row])  # (kvh, t, hd)
            k_all, v_all = self.cache.read(layer, s, start + t)  # (kvh, start + t, hd)
            out.append(causal_attention(q[row : row + 1], k_all[None], v_all[None], start))  # (1, nh, t, hd)
        return torch.cat(out)  # (B, nh, t, hd)

    def advance(self, t: int) -> None:
        for s in self.seq_ids:
            self.cache.lengths[s] += t


@dataclass
class Fragmentation:
    """Bytes for a batch of sequences: filled, reserved by contiguous buffers of max length, by pages."""

    filled: int
    contiguous: int
    paged: int

    @property
    def contiguous_waste(self) -> float:
        return 1 - self.filled / self.contiguous

    @property
    def paged_waste(self) -> float:
        return 1 - self.filled / self.paged


def fragmentation(lengths: list[int], max_len: int, block_size: int, bytes_per_token: int) -> Fragmentation:
    """The formula the measured pool is checked against: a contiguous server reserves max_len tokens
    per sequence, a paged one ceil(length / block_size) blocks."""
    if any(n > max_len for n in lengths):
        raise ValueError(f"a length exceeds max_len ({max_len}): {max(lengths)}")
    filled = sum(lengths) * bytes_per_token
    paged = sum(math.ceil(n / block_size) for n in lengths) * block_size * bytes_per_token
    return Fragmentation(filled, len(lengths) * max_len * bytes_per_token, paged)
