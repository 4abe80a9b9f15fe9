"""A training run that survives: ZeRO-1 data parallelism, a checkpoint every few steps, resume.

`train_resilient(ctx, cfg, attempt)` trains a TinyMLP on a fixed regression dataset with sharded
Adam (`zero.ZeroOptimizer`, stage 1), reading its data through `ResumableSampler`. On start it
loads the newest complete checkpoint under `cfg.root`, if any: the weights, this rank's optimizer
slice (re-sharded when the world size changed), the sampler position, the step, the history of
losses and batches, and on the same world size each rank's RNG state. Every
`cfg.checkpoint_every` steps it saves all of that (`checkpoint.save`: atomic files, manifest last).

`cfg.kill = (rank, step)` makes that rank SIGKILL itself at the start of that step in the first
attempt, for the lesson and the tests. `cfg.spike` turns on the loss-spike rule: a step whose
loss exceeds `spike` times the mean of the last `spike_window` losses is rolled back (the last
checkpoint is restored) and its batch is skipped.

Invariant: resumed on the same world size, the run's history is bit-identical to an
uninterrupted run's; on another world size, every sample of an epoch is used exactly once.
"""

from __future__ import annotations

import math
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from parallel_lab import comms
from parallel_lab.models import MLPConfig, build_model, synthetic_batch
from parallel_lab.resilience import checkpoint as ckpt
from parallel_lab.resilience import flash
from parallel_lab.resilience.reshard import reshard
from parallel_lab.resilience.sampler import ResumableSampler
from parallel_lab.zero import ZeroOptimizer


@dataclass
class ResilientConfig:
    """What `train_resilient` runs; the defaults run in a second or two on 2-4 CPU ranks."""

    root: str = "runs/resilience"  # where the checkpoints go
    steps: int = 12
    n_samples: int = 48
    global_batch: int = 12  # divisible by every world size the run may use (12: 1, 2, 3, 4, 6)
    checkpoint_every: int = 2
    lr: float = 1e-2
    seed: int = 0
    noise: float = 0.0  # input noise drawn from each rank's RNG: a resume must restore the RNG
    kill: tuple[int, int] | None = None  # (rank, step): that rank dies there, first attempt only
    spike: float | None = None  # roll back a step whose loss > spike x the recent mean
    spike_window: int = 4
    spike_at: int | None = None  # corrupt this step's targets (until a rollback), to cause a spike
    mlp: MLPConfig = None  # type: ignore[assignment]
    flash: flash.FlashSpec | None = None  # set: checkpoints go to shared memory, a FlashAgent persists them

    def __post_init__(self) -> None:
        if self.mlp is None:
            self.mlp = MLPConfig(in_dim=8, hidden=32, out_dim=4, depth=2)
        for name in ("steps", "n_samples", "global_batch", "checkpoint_every", "spike_window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive finite number, got {self.lr!r}")
        if self.spike is not None and not (isinstance(self.spike, (int, float)) and self.spike > 1):
            raise ValueError(
                f"spike must be None or a number > 1 (a ratio to the recent mean), got {self.spike!r}"
            )


def _zero_state(zero: ZeroOptimizer) -> dict:
    st = zero.optimizer.state.get(zero.states.opt_param, {})
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}


def _source(ctx, cfg: ResilientConfig) -> tuple[str, int, int, dict, Callable[[int], dict]] | None:
    """Where to resume from: (kind, step, world size, meta, read(rank) -> shard), the newest of the
    flash copy in shared memory (when the machine survived) and the newest complete disk checkpoint."""
    d, manifest, skipped = ckpt.latest(cfg.root)
    for e in skipped:
        ctx.print(f"skipped a checkpoint: {e}")
    found = flash.ready_snapshot(cfg.flash) if cfg.flash is not None else None
    if found is not None and (manifest is None or found[0] >= manifest["step"]):
        cache: dict[int, dict] = {}

        def read_memory(k: int) -> dict:
            if k not in cache:
                cache[k] = flash.read_snapshot(cfg.flash, k)[1]
            return cache[k]

        return "memory", found[0], found[1], read_memory(0)["meta"], lambda k: read_memory(k)["shard"]
    if d is None:
        return None
    files: dict[int, dict] = {}

    def read_disk(k: int) -> dict:
        if k not in files:
            files[k] = ckpt.read_shard(d, k, manifest)
        return files[k]

    return "disk", manifest["step"], manifest["world_size"], {**manifest["meta"], "_dir": str(d)}, read_disk


def _restore(
    ctx, cfg: ResilientConfig, model, zero: ZeroOptimizer, sampler: ResumableSampler
) -> tuple[int, dict]:
    """Load the newest checkpoint (memory or disk): returns (next step, history)."""
    src = _source(ctx, cfg)
    if src is None:
        raise FileNotFoundError(f"no complete checkpoint under {cfg.root}")
    kind, step, old_world, meta, read = src
    where = meta.get("_dir", "shared memory")
    ckpt.check_model({"meta": meta}, ckpt.model_signature(model), where)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(read(0)["model"][n])  # in place: the parameters are views of ZeRO's flat buffer
    if meta["optim_has_state"]:
        like = {k: torch.zeros_like(zero.states.opt_param) for k in ("exp_avg", "exp_avg_sq")}
        state = reshard(
            zero.layout.numel, old_world, ctx.world_size, ctx.rank, lambda k: read(k)["optim"], like
        )
        state["step"] = read(0)["optim"]["step"].clone()
        zero.optimizer.state[zero.states.opt_param] = state
    sampler.load_state_dict(meta["sampler"])
    if old_world == ctx.world_size:  # each rank's own generators; on another world size there is no "own"
        ckpt.set_rng_state(read(ctx.rank)["rng"])
    ctx.recorder.add_event(
        f"resumed from step {step} ({kind})", "other", ctx.recorder.now(), ctx.recorder.now()
    )
    return step, meta["history"]


