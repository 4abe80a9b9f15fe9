"""Lesson 03's exercises: the reference solution passes with one line; wrappers of the lab's and torch's data
parallelism fail as switched off; answer tables logged in one grade run fail the next (batches, shards,
accumulation, parameter lists, ready orders and bucket sizes are drawn every run); wrong algorithms fail with
a message naming the mistake."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
from solution_code import _check_cell, edit, run_check, solution_namespace, table_cheat_fails

CHECKS = ["check_average_gradients", "check_assign_buckets", "check_ddp_grad_hook", "check_ddp_bytes"]
P = "import torch\nimport torch.distributed as dist\nfrom parallel_lab import comms\n"
AVG = "def average_gradients(ctx, model, local_samples):\n"
HOOK = "def ddp_grad_hook(ctx, param, pending, micro_step, accumulation):\n"
BYTES = "def ddp_bytes(bucket_numels, p, rank, itemsize, accumulation, no_sync):\n"
ONE_SYNC = (
    "    one = 0\n    for n in bucket_numels:\n        c = comms.chunk_sizes(n, p)\n"
    "        one += (2 * n - c[rank] - c[(rank + 1) % p]) * itemsize\n"
)
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
    # ---- exercise 3: the hook under accumulation
    ("check_ddp_grad_hook", "all-reduces every micro-step (right gradient, k times the bytes)",
     P + HOOK + "    last = micro_step == accumulation - 1\n"
     "    param.grad.div_(ctx.world_size * (accumulation if last else 1))\n"
     "    if last:\n        pending.append(dist.all_reduce(param.grad, async_op=True))\n"
     "    else:\n        dist.all_reduce(param.grad)\n", "gradients to cross the ranks once"),
    ("check_ddp_grad_hook", "divides by world_size only",
     edit("03", "ddp_grad_hook", "param.grad.div_(ctx.world_size * accumulation)", "param.grad.div_(ctx.world_size)"),
     "= accumulation"),
    ("check_ddp_grad_hook", "all-reduces on the first micro-step",
     edit("03", "ddp_grad_hook", "if micro_step < accumulation - 1:", "if micro_step > 0:"),
     "micro_step=0, accumulation="),
    ("check_ddp_grad_hook", "waits at once (no pending work)",
     edit("03", "ddp_grad_hook", "pending.append(dist.all_reduce(param.grad, async_op=True))",
          "dist.all_reduce(param.grad)"), "appended 0 work(s)"),
    ("check_ddp_grad_hook", "wraps the lab's BucketedDDP hook",
     P + "from parallel_lab.data_parallel.ddp import BucketedDDP\n" + HOOK + "    BucketedDDP._on_grad(None, param)\n",
     "switched off"),
    ("check_ddp_grad_hook", "torch's DDP delayed all-reduce hook",
     P + HOOK + "    torch.nn.parallel.DistributedDataParallel._delayed_all_reduce_hook(None, param.grad)\n",
     "switched off"),
    ("check_ddp_grad_hook", "DTensor's data-parallel gradient hook",
     P + "from torch.distributed.tensor.parallel._data_parallel_utils import sync_grad_hook\n" + HOOK
     + "    sync_grad_hook(param.grad)\n", "switched off"),
    # ---- exercise 4: bytes of a step with accumulation
    ("check_ddp_bytes", "one sync's bytes whatever no_sync",
     P + BYTES + ONE_SYNC + "    return one\n", "how many of the micro-steps synced"),
    ("check_ddp_bytes", "accumulation times even under no_sync",
     P + BYTES + ONE_SYNC + "    return one * accumulation\n", "how many of the micro-steps synced"),
    ("check_ddp_bytes", "the ranks' average",
     P + BYTES + "    return 2 * (p - 1) * sum(bucket_numels) * itemsize / p * (1 if no_sync else accumulation)\n",
     "is the ranks' average"),
    ("check_ddp_bytes", "one all-reduce of everything",
     P + BYTES + "    n = sum(bucket_numels)\n    c = comms.chunk_sizes(n, p)\n"
     "    return (2 * n - c[rank] - c[(rank + 1) % p]) * itemsize * (1 if no_sync else accumulation)\n",
     "the rank sent"),
    ("check_ddp_bytes", "wraps the lab's ring formula",
     P + BYTES + "    one = sum(comms.ring_bytes_per_rank(n, p, itemsize, 'all_reduce')[rank][0] for n in bucket_numels)\n"
     "    return one * (1 if no_sync else accumulation)\n", "switched off"),
    ("check_ddp_bytes", "wraps the cost model",
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
     "    n = torch.tensor([local_samples], dtype=torch.float64)\n    dist.all_reduce(n)\n"
     "    for p in params:\n        p.grad.mul_(local_samples)\n        dist.all_reduce(p.grad)\n"
     "        p.grad.div_(n.item())\n"),
    ("check_ddp_grad_hook", "the lab's traced async all-reduce",
     edit("03", "ddp_grad_hook", "pending.append(dist.all_reduce(param.grad, async_op=True))",
          "pending.append(comms.dist_all_reduce(ctx, param.grad, async_op=True))")),
]  # fmt: skip


@pytest.mark.parametrize(("check", "label", "source"), RIGHT, ids=[r[1] for r in RIGHT])
def test_other_right_answers_pass(check, label, source, capsys):
    run_check("03", check, source)
    assert f"{check} passed" in capsys.readouterr().out


@pytest.mark.parametrize("check", CHECKS)
def test_the_solution_passes_with_one_line(check, capsys):
    run_check("03", check)
    out, err = capsys.readouterr()
    lines = [ln for ln in out.splitlines() if ln.startswith("check_")]
    assert lines == [lines[0]] and lines[0].startswith(f"{check} passed") and not err


@pytest.mark.parametrize(("check", "label", "source", "want"), WRONG, ids=[w[1] for w in WRONG])
def test_a_wrong_answer_fails_saying_what_differed(check, label, source, want):
    with pytest.raises(AssertionError) as info:
        run_check("03", check, source)
    assert want in str(info.value), f"{label}: {info.value}"


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
    """The hook logs, per call, the gradient it was handed and the averaged one (waiting at once); the table's
    hook launches an all-reduce of zeros per call on the last micro-step, so only the gradients can give it away."""
    import torch
    import torch.distributed as dist

    ns = solution_namespace("03")
    real = ns["ddp_grad_hook"]

    def logging(ctx, param, pending, micro_step, accumulation):
        k = _digest(param.grad, torch.tensor([micro_step, accumulation]))
        real(ctx, param, pending, micro_step, accumulation)
        if micro_step == accumulation - 1:
            pending[-1].wait()
            torch.save(param.grad.clone(), tmp_path / k)

    ns["ddp_grad_hook"] = logging
    _run(ns, "check_ddp_grad_hook")
    assert len(list(tmp_path.iterdir())) >= 20

    def from_the_table(ctx, param, pending, micro_step, accumulation):
        if micro_step < accumulation - 1:
            return
        f = tmp_path / _digest(param.grad, torch.tensor([micro_step, accumulation]))
        if f.exists():
            param.grad.copy_(torch.load(f))
        pending.append(dist.all_reduce(torch.zeros(1, dtype=param.dtype), async_op=True))

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
    # bucket sizes, micro-batch counts and no_sync are drawn per run; two runs can, rarely, draw a case alike
    table_cheat_fails("03", "ddp_bytes", "check_ddp_bytes", 0, "you predict 0 bytes",
                      key=lambda b, p, rank, itemsize, k, ns: (tuple(b), p, rank, itemsize, k, ns), tries=4)  # fmt: skip


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
    import torch

    from parallel_lab.grading.checks import data_parallel

    root = Path(torch.__file__).parent
    off = data_parallel.FORBIDDEN
    found: dict[str, list[str]] = {}
    for f in root.rglob("*.py"):
        if "testing" in f.relative_to(root).parts:
            continue
        text = f.read_text(encoding="utf-8", errors="ignore")
        module = ".".join(f.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        for match in JOB.finditer(text):
            found.setdefault(module, []).append(match.group(1))
    assert "torch.nn.parallel.distributed" in found, "the search finds nothing: torch's layout changed"
    missing = {
        m: [n for n in names if not any(k.startswith(m + ".") and n in k.split(".") for k in off)]
        for m, names in found.items()
    }
    missing = {m: names for m, names in missing.items() if names}
    assert not missing, f"torch functions doing an exercise's job, not switched off: {missing}"
    # and torch's C++ reducer and bucket assignment, which have no Python source to find
    for name in ("Reducer", "_compute_bucket_assignment_by_size"):
        assert f"torch.distributed.{name}" in off and f"torch._C._distributed_c10d.{name}" in off
