"""Parameter sharing and a factorized embedding: ALBERT's two ways to a smaller transformer.

Lan et al. 2019, "ALBERT: A Lite BERT for Self-supervised Learning of Language Representations".
Cross-layer sharing: one block's weights used by every layer, so depth costs compute but no
parameters (Dehghani et al. 2018's Universal Transformer does the same). Factorized embedding: a
vocab x E table and an E x H projection instead of a vocab x H table, V·E + E·H parameters instead
of V·H, which pays when the vocabulary is large and E << H. The output layer here reuses both
factors (the tied head of the lab's TinyGPT, factorized the same way).

Invariant: `CompactGPT.num_params()` equals `compact_param_count(...)` exactly (test), and with
unique_layers = layers and embed_dim = d_model the model has the same parameter count as a TinyGPT.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from parallel_lab.models import Block, GPTConfig

__all__ = ["CompactGPT", "compact_param_count"]


class CompactGPT(nn.Module):
    """TinyGPT with `unique_layers` blocks applied in turn to make `cfg.n_layers` layers, and an
    `embed_dim`-wide token table projected to d_model (tied to the output as its transpose)."""

    def __init__(
        self, cfg: GPTConfig, unique_layers: int | None = None, embed_dim: int | None = None, seed: int = 0
    ):
        super().__init__()
        u = cfg.n_layers if unique_layers is None else unique_layers
        e = cfg.d_model if embed_dim is None else embed_dim
        if not 1 <= u <= cfg.n_layers or cfg.n_layers % u:
            raise ValueError(f"unique_layers must divide n_layers ({cfg.n_layers}), got {unique_layers!r}")
        if not 1 <= e <= cfg.d_model:
            raise ValueError(f"embed_dim must be in [1, d_model={cfg.d_model}], got {embed_dim!r}")
        self.cfg, self.unique_layers, self.embed_dim = cfg, u, e
        with torch.random.fork_rng(devices=[]):
            # the CPU generator alone: torch.manual_seed would also reset every GPU's generator to
            # this seed, which fork_rng(devices=[]) does not restore (a rank's CUDA draws would restart)
            torch.default_generator.manual_seed(seed)
            self.wte = nn.Embedding(cfg.vocab, e)
            self.proj = nn.Linear(e, cfg.d_model, bias=False) if e != cfg.d_model else None
            self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(u))
            self.ln_f = nn.LayerNorm(cfg.d_model)
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(m.weight, std=0.02)
                    if getattr(m, "bias", None) is not None:
                        nn.init.zeros_(m.bias)
            if self.proj is not None:  # a product of two 0.02-scale factors would start the logits near 0
                nn.init.normal_(self.proj.weight, std=e**-0.5)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.wte(idx)  # (B, T, E)
        if self.proj is not None:
            x = self.proj(x)  # (B, T, H)
        x = x + self.wpe(torch.arange(T, device=idx.device))
        repeat = self.cfg.n_layers // self.unique_layers
        for block in self.blocks:
            for _ in range(repeat):  # the same weights, layer after layer
                x = block(x)
        x = self.ln_f(x)  # (B, T, H)
        if self.proj is not None:
            x = x @ self.proj.weight  # (B, T, E): the projection's transpose
        return x @ self.wte.weight.T  # (B, T, V)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def compact_param_count(vocab: int, seq_len: int, d_model: int, unique_layers: int, embed_dim: int) -> int:
    """V·E + E·H (when E < H) + seq·H + unique_layers·(12H² + 13H) + 2H.

    A block: qkv 3H² + 3H, output projection H² + H, MLP 4H² + 4H and 4H² + H, two LayerNorms 4H."""
    H, E = d_model, embed_dim
    return vocab * E + (E * H if E != H else 0) + seq_len * H + unique_layers * (12 * H * H + 13 * H) + 2 * H
