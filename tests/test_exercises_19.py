"""Lesson 19's exercises: the reference solution passes; wrappers of the lab's and torch's functions, answer
tables from an earlier grade run and wrong algorithms fail, each with a message naming what differed; the
check's slip timeline is the simulator's."""

from __future__ import annotations

import re

import pytest
from solution_code import (
    edit,
    fails_saying,
    functions_doing,
    not_switched_off,
    package_sources,
    passes_with_one_line,
    run_check,
    table_cheat_fails,
)

from parallel_lab.grading.checks import zero_bubble as checks

CHECKS = ["check_split_backward", "check_zb_h1_bubble_rate"]

# ----------------------------------------------------------------------------- exercise 1: B and W by hand
SIG_B = "import torch\ndef backward_b(x, h, w1, b1, w2, b2, grad_y):\n"
SIG_W = "def backward_w(keep):\n"
RIGHT_B = "    grad_h = (grad_y @ w2) * (h > 0)\n    grad_x = grad_h @ w1\n"
FLAT = (
    "    x, a = x.reshape(-1, x.shape[-1]), a.reshape(-1, a.shape[-1])\n"
    "    grad_h, grad_y = grad_h.reshape(-1, grad_h.shape[-1]), grad_y.reshape(-1, grad_y.shape[-1])\n"
)
KEEP_W = SIG_W + "    x, a, grad_h, grad_y = keep\n"
ALL_IN_B = (
    SIG_B + RIGHT_B + "    xx, aa = x.reshape(-1, x.shape[-1]), torch.relu(h).reshape(-1, h.shape[-1])\n"
    "    gh, gy = grad_h.reshape(-1, h.shape[-1]), grad_y.reshape(-1, grad_y.shape[-1])\n"
    "    return grad_x, (gh.T @ xx, gh.sum(0), gy.T @ aa, gy.sum(0))\n" + SIG_W + "    return keep\n"
)
W_THROUGH_W2 = (
    SIG_B + RIGHT_B + "    return grad_x, (x, h, w2, grad_y)\n" + SIG_W + "    x, h, w2, grad_y = keep\n"
    "    grad_h, a = (grad_y @ w2) * (h > 0), torch.relu(h)\n" + FLAT
    + "    return grad_h.T @ x, grad_h.sum(0), grad_y.T @ a, grad_y.sum(0)\n"
)  # fmt: skip
BROADCAST_IN_B = (
    SIG_B + RIGHT_B + "    gh, xx = grad_h.reshape(-1, h.shape[-1]), x.reshape(-1, x.shape[-1])\n"
    "    gw1 = (gh[:, :, None] * xx[:, None, :]).sum(0)  # an outer product per token, summed\n"
    "    return grad_x, (gw1, x, h, grad_h, grad_y)\n"
    + SIG_W + "    gw1, x, h, grad_h, grad_y = keep\n    a = torch.relu(h)\n" + FLAT
    + "    return gw1, grad_h.sum(0), grad_y.T @ a, grad_y.sum(0)\n"
)  # fmt: skip
WRAP_AUTOGRAD = (
    SIG_B + "    leaves = [t.clone().requires_grad_() for t in (x, w1, b1, w2, b2)]\n"
    "    xr, w1r, b1r, w2r, b2r = leaves\n    y = torch.relu(xr @ w1r.T + b1r) @ w2r.T + b2r\n"
    "    g = torch.autograd.grad(y, leaves, grad_y)\n    return g[0], g[1:]\n" + SIG_W + "    return keep\n"
)
WRAP_VJP = (
    SIG_B + "    from torch.func import vjp\n"
    "    _, pull = vjp(lambda x: torch.relu(x @ w1.T + b1) @ w2.T + b2, x)\n"
    "    return pull(grad_y)[0], None\n" + SIG_W + "    return keep\n"
)
WRAP_TORCH_SPLIT = (
    "import torch\nfrom torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight\n"
    + SIG_B[len("import torch\n") :]
    + "    grads, groups = stage_backward_input([], [grad_y], [x], iter([w1, b1, w2, b2]))\n"
    "    return grads[0], groups\n" + SIG_W + "    return stage_backward_weight(iter([]), keep)\n"
)
WRAP_LAB_SPLIT = (
    "import torch\nfrom parallel_lab.pipeline.executor import SplitBackward\n"
    + SIG_B[len("import torch\n") :]
    + "    split = SplitBackward(torch.relu(h) @ w2.T + b2, grad_y, x)\n"
    "    return split.input_grad(), split\n" + SIG_W + "    keep.weight_grads()\n    return keep\n"
)
WRAP_CONV_GRAD = (
    SIG_B + "    grad_h = (grad_y @ w2) * (h > 0)\n"
    "    g = torch.nn.grad.conv1d_input(x.T[None].shape, w1[:, :, None], grad_h.T[None])\n"
    "    return g[0].T, None\n" + SIG_W + "    return keep\n"
)
WRAP_NUMPY = (
    SIG_B + "    grad_h = (grad_y @ w2) * (h > 0)\n"
    "    return torch.from_numpy(grad_h.numpy() @ w1.numpy()), (x, torch.relu(h), grad_h, grad_y)\n"
)
WRAP_BACKWARD_KERNEL = (
    SIG_B + "    grad_h = torch.ops.aten.threshold_backward(grad_y @ w2, h, 0.0)\n"
    "    return grad_h @ w1, (x, torch.relu(h), grad_h, grad_y)\n"
)
WRAP_CHECK = (
    "from parallel_lab.grading.checks.zero_bubble import _by_hand_w\n"
    + KEEP_W
    + "    return _by_hand_w(grad_h, x, a, grad_y)\n"
)

