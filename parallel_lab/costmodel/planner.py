"""Planner: which (dp, tp, pp, ZeRO stage, checkpointing) layouts fit a GPT on a cluster, and how fast.

Memory per GPU (the first pipeline stage, the fullest under 1F1B):
- model states of the stage's parameters, split by tp, then ZeRO over dp
  (`costmodel.model_state_bytes`; Rajbhandari et al. 2020);
- activations: per layer and micro-batch sbh(10 + 24/t + 5as/(ht)) bytes in 16-bit
  (Korthikanti et al. 2022, Table 2), or sbh(34/t + 5as/(ht)) with sequence
  parallelism, times the layers of the stage, times the p micro-batches 1F1B keeps
  in flight; full recomputation keeps only each layer's input (2sbh) plus one
  layer's activations (Chen et al. 2016).
Time per iteration: FLOPs 72BsLh^2(1 + s/(6h) + V/(16Lh)), 96 with recomputation
(Narayanan et al. 2021, eq. 3), at an assumed fraction `mfu` of peak, stretched by
the pipeline bubble (p-1)/m; plus communication the model does not overlap:
TP 4 all-reduces of bsh per layer and micro-batch (8bsh; Korthikanti et al. 2022), DP one
all-reduce of the stage's gradients (16h^2 per layer in 16-bit; ZeRO-3 1.5x, Rajbhandari
et al. 2020 section 7; ZeRO-2/3 under PP once per micro-batch), PP 2bsh per micro-batch and
boundary. Links: NVLink inside a node, the network across nodes.
Context parallelism (cp, lesson 17): every rank holds s/cp tokens of each sequence, so every
activation term divides by cp (the score term too: a rank's queries are s/cp); ring attention
sends per layer and micro-batch (cp-1)·2·bsh/cp·2 bytes forward and that plus cp·2·bsh/cp·4
backward (`costmodel.ring_attention_bytes`, 16-bit blocks, fp32 dK/dV), of which only what the
attention's own compute (4bs²h/cp FLOPs forward, twice that backward) cannot hide is exposed;
the gradient reduction and ZeRO's sharding run over dp x cp ranks (CP ranks hold replicas).

Invariant: memory numbers are exact byte counts of the formulas above (and equal
what the lab's TinyGPT holds, parameter by parameter, when `lab_layout=True`); times
are a model, stated with their assumptions, for ranking layouts, not promises.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from parallel_lab.costmodel.context import ring_attention_bytes
from parallel_lab.costmodel.formulas import _int, _number, model_state_bytes, tp_activation_bytes_per_layer

#: sequences this long (tokens) or longer make `plan` consider context parallelism by default.
LONG_SEQUENCE = 16384


@dataclass(frozen=True)
class ModelSpec:
    """A GPT: layers, hidden size, heads, sequence length, vocabulary (Megatron's layer layout)."""

    name: str
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    tied: bool = True

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq", "vocab"):
            _int(name, getattr(self, name), 1)
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")

    @property
    def num_params(self) -> int:
        """12Lh^2 + 13Lh (blocks) + Vh + sh (embeddings) + 2h (final LayerNorm) (+ Vh untied head)."""
        L, h = self.layers, self.hidden
        return (
            12 * L * h * h
            + 13 * L * h
            + (self.vocab + self.seq) * h
            + 2 * h
            + (0 if self.tied else self.vocab * h)
        )


GPT3 = ModelSpec("GPT-3 175B", layers=96, hidden=12288, heads=96, seq=2048, vocab=50257)
BLOOM = ModelSpec("BLOOM-176B", layers=70, hidden=14336, heads=112, seq=2048, vocab=250880)


@dataclass(frozen=True)
class ClusterSpec:
    """GPUs, memory each, peak FLOP/s, link bandwidth (bytes/s per GPU) inside and across nodes."""

    gpus: int
    gpus_per_node: int = 8
    memory: float = 80e9
    peak_flops: float = 312e12  # A100 bf16 dense
    intra_bw: float = 300e9  # NVLink, per direction
    inter_bw: float = 12.5e9  # 100 Gb/s per GPU
    mfu: float = 0.5  # fraction of peak the matmuls reach

    def __post_init__(self) -> None:
        _int("gpus", self.gpus, 1)
        _int("gpus_per_node", self.gpus_per_node, 1)
        for name in ("memory", "peak_flops", "intra_bw", "inter_bw"):
            _number(name, getattr(self, name), 0.0, strict=True)
        if not 0 < _number("mfu", self.mfu) <= 1:
            raise ValueError(f"mfu must be in (0, 1], got {self.mfu}")


#: BLOOM-176B's machine (Jean Zay): 48 nodes x 8 A100 80GB, 4 x 100 Gb/s Omni-Path per node.
JEAN_ZAY = ClusterSpec(gpus=384, gpus_per_node=8, memory=80e9, inter_bw=4 * 12.5e9 / 8)


@dataclass
class Plan:
    """One layout: sizes, bytes per GPU by category, seconds per iteration by part, and notes."""

    dp: int
    tp: int
    pp: int
    zero: int
    checkpointing: bool
    microbatches: int
    memory: dict[str, float]
    time: dict[str, float]
    fits: bool
    notes: list[str] = field(default_factory=list)
    cp: int = 1

    def __str__(self) -> str:
        ck = "ckpt" if self.checkpointing else "    "
        cp = f"cp={self.cp:<2} " if self.cp > 1 else ""
        return (f"dp={self.dp:<3} {cp}tp={self.tp:<2} pp={self.pp:<3} ZeRO-{self.zero} {ck} m={self.microbatches:<4} "
                f"{self.memory['total'] / 1e9:7.1f} GB/GPU {self.time['total']:7.2f} s/iter")  # fmt: skip


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
    model: ModelSpec, micro_batch: int, tp: int, sequence_parallel: bool = False
) -> float:
    """Korthikanti et al. 2022: sbh(10 + 24/t + 5as/(ht)) bytes (16-bit, with dropout masks)."""
    s, b, h, a, t = model.seq, micro_batch, model.hidden, model.heads, tp
    if sequence_parallel:
        return s * b * h * (34 / t + 5 * a * s / (h * t))
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


