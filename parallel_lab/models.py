"""Tiny models, synthetic data and a single-process reference trainer.

Every parallel technique in the lab is checked against these: a seeded model is
built once, copied into the parallel version, and its losses/gradients compared
with `train_reference` run on the whole batch in one process.

`TinyGPT` is a pre-LN GPT (Radford et al. 2019, nanoGPT layout) with causal
attention written out op by op (no fused SDPA), so the tensors autograd saves for
backward are predictable; `costmodel.activation_bytes` counts them exactly.

Invariant: `build_model(cfg, seed)` gives bit-identical weights for the same
(cfg, seed) on every rank and never disturbs the global RNG.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    """Shape of a `TinyGPT`. Defaults run a training step on a CPU rank in milliseconds."""

    vocab: int = 64
    seq_len: int = 16
    d_model: int = 32
    n_heads: int = 4
    n_layers: int = 2
    dropout: float = 0.0
    tie_weights: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab", "seq_len", "d_model", "n_heads", "n_layers"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {v!r}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"GPTConfig.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")


@dataclass
class MLPConfig:
    """Shape of a `TinyMLP` (so `build_model` can build either model from a config)."""

    in_dim: int = 16
    hidden: int = 32
    out_dim: int = 4
    depth: int = 2


def _check_pos(**kw: int) -> None:
    for name, v in kw.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")


class TinyMLP(nn.Module):
    """`depth` hidden Linear+GELU layers, then a Linear head: in_dim -> hidden -> ... -> out_dim."""

    def __init__(self, in_dim: int = 16, hidden: int = 32, out_dim: int = 4, depth: int = 2):
        super().__init__()
        _check_pos(in_dim=in_dim, hidden=hidden, out_dim=out_dim, depth=depth)
        dims = [in_dim] + [hidden] * depth
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.head = nn.Linear(dims[-1], out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.gelu(layer(x))  # (B, hidden)
        return self.head(x)  # (B, out_dim)


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention written out: qkv projection, masked softmax, output projection."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        nh, hd = self.n_heads, C // self.n_heads
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C), views of one (B, T, 3C)
        q = q.view(B, T, nh, hd).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(B, T, nh, hd).transpose(1, 2)  # (B, nh, T, hd)
        v = v.view(B, T, nh, hd).transpose(1, 2)  # (B, nh, T, hd)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))  # (B, nh, T, T)
        # The mask is rebuilt each call (not a buffer) so model state is params only.
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)  # (T, T) True above diagonal
        att = att.masked_fill(mask, float("-inf"))
        att = F.softmax(att, dim=-1)  # (B, nh, T, T)
        if self.dropout > 0.0 and self.training:
            att = F.dropout(att, self.dropout)
        y = att @ v  # (B, nh, T, hd)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C) heads side by side again
        return self.proj(y)  # (B, T, C)


class MLP(nn.Module):
    """The transformer's feed-forward: C -> 4C -> GELU -> C."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(F.gelu(self.fc(x)))  # (B, T, C)
        if self.dropout > 0.0 and self.training:
            x = F.dropout(x, self.dropout)
        return x


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))  # (B, T, C)
        return x + self.mlp(self.ln2(x))  # (B, T, C)


class TinyGPT(nn.Module):
    """A small decoder-only transformer.

    `forward(idx)` returns logits (B, T, vocab); `forward(idx, targets)` returns the
    scalar mean cross-entropy loss instead, so the logits are not kept alive by the
    caller (this keeps the measured activation memory equal to what autograd saves).
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        if cfg.tie_weights:
            # One Parameter used twice: its gradient is the sum of both uses.
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        B, T = idx.shape
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length {T} exceeds GPTConfig.seq_len={self.cfg.seq_len}")
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T))


def build_model(
    cfg: GPTConfig | MLPConfig, seed: int = 0, device: torch.device | str | None = None
) -> nn.Module:
    """Build a TinyGPT (GPTConfig) or TinyMLP (MLPConfig) with weights fixed by `seed`.

    The global RNG is left untouched, so ranks that build the same (cfg, seed) agree
    bit for bit whatever else they drew before.
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    with torch.random.fork_rng(devices=[]):
        # the CPU generator alone: torch.manual_seed would also reset every GPU's generator to
        # this seed, which fork_rng(devices=[]) does not restore (a rank's CUDA draws would restart)
        torch.default_generator.manual_seed(seed)
        if isinstance(cfg, GPTConfig):
            model: nn.Module = TinyGPT(cfg)
        elif isinstance(cfg, MLPConfig):
            model = TinyMLP(cfg.in_dim, cfg.hidden, cfg.out_dim, cfg.depth)
        else:
            raise TypeError(f"cfg must be a GPTConfig or MLPConfig, got {type(cfg).__name__}")
    return model.to(device) if device is not None else model


