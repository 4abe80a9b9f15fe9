"""Checks for lesson 04 (ZeRO): the lesson's three ideas applied to cases it did not show.

`check_zero1_clipped_step(fn)`: `fn(ctx, flat_param, flat_grad, shard, optimizer, max_norm)` runs
one ZeRO-1 step with gradient-norm clipping on every rank. Run for 5 Adam steps on 1 to 4 ranks
with a parameter count drawn every grade run (no rank count 2-4 divides it), with weights,
gradients and `max_norm` drawn so that some steps clip, some do not, and one has a norm of the
order of clip_grad_norm_'s epsilon. The gradient each rank's optimizer steps with must be its
slice of what `torch.nn.utils.clip_grad_norm_` leaves of the averaged gradient on one process,
the parameters those of one process, the bytes a ring all-reduce's plus a few numbers (an
all-reduce of more than those is refused), and what the calls leave alive on a rank at most Adam's
states for its slice plus a slice or two (memory tracked).

`check_zero3_prefetch_hooks(fn)`: `fn(ctx, layers, shards, shapes)` installs hooks on 4 Linear
layers (widths drawn every grade run) so that each layer's parameters are gathered before it
runs and freed after, with the next layer's gather started before the current layer computes.
The output must equal the unsharded model's bit for bit on the CPU (within `_TOL` on a GPU), at
most two layers' parameters may be alive at any moment, and none after the pass; on 2-4 ranks a
receive of the next layer's slices must have been posted, and not yet waited for, when the current
layer begins to compute, and each layer's slices arrive once.

`check_zero_state_bytes(fn)`: `fn(numel, world_size, stage, optimizer, precision)` predicts the
model-state bytes one rank keeps after a step of SGD (with and without momentum) in fp32 and in
mixed precision under ZeRO stage 0-3; compared, exactly, with the memory tracker's count of real
runs on 2 and 3 ranks whose model sizes are drawn every grade run.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
import torch.nn as nn

from parallel_lab.grading.checks import (
    call_learner,
    draw_seed,
    family,
    launch_learner,
    passed,
    rank_verdict,
    require_callable,
    unavailable,
    uneven_vocab,
)

__all__ = ["check_zero1_clipped_step", "check_zero3_prefetch_hooks", "check_zero_state_bytes"]

WORLD_SIZES = (1, 2, 3, 4)
_SELF = "parallel_lab.grading.checks.zero"
#: The lab's ZeRO, switched off on the ranks while a learner's code runs (parallel_lab.comms'
#: collectives stay: the exercises are built from them).
LAB_ZERO = family("parallel_lab.zero.optimizer", "parallel_lab.zero.stage3", "parallel_lab.zero.comm")


def _code_family(*modules: str) -> dict[str, str]:
    """`family` for torch's modules, by where the code is rather than by `__module__`: torch renames its
    public names' module (`fully_shard.__module__` is "torch.distributed.fsdp"), so every function,
    method and property getter whose code sits in one of these files is listed, and, for a decorated
    function (`functools.wraps`: `clip_grad_norm_`, `fully_shard`), the function it wraps as well, so
    that every alias of it fails. A module this torch release does not have is skipped."""
    import importlib

    out: dict[str, str] = {}
    for name in modules:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        file = mod.__file__

        def here(fn, file: str = file) -> bool:
            return type(fn).__name__ == "function" and fn.__code__.co_filename == file

        for attr, value in vars(mod).items():
            if attr.startswith("__"):
                continue
            if isinstance(value, type):
                for meth, fn in vars(value).items():
                    if meth.startswith("__") and meth != "__init__":
                        continue
                    if isinstance(fn, property):
                        if here(fn.fget):
                            out[f"{name}.{attr}.{meth}.fget"] = ""
                        continue
                    fn = getattr(fn, "__func__", fn)  # staticmethod / classmethod
                    if here(getattr(fn, "__wrapped__", None)):  # @torch.no_grad() and the like
                        out[f"{name}.{attr}.{meth}.__wrapped__"] = ""
                    if here(fn):
                        out[f"{name}.{attr}.{meth}"] = ""
                continue
            # the wrapped function first: switching the wrapper off replaces it on the module
            if here(getattr(value, "__wrapped__", None)):
                out[f"{name}.{attr}.__wrapped__"] = ""
            if here(value):
                out[f"{name}.{attr}"] = ""
    return out


#: Exercise 1: torch's gradient-norm clipping (one process: torch.nn.utils.clip_grad; FSDP1's
#: sharded version, which all-reduces the norm), and torch's own ZeRO-1 (ZeroRedundancyOptimizer).
CLIP_FORBIDDEN = {
    **LAB_ZERO,
    **_code_family(
        "torch.nn.utils.clip_grad",
        "torch.distributed.fsdp.fully_sharded_data_parallel",
        "torch.distributed.optim.zero_redundancy_optimizer",
    ),
}
#: Exercise 2: torch's ZeRO-3, which gathers ("unshards") and prefetches a module's parameters around
#: its forward: FSDP2 (fully_shard), FSDP1 (FlatParamHandle and its runtime), and the pipeline
#: schedules' FSDP unshard; context parallelism's unshard (a gather of a sharded buffer) and DTensor's
#: unshard rule; and the lab's weight streamer (lesson 05: load a unit before it runs, drop it after,
#: prefetch the next).
PREFETCH_FORBIDDEN = {
    **LAB_ZERO,
    **family("parallel_lab.offload.streaming"),
    **_code_family(
        "torch.distributed.fsdp._fully_shard._fully_shard",
        "torch.distributed.fsdp._fully_shard._fsdp_param_group",
        "torch.distributed.fsdp._fully_shard._fsdp_param",
        "torch.distributed.fsdp._fully_shard._fsdp_collectives",
        "torch.distributed.fsdp._fully_shard._fsdp_state",
        "torch.distributed.fsdp._flat_param",
        "torch.distributed.fsdp._runtime_utils",
        "torch.distributed.fsdp._exec_order_utils",
        "torch.distributed.fsdp._init_utils",
        "torch.distributed.fsdp._unshard_param_utils",
        "torch.distributed.fsdp._state_dict_utils",
        "torch.distributed.fsdp.fully_sharded_data_parallel",
        "torch.distributed.pipelining.schedules",
        "torch.distributed.tensor.experimental._context_parallel._attention",
        "torch.distributed.tensor._ops._tensor_ops",
    ),
}
#: Exercise 3: every formula and counter of model-state bytes, the lab's (costmodel, zero.meta and
#: zero.layout, the meta counter, ZeRO-Offload's) and torch's memory trackers.
BYTES_FORBIDDEN = {
    **LAB_ZERO,
    **family(
        "parallel_lab.costmodel.formulas",
        "parallel_lab.costmodel.planner",
        "parallel_lab.zero.meta",
        "parallel_lab.zero.layout",
        "parallel_lab.runtime.memory",
        "parallel_lab.runtime.memory_state",
        "parallel_lab.offload.host_optimizer",
    ),
    **_code_family(
        "torch.distributed._tools.mem_tracker",
        "torch.distributed._tools.fsdp2_mem_tracker",
        "torch.distributed._tools.memory_tracker",
    ),
}


def _fail(e: Exception, what: str, limit: float) -> None:
    """A rank's AssertionError (our verdict) -> its message; a timeout -> a hint; else unchanged."""
    if getattr(e, "exc_type", None) in ("AssertionError", "WriteItYourself"):
        raise rank_verdict(e) from None
    if type(e).__name__ == "LaunchTimeout":
        raise AssertionError(
            f"{what}: the ranks did not finish in {limit:g} s (a collective some rank skipped?)"
        )
    raise e


