"""Lesson 04's exercises: the reference solution passes; wrappers of the lab's and torch's versions, answer
tables from an earlier grade run and wrong algorithms fail, each with a message naming what differed; torch's
own versions of each exercise's job (found by name in its source) are all switched off."""

from __future__ import annotations

import enum
import importlib
import re
from pathlib import Path

import pytest
from solution_code import _check_cell, edit, fails_saying, run_check, solution_namespace, table_cheat_fails

P = "import torch\nimport torch.distributed as dist\nfrom parallel_lab import comms\n"
CLIP, HOOKS, BYTES = "zero1_clipped_step", "zero3_prefetch_hooks", "zero_state_bytes"
FACTOR = "min(1.0, max_norm / (norm + 1e-6))"
# The clipped step with its norm or factor computed another way: the rest is the reference's.
STEP = (
    P + "def zero1_clipped_step(ctx, flat_param, flat_grad, shard, optimizer, max_norm):\n"
    "    grad = comms.ring_reduce_scatter(ctx, flat_grad) / ctx.world_size\n"
    "{body}"
    "    shard.grad = grad * {factor}\n"
    "    optimizer.step()\n"
    "    flat_param.copy_(comms.ring_all_gather(ctx, shard.detach()).view(-1))\n"
)


def step(body: str, factor: str = FACTOR) -> str:
    return STEP.format(body="".join(f"    {line}\n" for line in body.splitlines()), factor=factor)


GLOBAL = "norm = comms.ring_all_reduce(ctx, grad.double().square().sum().reshape(1)).sqrt().item()"
# Prefetching hooks built from two pieces: how a layer is gathered, and when.
HOOKS_HEAD = (
    P
    + """
def zero3_prefetch_hooks(ctx, layers, shards, shapes):
    p, r = ctx.world_size, ctx.rank
    inflight, kept = {}, []

    def start(i):
        buf = shards[i].new_empty(p, shards[i].numel())
        buf[r].copy_(shards[i])
        peers = [k for k in range(p) if k != r]
        sends, recvs = comms.post_batch(ctx, [(shards[i], k, i) for k in peers], [(buf[k], k, i) for k in peers])
        inflight[i] = (buf, sends + recvs)

    def bind(i):
        buf, handles = inflight.pop(i)
        for h in handles:
            h.wait()
        full, off = buf.view(-1), 0
        for q, shape in zip(layers[i].parameters(), shapes[i]):
            q.data = full[off : off + shape.numel()].view(shape)
            off += shape.numel()

    def after(module, args, output):
        {after}

    def before(i, module, args):
{before}

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: before(i, m, a)))
        handles.append(layer.register_forward_hook(after))
    return handles
"""
)
FREE = "for q in module.parameters():\n            q.data = q.data.new_empty(0)"


def hooks(before: str, after: str = FREE) -> str:
    body = "".join(f"        {line}\n" for line in before.splitlines())
    return HOOKS_HEAD.replace("{before}\n", body).replace("{after}", after)


