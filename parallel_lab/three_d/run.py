"""3D parallelism: a TinyGPT trained with data x tensor x pipeline parallelism on one mesh.

Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", PTD-P): the layers are cut into pipeline stages
(`pipeline.executor`, any schedule), every block inside a stage is tensor parallel over
its TP group (`tensor_parallel.transformer.ParallelBlock`: heads and MLP columns split, two
all-reduces per block forward and two backward), and the whole pipeline is
replicated over DP groups that average each stage's gradients once per step. The
mesh is `ParallelDims` (TP innermost, PP outermost). With tied embeddings the first
stage's `wte` and the last stage's `lm_head` are two copies of one matrix: their
gradients are summed over an "embedding group" (the first and last stage of the same
(dp, tp) coordinates), as Megatron-LM does, so the copies stay equal.

Invariant: losses and parameters equal single-process training of the same TinyGPT
on the whole batch (each TP shard against its slice of the full tensor).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from parallel_lab import comms
from parallel_lab.models import GPTConfig, build_model, synthetic_batch
from parallel_lab.pipeline import (
    DP_SYNCS,
    SCHEDULES,
    PipelineRank,
    StageParts,
    chunks_of,
    placement_of,
    split_layers,
    stage_of,
)
from parallel_lab.runtime.parallel_dims import ParallelDims
from parallel_lab.tensor_parallel import ColumnParallelLinear, ParallelBlock, RowParallelLinear


@dataclass
class ThreeDConfig:
    """A 3D run of a TinyGPT. Defaults run on 8 CPU ranks (2 x 2 x 2) in a few seconds."""

    gpt: GPTConfig = field(
        default_factory=lambda: GPTConfig(vocab=64, seq_len=16, d_model=32, n_heads=4, n_layers=4)
    )
    schedule: str = "1f1b"
    microbatches: int = 4
    chunks: int = 1
    batch: int = 16  # global batch (all DP replicas together)
    steps: int = 3
    optimizer: str = "adam"
    lr: float = 1e-2
    compute_time: float = 0.0
    dp_sync: str = "end"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"ThreeDConfig.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.dp_sync not in DP_SYNCS:
            raise ValueError(f"ThreeDConfig.dp_sync must be one of {DP_SYNCS}, got {self.dp_sync!r}")
        for name in ("microbatches", "chunks", "batch", "steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ThreeDConfig.{name} must be an int >= 1, got {v!r}")


class GPTStage(nn.Module):
    """One virtual stage of a TinyGPT: the embeddings (first stage), its blocks (named by their
    global index, so parameter names match `TinyGPT`'s), ln_f and the head (last stage)."""

    def __init__(
        self, ctx, model: nn.Module, layers: range, first: bool, last: bool, tp_group=None, tp: int = 1
    ):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe = model.wte, model.wpe
        make = (lambda b: ParallelBlock.from_block(ctx, b, tp_group)) if tp > 1 else copy.deepcopy
        self.blocks = nn.ModuleDict({str(i): make(model.blocks[i]) for i in layers})
        if last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            B, T = x.shape  # token ids
            x = self.wte(x) + self.wpe(torch.arange(T, device=x.device))  # (B, T, C)
        for block in self.blocks.values():
            x = block(x)  # (B, T, C): TP blocks all-reduce inside, so every TP rank holds it whole
        if self.last:
            return self.lm_head(self.ln_f(x))  # (B, T, V)
        return x


def shard_spec(module: nn.Module) -> dict[str, tuple]:
    """How each parameter relates to the single-process tensor: ("col", tp, rank, partitions),
    ("row", tp, rank) or ("full",) (replicated)."""
    out, seen = {}, set()
    for name, mod in module.named_modules():
        for pname, q in mod.named_parameters(recurse=False):
            if id(q) in seen:  # a tied parameter, listed under its first name (as named_parameters does)
                continue
            seen.add(id(q))
            key = f"{name}.{pname}" if name else pname
            if isinstance(mod, ColumnParallelLinear):
                out[key] = ("col", mod.tp, mod.tp_rank, mod.partitions)
            elif isinstance(mod, RowParallelLinear) and pname == "weight":
                out[key] = ("row", mod.tp, mod.tp_rank)
            else:
                out[key] = ("full",)
    return out


def gpt_stage_parts(ctx, cfg: ThreeDConfig, mesh, tp_group, embed_group) -> StageParts:
    """This rank's chunks of the seeded TinyGPT, its blocks tensor parallel over `tp_group`."""
    p, r, tp = mesh.dims.pp, mesh.coords["pp"], mesh.dims.tp
    v, placement = chunks_of(cfg.schedule, cfg.chunks), placement_of(cfg.schedule)
    blocks = split_layers(cfg.gpt.n_layers, p, v)
    vs = [stage_of(r, c, p, placement) for c in range(v)]  # in a V, rank 0 holds the first stage and the last
    with torch.no_grad():
        model = copy.deepcopy(build_model(cfg.gpt, seed=cfg.seed)).to(ctx.device)
        mods = {c: GPTStage(ctx, model, blocks[vs[c]], vs[c] == 0, vs[c] == p * v - 1, tp_group, tp)
                for c in range(v)}  # fmt: skip
    params = {
        n: q for mod in mods.values() for n, q in mod.named_parameters()
    }  # a tie in one chunk: one entry; across a V's two chunks on rank 0: two names, one tensor
    V = cfg.gpt.vocab

    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))

    extra = None
    if (
        embed_group is not None
    ):  # tied weights on two stages: sum their gradients (Megatron's embedding group)
        shared = params.get("wte.weight", params.get("lm_head.weight"))

        def extra() -> None:
            comms.dist_all_reduce(ctx, shared.grad, op="sum", group=embed_group)

    return StageParts(mods, params, loss_fn, (cfg.gpt.seq_len, cfg.gpt.d_model), extra)