WRONG_SPLIT = [
    ("B also computes the weight gradients", ALL_IN_B, "Your B also computed the gradient of w1"),
    ("W recomputes through w2", W_THROUGH_W2, "Your W recomputed the gradient at a = relu(h), through w2"),
    ("B recomputes the forward's h",
     edit("19", "backward_b", "grad_h = (grad_y @ w2) * (h > 0)", "h = x @ w1.T + b1\n    grad_h = (grad_y @ w2) * (h > 0)"),
     "Your B recomputed the forward's h"),
    ("the ReLU mask forgotten", edit("19", "backward_b", "grad_h = (grad_y @ w2) * (h > 0)", "grad_h = grad_y @ w2"),
     "the ReLU's mask is missing"),
    ("the ReLU mask inverted", edit("19", "backward_b", "(h > 0)", "(h <= 0)"), "the ReLU's mask is inverted"),
    ("grad_x with a transposed weight", edit("19", "backward_b", "grad_x = grad_h @ w1", "grad_x = grad_h @ w1.T"),
     "your function raised RuntimeError"),
    ("bias gradients summed over one axis only",
     KEEP_W + "    gb1, gb2 = grad_h.sum(0), grad_y.sum(0)\n" + FLAT
     + "    return grad_h.T @ x, gb1, grad_y.T @ a, gb2\n", "summed over the batch axis only"),
    ("bias gradients averaged", edit("19", "backward_w", "grad_h.sum(0), grad_y.T @ a", "grad_h.mean(0), grad_y.T @ a"),
     "grad_b1 differs from autograd's by up to"),
    ("weight gradients of a 3-D input not flattened",
     KEEP_W + "    return grad_h.transpose(-1, -2) @ x, grad_h.reshape(-1, grad_h.shape[-1]).sum(0), "
     "grad_y.transpose(-1, -2) @ a, grad_y.reshape(-1, grad_y.shape[-1]).sum(0)\n",
     "grad_w1 has shape (2, 5, 4), expected (5, 4): summed over the sequence axis only"),
    ("weight gradients of a 3-D input from the first position",
     KEEP_W + "    if x.dim() == 3:\n        x, a, grad_h, grad_y = x[:, 0], a[:, 0], grad_h[:, 0], grad_y[:, 0]\n" + FLAT
     + "    return grad_h.T @ x, grad_h.sum(0), grad_y.T @ a, grad_y.sum(0)\n", "from the first sequence position only"),
    ("a transposed weight gradient", edit("19", "backward_w", "return grad_h.T @ x,", "return x.T @ grad_h,"),
     "grad_w1 has shape (5, 7), expected (7, 5): transposed"),
    ("relu(h) replaced by h in W",
     edit("19", "backward_b", "(x, torch.relu(h), grad_h, grad_y)", "(x, h, grad_h, grad_y)"),
     "it uses h where the forward used relu(h)"),
    ("a broadcast product in place of a matrix product", BROADCAST_IN_B, "a product broadcast over three axes"),
    ("wraps torch.autograd.grad", WRAP_AUTOGRAD, "switched off"),
    ("wraps torch.func.vjp", WRAP_VJP, "switched off"),
    ("wraps torch's stage_backward_input", WRAP_TORCH_SPLIT, "switched off"),
    ("wraps the lab's SplitBackward", WRAP_LAB_SPLIT, "switched off"),
    ("wraps torch.nn.grad", WRAP_CONV_GRAD, "switched off"),
    ("computes in numpy, out of the count's sight", WRAP_NUMPY, "switched off"),
    ("calls torch's backward kernel", WRAP_BACKWARD_KERNEL, "torch's backward kernels are switched off"),
    ("reads the check's own reference", WRAP_CHECK, "switched off"),
]  # fmt: skip

