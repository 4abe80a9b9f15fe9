"""Executor: run a pipeline schedule's instruction lists on real ranks, optionally inside DP x PP.

The same `list[list[Step]]` the simulator draws runs here, step by step, on a
`TinyMLP` cut into p * v virtual stages (rank r holds chunks c = 0..v-1, virtual
stage c*p + r, or r and 2p-1-r in a V (ZB-V, DualPipeV); the head goes with the last one). F runs a chunk on one
micro-batch, B back-propagates the gradient received from the next stage (in a
schedule with W steps, ZB-H1 / ZB-H2, only to the stage's input: `SplitBackward`;
W later adds the weight gradients), RECV_* wait for a tagged point-to-point
message, SEND_* hand one over and move on.
Messages go out in batches planned on a clock all ranks share (`simulator.post_plan`):
each batch holds the sends and receives of one time, posted with one
`batch_isend_irecv`, so NCCL's blocking sends cannot deadlock (one message a batch
in list order does, in 1F1B's steady state). The
loss of a micro-batch is scaled by 1/m, so the accumulated gradients equal those
of the whole batch (GPipe, Huang et al. 2019). With data parallelism the
gradients of each stage are averaged over its DP group ONCE, after the last
micro-batch's backward (`dp_sync="end"`); "every_microbatch" is what DDP without
`no_sync()` does under accumulation: same result, m times the bytes.

Invariant: after every step the parameters equal single-process training on the
whole batch (up to float summation order), for every schedule.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.graph import GradientEdge

from parallel_lab import comms
from parallel_lab.models import build_model, make_optimizer, synthetic_batch
from parallel_lab.pipeline.schedules import chunks_of, make_schedule, placement_of
from parallel_lab.pipeline.simulator import post_plan, stage_of, validate_schedule
from parallel_lab.pipeline.stages import PipelineConfig, reference_batches, split_layers, stage_modules
from parallel_lab.runtime.device import bind_thread, is_cuda, on_stream, side_stream, spin, used_here
from parallel_lab.runtime.parallel_dims import ParallelDims

__all__ = ["PipelineConfig", "PipelineRank", "SendReaper", "SplitBackward", "StageParts", "mlp_stage_parts",
           "reference_batches", "split_layers", "stage_modules", "train_pipeline"]  # fmt: skip


class SendReaper:
    """Waits for posted sends on a thread, so each sent tensor is let go once delivered.

    A send must not block the schedule (the simulator's rule), yet its tensor has to stay
    alive until the peer received it. gloo's `is_completed()` on a send stays False until
    `wait()`, and `wait()` blocks until the peer posts its receive, so only a thread can
    find out in time: otherwise 1F1B would hold every sent tensor until the flush. (On a GPU
    the reaper's stream waits for the sends in the order they were handed over, so a send's
    span can end after an earlier, slower one's.)"""

    def __init__(self, device: torch.device | None = None):
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.device = device if device is not None else torch.device("cpu")
        # On a GPU, NCCL's wait() makes the *current* stream wait for the send's batch: on the default
        # stream that would hold back every later compute kernel until the peer received. The reaper
        # waits on a stream of its own instead (its span's end mark too); None on a CPU.
        self.stream = side_stream(self.device)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        bind_thread(self.device)  # a new thread starts on GPU 0
        with on_stream(self.stream):  # (current streams are per thread)
            while (h := self.q.get()) is not None:
                h.wait()  # records the span issue -> delivery, books the bytes
                # GPU: NCCL's wait() returns at once and lets go of the tensor (torch 2.8+ records no
                # stream on it); tie its memory to this stream, which now waits for the send, so the
                # allocator hands it out again only after the send has read it
                if isinstance(h.result, torch.Tensor):
                    used_here(h.result)
                del h  # the tensor goes with it

    def add(self, handle: comms.Handle) -> None:
        self.q.put(handle)

    def join(self) -> None:
        """Block until every send added so far is delivered; the reaper is done."""
        self.q.put(None)
        self.thread.join()


class SplitBackward:
    """One (micro-batch, chunk)'s backward in two calls: `input_grad` (B) now, `weight_grads` (W) later.

    The autograd graph from `out` down is cut where the path to the stage's input `x` ends: a node
    on that path (it leads to x) whose other edges lead only to parameters owns those parameters.
    B runs autograd to x alone, so each owner computes its x-ward gradient and not its weight
    gradient (the engine skips outputs nothing asked for), and a pre-hook keeps the gradient the
    owner received. W restarts the engine at each owner with that gradient, asking for its
    parameters only: the same kernels on the same tensors as the unsplit backward, accumulated
    into `.grad` by the same AccumulateGrad nodes, so the gradients are equal bit for bit, and
    nothing on the path to x runs twice (in a tensor-parallel stage, its all-reduces neither).

    The skipping holds for torch's built-in nodes only: a Python autograd Function computes every
    gradient its backward returns. One on the path that takes no parameter (tensor parallelism's
    f and g, whose backward is a collective) runs once, in B; one that owns parameters (a custom
    layer, a recomputed segment) would run in B and again in W. Three fallbacks do the whole weight
    backward at W instead, still exact: when x needs no gradient (the first virtual stage: its input
    is the data, so B has nothing to do), when two owners reach one parameter (a tie inside the
    stage), whose gradient the engine must sum in its own order, and when an owner is a Python
    Function. Then W re-runs the path to x too (what `backward(out, g, inputs=leaves)` costs),
    collectives on it included (every rank of a group does the same: they still match).

    Memory: until W the graph is kept (retain_graph), so a split micro-batch's saved activations are
    in flight from its F to its W, not to its B, and W also holds the gradient each owner received
    in B (one tensor of the owner's output shape per owner: for a Linear, (b, s, out)). That is more
    than the weight gradients alone need: a stage past its B holds more per micro-batch than 1F1B
    does, which the paper's memory argument (W needs less than B) does not count on."""

    def __init__(self, out: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor):
        self.out, self.grad, self.x = out, grad, x
        self.owners: list[tuple] | None = None  # [(node, its params)], None: the whole backward at W
        self.caught: dict = {}  # owner node -> the gradients it received in B

    def input_grad(self) -> torch.Tensor | None:
        """B: the gradient of the stage's input (None when the input needs none)."""
        if not self.x.requires_grad:
            return None
        self.owners = _owners(self.out.grad_fn, self.x)
        hooks = []
        for node, _ in self.owners or ():
            hooks.append(node.register_prehook(lambda g, node=node: self.caught.__setitem__(node, g)))
        try:
            (dx,) = torch.autograd.grad(self.out, [self.x], self.grad, retain_graph=True)  # (b, *act_tail)
        finally:
            for h in hooks:
                h.remove()
        if self.owners is not None:  # W restarts at the owners: the output and its gradient are done with
            self.out = self.grad = None
        return dx

    def weight_grads(self) -> None:
        """W: the weight gradients of this (micro-batch, chunk), accumulated into `.grad`; frees the graph."""
        if self.owners is None:  # nothing split off: the whole backward, minus x
            leaves = [t for t in _leaves(self.out.grad_fn) if t is not self.x]
            if leaves:
                torch.autograd.backward(self.out, self.grad, inputs=leaves)
        else:
            for node, params in self.owners:
                grads = self.caught.get(node, ())
                edges = [(GradientEdge(node, k), g) for k, g in enumerate(grads) if g is not None]
                if edges:  # disjoint subgraphs: each call frees its own, nothing of the next owner's
                    roots, gs = zip(*edges)
                    torch.autograd.backward(list(roots), list(gs), inputs=params)
        self.out = self.grad = self.x = self.owners = None
        self.caught = {}


def _walk(root) -> list:
    """The autograd nodes below `root`, children before parents (iterative: deep graphs)."""
    order, seen, stack = [], set(), [(root, False)]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
        elif node not in seen:
            seen.add(node)
            stack.append((node, True))
            stack.extend((n, False) for n, _ in node.next_functions if n is not None and n not in seen)
    return order


def _is_leaf_of(node, t: torch.Tensor | None = None) -> bool:
    return type(node).__name__ == "AccumulateGrad" and (t is None or node.variable is t)


def _leaves(root) -> list[torch.Tensor]:
    return [n.variable for n in _walk(root) if _is_leaf_of(n)] if root is not None else []


def _owners(root, x: torch.Tensor) -> list[tuple] | None:
    """[(node on the path to x, the leaves only it reaches off that path)], or None when the cut
    is not clean (x unreachable, or a node off the path reached from two owners)."""
    if root is None:
        return None
    order = _walk(root)
    on_path: set = set()
    for node in order:  # children first: a node leads to x when one of its children does
        if _is_leaf_of(node, x) or any(n in on_path for n, _ in node.next_functions):
            on_path.add(node)
    if root not in on_path:
        return None
    owner_of: dict = {}
    owners = []
    for node in order:
        if node not in on_path:
            continue
        params: list[torch.Tensor] = []
        for child in [n for n, _ in node.next_functions if n is not None and n not in on_path]:
            for sub in _walk(child):
                if owner_of.setdefault(sub, node) is not node:
                    return None  # shared below two owners: let the engine sum it
                if _is_leaf_of(sub) and all(sub.variable is not q for q in params):
                    params.append(sub.variable)
        if params and isinstance(node, torch.autograd.function.BackwardCFunction):
            return None  # a Python Function owner computes its weights' gradients in B as well
        if params:
            owners.append((node, params))
    return owners


class StageParts(NamedTuple):
    """What a rank computes: its chunks, its parameters by global name, the loss (last stage),
    the trailing shape of the activations between stages, and an extra gradient sync."""

    mods: dict[int, nn.Module]
    params: dict[str, nn.Parameter]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    act_tail: tuple[int, ...]
    extra_sync: Callable[[], None] | None = None


def mlp_stage_parts(ctx, cfg: PipelineConfig, stages: int, rank: int) -> StageParts:
    """This pipeline rank's chunks of the seeded TinyMLP, trained with MSE."""
    v = chunks_of(cfg.schedule, cfg.chunks)
    with torch.no_grad():
        model = build_model(cfg.model_config, seed=cfg.seed, device=ctx.device)  # same on every rank
        mods, params = stage_modules(model, stages, v, rank, placement_of(cfg.schedule))
    return StageParts(mods, params, F.mse_loss, (cfg.hidden,))


class PipelineRank:
    """One rank's part of a pipeline: its chunks, its peers, and a step that runs its instruction list.

    `cfg` needs schedule, microbatches, chunks, compute_time, dp_sync, optimizer and lr;
    `parts` defaults to this rank's chunks of the TinyMLP `cfg` describes."""

    def __init__(self, ctx, cfg, pp_ranks: list[int], dp_group=None, dp_size: int = 1, parts: StageParts | None = None,
                 pp_group=None):  # fmt: skip
        self.ctx, self.cfg, self.pp_ranks = ctx, cfg, pp_ranks
        self.p, self.r = len(pp_ranks), pp_ranks.index(ctx.rank)
        self.v = chunks_of(cfg.schedule, cfg.chunks)
        self.placement = placement_of(cfg.schedule)  # which virtual stages this rank holds
        self.m = cfg.microbatches
        self.dp_group, self.dp_size, self.pp_group = dp_group, dp_size, pp_group
        parts = parts or mlp_stage_parts(ctx, cfg, self.p, self.r)  # the other ranks' layers are gone
        self.mods, self.params, self.loss_fn, self.act_tail, self.extra_sync = parts
        if ctx.memory is not None:
            for mod in self.mods.values():
                ctx.memory.register_module(mod)
        # a tensor shared by two chunks (in a V, rank 0 holds a tied embedding's both ends) is stepped once
        unique = {id(p): p for mod in self.mods.values() for p in mod.parameters()}
        self.opt = make_optimizer(cfg.optimizer, list(unique.values()), cfg.lr)
        if ctx.memory is not None:
            ctx.memory.register_optimizer(self.opt)
        full = make_schedule(cfg.schedule, self.p, self.m, self.v)
        # a broken list would hang or crash mid-step: refuse it first
        validate_schedule(full, self.m, self.v, placement=self.placement)
        self.schedule = full[self.r]
        self.split = any(s.kind == "W" for rank in full for s in rank)  # B is the input gradient alone
        # which messages go out together, and when (see p2p_batches)
        plans, starts = post_plan(full, placement=self.placement)
        self.plan, self.starts = plans[self.r], starts[self.r]
        # when the first compute at or after each step starts (a RECV's batch must be out by then)
        upcoming, self.next_start = float("inf"), [0.0] * len(self.schedule)
        for i in reversed(range(len(self.schedule))):
            upcoming = self.starts.get(i, upcoming)
            self.next_start[i] = upcoming
        self.last_vs = self.p * self.v - 1
        self.mail: dict[int, torch.Tensor] = {}  # messages to ourselves (p == 1; stage p-1 -> p in a V)

    # -- messages ------------------------------------------------------------------
    def _tag(self, direction: int, mb: int, vs_recv: int) -> int:
        return (direction * self.m + mb) * (self.p * self.v) + vs_recv

    def _message(self, s) -> tuple[int, int]:
        """(global peer, tag) of a SEND/RECV step."""
        vs = self._stage(s.chunk)
        tag = {"SEND_F": (0, vs + 1), "RECV_F": (0, vs), "SEND_B": (1, vs - 1), "RECV_B": (1, vs)}[s.kind]
        return self.pp_ranks[s.peer], self._tag(tag[0], s.mb, tag[1])

    def _post_until(self, limit: float, plan: deque, box: dict, posted: dict, shape: tuple,
                    reaper: SendReaper) -> None:  # fmt: skip
        """Post every batch of `plan` (this step's copy of the plan, consumed) of time <= limit, in
        order: its sends (taken from `box`, where SEND steps leave their tensors) and its receives
        (their Handles into `posted`).

        Both ends of every message post it in the batch of the same time, so a batch never waits
        for a peer that waits for this rank's later batch: NCCL's blocking sends cannot deadlock
        (`simulator.check_blocking_sends`)."""
        while plan and plan[0][0] <= limit:
            _, idx = plan.popleft()
            sends, recvs = [], []
            for i in idx:
                s = self.schedule[i]
                peer, tag = self._message(s)
                if s.kind.startswith("SEND"):
                    if i not in box:
                        raise RuntimeError(
                            f"pipeline plan: step {i} ({s!r}) is posted before its tensor exists"
                        )
                    sends.append((box.pop(i).contiguous(), peer, tag))
                else:
                    recvs.append((torch.empty(shape, device=self.ctx.device), peer, tag))  # (b, *act_tail)
            sh, rh = comms.post_batch(self.ctx, sends, recvs)
            for h in sh:
                reaper.add(h)  # delivered on the reaper's thread; the tensor lives until then
            posted.update(zip((i for i in idx if self.schedule[i].kind.startswith("RECV")), rh))

    # -- compute -------------------------------------------------------------------
    def _compute(self, name: str, fn, target: float, **args):
        """Run fn in a compute span padded to `target` seconds: an emulated device speed, so bubbles
        have the simulator's shape. On a CPU the host sleeps what fn left of it; on a GPU, where fn only
        queues kernels, a kernel spins `target` seconds after them (`device.spin`), so the span, timed
        on the device, lasts the kernels' time plus `target`, and no host waits."""
        with self.ctx.span(name, "compute", **args):
            t0 = time.perf_counter()
            out = fn()
            if is_cuda(self.ctx.device):
                spin(self.ctx.device, target)
            else:
                spin(self.ctx.device, target - (time.perf_counter() - t0))
        return out

    def _sync_grads(self, params: list[torch.Tensor]) -> None:
        """Average gradients over the DP group with one flat all-reduce."""
        unique = {id(p): p for p in params}  # a tied tensor under two names (in a V, both on rank 0): once
        grads = [p.grad for p in unique.values() if p.grad is not None]
        if self.dp_size == 1 or not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])  # (n,)
        comms.dist_all_reduce(self.ctx, flat, op="avg", group=self.dp_group)
        for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(piece.view_as(g))

    def step(self, xs: list, ys: list, step: int, keep_outputs: bool = False) -> dict:
        """Run this rank's instruction list once over the m micro-batches, then the optimizer step."""
        ctx, p, cfg = self.ctx, self.p, self.cfg
        inputs, outputs, grads, logits, posted, reaper = {}, {}, {}, [], {}, SendReaper(ctx.device)
        box: dict[int, torch.Tensor] = {}  # step index of a SEND -> the tensor its batch will carry
        plan = deque(self.plan)  # this step's batches, posted in order
        loss_sum, shape = 0.0, (xs[0].shape[0], *self.act_tail)
        t_f, t_b = cfg.compute_time / self.v, 2 * cfg.compute_time / self.v
        # split, B and W each take half of the unsplit backward's time: the step's work is unchanged, and
        # the padded spans are the simulator's with t_f = t_b = t_w (1F1B's B then costs t_b + t_w)
        t_b, t_w = (t_b / 2, t_b / 2) if self.split else (t_b, 0.0)
        pending: dict[tuple[int, int], SplitBackward] = {}  # (mb, chunk) -> its W, once its B ran
        rec = ctx.recorder
        comms.dist_barrier(ctx)  # every rank starts the step together: bubbles are measured from here
        idle_from, idle_host = rec.mark(), rec.now()  # (the mark is a CUDA event on a GPU)

        def send(i: int, t: torch.Tensor, peer: int, tag: int) -> None:
            if self.pp_ranks[peer] == ctx.rank:
                self.mail[tag] = t  # one pipeline rank: a message to itself
            else:
                box[i] = t

        def recv(i: int, peer: int, tag: int) -> torch.Tensor:
            if self.pp_ranks[peer] == ctx.rank:
                return self.mail.pop(tag).detach()
            self._post_until(self.next_start[i], plan, box, posted, shape, reaper)
            return posted.pop(i).wait()

        for i, s in enumerate(self.schedule):
            key, vs = (s.mb, s.chunk), self._stage(s.chunk)
            if s.kind in ("F", "B", "W"):
                self._post_until(self.starts[i], plan, box, posted, shape, reaper)
                if rec.now() > idle_host:
                    rec.add_event("bubble", "bubble", idle_from, rec.mark(), step=step)
            if s.kind == "RECV_F":
                inputs[key] = recv(i, s.peer, self._tag(0, s.mb, vs)).requires_grad_()
            elif s.kind == "F":
                x = xs[s.mb] if vs == 0 else inputs[key]

                def fwd(x=x, c=s.chunk, mb=s.mb, vs=vs):
                    out = self.mods[c](x)  # (b, *act_tail), or the model's output on the last virtual stage
                    if vs == self.last_vs:
                        if keep_outputs:
                            logits.append(_np(out))
                        out = self.loss_fn(out, ys[mb]) / self.m  # 1/m: gradients add up to the batch mean
                    return out

                outputs[key] = self._compute(
                    self._name("F", s.chunk), fwd, t_f, mb=s.mb, chunk=s.chunk, stage=vs, step=step
                )
                if vs == self.last_vs:
                    loss_sum += outputs[key].item()
            elif s.kind == "SEND_F":
                send(i, outputs[key].detach(), s.peer, self._tag(0, s.mb, vs + 1))
            elif s.kind == "RECV_B":
                grads[key] = recv(i, s.peer, self._tag(1, s.mb, vs))
            elif s.kind == "B" and self.split:
                x = xs[s.mb] if vs == 0 else inputs[key]  # the first virtual stage's input is the data
                work = pending[key] = SplitBackward(outputs.pop(key), grads.pop(key, None), x)

                def bwd_input(work=work, x=x):
                    dx = work.input_grad()  # (b, *act_tail), None on the first virtual stage
                    if dx is not None:
                        x.grad = dx  # SEND_B sends it, as after an unsplit backward
                    return dx

                self._compute(
                    self._name("B", s.chunk), bwd_input, t_b, mb=s.mb, chunk=s.chunk, stage=vs, step=step
                )
            elif s.kind == "B":
                out, g = outputs.pop(key), grads.pop(key, None)
                self._compute(self._name("B", s.chunk), lambda out=out, g=g: out.backward(g), t_b,
                              mb=s.mb, chunk=s.chunk, stage=vs, step=step)  # fmt: skip
                if cfg.dp_sync == "every_microbatch":  # the bug class: an all-reduce per micro-batch
                    self._sync_grads(list(self.mods[s.chunk].parameters()))
            elif s.kind == "W":
                self._compute(self._name("W", s.chunk), pending.pop(key).weight_grads, t_w,
                              mb=s.mb, chunk=s.chunk, stage=vs, step=step)  # fmt: skip
                if cfg.dp_sync == "every_microbatch":  # split, a chunk's gradients are complete after W
                    self._sync_grads(list(self.mods[s.chunk].parameters()))
            elif s.kind == "SEND_B":
                send(i, inputs.pop(key).grad, s.peer, self._tag(1, s.mb, vs - 1))
            if s.kind in ("F", "B", "W"):
                idle_from, idle_host = rec.mark(), rec.now()
        self._post_until(float("inf"), plan, box, posted, shape, reaper)  # the last sends
        reaper.join()
        if p > 1:
            comms.dist_barrier(ctx, group=self.pp_group)  # the flush: the pipeline is empty
            rec.add_event("bubble", "bubble", idle_from, rec.mark(), step=step)
        if cfg.dp_sync == "end":  # the right way: once, after the last micro-batch's backward
            self._sync_grads(list(self.params.values()))
        if self.extra_sync is not None:
            self.extra_sync()
        out = {"loss": loss_sum if self.last_vs in [self._stage(c) for c in range(self.v)] else None}
        if keep_outputs:  # numpy copies: not tensors, so the memory plot shows the training alone
            out["grads"] = {n: _np(q.grad) for n, q in self.params.items() if q.grad is not None}
            out["outputs"] = np.concatenate(logits) if logits else None
        with ctx.span("optimizer step", "optimizer", step=step):
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        return out

    def _stage(self, chunk: int) -> int:
        """The virtual stage this rank's chunk holds (c*p + r; in a V, r or 2p-1-r)."""
        return stage_of(self.r, chunk, self.p, self.placement)

    def _name(self, kind: str, chunk: int) -> str:
        return f"{kind}.c{chunk}" if self.v > 1 else kind