def train_resilient(ctx, cfg: ResilientConfig, attempt: int = 0) -> dict:
    """Train `cfg.steps` steps, resuming from `cfg.root` if a checkpoint is there; returns the
    history (loss per step, the global batch of every step, the steps rolled back)."""
    x_all, y_all = synthetic_batch("regression", cfg.n_samples, in_dim=cfg.mlp.in_dim, out_dim=cfg.mlp.out_dim,
                                   seed=cfg.seed + 1, device=ctx.device)  # fmt: skip
    model = build_model(cfg.mlp, seed=cfg.seed, device=ctx.device)  # collectives need ctx.device (NCCL)
    zero = ZeroOptimizer(ctx, model, stage=1, optimizer="adam", lr=cfg.lr)
    sampler = ResumableSampler(cfg.n_samples, seed=cfg.seed)
    torch.manual_seed(cfg.seed * 7919 + ctx.rank)  # each rank its own noise stream
    try:
        step, history = _restore(ctx, cfg, model, zero, sampler)
    except FileNotFoundError:  # a fresh run: checkpoint the start, so even step 0 can be rolled back to
        step, history = 0, {"loss": [], "batches": [], "rolled_back": [], "skipped": []}
        _save(ctx, cfg, model, zero, sampler, step, history)
    while step < cfg.steps:
        if cfg.kill is not None and attempt == 0 and (ctx.rank, step) == tuple(cfg.kill):
            os.kill(os.getpid(), signal.SIGKILL)  # a machine gone: no traceback, no goodbye
        position = [sampler.epoch, sampler.offset]
        batch = sampler.take(cfg.global_batch)
        if position in history["skipped"]:  # the batch a rollback blamed: never used again
            batch = sampler.take(cfg.global_batch)
        idx = [i for _, i in sampler.rank_slice(batch, ctx.rank, ctx.world_size)]
        x, y = x_all[idx], y_all[idx]  # (b, in), (b, out)
        if cfg.noise:
            x = x + cfg.noise * torch.randn_like(x)
        if cfg.spike_at == step and not history["rolled_back"]:
            y = y * 100.0  # a bad batch (once)
        with ctx.span(f"step {step}"):
            loss = F.mse_loss(model(x), y)
            loss.backward()
            mean = comms.dist_all_reduce(ctx, loss.detach().clone()) / ctx.world_size
            zero.step()
            zero.zero_grad()
        recent = history["loss"][-cfg.spike_window :]
        if (
            cfg.spike
            and len(recent) == cfg.spike_window
            and mean.item() > cfg.spike * sum(recent) / len(recent)
        ):
            # Every rank sees the same mean, so all roll back together: the update already damaged the
            # weights, so restore the last checkpoint, and remember the batch so the replay skips it.
            ctx.print(f"step {step}: loss {mean.item():.3g} > {cfg.spike:g} x the mean of the last "
                      f"{cfg.spike_window} ({sum(recent) / len(recent):.3g}): back to the last checkpoint")  # fmt: skip
            bad, rolled = position, history["rolled_back"] + [step]
            with ctx.span(f"rollback at step {step}", "bubble"):
                step, history = _restore(ctx, cfg, model, zero, sampler)
            history["skipped"].append(bad)
            history["rolled_back"] = rolled
            continue
        history["loss"].append(mean.item())
        history["batches"].append([list(p) for p in batch])  # lists: the history goes through JSON
        step += 1
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            _save(ctx, cfg, model, zero, sampler, step, history)
    return history


def _save(ctx, cfg: ResilientConfig, model, zero: ZeroOptimizer, sampler: ResumableSampler, step: int,
          history: dict) -> None:  # fmt: skip
    shard = {"optim": _zero_state(zero), "rng": ckpt.rng_state()}
    if ctx.rank == 0:  # the weights are replicated (ZeRO-1): one copy is enough
        shard["model"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    meta = {"step": step, "sampler": sampler.state_dict(), "history": history,
            "optim_has_state": bool(shard["optim"]), "model": ckpt.model_signature(model)}  # fmt: skip
    if cfg.flash is not None:  # training waits for a memory copy; the agent writes the disk copy
        with ctx.span(f"flash snapshot {step}", "memcpy"):
            flash.snapshot(cfg.flash, ctx.rank, step, {"shard": shard, "meta": meta}, ctx.world_size)
        comms.dist_barrier(ctx)  # a snapshot counts once every rank's copy is whole
        return
    with ctx.span(f"checkpoint {step}", "memcpy"):
        ckpt.save(ctx, cfg.root, step, shard, meta)


def reference_losses(cfg: ResilientConfig) -> list[float]:
    """The same training in one process on the whole global batch of every step (torch.optim.Adam,
    no input noise): what a resumed run's history is compared with."""
    x_all, y_all = synthetic_batch("regression", cfg.n_samples, in_dim=cfg.mlp.in_dim, out_dim=cfg.mlp.out_dim,
                                   seed=cfg.seed + 1)  # fmt: skip
    model = build_model(cfg.mlp, seed=cfg.seed)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    sampler = ResumableSampler(cfg.n_samples, seed=cfg.seed)
    losses = []
    for _ in range(cfg.steps):
        idx = [i for _, i in sampler.take(cfg.global_batch)]
        loss = F.mse_loss(model(x_all[idx]), y_all[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


__all__ = ["ResilientConfig", "reference_losses", "train_resilient"]
