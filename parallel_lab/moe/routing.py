"""Mixture of Experts: routers, expert capacity, the load-balancing loss, one MoE layer.

A router scores each token against E experts (a linear layer and a softmax, kept in
fp32: Switch's "selective precision") and sends it to a few of them; the layer's
output is the gate-weighted sum of those experts' outputs. Routers here, from the
literature:
- token choice, top-k (Shazeer et al. 2017); top-1 is the Switch Transformer
  (Fedus et al. 2021);
- GShard (Lepikhin et al. 2020): top-2 whose second expert is used only with
  probability 2·g2 ("random routing"), and local group dispatching (routing and
  capacity per group of tokens; one group per rank under expert parallelism);
- Batch Priority Routing (V-MoE, Riquelme et al. 2021): slots go to the tokens
  with the highest routing weight first, so overflow drops the least important;
- Expert Choice (Zhou et al. 2022): each expert takes its top-C tokens.

Capacity (GShard, Switch): every expert has C = ceil(k · capacity_factor · tokens /
experts) slots; a token choice that finds its expert full is dropped (the token
passes through the residual connection only). Auxiliary loss (Switch, eq. 4):
aux = E · Σ_e f_e · P_e, with f_e the fraction of tokens whose first choice is e and
P_e the mean router probability of e; it is 1 when both are uniform.

Invariant: every router returns the same `Routing`: for each expert the tokens in
its slots (filled from slot 0, in priority order) and their gates, so the single-
process layer here and the expert-parallel one (`moe/expert_parallel.py`) dispatch
identically.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.nn as nn
import torch.nn.functional as F

POLICIES = ("token_choice", "gshard", "bpr", "expert_choice")


def expert_capacity(tokens: int, experts: int, capacity_factor: float, k: int = 1) -> int:
    """Slots per expert: ceil(k · capacity_factor · tokens / experts)."""
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)):
        raise TypeError(f"capacity_factor must be a number, got {type(capacity_factor).__name__}")
    if not capacity_factor > 0 or not math.isfinite(capacity_factor):
        raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
    for name, v in (("tokens", tokens), ("experts", experts), ("k", k)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "tokens" else 1):
            raise ValueError(
                f"{name} must be a {'non-negative' if name == 'tokens' else 'positive'} int, got {v!r}"
            )
    # Exact arithmetic on the factor as written: in floats 1.1 x 10 is 11.000000000000002, whose
    # ceiling would give an expert one slot more than the formula says.
    factor = (
        Fraction(repr(capacity_factor)) if isinstance(capacity_factor, float) else Fraction(capacity_factor)
    )
    return math.ceil(k * factor * tokens / experts)


def switch_aux_loss(probs: torch.Tensor, first_choice: torch.Tensor) -> torch.Tensor:
    """Switch's load-balancing loss E · Σ_e f_e · P_e for probs (N, E) and first choices (N,)."""
    n, e = probs.shape
    if n == 0:  # no tokens, nothing to balance: 0, still connected to the router's graph
        return probs.sum() * 0.0
    f = torch.bincount(first_choice, minlength=e).float() / n  # (E,) fraction routed, no gradient
    p = probs.mean(0)  # (E,) mean probability: the differentiable part
    return e * (f * p).sum()


@dataclass
class Routing:
    """Where each expert's slots point. Slots 0..counts[e]-1 of expert e are filled."""

    expert_tokens: torch.Tensor  # (E, C) int64 token index per slot, -1 where empty
    expert_gates: torch.Tensor  # (E, C) float32 gate per slot, 0 where empty (carries the gradient)
    counts: torch.Tensor  # (E,) int64 filled slots per expert
    tokens_per_expert: torch.Tensor  # (E,) int64 choices made for each expert, before capacity
    dropped: int  # choices that found their expert full
    capacity: int
    aux_loss: torch.Tensor  # () Switch load-balancing loss
    probs: torch.Tensor  # (N, E) router probabilities, fp32

    @property
    def unrouted(self) -> int:
        """Tokens that no expert processes (they pass through the residual only)."""
        n = self.probs.shape[0]
        seen = torch.zeros(n + 1, dtype=torch.bool, device=self.probs.device)
        seen[self.expert_tokens.flatten() + 1] = True  # index 0 collects the -1s of empty slots
        return int(n - seen[1:].sum())


