"""Checks for lesson 03's exercises: average gradients over uneven shards, buckets in the order gradients
became ready, a DDP hook under gradient accumulation with uneven micro-batch counts, and the bytes a rank
receives over a step that syncs every m-th micro-step.

The gradient checks train a small float64 GPT with tied embeddings and a frozen parameter. Everything a
case depends on is drawn afresh every grade run (`draw_seed`): the batch, how many samples each rank holds
(some rank holding none), how many micro-batches each rank runs and their size. Every gradient must equal the
gradient of the mean loss over the whole batch, computed in one process, on every rank, to 1e-12 (float64:
only the order of the sums differs, ~1e-16 relative). Each world size is one launch that runs all its cases
(on a GPU machine its ranks come from a forkserver, not forked from the notebook).
`assign_buckets` is compared with the rule of the lesson applied in the given ready order, on the check's GPT
(its ready order recorded from a real backward) and on drawn parameter lists, sizes, bucket sizes and
orders. `ddp_recv_bytes` is compared exactly with the received-bytes counter of `BucketedDDP(comm="ring")`
runs in float32 and float64, syncing every `sync_every`-th micro-step and always on the last.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable

import torch
import torch.nn as nn

from parallel_lab.grading.checks import (
    _resolve,
    draw_seed,
    family,
    guarded,
    launch_learner,
    passed,
    rank_verdict,
    require_callable,
    unavailable,
)

__all__ = ["check_assign_buckets", "check_average_gradients", "check_ddp_grad_hook", "check_ddp_recv_bytes"]

WORLD_SIZES = (1, 2, 3, 4)
VOCAB, SEQ = 25, 8
TOL = 1e-12  # float64; see the module docstring


def _torch_family(*modules: str) -> dict[str, str]:
    """`family` of torch modules that may move between releases, less what a module only inherits
    (an Enum's `_generate_next_value_` belongs to enum: switching it off would break every enum)."""
    out = {}
    for m in modules:
        for dotted, instead in family(m, missing_ok=True).items():
            if getattr(_resolve(dotted)[2], "__module__", m) == m:
                out[dotted] = instead
    return out


#: torch's own data parallelism: DDP (its reducer, bucket assignment and comm hooks), FSDP's and
#: pipelining's gradient reductions, DTensor's data-parallel gradient hook, ZeRO's DDP buckets.
#: torch.distributed's collectives stay: the exercises are built from them.
TORCH_DP = {
    **_torch_family(
        "torch.nn.parallel", "torch.nn.parallel.distributed", "torch.nn.parallel.data_parallel",
        "torch.distributed.algorithms.ddp_comm_hooks", "torch.distributed.algorithms.ddp_comm_hooks.default_hooks",
        "torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook",
        "torch.distributed.algorithms._comm_hooks.default_hooks",
        "torch.distributed.tensor.parallel._data_parallel_utils", "torch.distributed.fsdp._runtime_utils",
        "torch.distributed.fsdp.fully_sharded_data_parallel", "torch.distributed.fsdp._fully_shard._fully_shard",
        "torch.distributed.pipelining.stage", "torch.distributed.pipelining.schedules",
        "torch.distributed.optim.zero_redundancy_optimizer", "torch.distributed._composable.replicate",
    ),
    # defined in modules whose classes say they live elsewhere (`family` skips them), or properties
    **{f"torch.distributed.fsdp._fully_shard._fully_shard.FSDPModule.{n}": ""
       for n in ("set_all_reduce_hook", "set_requires_gradient_sync")},
    "torch.distributed.optim.zero_redundancy_optimizer.ZeroRedundancyOptimizer._bucket_assignments_per_rank": "",
    "torch.nn.parallel.DistributedDataParallelCPU": "",
    # the class's own __init__ first (then the class itself on its modules): also catches a Reducer
    # imported under its name before the check ran
    "torch._C._distributed_c10d.Reducer.__init__": "",
    "torch.distributed.Reducer": "",
    "torch._C._distributed_c10d.Reducer": "",
    "torch.distributed._compute_bucket_assignment_by_size": "",
    "torch._C._distributed_c10d._compute_bucket_assignment_by_size": "",
}  # fmt: skip
#: the lab's data parallelism and torch's, switched off while the learner's function runs
FORBIDDEN = {
    **family("parallel_lab.data_parallel.naive", "parallel_lab.data_parallel.ddp"),
    **TORCH_DP,
}
#: for `ddp_recv_bytes`: the lab's byte formulas too (`chunk_sizes`, lesson 01's split, stays)
BYTES_FORBIDDEN = {
    **FORBIDDEN,
    **family("parallel_lab.comms.cost", keep=("chunk_sizes",)),
    "parallel_lab.costmodel.formulas.allreduce_bytes_per_rank": "",
}


def _model() -> nn.Module:
    from parallel_lab.models import GPTConfig, build_model

    m = build_model(GPTConfig(vocab=VOCAB, seq_len=SEQ, d_model=8, n_heads=2, n_layers=2), seed=0).double()
    m.wpe.weight.requires_grad_(False)  # frozen: no gradient to average
    return m


def _batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    from parallel_lab.models import synthetic_batch

    return synthetic_batch("tokens", n, seq_len=SEQ, vocab=VOCAB, seed=seed)


def _flat_grad(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The gradient of the mean loss over the samples (x, y), flat over the trainable parameters;
    zeros for no samples."""
    m = _model()
    if len(x):
        m(x, y).backward()
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in m.parameters() if p.requires_grad])  # fmt: skip


def _flat(model: nn.Module, where: str) -> torch.Tensor:
    out = []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, f"{where}: {n} is frozen (requires_grad=False) but now has a .grad"
            continue
        assert p.grad is not None, f"{where}: {n}.grad is None after your code ran"
        out.append(p.grad.detach().cpu().reshape(-1))
    return torch.cat(out)


def _scale_of(got: torch.Tensor, want: torch.Tensor) -> float | None:
    """c when got = c * want (to 1e-9), else None."""
    c = float(got @ want / (want @ want))
    return c if (got - c * want).abs().max() <= 1e-9 * want.abs().max() else None


def _launch(rank_fn: Callable, p: int, *args, check: str):
    try:
        return launch_learner(rank_fn, p, *args, timeout=60.0, threads=1)
    except Exception as e:
        if getattr(e, "exc_type", None) in ("AssertionError", "WriteItYourself"):  # our verdict, on a rank
            raise rank_verdict(e) from None
        if type(e).__name__ == "LaunchTimeout":
            raise AssertionError(
                f"{check}: world_size={p}: the ranks did not finish in 60 s; every rank must call the same "
                "collectives on tensors of the same shape, in the same order (a rank with nothing to add too)"
            ) from None
        raise


# ----------------------------------------------------------------------------- 1: uneven shards
def _draw_shards(rnd: random.Random, p: int, empty: bool) -> list[int]:
    """Samples per rank: uneven (else dividing by the ranks would be right), one rank empty if `empty`."""
    while True:
        sizes = [rnd.randint(1, 6) for _ in range(p)]
        if empty and p > 1:
            sizes[rnd.randrange(p)] = 0
        if p == 1 or (len(set(sizes)) > 1 and sum(sizes) > 1):
            return sizes


def _average_rank(ctx, fn: Callable, cases: list[dict]) -> int:
    import torch.distributed as dist

    for case in cases:
        sizes, start = case["sizes"], sum(case["sizes"][: ctx.rank])
        n = sizes[ctx.rank]
        x, y = (t[start : start + n].to(ctx.device) for t in case["batch"])
        model = _model().to(ctx.device)  # the learner's all-reduces run on this rank's device (NCCL: a GPU)
        if n:
            model(x, y).backward()
        else:  # no samples: no loss to differentiate, a zero gradient
            for q in model.parameters():
                if q.requires_grad:
                    q.grad = torch.zeros_like(q)
        where = (f"average_gradients(ctx, model, local_samples={n}) on rank {ctx.rank} of world_size="
                 f"{ctx.world_size}, the ranks holding {sizes} samples")  # fmt: skip
        with unavailable(FORBIDDEN, "this exercise (average_gradients)"):
            fn(ctx, model, n)
        dist.barrier()
        got, want = _flat(model, where), case["want"]
        diff = (got - want).abs().max().item()
        if diff <= TOL:
            continue
        total, c = sum(sizes), _scale_of(got, want)
        why = f"differs from the gradient of the mean loss over all {total} samples by up to {diff:.3g}"
        if (got - case["ranks_mean"]).abs().max() <= 1e-9:
            why += (f"; it is the plain average over the ranks, which counts a rank holding {min(sizes)} "
                    f"sample(s) as much as one holding {max(sizes)}")  # fmt: skip
        elif (got - case["ranks_sum"]).abs().max() <= 1e-9:
            why += "; it is the plain sum of the ranks' gradients"
        elif (got - case["own"][ctx.rank]).abs().max() <= 1e-9:
            why += "; it is still this rank's own gradient (nothing crossed the ranks?)"
        elif c is not None:
            why += f"; it is {c:.6g} times the expected gradient (the weights of the ranks' gradients must add up to 1)"
        raise AssertionError(f"{where}: the gradient {why}")
    return len(cases)


def check_average_gradients(fn: Callable) -> None:
    """`fn(ctx, model, local_samples)` runs after backward on shards of uneven size (each rank's loss the
    mean over its own samples) and leaves in every `.grad` the gradient of the mean loss over all samples."""
    require_callable(fn)
    rnd = random.Random(draw_seed())  # shards and batches drawn afresh every grade run
    for p in WORLD_SIZES:
        cases = []
        for empty in (True, False) if p > 1 else (False,):
            sizes = _draw_shards(rnd, p, empty)
            batch = _batch(sum(sizes), rnd.getrandbits(31))
            bounds = [sum(sizes[:r]) for r in range(p + 1)]
            own = [_flat_grad(batch[0][a:b], batch[1][a:b]) for a, b in zip(bounds, bounds[1:])]
            cases.append({"sizes": sizes, "batch": batch, "want": _flat_grad(*batch), "own": own,
                          "ranks_mean": sum(own) / p, "ranks_sum": sum(own)})  # fmt: skip
        _launch(_average_rank, p, fn, cases, check="check_average_gradients")
    passed("check_average_gradients", "uneven shards, empty ranks too, on 1 to 4 ranks")


# ----------------------------------------------------------------------------- 3: the hook, accumulating
def _watching(counter: list[int], works: list, state: dict):
    """While the learner's hook runs: count the all-reduces of floating-point tensors this rank launches
    (every torch.distributed all-reduce, and the lab's wrappers of it, ends in the process group's method)
    and keep their works; note every wait on one of those works, and every wait on a future, that happens
    inside the hook (`state["in_hook"]`). (The lab's wrappers first all-reduce, and wait for, an int64
    fingerprint of the call, to catch ranks that disagree: neither counted nor noted.)"""
    pg = torch._C._distributed_c10d.ProcessGroup
    work_cls, future_cls = torch._C._distributed_c10d.Work, torch._C.Future
    real = {n: getattr(pg, n) for n in ("allreduce", "allreduce_coalesced")}
    real_wait, real_future_wait = work_cls.wait, future_cls.wait

    def wrap(name):
        def counted(self, *args, **kwargs):
            tensors = args[0] if args and isinstance(args[0], (list, tuple)) else args[:1]
            floating = any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in tensors)
            work = real[name](self, *args, **kwargs)
            if floating:
                counter[0] += 1
                works.append(work)
            return work

        return counted

    def wait(self, *args, **kwargs):
        if state["in_hook"] and any(self is w for w in works):
            state["waited"] += 1
        return real_wait(self, *args, **kwargs)

    def future_wait(self, *args, **kwargs):
        if state["in_hook"]:
            state["waited"] += 1
        return real_future_wait(self, *args, **kwargs)

    @contextlib.contextmanager
    def cm():
        try:
            for n in real:
                setattr(pg, n, wrap(n))
            work_cls.wait, future_cls.wait = wait, future_wait
            yield
        finally:
            for n, f in real.items():
                setattr(pg, n, f)
            work_cls.wait, future_cls.wait = real_wait, real_future_wait

    return cm()


def _hook_rank(ctx, fn: Callable, cases: list[dict]) -> int:
    for case in cases:
        _hook_case(ctx, fn, case)
    return len(cases)


def _hook_case(ctx, fn: Callable, case: dict) -> None:
    import torch.distributed as dist

    from parallel_lab.comms import Handle

    def _is_work_of(entry, new: list) -> bool:
        """`entry` is one of the works in `new` (launched during this call), or the lab's handle of one."""
        if isinstance(entry, Handle):
            return bool(entry.works) and all(any(w is x for x in new) for w in entry.works)
        return isinstance(entry, torch._C._distributed_c10d.Work) and any(entry is x for x in new)

    ks, mb = case["micro_batches"], case["micro_batch"]
    k, start = ks[ctx.rank], sum(ks[: ctx.rank]) * mb
    x, y = (t[start : start + k * mb].to(ctx.device) for t in case["batch"])
    model = _model().to(ctx.device)
    pending: list = []
    state = {"micro_step": 0, "bad": None, "in_hook": False, "waited": 0}
    counter, works = [0], []

    def hook(q: torch.Tensor) -> None:
        before, launched = len(pending), len(works)
        state["in_hook"] = True
        try:
            fn(ctx, q, pending, state["micro_step"], list(ks))
        finally:
            state["in_hook"] = False
        inside = torch._C._current_graph_task_id() != -1
        added, new = pending[before:], works[launched:]
        last = state["micro_step"] == k - 1
        want = (0, 1) if last and ctx.world_size == 1 else (1,) if last else (0,)
        if state["bad"] is None and (not inside or len(added) not in want or len(new) != len(added)):
            state["bad"] = (state["micro_step"], f"a call appended {len(added)} work(s) to `pending` and "
                            f"launched {len(new)} all-reduce(s)")  # fmt: skip
        elif state["bad"] is None and not all(_is_work_of(w, new) for w in added):
            state["bad"] = (state["micro_step"], "`pending` got " + ", ".join(type(w).__name__ for w in added)
                            + ", not the work of the all-reduce the call launched")  # fmt: skip

    n_train = 0
    for q in model.parameters():
        if q.requires_grad:
            q.register_post_accumulate_grad_hook(hook)
            n_train += 1
    with _watching(counter, works, state), unavailable(FORBIDDEN, "this exercise (ddp_grad_hook)"):
        for m in range(k):
            state["micro_step"] = m
            where = (f"ddp_grad_hook(ctx, param, pending, micro_step={m}, micro_batches={ks}) on rank "
                     f"{ctx.rank} of world_size={ctx.world_size}, {mb} sample(s) per micro-batch")  # fmt: skip
            counter[0] = 0
            model(x[m * mb : (m + 1) * mb], y[m * mb : (m + 1) * mb]).backward()
            if state["waited"]:
                raise AssertionError(
                    f"{where}: a call waited for its all-reduce ({state['waited']} wait(s) while the hook ran): "
                    "backward stops there until the ranks have exchanged the gradient, so nothing overlaps"
                )
            if m < k - 1:
                assert counter[0] == 0, (
                    f"{where}: this micro-step launched {counter[0]} all-reduce(s); this rank's gradients "
                    f"should cross the ranks once per optimizer step (torch's DDP: no_sync())"
                )
            else:
                allowed = (0, n_train) if ctx.world_size == 1 else (n_train,)
                assert counter[0] in allowed, (
                    f"{where}: this rank's last micro-step launched {counter[0]} all-reduce(s), expected one per "
                    f"parameter ({n_train})"
                )
            if state["bad"] is not None:
                step, what = state["bad"]
                raise AssertionError(
                    f"{where.replace(f'micro_step={m}', f'micro_step={step}')}: {what}; on this rank's "
                    "micro-step that communicates each call must start one asynchronous all-reduce inside "
                    "backward and append its work, on the others none"
                )
    for w in pending:
        w.wait()
    dist.barrier()
    got, want = _flat(model, where), case["want"]
    diff = (got - want).abs().max().item()
    if diff > TOL:
        c = _scale_of(got, want)
        said = f"; it is {c:.6g} times the expected gradient" if c is not None else ""
        raise AssertionError(
            f"{where}: after this rank's last micro-step the gradient differs from the gradient of the mean "
            f"loss over all {sum(ks)} micro-batches of all ranks by up to {diff:.3g}{said}"
        )


def _draw_micro_batches(rnd: random.Random, p: int) -> list[int]:
    """Micro-batches per rank: uneven where there are several ranks (else N*k would be right)."""
    while True:
        ks = [rnd.randint(1, 4) for _ in range(p)]
        if p == 1 or len(set(ks)) > 1:
            return ks


def check_ddp_grad_hook(fn: Callable) -> None:
    """`fn(ctx, param, pending, micro_step, micro_batches)`, called by autograd the moment `param.grad` is
    complete after each micro-batch's backward, rank r running `micro_batches[r]` micro-batches; communicates
    on this rank's last micro-step only."""
    require_callable(fn)
    rnd = random.Random(draw_seed())  # micro-batch counts, micro-batch size and batch drawn every grade run
    for p in WORLD_SIZES:
        cases = []
        for _ in range(2):
            ks, mb = _draw_micro_batches(rnd, p), rnd.randint(1, 3)
            batch = _batch(sum(ks) * mb, rnd.getrandbits(31))
            cases.append({"micro_batches": ks, "micro_batch": mb, "batch": batch, "want": _flat_grad(*batch)})
        _launch(_hook_rank, p, fn, cases, check="check_ddp_grad_hook")
    passed("check_ddp_grad_hook", "one all-reduce per parameter per optimizer step, on 1 to 4 ranks")


# ----------------------------------------------------------------------------- 2: buckets in ready order
def _reference_buckets(params, bucket_bytes, order, late: bool = False) -> list[list[int]]:
    """The lesson's rule, walked in `order` (indices into params); buckets of indices of first entries."""
    first: dict[int, int] = {}
    for i, q in enumerate(params):
        first.setdefault(id(q), i)
    buckets, cur, size, seen = [], [], 0, set()
    for i in order:
        q = params[i]
        if not q.requires_grad or id(q) in seen:
            continue
        seen.add(id(q))
        cur.append(first[id(q)])
        size += q.numel() * q.element_size()
        if (size > bucket_bytes) if late else (size >= bucket_bytes):
            buckets.append(cur)
            cur, size = [], 0
    return buckets + ([cur] if cur else [])


def _as_indices(buckets, params, where: str) -> list[list[int]]:
    first: dict[int, int] = {}
    for i, q in enumerate(params):
        first.setdefault(id(q), i)
    assert isinstance(buckets, (list, tuple)), (
        f"{where}: return a list of buckets, got {type(buckets).__name__}"
    )
    out = []
    for j, b in enumerate(buckets):
        assert isinstance(b, (list, tuple)), (
            f"{where}: bucket {j} must be a list of parameters, got {type(b).__name__}"
        )
        row = []
        for q in b:
            assert id(q) in first, (
                f"{where}: bucket {j} holds something that is not one of the given parameters"
            )
            row.append(first[id(q)])
        out.append(row)
    return out


def _ready_order_of(model: nn.Module, params: list) -> list[int]:
    """The order in which `params`' gradients became ready in one real backward (post-accumulate hooks);
    a tied weight's second listing right after its first readiness; frozen ones at the end."""
    seen: list[int] = []
    handles = [q.register_post_accumulate_grad_hook(lambda q: seen.append(id(q)))
               for q in {id(q): q for q in params if q.requires_grad}.values()]  # fmt: skip
    model(*_batch(2, 0)).backward()
    for h in handles:
        h.remove()
    order = [i for pid in seen for i, q in enumerate(params) if id(q) == pid]
    return order + [i for i in range(len(params)) if i not in order]


def _draw_params(rnd: random.Random) -> tuple[list, str]:
    n = rnd.randint(4, 9)
    ps = [nn.Parameter(torch.zeros(rnd.randint(1, 40))) for _ in range(n)]
    frozen = rnd.randrange(n)
    ps[frozen].requires_grad_(False)
    tied = rnd.choice([i for i in range(n) if i != frozen])
    params = [*ps]
    params.insert(rnd.randint(tied + 1, len(params)), ps[tied])  # a tied weight, listed a second time
    first = {id(q): i for i, q in reversed([*enumerate(params)])}
    label = "[" + ", ".join(f"p{first[id(q)]}: {q.numel()} floats" + ("" if q.requires_grad else ", frozen")
                            for q in params) + "]"  # fmt: skip
    return params, label


def check_assign_buckets(fn: Callable) -> None:
    """`fn(params, bucket_bytes, ready_order)` -> list of buckets (lists of parameters): the lesson's rule
    walked in the order the gradients became ready (`ready_order`, indices into `params`)."""
    require_callable(fn)
    rnd = random.Random(draw_seed())  # parameter lists, sizes, bucket sizes and ready orders: every grade run
    model = _model()
    gpt = [*model.parameters(), model.lm_head.weight]  # the tied weight, listed twice
    total = sum(q.numel() * 8 for q in model.parameters() if q.requires_grad)
    real = _ready_order_of(model, gpt)
    names = {i: n for i, (n, _) in enumerate(model.named_parameters())} | {len(gpt) - 1: "lm_head.weight"}
    gpt_label = "the check's GPT (" + ", ".join(f"{i}: {names[i]}" for i in range(len(gpt))) + ")"
    cases = [
        (gpt, b, real, gpt_label) for b in (10 * total, 1, rnd.randint(65, total // 2), rnd.randint(65, 3000))
    ]
    shuffled = [*range(len(gpt))]
    rnd.shuffle(shuffled)
    cases.append((gpt, rnd.randint(65, total // 3), shuffled, gpt_label))
    toy = [nn.Parameter(torch.zeros(n)) for n in (4, 2, 3)]
    cases.append(
        (
            [toy[0], nn.Parameter(torch.zeros(2), requires_grad=False)],
            4,
            [1, 0],
            "[p0: 4 floats, p1: 2 floats, frozen]",
        )
    )
    cases.append(
        ([toy[1], toy[2], toy[1]], 12, [2, 1, 0], "[p0: 2 floats, p1: 3 floats, p0 again]")
    )  # tied: ready as p2
    cases.append(
        ([toy[1], toy[2], toy[0]], 8, [0, 2, 1], "[p0: 2 floats, p1: 3 floats, p2: 4 floats]")
    )  # p0 fills 8
    for _ in range(8):
        params, label = _draw_params(rnd)
        order = [*range(len(params))]
        rnd.shuffle(order)
        cases.append((params, rnd.randint(4, 120), order, label))  # fmt: skip
    mine = guarded(fn, FORBIDDEN, "this exercise (assign_buckets)")
    for params, b, order, label in cases:
        where = f"assign_buckets(params={label}, bucket_bytes={b}, ready_order={order})"
        got = _as_indices(mine(list(params), b, list(order)), params, where)
        want = _reference_buckets(params, b, order)
        if got == want:
            continue
        flat_got, flat_want = [i for r in got for i in r], [i for r in want for i in r]
        if len(set(flat_got)) < len(flat_got):
            raise AssertionError(f"{where}: a parameter is in your buckets twice (a tied weight listed twice "
                                 "in params is one parameter)")  # fmt: skip
        frozen = [i for i in flat_got if not params[i].requires_grad]
        if frozen:
            raise AssertionError(
                f"{where}: your buckets hold frozen parameter(s) {frozen}: no gradient to reduce"
            )
        if sorted(flat_got) != sorted(flat_want):
            raise AssertionError(f"{where}: your buckets miss parameter(s) "
                                 f"{sorted(set(flat_want) - set(flat_got))}")  # fmt: skip
        reverse = [*range(len(params))][::-1]
        if got == _reference_buckets(params, b, reverse):
            raise AssertionError(f"{where}: your buckets follow the reversed registration order, not "
                                 "ready_order (the order this model's gradients really became ready)")  # fmt: skip
        if got == _reference_buckets(params, b, order[::-1]):
            raise AssertionError(f"{where}: your buckets follow ready_order backwards (ready_order[0] became "
                                 "ready first)")  # fmt: skip
        if flat_got != flat_want:
            raise AssertionError(f"{where}: parameters in a different order than they became ready: yours "
                                 f"{flat_got}, ready: {flat_want}")  # fmt: skip
        late = " (each of yours closes one parameter later than the lesson's rule)" if got == _reference_buckets(
            params, b, order, late=True) else ""  # fmt: skip
        raise AssertionError(f"{where}: the right order, cut differently: buckets of {[len(r) for r in got]} "
                             f"parameters, expected {[len(r) for r in want]}{late}")  # fmt: skip
    passed("check_assign_buckets", f"all {len(cases)} cases")


# ----------------------------------------------------------------------------- 4: bytes received, m-th syncs
def _bytes_model(dtype: torch.dtype) -> nn.Module:
    """A GPT whose parameter sizes are multiples of 5, so buckets split unevenly on 2, 3 and 4 ranks."""
    from parallel_lab.models import GPTConfig, build_model

    return build_model(GPTConfig(vocab=VOCAB, seq_len=SEQ, d_model=5, n_heads=1, n_layers=2), seed=0).to(
        dtype
    )


def _syncs_after(m: int, k: int, every: int) -> bool:
    return (m + 1) % every == 0 or m == k - 1


def _measure_ddp_bytes(ctx, cases: list[dict]) -> list[dict]:
    """Per case, one optimizer step of `accumulation` micro-batches through BucketedDDP (from-scratch ring
    all-reduces), synced after every `sync_every`-th micro-step and after the last, the others under no_sync():
    its buckets and the bytes this rank received."""
    from parallel_lab.data_parallel import BucketedDDP

    out = []
    for case in cases:
        k, every = case["accumulation"], case["sync_every"]
        x, y = (t.to(ctx.device) for t in _batch(k, 7 + ctx.rank))
        ddp = BucketedDDP(_bytes_model(case["dtype"]).to(ctx.device), ctx, bucket_bytes=case["bucket_bytes"],
                          comm="ring", broadcast_params=False)  # fmt: skip
        before = sum(c.get("recv", 0) for c in ctx.recorder.comm.values())
        for m in range(k):
            synced = _syncs_after(m, k, every)
            with contextlib.nullcontext() if synced else ddp.no_sync():
                ddp(x[m : m + 1], y[m : m + 1]).backward()
            if synced:
                ddp.finish_gradient_sync()
        recv = sum(c.get("recv", 0) for c in ctx.recorder.comm.values()) - before
        out.append({"buckets": [b.buffer.numel() for b in ddp.buckets], "itemsize": ddp.buckets[0].buffer.element_size(),
                    "recv": recv})  # fmt: skip
    return out


def _draw_bytes_cases(rnd: random.Random) -> list[dict]:
    """float32 with a count of micro-steps that sync_every does not divide (the last sync is extra), float64,
    then one drawn freely (one bucket or several, every micro-step syncing or only the last)."""
    k = rnd.randint(3, 6)
    every = rnd.choice([m for m in range(2, k) if k % m])
    k2, k3 = rnd.randint(2, 6), rnd.randint(1, 5)
    return [
        {"dtype": torch.float32, "bucket_bytes": rnd.randint(100, 1500), "accumulation": k, "sync_every": every},
        {"dtype": torch.float64, "bucket_bytes": rnd.randint(200, 3000), "accumulation": k2,
         "sync_every": rnd.randint(1, k2 + 1)},
        {"dtype": rnd.choice((torch.float32, torch.float64)), "bucket_bytes": rnd.choice((1 << 30, rnd.randint(100, 3000))),
         "accumulation": k3, "sync_every": rnd.randint(1, k3 + 1)},
    ]  # fmt: skip


def _ring_recv(n: int, p: int, rank: int) -> int:
    """Elements `rank` receives in a ring all-reduce of n elements (the check's own reference)."""
    from parallel_lab.comms import chunk_sizes

    c = chunk_sizes(n, p)
    return 2 * n - c[(rank - 1) % p] - c[rank]


def _ring_sent(n: int, p: int, rank: int) -> int:
    from parallel_lab.comms import chunk_sizes

    c = chunk_sizes(n, p)
    return 2 * n - c[rank] - c[(rank + 1) % p]


def check_ddp_recv_bytes(fn: Callable) -> None:
    """`fn(bucket_numels, p, rank, itemsize, accumulation, sync_every)` -> the bytes `rank` receives over one
    optimizer step of `accumulation` micro-batches of BucketedDDP (every bucket ring all-reduced), synced after
    every `sync_every`-th micro-step and after the last; compared with the byte counter of real runs, exactly."""
    require_callable(fn)
    mine = guarded(fn, BYTES_FORBIDDEN, "this exercise (ddp_recv_bytes)")
    rnd = random.Random(draw_seed())  # dtypes, bucket sizes, accumulation, sync_every: drawn every grade run
    for p in (2, 3, 4):
        drawn = _draw_bytes_cases(rnd)
        run = launch_learner(_measure_ddp_bytes, p, drawn, timeout=60.0, threads=1)
        for r, measured in enumerate(run.values):
            for case, got in zip(drawn, measured):
                k, every, b, size = case["accumulation"], case["sync_every"], got["buckets"], got["itemsize"]
                said = mine(list(b), p, r, size, k, every)
                where = (f"ddp_recv_bytes(bucket_numels={b}, p={p}, rank={r}, itemsize={size}, accumulation={k}, "
                         f"sync_every={every})")  # fmt: skip
                if said == got["recv"]:
                    continue
                syncs = sum(_syncs_after(m, k, every) for m in range(k))
                one = sum(_ring_recv(n, p, r) for n in b) * size
                # every reading of the number that fits (8-byte elements and twice the syncs can look alike)
                hints = []
                if said == sum(_ring_sent(n, p, r) for n in b) * size * syncs:
                    hints.append("that is what the rank sent")
                if said in (
                    2 * (p - 1) * sum(b) * size * syncs / p,
                    2 * (p - 1) * sum(b) * size * syncs // p,
                ):
                    hints.append(
                        "2(p-1)/p is the ranks' average; each bucket's ring cuts it into chunks of its own"
                    )
                if isinstance(said, (int, float)) and size != 8 and said * size == got["recv"] * 8:
                    hints.append("as if every element were 8 bytes")
                if isinstance(said, (int, float)) and one and said % one == 0 and said // one != syncs:
                    hints.append(
                        f"that is {int(said // one)} sync(s)' worth; count the micro-steps that synced"
                    )
                hint = f" ({'; or '.join(hints)})" if hints else ""
                raise AssertionError(
                    f"{where}: you predict {said} bytes, the rank received {got['recv']}{hint}"
                )
    passed("check_ddp_recv_bytes", "every rank received exactly what you predicted, float32 and float64")


# this module's references and helpers too (here, once they are defined: the module is still being imported)
FORBIDDEN.update(family(__name__))
BYTES_FORBIDDEN.update(family(__name__))
