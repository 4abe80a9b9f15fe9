"""Lesson 03 as a script: train a tiny GPT data-parallel and write the trace.

    torchrun --nproc-per-node 4 -m parallel_lab.scripts.ddp --variant ddp --bucket-kb 64
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 4 -m parallel_lab.scripts.ddp
    python -m parallel_lab.scripts.ddp --nproc 4          # no launcher: 4 local ranks via parallel_lab.runtime.launch

Variants: "param_server" (a parameter server, Li et al. 2014), "allreduce" (one all-reduce
per parameter after backward), "ddp" (`BucketedDDP`: bucket all-reduces overlapping
backward), "torch_ddp" (torch.nn.parallel.DistributedDataParallel, its bucket
all-reduces drawn on our timeline through a comm hook). Rank 0 prints the step time,
the buckets, the share of communication hidden under backward, the bytes each rank
sent per step next to the formula, and whether all replicas hold the same weights;
the trace (`--trace`, default runs/ddp.json) loads back with `RunResult.load`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from parallel_lab.costmodel import allreduce_bytes_per_rank
from parallel_lab.data_parallel import (
    AllReduceDP,
    AsyncAllReduce,
    BucketedDDP,
    ParameterServerDP,
    shard_batch,
    train_step,
)
from parallel_lab.models import GPTConfig, build_model, make_optimizer, synthetic_batch
from parallel_lab.runtime import device as mesh
from parallel_lab.runtime.from_env import round_up, run_script, scaled_default, script_world
from parallel_lab.runtime.overlap import LayerTimer, comm_hidden_fraction

VARIANTS = ("param_server", "allreduce", "ddp", "torch_ddp")


@dataclass
class DDPRun:
    """One data-parallel training run. Defaults take a few hundred ms on 2-4 CPU ranks."""

    variant: str = "ddp"
    model: GPTConfig = field(default_factory=lambda: GPTConfig(vocab=64, seq_len=32, d_model=64, n_layers=4))
    batch: int = 16  # global batch: every step, rank r trains on rows [r*B/N, (r+1)*B/N)
    steps: int = 3  # timed steps, after `warmup` untimed ones
    warmup: int = 1
    bucket_bytes: int = 64 * 2**10
    accumulation_steps: int = 1
    comm: str = "builtin"  # BucketedDDP: "builtin" (gloo async) or "ring" (ours, on a comm thread)
    algorithm: str = "builtin"  # AllReduceDP: "builtin" or "ring"
    optimizer: str = "adam"
    lr: float = 1e-3
    trace_layers: bool = True  # per-layer backward spans (LayerTimer)
    trace_comm: bool = True  # torch_ddp: draw its bucket all-reduces (a comm hook)
    bucket_view: bool = True  # torch_ddp: gradient_as_bucket_view (no second copy of the gradients)

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {self.variant!r}")
        for name in ("batch", "steps", "accumulation_steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"DDPRun.{name} must be an int >= 1, got {v!r}")


def traced_allreduce_hook(ctx, bucket):  # no annotations: DDP insists on its own types for them
    """A torch DDP comm hook (`dist.GradBucket` -> `Future[Tensor]`) doing what its default does
    (divide by N, all-reduce), drawn on our timeline."""
    buf = bucket.buffer().div_(dist.get_world_size())  # (bucket numel,)
    h = AsyncAllReduce(ctx, buf, None, f"torch bucket {bucket.index()}")
    # on gloo's thread at completion (waiting on the work there would deadlock)
    return h.future.then(lambda fut: (h.record(), fut.value()[0])[1])


def wrap(ctx: Any, model: torch.nn.Module, cfg: DDPRun) -> tuple[Any, torch.optim.Optimizer | None]:
    """The model wrapped for `cfg.variant`, and the optimizer this rank steps (None on parameter-server workers)."""
    make_opt = lambda params: make_optimizer(cfg.optimizer, params, cfg.lr)
    if cfg.variant == "param_server":
        ps = ParameterServerDP(model, ctx, make_opt)
        return ps, ps.optimizer
    if cfg.variant == "allreduce":
        dp = AllReduceDP(model, ctx, algorithm=cfg.algorithm)
    elif cfg.variant == "ddp":
        dp = BucketedDDP(model, ctx, bucket_bytes=cfg.bucket_bytes, comm=cfg.comm)
    else:
        dp = torch.nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=cfg.bucket_bytes / 2**20, gradient_as_bucket_view=cfg.bucket_view
        )
        if cfg.trace_comm:
            dp.register_comm_hook(ctx, traced_allreduce_hook)
    return dp, make_opt([p for p in model.parameters() if p.requires_grad])


def train_dp(ctx: Any, cfg: DDPRun) -> dict:
    """Train `cfg.warmup + cfg.steps` steps; the recorder keeps only the timed steps. Returns a summary."""
    model = build_model(cfg.model, seed=ctx.seed).to(ctx.device)
    # before wrapping: its gradient hooks then fire first, so "backward ended" is when the last gradient
    # arrived, not after a wrapper's hook has launched the last all-reduce
    timer = LayerTimer(model, ctx) if cfg.trace_layers else None
    dp, opt = wrap(ctx, model, cfg)
    mem = ctx.memory
    if mem is not None:
        mem.register_module(model)
        if opt is not None:
            mem.register_optimizer(opt)
    losses, step_s, starts = [], [], []
    for i in range(cfg.warmup + cfg.steps):
        if i == cfg.warmup:
            ctx.recorder.reset()  # forget the warm-up (first-call allocations, DDP's bucket rebuild)
            t_start = ctx.recorder.now()  # (the launcher has the warm-up's events already: see timed())
        with torch.no_grad():  # the global batch: "other" memory, the same on every rank
            batch = synthetic_batch("tokens", cfg.batch, seq_len=cfg.model.seq_len, vocab=cfg.model.vocab,
                                    seed=ctx.seed + 1000 + i, device=ctx.device)  # fmt: skip
        dist.barrier()  # every rank starts the step together: step times compare
        watch = mesh.Stopwatch(ctx.device)  # device time on a GPU: a host clock would time the launches
        starts.append(ctx.recorder.now())
        with watch():
            if cfg.variant == "param_server":
                losses.append(dp.step(batch if dp.is_server else None, timer=timer))
            else:
                xs, ys = (t.clone() for t in shard_batch(batch, ctx.rank, ctx.world_size))  # own storage
                losses.append(train_step(ctx, dp, opt, (xs, ys), cfg.accumulation_steps, timer=timer))
        if i >= cfg.warmup:
            step_s.append(watch)
    by_op = {op: (c["sent"] / cfg.steps, c["recv"] / cfg.steps) for op, c in ctx.recorder.comm.items()}
    ctx.recorder.resolve()  # GPU: device-timed spans join the timeline before we read it
    hidden, end = comm_hidden_fraction(ctx.recorder.events, ctx.rank), ctx.recorder.now()
    if cfg.variant == "param_server":
        dp.pull()  # the last update, to every replica (not counted in the bytes per step)
    params = [p for p in model.parameters() if p.requires_grad]
    return {
        "variant": cfg.variant,
        "t_start": t_start,
        "step_starts": starts[cfg.warmup :] + [end],
        "loss": losses[-1],
        "step_ms": [1e3 * w.seconds for w in step_s],
        "median_ms": 1e3 * statistics.median(w.seconds for w in step_s),
        "buckets": dp.bucket_table() if isinstance(dp, BucketedDDP) else None,
        "hidden": hidden,
        "sent_per_step": sum(v[0] for v in by_op.values()),
        "by_op": by_op,
        "grad_bytes": sum(p.numel() * p.element_size() for p in params),
        "checksum": float(sum(p.detach().double().sum() for p in params)),
    }


def timed(result: Any) -> Any:
    """`result` (a RunResult of `train_dp`) keeping only the timed steps' events and memory samples."""
    t0 = {r: v["t_start"] for r, v in enumerate(result.values)}
    return replace(result, timeline=[e for e in result.timeline if e["start"] >= t0[e["rank"]]],
                     memory=[s for s in result.memory if s["t"] >= t0[s["rank"]]])  # fmt: skip


