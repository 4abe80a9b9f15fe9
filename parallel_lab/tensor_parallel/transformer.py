"""Tensor-parallel transformer: attention split by heads, Megatron MLP, block, and a whole TinyGPT.

Shoeybi et al. 2019 (Megatron-LM) §3, Fig. 3b: heads are independent, so the q, k, v
projections are split by columns (each rank gets whole heads) and attention runs on
local heads with no communication; the output projection is split by rows and its
partial sums are added by one all-reduce, exactly like the MLP. A layer (attention +
MLP) thus all-reduces a (b, s, h) tensor twice in forward and twice in backward.
Sequence parallelism (Korthikanti et al. 2022) runs LayerNorm and the residual stream
on s/tp tokens per rank and swaps those all-reduces for all-gathers and reduce-scatters.

Embeddings, the final LayerNorm and the head stay replicated here: every TP rank holds
them whole, computes the same values and gets the same gradients (Megatron also splits
the vocabulary; a tiny vocab does not need it).

Invariant: `TensorParallelGPT(ctx, model)` computes the same loss as `model` on the
same batch (every TP rank gets the whole batch: TP splits weights, not data), and
after `backward` (+ `sync_grads`) each shard's gradient is that slice of the model's.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel_lab.comms import ring_bytes_per_rank
from parallel_lab.costmodel import tp_activation_bytes_per_layer  # noqa: F401 - a formula; lesson 08 reads it here
from parallel_lab.tensor_parallel.layers import (
    ColumnParallelLinear,
    ParallelMLP,
    RowParallelLinear,
    dropout,
    dropout_generator,
)
from parallel_lab.tensor_parallel.operators import check_divisible, column_shard, row_shard, tp_size_rank
from parallel_lab.tensor_parallel.sequence_parallel import (
    gather_from_sequence_region,
    mark_sequence_parallel,
    scatter_to_sequence_region,
)
from parallel_lab.tensor_parallel.sequence_parallel import sync_sequence_parallel_grads as _sync


class ParallelSelfAttention(nn.Module):
    """Causal self-attention on n_heads/tp local heads: qkv by columns (whole heads), proj by rows."""

    def __init__(self, ctx, d_model: int, n_heads: int, group: Any = None, sequence_parallel: bool = False,
                 regather: bool = False, dropout: float = 0.0, impl: str = "ring", seed: int | None = None):  # fmt: skip
        super().__init__()
        tp, tp_rank = tp_size_rank(ctx, group)
        check_divisible("d_model", d_model, n_heads, f"n_heads ({n_heads})")
        self.local_heads = check_divisible("n_heads", n_heads, tp)
        self.head_dim = d_model // n_heads
        seed = ctx.seed if seed is None else seed
        kw = dict(group=group, sequence_parallel=sequence_parallel, impl=impl)
        # partitions=3: q, k and v are split separately, so this rank gets the same heads of each
        self.qkv = ColumnParallelLinear(
            ctx, d_model, 3 * d_model, partitions=3, regather=regather, seed=seed, **kw
        )
        self.proj = RowParallelLinear(ctx, d_model, d_model, seed=seed + 1, **kw)
        self.p = dropout
        self.gen = dropout_generator(ctx, dropout, True, tp_rank)  # different heads: different masks

    @classmethod
    def from_attention(cls, ctx, attn: nn.Module, group: Any = None, **kw: Any) -> ParallelSelfAttention:
        """Shard a `models.CausalSelfAttention` for this rank."""
        kw.setdefault("dropout", getattr(attn, "dropout", 0.0))
        layer = cls(ctx, attn.qkv.in_features, attn.n_heads, group, **kw)
        q, r = layer.qkv, layer.proj
        common = dict(sequence_parallel=q.sequence_parallel, impl=q.impl)
        layer.qkv = ColumnParallelLinear.from_linear(
            ctx, attn.qkv, group, partitions=3, regather=q.regather, **common
        )
        layer.proj = RowParallelLinear.from_linear(ctx, attn.proj, group, sequence_parallel=r.sequence_parallel,
                                                   impl=r.impl)  # fmt: skip
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # (B, T, 3C/tp): q, k, v of the local heads (T whole, even from a shard)
        B, T, _ = qkv.shape
        nh, hd = self.local_heads, self.head_dim
        q, k, v = qkv.split(nh * hd, dim=2)  # 3 x (B, T, C/tp)
        q = q.view(B, T, nh, hd).transpose(1, 2)  # (B, nh/tp, T, hd)
        k = k.view(B, T, nh, hd).transpose(1, 2)  # (B, nh/tp, T, hd)
        v = v.view(B, T, nh, hd).transpose(1, 2)  # (B, nh/tp, T, hd)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))  # (B, nh/tp, T, T)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)  # (T, T)
        att = F.softmax(att.masked_fill(mask, float("-inf")), dim=-1)  # (B, nh/tp, T, T)
        att = dropout(att, self.p, self.training, self.gen)
        y = (
            (att @ v).transpose(1, 2).contiguous().view(B, T, nh * hd)
        )  # (B, T, C/tp): local heads side by side
        return self.proj(y)  # (B, T, C), or (B, T/tp, C) with sequence parallelism


class ParallelBlock(nn.Module):
    """Pre-LN block: x + attn(ln1(x)), x + mlp(ln2(x)). LayerNorms run on what the rank holds:
    the whole sequence (replicated) or, with `sequence_parallel`, its own tokens."""

    def __init__(self, ctx, d_model: int, n_heads: int, group: Any = None, sequence_parallel: bool = False,
                 regather: bool = False, dropout: float = 0.0, impl: str = "ring", seed: int | None = None):  # fmt: skip
        super().__init__()
        seed = ctx.seed if seed is None else seed
        kw = dict(
            group=group, sequence_parallel=sequence_parallel, regather=regather, dropout=dropout, impl=impl
        )
        self.ln1 = nn.LayerNorm(d_model, device=ctx.device)
        self.attn = ParallelSelfAttention(ctx, d_model, n_heads, seed=seed, **kw)
        self.ln2 = nn.LayerNorm(d_model, device=ctx.device)
        self.mlp = ParallelMLP(ctx, d_model, 4 * d_model, seed=seed + 2, **kw)
        self.sequence_parallel = sequence_parallel
        if sequence_parallel:
            mark_sequence_parallel(self.ln1.weight, self.ln1.bias, self.ln2.weight, self.ln2.bias)

    @classmethod
    def from_block(cls, ctx, block: nn.Module, group: Any = None, **kw: Any) -> ParallelBlock:
        """Shard a `models.Block` for this rank (LayerNorms copied whole)."""
        attn = block.attn
        kw.setdefault("dropout", getattr(attn, "dropout", 0.0))
        layer = cls(ctx, attn.qkv.in_features, attn.n_heads, group, **kw)
        kw.pop("dropout")
        layer.attn = ParallelSelfAttention.from_attention(ctx, attn, group, **kw)
        layer.mlp = ParallelMLP.from_mlp(ctx, block.mlp, group, **kw)
        layer.ln1.load_state_dict(block.ln1.state_dict())
        layer.ln2.load_state_dict(block.ln2.state_dict())
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))  # (B, T, C), or (B, T/tp, C) with sequence parallelism
        return x + self.mlp(self.ln2(x))


class TensorParallelGPT(nn.Module):
    """A `models.TinyGPT` with every block tensor-parallel over `group` (embeddings, ln_f and
    the tied head replicated). `forward(idx, targets)` as TinyGPT; call `sync_grads()` after
    backward (it sums the sequence-parallel parameters' gradients; a no-op without SP)."""

    def __init__(self, ctx, model: nn.Module, group: Any = None, sequence_parallel: bool = False,
                 regather: bool = False, impl: str = "ring"):  # fmt: skip
        super().__init__()
        self.ctx, self.group, self.impl, self.cfg = ctx, group, impl, model.cfg
        self.tp, _ = tp_size_rank(ctx, group)
        check_divisible("n_heads", model.cfg.n_heads, self.tp)
        self.sequence_parallel = sequence_parallel
        base = copy.deepcopy(model).to(ctx.device)  # one deepcopy keeps the wte/lm_head tie
        self.wte, self.wpe, self.ln_f, self.lm_head = base.wte, base.wpe, base.ln_f, base.lm_head
        kw = dict(sequence_parallel=sequence_parallel, regather=regather, impl=impl)
        self.blocks = nn.ModuleList(ParallelBlock.from_block(ctx, b, group, **kw) for b in model.blocks)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        B, T = idx.shape
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length {T} exceeds GPTConfig.seq_len={self.cfg.seq_len}")
        if self.sequence_parallel and T % self.tp:
            raise ValueError(
                f"sequence length ({T}) must be divisible by the tensor-parallel size ({self.tp}) "
                "with sequence_parallel=True"
            )
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C), the same on every TP rank
        if self.sequence_parallel:
            x = scatter_to_sequence_region(self.ctx, x, self.group, self.impl)  # (B, T/tp, C)
        for block in self.blocks:
            x = block(x)
        if self.sequence_parallel:  # the head is replicated: its gradient is whole on every rank
            x = gather_from_sequence_region(self.ctx, x, self.group, self.impl, grad_is_partial=False)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T))

    def sync_grads(self) -> int:
        """Sum the gradients of parameters used on sequence shards over the TP group."""
        return _sync(self.ctx, self, self.group, self.impl) if self.sequence_parallel else 0

    def diff_to(self, model: nn.Module, grads: bool = False) -> dict[str, float]:
        """Max |ours - reference| per parameter (or its gradient), each shard against the
        matching slice (`column_shard` / `row_shard`) of the single-process `model`'s tensor."""
        out = {}
        for name, mod in self.named_modules():
            for pname, mine in mod.named_parameters(recurse=False):
                full = model.get_submodule(name).get_parameter(pname)
                a, b = (mine.grad, full.grad) if grads else (mine, full)
                if a is None or b is None:
                    if (a is None) != (b is None):
                        out[f"{name}.{pname}"] = float("inf")  # one side has a gradient, the other none
                    continue
                if isinstance(mod, ColumnParallelLinear):
                    b = column_shard(b, mod.tp, mod.tp_rank, mod.partitions)
                elif isinstance(mod, RowParallelLinear) and pname == "weight":
                    b = row_shard(b, mod.tp, mod.tp_rank)
                out[f"{name}.{pname}"] = (a.detach() - b.detach().to(a.device)).abs().max().item()
        return out