# ----------------------------------------------------------------------------- ZeRO-1, clipped
_STEPS = ("clip", "clip", "free", "free", "tiny")  # shuffled per world size: kinds of step
#: "a few numbers": beyond the reduce-scatter and the all-gather a rank may send and receive at most
#: 16 floats' worth per rank of the world (`_SCALARS * 4 * world_size` bytes), and all-reduce as much
_SCALARS = 16


def _draw_numel(rnd: random.Random) -> int:
    while True:
        n = rnd.randint(700, 1500)
        if all(n % p for p in (2, 3, 4)):
            return n


def _scale(max_norm: float, norm: float) -> float:
    """clip_grad_norm_'s factor (torch.nn.utils.clip_grad: max_norm / (norm + 1e-6), at most 1)."""
    return min(1.0, max_norm / (norm + 1e-6))


def _clip_diagnosis(c: float, max_norm: float, ranks: torch.Tensor, own: torch.Tensor, r: int) -> str:
    """Name the mistake whose factor the learner's matches. `ranks`: (N, S) the averaged gradient's
    slices; `own`: this rank's own (unreduced) gradient."""
    p = ranks.shape[0]
    slices = ranks.double().norm(dim=1)  # (N,)
    total = float(slices.square().sum().sqrt())
    right = _scale(max_norm, total)
    mistakes = [
        (p * _scale(max_norm, p * total), "the reduce-scatter returns the sum over ranks: divide it by the world size"),
        (p * right, "the reduce-scatter returns the sum over ranks: divide it by the world size"),
        (_scale(max_norm, float(slices[r])), "that is the factor of this rank's slice's own norm: the norm "
         "clip_grad_norm_ uses is the whole gradient's, and every rank holds only one slice of it"),
        (_scale(max_norm, p * total), "that is the factor of the summed gradient's norm: clip the averaged "
         "gradient, the one the optimizer steps with"),
        (_scale(max_norm, float(own.double().norm())), "that is the factor of this rank's own gradient "
         "before the reduction: clip what all ranks' gradients average to"),
        (_scale(max_norm, float(slices.sum())), "that is the factor of the slices' norms added up: norms do "
         "not add, their squares do"),
        (max_norm / (total + 1e-6), "the factor must never exceed 1: clipping only scales a gradient down"),
        (min(1.0, max_norm / total) if total else 1.0, "clip_grad_norm_ divides by the norm plus 1e-6"),
        (_scale(max_norm, total * total), "that is the factor of the squared norm: take its square root"),
        (1.0, "nothing was clipped"),
    ]  # fmt: skip
    for value, why in mistakes:
        if abs(value - right) > 1e-4 * right and abs(c - value) <= 1e-5 * max(value, 1e-30):
            return f" ({why})"
    return ""


