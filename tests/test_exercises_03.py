"""Lesson 03's exercises: the reference solution passes with one line; wrappers of the lab's and torch's data
parallelism fail as switched off; answer tables logged in one grade run fail the next (batches, shards,
micro-batch counts, parameter lists, ready orders, bucket sizes, dtypes and sync intervals are drawn every run);
wrong algorithms and cheats (a hook that waits inside backward) fail with a message naming the mistake."""

from __future__ import annotations

import hashlib
import re

import pytest
from solution_code import (
    _check_cell,
    edit,
    fails_saying,
    functions_doing,
    not_switched_off,
    passes_with_one_line,
    run_check,
    solution_namespace,
    table_cheat_fails,
)

CHECKS = ["check_average_gradients", "check_assign_buckets", "check_ddp_grad_hook", "check_ddp_recv_bytes"]
P = "import torch\nimport torch.distributed as dist\nfrom parallel_lab import comms\n"
AVG = "def average_gradients(ctx, model, local_samples):\n"
HOOK = "def ddp_grad_hook(ctx, param, pending, micro_step, micro_batches):\n"
LAST = "    if micro_step < micro_batches[ctx.rank] - 1:\n        return\n    param.grad.div_(sum(micro_batches))\n"
BYTES = "def ddp_recv_bytes(bucket_numels, p, rank, itemsize, accumulation, sync_every):\n"
ONE_RECV = (
    "    one = 0\n    for n in bucket_numels:\n        c = comms.chunk_sizes(n, p)\n"
    "        one += (2 * n - c[(rank - 1) % p] - c[rank]) * itemsize\n"
)
SYNCS = "    syncs = sum((m + 1) % sync_every == 0 or m == accumulation - 1 for m in range(accumulation))\n"
BUCKETS = "def assign_buckets(params, bucket_bytes, ready_order):\n"

