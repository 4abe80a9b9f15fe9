"""Seconds for one transformer layer on one GPU: a roofline per matrix multiply, memory-bound traffic
for the rest, ring collectives on the node's links.

- Matmuls (Williams et al. 2009, the roofline): a GEMM of (M x K) by (K x N), `count` times, takes
  max(2·MNK / (peak · gemm_efficiency), 2(MK + KN + MN) / HBM bandwidth) in 16-bit. Efficiency
  therefore rises with the GEMM's arithmetic intensity MNK / (MK + KN + MN): with the hidden size, and
  falls with few tokens per micro-batch, a small head dimension, or a tensor-parallel degree that
  thins N or K. The backward runs two GEMMs per forward one (input and weight gradients).
- Everything else in a layer (LayerNorm, softmax, GeLU, dropout, bias and residual adds) moves bytes
  and does almost no arithmetic: its time is its traffic over the HBM bandwidth. The traffic is
  counted from the same tensors Korthikanti et al. 2022 (Table 2) count for activation memory: each
  op reads its 16-bit input and writes its output, a dropout also writes its 1-byte mask; the
  backward moves about twice the forward's bytes (it reads the saved input and the incoming gradient,
  writes the outgoing one). FlashAttention (Dao et al. 2022) keeps the s x s scores on chip: with it,
  the softmax and dropout traffic is gone and the attention GEMMs are pure compute.
- A ring collective of S bytes over n GPUs moves (n-1)/n · S per GPU per phase (two phases for an
  all-reduce) at `link_efficiency` of the link: NVLink inside a node, the GPU's NIC across nodes.
  One that overlaps compute leaves exposed max(0, comm - compute) + f·min(comm, compute)
  (`exposed_seconds`).

Invariant: pure arithmetic on the model's shape and a `GPU`; no number here is fitted to a run.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel_lab.costmodel.hardware import GPU


def gemm_seconds(gpu: GPU, m: float, n: float, k: float, count: float = 1.0, on_chip: bool = False) -> float:
    """`count` GEMMs of (m x k) @ (k x n) in 16-bit on `gpu`: the roofline's max of compute and traffic.
    `on_chip`: the operands never leave the SM (a fused kernel such as FlashAttention's): compute only."""
    flops = 2.0 * m * n * k * count
    traffic = 0.0 if on_chip else 2.0 * (m * k + k * n + m * n) * count
    return max(flops / (gpu.peak_flops * gpu.gemm_efficiency), traffic / gpu.hbm_bw)


def collective_seconds(gpu: GPU, nbytes: float, n: int, inside_node: bool, phases: int = 1) -> float:
    """A ring collective on `nbytes` over `n` GPUs: `phases` = 2 for an all-reduce, 1 for a reduce-scatter
    or an all-gather (`nbytes` is the full tensor's size)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw = (gpu.nvlink_bw if inside_node else gpu.network_bw) * gpu.link_efficiency
    return phases * (n - 1) / n * nbytes / bw


def exposed_seconds(gpu: GPU, comm: float, compute: float) -> float:
    """What a collective of `comm` seconds adds when it runs beside `compute` seconds of work.

    Perfect overlap would add max(0, comm - compute). But while the two run together each slows the
    other by `overlap_slowdown` f (the collective's kernels share the SMs and the memory with the
    compute), so the overlapped part, min(comm, compute), costs f of itself:
    exposed = max(0, comm - compute) + f·min(comm, compute)."""
    if comm <= 0:
        return 0.0
    return max(0.0, comm - compute) + gpu.overlap_slowdown * min(comm, compute)


@dataclass(frozen=True)
class LayerShape:
    """One transformer layer as one GPU of a (tp, cp) group sees it, for `micro_batch` sequences."""

    hidden: int
    heads: int
    seq: int
    micro_batch: int
    ffn: int  # the MLP's inner width (4h for GPT)
    kv_heads: int  # grouped-query attention: fewer key/value heads than query heads
    gated: bool = False  # SwiGLU: two input projections in the MLP
    tp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    flash_attention: bool = False

    @property
    def tokens(self) -> float:
        """Token rows of every activation on this GPU: b · s / cp."""
        return self.micro_batch * self.seq / self.cp


def _layer_gemms(x: LayerShape) -> dict[str, list[tuple[float, float, float]]]:
    """One layer's forward GEMMs as (M, N, K): the linear layers, and the s x s score and value GEMMs
    (each batched over b · a/t heads)."""
    T, h, t = x.tokens, x.hidden, x.tp
    d = h // x.heads
    qkv = h + 2 * x.kv_heads * d
    mlp_in = (2 if x.gated else 1) * x.ffn
    return {
        # Q, K, V; output projection; fc1 (gate and up for SwiGLU); fc2
        "linear": [(T, qkv / t, h), (T, h, h / t), (T, mlp_in / t, h), (T, h, x.ffn / t)],
        "attention": [(x.seq / x.cp, x.seq, d), (x.seq / x.cp, d, x.seq)],
    }


def layer_matmul_seconds(gpu: GPU, x: LayerShape) -> dict[str, float]:
    """Forward GEMM time of one layer, split {"linear", "attention"} (the s x s score and value GEMMs)."""
    g = _layer_gemms(x)
    per_head = x.micro_batch * x.heads / x.tp  # batched over sequences and this GPU's heads
    return {
        "linear": sum(gemm_seconds(gpu, m, n, k) for m, n, k in g["linear"]),
        "attention": sum(
            gemm_seconds(gpu, m, n, k, per_head, x.flash_attention) for m, n, k in g["attention"]
        ),
    }


def layer_backward_matmul_seconds(gpu: GPU, x: LayerShape) -> float:
    """Backward GEMM time of one layer: for each forward GEMM (M, N, K), the input gradient (M, K, N)
    and the weight gradient (K, N, M); with flash attention also the scores, recomputed."""
    g = _layer_gemms(x)
    per_head = x.micro_batch * x.heads / x.tp
    total = sum(gemm_seconds(gpu, m, k, n) + gemm_seconds(gpu, k, n, m) for m, n, k in g["linear"])
    for m, n, k in g["attention"]:
        fused = x.flash_attention
        total += gemm_seconds(gpu, m, k, n, per_head, fused) + gemm_seconds(gpu, k, n, m, per_head, fused)
    if x.flash_attention:  # the fused backward rebuilds the scores S = QK^T it never stored: a 5th GEMM
        m, n, k = g["attention"][0]  # (Dao 2023, FlashAttention-2, section 3.1.2)
        total += gemm_seconds(gpu, m, n, k, per_head, True)
    return total


def layer_memory_bytes(x: LayerShape) -> dict[str, float]:
    """Forward HBM traffic of the non-matmul ops of one layer, {"pointwise", "scores"} bytes.

    pointwise: two LayerNorms (read 2 + write 2 bytes per element each), two bias-dropout-residual
    adds (read output and residual, write the sum and a 1-byte mask: 7 each), the activation
    (GeLU: read and write the ffn-wide tensor; SwiGLU: read two, write one). With sequence parallelism
    the LayerNorms and dropouts run on 1/tp of the tokens. scores: the softmax (read, write) and
    dropout (read, write, mask) of the b·a/t·(s/cp)·s attention scores: 9 bytes each; none with
    FlashAttention."""
    T, h, t = x.tokens, x.hidden, x.tp
    E = T * h
    replicated = (8 + 14) * E / (t if x.sequence_parallel else 1)  # LayerNorms, dropout-adds
    act = (6 if x.gated else 4) * T * x.ffn / t  # 16-bit, ffn wide
    scores = 0.0 if x.flash_attention else 9.0 * x.micro_batch * x.heads / t * (x.seq / x.cp) * x.seq
    return {"pointwise": replicated + act, "scores": scores}


@dataclass(frozen=True)
class LayerTimes:
    """Seconds for one layer and one micro-batch on one GPU, by kind and pass."""

    matmul_fwd: float
    matmul_bwd: float
    memory_fwd: float
    memory_bwd: float
    attention_fwd: float  # the score GEMMs and score traffic alone (what selective recompute redoes)
    tp_comm_fwd: float
    tp_comm_bwd: float


def layer_times(gpu: GPU, x: LayerShape, tp_inside_node: bool = True) -> LayerTimes:
    """One layer's forward and backward: GEMMs by the roofline, the rest by traffic, and the tensor-parallel
    collectives (two all-reduces of the (b, s/cp, h) activation per pass, or with sequence parallelism an
    all-gather and a reduce-scatter each: the same bytes)."""
    mm = layer_matmul_seconds(gpu, x)
    mem = layer_memory_bytes(x)
    scores_fwd = mem["scores"] / gpu.hbm_bw
    memory_fwd = (mem["pointwise"] + mem["scores"]) / gpu.hbm_bw
    act_bytes = 2.0 * x.tokens * x.hidden  # 16-bit (b, s/cp, h)
    ar = collective_seconds(gpu, act_bytes, x.tp, tp_inside_node, phases=2)
    return LayerTimes(
        matmul_fwd=mm["linear"] + mm["attention"],
        matmul_bwd=layer_backward_matmul_seconds(gpu, x),
        memory_fwd=memory_fwd,
        memory_bwd=2.0 * memory_fwd,
        attention_fwd=mm["attention"] + scores_fwd,
        tp_comm_fwd=2 * ar,
        tp_comm_bwd=2 * ar,
    )


__all__ = ["LayerShape", "LayerTimes", "collective_seconds", "exposed_seconds", "gemm_seconds", "layer_matmul_seconds",
           "layer_memory_bytes", "layer_times"]  # fmt: skip