# ----------------------------------------------------------------------------- exercise 2: ZB-H1's rate
SIG_R = "def zb_h1_bubble_rate(p, m, t_f, t_b, t_w, t_comm):\n"
CLOSED = "    b = (p - 1) * (t_f + t_b - t_w)\n    return b / (m * (t_f + t_b + t_w) + b)\n"
LONGEST = "longest = max(free[s] - first[s] for s in range(p))"
WAIT = "ready = max(ready, end[src] + t_comm)"
WRONG_RATE = [
    ("the lesson's closed form everywhere", SIG_R + CLOSED, "this case has t_w > t_f."),
    ("the closed form where messages take time",
     "_right = zb_h1_bubble_rate\n" + SIG_R + "    if t_comm == 0:\n        return _right(p, m, t_f, t_b, t_w, t_comm)\n"
     + CLOSED, "this case has t_comm > 0."),
    ("the closed form where m < p",
     "_right = zb_h1_bubble_rate\n" + SIG_R + "    if m >= p:\n        return _right(p, m, t_f, t_b, t_w, t_comm)\n"
     + CLOSED, "this case has microbatches < stages."),
    ("the idle share of the step (cost as the makespan)", edit("19", "zb_h1_bubble_rate", LONGEST, "longest = max(free)"),
     "t_w=3.0, t_comm=0.5) returned 0.1724137931034483"),
    ("1F1B's bubble, B and W as one",
     edit("19", "zb_h1_bubble_rate", 'cost = {"F": t_f, "B": t_b, "W": t_w}', 'cost = {"F": t_f, "B": t_b + t_w, "W": 0.0}')
     .replace("if b >= s:", "if True:"), "That is 1F1B's bubble rate"),
    ("each W right after its B", edit("19", "zb_h1_bubble_rate", "if b >= s:", "if True:"),
     "each W right after its own B"),
    ("latency on the activations only",
     edit("19", "zb_h1_bubble_rate", WAIT, 'ready = max(ready, end[src] + (t_comm if kind == "F" else 0.0))'),
     "charged in one direction only"),
    ("latency on the gradients only",
     edit("19", "zb_h1_bubble_rate", WAIT, 'ready = max(ready, end[src] + (t_comm if kind == "B" else 0.0))'),
     "charged in one direction only"),
    ("latency added once per link",
     "_right = zb_h1_bubble_rate\n" + SIG_R + "    if t_comm == 0:\n        return _right(p, m, t_f, t_b, t_w, t_comm)\n"
     "    b = (p - 1) * (t_f + t_b - t_w) + (p - 1) * t_comm\n    return b / (m * (t_f + t_b + t_w) + b)\n",
     "charged once per link"),
    ("wraps the lab's simulator",
     "from parallel_lab.pipeline import schedule_zb_h1, simulate\n" + SIG_R
     + "    return simulate(schedule_zb_h1(p, m), t_f, t_b, t_comm, t_w=t_w).bubble_rate\n", "switched off"),
    ("wraps the lab's ZB-H1 order",
     "from parallel_lab.pipeline import order_zb_h1\n" + SIG_R + "    order_zb_h1(0, p, m)\n    return 0.0\n",
     "switched off"),
    ("wraps the lab's bubble formula",
     "from parallel_lab.costmodel import pipeline_bubble_fraction\n" + SIG_R + "    return pipeline_bubble_fraction(p, m)\n",
     "switched off"),
    ("reads the check's own reference",
     "from parallel_lab.grading.checks.zero_bubble import _zb_h1_rate\n" + SIG_R
     + "    return _zb_h1_rate(p, m, t_f, t_b, t_w, t_comm)\n", "switched off"),
    ("reads the check's own timeline",
     "from parallel_lab.grading.checks.zero_bubble import _timeline\n" + SIG_R
     + "    return _timeline([], {}, t_comm, t_comm)\n", "switched off"),
    ("torch's zero-bubble rank ops",
     "from torch.distributed.pipelining.schedules import _get_1f1b_rank_ops\n" + SIG_R
     + "    _get_1f1b_rank_ops(1, p, p - 1, m, 0, 0, lambda s: s, lambda s: s, enable_zero_bubble=True)\n    return 0.0\n",
     "switched off"),
    ("torch's schedule visualizer",
     "from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops\n" + SIG_R
     + "    get_schedule_ops('ZBVZeroBubble', p, m)\n    return 0.0\n", "switched off"),
]  # fmt: skip

WRONG = [("check_split_backward", *w) for w in WRONG_SPLIT] + [
    ("check_zb_h1_bubble_rate", *w) for w in WRONG_RATE
]


@pytest.mark.parametrize("check", CHECKS)
def test_the_solution_passes_with_one_line(check, capsys):
    passes_with_one_line("19", check, capsys)