WRONG = [
    # ---- exercise 1: average over samples
    ("check_average_gradients", "divides by world_size (the lesson's equal slices)",
     P + AVG + "    for p in model.parameters():\n        if p.grad is not None:\n"
     "            dist.all_reduce(p.grad)\n            p.grad.div_(ctx.world_size)\n",
     "plain average over the ranks"),
    ("check_average_gradients", "sums without weights",
     P + AVG + "    for p in model.parameters():\n        if p.grad is not None:\n            dist.all_reduce(p.grad)\n",
     "plain sum"),
    ("check_average_gradients", "weights without dividing by the total",
     P + AVG + "    for p in model.parameters():\n        if p.grad is not None:\n"
     "            p.grad.mul_(local_samples)\n            dist.all_reduce(p.grad)\n",
     "must add up to 1"),
    ("check_average_gradients", "communicates nothing", P + AVG + "    pass\n", "still this rank's own gradient"),
    ("check_average_gradients", "wraps the lab's AllReduceDP",
     P + "from parallel_lab.data_parallel import AllReduceDP\n" + AVG
     + "    AllReduceDP(model, ctx, broadcast_params=False).finish_gradient_sync()\n", "switched off"),
    ("check_average_gradients", "wraps torch's DDP",
     P + AVG + "    torch.nn.parallel.DistributedDataParallel(model)\n", "switched off"),
    ("check_average_gradients", "torch's private reducer",
     P + AVG + "    ps = [p for p in model.parameters() if p.requires_grad]\n"
     "    dist.Reducer(ps, [list(range(len(ps)))], [1 << 20], dist.group.WORLD)\n", "switched off"),
    ("check_average_gradients", "torch's private reducer, from torch._C",
     P + "from torch._C._distributed_c10d import Reducer\n" + AVG
     + "    ps = [p for p in model.parameters() if p.requires_grad]\n"
     "    Reducer(ps, [list(range(len(ps)))], [1 << 20], dist.group.WORLD)\n", "switched off"),
    ("check_average_gradients", "FSDP's all-reduce hook",
     P + "from torch.distributed.algorithms._comm_hooks.default_hooks import DefaultState, allreduce_hook\n" + AVG
     + "    st = DefaultState(dist.group.WORLD)\n    for p in model.parameters():\n"
     "        if p.grad is not None:\n            allreduce_hook(st, p.grad)\n", "switched off"),
    ("check_average_gradients", "reads the check's own helpers",
     P + "from parallel_lab.grading.checks.data_parallel import _flat_grad\n" + AVG
     + "    _flat_grad(torch.zeros(0), torch.zeros(0))\n", "switched off"),
    # ---- exercise 2: buckets in ready order
    ("check_assign_buckets", "reverse registration order (ignores ready_order)",
     edit("03", "assign_buckets", "for i in ready_order:", "for i in reversed(range(len(params))):"),
     "reversed registration order"),
    ("check_assign_buckets", "ready order reversed",
     edit("03", "assign_buckets", "for i in ready_order:", "for i in ready_order[::-1]:"), "ready_order backwards"),
    ("check_assign_buckets", "a tied weight twice",
     edit("03", "assign_buckets", "if not p.requires_grad or id(p) in seen:", "if not p.requires_grad:"), "twice"),
    ("check_assign_buckets", "frozen included",
     edit("03", "assign_buckets", "if not p.requires_grad or id(p) in seen:", "if id(p) in seen:"), "frozen"),
    ("check_assign_buckets", "closes a bucket one parameter late",
     edit("03", "assign_buckets", "if size >= bucket_bytes:", "if size > bucket_bytes:"), "one parameter later"),
    ("check_assign_buckets", "forgets the last, open bucket",
     edit("03", "assign_buckets", "    if current:\n        buckets.append(current)\n", ""), "miss"),
    ("check_assign_buckets", "wraps the lab's assign_buckets",
     "from parallel_lab.data_parallel.ddp import assign_buckets as ours\n" + BUCKETS
     + "    return ours([params[i] for i in ready_order][::-1], bucket_bytes)\n", "switched off"),
    ("check_assign_buckets", "torch's private bucket assignment",
     "import torch.distributed as dist\n" + BUCKETS
     + "    ps = [params[i] for i in ready_order if params[i].requires_grad]\n"
     "    idx, _ = dist._compute_bucket_assignment_by_size(ps, [bucket_bytes])\n"
     "    return [[ps[i] for i in b] for b in idx]\n", "switched off"),
    ("check_assign_buckets", "reads the check's reference",
     "from parallel_lab.grading.checks.data_parallel import _reference_buckets\n" + BUCKETS
     + "    return [[params[i] for i in b] for b in _reference_buckets(params, bucket_bytes, ready_order)]\n",
     "switched off"),
    # ---- exercise 3: the hook under accumulation, uneven micro-batch counts
    ("check_ddp_grad_hook", "all-reduces every micro-step (right gradient, more bytes)",
     P + HOOK + "    last = micro_step == micro_batches[ctx.rank] - 1\n"
     "    param.grad.div_(sum(micro_batches) if last else 1)\n"
     "    if last:\n        pending.append(dist.all_reduce(param.grad, async_op=True))\n"
     "    else:\n        h = dist.all_reduce(torch.zeros_like(param.grad), async_op=True)\n        pending.append(h)\n",
     "once per optimizer step"),
    ("check_ddp_grad_hook", "divides by world_size times its own count (the lesson's two divisions)",
     edit("03", "ddp_grad_hook", "param.grad.div_(sum(micro_batches))",
          "param.grad.div_(ctx.world_size * micro_batches[ctx.rank])"),
     "differs from the gradient of the mean loss over all"),
    ("check_ddp_grad_hook", "divides by world_size only",
     edit("03", "ddp_grad_hook", "param.grad.div_(sum(micro_batches))", "param.grad.div_(ctx.world_size)"),
     "differs from the gradient of the mean loss over all"),
    ("check_ddp_grad_hook", "divides by the longest rank's count times world_size",
     edit("03", "ddp_grad_hook", "param.grad.div_(sum(micro_batches))",
          "param.grad.div_(ctx.world_size * max(micro_batches))"),
     "differs from the gradient of the mean loss over all"),
    ("check_ddp_grad_hook", "all-reduces on the first micro-step",
     edit("03", "ddp_grad_hook", "if micro_step < micro_batches[ctx.rank] - 1:", "if micro_step > 0:"),
     "micro_step=0, micro_batches="),
    ("check_ddp_grad_hook", "blocking all-reduce, nothing pending",
     edit("03", "ddp_grad_hook", "pending.append(dist.all_reduce(param.grad, async_op=True))",
          "dist.all_reduce(param.grad)"), "waited for its all-reduce"),
    ("check_ddp_grad_hook", "cheat: starts it, waits at once, appends the finished work",
     P + HOOK + LAST + "    w = dist.all_reduce(param.grad, async_op=True)\n    w.wait()\n    pending.append(w)\n",
     "waited for its all-reduce"),
    ("check_ddp_grad_hook", "cheat: blocking all-reduce plus any object with .wait",
     P + "import types\n" + HOOK + LAST
     + "    dist.all_reduce(param.grad)\n    pending.append(types.SimpleNamespace(wait=lambda: None))\n",
     "waited for its all-reduce"),
    ("check_ddp_grad_hook", "cheat: the lab's traced blocking all-reduce plus any object with .wait",
     P + "import types\n" + HOOK + LAST
     + "    comms.dist_all_reduce(ctx, param.grad)\n    pending.append(types.SimpleNamespace(wait=lambda: None))\n",
     "waited for its all-reduce"),
    ("check_ddp_grad_hook", "cheat: waits on the work's future",
     P + HOOK + LAST + "    w = dist.all_reduce(param.grad, async_op=True)\n    w.get_future().wait()\n"
     "    pending.append(w)\n", "waited for its all-reduce"),
    ("check_ddp_grad_hook", "cheat: appends a stand-in instead of the work",
     P + "import types\n" + HOOK + LAST
     + "    w = dist.all_reduce(param.grad, async_op=True)\n    pending.append(types.SimpleNamespace(wait=w.wait))\n",
     "not the work of the all-reduce"),
    ("check_ddp_grad_hook", "wraps the lab's BucketedDDP hook",
     P + "from parallel_lab.data_parallel.ddp import BucketedDDP\n" + HOOK + "    BucketedDDP._on_grad(None, param)\n",
     "switched off"),
    ("check_ddp_grad_hook", "torch's DDP delayed all-reduce hook",
     P + HOOK + "    torch.nn.parallel.DistributedDataParallel._delayed_all_reduce_hook(None, param.grad)\n",
     "switched off"),
    ("check_ddp_grad_hook", "DTensor's data-parallel gradient hook",
     P + "from torch.distributed.tensor.parallel._data_parallel_utils import sync_grad_hook\n" + HOOK
     + "    sync_grad_hook(param.grad)\n", "switched off"),
    # ---- exercise 4: bytes received, syncing every sync_every-th micro-step
    ("check_ddp_recv_bytes", "the bytes sent (the lesson's formula)",
     P + BYTES + "    one = 0\n    for n in bucket_numels:\n        c = comms.chunk_sizes(n, p)\n"
     "        one += (2 * n - c[rank] - c[(rank + 1) % p]) * itemsize\n" + SYNCS + "    return one * syncs\n",
     "what the rank sent"),
    ("check_ddp_recv_bytes", "8 bytes per element whatever the dtype",
     P + BYTES + ONE_RECV.replace("* itemsize", "* 8") + SYNCS + "    return one * syncs\n",
     "as if every element were 8 bytes"),
    ("check_ddp_recv_bytes", "the last micro-step's sync only",
     P + BYTES + ONE_RECV + "    return one\n", "count the micro-steps that synced"),
    ("check_ddp_recv_bytes", "every micro-step syncs",
     P + BYTES + ONE_RECV + "    return one * accumulation\n", "count the micro-steps that synced"),
    ("check_ddp_recv_bytes", "forgets the final sync (accumulation // sync_every)",
     P + BYTES + ONE_RECV + "    return one * (accumulation // sync_every)\n", "the rank received"),
    ("check_ddp_recv_bytes", "the ranks' average",
     P + BYTES + SYNCS + "    return 2 * (p - 1) * sum(bucket_numels) * itemsize / p * syncs\n", "is the ranks' average"),
    ("check_ddp_recv_bytes", "one all-reduce of everything",
     P + BYTES + "    n = sum(bucket_numels)\n    c = comms.chunk_sizes(n, p)\n" + SYNCS
     + "    return (2 * n - c[(rank - 1) % p] - c[rank]) * itemsize * syncs\n", "the rank received"),
    ("check_ddp_recv_bytes", "wraps the lab's ring formula",
     P + BYTES + "    one = sum(comms.ring_bytes_per_rank(n, p, itemsize, 'all_reduce')[rank][1] for n in bucket_numels)\n"
     + SYNCS + "    return one * syncs\n", "switched off"),
    ("check_ddp_recv_bytes", "wraps the cost model",
     P + "from parallel_lab.costmodel import allreduce_bytes_per_rank\n" + BYTES
     + "    return allreduce_bytes_per_rank(sum(bucket_numels) * itemsize, p)\n", "switched off"),
]  # fmt: skip


