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
  each one): forward's all-reduces are counted with their sizes, backward must send nothing. A
  torch.distributed collective called directly would go unseen, so it is refused while the learner's
  code runs; so are torch's and the lab's own versions of these layers, and this module's reference.
- `check_vocab_step_bytes`: a prediction of the bytes a rank sends in one step of both layers,
  against the lab's byte counter on this module's reference layers (ring all-reduces), exactly.
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

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
_KEEP = ("_only_traced", "_learner_running")  # the check's own guards, running while the learner's code does


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
@contextlib.contextmanager
def _only_traced(what: str) -> Iterator[None]:
    """torch.distributed's collectives and point-to-point calls refuse a caller outside torch and the
    lab: the check counts what `parallel_lab.comms` records, and a direct call would go unseen."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    message = (
        f"{what}: call the collectives through parallel_lab.comms (comms.dist_all_reduce or "
        "comms.ring_all_reduce), which trace them; torch.distributed's own are switched off here"
    )
    names = [n.rsplit(".", 1)[1] for n in TORCH_COLLECTIVES if n.startswith("torch.distributed.")]
    names += ["send", "recv", "isend", "irecv", "batch_isend_irecv", "all_reduce_coalesced"]
    pg_names = [n.rsplit(".", 1)[1] for n in TORCH_COLLECTIVES if ".ProcessGroup." in n] + ["send", "recv"]
    undo: list[tuple[Any, str, Any]] = []

    def wrap(fn: Any) -> Any:
        def only_from_the_lab(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if not caller.startswith(("torch.", "parallel_lab.")):
                raise WriteItYourself(message)
            return fn(*args, **kwargs)

        return only_from_the_lab

    try:
        for owner in (dist, c10d):
            for name in names:
                fn = getattr(owner, name, None)
                if fn is not None:
                    undo.append((owner, name, fn))
                    setattr(owner, name, wrap(fn))
        pg = torch._C._distributed_c10d.ProcessGroup
        for name in pg_names:
            fn = vars(pg).get(name)
            if fn is not None:
                undo.append((pg, name, fn))
                setattr(pg, name, wrap(fn))
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
            reduces = [e for e in sent if "all_reduce" in e[0]]
            if len(sent) != 3 or len(reduces) != 3 or any(n != c["n"] for _, n in reduces):
                raise AssertionError(
                    f"{where}: forward should all-reduce three tensors of {c['n']} elements (one number per token) "
                    f"and nothing else; it sent {_say(sent)}"
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
class _RefLoss(torch.autograd.Function):
    """The check's reference loss over a vocabulary-split logits tensor (ring all-reduces: real bytes)."""

    @staticmethod
    def forward(fctx, logits, target, start, ctx):
        m = logits.max(-1).values  # (N,)
        comms.ring_all_reduce(ctx, m, op="max")
        z = logits - m[:, None]
        local = target - start
        here = (local >= 0) & (local < logits.shape[-1])
        picked = torch.where(here, z.gather(1, local.clamp(0, logits.shape[-1] - 1)[:, None])[:, 0], 0.0)
        comms.ring_all_reduce(ctx, picked)
        e = z.exp()
        s = e.sum(-1)
        comms.ring_all_reduce(ctx, s)
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
    """(forward, backward) bytes this rank sends in one step of the reference embedding and loss, per shape."""
    out = []
    for n, h, vocab, itemsize, cuts in shapes:
        dt, r = _DTYPES[itemsize], ctx.rank
        lo, hi = cuts[r], cuts[r + 1]
        gen = torch.Generator().manual_seed(n * 1000 + h)
        ids = torch.randint(0, vocab, (n,), generator=gen).to(ctx.device)
        weight = torch.randn(hi - lo, h, generator=gen).to(ctx.device, dt).requires_grad_()
        logits = torch.randn(n, hi - lo, generator=gen).to(ctx.device, dt).requires_grad_()
        before = ctx.recorder.comm_totals()["sent"]
        x = _RefEmbedding.apply(ids, weight, lo, ctx)
        loss = _RefLoss.apply(logits, ids, lo, ctx)
        middle = ctx.recorder.comm_totals()["sent"]
        (x.float().sum() + loss.float().sum()).backward()
        out.append((middle - before, ctx.recorder.comm_totals()["sent"] - middle))
    return out


def check_vocab_step_bytes(fn: Callable) -> None:
    """`fn(n, h, vocab, p, rank, itemsize)` -> bytes rank `rank` sends in one forward + backward of a
    vocabulary-parallel embedding of n ids and a vocabulary-parallel loss of n tokens, on p ranks (the
    lab's ring all-reduces); predicted, then compared with the byte counter of real runs, exactly."""
    require_callable(fn)
    forbidden = {
        **_forbidden(),
        "parallel_lab.comms.cost.ring_bytes_per_rank": "count with comms.chunk_sizes",
    }
    fn = guarded(fn, forbidden, "this exercise (vocab_step_bytes)")
    rnd = random.Random(draw_seed())
    cases = 0
    for p in (2, 3, 4):
        shapes = [(p, 1, p + 1, 4), (7, 5, 50, 8)]  # a token per rank, h = 1; then chunks that do not divide
        shapes += [
            (rnd.randint(1, 40), rnd.randint(1, 24), rnd.randint(p, 60), rnd.choice((2, 4, 8)))
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