@pytest.mark.parametrize(("check", "label", "source", "want"), WRONG, ids=[w[1] for w in WRONG])
def test_a_wrong_answer_fails_saying_what_differed(check, label, source, want):
    message = fails_saying("19", check, label, source, want)
    if "closed form" in label:  # the message names the broken condition, never the answer's value
        assert "the simulator measures" in message and message.count("this case has") == 1


def test_a_failure_names_the_call():
    message = fails_saying("19", *WRONG[3])
    assert message.startswith(
        "backward_b(x=<(6, 5) float64>, h=<(6, 7) float64>, w1=<(7, 5) float64>, b1=<(7,) float64>, "
        "w2=<(3, 7) float64>, b2=<(3,) float64>, grad_y=<(6, 3) float64>): grad_x differs"
    ), message
    message = fails_saying("19", "check_zb_h1_bubble_rate", *WRONG_RATE[0])
    assert message.startswith(
        "zb_h1_bubble_rate(stages=4, microbatches=8, t_f=1.0, t_b=1.0, t_w=2.0, t_comm=0.0) returned"
    ), message


def test_an_unfinished_exercise_stays_not_implemented():
    with pytest.raises(NotImplementedError, match="todo"):
        run_check("19", "check_split_backward", SIG_B + "    raise NotImplementedError('todo')\n")
    with pytest.raises(NotImplementedError, match="todo"):
        run_check("19", "check_split_backward", SIG_W + "    raise NotImplementedError('todo')\n")
    with pytest.raises(NotImplementedError, match="todo"):
        run_check("19", "check_zb_h1_bubble_rate", SIG_R + "    raise NotImplementedError('todo')\n")


def test_malformed_answers_are_named():
    with pytest.raises(AssertionError, match=r"return the pair \(grad_x, keep\)"):
        run_check("19", "check_split_backward", SIG_B + "    return (grad_y @ w2) * (h > 0) @ w1\n")
    with pytest.raises(AssertionError, match="return the four gradients"):
        run_check("19", "check_split_backward", SIG_W + "    return keep[0]\n")
    with pytest.raises(AssertionError, match="expected float64"):
        run_check(
            "19",
            "check_split_backward",
            edit("19", "backward_b", "grad_x = grad_h @ w1", "grad_x = (grad_h @ w1).float()"),
        )
    with pytest.raises(AssertionError, match="must return a number, got str"):
        run_check("19", "check_zb_h1_bubble_rate", SIG_R + "    return '0.1'\n")


# ----------------------------------------------------------------------------- cases drawn at grade time
def _tensor_key(x, *args):
    # runs inside the check, where numpy and tolist are switched off: x's shape and sum name a stage
    return tuple(x.shape), x.sum().item()


def test_a_table_of_one_grade_runs_answers_fails_the_next():
    """A learner who logs one grade run's inputs and answers and replays them fails the next run: the shapes
    and values (of the fixed stages too) and the timings are drawn again."""
    import torch

    table_cheat_fails(
        "19", "backward_b", "check_split_backward", (torch.zeros(1, dtype=torch.float64), None), "backward_b(",
        key=_tensor_key,
    )  # fmt: skip
    table_cheat_fails("19", "zb_h1_bubble_rate", "check_zb_h1_bubble_rate", 0.0, "returned 0.0")


# ----------------------------------------------------------------------------- the check's references
def test_the_slip_timeline_is_the_simulators():
    """`_timeline` with the same latency both ways gives the simulator's bubble rate (it names the one-way slips)."""
    import random

    from parallel_lab.pipeline import order_zb_h1

    rnd = random.Random(0)
    for _ in range(60):
        p, m = rnd.randint(1, 9), rnd.randint(1, 20)
        t_f, t_b, t_w, c = (round(rnd.uniform(0.1, 3), 3) for _ in range(4))
        spans = checks._timeline(
            [order_zb_h1(s, p, m) for s in range(p)], {"F": t_f, "B": t_b, "W": t_w}, c, c
        )
        assert checks._rate(spans, m * (t_f + t_b + t_w)) == pytest.approx(
            checks._zb_h1_rate(p, m, t_f, t_b, t_w, c), abs=1e-12
        )


def test_the_closed_form_holds_exactly_where_the_exercise_says():
    """(p-1)(T_F + T_B - T_W) is ZB-H1's bubble with free messages, T_W <= T_F and m >= p; each fixed case
    where the exercise says it breaks, it does."""
    for p in range(1, 7):
        for m in range(p, 3 * p + 2):
            for t_f, t_b, t_w in ((1.0, 1.0, 1.0), (1.0, 2.0, 0.5), (1.5, 0.7, 1.5), (2.0, 1.0, 0.25)):
                bubble = (p - 1) * (t_f + t_b - t_w)
                want = bubble / (m * (t_f + t_b + t_w) + bubble)
                assert checks._zb_h1_rate(p, m, t_f, t_b, t_w, 0.0) == pytest.approx(want, abs=1e-12)
    for p, m, t_f, t_b, t_w, c in checks._FIXED_RATE:
        bubble = (p - 1) * (t_f + t_b - t_w)
        closed = bubble / (m * (t_f + t_b + t_w) + bubble) if p > 1 else 0.0
        broken = t_w > t_f or c > 0 or m < p
        assert (abs(closed - checks._zb_h1_rate(p, m, t_f, t_b, t_w, c)) > 1e-9) == (broken and p > 1)