# Right answers other than the reference, which the checks must pass: through the lab's traced collectives
# (they first all-reduce an int64 fingerprint of each call, which is not a gradient's all-reduce), and the
# weights applied after the sum
RIGHT = [
    ("check_average_gradients", "the lab's traced all-reduce",
     edit("03", "average_gradients", "dist.all_reduce(p.grad)", "comms.dist_all_reduce(ctx, p.grad)")),
    ("check_average_gradients", "weighted sum, then divided by the total",
     P + AVG + "    params = [p for p in model.parameters() if p.grad is not None]\n"
     "    n = torch.tensor([local_samples], dtype=torch.float64, device=ctx.device)\n    dist.all_reduce(n)\n"
     "    for p in params:\n        p.grad.mul_(local_samples)\n        dist.all_reduce(p.grad)\n"
     "        p.grad.div_(n.item())\n"),
    ("check_ddp_grad_hook", "the lab's traced async all-reduce",
     edit("03", "ddp_grad_hook", "pending.append(dist.all_reduce(param.grad, async_op=True))",
          "pending.append(comms.dist_all_reduce(ctx, param.grad, async_op=True))")),
    ("check_ddp_grad_hook", "skips the all-reduce on one rank",
     edit("03", "ddp_grad_hook", "    pending.append(dist.all_reduce(param.grad, async_op=True))",
          "    if ctx.world_size > 1:\n        pending.append(dist.all_reduce(param.grad, async_op=True))")),
]  # fmt: skip


