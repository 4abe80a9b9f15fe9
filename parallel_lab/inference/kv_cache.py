"""The KV cache: keys and values of past tokens, kept so a new token does not recompute them.

Pope et al. 2022, "Efficiently Scaling Transformer Inference", section 2. Generating token t+1
needs every layer's keys and values of tokens 0..t; without a cache each step recomputes them all
(a step costs O(t) times the work of one token), with it a step computes one token's and appends
them. The price is memory that grows with every token: 2 · layers · kv_heads · head_dim · tokens ·
batch · bytes (`costmodel.kv_cache_bytes`).

A cache here is anything with three methods the serving model calls (`model.ServingGPT`):
  positions(batch, t, device) -> (B, t) absolute positions of the new tokens
  attend(layer, q, k, v)      -> attention output of the new queries over the cached keys and the new ones
  advance(t)                  after the last layer: the new tokens are now cached
`NoCache` recomputes everything (the reference); `KVCache` keeps one tensor per layer that grows by
one token per step (measured bytes = the formula exactly); `paged.PagedKVCache` keeps fixed-size
blocks in a pool shared by many sequences.

Invariant: greedy generation gives the same tokens with any cache as with `NoCache`.
"""

from __future__ import annotations

import torch

from parallel_lab.inference.attention import causal_attention

__all__ = ["KVCache", "NoCache"]


class NoCache:
    """Nothing kept: the model sees the whole sequence every call (the reference)."""

    def positions(self, batch: int, t: int, device) -> torch.Tensor:
        return torch.arange(t, device=device).expand(batch, t)  # (B, t)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return causal_attention(q, k, v, 0)  # (B, nh, t, hd)

    def advance(self, t: int) -> None:
        pass


class KVCache:
    """One (B, kv_heads, tokens, head_dim) key tensor and one value tensor per layer, growing by
    concatenation: after each step the live bytes are exactly those of the cached tokens."""

    def __init__(self) -> None:
        self.k: list[torch.Tensor] = []  # per layer: (B, kvh, L, hd)
        self.v: list[torch.Tensor] = []
        self.length = 0  # tokens cached (the same in every layer between calls)

    def positions(self, batch: int, t: int, device) -> torch.Tensor:
        return torch.arange(self.length, self.length + t, device=device).expand(batch, t)  # (B, t)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new tokens' keys and values (B, kvh, t, hd) to `layer`; returns all of them."""
        if layer == len(self.k):  # first call for this layer
            self.k.append(k.contiguous())
            self.v.append(v.contiguous())
        else:
            self.k[layer] = torch.cat([self.k[layer], k], dim=2)  # (B, kvh, L + t, hd)
            self.v[layer] = torch.cat([self.v[layer], v], dim=2)
        return self.k[layer], self.v[layer]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        start = self.length  # positions before this call's tokens
        k_all, v_all = self.update(layer, k, v)  # (B, kvh, start + t, hd)
        return causal_attention(q, k_all, v_all, start)  # (B, nh, t, hd)

    def advance(self, t: int) -> None:
        self.length += t

    def nbytes(self) -> int:
        """Bytes of the storages the cache holds (measured from the tensors, not from a formula)."""
        return sum(t.untyped_storage().nbytes() for t in self.k + self.v)