def _embedding_groups(ctx, dims: ParallelDims):
    """One group per (dp, tp): the first and the last pipeline stage. Every rank creates all of them."""
    mine = None
    for pp_ranks in dims.groups("pp"):
        ranks = [pp_ranks[0], pp_ranks[-1]]
        g = dist.new_group(ranks)
        if ctx.rank in ranks:
            mine = g
    return mine


def train_3d(ctx, cfg: ThreeDConfig, dims: ParallelDims) -> dict:
    """Train `cfg.steps` steps of a TinyGPT on the DP x TP x PP mesh `dims` (call through `launch`).

    Returns this rank's coordinates, losses (None off the last stage), parameters after
    training and step-0 gradients by TinyGPT name (numpy), with each one's `shard_spec`.
    """
    if dims.size != ctx.world_size:
        raise ValueError(
            f"dims.dp * dims.tp * dims.pp = {dims.size} must equal world_size = {ctx.world_size}"
        )
    mesh = dims.build(ctx)
    dp_rank, dp, m = mesh.coords["dp"], dims.dp, cfg.microbatches
    if cfg.batch % (dp * m):
        raise ValueError(f"batch ({cfg.batch}) must be divisible by dp x microbatches = {dp} x {m}")
    # a tie across ranks needs the embedding group; in a V the first and last stage share rank 0 (one tensor)
    tied = cfg.gpt.tie_weights and dims.pp > 1 and placement_of(cfg.schedule) != "v"
    embed_group = _embedding_groups(ctx, dims) if tied else None
    parts = gpt_stage_parts(ctx, cfg, mesh, mesh.group("tp"), embed_group)
    runner = PipelineRank(ctx, cfg, mesh.ranks("pp"), mesh.group("dp"), dp, parts, pp_group=mesh.group("pp"))
    rows, losses, grads = cfg.batch // dp, [], {}
    for step in range(cfg.steps):
        x, y = synthetic_batch("tokens", cfg.batch, seq_len=cfg.gpt.seq_len, vocab=cfg.gpt.vocab,
                               seed=cfg.seed + 1 + step, device=ctx.device)  # fmt: skip
        x, y = x[dp_rank * rows : (dp_rank + 1) * rows], y[dp_rank * rows : (dp_rank + 1) * rows]  # (B/dp, T)
        out = runner.step(list(x.chunk(m)), list(y.chunk(m)), step, keep_outputs=step == 0)
        losses.append(out["loss"])
        if step == 0:
            grads = out["grads"]
    spec = {}
    for mod in runner.mods.values():
        spec.update(shard_spec(mod))
    return {
        "rank": ctx.rank,
        "coords": mesh.coords,
        "losses": losses if losses[0] is not None else None,
        "params": {n: q.detach().cpu().numpy().copy() for n, q in runner.params.items()},
        "grads": grads,
        "spec": spec,
        # each tensor once: a V's tied embedding and head on rank 0 are two names of one tensor
        "n_params": sum(q.numel() for q in {id(q): q for q in runner.params.values()}.values()),
    }


def reference_3d(cfg: ThreeDConfig) -> tuple[list[float], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Single-process TinyGPT on the whole batch: (losses, step-0 gradients, parameters after training)."""
    from parallel_lab.models import train_reference

    model = build_model(cfg.gpt, seed=cfg.seed)
    batches = [synthetic_batch("tokens", cfg.batch, seq_len=cfg.gpt.seq_len, vocab=cfg.gpt.vocab, seed=cfg.seed + 1 + s)
               for s in range(cfg.steps)]  # fmt: skip
    model(*batches[0]).backward()
    grads = {n: q.grad.numpy().copy() for n, q in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    losses = train_reference(model, batches, cfg.optimizer, cfg.lr, cfg.steps)
    return losses, grads, {n: q.detach().numpy().copy() for n, q in model.named_parameters()}


def shard_of(full: np.ndarray, spec: tuple) -> np.ndarray:
    """The slice of a single-process tensor that a parameter with `spec` holds."""
    from parallel_lab.tensor_parallel import column_shard, row_shard

    t = torch.from_numpy(full)
    if spec[0] == "col":
        return column_shard(t, spec[1], spec[2], spec[3]).numpy()
    if spec[0] == "row":
        return row_shard(t, spec[1], spec[2]).numpy()
    return full


def compare_3d(result, cfg: ThreeDConfig) -> dict[str, float]:
    """Max |difference| to single-process training: losses, step-0 gradients, final parameters."""
    ref_losses, ref_grads, ref_params = reference_3d(cfg)
    tie = cfg.gpt.tie_weights
    last = [v for v in result.values if v["losses"] is not None]
    by_dp: dict[int, list[float]] = {}
    for v in last:  # TP ranks of one replica report the same loss; average the replicas
        by_dp.setdefault(v["coords"]["dp"], v["losses"])
    losses = [sum(ls[i] for ls in by_dp.values()) / len(by_dp) for i in range(cfg.steps)]
    out = {"loss": max(abs(a - b) for a, b in zip(losses, ref_losses)), "grad": 0.0, "param": 0.0}
    for v in result.values:
        for name, spec in v["spec"].items():
            ref_name = "wte.weight" if (tie and name == "lm_head.weight") else name
            for key, ref in (("param", ref_params), ("grad", ref_grads)):
                mine = v["params" if key == "param" else "grads"].get(name)
                if mine is None:
                    raise AssertionError(f"rank {v['rank']}: no {key} for {name}")
                want = ref[ref_name]  # a tied copy's gradient is the sum of both uses (embedding group)
                out[key] = max(out[key], float(np.abs(mine - shard_of(want, spec)).max()))
    return out