@pytest.mark.parametrize(("check", "label", "source"), RIGHT, ids=[r[1] for r in RIGHT])
def test_other_right_answers_pass(check, label, source, capsys):
    run_check("03", check, source)
    assert f"{check} passed" in capsys.readouterr().out


@pytest.mark.parametrize("check", CHECKS)
def test_the_solution_passes_with_one_line(check, capsys):
    passes_with_one_line("03", check, capsys)


@pytest.mark.parametrize(("check", "label", "source", "want"), WRONG, ids=[w[1] for w in WRONG])
def test_a_wrong_answer_fails_saying_what_differed(check, label, source, want):
    fails_saying("03", check, label, source, want)


# ----------------------------------------------------------------------------- cases drawn at grade time
def _run(ns: dict, check: str) -> None:
    exec(compile(_check_cell("03", check), f"<check cell {check}>", "exec"), ns)  # noqa: S102


def _digest(*tensors) -> str:
    return hashlib.sha1(b"".join(t.detach().cpu().numpy().tobytes() for t in tensors)).hexdigest()


def test_a_table_of_one_grade_runs_averages_fails_the_next(tmp_path):
    """The ranks log each call's gradients before and after (keyed by what a rank sees: its gradients and
    sample count) into files; the next run answers from them. Its batches and shards are new."""
    import torch

    ns = solution_namespace("03")
    real = ns["average_gradients"]

    def key(model, n):
        return _digest(*(p.grad for p in model.parameters() if p.grad is not None), torch.tensor([n]))

    def logging(ctx, model, n):
        k = key(model, n)
        real(ctx, model, n)
        torch.save([p.grad.clone() for p in model.parameters() if p.grad is not None], tmp_path / k)

    ns["average_gradients"] = logging
    _run(ns, "check_average_gradients")
    assert len(list(tmp_path.iterdir())) >= 10

    def from_the_table(ctx, model, n):
        f = tmp_path / key(model, n)
        if f.exists():
            for p, g in zip([p for p in model.parameters() if p.grad is not None], torch.load(f)):
                p.grad.copy_(g)

    ns["average_gradients"] = from_the_table
    with pytest.raises(AssertionError, match=r"average_gradients\(ctx, model, local_samples="):
        _run(ns, "check_average_gradients")


