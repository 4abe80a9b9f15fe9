"""The balancing race: no balancing, an auxiliary loss, the routing bias, on one TinyGPT-MoE (lesson 21).

Wang et al. 2024 (arXiv 2408.15664) compare, on the same model and data, training with no balancing,
with the auxiliary loss (the Switch loss of lesson 11 generalised to top-k: alpha * E/(k T) *
sum_e count_e * mean_t s'_e, s' the token's scores normalised to sum 1), and with the bias of
`moe.balancing` (no loss term at all), and report the maximal violation MaxVio = max load / mean
load - 1 over training. `run_race` does the same on the lab's TinyGPT with every MLP replaced by a
`FineGrainedMoE`: same seed, same batches, one method per run; it records each step's loss and the
MaxVio of each MoE layer on that step's tokens.

Invariant: the three runs differ only in the balancing; with `method="bias"` the loss function is
the language-modelling loss alone (the bias never enters the output).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from parallel_lab.models import GPTConfig, TinyGPT, synthetic_batch
from parallel_lab.moe.balancing import max_violation, update_bias
from parallel_lab.moe.fine_grained import FineGrainedMoE

__all__ = ["METHODS", "MoEGPT", "RaceConfig", "RaceResult", "run_race", "topk_aux_loss"]

METHODS = ("none", "aux", "bias")


def topk_aux_loss(scores: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """E/(k T) * sum_e count_e * mean_t s'_{t,e}: 1 when balanced and uniform, up to E/k when collapsed.
    scores (T, E) affinities, chosen (T, k); the counts carry no gradient, the mean scores do."""
    t, e = scores.shape
    k = chosen.shape[-1]
    count = torch.bincount(chosen.reshape(-1), minlength=e).to(scores.dtype)  # (E,)
    s = scores / scores.sum(-1, keepdim=True)  # (T, E) normalised per token
    return e / (k * t) * (count * s.mean(0)).sum()


class _MoEMLP(nn.Module):
    """A block's MLP slot holding a FineGrainedMoE; keeps the last step's routing for the loads."""

    def __init__(self, layer: FineGrainedMoE):
        super().__init__()
        self.moe = layer
        self.chosen: torch.Tensor | None = None
        self.x: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, chosen, _ = self.moe(x)
        self.chosen = chosen  # (B T, k)
        self.x = x  # the aux loss scores it again; the other methods never need the scores
        return y

    def scores(self) -> torch.Tensor:
        """(B T, E) the router's sigmoid affinities for the last input, in the graph (the aux loss's gradient)."""
        return torch.sigmoid(self.moe.router(self.x.reshape(-1, self.x.shape[-1])).float())


class MoEGPT(TinyGPT):
    """TinyGPT with each block's MLP replaced by `FineGrainedMoE(d_model, d_expert, n_shared, n_routed, k)`."""

    def __init__(self, cfg: GPTConfig, n_routed: int = 16, k: int = 2, n_shared: int = 1, d_expert: int = 16):
        super().__init__(cfg)
        for block in self.blocks:
            block.mlp = _MoEMLP(FineGrainedMoE(cfg.d_model, d_expert, n_shared, n_routed, k))
        self.apply(self._init_weights)

    def moe_layers(self) -> list[_MoEMLP]:
        return [b.mlp for b in self.blocks]


@dataclass
class RaceConfig:
    """One run of the race. Defaults train in a few seconds on one CPU core."""

    method: str = "bias"
    steps: int = 200
    n_routed: int = 16
    k: int = 2
    n_shared: int = 1
    d_expert: int = 16
    gamma: float = 1e-3  # bias step (Wang et al. 2024 use 1e-3)
    alpha: float = 1e-2  # aux loss weight
    lr: float = 3e-3
    batch: int = 16
    gpt: GPTConfig = field(default_factory=lambda: GPTConfig(vocab=64, seq_len=16, d_model=32, n_heads=4))
    seed: int = 0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"steps must be a positive int, got {self.steps!r}")
        if not self.gamma >= 0 or not self.alpha >= 0:
            raise ValueError(f"gamma and alpha must be >= 0, got {self.gamma!r} and {self.alpha!r}")


@dataclass
class RaceResult:
    """Per step: the language-modelling loss and each MoE layer's MaxVio on that step's tokens."""

    method: str
    loss: list[float]
    max_vio: list[list[float]]  # [step][layer]
    load: list[list[int]]  # the last step's tokens per expert, per layer

    def mean_vio(self, last: int | None = None) -> float:
        """MaxVio averaged over layers and over the last `last` steps (all steps when None)."""
        rows = self.max_vio[-last:] if last else self.max_vio
        return sum(sum(r) / len(r) for r in rows) / len(rows)


def run_race(cfg: RaceConfig | None = None, **overrides) -> RaceResult:
    """Train one MoEGPT with `cfg.method` balancing; the model and batches depend on `cfg.seed` only."""
    cfg = cfg or RaceConfig(**overrides)
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(cfg.seed)
        model = MoEGPT(cfg.gpt, cfg.n_routed, cfg.k, cfg.n_shared, cfg.d_expert)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    losses, vios = [], []
    for step in range(cfg.steps):
        x, y = synthetic_batch("tokens", cfg.batch, seq_len=cfg.gpt.seq_len, vocab=cfg.gpt.vocab,
                               seed=cfg.seed * 100_003 + step)  # fmt: skip
        lm = model(x, y)
        loss = lm
        layers = model.moe_layers()
        if cfg.method == "aux":
            loss = lm + cfg.alpha * sum(topk_aux_loss(m.scores(), m.chosen) for m in layers)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loads = [torch.bincount(m.chosen.reshape(-1), minlength=cfg.n_routed) for m in layers]
        if cfg.method == "bias":  # after the step, from this step's loads: no gradient involved
            for m, load in zip(layers, loads):
                m.moe.bias.copy_(update_bias(m.moe.bias, load, cfg.gamma))
        losses.append(float(lm.detach()))
        vios.append([max_violation(load) for load in loads])
    return RaceResult(cfg.method, losses, vios, [load.tolist() for load in loads])