# A fixed "teacher" for regression data: every batch, whatever its seed, is drawn
# from the same linear map, so training on several batches (or shards) converges.
_TEACHER_SEED = 1234


def synthetic_batch(
    kind: str,
    batch: int,
    *,
    in_dim: int = 16,
    out_dim: int = 4,
    seq_len: int = 16,
    vocab: int = 64,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic (inputs, targets) batch.

    kind="regression": x (B, in_dim) ~ N(0, 1), y = tanh(x @ W) (B, out_dim) with a fixed W.
    kind="tokens": idx (B, seq_len) int64 sequences that follow t[i+1] = (5*t[i] + 3) % vocab
    from random starts, with 10% random tokens; targets are idx shifted by one, so a
    model can learn it and the loss falls.
    """
    _check_pos(batch=batch)
    g = torch.Generator().manual_seed(seed)
    if kind == "regression":
        _check_pos(in_dim=in_dim, out_dim=out_dim)
        w = torch.randn(in_dim, out_dim, generator=torch.Generator().manual_seed(_TEACHER_SEED))
        x = torch.randn(batch, in_dim, generator=g)  # (B, in_dim)
        y = torch.tanh(x @ w / math.sqrt(in_dim))  # (B, out_dim)
    elif kind == "tokens":
        _check_pos(seq_len=seq_len, vocab=vocab)
        seq = torch.empty(batch, seq_len + 1, dtype=torch.long)  # (B, T+1)
        seq[:, 0] = torch.randint(vocab, (batch,), generator=g)
        for i in range(seq_len):
            seq[:, i + 1] = (5 * seq[:, i] + 3) % vocab
        noise = torch.rand(batch, seq_len + 1, generator=g) < 0.1
        seq[noise] = torch.randint(vocab, (int(noise.sum()),), generator=g)
        # clone: inputs and targets own their storage (a view of `seq` would share it).
        x, y = seq[:, :-1].clone(), seq[:, 1:].clone()  # (B, T) each
    else:
        raise ValueError(f"kind must be 'regression' or 'tokens', got {kind!r}")
    if device is not None:
        x, y = x.to(device), y.to(device)
    return x, y


def compute_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss each tiny model trains on: cross-entropy for TinyGPT, MSE otherwise."""
    if isinstance(model, TinyGPT):
        return model(x, y)
    return F.mse_loss(model(x), y)


def make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    """'sgd', 'momentum' (SGD, 0.9), 'adam' or 'adamw' over `params`."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    raise ValueError(f"optimizer must be one of 'sgd', 'momentum', 'adam', 'adamw', got {name!r}")


def train_reference(
    model: nn.Module,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    optimizer: str = "adam",
    lr: float = 1e-2,
    steps: int | None = None,
) -> list[float]:
    """Plain single-process training: the parity reference for every parallel version.

    Step i uses `batches[i % len(batches)]` whole (for data parallel this is the
    union of the ranks' shards). Returns the loss of each step, before its update.
    """
    if len(batches) == 0:
        raise ValueError("batches must not be empty")
    steps = len(batches) if steps is None else steps
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    opt = make_optimizer(optimizer, model.parameters(), lr)
    model.train()
    losses = []
    for i in range(steps):
        x, y = batches[i % len(batches)]
        loss = compute_loss(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