def test_drawn_stages_keep_their_sizes_apart():
    """Every drawn stage has d_in, d_h, d_out and its token counts all different, so a product's sizes say
    which product it is; the ReLU-dead fixed stage passes nothing."""
    for seed in range(20):
        cases = checks._cases(seed)
        assert all(c.distinct for c in cases[5:])
        assert {len(c.lead) for c in cases[5:]} == {1, 2}
        assert not (cases[3].h > 0).any()


# ----------------------------------------------------------------------------- torch's own versions
#: found by the search below but doing another job: they compute no gradient a learner could use
NOT_THE_JOB = {
    "torch._custom_op.autograd": "validates and flattens what a custom op's backward returns",
    "torch._dynamo.variables.tensor": "the compiler tracing a call to .backward",
    "torch._meta_registrations": "shapes only: meta kernels allocate empty outputs",
    "torch.nn.utils.memory_format": "changes a convolution weight's memory layout",
}
SPLIT_JOB = (
    r"(_?\w*(?:backward_input|backward_weight|input_grad|weight_grad|grad_input|grad_weight|stage_backward|"
    r"split_backward|conv[123]d_(?:input|weight)|PerSampleGrad|per_sample_grad|linear_backward|matmul_backward|"
    r"threshold_backward|mm_backward)\w*)"
)
ORDER_JOB = (
    r"(\w*(?:1f1b|gpipe|pipeline_order|schedule_ops|simulate_comms|LoopedBFS|ZeroBubble|ZBV|DualPipe|"
    r"PipelineSchedule|warmup_ops|bfs_ops)\w*)"
)


def test_torchs_own_versions_of_an_exercise_are_switched_off():
    """torch's functions that split a backward or give a layer's input or weight gradient outside autograd, and
    those that build or simulate pipeline orders (found by name in torch's source), are in the checks'
    switched-off lists: top-level ones by name, nested ones and methods by their module. A new torch that adds
    one fails here, not in a learner's notebook."""
    for job, off, where in (
        (SPLIT_JOB, checks.split_switched_off(), "torch.distributed.pipelining._backward"),
        (ORDER_JOB, checks.rate_switched_off(), "torch.distributed.pipelining.schedules"),
    ):
        top = functions_doing(re.compile(rf"^(?:class|def) {job}", re.M | re.I))
        anywhere = functions_doing(re.compile(rf"^[ \t]*(?:class|def) {job}", re.M | re.I))
        if job is ORDER_JOB:  # orders: only torch.distributed's pipelining builds them
            top = {m: n for m, n in top.items() if m.startswith("torch.distributed.")}
            anywhere = {m: n for m, n in anywhere.items() if m.startswith("torch.distributed.")}
        assert where in anywhere, "the search finds nothing: torch's layout changed"
        top = {m: n for m, n in top.items() if m not in NOT_THE_JOB}
        missing = not_switched_off(top, off)
        assert not missing, f"torch functions doing an exercise's job, not switched off: {missing}"
        covered = {m for m in anywhere if any(k.startswith(m + ".") for k in off)}
        bare = sorted(set(anywhere) - covered - set(NOT_THE_JOB))
        assert not bare, f"torch modules doing an exercise's job, none of it switched off: {bare}"
    assert package_sources()  # the search read torch's source (shared with other lessons' tests)


# ----------------------------------------------------------------------------- exercise 3: predict, then measure
IDLE = "check_predicted_idle_share"
SIG_I = "def predicted_idle_share(schedule, stages, microbatches, t_f, t_b, t_w):\n"
WRAP_I = "_right = predicted_idle_share\n" + SIG_I  # a slip in some cases, the right answer elsewhere
RIGHT_ELSE = "    return _right(schedule, stages, microbatches, t_f, t_b, t_w)\n"
CLOSED_I = (
    "    k = {'1f1b': t_f + t_b + t_w, 'zb-h1': t_f + t_b - t_w, 'zb-h2': t_f + t_b - t_w}[schedule]\n"
    "    b = (stages - 1) * k  # the lesson's sizes, ZB-H2 as ZB-H1 under a flush\n"
    "    return b / ((t_f + t_b + t_w) * microbatches + b)\n"
)


