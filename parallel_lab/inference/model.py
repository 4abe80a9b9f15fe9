"""The lab's TinyGPT arranged for serving: separate q and kv projections, any cache, greedy generation.

Radford et al. 2019 (GPT-2) for the decoder; Ainslie et al. 2023, "GQA: Training Generalized
Multi-Query Transformer Models from Multi-Head Checkpoints": grouped-query attention gives each
group of n_heads / kv_heads query heads one shared key/value head, and section 2.1 turns a
multi-head checkpoint into a grouped one by mean-pooling the key and value heads of each group
(then a short "uptraining"; the lab pools and measures what pooling alone costs). Shazeer 2019
("Fast Transformer Decoding: One Write-Head is All You Need") is the case kv_heads = 1.

`ServingGPT.from_gpt(model, kv_heads)` copies a `models.TinyGPT`: with kv_heads = n_heads its
logits equal the model's (test); fewer KV heads shrink the cache by n_heads / kv_heads.
`ServingBlock` takes its projections as modules, so the tensor-parallel server (`parallel.py`)
builds the same block from lesson 08's Column/RowParallelLinear.

Invariant: `generate(model, prompt, n, cache)` returns the same tokens for every cache
(`NoCache`, `KVCache`, a paged view): a cache changes the cost of a step, never its result.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn as nn

from parallel_lab.inference.kv_cache import KVCache, NoCache
from parallel_lab.models import GPTConfig, TinyGPT, build_model, synthetic_batch, train_reference

__all__ = ["ServingBlock", "ServingGPT", "generate", "trained_gpt"]


def _pool_heads(w: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """(heads * hd, ...) -> (kv_heads * hd, ...): the mean of each group of heads (GQA section 2.1)."""
    g = heads // kv_heads
    return w.reshape(kv_heads, g, -1, *w.shape[1:]).mean(dim=1).reshape(-1, *w.shape[1:])


class ServingBlock(nn.Module):
    """Pre-LN block with attention through a cache: x + attn(ln1(x)), x + mlp(ln2(x)).

    `q` maps C to heads * hd, `kv` to 2 * kv_heads * hd (keys then values), `proj` back to C;
    `heads`/`kv_heads` are the heads this block computes (all of them, or one rank's share)."""

    def __init__(self, ln1: nn.Module, q: nn.Module, kv: nn.Module, proj: nn.Module, ln2: nn.Module,
                 mlp: nn.Module, heads: int, kv_heads: int, head_dim: int):  # fmt: skip
        super().__init__()
        self.ln1, self.q, self.kv, self.proj, self.ln2, self.mlp = ln1, q, kv, proj, ln2, mlp
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim

    def forward(self, x: torch.Tensor, cache, layer: int) -> torch.Tensor:
        B, t, _ = x.shape
        nh, kvh, hd = self.heads, self.kv_heads, self.head_dim
        h = self.ln1(x)  # (B, t, C)
        q = self.q(h).view(B, t, nh, hd).transpose(1, 2)  # (B, nh, t, hd)
        k, v = self.kv(h).split(kvh * hd, dim=2)  # 2 x (B, t, kvh*hd)
        k = k.reshape(B, t, kvh, hd).transpose(1, 2)  # (B, kvh, t, hd)
        v = v.reshape(B, t, kvh, hd).transpose(1, 2)  # (B, kvh, t, hd)
        y = cache.attend(layer, q, k, v)  # (B, nh, t, hd)
        x = x + self.proj(y.transpose(1, 2).reshape(B, t, nh * hd))  # (B, t, C)
        return x + self.mlp(self.ln2(x))


class ServingGPT(nn.Module):
    """Embeddings, `ServingBlock`s, final LayerNorm and head. `forward(idx, cache)` -> logits of the
    new tokens (B, t, V); the cache is advanced by t."""

    def __init__(self, cfg: GPTConfig, wte: nn.Module, wpe: nn.Module, blocks: list[ServingBlock],
                 ln_f: nn.Module, lm_head: nn.Module, kv_heads: int):  # fmt: skip
        super().__init__()
        self.cfg, self.kv_heads = cfg, kv_heads
        self.wte, self.wpe, self.ln_f, self.lm_head = wte, wpe, ln_f, lm_head
        self.blocks = nn.ModuleList(blocks)

    @property
    def head_dim(self) -> int:
        return self.cfg.d_model // self.cfg.n_heads

    @classmethod
    def from_gpt(cls, model: TinyGPT, kv_heads: int | None = None) -> ServingGPT:
        """A copy of `model` (weights copied, not shared); `kv_heads` < n_heads pools key/value heads."""
        cfg = model.cfg
        nh, C = cfg.n_heads, cfg.d_model
        kvh = nh if kv_heads is None else kv_heads
        if isinstance(kvh, bool) or not isinstance(kvh, int) or kvh < 1 or nh % kvh:
            raise ValueError(f"kv_heads must be a positive divisor of n_heads ({nh}), got {kv_heads!r}")
        base = copy.deepcopy(model)  # one deepcopy keeps the wte/lm_head tie
        hd = C // nh
        blocks = []
        for b in base.blocks:
            w, bias = b.attn.qkv.weight.detach(), b.attn.qkv.bias.detach()  # (3C, C), (3C,)
            dev, dt = w.device, w.dtype
            q = nn.Linear(C, C, device=dev, dtype=dt)
            kv = nn.Linear(C, 2 * kvh * hd, device=dev, dtype=dt)
            with torch.no_grad():
                q.weight.copy_(w[:C]), q.bias.copy_(bias[:C])
                kw, vw = (
                    _pool_heads(w[C : 2 * C], nh, kvh),
                    _pool_heads(w[2 * C :], nh, kvh),
                )  # (kvh*hd, C) each
                kb, vb = _pool_heads(bias[C : 2 * C], nh, kvh), _pool_heads(bias[2 * C :], nh, kvh)
                kv.weight.copy_(torch.cat([kw, vw])), kv.bias.copy_(torch.cat([kb, vb]))
            blocks.append(ServingBlock(b.ln1, q, kv, b.attn.proj, b.ln2, b.mlp, nh, kvh, hd))
        return cls(cfg, base.wte, base.wpe, blocks, base.ln_f, base.lm_head, kvh)

    def embed(self, idx: torch.Tensor, cache) -> torch.Tensor:
        B, t = idx.shape
        pos = cache.positions(B, t, idx.device)  # (B, t)
        if int(pos.max()) >= self.cfg.seq_len:
            raise ValueError(
                f"position {int(pos.max())} is past the model's context (GPTConfig.seq_len={self.cfg.seq_len})"
            )
        return self.wte(idx) + self.wpe(pos)  # (B, t, C)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))  # (B, t, V)

    def forward(self, idx: torch.Tensor, cache=None) -> torch.Tensor:
        cache = NoCache() if cache is None else cache
        x = self.embed(idx, cache)  # (B, t, C)
        for i, block in enumerate(self.blocks):
            x = block(x, cache, i)
        cache.advance(idx.shape[1])
        return self.head(x)  # (B, t, V)


@torch.no_grad()
def generate(model: ServingGPT, prompt: torch.Tensor, new_tokens: int, cache: KVCache | NoCache | None = None,
             on_token: Callable[[int, object], None] | None = None) -> torch.Tensor:  # fmt: skip
    """Greedy decoding: `new_tokens` tokens after `prompt` (B, T0). Returns (B, T0 + new_tokens).

    With a cache the prompt goes through once (prefill), then one token per step (decode); with
    `NoCache` every step runs the whole sequence so far. `on_token(i, cache)` runs after token i.
    """
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1:
        raise ValueError(f"new_tokens must be a positive int, got {new_tokens!r}")
    if prompt.dim() != 2 or prompt.shape[1] < 1:
        raise ValueError(f"prompt must be (batch, tokens) with at least one token, got {tuple(prompt.shape)}")
    if prompt.shape[1] + new_tokens > model.cfg.seq_len:
        raise ValueError(
            f"prompt ({prompt.shape[1]}) + new_tokens ({new_tokens}) must fit the context "
            f"(GPTConfig.seq_len={model.cfg.seq_len})"
        )
    cache = NoCache() if cache is None else cache
    seq = prompt
    feed = prompt  # what the model has not seen yet
    for i in range(new_tokens):
        logits = model(seq if isinstance(cache, NoCache) else feed, cache)  # (B, t, V)
        nxt = logits[:, -1].argmax(dim=-1, keepdim=True)  # (B, 1)
        seq = torch.cat([seq, nxt], dim=1)
        feed = nxt
        if on_token is not None:
            on_token(i, cache)
    return seq


def trained_gpt(cfg: GPTConfig | None = None, steps: int = 150, seed: int = 0) -> TinyGPT:
    """A TinyGPT trained on the lab's synthetic token sequences (t[i+1] = 5 t[i] + 3 mod vocab, 10%
    noise), so greedy generation continues a prompt the way the data does (seconds on a CPU)."""
    cfg = cfg or GPTConfig(vocab=64, seq_len=64, d_model=64, n_heads=8, n_layers=2)
    model = build_model(cfg, seed)
    batches = [
        synthetic_batch("tokens", 16, seq_len=cfg.seq_len, vocab=cfg.vocab, seed=seed + i) for i in range(8)
    ]
    with torch.random.fork_rng(devices=[]):
        train_reference(model, batches, optimizer="adam", lr=3e-3, steps=steps)
    return model.eval()