RIGHT = {
    # the padding is zero: leaving the last rank's padding out of the sum of squares changes nothing
    (CLIP, "the zero padding left out of the norm"): step(
        "S, n = grad.numel(), flat_param.numel()\n"
        "real = grad[: S - (S * ctx.world_size - n)] if ctx.rank == ctx.world_size - 1 else grad\n"
        "norm = comms.ring_all_reduce(ctx, real.double().square().sum().reshape(1)).sqrt().item()"
    ),
    (CLIP, "the norm from every rank's squared norm, gathered"): step(
        "sq = grad.double().square().sum().reshape(1)\n"
        "norm = comms.ring_all_gather(ctx, sq).sum().sqrt().item()"
    ),
    # on 1 rank there is nothing to gather: the shard is the whole layer, and binding views of it allocates nothing
    (HOOKS, "on 1 rank the shard itself, bound without a copy"): hooks(
        "if ctx.world_size == 1:\n"
        "    full, off = shards[i], 0\n"
        "    for q, shape in zip(layers[i].parameters(), shapes[i]):\n"
        "        q.data = full[off : off + shape.numel()].view(shape)\n"
        "        off += shape.numel()\n"
        "    return\n"
        "if i not in inflight:\n    start(i)\nbind(i)\nif i + 1 < len(layers):\n    start(i + 1)"
    ),
}
BLOCKING = (
    P
    + """
def zero3_prefetch_hooks(ctx, layers, shards, shapes):
    ready = {}

    def bind(i):
        full, off = ready.pop(i).view(-1), 0
        for q, shape in zip(layers[i].parameters(), shapes[i]):
            q.data = full[off : off + shape.numel()].view(shape)
            off += shape.numel()

    def before(i, module, args):
        if i not in ready:
            ready[i] = comms.ring_all_gather(ctx, shards[i])
        bind(i)
        if i + 1 < len(layers):
            ready[i + 1] = comms.ring_all_gather(ctx, shards[i + 1])

    def after(module, args, output):
        for q in module.parameters():
            q.data = q.data.new_empty(0)

    return [h for i, layer in enumerate(layers) for h in (
        layer.register_forward_pre_hook(lambda m, a, i=i: before(i, m, a)), layer.register_forward_hook(after))]
"""
)
# The answer through an all-reduce of the whole gradient, each rank keeping Adam for the whole model
# (`honest`: on 1 rank the reference, so that the all-reduce's bytes are what fails on 2-4).
REPLICATED = (
    P
    + """
_whole = {{}}
def zero1_clipped_step(ctx, flat_param, flat_grad, shard, optimizer, max_norm):
    if {honest} and ctx.world_size == 1:
        grad = comms.ring_reduce_scatter(ctx, flat_grad)
        norm = comms.ring_all_reduce(ctx, grad.double().square().sum().reshape(1)).sqrt().item()
        shard.grad = grad * min(1.0, max_norm / (norm + 1e-6))
        optimizer.step()
        shard.grad = None
        return
    avg = comms.ring_all_reduce(ctx, flat_grad.clone()) / ctx.world_size  # (N*S,) on every rank
    comms.ring_all_reduce(ctx, torch.zeros(1, device=avg.device))  # the few numbers the budget expects
    f = min(1.0, max_norm / (avg.norm().item() + 1e-6))
    if not _whole:  # a copy of the weights before the first step, stepped by an Adam of its own
        _whole["p"] = flat_param.detach().clone().requires_grad_()
        _whole["opt"] = torch.optim.Adam([_whole["p"]], lr=0.05)
    shard.grad = avg.view(ctx.world_size, -1)[ctx.rank] * f
    optimizer.step()
    shard.grad = None
    _whole["p"].grad = avg * f
    _whole["opt"].step()
    flat_param.copy_(_whole["p"].detach())
"""
)
WRONG = [
    # ---- exercise 1: ZeRO-1 with gradient clipping
    ("check_zero1_clipped_step", "clips by the local slice's norm",
     step("norm = grad.norm().item()"), "this rank's slice's own norm"),
    ("check_zero1_clipped_step", "clips before averaging (the summed gradient's norm)",
     step("norm = comms.ring_all_reduce(ctx, (grad * ctx.world_size).double().square().sum().reshape(1)).sqrt().item()"),
     "the summed gradient's norm"),
    ("check_zero1_clipped_step", "clips by its own gradient before the reduction",
     step("norm = flat_grad.norm().item()"), "this rank's own gradient before the reduction"),
    ("check_zero1_clipped_step", "adds the slices' norms",
     step("norm = comms.ring_all_reduce(ctx, grad.double().norm().reshape(1)).item()"), "norms do not add"),
    ("check_zero1_clipped_step", "never takes the square root",
     step("norm = comms.ring_all_reduce(ctx, grad.double().square().sum().reshape(1)).item()"),
     "take its square root"),
    ("check_zero1_clipped_step", "scales small gradients up (no clamp at 1)",
     step(GLOBAL, "(max_norm / (norm + 1e-6))"), "must never exceed 1"),
    ("check_zero1_clipped_step", "forgets clip_grad_norm_'s epsilon",
     step(GLOBAL, "min(1.0, max_norm / norm)"), "plus 1e-6"),
    ("check_zero1_clipped_step", "forgets to average",
     edit("04", CLIP, "comms.ring_reduce_scatter(ctx, flat_grad) / ctx.world_size", "comms.ring_reduce_scatter(ctx, flat_grad)"),
     "divide it by the world size"),
    ("check_zero1_clipped_step", "computes the norm on the gathered gradient",
     step("norm = comms.ring_all_gather(ctx, grad).norm().item()"), "send their sums of squares, not the slices"),
    ("check_zero1_clipped_step", "all-reduces the whole gradient for the norm",
     step("norm = (comms.ring_all_reduce(ctx, flat_grad.clone()) / ctx.world_size).norm().item()"),
     "a number or two from each rank"),
    ("check_zero1_clipped_step", "sends the norm around parallel_lab.comms",
     step("sq = grad.double().square().sum().reshape(1)\ndist.all_reduce(sq)\nnorm = sq.sqrt().item()"),
     "send it through parallel_lab.comms"),
    ("check_zero1_clipped_step", "all-reduces the gradient and keeps Adam for the whole model",
     REPLICATED.format(honest=False), "never for the whole model"),
    ("check_zero1_clipped_step", "all-reduces the gradient (Adam for the whole model on 2-4 ranks)",
     REPLICATED.format(honest=True), "leaves the whole averaged gradient on every rank"),
    ("check_zero1_clipped_step", "clips each rank's gradient before the reduce-scatter",
     P + "def zero1_clipped_step(ctx, flat_param, flat_grad, shard, optimizer, max_norm):\n"
     "    g = flat_grad * min(1.0, max_norm / (flat_grad.norm().item() + 1e-6))\n"
     "    shard.grad = comms.ring_reduce_scatter(ctx, g) / ctx.world_size\n"
     "    optimizer.step()\n"
     "    flat_param.copy_(comms.ring_all_gather(ctx, shard.detach()).view(-1))\n",
     "not a multiple of this rank's slice"),
    ("check_zero1_clipped_step", "wraps the lab's ZeRO", P + '''
from parallel_lab.zero import optimizer as zo
def zero1_clipped_step(ctx, flat_param, flat_grad, shard, optimizer, max_norm):
    zo.ZeroOptimizer.step(None)
''', "switched off"),
    ("check_zero1_clipped_step", "torch's clip_grad_norm_ on the slice with the global norm folded in", step(
        GLOBAL + "\nshard.grad = grad\ntorch.nn.utils.clip_grad_norm_([shard], max_norm)", "1"), "switched off"),
    ("check_zero1_clipped_step", "torch's public clip_grads_with_norm_", step(
        GLOBAL + "\nshard.grad = grad\ntorch.nn.utils.clip_grads_with_norm_([shard], max_norm, torch.tensor(norm))",
        "1"), "switched off"),
    ("check_zero1_clipped_step", "torch's private total norm",
     "from torch.nn.utils.clip_grad import _get_total_norm as total\n" + step(
         "norm = float(total([grad])) * 0 + " + GLOBAL.split(" = ", 1)[1]), "switched off"),
    ("check_zero1_clipped_step", "FSDP1's private sharded grad norm",
     "from torch.distributed.fsdp.fully_sharded_data_parallel import _get_grad_norm\n" + step(
         "_get_grad_norm([shard], 2.0, torch.zeros(1), 1.0)\n" + GLOBAL), "switched off"),
    ("check_zero1_clipped_step", "reads the check's own factor",
     "from parallel_lab.grading.checks.zero import _scale\n" + step(GLOBAL, "_scale(max_norm, norm)"),
     "switched off"),
    # ---- exercise 2: ZeRO-3 hooks with prefetch
    ("check_zero3_prefetch_hooks", "no prefetch (the lesson's gather before, free after)",
     hooks("start(i)\nbind(i)"), "the next layer's gather had not started"),
    ("check_zero3_prefetch_hooks", "never frees a layer",
     hooks("if i not in inflight:\n    start(i)\nbind(i)\nif i + 1 < len(layers):\n    start(i + 1)", "pass"),
     "still held its parameters"),
    ("check_zero3_prefetch_hooks", "unbinds a layer but keeps its buffer",
     hooks("if i not in inflight:\n    start(i)\nbind(i)\nif i + 1 < len(layers):\n    start(i + 1)",
           "kept.extend(q.data for q in module.parameters())\n        " + FREE),
     "a layer not freed"),
    ("check_zero3_prefetch_hooks", "prefetches two layers ahead",
     hooks("if i not in inflight:\n    start(i)\nbind(i)\nfor j in (i + 1, i + 2):\n"
           "    if j < len(layers) and j not in inflight:\n        start(j)"),
     "further ahead than the next layer"),
    ("check_zero3_prefetch_hooks", "allocates the next buffer early but posts its messages late", P + '''
def zero3_prefetch_hooks(ctx, layers, shards, shapes):
    p, r = ctx.world_size, ctx.rank
    bufs = {}

    def gather(i):
        buf = bufs.pop(i, None)
        buf = shards[i].new_empty(p, shards[i].numel()) if buf is None else buf
        buf.copy_(comms.ring_all_gather(ctx, shards[i]))
        full, off = buf.view(-1), 0
        for q, shape in zip(layers[i].parameters(), shapes[i]):
            q.data = full[off : off + shape.numel()].view(shape)
            off += shape.numel()

    def before(i, module, args):
        gather(i)
        if i + 1 < len(layers):
            bufs[i + 1] = shards[i + 1].new_empty(p, shards[i + 1].numel())

    def after(module, args, output):
        for q in module.parameters():
            q.data = q.data.new_empty(0)

    return [h for i, layer in enumerate(layers) for h in (
        layer.register_forward_pre_hook(lambda m, a, i=i: before(i, m, a)), layer.register_forward_hook(after))]
''', "had been posted"),
    ("check_zero3_prefetch_hooks", "the next layer gathered one layer ahead with a blocking ring all-gather",
     BLOCKING, "had already been received and waited for"),
    ("check_zero3_prefetch_hooks", "gathers the prefetched layer a second time",
     hooks("if i not in inflight:\n    start(i)\nbind(i)\nstart(i)\nbind(i)\nif i + 1 < len(layers):\n    start(i + 1)"),
     "a layer was gathered twice"),
    ("check_zero3_prefetch_hooks", "binds a layer's values in the wrong order",
     hooks("if i not in inflight:\n    start(i)\nbind(i)\nif i + 1 < len(layers):\n    start(i + 1)\n"
           "for q in layers[i].parameters():\n    q.data = q.data.flip(-1)"),
     "differs from the unsharded model"),
    ("check_zero3_prefetch_hooks", "wraps the lab's ZeRO-3 hook", P + '''
from parallel_lab.zero.stage3 import Zero3
def zero3_prefetch_hooks(ctx, layers, shards, shapes):
    return [layer.register_forward_pre_hook(lambda m, a, i=i: Zero3._unit_pre(None, i, m, a))
            for i, layer in enumerate(layers)]
''', "switched off"),
    ("check_zero3_prefetch_hooks", "the lab's uneven all-gather, started in a hook", hooks(
        "from parallel_lab.zero.comm import all_gather_pieces\n"
        "all_gather_pieces(ctx, shards[i], [], shards[i], 0)\nstart(i)\nbind(i)"), "switched off"),
    ("check_zero3_prefetch_hooks", "the lab's weight streamer", P + '''
from parallel_lab.offload.streaming import WeightStreamer
def zero3_prefetch_hooks(ctx, layers, shards, shapes):
    WeightStreamer._load(None, 0)
''', "switched off"),
    ("check_zero3_prefetch_hooks", "torch's public fully_shard", P + '''
from torch.distributed.fsdp import fully_shard
def zero3_prefetch_hooks(ctx, layers, shards, shapes):
    for layer in layers:
        fully_shard(layer)
''', "switched off"),
    ("check_zero3_prefetch_hooks", "torch's private FSDP2 prefetch", P + '''
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
def zero3_prefetch_hooks(ctx, layers, shards, shapes):
    FSDPParamGroup._prefetch_unshard(None, "forward")
''', "switched off"),
    ("check_zero3_prefetch_hooks", "torch's private FSDP1 unshard", P + '''
from torch.distributed.fsdp._runtime_utils import _unshard
def zero3_prefetch_hooks(ctx, layers, shards, shapes):
    _unshard(None, None, None, None)
''', "switched off"),
    # ---- exercise 3: ZeRO state bytes for SGD, fp32 and mixed
    ("check_zero_state_bytes", "Adam's two states for momentum",
     edit("04", BYTES, '(4 if optimizer == "momentum" else 0)', '(8 if optimizer == "momentum" else 0)'), "too many"),
    ("check_zero_state_bytes", "forgets the master copy",
     edit("04", BYTES, '(4 if precision == "mixed" else 0) + ', ""), "count it"),
    ("check_zero_state_bytes", "counts the master copy as a parameter", edit(
        "04", BYTES, '    if stage == 0:',
        '    if precision == "mixed":\n'
        '        out = zero_state_bytes(numel, world_size, stage, optimizer, "fp32")\n'
        '        return {"param": out["param"] // 2 + out["param"], "grad": out["grad"] // 2, "optim": out["optim"]}\n'
        '    if stage == 0:'), "it is optimizer state"),
    ("check_zero_state_bytes", "no padding", edit("04", BYTES, "full = world_size * S", "full = numel"), "padded"),
    ("check_zero_state_bytes", "stage 2 keeps whole gradients",
     edit("04", BYTES, "S if stage >= 2 else full", "S if stage >= 3 else full"), "grad"),
    ("check_zero_state_bytes", "the lab's formula", "from parallel_lab.costmodel import model_state_bytes\n"
     "def zero_state_bytes(numel, n, stage, optimizer, precision):\n"
     "    return model_state_bytes(numel, n, stage, optimizer, precision)\n", "switched off"),
    ("check_zero_state_bytes", "the lab's padded formula", "from parallel_lab.zero import meta\n"
     "def zero_state_bytes(numel, n, stage, optimizer, precision):\n"
     "    return meta.expected_state_bytes(None, stage, optimizer, precision)\n", "switched off"),
    ("check_zero_state_bytes", "the lab's meta counter", "from parallel_lab.zero.meta import count_state_bytes\n"
     "def zero_state_bytes(numel, n, stage, optimizer, precision):\n"
     "    return count_state_bytes(lambda: None, n, stage)\n", "switched off"),
    ("check_zero_state_bytes", "torch's memory tracker", "from torch.distributed._tools.mem_tracker import MemTracker\n"
     "def zero_state_bytes(numel, n, stage, optimizer, precision):\n"
     "    MemTracker()\n", "switched off"),
    ("check_zero_state_bytes", "reads the check's own diagnosis", "from parallel_lab.grading.checks.zero import _bytes_diagnosis\n"
     "def zero_state_bytes(numel, n, stage, optimizer, precision):\n"
     "    _bytes_diagnosis('param', 0, {}, n)\n", "switched off"),
]  # fmt: skip