def plot_step(
    result: Any, step: int = 0, ranks: list[int] | None = None, ax: Any = None, title: str | None = None
):
    """One timed step of a `train_dp` run, one row per rank: forward, backward layer by layer and the
    optimizer on the compute lane; every all-reduce (issue -> completion) on the comm lane. Times from the
    step's start, in ms. Returns the figure."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from parallel_lab.plots import KIND_COLORS, PHASE_COLORS

    colors = {  # the lab's palette (plots.base); neighbours alternate two shades so their edges show
        "forward": PHASE_COLORS["forward"][0],
        "optimizer": KIND_COLORS["optimizer"],
        "bwd": PHASE_COLORS["backward"][:2],
        "comm": (KIND_COLORS["comm"], "#EDB48C"),
    }

    ranks = list(range(result.world_size)) if ranks is None else ranks
    if ax is None:
        _, ax = plt.subplots(figsize=(9.4, 0.5 + 1.0 * len(ranks)), layout="constrained")
    rows = []
    for r in ranks:
        t0, t1 = result.values[r]["step_starts"][step : step + 2]
        rows.append((t0, sorted((e for e in result.timeline if e["rank"] == r and t0 <= e["start"] < t1),
                                key=lambda e: e["start"])))  # fmt: skip
    span = max([(e["end"] - t0) * 1e3 for t0, evs in rows for e in evs] + [1e-3])
    for row, (t0, evs) in enumerate(rows):
        n_bwd = n_comm = 0
        for e in evs:
            a, w = (e["start"] - t0) * 1e3, (e["end"] - e["start"]) * 1e3
            lower = e["kind"] == "comm"
            y = row + (0.52 if lower else 0.08)
            label, hatch, color = "", None, colors.get(e["name"], "#BBBBBB")
            if e["name"].startswith("bwd "):
                color, label, n_bwd = colors["bwd"][n_bwd % 2], e["name"][4:], n_bwd + 1
            elif lower:
                color, n_comm = colors["comm"][n_comm % 2], n_comm + 1
                label = e["name"].replace("torch bucket ", "b").replace("bucket ", "b")
            elif e["kind"] == "idle":
                color, hatch, label = "#E8E8E8", "..", "wait"
            ax.broken_barh(
                [(a, w)], (y, 0.38), facecolors=color, hatch=hatch, edgecolor="#888888" if hatch else "none"
            )
            if label and w > 0.012 * span * max(2, len(label)):  # only where the text fits
                ax.text(a + w / 2, y + 0.19, label, ha="center", va="center", fontsize=6.5, clip_on=True)
    ax.set_ylim(len(ranks), 0)
    ax.set_yticks([i + off for i in range(len(ranks)) for off in (0.27, 0.71)],
                  [f"rank {r} {lane}" for r in ranks for lane in ("compute", "comm")], fontsize=8)  # fmt: skip
    for i in range(1, len(ranks)):
        ax.axhline(i, color="#BBBBBB", linewidth=0.6)
    ax.set_xlabel("time since the step began (ms)")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title or f"{result.values[0]['variant']}: step {step}")
    seen = {e["kind"] for _, evs in rows for e in evs} | {e["name"] for _, evs in rows for e in evs}
    legend = [("forward", colors["forward"], None), ("backward, one layer per bar", colors["bwd"][0], None),
              ("communication, issue to completion (shades alternate per op)", colors["comm"][0], None),
              ("optimizer", colors["optimizer"], None), ("waiting", "#E8E8E8", "..")]  # fmt: skip
    keep = [seen & {"forward"}, {n for n in seen if str(n).startswith("bwd ")}, seen & {"comm"},
            seen & {"optimizer"}, seen & {"idle"}]  # fmt: skip
    handles = [Patch(facecolor=c, hatch=h, edgecolor="#888888" if h else "none", label=lab)
               for (lab, c, h), k in zip(legend, keep) if k]  # fmt: skip
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.16 - 0.1 / len(ranks)),
              ncol=min(3, len(handles)), fontsize=7.5, frameon=False)  # fmt: skip
    return ax.figure


def mean_hidden(values: list[dict]) -> float:
    """Mean over ranks of the hidden share (ranks without communication left out; NaN if none had any)."""
    got = [v["hidden"] for v in values if v["hidden"] == v["hidden"]]
    return statistics.fmean(got) if got else float("nan")


def report(values: list[dict], world_size: int) -> str:
    """Rank 0's summary of a run (the values of every rank)."""
    v0 = values[0]
    formula = allreduce_bytes_per_rank(v0["grad_bytes"], world_size)
    lines = [
        f"{v0['variant']} on {world_size} ranks: median step {max(v['median_ms'] for v in values):.1f} ms "
        f"(slowest rank), last loss {v0['loss']:.4f}",
        "bytes sent per step: "
        + ", ".join(f"rank {r} {v['sent_per_step']:,.0f}" for r, v in enumerate(values))
        + f"  (ring all-reduce of all gradients: 2(N-1)/N x {v0['grad_bytes']:,} = {formula:,.0f})",
        f"communication hidden under backward: {mean_hidden(values):.0%}",
        f"identical weights on every rank: {len({round(v['checksum'], 9) for v in values}) == 1}",
    ]
    if v0["buckets"]:
        lines.append(
            f"{len(v0['buckets'])} buckets: " + ", ".join(f"{b['bytes']:,} B" for b in v0["buckets"])
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", default="ddp", choices=VARIANTS)
    ap.add_argument("--bucket-kb", type=float, default=64, help="BucketedDDP / torch DDP bucket size, KiB")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument(
        "--batch", type=int, default=None, help="global batch, divisible by the ranks (default 16)"
    )
    ap.add_argument("--accumulation", type=int, default=1, help="micro-steps per optimizer step")
    ap.add_argument("--comm", default="builtin", choices=("builtin", "ring"))
    ap.add_argument("--trace", default="runs/ddp.json", help="where rank 0 writes the trace")
    ap.add_argument("--nproc", type=int, default=4, help="ranks to start when run without a launcher")
    args = ap.parse_args(argv)
    world = script_world(args.nproc)
    args.batch = scaled_default("--batch", args.batch, world, lambda w: round_up(16, w * args.accumulation))
    cfg = replace(DDPRun(), variant=args.variant, bucket_bytes=int(args.bucket_kb * 1024), steps=args.steps,
                  batch=args.batch, accumulation_steps=args.accumulation, comm=args.comm)  # fmt: skip
    result = run_script(train_dp, cfg, nproc=args.nproc, trace_path=args.trace)
    if result is None:  # not rank 0
        return 0
    print(report(result.values, result.world_size))
    print(f"trace written to {args.trace} ({len(result.timeline)} spans)")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
