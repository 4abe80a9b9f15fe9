"""Analytic predictions: memory per strategy, communication volume, bubbles, FLOPs.

Every number a lesson measures is first predicted here:
- model states per rank under ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory
  Optimizations Toward Training Trillion Parameter Models", §3 and Figure 1):
  mixed-precision Adam holds 2 + 2 + (4 + 4 + 4) = 16 bytes per parameter, and
  stages 1/2/3 shard optimizer states / + gradients / + parameters over N ranks;
- activations saved for backward by the lab's `TinyGPT`, counted exactly, and the
  Megatron estimate sbh(34 + 5as/h) (Korthikanti et al. 2022) for comparison;
- ring all-reduce volume 2(N-1)/N * S per rank (Patarasuk & Yuan 2009);
- pipeline bubble (p-1)/(v*m + p-1) (GPipe; Narayanan et al. 2021 for v chunks);
- training FLOPs 6*N*D (Kaplan et al. 2020) and arithmetic intensity / roofline
  (Williams et al. 2009);
- the 3D planner (`plan`, `ModelSpec`, `ClusterSpec`, `Plan`: lesson 10) lives in
  `costmodel/planner.py`, which builds on the functions here; it is reachable as
  `costmodel.plan` too.

Invariant: functions are pure arithmetic on their arguments (no torch state), and
reject bad input with a ValueError/TypeError that names the argument.
"""

from __future__ import annotations

import math

GB = 1e9  # the seeds' and the ZeRO paper's GB are decimal

#: bytes per parameter for (param, grad) by precision.
#: "fp32": everything fp32. "mixed": fp16/bf16 weights and gradients, with an fp32
#: master copy kept by the optimizer (counted as optimizer state, as in the ZeRO
#: paper). "bf16": pure bf16 training, no master copy, optimizer state in bf16 too.
PRECISIONS = {"fp32": (4, 4), "mixed": (2, 2), "bf16": (2, 2)}

#: per-parameter optimizer state tensors: sgd none, momentum one buffer, adam/adamw m and v.
OPTIMIZER_STATES = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}

ZERO_STAGES = (0, 1, 2, 3)


def _int(name: str, v, minimum: int = 0) -> int:
    """An integral count >= minimum; floats like 7e9 are accepted when integral."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(v).__name__}")
    if isinstance(v, float) and not (math.isfinite(v) and v.is_integer()):
        raise ValueError(f"{name} must be a whole number, got {v}")
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return int(v)


def _number(name: str, v, minimum: float = 0.0, strict: bool = False) -> float:
    """A finite real number >= minimum (> minimum when `strict`); NaN and infinity are refused."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(v).__name__}")
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v}")
    if v < minimum or (strict and v == minimum):
        raise ValueError(f"{name} must be {'>' if strict else '>='} {minimum:g}, got {v}")
    return v