@pytest.mark.parametrize(
    "check", ["check_zero1_clipped_step", "check_zero3_prefetch_hooks", "check_zero_state_bytes"]
)
def test_the_solution_passes_with_one_line(check, capsys):
    run_check("04", check)
    out, err = capsys.readouterr()
    lines = [ln for ln in out.splitlines() if ln.startswith("check_")]  # (the solution prints the lab's code)
    assert lines == [lines[0]] and lines[0].startswith(f"{check} passed") and not err, err


@pytest.mark.parametrize(("name", "label"), list(RIGHT), ids=[k[1] for k in RIGHT])
def test_other_right_answers_pass(name, label, capsys):
    check = {CLIP: "check_zero1_clipped_step", HOOKS: "check_zero3_prefetch_hooks"}[name]
    run_check("04", check, RIGHT[name, label])
    assert f"{check} passed" in capsys.readouterr().out


@pytest.mark.parametrize(("check", "label", "source", "want"), WRONG, ids=[w[1] for w in WRONG])
def test_a_wrong_answer_fails_saying_what_differed(check, label, source, want):
    fails_saying("04", check, label, source, want)


def test_an_unfinished_exercise_stays_unfinished():
    from parallel_lab.grading import (
        check_zero1_clipped_step,
        check_zero3_prefetch_hooks,
        check_zero_state_bytes,
    )

    def todo(*args):
        raise NotImplementedError("exercise")

    for check in (check_zero1_clipped_step, check_zero3_prefetch_hooks, check_zero_state_bytes):
        with pytest.raises(NotImplementedError):
            check(todo)