def _spans(last: str) -> str:
    """The solution, each stage's first compute kept, ending in `last` (a return using p, m, free, first)."""
    src = edit(
        "19",
        "predicted_idle_share",
        "nxt, free = [0] * p, [0] * p",
        "nxt, free, first = [0] * p, [0] * p, [0] * p",
    )
    src = src.replace(
        "nxt[s] += 1", "first[s] = start if nxt[s] == 0 else first[s]\n                nxt[s] += 1", 1
    )
    return src.replace("return 1 - m * (t_f + t_b + t_w) / span", last, 1)


WRONG_IDLE = [
    ("the paper's rate instead of the idle share",
     _spans("return 1 - m * (t_f + t_b + t_w) / max(free[s] - first[s] for s in range(p))"), "That is the paper's bubble rate"),
    ("the lesson's closed forms everywhere", SIG_I + CLOSED_I,
     "hold for ZB-H1 only with microbatches >= stages; this case has 1 micro-batch on 4 stages"),
    ("the closed form for ZB-H2 with p <= m < 2p - 1",
     WRAP_I + "    if schedule == 'zb-h2' and microbatches >= stages:\n" + CLOSED_I.replace("    ", "        ")
     + RIGHT_ELSE, "hold for ZB-H2 only with microbatches >= 2·stages − 1; this case has 5 micro-batches"),
    ("the flush ignored: each stage charged for its own span",
     _spans("return 1 - p * m * (t_f + t_b + t_w) / sum(free[s] - first[s] for s in range(p))"),
     "That charges each stage only for its own span"),
    ("the flush ignored: each stage's own idle share, averaged",
     _spans("return sum(1 - m * (t_f + t_b + t_w) / (free[s] - first[s]) for s in range(p)) / p"),
     "That charges each stage only for its own span"),
    ("1F1B's unsplit backward counted as 1 in the timeline",
     edit("19", "predicted_idle_share", '"B": t_b if split else t_b + t_w', '"B": t_b'),
     "1F1B's backward is not split"),
    ("1F1B's unsplit backward counted as 1 in the busy time",
     edit("19", "predicted_idle_share", "return 1 - m * (t_f + t_b + t_w) / span",
          "return 1 - m * (t_f + t_b + (t_w if split else 0)) / span"),
     "1F1B's backward is not split"),
    ("a percentage", WRAP_I + "    return 100 * _right(schedule, stages, microbatches, t_f, t_b, t_w)\n",
     "A share lies between 0 and 1"),
    ("ZB-H2 taken as zero", WRAP_I + "    if schedule == 'zb-h2':\n        return 0.0\n" + RIGHT_ELSE,
     "That takes ZB-H2 as zero"),
    ("wraps the lab's simulator",
     "from parallel_lab.pipeline import make_schedule, simulate\n" + SIG_I
     + "    return simulate(make_schedule(schedule, stages, microbatches), t_f, t_b, t_w=t_w).bubble_fraction\n",
     "switched off"),
    ("wraps the lab's ZB-H2 order",
     "from parallel_lab.pipeline import order_zb_h2\n" + SIG_I + "    order_zb_h2(0, stages, microbatches)\n    return 0.0\n",
     "switched off"),
    ("wraps measured_bubble",
     "from parallel_lab.pipeline.viz import measured_bubble\n" + SIG_I + "    return measured_bubble(None)\n",
     "switched off"),
    ("wraps measured_times",
     "from parallel_lab.pipeline.viz import measured_times\n" + SIG_I + "    return measured_times(None)['t_f']\n",
     "switched off"),
    ("wraps the lab's bubble formula",
     "from parallel_lab.costmodel import pipeline_bubble_fraction\n" + SIG_I
     + "    return pipeline_bubble_fraction(stages, microbatches)\n", "switched off"),
    ("wraps the planner's zero-bubble size",
     "from parallel_lab.costmodel.planner import zero_bubble_size\n" + SIG_I
     + "    return zero_bubble_size(schedule, stages, microbatches, t_f, t_b, t_w)[0]\n", "switched off"),
    ("reads the check's own reference",
     "from parallel_lab.grading.checks.zero_bubble import _idle_share\n" + SIG_I
     + "    return _idle_share(schedule, stages, microbatches, t_f, t_b, t_w)\n", "switched off"),
    ("runs the check's own measurement",
     "from parallel_lab.grading.checks.zero_bubble import _measure_live\n" + SIG_I
     + "    return _measure_live(schedule, stages, microbatches)\n", "switched off"),
    ("torch's zero-bubble rank ops",
     "from torch.distributed.pipelining.schedules import _get_1f1b_rank_ops\n" + SIG_I
     + "    _get_1f1b_rank_ops(1, stages, stages - 1, microbatches, 0, 0, lambda s: s, lambda s: s, "
     "enable_zero_bubble=True)\n    return 0.0\n", "switched off"),
    ("torch's schedule visualizer",
     "from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops\n" + SIG_I
     + "    get_schedule_ops('ZBVZeroBubble', stages, microbatches)\n    return 0.0\n", "switched off"),
]  # fmt: skip