def bytes_per_param(optimizer: str = "adam", precision: str = "mixed") -> dict[str, int]:
    """{'param', 'grad', 'optim'} bytes for one parameter (before any sharding).

    mixed + adam: 2 + 2 + (4 master + 4 m + 4 v) = 16; fp32 + adam: 4 + 4 + 8 = 16;
    bf16 + adam: 2 + 2 + 4 = 8; mixed + momentum: 2 + 2 + 8 (the "8 bytes" of the usual rule
    for an SGD-like optimizer).
    """
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {tuple(OPTIMIZER_STATES)}, got {optimizer!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {tuple(PRECISIONS)}, got {precision!r}")
    param, grad = PRECISIONS[precision]
    n_states = OPTIMIZER_STATES[optimizer]
    if precision == "mixed":
        optim = 4 + 4 * n_states  # fp32 master + fp32 states
    else:
        optim = param * n_states  # states in the parameters' own dtype
    return {"param": param, "grad": grad, "optim": optim}


def shard_numel(num_params: int, dp_size: int) -> int:
    """Elements per rank when `num_params` are split over `dp_size` ranks (flat buffer padded to N)."""
    return -(-_int("num_params", num_params) // _int("dp_size", dp_size, 1))


def model_state_bytes(
    num_params: int, dp_size: int = 1, zero_stage: int = 0, optimizer: str = "adam", precision: str = "mixed"
) -> dict[str, int]:
    """Bytes per rank of parameters, gradients and optimizer states (no activations).

    Stage 0 (plain DP) replicates everything: 16Ψ for mixed Adam. Stage 1 shards the
    optimizer states (4Ψ + 12Ψ/N), stage 2 also the gradients (2Ψ + 14Ψ/N), stage 3
    also the parameters (16Ψ/N). A sharded part holds ceil(Ψ/N) elements per rank.
    """
    psi = _int("num_params", num_params)
    n = _int("dp_size", dp_size, 1)
    if type(zero_stage) is not int or zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage must be one of {ZERO_STAGES}, got {zero_stage!r}")
    b = bytes_per_param(optimizer, precision)
    shard = shard_numel(psi, n)
    sharded = {1: ("optim",), 2: ("optim", "grad"), 3: ("optim", "grad", "param")}.get(zero_stage, ())
    out = {k: b[k] * (shard if k in sharded else psi) for k in ("param", "grad", "optim")}
    out["total"] = out["param"] + out["grad"] + out["optim"]
    return out


def rule_of_thumb_bytes(num_params: int, gb_per_billion: float = 6.0) -> float:
    """The "6 GB per 1B parameters at 16-bit" rule of thumb: 6 bytes/param.

    It fits 16-bit weights + 16-bit gradients + ONE 16-bit optimizer state (e.g.
    `model_state_bytes(n, optimizer="momentum", precision="bf16")`): no fp32
    master copy, no Adam second moment, no activations.
    """
    _number("gb_per_billion", gb_per_billion, 0.0, strict=True)
    return _int("num_params", num_params) / 1e9 * gb_per_billion * GB  # = num_params * bytes/param


def allreduce_bytes_per_rank(nbytes: float, world_size: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce: 2(N-1)/N * S."""
    _number("nbytes", nbytes)
    n = _int("world_size", world_size, 1)
    return 2 * (n - 1) / n * nbytes


def pipeline_bubble_fraction(stages: int, microbatches: int, chunks: int = 1) -> float:
    """Idle share of a pipeline step: (p-1)/(v*m + p-1).

    Megatron quotes the bubble-to-compute ratio (p-1)/(v*m) instead; both are
    the same bubble measured against a different whole.
    """
    p = _int("stages", stages, 1)
    m = _int("microbatches", microbatches, 1)
    v = _int("chunks", chunks, 1)
    return (p - 1) / (v * m + p - 1)


# -- activations ------------------------------------------------------------------
def activation_bytes_per_layer(
    batch: int, seq: int, hidden: int, heads: int, dtype_bytes: int = 4, stats_bytes: int | None = None
) -> int:
    """Bytes one `models.Block` saves for backward (B=batch, T=seq, C=hidden, a=heads).

    Counted tensor by tensor (each storage once, parameters excluded):
      ln1 input, qkv input, q, k, v, attention-proj input, ln2 input, fc input  8 x BTC
      GELU input and mlp-proj input (4C wide)                                  8 x BTC
      softmax output (B, a, T, T)                                              a B T^2
      two LayerNorms' mean and rstd (B, T, 1) each                            4 x BT (stats dtype)
      causal mask (T, T) bool                                                  T^2 (1 byte each)
    = 16 BTC d + a B T^2 d + 4 BT s + T^2. `stats_bytes` defaults to `dtype_bytes`
    (CPU LayerNorm keeps its statistics in the input dtype; pass 4 for kernels that
    keep them in fp32).
    """
    B, T, C, a = (
        _int(n, v, 1) for n, v in (("batch", batch), ("seq", seq), ("hidden", hidden), ("heads", heads))
    )
    d = _int("dtype_bytes", dtype_bytes, 1)
    s = d if stats_bytes is None else _int("stats_bytes", stats_bytes, 1)
    return 16 * B * T * C * d + a * B * T * T * d + 4 * B * T * s + T * T


def activation_bytes(
    batch: int, seq: int, hidden: int, layers: int, heads: int = 4, vocab: int = 64,
    dtype_bytes: int = 4, stats_bytes: int | None = None, index_bytes: int = 8,
) -> int:  # fmt: skip
    """Bytes a `models.TinyGPT` forward with targets saves for backward, all of it.

    layers x `activation_bytes_per_layer`, plus outside the blocks: token ids and
    positions for the embeddings (int64), ln_f input and its statistics, lm_head
    input, log-softmax output (B, T, V), the targets, and cross-entropy's 1-element
    total weight. Exact for the lab's model (tests compare it with measured bytes).
    """
    B, T, C, L, V = (
        _int(n, v, 1) for n, v in (("batch", batch), ("seq", seq), ("hidden", hidden), ("layers", layers),
                                   ("vocab", vocab))
    )  # fmt: skip
    d = _int("dtype_bytes", dtype_bytes, 1)
    s = d if stats_bytes is None else _int("stats_bytes", stats_bytes, 1)
    i = _int("index_bytes", index_bytes, 1)
    per_layer = activation_bytes_per_layer(B, T, C, heads, d, s)
    embed = B * T * i + T * i  # token ids (B, T) and positions (T,)
    head = 2 * B * T * C * d + 2 * B * T * s  # ln_f input + stats, lm_head input
    loss = B * T * V * d + B * T * i + d  # log-softmax output, targets, total weight
    return L * per_layer + embed + head + loss


def activation_bytes_megatron(seq: int, batch: int, hidden: int, heads: int, layers: int = 1) -> int:
    """Korthikanti et al. 2022 ("Reducing Activation Recomputation"): sbh(34 + 5as/h) bytes per layer.

    Assumes fp16 activations, 1-byte dropout masks and no recomputation; our
    TinyGPT has no dropout and runs fp32, so its exact count differs.
    """
    s, b, h, a, L = (
        _int(n, v, 1) for n, v in (("seq", seq), ("batch", batch), ("hidden", hidden), ("heads", heads),
                                   ("layers", layers))
    )  # fmt: skip
    return L * (34 * s * b * h + 5 * a * s * s * b)


# -- compute ------------------------------------------------------------------------
def training_flops(num_params: float, tokens: float) -> float:
    """6 * N * D: forward 2ND (one multiply-add per parameter per token) + backward 4ND."""
    _number("num_params", num_params)
    _number("tokens", tokens)
    return 6.0 * num_params * tokens


def matmul_flops(b: int, d: int, f: int) -> int:
    """FLOPs of (b, d) @ (d, f): 2*b*d*f (a multiply and an add per term)."""
    return 2 * _int("b", b, 1) * _int("d", d, 1) * _int("f", f, 1)


def arithmetic_intensity_dot(n: int, dtype_bytes: int = 2) -> float:
    """Dot product of two n-vectors: (2n - 1) FLOPs over 2n reads + 1 write -> 0.5 FLOP/byte in bf16."""
    n = _int("n", n, 1)
    db = _int("dtype_bytes", dtype_bytes, 1)
    return (2 * n - 1) / (2 * n * db + db)


def arithmetic_intensity_matmul(b: int, d: int, f: int, dtype_bytes: int = 2) -> float:
    """(b, d) @ (d, f): 2bdf / (bytes of X + Y + Z); about b when b << d, f (bf16)."""
    db = _int("dtype_bytes", dtype_bytes, 1)
    return matmul_flops(b, d, f) / (db * (b * d + d * f + b * f))


def roofline(intensity: float, peak_flops: float, mem_bw: float) -> float:
    """Attainable FLOP/s = min(peak, intensity * bandwidth); the ridge is peak / bandwidth."""
    for name, v in (("intensity", intensity), ("peak_flops", peak_flops), ("mem_bw", mem_bw)):
        _number(name, v, 0.0, strict=True)
    return min(peak_flops, intensity * mem_bw)


__all__ = [
    "GB", "OPTIMIZER_STATES", "PRECISIONS", "ZERO_STAGES", "activation_bytes", "activation_bytes_megatron",
    "activation_bytes_per_layer", "allreduce_bytes_per_rank", "arithmetic_intensity_dot",
    "arithmetic_intensity_matmul", "bytes_per_param", "matmul_flops", "model_state_bytes",
    "pipeline_bubble_fraction", "roofline", "rule_of_thumb_bytes", "shard_numel", "tp_activation_bytes_per_layer", "training_flops",
]  # fmt: skip


def _divisible(name: str, value: int, tp: int) -> None:
    if value % _int("tp", tp, 1):
        raise ValueError(f"{name} ({value}) must be divisible by the tensor-parallel size ({tp})")


def tp_activation_bytes_per_layer(batch: int, seq: int, hidden: int, heads: int, tp: int,
                                  sequence_parallel: bool = False, regather: bool = False,
                                  dtype_bytes: int = 4) -> int:  # fmt: skip
    """Bytes one `ParallelBlock` saves for backward on each rank (dropout off), tensor by tensor.

    Replicated under TP: the LayerNorm inputs and the two linear inputs they feed
    (4·BTC) and the LayerNorm statistics (4·BT). Split by tp: q, k, v and the attention
    output (4·BTC), the MLP's two 4C-wide tensors (8·BTC) and the softmax (a·B·T²).
    Sequence parallelism splits the LayerNorm inputs and statistics; `regather` also the
    linear inputs. The causal mask (T² bytes, bool) is whole everywhere. tp=1 gives
    `activation_bytes_per_layer`; compare Korthikanti et al.'s fp16
    sbh(10 + 24/t + 5as/(ht)) and, with SP, sbh(34/t + 5as/(ht)).
    """
    B, T, C, a = batch, seq, hidden, heads
    for name, v in (("batch", B), ("seq", T), ("hidden", C), ("heads", a), ("dtype_bytes", dtype_bytes)):
        _int(name, v, 1)
    _divisible("heads", a, tp)
    d, t = dtype_bytes, tp
    ln_in, stats, lin_in = 2 * B * T * C * d, 4 * B * T * d, 2 * B * T * C * d
    if sequence_parallel:
        _divisible("seq", T, t)
        ln_in, stats = ln_in // t, stats // t
        lin_in = lin_in // t if regather else lin_in
    split = 12 * B * T * C * d // t + a * B * T * T * d // t
    return ln_in + stats + lin_in + split + T * T