def iteration_flops(model: ModelSpec, global_batch: int, checkpointing: bool) -> float:
    """Narayanan et al. 2021: 72BsLh^2(1 + s/6h + V/16Lh), 96 (one more forward) with recomputation."""
    B, s, L, h, V = global_batch, model.seq, model.layers, model.hidden, model.vocab
    return (96 if checkpointing else 72) * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))


def evaluate(model: ModelSpec, cluster: ClusterSpec, dp: int, tp: int, pp: int, zero: int, checkpointing: bool,
             global_batch: int, micro_batch: int = 1, sequence_parallel: bool = False,
             precision: str = "mixed", optimizer: str = "adam", cp: int = 1) -> Plan:  # fmt: skip
    """Memory and time of one layout (see the module docstring for every term)."""
    _int("cp", cp, 1)
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
    m = global_batch // (dp * micro_batch)
    notes = []
    states = model_state_bytes(stage_params(model, tp, pp), dp * cp, zero, optimizer, precision)
    L_stage = -(-model.layers // pp)
    per_layer = activation_bytes_per_layer(model, micro_batch, tp, sequence_parallel) / cp
    in_flight = min(pp, m)  # 1F1B on the first stage
    if checkpointing:  # keep each layer's 16-bit input; recompute one layer at a time in backward
        act = in_flight * L_stage * 2 * model.seq // cp * micro_batch * model.hidden + per_layer
    else:
        act = in_flight * L_stage * per_layer
    memory = {"param": states["param"], "grad": states["grad"], "optim": states["optim"], "activation": act}
    memory["total"] = sum(memory.values())

    compute = iteration_flops(model, global_batch, checkpointing) / (
        cluster.gpus * cluster.peak_flops * cluster.mfu
    )
    bubble = compute * (pp - 1) / m  # Megatron's bubble-to-compute ratio
    gpn = cluster.gpus_per_node
    bw = lambda inside: cluster.intra_bw if inside else cluster.inter_bw  # noqa: E731
    x = micro_batch * model.seq // cp * model.hidden * 2  # one (b, s/cp, h) activation in 16-bit, bytes
    passes = 6 if checkpointing else 4  # all-reduces per layer and micro-batch (recompute redoes forward's 2)
    tp_comm = (L_stage * m * passes * 2 * (tp - 1) / tp * x / bw(tp <= gpn)) if tp > 1 else 0.0
    grads = stage_params(model, tp, pp) * 2  # 16-bit gradients of the stage
    dp_inside = dp * cp * tp <= gpn
    r = dp * cp  # replicas of the stage's weights: the gradient reduction runs over all of them
    dp_comm = 2 * (r - 1) / r * grads / bw(dp_inside) * (1.5 if zero == 3 else 1.0) if r > 1 else 0.0
    if zero >= 2 and pp > 1 and r > 1:
        dp_comm *= m
        notes.append("ZeRO-2/3 under PP: a reduce-scatter per micro-batch")
    pp_inside = dp * cp * tp * pp <= gpn
    pp_comm = (m + pp - 1) * 2 * x / bw(pp_inside) if pp > 1 else 0.0
    cp_comm = 0.0
    if cp > 1:  # ring attention per layer and micro-batch, minus what the attention's compute hides
        ring = ring_attention_bytes(micro_batch, model.heads // tp, model.seq // cp, model.hidden // model.heads,
                                    cp, itemsize=2)  # fmt: skip
        attn_flops = 4 * micro_batch * (model.seq // cp) * model.seq * model.hidden // tp  # forward, per rank
        hide = attn_flops / (cluster.peak_flops * cluster.mfu)
        link = bw(cp * tp <= gpn)
        exposed = max(0.0, ring["forward"] / link - hide) + max(0.0, ring["backward"] / link - 2 * hide)
        cp_comm = L_stage * m * exposed
    time = {"compute": compute, "bubble": bubble, "tp_comm": tp_comm, "dp_comm": dp_comm, "pp_comm": pp_comm,
            "cp_comm": cp_comm}  # fmt: skip
    time["total"] = sum(time.values())
    if tp > gpn:
        notes.append("TP across nodes")
    return Plan(
        dp, tp, pp, zero, checkpointing, m, memory, time, memory["total"] <= cluster.memory, notes, cp
    )


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


__all__ = ["BLOOM", "GPT3", "JEAN_ZAY", "LONG_SEQUENCE", "ClusterSpec", "ModelSpec", "Plan", "evaluate", "fp32_param_bytes",
           "gradient_traffic_per_iteration", "iteration_flops", "lab_stage_memory", "plan", "stage_params"]  # fmt: skip