def train_pipeline(ctx, cfg: PipelineConfig, dims: ParallelDims | None = None) -> dict:
    """Train `cfg.steps` steps of a pipelined TinyMLP on this rank (call through `launch`).

    `dims` defaults to pure pipeline parallelism over all ranks (pp = world size); with
    ParallelDims(dp=2, pp=2) on 4 ranks each DP replica is a 2-stage pipeline. Returns
    this rank's losses (None off the last stage), its parameters after training and, from
    the first step, its gradients and the last stage's outputs, all by global name.
    """
    dims = dims or ParallelDims(pp=ctx.world_size)
    if dims.size != ctx.world_size:
        raise ValueError(
            f"dims.dp * dims.tp * dims.pp = {dims.size} must equal world_size = {ctx.world_size}"
        )
    if dims.tp != 1:
        raise ValueError("train_pipeline runs DP x PP; tensor parallel stages are in three_d/run.py")
    mesh = dims.build(ctx)
    dp_rank, dp = mesh.coords["dp"], dims.dp
    if cfg.batch % (dp * cfg.microbatches):
        raise ValueError(
            f"batch ({cfg.batch}) must be divisible by dp x microbatches = {dp} x {cfg.microbatches}"
        )
    runner = PipelineRank(ctx, cfg, mesh.ranks("pp"), mesh.group("dp"), dp, pp_group=mesh.group("pp"))
    rows = cfg.batch // dp
    losses, first = [], {}
    for step in range(cfg.steps):
        x, y = synthetic_batch("regression", cfg.batch, in_dim=cfg.in_dim, out_dim=cfg.out_dim,
                               seed=cfg.seed + 1 + step, device=ctx.device)  # fmt: skip
        x, y = x[dp_rank * rows : (dp_rank + 1) * rows], y[dp_rank * rows : (dp_rank + 1) * rows]  # (B/dp, .)
        out = runner.step(list(x.chunk(cfg.microbatches)), list(y.chunk(cfg.microbatches)), step, step == 0)
        losses.append(out["loss"])
        if step == 0:
            first = out
    return {
        "rank": ctx.rank,
        "coords": mesh.coords,
        "losses": losses if losses[0] is not None else None,
        "params": {n: _np(q) for n, q in runner.params.items()},
        "grads": first.get("grads", {}),
        "outputs": first.get("outputs"),
    }


def _np(t: torch.Tensor):
    """A numpy copy: tensors sent back to the parent would travel as shared-memory file
    descriptors, which break when the rank exits before the parent reads them."""
    return t.detach().cpu().numpy().copy()
