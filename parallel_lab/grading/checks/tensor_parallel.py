"""Checks for lesson 08's exercises: the vocabulary-parallel cross-entropy and embedding, and their bytes.

The lesson splits a block's matrices; these exercises split the two layers it leaves whole, the ones
as wide as the vocabulary (Shoeybi et al. 2019, §3; Megatron-LM's `_VocabParallelCrossEntropy` and
`VocabParallelEmbedding`). Rank r holds vocabulary entries [vocab_start, vocab_start + shard): the
shards are uneven, drawn afresh every grade run, as are the sizes, logits, tables and ids.

- `check_vocab_parallel_loss` / `check_vocab_parallel_loss_grad`: `Fn.apply(logits, target,
  vocab_start, ctx, group)` on 1 to 4 gloo ranks (one launch per world size), float64, against
  `F.cross_entropy(reduction="none")` on the whole logits: the loss on every rank and this rank's
  slice of the gradient, to 1e-10; cases with logits near 1e4, where exp overflows float64, included.
- `check_vocab_parallel_embedding`: `Fn.apply(ids, weight, vocab_start, ctx, group)` against
  `F.embedding` on the whole table, output and this rank's rows of the table's gradient.
- The collectives the learner's code calls are read from the lab's trace (`parallel_lab.comms` records
  each one): forward's all-reduces are counted with their sizes (the loss's: a max of N, then sums of 2N
  in all, as three all-reduces of N or Megatron-core's fused two), backward must send nothing. A
  collective that skips the lab's comms would go unseen, so every one is refused while the learner's
  code runs (torch.distributed's functions, the process group's and its backend's methods, and the
  dispatcher's c10d and _c10d_functional ops); so are torch's and the lab's own versions of these
  layers, and this module's reference.
- `check_vocab_step_bytes`: a prediction of the bytes a rank sends in one step of a vocabulary-parallel
  embedding whose output is reduce-scattered along the sequence (sequence parallelism) and of the fused
  loss, against the lab's byte counter on this module's reference layers (the lab's rings), exactly.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from parallel_lab import comms
from parallel_lab.grading.checks import (
    TORCH_COLLECTIVES,
    WriteItYourself,
    call_learner,
    draw_seed,
    family,
    guarded,
    launch_learner,
    passed,
    rank_verdict,
    require_callable,
    unavailable,
)

__all__ = [
    "check_vocab_parallel_embedding",
    "check_vocab_parallel_loss",
    "check_vocab_parallel_loss_grad",
    "check_vocab_step_bytes",
]

_SELF = "parallel_lab.grading.checks.tensor_parallel"
WORLD_SIZES = (1, 2, 3, 4)
TOL = 1e-10  # float64; the sums over shards run in another order than F.cross_entropy's

#: torch's modules with functions or classes doing these exercises' jobs (a vocabulary-sharded loss or
#: lookup: loss_parallel, DTensor's embedding and nll/softmax rules and its _MaskPartial placement, the
#: sharded-tensor embedding ops; found by tests/test_exercises_08.py in torch's source), and torch's
#: functional collectives, which would bypass the lab's trace
TORCH_MODULES = (
    "torch.distributed.tensor.parallel.loss",
    "torch.distributed.tensor.parallel.style",
    "torch.distributed.tensor.parallel.api",
    "torch.distributed.tensor._ops._embedding_ops",
    "torch.distributed.tensor._ops._math_ops",
    "torch.distributed.tensor.placement_types",
    "torch.distributed._shard.sharding_spec.chunk_sharding_spec_ops._common",
    "torch.distributed._shard.sharding_spec.chunk_sharding_spec_ops.embedding",
    "torch.distributed._shard.sharding_spec.chunk_sharding_spec_ops.embedding_bag",
    "torch.distributed._functional_collectives",
    "torch.distributed._functional_collectives_impl",
    "torch.distributed.nn.functional",
)
LAB_TP = (
    "parallel_lab.tensor_parallel.operators",
    "parallel_lab.tensor_parallel.layers",
    "parallel_lab.tensor_parallel.sequence_parallel",
    "parallel_lab.tensor_parallel.transformer",
)
# the check's own guards, running while the learner's code does
_KEEP = ("_only_traced", "_learner_running", "_from_the_labs_comms", "_comms_only", "_OnlyThroughComms")


def _forbidden() -> dict[str, str]:
    import warnings

    with warnings.catch_warnings():  # some of torch's private modules warn on import
        warnings.simplefilter("ignore")
        return {
            **family(*LAB_TP),
            **family(*TORCH_MODULES, missing_ok=True),
            **family(_SELF, keep=_KEEP),
            # the package's aliases: a context manager is replaced, not rewritten, so its alias needs its own entry
            "torch.distributed.tensor.parallel.loss_parallel": "",
            "torch.distributed.tensor.parallel.parallelize_module": "",
        }


# ----------------------------------------------------------------------------- the learner's calls
_TORCH_DIR = str(Path(torch.__file__).resolve().parent) + os.sep
_COMMS_DIR = str(Path(comms.__file__).resolve().parent) + os.sep
#: the dispatcher's namespaces of collective and point-to-point ops: torch.distributed's Python calls end
#: here (c10d::allreduce_, c10d::send, ...), and torch.ops._c10d_functional.* reaches them directly
_COMM_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd", "c10d_functional", "symm_mem")
#: the per-device backend's methods (`pg._get_backend(device).allreduce(...)`), which skip the dispatcher
_BACKEND_METHODS = (
    "allreduce", "allreduce_coalesced", "allgather", "_allgather_base", "allgather_coalesced",
    "allgather_into_tensor_coalesced", "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced",
    "alltoall", "alltoall_base", "broadcast", "reduce", "gather", "scatter", "send", "recv", "recv_anysource",
)  # fmt: skip


def _from_the_labs_comms(frame: Any) -> bool:
    """Is the innermost caller outside torch one of parallel_lab.comms' functions? Decided by the code's
    file and by the frame's globals being that module's own (a learner's `exec` with a made-up file name
    or `__name__` has neither)."""
    while frame is not None and (
        frame.f_code.co_filename.startswith(_TORCH_DIR) or frame.f_code is _ONLY_FROM_THE_LAB
    ):
        frame = frame.f_back
    if frame is None or not frame.f_code.co_filename.startswith(_COMMS_DIR):
        return False
    module = sys.modules.get(frame.f_globals.get("__name__", ""))
    return module is not None and vars(module) is frame.f_globals


def _comms_only(fn: Any, message: str) -> Any:
    def only_from_the_lab(*args: Any, **kwargs: Any) -> Any:
        if not _from_the_labs_comms(sys._getframe(1)):
            raise WriteItYourself(message)
        return fn(*args, **kwargs)

    return only_from_the_lab


_ONLY_FROM_THE_LAB = _comms_only(print, "").__code__  # the wrappers' one code object: a step to look past


class _OnlyThroughComms(TorchDispatchMode):
    """Every collective and message reaches the dispatcher as a c10d op; one the lab's comms did not
    call is refused (torch.ops._c10d_functional.all_gather_into_tensor, say, called directly)."""

    def __init__(self, message: str) -> None:
        super().__init__()
        self.message = message

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in _COMM_NAMESPACES and not _from_the_labs_comms(sys._getframe(1)):
            raise WriteItYourself(self.message)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _only_traced(what: str) -> Iterator[None]:
    """torch.distributed's collectives and point-to-point calls refuse a caller other than the lab's
    comms: the check counts what `parallel_lab.comms` records, and a direct call would go unseen. Three
    doors: torch.distributed's Python functions and the process group's methods (wrapped), the
    dispatcher's c10d ops (a dispatch mode), and the backend's methods, which skip the dispatcher."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    message = (
        f"{what}: call the collectives through parallel_lab.comms (comms.dist_all_reduce or "
        "comms.ring_all_reduce), which trace them; torch.distributed's own are switched off here"
    )
    names = [n.rsplit(".", 1)[1] for n in TORCH_COLLECTIVES if n.startswith("torch.distributed.")]
    names += ["send", "recv", "isend", "irecv", "batch_isend_irecv", "all_reduce_coalesced"]
    pg_names = [n.rsplit(".", 1)[1] for n in TORCH_COLLECTIVES if ".ProcessGroup." in n]
    pg_names += ["send", "recv", "recv_anysource"]
    undo: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, fn: Any) -> None:
        if fn is not None:
            undo.append((owner, name, fn))
            setattr(owner, name, _comms_only(fn, message))

    try:
        for owner in (dist, c10d):
            for name in names:
                patch(owner, name, getattr(owner, name, None))
        for klass, methods in ((torch._C._distributed_c10d.ProcessGroup, pg_names),
                               (torch._C._distributed_c10d.Backend, _BACKEND_METHODS)):  # fmt: skip
            for name in methods:
                patch(klass, name, vars(klass).get(name))
        with _OnlyThroughComms(message):
            yield
    finally:
        for owner, name, fn in reversed(undo):
            setattr(owner, name, fn)