# ----------------------------------------------------------------------------- formulas
def tp_comm_bytes_per_layer(batch: int, seq: int, hidden: int, tp: int, itemsize: int = 4,
                            sequence_parallel: bool = False, regather: bool = False) -> list[int]:  # fmt: skip
    """Bytes each TP rank sends for one layer's forward + backward (ring collectives), per rank.

    Korthikanti et al. 2022 (tensor parallelism, as in Megatron-LM): attention and MLP each all-reduce x = b·s·h once forward and once backward,
    and an all-reduce is two phases (reduce-scatter, all-gather) of x each: 4 all-reduces,
    8x per layer, "8·b·s·h". On a ring a phase moves (p-1)/p of x per rank, so exactly
    8·(p-1)/p·b·s·h elements when p divides b·s·h. Sequence parallelism: 4 reduce-scatters
    + 4 all-gathers of the same x, the same bytes; `regather` adds 2 all-gathers in backward.
    """
    for name, v in (("batch", batch), ("seq", seq), ("hidden", hidden), ("tp", tp), ("itemsize", itemsize)):
        check_divisible(name, v, 1)
    x = batch * seq * hidden
    if not sequence_parallel:
        return [4 * s for s, _ in ring_bytes_per_rank(x, tp, itemsize, "all_reduce")]
    check_divisible("seq", seq, tp)
    rs = ring_bytes_per_rank(x, tp, itemsize, "reduce_scatter")
    ag = ring_bytes_per_rank(x, tp, itemsize, "all_gather")
    return [4 * a + (6 if regather else 4) * b for (a, _), (b, _) in zip(rs, ag)]
