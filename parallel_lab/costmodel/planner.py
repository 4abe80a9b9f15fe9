"""Planner: which (dp, tp, pp, ZeRO stage, checkpointing) layouts fit a GPT on a cluster, and how fast.

Memory per GPU (the first pipeline stage, the fullest under 1F1B):
- model states of the stage's parameters, split by tp, then ZeRO over dp
  (`costmodel.model_state_bytes`; Rajbhandari et al. 2020);
- activations: per layer and micro-batch sbh(10 + 24/t + 5as/(ht)) bytes in 16-bit
  (Korthikanti et al. 2022, Table 2), or sbh(34/t + 5as/(ht)) with sequence
  parallelism, times the layers of the stage, times the p micro-batches 1F1B keeps
  in flight; full recomputation keeps only each layer's input (2sbh) plus one
  layer's activations (Chen et al. 2016).
Time per iteration, from the GPU's physics (`costmodel.hardware`, `costmodel.timing`), never a fitted
fraction of peak: one micro-batch through the slowest pipeline stage is its layers' GEMMs (a roofline
each) plus their memory-bound ops (traffic over HBM) plus the tensor-parallel all-reduces (exposed:
two per pass, 2(t-1)/t of the (b, s, h) activation each; the recomputed forward's too), and on the
last stage the logits. The 1F1B pipeline runs m of them and a bubble of (p-1)/v more (Narayanan et
al. 2021, v model chunks per stage); each micro-batch sends its activation forward and its gradient
back (1/t of it from each TP rank, Megatron's scatter/gather). Data parallelism reduces fp32
gradients once a step, bucketed behind the last micro-batch's backward; ZeRO-2 reduce-scatters every
micro-batch behind its backward; ZeRO-3 gathers the parameters for the forward, the backward and a
recomputed forward and reduce-scatters the gradients, every micro-batch, prefetched behind its
compute (Rajbhandari et al. 2020). Overlapped communication leaves max(0, comm - compute) +
f·min(comm, compute) exposed (`timing.exposed_seconds`). Recomputation: full reruns every layer's
forward, selective only the attention's score GEMMs, softmax and dropout (Korthikanti et al. 2022).
The zero-bubble schedules (`schedule`, Qi et al. 2024, lesson 19) split each backward into B and W (W:
the weight-gradient GEMMs) and charge ZB-H1's or ZB-H2's bubble (`zero_bubble_size`); ZB-H2 keeps
2p-1 micro-batches in flight instead of p.
The optimizer step is memory-bound: about 30 bytes per parameter of the GPU's shard.
MFU is an output: model FLOPs (`training_flops`, no recomputation) per second over the peak.
Context parallelism (cp, lesson 17): every rank holds s/cp tokens of each sequence, so every
activation term divides by cp (the score term too: a rank's queries are s/cp); ring attention
sends per layer and micro-batch (cp-1)·2·bsh/cp·2 bytes forward and that plus cp·2·bsh/cp·4
backward (`costmodel.ring_attention_bytes`, 16-bit blocks, fp32 dK/dV), of which only what the
attention's own compute (4bs²h/cp FLOPs forward, twice that backward) cannot hide is exposed;
the gradient reduction and ZeRO's sharding run over dp x cp ranks (CP ranks hold replicas).

Invariant: memory numbers are exact byte counts of the formulas above (and equal
what the lab's TinyGPT holds, parameter by parameter, when `lab_layout=True`); times
are a model with one set of constants per GPU kind, checked against published runs
(`costmodel.published`: every row within 15%).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from parallel_lab.costmodel.context import ring_attention_bytes
from parallel_lab.costmodel.formulas import _int, _number, model_state_bytes, tp_activation_bytes_per_layer
from parallel_lab.costmodel.hardware import A100_80GB, GPU
from parallel_lab.costmodel.timing import (
    LayerShape,
    collective_seconds,
    exposed_seconds,
    gemm_seconds,
    layer_times,
)

#: sequences this long (tokens) or longer make `plan` consider context parallelism by default.
LONG_SEQUENCE = 16384


@dataclass(frozen=True)
class ModelSpec:
    """A GPT: layers, hidden size, heads, sequence length, vocabulary (Megatron's layer layout).

    `ffn` (default 4h), `kv_heads` (default: every head has its keys and values) and `gated`
    (SwiGLU's two input projections) describe Llama-style blocks."""

    name: str
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    tied: bool = True
    ffn: int | None = None
    kv_heads: int | None = None
    gated: bool = False

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq", "vocab"):
            _int(name, getattr(self, name), 1)
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if self.ffn is not None:
            _int("ffn", self.ffn, 1)
        if self.kv_heads is not None and (
            _int("kv_heads", self.kv_heads, 1) > self.heads or self.heads % self.kv_heads
        ):
            raise ValueError(f"kv_heads ({self.kv_heads}) must divide heads ({self.heads})")

    @property
    def ffn_size(self) -> int:
        return 4 * self.hidden if self.ffn is None else self.ffn

    @property
    def kv_size(self) -> int:
        """Key/value heads: all of them unless grouped-query attention says fewer."""
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def layer_weights(self) -> int:
        """Matrix weights of one block: Q, K, V, the output projection, the MLP (12h^2 for GPT)."""
        h, d = self.hidden, self.hidden // self.heads
        return h * (h + 2 * self.kv_size * d) + h * h + ((3 if self.gated else 2) * self.ffn_size) * h

    @property
    def num_params(self) -> int:
        """L(12h^2 + 13h) (blocks) + Vh + sh (embeddings) + 2h (final LayerNorm) (+ Vh untied head)."""
        L, h = self.layers, self.hidden
        return (
            L * (self.layer_weights + 13 * h)
            + (self.vocab + self.seq) * h
            + 2 * h
            + (0 if self.tied else self.vocab * h)
        )


GPT3 = ModelSpec("GPT-3 175B", layers=96, hidden=12288, heads=96, seq=2048, vocab=50257)
BLOOM = ModelSpec("BLOOM-176B", layers=70, hidden=14336, heads=112, seq=2048, vocab=250880)


@dataclass(frozen=True)
class ClusterSpec:
    """`gpus` GPUs of one kind (`gpu`, a `costmodel.hardware` preset), `gpus_per_node` per node.

    `memory`, `intra_bw` (NVLink, per GPU and direction) and `inter_bw` (the GPU's network link) default
    to the preset's; set them to describe another machine (e.g. a slower network)."""

    gpus: int
    gpus_per_node: int = 8
    gpu: GPU = A100_80GB
    memory: float | None = None
    intra_bw: float | None = None
    inter_bw: float | None = None

    def __post_init__(self) -> None:
        _int("gpus", self.gpus, 1)
        _int("gpus_per_node", self.gpus_per_node, 1)
        if not isinstance(self.gpu, GPU):
            raise TypeError(
                f"gpu must be a costmodel.hardware.GPU (e.g. A100_80GB), got {type(self.gpu).__name__}"
            )
        for name in ("memory", "intra_bw", "inter_bw"):
            if getattr(self, name) is not None:
                _number(name, getattr(self, name), 0.0, strict=True)

    @property
    def device(self) -> GPU:
        """The GPU with this cluster's overrides of memory and links applied."""
        return replace(
            self.gpu,
            memory=self.memory or self.gpu.memory,
            nvlink_bw=self.intra_bw or self.gpu.nvlink_bw,
            network_bw=self.inter_bw or self.gpu.network_bw,
        )

    @property
    def peak_flops(self) -> float:
        return self.gpu.peak_flops


#: BLOOM-176B's machine (Jean Zay): 48 nodes x 8 A100 80GB, 4 x 100 Gb/s Omni-Path per node.
JEAN_ZAY = ClusterSpec(gpus=384, gpus_per_node=8, gpu=A100_80GB, inter_bw=4 * 12.5e9 / 8)


@dataclass
class Plan:
    """One layout: sizes, bytes per GPU by category, seconds per iteration by part, and notes.

    `time` splits the iteration: "matmul" and "memory" (non-matmul ops and the optimizer step) are
    the busy part, then the pipeline "bubble" and the communication each axis leaves exposed
    ("tp_comm", "pp_comm", "dp_comm", "cp_comm"); "total" is their sum. `mfu` is the model FLOPs
    (no recomputation) per second over the cluster's peak, `tflops` the FLOPs the GPUs actually run
    (recomputation included) per GPU, in TFLOP/s."""

    dp: int
    tp: int
    pp: int
    zero: int
    checkpointing: bool | str
    microbatches: int
    memory: dict[str, float]
    time: dict[str, float]
    fits: bool
    notes: list[str] = field(default_factory=list)
    cp: int = 1
    chunks: int = 1
    mfu: float = 0.0
    tflops: float = 0.0
    schedule: str = "1f1b"
    replicate: int = 1  # HSDP's replicas (ZeRO-3 sharded over dp x cp / replicate ranks)

    def __str__(self) -> str:
        ck = {False: "    ", True: "ckpt", "full": "ckpt", "selective": "sel "}[self.checkpointing]
        cp = f"cp={self.cp:<2} " if self.cp > 1 else ""
        z = (
            f"HSDP {self.replicate}x{self.dp * self.cp // self.replicate}"
            if self.replicate > 1
            else f"ZeRO-{self.zero}"
        )
        return (f"dp={self.dp:<3} {cp}tp={self.tp:<2} pp={self.pp:<3} {z} {ck} m={self.microbatches:<4} "
                f"{self.memory['total'] / 1e9:7.1f} GB/GPU {self.time['total']:7.2f} s/iter MFU {self.mfu:4.0%}")  # fmt: skip


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def stage_params(model: ModelSpec, tp: int, pp: int, stage: int = 0, lab_layout: bool = False) -> int:
    """Parameters one GPU of pipeline stage `stage` holds.

    Megatron layout: blocks (12h^2 + 13h each) and the vocabulary split by tp. `lab_layout`:
    the lab's TP blocks (split weights and column biases, replicated row biases and
    LayerNorms: (12h^2 + 7h)/t + 6h) and embeddings replicated over TP (tensor_parallel.transformer).
    """
    L, h, V, s = model.layers, model.hidden, model.vocab, model.seq
    per = -(-L // pp)  # ceil: the first stages take the extra layers
    layers = max(0, min(per, L - stage * per))
    block = (12 * h * h + 7 * h) // tp + 6 * h if lab_layout else (12 * h * h + 13 * h) // tp
    vt = 1 if lab_layout else tp
    n = layers * block
    first, last = stage == 0, stage == pp - 1
    if first:
        n += V * h // vt + s * h
    if last:
        n += 2 * h
        if not (model.tied and first):  # the head: its own matrix, or a tied copy on another stage
            n += V * h // vt
    return n


def activation_bytes_per_layer(
    model: ModelSpec, micro_batch: int, tp: int, sequence_parallel: bool = False, selective: bool = False
) -> float:
    """Korthikanti et al. 2022: sbh(10 + 24/t + 5as/(ht)) bytes (16-bit, with dropout masks); selective
    recomputation drops the attention's 5as/(ht) term (it is recomputed)."""
    s, b, h, a, t = model.seq, micro_batch, model.hidden, model.heads, tp
    scores = 0.0 if selective else 5 * a * s / (h * t)
    if sequence_parallel:
        return s * b * h * (34 / t + scores)
    return s * b * h * (10 + 24 / t + scores)


def _recompute(checkpointing: bool | str) -> str:
    if checkpointing is False or checkpointing == "none":
        return "none"
    if checkpointing is True or checkpointing == "full":
        return "full"
    if checkpointing == "selective":
        return "selective"
    raise ValueError(f"checkpointing must be False, True ('full') or 'selective', got {checkpointing!r}")


def training_flops(model: ModelSpec, global_batch: int, recompute: bool | str = False) -> float:
    """FLOPs of one iteration: 3 x the forward (backward is twice the forward) of every layer, 2s·W + 4s²h
    per sequence for W matrix weights, and the logits, 2shV; full recomputation runs the layers' forward
    once more, selective only the attention's 4s²h. For GPT this is Narayanan et al. 2021, eq. 3:
    96BsLh²(1 + s/6h + V/16Lh) with recomputation, and 72BsLh²(1 + s/6h) + 6BshV without."""
    rc = _recompute(recompute)
    s, h, L, V = model.seq, model.hidden, model.layers, model.vocab
    layer = 2 * s * model.layer_weights + 4 * s * s * h
    flops = 3 * (L * layer + 2 * s * h * V)
    flops += {"none": 0, "full": L * layer, "selective": L * 4 * s * s * h}[rc]
    return float(global_batch) * flops


def iteration_flops(model: ModelSpec, global_batch: int, checkpointing: bool) -> float:
    """`training_flops` with full recomputation or none (Narayanan et al. 2021, eq. 3)."""
    return training_flops(model, global_batch, "full" if checkpointing else "none")


#: the pipeline schedules `evaluate` times: 1F1B (interleaved with chunks > 1) and Qi et al.'s ZB-H1, ZB-H2
PIPELINE_SCHEDULES = ("1f1b", "zb-h1", "zb-h2")


def zero_bubble_size(schedule: str, pp: int, m: int, t_f: float, t_b: float, t_w: float) -> tuple[float, str]:
    """The bubble of ZB-H1 or ZB-H2 (Qi et al. 2024, section 2) in seconds, and a note when it falls back.

    ZB-H1: (p-1)(T_F + T_B - T_W), where T_W <= T_F and m >= p; ZB-H2: (p-1)(T_F + T_B - 2T_W), where
    T_W <= T_F, 2T_W <= T_F + T_B and m >= 2p-1 (lesson 19's simulator finds the formulas exact there).
    Outside its conditions a schedule is charged 1F1B's (p-1)(T_F + T_B + T_W), which bounds both
    from above (the simulator, on a grid of p, m and times), and the note says so. Messages take
    no time here: the planner charges them apart (pp_comm)."""
    h1 = t_w <= t_f and m >= pp
    if schedule == "zb-h2" and h1 and 2 * t_w <= t_f + t_b and m >= 2 * pp - 1:
        return (pp - 1) * (t_f + t_b - 2 * t_w), ""
    if schedule == "zb-h1" and h1:
        return (pp - 1) * (t_f + t_b - t_w), ""
    why = f"{schedule} outside its bubble formula's conditions: 1F1B's bubble charged"
    return (pp - 1) * (t_f + t_b + t_w), why


def evaluate(model: ModelSpec, cluster: ClusterSpec, dp: int, tp: int, pp: int, zero: int,
             checkpointing: bool | str, global_batch: int, micro_batch: int = 1, sequence_parallel: bool = False,
             precision: str = "mixed", optimizer: str = "adam", cp: int = 1, chunks: int = 1,
             flash_attention: bool = False, schedule: str = "1f1b", replicate: int = 1) -> Plan:  # fmt: skip
    """Memory and time of one layout (see the module docstring for every term).

    `checkpointing`: False, True (full recomputation) or "selective" (the attention scores only,
    Korthikanti et al. 2022). `chunks`: model chunks per pipeline stage (interleaved 1F1B, v).
    `flash_attention`: attention as one fused kernel (Dao et al. 2022), timed so, and its T x T
    scores never stored, in any recomputation mode. `schedule`: "1f1b", or a zero-bubble one (Qi et
    al. 2024, lesson 19; one chunk per stage), see `ZERO_BUBBLE`. `replicate`: with zero=3, HSDP (lesson 20):
    the dp x cp ranks that hold a stage split into `replicate` replicas of S = dp x cp / replicate ranks each
    (neighbours); ZeRO-3 inside each (gathers and reduce-scatters over S, every micro-batch), the (P/S,)
    gradient slice all-reduced across the replicas once per step in 16-bit, behind the last micro-batch's
    backward (FSDP2 overlaps it unit by unit; the lab's `zero.HSDP` runs it after the backward)."""
    _int("cp", cp, 1)
    _int("replicate", replicate, 1)
    if replicate > 1 and zero != 3:
        raise ValueError(
            f"replicate={replicate} is HSDP, which shards with ZeRO-3: needs zero=3, got zero={zero}"
        )
    if (dp * cp) % replicate:
        raise ValueError(
            f"replicate ({replicate}) must divide dp x cp = {dp * cp} (the ranks that hold a stage)"
        )
    _int("chunks", chunks, 1)
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"schedule must be one of {PIPELINE_SCHEDULES}, got {schedule!r}")
    if schedule != "1f1b" and chunks > 1:
        raise ValueError(f"schedule {schedule!r} runs one chunk per stage, got chunks={chunks}")
    rc = _recompute(checkpointing)
    if dp * cp * tp * pp != cluster.gpus:
        what = "dp * cp * tp * pp" if cp > 1 else "dp * tp * pp"
        raise ValueError(f"{what} = {dp * cp * tp * pp} must equal the cluster's {cluster.gpus} GPUs")
    if model.seq % (2 * cp) and cp > 1:
        raise ValueError(
            f"seq ({model.seq}) must be divisible by 2 x cp = {2 * cp} (the load-balanced layout)"
        )
    if global_batch % (dp * micro_batch):
        raise ValueError(
            f"global_batch ({global_batch}) must be divisible by dp x micro_batch = {dp} x {micro_batch}"
        )
    if chunks > 1 and (pp == 1 or model.layers % (pp * chunks)):
        raise ValueError(
            f"chunks ({chunks}) > 1 needs pp > 1 and layers ({model.layers}) divisible by pp x chunks"
        )
    m = global_batch // (dp * micro_batch)
    notes = []
    gpu, gpn = cluster.device, cluster.gpus_per_node
    r = dp * cp  # replicas of the stage's weights: the gradient reduction runs over all of them
    shard = r // replicate  # ranks a stage's states are sharded over (all r but under HSDP)
    n_stage = stage_params(model, tp, pp)
    states = model_state_bytes(n_stage, shard, zero, optimizer, precision)
    L_stage = -(-model.layers // pp)
    # flash attention never stores the T x T scores: the same bytes as selective recomputation's
    no_scores = rc == "selective" or flash_attention
    per_layer = activation_bytes_per_layer(model, micro_batch, tp, sequence_parallel, no_scores) / cp
    # 1F1B and ZB-H1 on the first stage; ZB-H2 warms up 2p-1 micro-batches on every stage
    in_flight = min(2 * pp - 1 if schedule == "zb-h2" else pp, m)
    if rc == "full":  # keep each layer's 16-bit input; recompute one layer at a time in backward
        act = in_flight * L_stage * 2 * model.seq // cp * micro_batch * model.hidden + per_layer
    else:
        act = in_flight * L_stage * per_layer
    memory = {"param": states["param"], "grad": states["grad"], "optim": states["optim"], "activation": act}
    memory["total"] = sum(memory.values())

    # one micro-batch through the slowest stage: layers, and on the last stage the logits
    shape = LayerShape(model.hidden, model.heads, model.seq, micro_batch, model.ffn_size, model.kv_size,
                       model.gated, tp, cp, sequence_parallel, flash_attention)  # fmt: skip
    lt = layer_times(gpu, shape, tp_inside_node=tp <= gpn)
    mm = lt.matmul_fwd + lt.matmul_bwd + {"none": 0.0, "full": lt.matmul_fwd, "selective": 0.0}[rc]
    mem = (
        lt.memory_fwd
        + lt.memory_bwd
        + {"none": 0.0, "full": lt.memory_fwd, "selective": lt.attention_fwd}[rc]
    )
    tpc = lt.tp_comm_fwd + lt.tp_comm_bwd + (lt.tp_comm_fwd if rc == "full" else 0.0)
    T = shape.tokens
    V = model.vocab / tp
    logits_mm = gemm_seconds(gpu, T, V, model.hidden) + 2 * gemm_seconds(gpu, T, model.hidden, V)
    logits_mem = 12 * T * V / gpu.hbm_bw  # 16-bit logits in, fp32 softmax and its gradient
    L_last = model.layers - (pp - 1) * L_stage if pp > 1 else model.layers
    stages = (
        [(L_stage, 0.0, 0.0), (L_last, logits_mm, logits_mem)]
        if pp > 1
        else [(model.layers, logits_mm, logits_mem)]
    )
    n_slow, lmm_slow, per_mb = max(
        (
            (n, lmm, {"matmul": n * mm + lmm, "memory": n * mem + lmem, "tp_comm": n * tpc})
            for n, lmm, lmem in stages
        ),
        key=lambda st: sum(st[2].values()),
    )  # the slowest stage: its layers, its logits' GEMMs, and its time per micro-batch by kind
    t_mb = sum(per_mb.values())
    bwd_mb = L_stage * (lt.matmul_bwd + lt.memory_bwd)  # what a gradient reduction can hide behind

    time = {k: m * v for k, v in per_mb.items()}
    time["bubble"] = (pp - 1) / chunks * t_mb  # 1F1B: (p-1)/v micro-batch times of fill and drain
    if schedule != "1f1b" and pp > 1:
        # W: the weight-gradient GEMMs, half of a layer's backward GEMMs (and one of the logits' two); B the
        # rest of the backward (attention's score GEMMs, all the memory-bound ops and TP collectives: more than
        # its share); F the forward with its TP collectives, the recomputed forward moved to B
        t_f = n_slow * (lt.matmul_fwd + lt.memory_fwd + lt.tp_comm_fwd) + lmm_slow / 3
        t_w = n_slow * lt.matmul_bwd / 2 + lmm_slow / 3
        t_b = t_mb - t_f - t_w
        bubble, why = zero_bubble_size(schedule, pp, m, t_f, t_b, t_w)
        if why:
            notes.append(why)
        time["bubble"] = bubble
    # pipeline sends: an activation forward and its gradient back per micro-batch and chunk; Megatron's
    # scatter/gather sends 1/tp of it from each tensor-parallel rank
    x = micro_batch * model.seq // cp * model.hidden * 2  # one (b, s/cp, h) activation in 16-bit, bytes
    pp_inside = dp * cp * tp * pp <= gpn
    link = (gpu.nvlink_bw if pp_inside else gpu.network_bw) * gpu.link_efficiency
    time["pp_comm"] = (m + pp - 1) * chunks * 2 * x / tp / link if pp > 1 else 0.0

    dp_inside = dp * cp * tp <= gpn
    param16 = n_stage * 2
    if r == 1:
        dp_comm = 0.0
    elif zero <= 1:  # one all-reduce (ZeRO-1: reduce-scatter + all-gather, the same bytes) of fp32 gradients,
        # bucketed behind the last micro-batch's backward
        dp_comm = exposed_seconds(gpu, collective_seconds(gpu, n_stage * 4, r, dp_inside, phases=2), bwd_mb)
    elif zero == 2:  # a reduce-scatter per micro-batch behind its backward, then the parameter all-gather
        rs = collective_seconds(gpu, param16, r, dp_inside)
        dp_comm = m * exposed_seconds(gpu, rs, bwd_mb) + collective_seconds(gpu, param16, r, dp_inside)
        notes.append("ZeRO-2 under accumulation: a reduce-scatter per micro-batch")
    else:  # ZeRO-3: gathers for forward, backward (and the recomputed forward), a reduce-scatter, per
        # micro-batch, each prefetched behind the compute of the layers before it; under HSDP over the
        # shard group (S neighbours: S x tp GPUs), and once per step an all-reduce of the 16-bit slice
        # across the replicas (they span the whole data-parallel extent)
        gathers = 3 if rc == "full" else 2
        # (a shard group sits inside a node when its S x tp GPUs fit one and do not straddle two)
        shard_inside = shard * tp <= gpn and gpn % (shard * tp) == 0 if replicate > 1 else dp_inside
        comm_mb = (gathers + 1) * collective_seconds(gpu, param16, shard, shard_inside)
        dp_comm = m * exposed_seconds(gpu, comm_mb, t_mb)
        if replicate > 1:  # 16-bit like the reduce-scatter (FSDP2: one reduce dtype for both), behind the
            # last micro-batch's backward, as FSDP2 overlaps it unit by unit
            slice_ar = collective_seconds(gpu, param16 / shard, replicate, dp_inside, phases=2)
            dp_comm += exposed_seconds(gpu, slice_ar, bwd_mb)
    time["dp_comm"] = dp_comm
    cp_comm = 0.0
    if cp > 1:  # ring attention per layer and micro-batch, minus what the attention's compute hides
        ring = ring_attention_bytes(micro_batch, model.heads // tp, model.seq // cp, model.hidden // model.heads,
                                    cp, itemsize=2)  # fmt: skip
        hide = lt.attention_fwd  # the attention's own compute, forward; twice that backward
        link = (gpu.nvlink_bw if cp * tp <= gpn else gpu.network_bw) * gpu.link_efficiency
        exposed = exposed_seconds(gpu, ring["forward"] / link, hide) + exposed_seconds(
            gpu, ring["backward"] / link, 2 * hide
        )
        cp_comm = L_stage * m * exposed
    time["cp_comm"] = cp_comm
    # the optimizer step: Adam reads and writes fp32 master weights, moments and gradients (~30 bytes a parameter)
    time["memory"] += 30 * n_stage / (shard if zero >= 1 else 1) / gpu.hbm_bw
    time["total"] = sum(time.values())
    if tp > gpn:
        notes.append("TP across nodes")
    seconds = time["total"]
    mfu = training_flops(model, global_batch) / (seconds * cluster.gpus * gpu.peak_flops)
    tflops = training_flops(model, global_batch, rc) / (seconds * cluster.gpus) / 1e12
    return Plan(dp, tp, pp, zero, checkpointing, m, memory, time, memory["total"] <= gpu.memory, notes, cp,
                chunks, mfu, tflops, schedule, replicate)  # fmt: skip


def plan(model: ModelSpec, cluster: ClusterSpec, global_batch: int, micro_batch: int = 1,
         zero_stages: tuple[int, ...] = (0, 1, 2, 3), checkpointing: tuple[bool, ...] = (False, True),
         sequence_parallel: bool = False, max_tp: int | None = None,
         context_parallel: tuple[int, ...] | None = None) -> list[Plan]:  # fmt: skip
    """Every layout with tp | heads, tp <= `max_tp` (default: a node), pp <= layers and a whole number
    of micro-batches; feasible ones (fit in memory) first, each group fastest first.

    `context_parallel`: the cp sizes to consider; by default 1, and 2, 4, 8 too when the sequence is
    long (at least `LONG_SEQUENCE` tokens), where activations outgrow what the other axes can split."""
    if global_batch < 1 or micro_batch < 1:
        raise ValueError(f"global_batch and micro_batch must be >= 1, got {global_batch}, {micro_batch}")
    max_tp = cluster.gpus_per_node if max_tp is None else max_tp
    if context_parallel is None:
        context_parallel = (1, 2, 4, 8) if model.seq >= LONG_SEQUENCE else (1,)
    out = []
    for cp in context_parallel:
        if cluster.gpus % cp or (cp > 1 and model.seq % (2 * cp)):
            continue
        for tp in _divisors(cluster.gpus // cp):
            if tp > max_tp or model.heads % tp:
                continue
            for pp in _divisors(cluster.gpus // (cp * tp)):
                dp = cluster.gpus // (cp * tp * pp)
                if pp > model.layers or global_batch % (dp * micro_batch):
                    continue
                for zero in zero_stages:
                    for ck in checkpointing:
                        out.append(evaluate(model, cluster, dp, tp, pp, zero, ck, global_batch, micro_batch,
                                            sequence_parallel, cp=cp))  # fmt: skip
    return sorted(out, key=lambda p: (not p.fits, p.time["total"]))


# ----------------------------------------------------------------------------- published scale
def fp32_param_bytes(num_params: float) -> float:
    """GPT-3's 175B parameters (Brown et al. 2020) in fp32 are 700 GB (4 bytes each)."""
    return 4.0 * num_params


def gradient_traffic_per_iteration(num_params: float, replicas: int, bytes_per_grad: int = 4) -> float:
    """With 128 model replicas every iteration moves at least 128 x 700 GB = 89.6 TB of gradients
    (each replica's full fp32 gradient once). A ring all-reduce actually sends 2(N-1)/N of that per replica."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    return float(replicas) * bytes_per_grad * num_params


# ----------------------------------------------------------------------------- the lab's own runs
def lab_stage_memory(
    gpt, dims, micro_batch: int, microbatches: int, stage: int, optimizer: str = "adam"
) -> dict:
    """Predicted bytes on one rank of pipeline stage `stage` of a `three_d.train_3d` run (fp32, 1F1B).

    States: `stage_params(lab_layout=True)` x `costmodel` bytes per parameter. Activations:
    the micro-batches 1F1B keeps in flight on this stage, min(p - s, m), each saving
    `tp_activation_bytes_per_layer` per block, and on the last stage the head's tensors
    (ln_f input and statistics, lm_head input, logits' log-softmax, targets), as counted in
    `costmodel.activation_bytes`.
    """
    spec = ModelSpec("lab", gpt.n_layers, gpt.d_model, gpt.n_heads, gpt.seq_len, gpt.vocab, gpt.tie_weights)
    states = model_state_bytes(stage_params(spec, dims.tp, dims.pp, stage, lab_layout=True), dims.dp, 0,
                               optimizer, "fp32")  # fmt: skip
    b, T, C, V, d = micro_batch, gpt.seq_len, gpt.d_model, gpt.vocab, 4
    layers = max(0, min(-(-gpt.n_layers // dims.pp), gpt.n_layers - stage * -(-gpt.n_layers // dims.pp)))
    per_mb = layers * tp_activation_bytes_per_layer(b, T, C, gpt.n_heads, dims.tp)
    if stage == dims.pp - 1:
        per_mb += 2 * b * T * C * d + 2 * b * T * d + b * T * V * d + b * T * 8 + d
    act = min(dims.pp - stage, microbatches) * per_mb
    out = {"param": states["param"], "grad": states["grad"], "optim": states["optim"], "activation": act}
    out["total"] = sum(out.values())
    return out


__all__ = ["BLOOM", "GPT3", "JEAN_ZAY", "LONG_SEQUENCE", "PIPELINE_SCHEDULES", "ClusterSpec", "ModelSpec", "Plan", "evaluate",
           "fp32_param_bytes", "gradient_traffic_per_iteration", "iteration_flops", "lab_stage_memory", "plan", "stage_params",
           "zero_bubble_size"]  # fmt: skip