@contextlib.contextmanager
def _learner_running(forbidden: dict[str, str], what: str) -> Iterator[None]:
    with _only_traced(f"this exercise ({what})"), unavailable(forbidden, f"this exercise ({what})"):
        yield


def _learner(forbidden: dict, what: str, where: str, fn: Callable, *args: Any) -> Any:
    with _learner_running(forbidden, what):
        return call_learner(fn, where, *args)


def _comm_events(ctx, since: int) -> list[tuple[str, int]]:
    return [
        (e["name"], int(e["args"].get("numel", 0)))
        for e in ctx.recorder.events[since:]
        if e["kind"] == "comm"
    ]


def _say(events: list[tuple[str, int]]) -> str:
    return ", ".join(f"{name} of {n} elements" for name, n in events) or "nothing"


def _close(where: str, what: str, got: Any, want: torch.Tensor, label: str = "index") -> None:
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{where}: {what} should be a tensor, got {type(got).__name__}")
    if tuple(got.shape) != tuple(want.shape):
        raise AssertionError(f"{where}: {what} has shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    got = got.detach().to(want.device, torch.float64)
    bad = ~torch.isclose(got, want, rtol=TOL, atol=TOL)
    if bad.any():
        i = tuple(int(k) for k in bad.nonzero()[0])
        raise AssertionError(
            f"{where}: {what} differs at {label} {i[0] if len(i) == 1 else i}: got {got[i].item():.12g}, "
            f"expected {want[i].item():.12g}"
        )


def _same(got: torch.Tensor, other: torch.Tensor) -> bool:
    return torch.allclose(got.detach().to(other.device, torch.float64), other, rtol=1e-8, atol=1e-8)


def _draw_cuts(rnd: random.Random, vocab: int, p: int) -> list[int]:
    """Uneven shard boundaries: p shards of at least one entry each, [0, ..., vocab]."""
    return [0, *sorted(rnd.sample(range(1, vocab), p - 1)), vocab]


def _run(rank_fn: Callable, what: str, cases: dict[int, list], *args: Any) -> None:
    for p in WORLD_SIZES:
        try:
            launch_learner(rank_fn, p, cases[p], *args, timeout=60.0)
        except NotImplementedError:
            raise
        except Exception as e:
            if getattr(e, "exc_type", None) in ("AssertionError", "WriteItYourself"):
                raise rank_verdict(e) from None
            if type(e).__name__ == "LaunchTimeout":
                raise AssertionError(
                    f"{what}: world_size={p}: the ranks did not finish in 60 s; does every rank call the "
                    "same collectives in the same order?"
                ) from None
            raise


# ----------------------------------------------------------------------------- the loss
def _loss_cases(p: int, rnd: random.Random) -> list[dict]:
    """Fixed edge cases, then drawn ones: sizes, uneven cuts, seeds, scales and offsets."""
    out = []
    if p > 1:  # every target on the last rank; then logits near 1e4, where exp overflows
        out.append(dict(n=3, vocab=2 * p + 1, cuts=None, scale=2.0, offset=0.0, on_last=True, label="edge"))
    out.append(dict(n=4, vocab=p + 3, cuts=None, scale=3.0, offset=1e4, on_last=False, label="large logits"))
    for _ in range(3):
        out.append(dict(n=rnd.randint(1, 12), vocab=rnd.randint(p + 1, 40), cuts=None, on_last=False,
                        scale=rnd.choice((1.0, 4.0, 20.0)), offset=rnd.choice((0.0, -30.0, 1e4)), label="drawn"))  # fmt: skip
    for c in out:
        c["cuts"] = _draw_cuts(rnd, c["vocab"], p)
        c["seed"] = rnd.getrandbits(40)
    return out


def _loss_inputs(c: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(c["seed"])
    n, v = c["n"], c["vocab"]
    logits = torch.randn(n, v, generator=gen, dtype=torch.float64) * c["scale"] + c["offset"]  # (N, V)
    lo = c["cuts"][-2] if c["on_last"] else 0
    target = torch.randint(lo, v, (n,), generator=gen)  # (N,)
    grad = torch.rand(n, generator=gen, dtype=torch.float64) + 0.5  # (N,) not all ones
    return logits, target, grad


def _own_max_loss(logits: torch.Tensor, target: torch.Tensor, cuts: list[int]) -> torch.Tensor:
    """The loss when each rank subtracts its own shard's maximum (not the row's) and sums what results."""
    shards = [logits[:, a:b] for a, b in zip(cuts, cuts[1:])]
    maxes = [s.max(-1).values for s in shards]
    total = sum(torch.exp(s - m[:, None]).sum(-1) for s, m in zip(shards, maxes))
    owner = torch.bucketize(target, torch.tensor(cuts[1:-1]), right=True)
    picked = logits.gather(1, target[:, None])[:, 0] - torch.stack(maxes, 1).gather(1, owner[:, None])[:, 0]
    return torch.log(total) - picked


def _loss_rank(ctx, cases: list[dict], Fn: Any, backward: bool) -> int:
    p, r = ctx.world_size, ctx.rank
    forbidden = _forbidden()
    what = "VocabParallelCrossEntropy"
    for c in cases:
        logits, target, grad = _loss_inputs(c)
        lo, hi = c["cuts"][r], c["cuts"][r + 1]
        sizes = [b - a for a, b in zip(c["cuts"], c["cuts"][1:])]
        where = (
            f"{what}.apply(logits[:, {lo}:{hi}], target, vocab_start={lo}, ctx, group=None) on rank {r} of "
            f"world_size={p} ({c['label']} case: {c['n']} tokens, vocabulary of {c['vocab']} split {sizes}"
            + (", logits near 1e4" if c["offset"] == 1e4 else "")
            + ")"
        )
        shard = logits[:, lo:hi].clone().to(ctx.device).requires_grad_(backward)
        mark = len(ctx.recorder.events)
        loss = _learner(
            forbidden, what, f"{where}, forward", Fn.apply, shard, target.to(ctx.device), lo, ctx, None
        )
        sent = _comm_events(ctx, mark)
        want = F.cross_entropy(logits, target, reduction="none")
        if isinstance(loss, torch.Tensor) and loss.shape == want.shape:
            got = loss.detach().cpu()
            if not torch.isfinite(got).all():
                raise AssertionError(
                    f"{where}: the loss is {got[~torch.isfinite(got)][0].item()} where it should be "
                    f"{want[~torch.isfinite(got)][0].item():.6g}: exp overflows float64 above about 709"
                    + (", and these logits are near 1e4" if c["offset"] == 1e4 else "")
                )
            if p > 1 and not _same(got, want) and _same(got, _own_max_loss(logits, target, c["cuts"])):
                raise AssertionError(
                    f"{where}: the loss is what each rank gets from the maximum of its own shard: exps shifted "
                    "by different amounts on different ranks do not add up to the softmax's denominator"
                )
        _close(where, "the loss", loss, want, "token")
        if p > 1:
            # three all-reduces of N (Megatron-LM's), or the max and then the two sums side by side in one
            # of 2N (Megatron-core's fused version): a max of N first, then 2N elements of sums in all
            if not (
                sent
                and all("all_reduce" in name for name, _ in sent)
                and sent[0][1] == c["n"]
                and sum(k for _, k in sent[1:]) == 2 * c["n"]
            ):
                raise AssertionError(
                    f"{where}: forward should send a max all-reduce of {c['n']} elements (one number per token), "
                    f"then sum all-reduces of {2 * c['n']} elements in all, and nothing else; it sent {_say(sent)}"
                )
        if not backward:
            continue
        mark = len(ctx.recorder.events)
        _learner(forbidden, what, f"{where}, backward", loss.backward, grad.to(ctx.device))
        sent = _comm_events(ctx, mark)
        full = logits.clone().requires_grad_()
        F.cross_entropy(full, target, reduction="none").backward(grad)
        want_g = full.grad[:, lo:hi]
        if shard.grad is None:
            raise AssertionError(
                f"{where}: no gradient reached the logits: backward must return one for them"
            )
        got = shard.grad.detach().cpu()
        soft = torch.softmax(logits, -1)[:, lo:hi]
        onehot = F.one_hot(target, c["vocab"]).double()[:, lo:hi]
        local = torch.zeros_like(soft)
        mine = target < hi - lo
        local[mine.nonzero()[:, 0], target[mine]] = 1.0  # the target's column counted from 0 on every rank
        if not _same(got, want_g):
            if _same(got, (soft - local) * grad[:, None]):
                raise AssertionError(
                    f"{where}: the target's term sits at column `target` of this rank's shard on every rank; "
                    f"this rank's column j is vocabulary entry {lo} + j"
                )
            if _same(got, soft * grad[:, None]):
                raise AssertionError(
                    f"{where}: the gradient is the softmax alone: the target's term is missing"
                )
            if _same(got, soft - onehot):
                raise AssertionError(
                    f"{where}: the gradient ignores grad_output (the incoming gradient, not all ones here)"
                )
        _close(where, "the logits' gradient", got, want_g, "(token, column)")
        if sent:
            raise AssertionError(
                f"{where}: backward sent {_say(sent)}; everything backward needs is on this rank already"
            )
    return 1


def _check_loss(Fn: Any, backward: bool) -> None:
    require_callable(
        getattr(Fn, "apply", None), "VocabParallelCrossEntropy.apply (a torch.autograd.Function subclass)"
    )
    rnd = random.Random(draw_seed())
    cases = {p: _loss_cases(p, rnd) for p in WORLD_SIZES}
    _run(_loss_rank, "VocabParallelCrossEntropy", cases, Fn, backward)


def check_vocab_parallel_loss(Fn: Any) -> None:
    """`Fn.apply(logits_shard, target, vocab_start, ctx, group)` -> the per-token loss, on every rank."""
    _check_loss(Fn, backward=False)
    passed("check_vocab_parallel_loss", "the loss on 1 to 4 ranks, uneven vocabulary shards, large logits")


def check_vocab_parallel_loss_grad(Fn: Any) -> None:
    """The same Function's backward: this rank's slice of the logits' gradient, with no communication."""
    _check_loss(Fn, backward=True)
    passed("check_vocab_parallel_loss_grad", "the loss and its gradient on 1 to 4 ranks")


# ----------------------------------------------------------------------------- the embedding
def _embedding_cases(p: int, rnd: random.Random) -> list[dict]:
    out = [dict(shape=(2, 3), vocab=p + 1, h=3, label="edge")]  # a shard of one row or two: ids repeat
    for _ in range(3):
        out.append(dict(shape=(rnd.randint(1, 3), rnd.randint(1, 8)), vocab=rnd.randint(p + 1, 30),
                        h=rnd.randint(1, 9), label="drawn"))  # fmt: skip
    for c in out:
        c["cuts"] = _draw_cuts(rnd, c["vocab"], p)
        c["seed"] = rnd.getrandbits(40)
    return out


def _embedding_inputs(c: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(c["seed"])
    table = torch.randn(c["vocab"], c["h"], generator=gen, dtype=torch.float64)  # (V, h)
    ids = torch.randint(0, c["vocab"], c["shape"], generator=gen)  # (B, T)
    ids.view(-1)[0] = ids.view(-1)[-1]  # one id at least twice (when there are two tokens)
    grad = torch.randn(*c["shape"], c["h"], generator=gen, dtype=torch.float64)  # (B, T, h)
    return table, ids, grad


def _embedding_rank(ctx, cases: list[dict], Fn: Any) -> int:
    p, r = ctx.world_size, ctx.rank
    forbidden = _forbidden()
    what = "VocabParallelEmbedding"
    for c in cases:
        table, ids, grad = _embedding_inputs(c)
        lo, hi = c["cuts"][r], c["cuts"][r + 1]
        sizes = [b - a for a, b in zip(c["cuts"], c["cuts"][1:])]
        where = (
            f"{what}.apply(ids, weight[{lo}:{hi}], vocab_start={lo}, ctx, group=None) on rank {r} of "
            f"world_size={p} ({c['label']} case: ids of shape {tuple(c['shape'])}, a table of {c['vocab']} rows "
            f"split {sizes}, h={c['h']})"
        )
        weight = table[lo:hi].clone().to(ctx.device).requires_grad_()
        mark = len(ctx.recorder.events)
        try:
            out = _learner(
                forbidden,
                what,
                f"{where}, forward",
                Fn.apply,
                ids.clone().to(ctx.device),
                weight,
                lo,
                ctx,
                None,
            )
        except AssertionError as e:
            if "IndexError" in str(e) or "out of range" in str(e):
                raise AssertionError(f"{e}; an id this rank does not hold has no row in its shard") from None
            raise
        sent = _comm_events(ctx, mark)
        want = F.embedding(ids, table)
        if isinstance(out, torch.Tensor) and out.shape == want.shape and p > 1:
            leak = want.clone()
            for k in range(p):
                foreign = (ids < c["cuts"][k]) | (ids >= c["cuts"][k + 1])
                leak[foreign] += table[c["cuts"][k]]
            if not _same(out, want) and _same(out, leak):
                raise AssertionError(
                    f"{where}: every token whose id a rank does not hold got that rank's row 0 added: "
                    "zero those tokens' rows before the sum"
                )
        _close(where, "the output", out, want)
        if p > 1:
            n = ids.numel() * c["h"]
            if len(sent) != 1 or "all_reduce" not in sent[0][0] or sent[0][1] != n:
                raise AssertionError(
                    f"{where}: forward should all-reduce one tensor of {n} elements; it sent {_say(sent)}"
                )
        mark = len(ctx.recorder.events)
        _learner(forbidden, what, f"{where}, backward", out.backward, grad.to(ctx.device))
        sent = _comm_events(ctx, mark)
        full = table.clone().requires_grad_()
        F.embedding(ids, full).backward(grad)
        want_g = full.grad[lo:hi]
        if weight.grad is None:
            raise AssertionError(f"{where}: no gradient reached the weight: backward must return one for it")
        got = weight.grad.detach().cpu()
        if not _same(got, want_g):
            leak = want_g.clone()
            foreign = (ids < lo) | (ids >= hi)
            leak[0] += grad[foreign].sum(0)
            if _same(got, leak):
                raise AssertionError(
                    f"{where}: row 0 of this rank's shard got the gradients of the tokens whose ids other ranks hold"
                )
            rows = [i - lo for i in ids.unique().tolist() if lo <= i < hi and int((ids == i).sum()) > 1]
            wrong = [j for j in range(hi - lo) if not _same(got[j], want_g[j])]
            if wrong and set(wrong) <= set(rows):
                raise AssertionError(
                    f"{where}: the gradient of row {wrong[0]} (id {lo + wrong[0]}, which appears "
                    f"{int((ids == lo + wrong[0]).sum())} times) is not the sum over its tokens"
                )
        _close(where, "the weight's gradient", got, want_g, "(row, feature)")
        if sent:
            raise AssertionError(
                f"{where}: backward sent {_say(sent)}; every token's gradient is on every rank already"
            )
    return 1


def check_vocab_parallel_embedding(Fn: Any) -> None:
    """`Fn.apply(ids, weight_shard, vocab_start, ctx, group)` -> the embeddings (..., h), on every rank."""
    require_callable(
        getattr(Fn, "apply", None), "VocabParallelEmbedding.apply (a torch.autograd.Function subclass)"
    )
    rnd = random.Random(draw_seed())
    cases = {p: _embedding_cases(p, rnd) for p in WORLD_SIZES}
    _run(_embedding_rank, "VocabParallelEmbedding", cases, Fn)
    passed("check_vocab_parallel_embedding", "output and gradient on 1 to 4 ranks, uneven vocabulary shards")


# ----------------------------------------------------------------------------- predict, then measure
def _ring_rows(ctx, name: str, blocks: list[torch.Tensor], gather: bool) -> None:
    """The lab's ring reduce-scatter (or all-gather) on blocks of whole tokens, in place: `blocks` are
    the (rows_k, h) slices of one (n, h) tensor, rank k's tokens being block k. comms.ring_reduce_scatter
    cuts the flat tensor by elements, which splits a token when p does not divide n; the steps here are the
    ring's (comms/ring.py), on these blocks, through the lab's traced exchange."""
    with comms.TracedOp(ctx, name, blocks[0], None) as o:
        p, me, flat = o.p, o.me, [b.view(-1) for b in blocks]
        right, left = (me + 1) % p, (me - 1) % p
        if p > 1 and gather:  # at step s rank r forwards block r-s and receives block r-s-1 in place
            for s in range(p - 1):
                o.xchg(flat[(me - s) % p], right, flat[(me - s - 1) % p], left, "all-gather", tag=o.steps)
        elif p > 1:  # at step s rank r sends its partial sum of block r-s-1 and adds in block r-s-2
            acc = flat[(me - 1) % p].clone()
            for s in range(p - 1):
                k = (me - s - 2) % p
                got = torch.empty_like(flat[k])
                o.xchg(acc, right, got, left, "reduce-scatter", tag=o.steps)
                acc = flat[k] + got
            flat[me].copy_(acc)


class _RefSequenceParallelEmbedding(torch.autograd.Function):
    """The vocabulary-parallel embedding whose output is reduce-scattered along the sequence (sequence
    parallelism: Korthikanti et al. 2022, §4.2.2): rank r keeps its block of tokens, comms.chunk_sizes(n, p)."""

    @staticmethod
    def forward(fctx, ids, weight, start, ctx):
        local = ids - start
        foreign = (local < 0) | (local >= weight.shape[0])
        local = local.masked_fill(foreign, 0)
        out = F.embedding(local, weight).masked_fill(
            foreign[:, None], 0.0
        )  # (n, h) this rank's part of the sum
        rows = comms.chunk_sizes(ids.numel(), ctx.world_size)
        _ring_rows(ctx, "ring_reduce_scatter", list(out.split(rows)), gather=False)
        fctx.save_for_backward(local, foreign)
        fctx.rows, fctx.ctx, fctx.blocks = weight.shape[0], ctx, rows
        return out.split(rows)[ctx.rank].clone()  # (rows_r, h)

    @staticmethod
    def backward(fctx, g):
        local, foreign = fctx.saved_tensors
        full = g.new_zeros(local.numel(), g.shape[-1])  # (n, h): every token's gradient, for this rank's rows
        blocks = list(full.split(fctx.blocks))
        blocks[fctx.ctx.rank].copy_(g)
        _ring_rows(fctx.ctx, "ring_all_gather", blocks, gather=True)
        gw = g.new_zeros(fctx.rows, g.shape[-1])
        gw.index_add_(0, local, full.masked_fill(foreign[:, None], 0.0))
        return None, gw, None, None


class _RefLoss(torch.autograd.Function):
    """The vocabulary-parallel loss as Megatron-core fuses it (megatron/core/fusions/fused_cross_entropy.py):
    the max all-reduced, then the target's logits and the exps' sums side by side in one all-reduce of 2N."""

    @staticmethod
    def forward(fctx, logits, target, start, ctx):
        m = logits.max(-1).values  # (N,)
        comms.ring_all_reduce(ctx, m, op="max")
        z = logits - m[:, None]
        local = target - start
        here = (local >= 0) & (local < logits.shape[-1])
        picked = torch.where(here, z.gather(1, local.clamp(0, logits.shape[-1] - 1)[:, None])[:, 0], 0.0)
        e = z.exp()
        both = torch.cat((picked, e.sum(-1)))  # (2N,)
        comms.ring_all_reduce(ctx, both)
        picked, s = both.split(len(m))
        fctx.save_for_backward(e / s[:, None], local, here)
        return s.log() - picked

    @staticmethod
    def backward(fctx, g):
        soft, local, here = fctx.saved_tensors
        out = soft.clone()
        rows = here.nonzero()[:, 0]
        out[rows, local[rows]] -= 1
        return out * g[:, None], None, None, None


class _RefEmbedding(torch.autograd.Function):
    """The plain vocabulary-parallel embedding (its output all-reduced): the reference of exercise 3's check."""

    @staticmethod
    def forward(fctx, ids, weight, start, ctx):
        local = ids - start
        foreign = (local < 0) | (local >= weight.shape[0])
        local = local.masked_fill(foreign, 0)
        out = F.embedding(local, weight).masked_fill(foreign[..., None], 0.0)
        comms.ring_all_reduce(ctx, out)
        fctx.save_for_backward(local, foreign)
        fctx.rows = weight.shape[0]
        return out

    @staticmethod
    def backward(fctx, g):
        local, foreign = fctx.saved_tensors
        gw = g.new_zeros(fctx.rows, g.shape[-1])
        gw.index_add_(0, local.reshape(-1), g.masked_fill(foreign[..., None], 0.0).reshape(-1, g.shape[-1]))
        return None, gw, None, None


_DTYPES = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


def _measure_step(ctx, shapes: list[tuple]) -> list[tuple[int, int]]:
    """(forward, backward) bytes this rank sends in one step of the reference sequence-parallel embedding
    and the reference loss, per shape; the embedding's output is checked against F.embedding on the way."""
    out = []
    for n, h, vocab, itemsize, cuts in shapes:
        dt, r = _DTYPES[itemsize], ctx.rank
        lo, hi = cuts[r], cuts[r + 1]
        gen = torch.Generator().manual_seed(n * 1000 + h)
        ids = torch.randint(0, vocab, (n,), generator=gen)
        table = torch.randn(vocab, h, generator=gen).to(dt)
        weight = table[lo:hi].clone().to(ctx.device).requires_grad_()
        logits = torch.randn(n, hi - lo, generator=gen).to(ctx.device, dt).requires_grad_()
        before = ctx.recorder.comm_totals()["sent"]
        x = _RefSequenceParallelEmbedding.apply(ids.to(ctx.device), weight, lo, ctx)
        loss = _RefLoss.apply(logits, ids.to(ctx.device), lo, ctx)
        middle = ctx.recorder.comm_totals()["sent"]
        (x.float().sum() + loss.float().sum()).backward()
        rows = comms.chunk_sizes(n, ctx.world_size)
        mine = F.embedding(ids, table.double()).split(rows)[r]
        if not torch.allclose(x.detach().cpu().double(), mine, rtol=1e-2, atol=1e-2):
            raise AssertionError(f"the reference's tokens on rank {r} are not its block of the lookup")
        out.append((middle - before, ctx.recorder.comm_totals()["sent"] - middle))
    return out


def check_vocab_step_bytes(fn: Callable) -> None:
    """`fn(n, h, vocab, p, rank, itemsize)` -> bytes rank `rank` sends in one forward + backward of a
    vocabulary-parallel embedding whose output is reduce-scattered along the sequence (n tokens) and a
    vocabulary-parallel loss of n tokens, on p ranks (the lab's rings); predicted, then compared with the
    byte counter of real runs, exactly."""
    require_callable(fn)
    forbidden = {
        **_forbidden(),
        "parallel_lab.comms.cost.ring_bytes_per_rank": "count with comms.chunk_sizes",
    }
    fn = guarded(fn, forbidden, "this exercise (vocab_step_bytes)")
    rnd = random.Random(draw_seed())
    cases = 0
    for p in (2, 3, 4):
        # fewer tokens than ranks; p + 1 tokens (blocks by tokens and by elements differ); then drawn
        shapes = [(p - 1, 3, p + 1, 4), (p + 1, 5, 50, 8)]
        shapes += [
            (rnd.randint(1, 40), rnd.randint(2, 24), rnd.randint(p, 60), rnd.choice((2, 4, 8)))
            for _ in range(4)
        ]
        shapes = [(*s, _draw_cuts(rnd, s[2], p)) for s in shapes]
        res = launch_learner(_measure_step, p, shapes, timeout=60.0)
        for r, sent in enumerate(res.values):
            for (n, h, vocab, itemsize, _), (fwd, bwd) in zip(shapes, sent):
                call = f"vocab_step_bytes(n={n}, h={h}, vocab={vocab}, p={p}, rank={r}, itemsize={itemsize})"
                said = call_learner(fn, call, n, h, vocab, p, r, itemsize)
                assert said == fwd + bwd, (
                    f"{call}: you predict {said} bytes, the rank sent {fwd + bwd} ({fwd} in forward, {bwd} in backward)"
                )
                cases += 1
    passed("check_vocab_step_bytes", f"{cases} predictions equal the bytes measured on 2, 3 and 4 ranks")