def _zero1_case(ctx, fn: Callable, seed: int, numel: int) -> float:
    from parallel_lab import comms

    p, r = ctx.world_size, ctx.rank
    rnd = random.Random(seed + p)
    kinds = list(_STEPS)
    rnd.shuffle(kinds)  # where the clipped, the free and the tiny steps fall: drawn
    shard_n = -(-numel // p)
    padded = shard_n * p
    g = torch.Generator().manual_seed(seed)  # drawn per grade run: the same weights on every rank
    init = torch.randn(numel, generator=g)
    flat_param = torch.cat([init, torch.zeros(padded - numel)]).to(ctx.device)  # (P,) padded
    flat_grad = torch.zeros(padded, device=ctx.device)  # (P,)
    shard = flat_param.view(p, shard_n)[r].detach().requires_grad_()  # (S,) a view of flat_param
    opt = torch.optim.Adam([shard], lr=0.05)
    ref = init.clone().requires_grad_()  # one process: averaged gradients, clipped, Adam
    ref_opt = torch.optim.Adam([ref], lr=0.05)
    seen: list[torch.Tensor | None] = []
    opt.register_step_pre_hook(
        lambda o, a, k: seen.append(shard.grad.detach().cpu().clone() if shard.grad is not None else None)
    )
    learner = _guarded_call(fn, CLIP_FORBIDDEN, "zero1_clipped_step")
    clipped, bytes_wrong, grown = [], None, 0  # grown: bytes the calls left alive, all steps together
    for step, kind in enumerate(kinds):
        grads = torch.randn(p, numel, generator=torch.Generator().manual_seed(seed + 100 * step + 1))
        grads *= 10 ** rnd.uniform(-1, 1)  # (N, Ψ) every rank's gradient, at a drawn scale
        mean = grads.mean(0)
        if kind == "tiny":  # a norm of a few 1e-6: clip_grad_norm_'s epsilon shows
            grads *= rnd.uniform(1.5, 3.0) * 1e-6 / float(mean.norm())
            mean = grads.mean(0)
        norm = float(torch.linalg.vector_norm(mean))
        factor = rnd.uniform(1.3, 3.0) if kind == "free" else rnd.uniform(0.2, 0.7)
        max_norm = float(f"{norm * factor:.6g}")
        ref.grad = mean.clone()
        torch.nn.utils.clip_grad_norm_([ref], max_norm)  # torch's own, outside the learner's call
        clipped.append(_scale(max_norm, norm) < 1)
        want_grad = torch.cat([ref.grad, ref.grad.new_zeros(padded - numel)]).view(p, shard_n)[r]  # (S,)
        ref_opt.step()
        flat_grad.zero_()
        flat_grad[:numel] = grads[r].to(ctx.device)  # this rank's own gradient
        call = f"zero1_clipped_step(ctx, flat_param, flat_grad, shard, optimizer, max_norm={max_norm!r})"
        where = f"world_size={p}, rank {r}, {numel} parameters padded to {padded}, step {step}: {call}"
        totals = ctx.recorder.comm_totals()
        before = (totals["sent"], totals["recv"], _reduced(totals))
        alive = ctx.memory.total()
        call_learner(learner, where, ctx, flat_param, flat_grad, shard, opt, max_norm)
        # (the check's own copy of the gradient stepped with, made inside the call, is not the learner's)
        mine = seen[-1] if len(seen) > step and ctx.device.type == "cpu" and seen[-1] is not None else None
        grown += ctx.memory.total() - alive - (0 if mine is None else mine.numel() * mine.element_size())
        totals = ctx.recorder.comm_totals()
        sent, recv = totals["sent"] - before[0], totals["recv"] - before[1]
        reduced = _reduced(totals) - before[2]
        assert len(seen) == step + 1 and seen[-1] is not None, (
            f"{where}: call optimizer.step() once, with shard.grad set to this rank's slice of the clipped, "
            "averaged gradient"
        )
        got = seen[-1]
        scale = float(want_grad.abs().max())
        if float((got - want_grad).abs().max()) > 1e-5 * scale:
            slices = torch.cat([mean, mean.new_zeros(padded - numel)]).view(p, shard_n)  # (N, S)
            base = slices[r]
            c = float(got.double() @ base.double() / (base.double() @ base.double()))
            if float((got - c * base).abs().max()) > 1e-5 * float((c * base).abs().max()):
                raise AssertionError(
                    f"{where}: the gradient your optimizer stepped with is not a multiple of this rank's slice "
                    "of the averaged gradient (clipping scales the whole averaged gradient by one factor, the "
                    "same on every rank)"
                )
            raise AssertionError(
                f"{where}: the gradient your optimizer stepped with is this rank's slice of the averaged "
                f"gradient times {c:.6g}; torch.nn.utils.clip_grad_norm_ on the whole averaged gradient "
                f"(norm {norm:.6g}) scales it by {_scale(max_norm, norm):.6g}"
                + _clip_diagnosis(c, max_norm, slices, grads[r], r)
            )
        diff = (flat_param[:numel].cpu() - ref.detach()).abs().max().item()
        assert diff <= 1e-5, (
            f"{where}: the parameters differ from one process (clip_grad_norm_, then Adam) by up to {diff:.3g}: "
            "every rank's flat_param must hold every rank's updated slice"
        )
        # bytes: judged after every step's numbers, which say more about a wrong norm than its bytes do
        ring = comms.ring_bytes_per_rank(padded, p, 4, "all_reduce")[r]
        extra = (sent - ring[0], recv - ring[1])
        limit = _SCALARS * 4 * p
        if bytes_wrong is None and (min(extra) < 0 or (p > 1 and max(extra) == 0)):
            bytes_wrong = (
                f"{where}: this rank sent {sent:,} and received {recv:,} bytes through parallel_lab.comms; the "
                f"reduce-scatter of the gradients and the all-gather of the updated slices alone move {ring[0]:,} "
                f"and {ring[1]:,}" + (", and the norm needs something from every other rank: send it through "
                "parallel_lab.comms, whose collectives count their bytes" if min(extra) >= 0 else "")
            )  # fmt: skip
        elif bytes_wrong is None and max(extra) > limit:
            bytes_wrong = (
                f"{where}: beyond the reduce-scatter and the all-gather ({ring[0]:,} bytes sent), this rank sent "
                f"{extra[0]:,} and received {extra[1]:,} bytes; the norm needs only a number or two from each rank "
                f"(at most {limit} bytes)"
                + (" (that is as much as the gradient slices themselves: send their sums of squares, not the "
                   "slices)" if max(extra) >= 4 * (padded - shard_n) else "")
            )  # fmt: skip
        elif bytes_wrong is None and reduced > limit:
            bytes_wrong = (
                f"{where}: this rank all-reduced {reduced:,} bytes (sent plus received), more than a few numbers "
                f"(at most {limit} bytes): an all-reduce of the gradient leaves the whole averaged gradient on every "
                "rank, which ZeRO-1 never holds; the reduce-scatter leaves each rank its slice, and the norm needs "
                "only a number from each"
            )
        state = opt.state.get(shard, {})
        assert state and state["exp_avg"].numel() == shard_n, (
            f"{where}: the optimizer must step this rank's slice (shard), keeping Adam's state for {shard_n} "
            "elements only"
        )
        assert not flat_param[numel:].any(), f"{where}: the padding of flat_param must stay zero"
    if bytes_wrong is not None:
        raise AssertionError(bytes_wrong)
    # Adam's two states for this rank's S elements (8 S bytes and a step counter: the reference leaves
    # just that), a gradient slice and the messages' scratch: whatever is kept per element of the whole
    # model (optimizer states for all N·S elements: 8 N·S more) does not fit
    allowed = 4 * shard_n * (2 + 2) + 1024
    assert grown <= allowed, (
        f"world_size={p}, rank {r}, {numel} parameters padded to {padded}: after {len(kinds)} steps your function "
        f"left {grown:,} bytes alive on this rank; Adam's two states for this rank's {shard_n} elements, a "
        f"gradient slice and the messages' buffers take at most {allowed:,}: keep optimizer states (and "
        "gradients) for this rank's slice only, never for the whole model"
    )
    assert any(clipped) and not all(clipped)  # the drawn steps cover both sides of max_norm
    return flat_param[:numel].sum().item()


def _reduced(totals: dict) -> int:
    """Bytes (sent plus received) that all-reduces and reduces moved on this rank, any algorithm."""
    ops = totals["by_op"].items()
    return sum(c["sent"] + c["recv"] for k, c in ops if k.endswith("reduce") and "scatter" not in k)


def _guarded_call(fn: Callable, targets: dict[str, str], name: str) -> Callable:
    """`fn` run with the exercise's back doors and this module's helpers switched off."""
    forbidden = {**targets, **family(_SELF)}

    def call(*args):
        with unavailable(forbidden, f"this exercise ({name})"):
            return fn(*args)

    return call


def check_zero1_clipped_step(fn: Callable) -> None:
    """`fn(ctx, flat_param, flat_grad, shard, optimizer, max_norm)`: a ZeRO-1 step whose update equals
    one process's Adam after `torch.nn.utils.clip_grad_norm_(params, max_norm)` on the averaged gradient."""
    require_callable(fn)
    seed = draw_seed() % 2**40  # weights, gradients, max_norm and the parameter count: drawn every run
    numel = _draw_numel(random.Random(seed))
    for p in WORLD_SIZES:
        try:
            res = launch_learner(_zero1_case, p, fn, seed, numel, track_memory=True, timeout=60.0)
        except NotImplementedError:
            raise
        except Exception as e:
            _fail(e, f"world_size={p}", 60.0)
        sums = set(res.values)
        assert len(sums) == 1, f"world_size={p}: the ranks ended with different parameters ({sorted(sums)})"
    passed(
        "check_zero1_clipped_step",
        f"{len(_STEPS)} clipped Adam steps on 1-4 ranks as one process, ring all-reduce bytes + a few numbers",
    )


# ----------------------------------------------------------------------------- ZeRO-3, prefetch
_LAYERS = 4
_BATCH = 2
#: On a GPU the gathered views and the unsharded model's weights sit at other offsets, and cuBLAS may
#: pick another kernel (another summation order) for each: outputs may differ in the last bits, by at
#: most this fraction of the largest output. On the CPU they must be equal bit for bit.
_TOL = 1e-5


def _draw_widths(rnd: random.Random) -> list[int]:
    """Widths of the 4 layers' inputs and output such that, on every rank count, the layers' slices
    differ in size (a message's size then tells which layer it carries)."""
    while True:
        dims = [rnd.randint(20, 40) for _ in range(_LAYERS + 1)]
        sizes = [a * b + b for a, b in zip(dims, dims[1:])]
        if all(len({-(-n // p) for n in sizes}) == _LAYERS for p in WORLD_SIZES):
            return dims


class _PostLog:
    """The receives posted on this rank, in order, each with whether it has been waited for. Every
    message of parallel_lab.comms is posted by `post_p2p` (its one posting point), so a wrapper of it
    sees each message once, on gloo and on NCCL alike, when it is posted; the works it returns are
    wrapped so that a wait on one marks the receives it finishes (gloo: one work per message, receives
    first; NCCL: the batch is one kernel, each work finishes all of it). Entered before the pass's
    switch-off: everything that runs during the pass is a closure or a class local to `__enter__`."""

    def __init__(self) -> None:
        self.recvs: list[list] = []  # [elements, waited] per posted receive
        self._undo: list = []

    def __enter__(self) -> _PostLog:
        import parallel_lab.comms as comms_pkg
        from parallel_lab.comms import core, p2p

        real, posted = core.post_p2p, self.recvs

        class Work:
            def __init__(self, work, mine: list) -> None:
                self._work, self._mine = work, mine

            def wait(self, *args, **kwargs):
                for m in self._mine:
                    m[1] = True
                return self._work.wait(*args, **kwargs)

            def __getattr__(self, name):
                return getattr(self._work, name)

        def post_p2p(group, sends=(), recvs=(), tag: int = 0) -> list:
            works = real(group, sends, recvs, tag)
            mine = [[m[0].numel(), False] for m in recvs if m[0].numel() > 0]
            posted.extend(mine)
            if core.independent_messages(group):
                return [Work(w, mine[k : k + 1]) for k, w in enumerate(works)]
            return [Work(w, mine) for w in works]

        for m in (core, p2p, comms_pkg):
            if getattr(m, "post_p2p", None) is real:
                self._undo.append(m)
                m.post_p2p = post_p2p
        self._real = real
        return self

    def __exit__(self, *exc) -> None:
        for m in self._undo:
            m.post_p2p = self._real
        self._undo.clear()


def _zero3_case(ctx, fn: Callable, seed: int, dims: list[int]) -> list[float]:
    from parallel_lab.runtime.memory import MemoryTracker

    p, r = ctx.world_size, ctx.rank
    torch.manual_seed(seed)  # weights and inputs drawn afresh every grade run
    layers = [nn.Linear(a, b) for a, b in zip(dims, dims[1:])]
    mods: list[nn.Module] = []
    for i, layer in enumerate(layers):
        mods += [layer] if i == _LAYERS - 1 else [layer, nn.GELU()]
    full = nn.Sequential(*mods)
    gen = torch.Generator().manual_seed(seed + 1)
    xs = [torch.randn(_BATCH, dims[0], generator=gen) for _ in range(2)]  # two passes: state must not leak
    full.to(ctx.device)  # the layers, in place: sharded and gathered on this rank's device
    xs = [x.to(ctx.device) for x in xs]
    with torch.no_grad():  # on the same device: CPU and GPU kernels round differently
        wants = [full(x).cpu() for x in xs]  # (B, d_out) the unsharded model's outputs
    exact = ctx.device.type == "cpu"
    nbytes, slices, shards, shapes = [], [], [], []
    for layer in layers:
        shapes.append([q.shape for q in layer.parameters()])
        flat = torch.cat([q.detach().reshape(-1) for q in layer.parameters()])
        n = -(-flat.numel() // p)
        flat = torch.cat([flat, flat.new_zeros(n * p - flat.numel())])  # (N*S,) padded
        shards.append(flat.view(p, n)[r].clone())  # (S,) all this rank keeps of the layer
        slices.append(n)
        nbytes.append(4 * flat.numel())  # a gathered layer, padding included
        for q in layer.parameters():
            q.data = torch.empty(0, device=ctx.device)
    where = f"world_size={p}, rank {r}, layers of widths {dims}"
    call = "zero3_prefetch_hooks(ctx, layers, shards, shapes)"
    handles = call_learner(_guarded_call(fn, PREFETCH_FORBIDDEN, "zero3_prefetch_hooks"),
                            f"{where}: {call}", ctx, layers, shards, shapes)  # fmt: skip
    slack = min(nbytes) // 2  # activations, padding, bookkeeping: less than half the smallest layer
    mem = MemoryTracker(ctx.device)
    log = _PostLog()
    samples: list[tuple] = []  # (when, layer, bytes alive, sizes of receives posted, of those not waited for)

    # Registered after the learner's hooks, so they run after them: a layer's pre-hook has run, its
    # post-hook too. Closures only (this module's functions are switched off during the pass).
    def probe(when: str, i: int) -> Callable:
        def hook(*_):
            posted = {n for n, _ in log.recvs}
            samples.append((when, i, mem.total(), posted, {n for n, waited in log.recvs if not waited}))

        return hook

    probes = [h for i, lay in enumerate(layers) for h in (lay.register_forward_pre_hook(probe("pre", i)),
              lay.register_forward_hook(probe("post", i)))]  # fmt: skip
    outs = []
    for pass_, x in enumerate(xs):
        samples.clear()
        log.recvs.clear()
        before = ctx.recorder.comm_totals()["recv"]
        with (
            mem,
            log,
            unavailable({**PREFETCH_FORBIDDEN, **family(_SELF)}, "this exercise (zero3_prefetch_hooks)"),
        ):
            with torch.no_grad():
                try:
                    out = full(x)
                except NotImplementedError:
                    raise
                except Exception as e:
                    raise AssertionError(
                        f"{where}, forward pass {pass_}: your hooks raised {type(e).__name__}: {e}"
                    ) from e
            after = mem.total() - out.numel() * out.element_size()
        recv = ctx.recorder.comm_totals()["recv"] - before
        wpass = f"{where}, forward pass {pass_}"
        got, want = out.cpu(), wants[pass_]
        assert got.shape == want.shape, (
            f"{wpass}: output shape {tuple(got.shape)}, expected {tuple(want.shape)}"
        )
        diff = (got - want).abs().max().item()
        assert diff <= (0 if exact else _TOL * max(1.0, want.abs().max().item())), (
            f"{wpass}: the output differs from the unsharded model's by up to {diff:.3g}"
            + (
                ""
                if exact
                else f" (on a GPU, kernels may round differently: at most {_TOL:g} of the largest output)"
            )
        )
        _check_alive(wpass, samples, nbytes, slack, layers, lower=p > 1)
        if p > 1:
            _check_posted(wpass, samples, slices)
            want_recv = sum(4 * (p - 1) * s for s in slices)
            assert recv == want_recv, (
                f"{wpass}: this rank received {recv:,} bytes through parallel_lab.comms; gathering each layer once "
                f"brings {want_recv:,} (the other ranks' slices of every layer)"
                + (": a layer was gathered twice" if recv > want_recv else ": use parallel_lab.comms, whose "
                   "messages are counted")
            )  # fmt: skip
        for i, layer in enumerate(layers):
            left = sum(q.numel() for q in layer.parameters())
            assert left == 0, (
                f"{wpass}: after the pass layer {i} still holds {left} parameter elements: free each layer after "
                "it has run"
            )
        assert after < slack, (
            f"{wpass}: {after:,} bytes allocated during the pass are still alive after it (a gathered layer is "
            f"{min(nbytes):,} or more): keep nothing gathered once the layers have run"
        )
        outs += got.reshape(-1).tolist()
    for h in probes:
        h.remove()
    for h in handles if isinstance(handles, (list, tuple)) else []:
        getattr(h, "remove", lambda: None)()
    return exact, outs


def _check_alive(where: str, samples: list, nbytes: list[int], slack: int, layers: list[nn.Module],
                 lower: bool) -> None:  # fmt: skip
    """At each layer's compute its own and the next layer's parameters (no more) are alive; after it, at
    most two layers'. `lower`: the next layer's buffer must exist too (on 1 rank a layer may be bound
    to its shard itself: nothing to gather, nothing allocated)."""
    last = len(nbytes) - 1
    for when, i, alive, _, _ in samples:
        if when == "pre":
            need = nbytes[i] + (nbytes[i + 1] if i < last else 0)
            held = [k for k in range(i) if sum(q.numel() for q in layers[k].parameters())]
            assert not held, (
                f"{where}: when layer {i} began to compute, layer {held[0]} still held its parameters: free a "
                "layer once it has run"
            )
            if lower and alive < need:
                raise AssertionError(
                    f"{where}: when layer {i} began to compute, {alive:,} bytes were alive, layer {i} alone is "
                    f"{nbytes[i]:,}: the next layer's gather had not started (start it before this layer "
                    "computes, so that it travels while the layer runs)"
                )
            assert alive < need + slack, (
                f"{where}: when layer {i} began to compute, {alive:,} bytes were alive; layer {i}"
                + (
                    f" and layer {i + 1} (in flight) are {need:,}"
                    if i < last
                    else f" is {need:,}, the last layer"
                )
                + ": more than that means a layer not freed, or a gather started further ahead than the next layer"
            )
        else:
            top = max(nbytes[k] + nbytes[k + 1] for k in range(last))
            assert alive < top + slack, (
                f"{where}: after layer {i} ran, {alive:,} bytes were alive, more than any two layers ({top:,}): "
                "at most the layer that ran and the one in flight may be alive"
            )


def _check_posted(where: str, samples: list, slices: list[int]) -> None:
    """When layer i began to compute, a receive of layer i+1's slices (their size) had been posted and
    not yet waited for: the next layer travels while this one computes."""
    for when, i, _, posted, pending in samples:
        if when != "pre" or i + 1 >= len(slices):
            continue
        n = slices[i + 1]
        assert n in posted, (
            f"{where}: when layer {i} began to compute, no message of layer {i + 1}'s slice size ({n} "
            "elements) had been posted: start the next layer's gather before this layer computes"
        )
        assert n in pending, (
            f"{where}: when layer {i} began to compute, layer {i + 1}'s slices ({n} elements each) had already "
            f"been received and waited for: a blocking gather in layer {i}'s hook moves them before layer {i} "
            f"computes, not while it does; post the receives there and wait for them only when layer {i + 1} "
            "is about to run"
        )


def check_zero3_prefetch_hooks(fn: Callable) -> None:
    """`fn(ctx, layers, shards, shapes)` registers hooks: gather a layer before it runs, free it after, and
    start the next layer's gather before the current one computes."""
    require_callable(fn)
    seed = draw_seed() % 2**40
    dims = _draw_widths(random.Random(seed))
    for p in WORLD_SIZES:
        try:
            res = launch_learner(_zero3_case, p, fn, seed, dims, timeout=60.0)
        except NotImplementedError:
            raise
        except Exception as e:
            _fail(e, f"world_size={p}", 60.0)
        exact, first = res.values[0]
        spread = max(abs(a - b) for _, outs in res.values for a, b in zip(outs, first))
        assert spread <= (0 if exact else _TOL * max(1.0, *map(abs, first))), (
            f"world_size={p}: ranks computed different outputs (by up to {spread:.3g})"
        )
    passed(
        "check_zero3_prefetch_hooks",
        f"{_LAYERS} layers on 1-4 ranks, output as the unsharded model's, the next layer in flight, at most two alive",
    )


# ----------------------------------------------------------------------------- predict, then measure
_SMALL = dict(vocab=35, seq_len=8, d_model=16, n_heads=2, n_layers=2)
#: (optimizer, precision): SGD with momentum keeps one state, without none; "mixed" is the lab's bf16
#: weights and gradients with an fp32 master copy (lesson 02's accounting), fp32 keeps none
_CASES = (("momentum", "mixed"), ("sgd", "mixed"), ("momentum", "fp32"), ("sgd", "fp32"))


def _measure_state_bytes(ctx, vocab: int) -> list[dict]:
    """One ZeRO step of a small GPT per (optimizer, precision, stage): the model states it adds, as the
    memory tracker counts them."""
    import gc

    from parallel_lab.models import GPTConfig, build_model, compute_loss, synthetic_batch
    from parallel_lab.zero import ZeRO

    out = []
    cfg = GPTConfig(**{**_SMALL, "vocab": vocab})
    x, y = synthetic_batch("tokens", 1, seq_len=_SMALL["seq_len"], vocab=vocab, seed=1 + ctx.rank,
                           device=ctx.device)  # fmt: skip
    # The runs before stay alive (a stage-3 model and its hooks form a cycle; a collection costs 0.5 s
    # here): each run is measured as what it adds, with no collection in between to free the others.
    gc.disable()
    try:
        for optimizer, precision in _CASES:
            for stage in range(4):
                before = ctx.memory.snapshot()
                model = build_model(cfg, seed=0, device=ctx.device)
                kw = {"momentum": 0.9} if optimizer == "momentum" else {}
                zero = ZeRO(ctx, model, stage=stage, optimizer="sgd", precision=precision, lr=1e-2, **kw)
                compute_loss(model, x, y).backward()
                zero.step()
                zero.zero_grad()
                live = ctx.memory.snapshot()
                master = zero.states.master
                out.append({"numel": zero.layout.numel, "optimizer": optimizer, "precision": precision,
                            "stage": stage, **{k: live[k] - before[k] for k in ("param", "grad", "optim")},
                            "master": 0 if master is None else master.numel() * master.element_size()})  # fmt: skip
                del model, zero, master
    finally:
        gc.enable()
    return out


def _bytes_diagnosis(k: str, said: int, got: dict, p: int) -> str:
    """Name the mistake when `said` (the learner's bytes of state k) is what that mistake gives."""
    n, stage, mixed, master = got["numel"], got["stage"], got["precision"] == "mixed", got["master"]
    s = -(-n // p)
    if k == "param" and mixed and said == got["param"] + master:
        return " (the fp32 master copy is what the optimizer steps, not what the model computes with: it is optimizer state)"
    if k in ("param", "grad") and said == got[k] - (2 if mixed else 4) * (s * p - n) and s * p != n:
        return " (the flat buffer is padded so that it splits into equal shards)"
    if k == "optim":
        if mixed and said == got["optim"] - master:
            return " (in mixed precision the optimizer steps an fp32 master copy of the weights: count it)"
        per = 4 * (n if stage == 0 else s)  # one fp32 number for every element this rank keeps states of
        extra = (said - got["optim"]) / per
        if extra == int(extra) and extra:
            return (
                f" ({abs(int(extra))} fp32 state(s) per element too {'many' if extra > 0 else 'few'}: plain "
                "SGD keeps no state, SGD with momentum one buffer)"
            )
    return ""


def check_zero_state_bytes(fn: Callable) -> None:
    """`fn(numel, world_size, stage, optimizer, precision)` -> {"param", "grad", "optim"}: the bytes one rank
    keeps after a step under ZeRO stage 0-3, for SGD ("sgd") or SGD with momentum ("momentum") in "fp32" or
    "mixed" precision; compared exactly with the memory tracker's count of real runs on 2 and 3 ranks."""
    require_callable(fn)
    fn = _guarded_call(fn, BYTES_FORBIDDEN, "zero_state_bytes")
    rnd = random.Random(draw_seed())
    # both model sizes drawn every grade run, one that 2 divides and one that 3 does not
    vocabs = {2: 2 * rnd.randint(10, 39) + 1, 3: uneven_vocab(_SMALL, 3)}
    cases = 0
    for p in (2, 3):
        try:
            res = launch_learner(_measure_state_bytes, p, vocabs[p], track_memory=True, timeout=60.0)
        except Exception as e:
            _fail(e, f"the measured runs on {p} ranks", 60.0)
        for got in res.values[0]:
            args = (got["numel"], p, got["stage"], got["optimizer"], got["precision"])
            where = (f"zero_state_bytes(numel={args[0]}, world_size={p}, stage={args[2]}, "
                     f"optimizer={args[3]!r}, precision={args[4]!r})")  # fmt: skip
            said = call_learner(fn, where, *args)
            assert isinstance(said, dict) and all(k in said for k in ("param", "grad", "optim")), (
                f"{where}: return a dict with 'param', 'grad' and 'optim' bytes, got {said!r:.80}"
            )
            for k in ("param", "grad", "optim"):
                assert said[k] == got[k], (
                    f"{where}: you predict {said[k]:,} bytes of {k} on a rank, the tracker measured {got[k]:,}"
                    + _bytes_diagnosis(k, said[k], got, p)
                )
            cases += 1
    passed(
        "check_zero_state_bytes",
        f"{cases} runs (SGD with and without momentum, fp32 and mixed, stages 0-3, 2 and 3 ranks) measured as "
        "predicted",
    )