def assign_slots(expert_ids, tokens, gates, num_experts: int, capacity: int):
    """Assign choices, given in priority order, to slots first come first served.

    expert_ids, tokens, gates: (M,) in priority order (expert -1: no choice). Returns
    expert_tokens (E, C), expert_gates (E, C), counts (E,), dropped.
    """
    valid = expert_ids >= 0
    onehot = F.one_hot(expert_ids.clamp(min=0), num_experts) * valid[:, None]  # (M, E)
    position = ((onehot.cumsum(0) - 1) * onehot).sum(1)  # (M,) slot within its expert
    kept = valid & (position < capacity)
    e, pos = expert_ids[kept], position[kept]
    expert_tokens = torch.full((num_experts, capacity), -1, dtype=torch.long, device=gates.device)
    expert_tokens[e, pos] = tokens[kept]
    expert_gates = gates.new_zeros(num_experts, capacity).index_put((e, pos), gates[kept])  # differentiable
    counts = torch.bincount(e, minlength=num_experts)
    return expert_tokens, expert_gates, counts, int(valid.sum() - kept.sum())


class TopKRouter(nn.Module):
    """Scores tokens against experts and fills each expert's `capacity` slots.

    policy "token_choice": each token's top-k experts, slots in token order, all first
    choices before any second choice (k=1: Switch). "gshard": top-2, the second kept
    with probability 2·g2. "bpr": token choice with slots in order of each token's
    top routing weight. "expert_choice": each expert takes its top-C tokens.
    With k > 1 the k gates of a token are renormalised to sum to 1 (GShard).
    """

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.25,
        policy: str = "token_choice",
        init_std: float = 0.02,
    ):
        super().__init__()
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= num_experts:
            raise ValueError(f"k must be an int with 1 <= k <= num_experts ({num_experts}), got {k!r}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if policy == "gshard" and k != 2:
            raise ValueError(f"policy 'gshard' routes to exactly 2 experts: k must be 2, got {k}")
        expert_capacity(1, num_experts, capacity_factor, k)  # validates capacity_factor
        self.num_experts, self.k, self.capacity_factor, self.policy = num_experts, k, capacity_factor, policy
        self.weight = nn.Parameter(torch.randn(num_experts, d_model) * init_std)  # (E, C)

    def forward(self, x: torch.Tensor, generator: torch.Generator | None = None) -> Routing:
        """Route tokens x (N, d_model). `generator` draws GShard's second-expert coins (CPU)."""
        n, E, k = x.shape[0], self.num_experts, self.k
        # Selective precision (Switch): the softmax's exponentials are where fp16/bf16 go wrong.
        logits = x.float() @ self.weight.float().T  # (N, E) fp32
        probs = logits.softmax(dim=-1)  # (N, E)
        cap = expert_capacity(n, E, self.capacity_factor, 1 if self.policy == "expert_choice" else k)
        aux = switch_aux_loss(probs, probs.argmax(-1))
        if self.policy == "expert_choice":
            gates, tok = probs.T.topk(min(cap, n), dim=1)  # (E, min(C, N)): each expert's best tokens
            expert_tokens = torch.full((E, cap), -1, dtype=torch.long, device=x.device)
            expert_tokens[:, : tok.shape[1]] = tok
            expert_gates = F.pad(gates, (0, cap - gates.shape[1]))  # (E, C)
            counts = torch.full((E,), tok.shape[1], dtype=torch.long, device=x.device)
            per_expert = counts.clone()
            return Routing(expert_tokens, expert_gates, counts, per_expert, 0, cap, aux, probs)
        top_p, top_e = probs.topk(k, dim=-1)  # (N, k)
        gates = top_p / top_p.sum(-1, keepdim=True) if k > 1 else top_p  # (N, k)
        choice = top_e.clone()
        if self.policy == "gshard":
            coin = torch.rand(n, generator=generator).to(x.device)  # (N,)
            choice[:, 1] = torch.where(2 * gates[:, 1].detach() > coin, choice[:, 1], -1)
        order = torch.arange(n, device=x.device)
        if self.policy == "bpr":  # most confident tokens first: overflow drops the least important
            order = top_p[:, 0].detach().argsort(descending=True, stable=True)
        # priority: choice 0 of every token (in `order`), then choice 1, ...
        ids, toks, gs = choice[order].T.reshape(-1), order.repeat(k), gates[order].T.reshape(-1)  # (k*N,)
        expert_tokens, expert_gates, counts, dropped = assign_slots(ids, toks, gs, E, cap)
        per_expert = torch.bincount(choice[choice >= 0], minlength=E)
        return Routing(expert_tokens, expert_gates, counts, per_expert, dropped, cap, aux, probs)


class Expert(nn.Module):
    """One expert: the transformer's feed-forward, d_model -> d_ff -> GELU -> d_model."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.fc = nn.Linear(d_model, d_ff)
        self.proj = nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))  # (n, d_model)


@dataclass
class MoEConfig:
    """Shape and routing of an `MoELayer`; defaults run on 1-4 CPU ranks in milliseconds."""

    d_model: int = 16
    d_ff: int = 32
    num_experts: int = 4
    k: int = 1
    capacity_factor: float = 1.25
    policy: str = "token_choice"

    def __post_init__(self) -> None:
        for name in ("d_model", "d_ff", "num_experts", "k"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        cf = self.capacity_factor
        if isinstance(cf, bool) or not isinstance(cf, (int, float)) or not math.isfinite(cf) or cf <= 0:
            raise ValueError(f"capacity_factor must be a finite number > 0, got {cf!r}")


def combine(y: torch.Tensor, routing: Routing, expert_out: list[torch.Tensor]) -> torch.Tensor:
    """y (N, d) += gate · output of each filled slot, expert by expert (the order fixes the bits)."""
    for e, out in enumerate(expert_out):
        n = int(routing.counts[e])
        tok, gate = routing.expert_tokens[e, :n], routing.expert_gates[e, :n]  # (n,), (n,)
        y = y.index_add(0, tok, gate[:, None].to(out.dtype) * out)  # (N, d)
    return y


class MoELayer(nn.Module):
    """Router + E experts in one process: the reference for expert parallelism.

    `forward(x, groups=G)` routes each of G equal groups of tokens on its own (GShard's
    local groups: capacity per group), runs each expert once on its tokens from all
    groups in group order, and combines. Returns (y, aux_loss, routings): y has x's
    shape, aux_loss is the mean of the groups' Switch losses.
    """

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.router = TopKRouter(cfg.d_model, cfg.num_experts, cfg.k, cfg.capacity_factor, cfg.policy)
        self.experts = nn.ModuleList(Expert(cfg.d_model, cfg.d_ff) for _ in range(cfg.num_experts))

    def forward(self, x: torch.Tensor, groups: int = 1, seed: int = 0):
        xf = x.reshape(-1, x.shape[-1])  # (N, d)
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or xf.shape[0] % groups:
            raise ValueError(
                f"groups must be a positive int dividing the {xf.shape[0]} tokens, got {groups!r}"
            )
        parts = xf.chunk(groups)  # G x (N/G, d)
        routings = [self.router(p, torch.Generator().manual_seed(seed + g)) for g, p in enumerate(parts)]
        outs: list[list[torch.Tensor]] = [[] for _ in parts]  # [group][expert] -> (n_ge, d)
        for e, expert in enumerate(self.experts):
            sizes = [int(r.counts[e]) for r in routings]
            xs = torch.cat([p[r.expert_tokens[e, :n]] for p, r, n in zip(parts, routings, sizes)])  # (n_e, d)
            for g, out in enumerate(expert(xs).split(sizes)):
                outs[g].append(out)
        y = torch.cat([combine(torch.zeros_like(p), r, o) for p, r, o in zip(parts, routings, outs)])
        aux = torch.stack([r.aux_loss for r in routings]).mean()
        return y.reshape(x.shape), aux, routings


def build_moe(cfg: MoEConfig, seed: int = 0) -> MoELayer:
    """An `MoELayer` with weights fixed by `seed` (global RNG untouched): same on every rank."""
    with torch.random.fork_rng(devices=[]):
        # the CPU generator alone: torch.manual_seed would also reset every GPU's generator to
        # this seed, which fork_rng(devices=[]) does not restore (a rank's CUDA draws would restart)
        torch.default_generator.manual_seed(seed)
        return MoELayer(cfg)


__all__ = [
    "POLICIES",
    "assign_slots",
    "Expert",
    "MoEConfig",
    "MoELayer",
    "Routing",
    "TopKRouter",
    "build_moe",
    "combine",
    "expert_capacity",
    "switch_aux_loss",
]