def test_the_drawn_cases_are_the_cases_the_checks_need():
    """Clipping steps of three kinds (clipped, not clipped, a norm of a few epsilons), parameter counts no world
    size from 2 to 4 divides, and layer widths whose slices differ in size on every world size (a message's
    size tells which layer it carries)."""
    import random

    from parallel_lab.grading.checks import zero

    assert set(zero._STEPS) == {"clip", "free", "tiny"}
    for seed in range(20):
        n = zero._draw_numel(random.Random(seed))
        assert all(n % p for p in (2, 3, 4))
        dims = zero._draw_widths(random.Random(seed))
        sizes = [a * b + b for a, b in zip(dims, dims[1:])]
        assert all(len({-(-s // p) for s in sizes}) == len(sizes) for p in zero.WORLD_SIZES)


# ----------------------------------------------------------------------------- cases drawn at grade time
def _run(ns: dict, check: str) -> None:
    exec(compile(_check_cell("04", check), "<check>", "exec"), ns)  # noqa: S102


def test_a_table_of_one_grade_runs_clipped_steps_fails_the_next(tmp_path):
    """The ranks are processes: the table lives in files. A learner who saves each step's result (keyed by the
    case: world size, rank, max_norm) in one run and replays it in the next fails, since max_norm, weights and
    gradients are drawn again."""
    import torch

    from parallel_lab import comms

    ns = solution_namespace("04")
    real = ns[CLIP]

    def logging(ctx, flat_param, flat_grad, shard, optimizer, max_norm):
        real(ctx, flat_param, flat_grad, shard, optimizer, max_norm)
        torch.save(
            (shard.detach().cpu(), flat_param.cpu()),
            tmp_path / f"{ctx.world_size}-{ctx.rank}-{max_norm!r}.pt",
        )

    def from_the_table(ctx, flat_param, flat_grad, shard, optimizer, max_norm):
        path = tmp_path / f"{ctx.world_size}-{ctx.rank}-{max_norm!r}.pt"
        grad = comms.ring_reduce_scatter(ctx, flat_grad) / ctx.world_size
        shard.grad = grad  # unclipped where the table has nothing
        optimizer.step()
        if path.exists():
            mine, whole = torch.load(path)
            shard.data.copy_(mine)
            flat_param.copy_(whole)
        else:
            flat_param.copy_(comms.ring_all_gather(ctx, shard.detach()).view(-1))

    ns[CLIP] = logging
    _run(ns, "check_zero1_clipped_step")
    assert len(list(tmp_path.iterdir())) == 5 * (1 + 2 + 3 + 4)
    ns[CLIP] = from_the_table
    with pytest.raises(AssertionError, match="clip_grad_norm_"):
        _run(ns, "check_zero1_clipped_step")


def test_a_table_of_one_grade_runs_gathered_layers_fails_the_next(tmp_path):
    """A learner who saves every gathered layer (keyed by the layer's slice) in one run and binds the saved
    values in the next, gathering nothing, fails: widths and weights are drawn again."""
    ns = solution_namespace("04")
    real = ns[HOOKS]

    def key(ctx, i, shard):
        return tmp_path / f"{ctx.world_size}-{ctx.rank}-{i}-{hash(shard.cpu().numpy().tobytes())}.pt"

    def logging(ctx, layers, shards, shapes):
        import torch

        handles = real(ctx, layers, shards, shapes)

        def save(i):
            return lambda m, a: torch.save([q.detach().cpu() for q in m.parameters()], key(ctx, i, shards[i]))

        return handles + [layer.register_forward_pre_hook(save(i)) for i, layer in enumerate(layers)]

    def from_the_table(ctx, layers, shards, shapes):
        import torch

        def bind(i):
            def hook(m, a):
                path = key(ctx, i, shards[i])
                saved = torch.load(path) if path.exists() else [torch.zeros(s) for s in shapes[i]]
                for q, v in zip(m.parameters(), saved):
                    q.data = v.to(ctx.device)

            return hook

        def free(m, a, out):
            for q in m.parameters():
                q.data = q.data.new_empty(0)

        return [h for i, layer in enumerate(layers)
                for h in (layer.register_forward_pre_hook(bind(i)), layer.register_forward_hook(free))]  # fmt: skip

    ns[HOOKS] = logging
    _run(ns, "check_zero3_prefetch_hooks")
    assert len(list(tmp_path.iterdir())) == 4 * (1 + 2 + 3 + 4)
    ns[HOOKS] = from_the_table
    with pytest.raises(AssertionError, match="differs from the unsharded model"):
        _run(ns, "check_zero3_prefetch_hooks")


def test_a_table_of_one_grade_runs_state_bytes_fails_the_next():
    # both model sizes are drawn per run: a couple of runs make a miss certain in practice
    zero = dict.fromkeys(("param", "grad", "optim"), 0)
    table_cheat_fails("04", BYTES, "check_zero_state_bytes", zero, match="you predict 0 bytes", tries=3)


# ----------------------------------------------------------------------------- torch's own versions
# Names that say a function or class does an exercise's job: clip by the global gradient norm (1), gather
# ("unshard") a module's sharded parameters or fetch them ahead (2), count the bytes of model states (3).
# What the search finds that does another job stays on, each kind with its reason: torch._inductor (the
# compiler's own scheduling, code generation and buffer bookkeeping), torch._vendor (GPU kernels),
# torch.testing (test helpers), torch.utils._functools (a memoizing cache's prefetch),
# torch._functorch._activation_offloading (a graph pass that offloads activations, not parameters).
JOBS = {
    "CLIP_FORBIDDEN": r"clip_grads?_norm|clip_grads_with|total_norm|grad_norm(?!al)",
    "PREFETCH_FORBIDDEN": r"unshard|Unshard|prefetch|Prefetch",
    "BYTES_FORBIDDEN": r"[Mm]em_?[Tt]rack|[Mm]emory_?[Tt]rack|state_bytes|bytes_per_param",
}
OTHER_JOBS = ("torch._inductor.", "torch._vendor.", "torch.testing.", "torch.utils._functools",
              "torch._functorch._activation_offloading.")  # fmt: skip


def _enclosing(lines: list[str], at: int) -> str | None:
    """The def or class a nested definition at line `at` sits in (None at module level)."""
    depth = len(lines[at]) - len(lines[at].lstrip())
    for line in reversed(lines[:at]):
        m = re.match(r"^([ \t]*)(?:async\s+)?(?:def|class) (\w+)", line)
        if m and len(m.group(1)) < depth:
            return m.group(2)
    return None


def _is_data(module: str, name: str) -> bool:
    """An Enum of settings (FSDP's BackwardPrefetch): no code to run."""
    value = getattr(importlib.import_module(module), name, None)
    return isinstance(value, type) and issubclass(value, enum.Enum)


@pytest.mark.parametrize("job", list(JOBS))
def test_torchs_own_versions_of_an_exercise_are_switched_off(job):
    """torch's functions that do an exercise's job (found by name in torch's source) are all in the check's
    switched-off list: a new torch that adds one fails here, not in a learner's notebook. A definition nested
    in a function counts as off when the function it sits in is."""
    import torch

    from parallel_lab.grading.checks import zero

    off = getattr(zero, job)
    pattern = re.compile(rf"^[ \t]*(?:async\s+)?(?:class|def) (_?\w*(?:{JOBS[job]})\w*)", re.M)
    root = Path(torch.__file__).parent

    def is_off(module: str, name: str) -> bool:
        return any(k.startswith(module + ".") and name in k.split(".") for k in off)

    found, missing = 0, {}
    for f in root.rglob("*.py"):
        text = f.read_text(encoding="utf-8", errors="ignore")
        if not pattern.search(text):
            continue
        module = ".".join(f.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        if module.startswith(OTHER_JOBS):
            continue
        lines = text.splitlines()
        for match in pattern.finditer(text):
            name, at = match.group(1), text.count("\n", 0, match.start())
            found += 1
            outer = _enclosing(lines, at)
            nested = outer is not None and not re.match(r"^[ \t]*class ", lines[at]) and is_off(module, outer)
            if is_off(module, name) or nested or (outer and is_off(module, outer)) or _is_data(module, name):
                continue
            missing.setdefault(module, []).append(name)
    assert found, "the search finds nothing: torch's layout changed"
    assert not missing, f"torch functions doing an exercise's job, not switched off: {missing}"


def test_the_message_log_leaves_torch_distributed_alone():
    """The prefetch check logs messages at parallel_lab.comms' posting point, not by replacing torch.distributed's
    functions: on NCCL the lab posts `dist.P2POp(dist.irecv, ...)`, which accepts torch's own irecv only."""
    import torch
    import torch.distributed as dist

    from parallel_lab.comms import core
    from parallel_lab.grading.checks import zero
    from parallel_lab.runtime.launch import launch

    names = ("isend", "irecv", "batch_isend_irecv", "all_gather", "broadcast")
    real = {n: getattr(dist, n) for n in names}
    real_post = core.post_p2p

    def build(ctx):
        with zero._PostLog():
            assert all(getattr(dist, n) is real[n] for n in names)
            assert core.post_p2p is not real_post  # what is wrapped is the lab's posting point
            return type(dist.P2POp(dist.irecv, torch.zeros(1), 0)).__name__

    assert launch(build, 1, timeout=30.0).values == ["P2POp"]
    assert core.post_p2p is real_post