_RUN = {"calls": [], "offset": 0.015}


def _fake_measure(schedule, stages, microbatches):
    # a plain function (no closure), so the check switches it off as it does the real one
    _RUN["calls"].append((schedule, stages, microbatches))
    return checks._idle_share(schedule, stages, microbatches, 1.0, 1.0, 1.0) + _RUN["offset"]


@pytest.fixture
def fake_run(monkeypatch):
    """The live run replaced by the ideal device plus the point and a half a real run adds (`offset`), its
    calls logged: every test of exercise 3 but the solution's own passes without launching ranks."""
    monkeypatch.setitem(_RUN, "calls", [])
    monkeypatch.setitem(_RUN, "offset", 0.015)
    monkeypatch.setattr(checks, "_measure_live", _fake_measure)
    return _RUN


def test_the_prediction_passes_against_a_real_run_with_one_line(capsys):
    """The one test of exercise 3 that launches ranks: the solution's prediction within 5 points of a real run."""
    passes_with_one_line("19", IDLE, capsys)


@pytest.mark.parametrize(("label", "source", "want"), WRONG_IDLE, ids=[w[0] for w in WRONG_IDLE])
def test_a_wrong_prediction_fails_saying_what_differed(fake_run, label, source, want):
    message = fails_saying("19", IDLE, label, source, want)
    assert message.startswith("predicted_idle_share(schedule="), message
    assert not fake_run["calls"], "a wrong prediction must fail before any run"
    if "switched off" not in want:  # the failing case and what differed, never the answer
        got = re.search(r"schedule='([\w-]+)', stages=(\d+), microbatches=(\d+), t_f=(\S+), t_b=(\S+), "
                        r"t_w=(\S+)\) returned (\S+),", message)  # fmt: skip
        want_value = checks._idle_share(got[1], int(got[2]), int(got[3]), *(float(got[i]) for i in (4, 5, 6)))
        assert repr(want_value) not in message and f"{want_value:.1%}" not in message


def test_predictions_are_stored_before_the_run(fake_run):
    """Every call of the learner's function comes before the measurement, which gets the last drawn case."""
    from solution_code import _check_cell, solution_namespace

    ns = solution_namespace("19")
    log, right = [], ns["predicted_idle_share"]

    def logging(*args):
        log.append(("predict", args))
        return right(*args)

    calls = fake_run["calls"]
    ns["predicted_idle_share"] = logging
    exec(compile(_check_cell("19", IDLE), "<check cell>", "exec"), ns)  # noqa: S102
    assert len(calls) == 1 and len(log) == len(checks._FIXED_IDLE) + checks._DRAWN_IDLE + 1
    schedule, p, m = calls[0]
    assert log[-1] == ("predict", (schedule, p, m, 1.0, 1.0, 1.0))  # the live case, predicted with the others


def test_a_run_far_from_the_prediction_fails_showing_both(fake_run, capsys):
    """A run more than 5 points from the stored prediction fails, showing the prediction and the measurement;
    one within 5 points passes with the same line whatever it measured."""
    fake_run["offset"] = 0.10
    with pytest.raises(AssertionError) as info:
        run_check("19", IDLE)
    message, _ = str(info.value), capsys.readouterr()
    assert re.match(r"predicted_idle_share\(schedule='zb-h([12])', stages=3, microbatches=3, t_f=1\.0, t_b=1\.0, "
                    r"t_w=1\.0\) was stored as (18\.2|25\.0)% before the run; .* measured (28\.2|35\.0)% .*more than "
                    r"5 points apart", message), message  # fmt: skip
    lines = set()
    for offset in (0.0, 0.049, -0.02):
        fake_run["offset"] = offset
        run_check("19", IDLE)
        lines |= {line for line in capsys.readouterr().out.splitlines() if line.startswith("check_")}
    assert len(lines) == 1, lines


def test_the_live_case_is_outside_the_lesson_formulas():
    """Three ranks, three micro-batches: ZB-H2 outside its closed form (m < 2p - 1); both schedules drawn, and
    their idle shares far enough apart for the run to tell them apart."""
    import random

    seen = {}
    for seed in range(40):
        schedule, p, m, *times = checks._live_case(random.Random(seed))
        assert (p, m, times) == (3, 3, [1.0, 1.0, 1.0])
        seen[schedule] = checks._idle_share(schedule, p, m, *times)
    assert set(seen) == {"zb-h1", "zb-h2"} and m < 2 * p - 1
    assert abs(seen["zb-h1"] - seen["zb-h2"]) > checks._LIVE_TOLERANCE