def test_a_table_of_one_grade_runs_hooks_fails_the_next(tmp_path):
    """The hook logs, per call, the gradient it was handed and, once its all-reduce is done (a callback on the
    work's future: the check fails a hook that waits), the averaged one; the table's hook launches an all-reduce
    of zeros per call on the last micro-step, so only the gradients can give it away."""
    import torch
    import torch.distributed as dist

    ns = solution_namespace("03")
    real = ns["ddp_grad_hook"]

    def logging(ctx, param, pending, micro_step, micro_batches):
        k = _digest(param.grad, torch.tensor([micro_step, *micro_batches]))
        before = len(pending)
        real(ctx, param, pending, micro_step, micro_batches)
        if len(pending) > before:
            grad, where = param.grad, tmp_path / k
            pending[-1].get_future().then(lambda _: torch.save(grad.clone(), where))

    ns["ddp_grad_hook"] = logging
    _run(ns, "check_ddp_grad_hook")
    assert len(list(tmp_path.iterdir())) >= 20

    def from_the_table(ctx, param, pending, micro_step, micro_batches):
        if micro_step < micro_batches[ctx.rank] - 1:
            return
        f = tmp_path / _digest(param.grad, torch.tensor([micro_step, *micro_batches]))
        if f.exists():
            param.grad.copy_(torch.load(f))
        pending.append(dist.all_reduce(torch.zeros(1, dtype=param.dtype, device=param.device), async_op=True))

    ns["ddp_grad_hook"] = from_the_table
    with pytest.raises(AssertionError, match=r"ddp_grad_hook\(ctx, param, pending, micro_step="):
        _run(ns, "check_ddp_grad_hook")


def test_a_table_of_one_grade_runs_buckets_fails_the_next():
    """Keyed by all a learner can see (sizes, frozen flags, which entries are one parameter, the bucket size,
    the ready order), answered by position."""
    ns = solution_namespace("03")
    real, table = ns["assign_buckets"], {}

    def key(params, bucket_bytes, ready_order):
        first = {}
        for i, p in enumerate(params):
            first.setdefault(id(p), i)
        return (
            tuple((p.numel(), p.requires_grad, first[id(p)]) for p in params),
            bucket_bytes,
            tuple(ready_order),
        )

    def logging(params, bucket_bytes, ready_order):
        out = real(params, bucket_bytes, ready_order)
        index = {id(p): i for i, p in enumerate(params)}
        table[key(params, bucket_bytes, ready_order)] = [[index[id(p)] for p in b] for b in out]
        return out

    ns["assign_buckets"] = logging
    _run(ns, "check_assign_buckets")
    assert len(table) >= 12

    def from_the_table(params, bucket_bytes, ready_order):
        return [[params[i] for i in b] for b in table.get(key(params, bucket_bytes, ready_order), [])]

    ns["assign_buckets"] = from_the_table
    with pytest.raises(AssertionError, match=r"assign_buckets\(params="):
        _run(ns, "check_assign_buckets")


def test_a_table_of_one_grade_runs_byte_predictions_fails_the_next():
    # dtypes, bucket sizes, micro-batch counts and sync_every are drawn per run; two runs can, rarely, draw a
    # case alike
    table_cheat_fails("03", "ddp_recv_bytes", "check_ddp_recv_bytes", 0, "you predict 0 bytes",
                      key=lambda b, p, rank, itemsize, k, m: (tuple(b), p, rank, itemsize, k, m), tries=4)  # fmt: skip


# ----------------------------------------------------------------------------- torch's own versions
# Names in torch's source of functions and classes that do an exercise's job: data-parallel wrappers,
# gradient all-reduce hooks and reductions, bucket assignment, skipping the sync while accumulating.
JOB = re.compile(
    r"^[ \t]*(?:class|def) (_?\w*(?:DistributedDataParallel|allreduce_hook|all_reduce_hook|sync_grad_hook"
    r"|reduce_grad|bucket_assign|assign_bucket|no_sync)\w*)",
    re.M,
)


def test_torchs_own_versions_of_an_exercise_are_switched_off():
    """torch's functions that do an exercise's job (found by name in torch's source, its tests left out) are all
    in the checks' switched-off list: a new torch that adds one fails here, not in a learner's notebook."""

    from parallel_lab.grading.checks import data_parallel

    off = data_parallel.FORBIDDEN
    found = functions_doing(JOB, skip=("testing",))
    assert "torch.nn.parallel.distributed" in found, "the search finds nothing: torch's layout changed"
    missing = not_switched_off(found, off)
    assert not missing, f"torch functions doing an exercise's job, not switched off: {missing}"
    # and torch's C++ reducer and bucket assignment, which have no Python source to find
    for name in ("Reducer", "_compute_bucket_assignment_by_size"):
        assert f"torch.distributed.{name}" in off and f"torch._C._distributed_c10d.{name}" in off
