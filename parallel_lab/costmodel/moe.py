"""MoE at scale (lesson 21): all-to-all bytes per layer, flat vs node-limited two-hop, and memory per GPU.

Routing model: a token's k experts are a uniformly random k-subset of the E (iid scores, as
`moe.balancing.biased_topk` picks them from random scores), E/G experts on each of G nodes.
- expected distinct nodes among the k choices (no node limit), exactly: a node is missed when all k
  choices fall among the other E - E/G experts, so  G (1 - C(E - E/G, k) / C(E, k));
- node-limited to M nodes (`node_limited_topk`): at most M. The exact mean depends on the score
  distribution (the groups are picked by sums of scores), so the model charges M, the budget the
  router guarantees; it lies between M (1 - C((M-1)E/G, k) / C(M E/G, k)) (k experts uniform over
  the M nodes' experts, `node_limited_floor`) and M. Monte Carlo of `node_limited_topk` on uniform
  scores: exactly M at M = 1, 3.954 of 4 for DeepSeek-V3's shape (8 nodes of 32, k = 8), 1.80 of
  2 at k = M = 2 on 4 nodes of 4 (tests/test_moe_dispatch.py);
- by symmetry each choice's node and each reached node is uniform, so of those, (G - 1)/G are
  another node than the token's own. Cross-node rows per token: flat k (G - 1)/G (node limit or
  not: it moves choices, not their count), two-hop (distinct nodes) x (G - 1)/G.
The combine returns as many rows as the dispatch sent (two-hop: one partial sum per node).

DeepSeek-V3 (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", arXiv 2412.19437): `DEEPSEEK_V3`
holds its shape from the model's config.json (61 layers, the first 3 dense, d_model 7168, 256 routed
experts of d_ff 2048 plus 1 shared, 8 per token, groups of experts on at most 4 of 8 nodes), the
training layout of the report's section on its training framework (PP16 x EP64, the EP group spanning
8 nodes of 8 GPUs, ZeRO-1 data parallelism, 2048 H800 GPUs), and from DeepEP's README the links of
its H800 tests (~160 GB/s NVLink and ~50 GB/s per 400 Gb/s InfiniBand card, nominal maxima) and "the
DeepSeek-V3/R1 pretraining setting (4096 tokens per batch, ..., FP8 dispatching and BF16 combining)".
Assumed by the lab: SwiGLU experts (3 matrices d x d_ff), dense bf16 peak 989 TFLOP/s for the H800
at a given MFU, mixed-precision Adam states (16 bytes per parameter, ZeRO-1 over the data-parallel
copies), and ceil(58 / 16) = 4 MoE layers on the fullest pipeline stage.

Invariant: pure arithmetic; a bad argument raises ValueError or TypeError naming it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from parallel_lab.costmodel.formulas import _int, _number, model_state_bytes

__all__ = ["DEEPSEEK_V3", "MoESpec", "cross_node_rows", "deepseek_v3_row", "expected_nodes", "moe_layer_row",
           "node_limited_floor"]  # fmt: skip


def _check(experts: int, nodes: int, k: int, max_nodes: int | None) -> tuple[int, int, int, int | None]:
    E, G, k = _int("experts", experts, 1), _int("nodes", nodes, 1), _int("k", k, 1)
    if E % G:
        raise ValueError(f"nodes ({G}) must divide experts ({E}): each node holds E/nodes experts")
    if k > E:
        raise ValueError(f"k ({k}) must be at most experts ({E})")
    if max_nodes is not None:
        M = _int("max_nodes", max_nodes, 1)
        if M > G or k % M or k > M * (E // G):
            raise ValueError(f"max_nodes ({M}) must be at most nodes ({G}), divide k ({k}), and hold k experts "
                             f"(max_nodes x experts per node >= k)")  # fmt: skip
    return E, G, k, max_nodes


def expected_nodes(experts: int, nodes: int, k: int, max_nodes: int | None = None) -> float:
    """Expected distinct nodes among a token's k experts under uniform routing (module docstring);
    with `max_nodes` the model's M."""
    E, G, k, M = _check(experts, nodes, k, max_nodes)
    if M is not None:
        return float(M)
    return G * (1 - math.comb(E - E // G, k) / math.comb(E, k))


def node_limited_floor(experts: int, nodes: int, k: int, max_nodes: int) -> float:
    """The lower bound of node-limited routing's mean: k experts uniform over the M nodes' experts."""
    E, G, k, M = _check(experts, nodes, k, max_nodes)
    n = E // G
    return M * (1 - math.comb((M - 1) * n, k) / math.comb(M * n, k))


def cross_node_rows(experts: int, nodes: int, k: int, max_nodes: int | None = None,
                    variant: str = "two_hop") -> float:  # fmt: skip
    """Expected rows a token sends across nodes in the dispatch (the combine brings as many back)."""
    E, G, k, M = _check(experts, nodes, k, max_nodes)
    if variant == "flat":
        return k * (G - 1) / G
    if variant == "two_hop":
        return expected_nodes(E, G, k, M) * (G - 1) / G
    raise ValueError(f"variant must be 'flat' or 'two_hop', got {variant!r}")


@dataclass(frozen=True)
class MoESpec:
    """An MoE transformer and its layout: the sizes the all-to-all and the experts' memory depend on."""

    name: str
    layers: int  # all of them
    dense_layers: int  # the first ones, with a dense FFN
    d_model: int
    d_ff: int  # one routed expert's hidden size
    routed: int
    shared: int
    k: int
    max_nodes: int | None
    gpus: int
    gpus_per_node: int
    pp: int
    ep: int
    peak_flops: float  # dense bf16 FLOP/s of one GPU
    ib_bw: float  # bytes/s per GPU across nodes
    nvlink_bw: float  # bytes/s per GPU inside a node
    dispatch_bytes: int = 1  # per element (FP8)
    combine_bytes: int = 2  # per element (BF16)
    notes: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in ("layers", "d_model", "d_ff", "routed", "k", "gpus", "gpus_per_node", "pp", "ep",
                     "dispatch_bytes", "combine_bytes"):  # fmt: skip
            _int(name, getattr(self, name), 1)
        _int("dense_layers", self.dense_layers, 0)
        _int("shared", self.shared, 0)
        for name in ("peak_flops", "ib_bw", "nvlink_bw"):
            _number(name, getattr(self, name), 0.0, strict=True)
        if self.dense_layers >= self.layers:
            raise ValueError(f"dense_layers ({self.dense_layers}) must be fewer than layers ({self.layers})")
        if self.routed % self.ep:
            raise ValueError(
                f"ep ({self.ep}) must divide routed ({self.routed}): each GPU holds routed/ep experts"
            )
        if self.ep % self.gpus_per_node:
            raise ValueError(f"ep ({self.ep}) must be a multiple of gpus_per_node ({self.gpus_per_node}): "
                             "an expert-parallel group spans whole nodes")  # fmt: skip
        if self.gpus % (self.pp * self.ep):
            raise ValueError(f"pp x ep ({self.pp} x {self.ep}) must divide gpus ({self.gpus})")
        _check(self.routed, self.ep // self.gpus_per_node, self.k, self.max_nodes)

    @property
    def ep_nodes(self) -> int:
        return self.ep // self.gpus_per_node

    @property
    def dp(self) -> int:
        """Data-parallel degree of the non-expert weights (the EP group is data-parallel for them)."""
        return self.gpus // self.pp

    @property
    def expert_dp(self) -> int:
        """Copies of each routed expert: gpus / (pp x ep)."""
        return self.gpus // (self.pp * self.ep)


DEEPSEEK_V3 = MoESpec(
    "DeepSeek-V3", layers=61, dense_layers=3, d_model=7168, d_ff=2048, routed=256, shared=1, k=8, max_nodes=4,
    gpus=2048, gpus_per_node=8, pp=16, ep=64, peak_flops=989e12, ib_bw=50e9, nvlink_bw=160e9,
    notes=("shape: config.json; layout: the report's training framework; links, tokens, FP8/BF16: DeepEP's README",
           "H800 dense bf16 peak taken as the H100 SXM's 989 TFLOP/s (an assumption)",
           "SwiGLU experts; dispatch FP8, combine BF16 (assumptions)"),
)  # fmt: skip


def moe_layer_row(spec: MoESpec, mfu: float = 0.4, tokens: int = 4096) -> dict:
    """One MoE layer on one GPU, per `tokens` of its own tokens (a micro-batch; the shares do not depend on it):
    cross-node rows and bytes per token (flat vs two-hop, node-limited or not), the all-to-all seconds
    (dispatch + combine, forward and backward: the backward exchanges the same rows again) over IB, the
    experts' seconds at `mfu` of the peak (forward + backward = 3x forward, SwiGLU 6 d d_ff FLOPs per
    token per expert), the all-to-all share if not overlapped, and the memory per GPU of the fullest stage."""
    if not isinstance(spec, MoESpec):
        raise TypeError(f"spec must be a MoESpec, got {type(spec).__name__}")
    if not 0 < _number("mfu", mfu) <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu}")
    T = _int("tokens", tokens, 1)
    G, E, k, M, d = spec.ep_nodes, spec.routed, spec.k, spec.max_nodes, spec.d_model
    per_row = d * (spec.dispatch_bytes + spec.combine_bytes)  # one row out, its result back
    rows = {
        "flat": cross_node_rows(E, G, k, None, "flat"),
        "two_hop": cross_node_rows(E, G, k, None, "two_hop"),
        "flat_node_limited": cross_node_rows(E, G, k, M, "flat") if M else None,
        "two_hop_node_limited": cross_node_rows(E, G, k, M, "two_hop") if M else None,
    }
    expert_flops = 3 * (k + spec.shared) * 6 * d * spec.d_ff * T  # forward + backward
    t_experts = expert_flops / (spec.peak_flops * mfu)
    a2a = {name: None if r is None else 2 * T * r * per_row / spec.ib_bw for name, r in rows.items()}
    share = {name: None if t is None else t / (t + t_experts) for name, t in a2a.items()}
    expert_params = 3 * d * spec.d_ff
    moe_stage = -(-(spec.layers - spec.dense_layers) // spec.pp)  # MoE layers on the fullest stage
    routed = model_state_bytes(spec.routed // spec.ep * expert_params, spec.expert_dp, 1)["total"]
    replicated = model_state_bytes(spec.shared * expert_params + d * E, spec.dp, 1)["total"]
    return {
        "model": spec.name, "ep": spec.ep, "ep_nodes": G, "experts_per_gpu": E // spec.ep,
        "cross_rows_per_token": rows,
        "cross_bytes_per_layer": {n: None if r is None else T * r * per_row for n, r in rows.items()},
        "a2a_seconds": a2a, "expert_seconds": t_experts, "a2a_share": share,
        "memory_per_layer": {"routed": routed, "shared_and_router": replicated},
        "moe_layers_per_stage": moe_stage, "memory_per_gpu": moe_stage * (routed + replicated),
        "mfu": mfu, "tokens": T, "notes": list(spec.notes),
    }  # fmt: skip


def deepseek_v3_row(mfu: float = 0.4, tokens: int = 4096) -> dict:
    """`moe_layer_row` for DeepSeek-V3's published layout (module docstring: which numbers are assumptions)."""
    return moe_layer_row(DEEPSEEK_V3, mfu, tokens)