def test_the_fixed_cases_cover_what_the_statement_says():
    fixed = [c[:3] for c in checks._FIXED_IDLE]
    assert any(c[3:] != (1.0, 1.0, 1.0) for c in checks._FIXED_IDLE)  # unequal times
    assert {s for s, p, _ in fixed if p == 1} == set(checks._SCHEDULES)  # one stage
    assert {s for s, p, m in fixed if m == 1 and p > 1} == set(checks._SCHEDULES)  # one micro-batch
    assert {s for s, p, m in fixed if (p, m) == (4, 8)} == set(checks._SCHEDULES)  # the lesson's case
    assert {s for s, p, m in fixed if 1 < m < p} == set(checks._SCHEDULES)  # fewer micro-batches than stages
    assert any(s == "zb-h2" and p <= m < 2 * p - 1 for s, p, m in fixed)


def test_an_unfinished_prediction_stays_not_implemented(fake_run):
    with pytest.raises(NotImplementedError, match="todo"):
        run_check("19", IDLE, SIG_I + "    raise NotImplementedError('todo')\n")
    with pytest.raises(
        AssertionError, match="must return a finite number of the step's idle share, got '0.1'"
    ):
        run_check("19", IDLE, SIG_I + "    return '0.1'\n")
    assert not fake_run["calls"]


def test_a_table_of_one_grade_runs_predictions_fails_the_next(fake_run):
    table_cheat_fails("19", "predicted_idle_share", IDLE, -1.0, "returned -1.0")


def test_torchs_pipeline_code_is_switched_off_for_the_prediction():
    """torch's code that builds, simulates or pads pipeline orders with bubbles (found by name) is switched off
    while the prediction runs; what else torch names idle time measures a profiler's trace, no pipeline."""
    not_the_job = {
        "torch.profiler._utils": "the idle time of a GPU in a profiler's trace",
        "torch._dynamo.symbolic_convert": "an exception passed up the compiler's interpreters",
    }
    job = r"(\w*(?:1f1b|gpipe|pipeline_order|schedule_ops|simulate_comms|ZeroBubble|ZBV|DualPipe|bubble|idle_time)\w*)"
    off = checks.idle_switched_off()
    anywhere = functions_doing(re.compile(rf"^[ \t]*(?:class|def) {job}", re.M | re.I))
    assert "torch.distributed.pipelining.schedules" in anywhere and "torch.profiler._utils" in anywhere
    top = {m: n for m, n in functions_doing(re.compile(rf"^(?:class|def) {job}", re.M | re.I)).items()
           if m not in not_the_job}  # fmt: skip
    assert not not_switched_off(top, off), not_switched_off(top, off)
    bare = sorted(m for m in anywhere if m not in not_the_job and not any(k.startswith(m + ".") for k in off))
    assert not bare, f"torch modules doing the prediction's job, none of it switched off: {bare}"


def test_correct_answers_written_otherwise_pass():
    """einsum everywhere (it sums a length-1 axis elementwise: no matrix product reaches the dispatcher), and a
    W that takes each weight's gradient one sequence at a time and adds them up: both are right."""
    import torch

    from parallel_lab.grading import check_split_backward

    def b_einsum(x, h, w1, b1, w2, b2, grad_y):
        gh = torch.einsum("...o,oh->...h", grad_y, w2) * (h > 0)
        return torch.einsum("...h,hi->...i", gh, w1), (x, torch.relu(h), gh, grad_y)

    def w_einsum(keep):
        x, a, gh, gy = keep
        return (torch.einsum("...h,...i->hi", gh, x), gh.flatten(0, -2).sum(0),
                torch.einsum("...o,...h->oh", gy, a), gy.flatten(0, -2).sum(0))  # fmt: skip

    def w_per_sequence(keep):
        x, a, gh, gy = keep
        if x.dim() == 2:
            return w_einsum(keep)
        gw1 = sum(gh[i].T @ x[i] for i in range(x.shape[0]))
        gw2 = sum(gy[i].T @ a[i] for i in range(x.shape[0]))
        return gw1, gh.sum((0, 1)), gw2, gy.sum((0, 1))

    check_split_backward(b_einsum, w_einsum)
    check_split_backward(b_einsum, w_per_sequence)


def test_a_prediction_as_a_fraction_or_a_tensor_passes(fake_run, capsys):
    """Any number: an exact Fraction (the timeline's sums are exact), a 0-d tensor."""
    for wrap in (
        "Fraction(_right(schedule, stages, microbatches, t_f, t_b, t_w)).limit_denominator(10**12)",
        "torch.tensor(_right(schedule, stages, microbatches, t_f, t_b, t_w), dtype=torch.float64)",
    ):
        run_check(
            "19", IDLE, "from fractions import Fraction\nimport torch\n" + WRAP_I + f"    return {wrap}\n"
        )
        assert "check_predicted_idle_share passed" in capsys.readouterr().out
