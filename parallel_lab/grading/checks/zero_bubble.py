"""Checks for lesson 19's exercises: a stage's backward split by hand into B and W, and ZB-H1's bubble rate
when messages take time and W is slow.

`backward_b(x, h, w1, b1, w2, b2, grad_y)` -> (grad_x, keep) and `backward_w(keep)` -> (grad_w1, grad_b1,
grad_w2, grad_b2), for the stage y = relu(x w1ᵀ + b1) w2ᵀ + b2 (h = x w1ᵀ + b1 is what its forward saved), are
compared in float64, to 1e-10 relative, with the gradients autograd gives for this module's own stage; x is
(n, d_in) or (b, s, d_in). Fixed cases: one token, d_h = 1, a ReLU that is 0 everywhere, a 3-D input; drawn
every run: shapes with d_in, d_h, d_out and the token counts all distinct (so no two can be confused), 2-D and
3-D inputs. `_Watch` counts the FLOPs of every matrix product each half runs (mm, addmm, bmm, baddbmm, mv,
dot, ...: what @, matmul, linear and einsum come down to at the dispatcher): B must run exactly those of the two
input-side products (through w2, then through w1), W exactly those of the two weight-gradient products, and W
gets nothing but `keep`. Named slips: B computing a weight gradient too, or recomputing the forward; W redoing
B's product through w2; the ReLU's mask forgotten or inverted; a bias gradient summed over one axis of a 3-D
input only, or averaged; a weight gradient of a 3-D input left per sequence, taken from one position, or
transposed; relu(h) replaced by h.

`zb_h1_bubble_rate(stages, microbatches, t_f, t_b, t_w, t_comm)` is compared, to 1e-9, with the bubble rate
the lab's simulator measures for `schedule_zb_h1` with the same times, every message arriving t_comm after
its send; fixed cases (one stage, one micro-batch, the lesson's conditions, W slower than F, fewer
micro-batches than stages, latency) and 30 drawn each run. Named slips: the lesson's closed form used where
it does not hold (the message says which of its conditions the case breaks), the idle share of the step
instead of the rate (the same number as the cost taken as the whole step's span: every stage is busy
m(T_F + T_B + T_W); a fixed case has a W so slow that the last stage ends last, where it differs), 1F1B's
bubble (B and W as one backward, or W right after its B), the latency paid in one direction only or once
per link.

`predicted_idle_share(schedule, stages, microbatches, t_f, t_b, t_w)` (schedule "1f1b", "zb-h1" or "zb-h2") is
called on every case first, and its answers stored before anything runs: 20 fixed cases (one stage, one
micro-batch, ZB-H2 with p <= m < 2p - 1, fewer micro-batches than stages, the lesson's p = 4, m = 8, unequal times)
and 24 drawn each run (2 to 8 stages, 1 to 3p micro-batches, all three schedules, times that are not whole
numbers), plus the case the run measures. Each is compared, to 1e-9, with the idle share of a step (lesson 09's:
1 - busy / (p · span), the span from the first compute on any stage to the last) that the lab's simulator gives
on the emulated device (F t_f, B t_b, W t_w, an unsplit backward t_b + t_w, messages free). Then ZB-H1 or ZB-H2
with 3 micro-batches runs on 3 gloo ranks of the lab's executor (20 ms per forward, B and W 20 ms each, 4 steps),
and the stored prediction for it must lie within 5 points of the median of steps 1 to 3. Named slips: the
paper's bubble rate, each stage charged for its own span only (the flush ignored), the lesson's closed forms
where they do not hold, ZB-H2 taken as zero, 1F1B's backward counted as t_b, a percentage.

Switched off while the learner's functions run. Exercise 1: every way to let torch differentiate
(`differentiation_off`; `_Watch` refuses graphs and backward kernels), torch's split helpers
(`torch.distributed.pipelining._backward`: stage_backward_input / stage_backward_weight do exactly this job,
and the stage's own), torch's gradient helpers for other layers that a learner could bend to a linear one
(`torch.nn.grad`, the per-sample-gradient rules), the lab's pipeline package (`executor.SplitBackward`
splits with autograd) and this module's references; moving tensors to numpy or to Python (so the count sees
the computation) and new threads (the watch is per thread). `_Watch` also refuses convolutions, complex
numbers and any tensor larger than the largest the stage's backward makes (a broadcast product standing in
for a matrix product). Not caught: a product written as a Python loop of small element-wise operations,
and the watch popped with torch's private dispatch calls; the check is no sandbox. Exercise 2: the lab's
pipeline package (schedules, simulator, zero_bubble, viz, executor), its bubble formula, torch's pipeline
schedules and visualizer (`pipeline.switched_off`) and this module's references. Exercise 3: exercise 2's list
(`measured_bubble` and `measured_times` are in the lab's viz), the planner's `zero_bubble_size`, and this module's
references, the live measurement among them.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from parallel_lab.grading.checks import (
    WriteItYourself,
    call_learner,
    differentiation_off,
    differentiation_refused,
    draw_seed,
    family,
    finite_number,
    guarded,
    passed,
    require_callable,
    stay_in_torch,
    threads_off,
)

__all__ = ["check_predicted_idle_share", "check_split_backward", "check_zb_h1_bubble_rate"]

_BY_HAND = "write B and W with matrix products of your own"
_ONE_THREAD = "run your tensor operations on the thread that calls your function: the check watches that one"
_IN_TORCH = "keep the computation in tensor operations: the check counts their products"

#: torch's modules that split a backward or compute a layer's input or weight gradient outside autograd
#: (tests/test_exercises_19.py searches torch's source for more)
TORCH_SPLIT_MODULES = (
    "torch.distributed.pipelining._backward",
    "torch.distributed.pipelining.stage",
    "torch.nn.grad",
    "torch.nn.modules.linear_cross_entropy",
    "torch.nn.utils._per_sample_grad",
    "torch.nn.utils._expanded_weights.expanded_weights_impl",
    "torch.nn.utils._expanded_weights.expanded_weights_utils",
    "torch.nn.utils._expanded_weights.linear_expanded_weights",
    "torch.nn.utils._expanded_weights.conv_expanded_weights",
    "torch.nn.utils._expanded_weights.conv_utils",
    "torch.nn.utils._expanded_weights.embedding_expanded_weights",
    "torch.nn.utils._expanded_weights.group_norm_expanded_weights",
    "torch.nn.utils._expanded_weights.instance_norm_expanded_weights",
    "torch.nn.utils._expanded_weights.layer_norm_expanded_weights",
)
#: single functions of large torch modules (switching a whole module off would cost more than the check)
TORCH_SPLIT_FUNCTIONS = (
    "torch._decomp.decompositions.threshold_backward",
    "torch.nested._internal.ops.linear_backward_default",
    "torch.nested._internal.ops.matmul_backward_default",
)
_LAB_PIPELINE = (
    "parallel_lab.pipeline.executor",
    "parallel_lab.pipeline.schedules",
    "parallel_lab.pipeline.simulator",
    "parallel_lab.pipeline.stages",
    "parallel_lab.pipeline.viz",
    "parallel_lab.pipeline.zero_bubble",
)


@functools.cache
def split_switched_off() -> dict[str, str]:
    """Exercise 1's switched-off list (built on first use: torch's pipelining costs a few tenths of a second
    to import, which other lessons' grading skips)."""
    return {
        **differentiation_off(_BY_HAND),
        **family(*TORCH_SPLIT_MODULES, instead=_BY_HAND, missing_ok=True),
        **dict.fromkeys(TORCH_SPLIT_FUNCTIONS, _BY_HAND),
        **family(*_LAB_PIPELINE, instead=_BY_HAND),
        **{
            f"{__name__}.{n}": ""
            for n in ("_reference_grads", "_by_hand_b", "_by_hand_w", "_slips_x", "_slips_w")
        },
        **threads_off(_ONE_THREAD),
        **stay_in_torch(_IN_TORCH),
    }


@functools.cache
def rate_switched_off() -> dict[str, str]:
    """Exercise 2's switched-off list: lesson 09's (schedules, simulator, viz, bubble formula, torch's
    pipeline schedules and visualizer), the rest of the lab's pipeline package, and this module's references."""
    from parallel_lab.grading.checks.pipeline import switched_off

    return {
        **switched_off(),
        **family(*_LAB_PIPELINE),
        **{f"{__name__}.{n}": "" for n in ("_zb_h1_rate", "_timeline", "_rate_slip")},
    }


# ----------------------------------------------------------------------------- exercise 1: B and W by hand
#: aten's matrix products (what @, matmul, linear, einsum, tensordot come down to) -> (M, K, N, batch) of
#: their operands; a product costs 2·batch·M·K·N FLOPs
def _mkn(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int, int, int]:
    if a.dim() == 1 and b.dim() == 1:
        return 1, a.shape[0], 1, 1  # dot
    if b.dim() == 1:
        return a.shape[0], a.shape[1], 1, 1  # mv
    if a.dim() == 3:
        return a.shape[1], a.shape[2], b.shape[2], a.shape[0]  # bmm
    return a.shape[0], a.shape[1], b.shape[1], 1


_PRODUCTS: dict[str, Callable] = {
    "mm": lambda a, b, *_: _mkn(a, b),
    "bmm": lambda a, b, *_: _mkn(a, b),
    "mv": lambda a, b, *_: _mkn(a, b),
    "dot": lambda a, b, *_: _mkn(a, b),
    "vdot": lambda a, b, *_: _mkn(a, b),
    "addmm": lambda _, a, b, *__: _mkn(a, b),
    "baddbmm": lambda _, a, b, *__: _mkn(a, b),
    "addbmm": lambda _, a, b, *__: _mkn(a, b),
    "addmv": lambda _, a, b, *__: _mkn(a, b),
    "addr": lambda _, a, b, *__: (a.shape[0], 1, b.shape[0], 1),  # an outer product
    "linear": lambda a, w, *_: (a.numel() // a.shape[-1], a.shape[-1], w.shape[0], 1),
    "matmul": lambda a, b, *_: (a.numel() // a.shape[-1], a.shape[-1], b.shape[-1], 1),
}


class _Watch(TorchDispatchMode):
    """Sees every aten op the learner's B or W runs on the calling thread: refuses graphs, backward kernels,
    convolutions, complex numbers and tensors larger than `largest`, and records each matrix product as
    (M, K, N, batch)."""

    def __init__(self, exercise: str, largest: int):
        super().__init__()
        self.exercise, self.largest = exercise, largest
        self.products: list[tuple[int, int, int, int]] = []
        self.scalars = 0

    def refuse(self, what: str):
        raise WriteItYourself(f"{self.exercise} asks for B and W by hand, so {what}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        ins = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        why = differentiation_refused(func, ins)
        if why:
            self.refuse(f"{why}; {_BY_HAND}")
        if "conv" in name:
            self.refuse(f"convolutions are refused while the check runs (aten.{name}): the stage has none")
        out = func(*args, **kwargs)
        if name in _PRODUCTS:
            self.products.append(_PRODUCTS[name](*args))
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        if any(t.is_complex() for t in ins + outs):
            self.refuse(f"complex numbers are refused while the check runs (aten.{name}); {_BY_HAND}")
        big = 0 if func.is_view else max((o.numel() for o in outs), default=0)
        if big > self.largest:
            self.refuse(
                f"aten.{name} made a tensor of {big} elements, more than the {self.largest} of the largest one "
                "this stage's backward needs: a product broadcast over three axes and summed stands in for a "
                "matrix product, which the check counts; write it as one (@, torch.matmul, torch.einsum)"
            )
        self.scalars += name == "_local_scalar_dense"
        if self.scalars > 16:
            self.refuse("reading tensors into Python numbers one at a time is refused past 16 of them")
        return out


class _Case:
    """One stage and one gradient of its output: the tensors, their sizes and the call as a message shows it."""

    def __init__(
        self, g: torch.Generator, lead: tuple[int, ...], d_in: int, d_h: int, d_out: int, dead: bool = False
    ):
        self.lead, self.d_in, self.d_h, self.d_out = lead, d_in, d_h, d_out
        self.n = math.prod(lead)  # tokens
        f64 = torch.float64
        self.x = torch.randn(*lead, d_in, generator=g, dtype=f64)
        self.w1 = torch.randn(d_h, d_in, generator=g, dtype=f64) / math.sqrt(d_in)
        self.b1 = torch.randn(d_h, generator=g, dtype=f64) * 0.5
        if dead:  # every pre-activation below 0: the ReLU passes nothing
            self.b1 = -(self.x.abs().reshape(-1, d_in).sum(1).max() * self.w1.abs().max() + 1.0) * torch.ones(
                d_h, dtype=f64
            )
        self.w2 = torch.randn(d_out, d_h, generator=g, dtype=f64) / math.sqrt(d_h)
        self.b2 = torch.randn(d_out, generator=g, dtype=f64) * 0.5
        self.grad_y = torch.randn(*lead, d_out, generator=g, dtype=f64)
        self.h = self.x @ self.w1.T + self.b1
        batch = lead[0] if len(lead) > 1 else 1  # a weight gradient taken per sequence, then summed, is fine
        self.largest = max(self.n * max(d_in, d_h, d_out), batch * d_h * max(d_in, d_out))
        dims = [*lead, d_in, d_h, d_out] + ([self.n] if len(lead) > 1 else [])
        self.distinct = len(set(dims)) == len(dims)

    def args(self) -> tuple[torch.Tensor, ...]:
        return tuple(t.clone() for t in (self.x, self.h, self.w1, self.b1, self.w2, self.b2, self.grad_y))

    def call(self) -> str:
        def t(v: torch.Tensor) -> str:
            return f"<{tuple(v.shape)} float64>"

        return (
            f"backward_b(x={t(self.x)}, h={t(self.h)}, w1={t(self.w1)}, b1={t(self.b1)}, w2={t(self.w2)}, "
            f"b2={t(self.b2)}, grad_y={t(self.grad_y)})"
        )


def _reference_grads(c: _Case) -> dict[str, torch.Tensor]:
    """What autograd gives for the stage: the gradients of x, w1, b1, w2, b2."""
    leaves = [t.clone().requires_grad_() for t in (c.x, c.w1, c.b1, c.w2, c.b2)]
    x, w1, b1, w2, b2 = leaves
    y = torch.relu(x @ w1.T + b1) @ w2.T + b2
    grads = torch.autograd.grad(y, leaves, c.grad_y)
    return dict(zip(("grad_x", "grad_w1", "grad_b1", "grad_w2", "grad_b2"), grads))


def _by_hand_b(c: _Case, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The gradient at h (the ReLU's mask applied, or `mask`)."""
    mask = (c.h > 0) if mask is None else mask
    return (c.grad_y @ c.w2) * mask


def _by_hand_w(grad_h: torch.Tensor, x: torch.Tensor, a: torch.Tensor, grad_y: torch.Tensor) -> tuple:
    d_in, d_h, d_out = x.shape[-1], grad_h.shape[-1], grad_y.shape[-1]
    gh, xx, aa, gy = (
        grad_h.reshape(-1, d_h),
        x.reshape(-1, d_in),
        a.reshape(-1, d_h),
        grad_y.reshape(-1, d_out),
    )
    return gh.T @ xx, gh.sum(0), gy.T @ aa, gy.sum(0)


def _slips_x(c: _Case) -> dict[str, torch.Tensor]:
    """grad_x as the usual slips compute it."""
    return {
        "the ReLU's mask is missing: the gradient passes the ReLU only where h > 0": (c.grad_y @ c.w2) @ c.w1,
        "the ReLU's mask is inverted: the gradient passes the ReLU where h > 0, not where h <= 0": _by_hand_b(
            c, c.h <= 0
        )
        @ c.w1,
    }


def _slips_w(c: _Case) -> dict[str, dict[str, torch.Tensor]]:
    """(grad_w1, grad_b1, grad_w2, grad_b2) as the usual slips compute them: {name: {slip: value}}."""
    gh, a, n = _by_hand_b(c), torch.relu(c.h), c.n
    no_mask = _by_hand_w(c.grad_y @ c.w2, c.x, a, c.grad_y)
    right = _by_hand_w(gh, c.x, a, c.grad_y)
    out: dict[str, dict[str, torch.Tensor]] = {k: {} for k in ("grad_w1", "grad_b1", "grad_w2", "grad_b2")}
    mask = "the ReLU's mask is missing: the gradient at h is the gradient at relu(h) only where h > 0"
    out["grad_w1"][mask], out["grad_b1"][mask] = no_mask[0], no_mask[1]
    out["grad_w2"]["it uses h where the forward used relu(h)"] = _by_hand_w(gh, c.x, c.h, c.grad_y)[2]
    for i, name in enumerate(out):
        out[name][
            "it is averaged over the tokens: a parameter shared by every token gets the sum of their gradients"
        ] = right[i] / n
    if len(c.lead) == 2:
        first = _by_hand_w(gh[:, 0], c.x[:, 0], a[:, 0], c.grad_y[:, 0])
        for i, name in enumerate(out):
            out[name][
                "it looks computed from the first sequence position only: every token of every sequence "
                "contributes"
            ] = first[i]
    return out


def _role(c: _Case, m: int, k: int, n: int) -> str:
    """What a product of (m x k) by (k x n) computes in this stage ('' when its sizes do not say)."""
    if not c.distinct:
        return ""
    tokens, outer = (c.n, *c.lead[1:]), {m, n}
    if k == c.d_out and c.d_h in outer:
        return "the gradient at a = relu(h), through w2"
    if k == c.d_h and c.d_in in outer:
        return "the gradient of x, through w1"
    if k in tokens and outer == {c.d_h, c.d_in}:
        return "the gradient of w1 (a product over the tokens)"
    if k in tokens and outer == {c.d_out, c.d_h}:
        return "the gradient of w2 (a product over the tokens)"
    if k == c.d_in and c.d_h in outer:
        return "the forward's h = x w1ᵀ"
    if k == c.d_h and c.d_out in outer:
        return "the forward's output a w2ᵀ"
    return ""


def _role_flops(c: _Case) -> dict[str, int]:
    """The FLOPs each of the backward's four products takes, by role (as `_role` names them)."""
    return {
        "the gradient at a = relu(h), through w2": 2 * c.n * c.d_out * c.d_h,
        "the gradient of x, through w1": 2 * c.n * c.d_h * c.d_in,
        "the gradient of w1 (a product over the tokens)": 2 * c.n * c.d_h * c.d_in,
        "the gradient of w2 (a product over the tokens)": 2 * c.n * c.d_out * c.d_h,
    }


def _flops_verdict(c: _Case, where: str, half: str, products: list, want_roles: tuple[str, str]) -> None:
    # a product summing over an axis of length 1 is an elementwise one (torch.einsum runs it so, and no matrix
    # product reaches the dispatcher): on such a stage the FLOPs say nothing, and the gradients alone are compared
    if min(c.n, c.d_h, c.d_out) == 1:
        return
    got = sum(2 * m * k * n * b for m, k, n, b in products)
    want = 2 * c.n * c.d_h * (c.d_out + c.d_in)  # both halves: two products of these sizes each
    roles = [_role(c, m, k, n) for m, k, n, _ in products]
    per_role: dict[str, int] = {}
    for r, (m, k, n, b) in zip(roles, products):  # one product per role, or one per sequence: the same FLOPs
        per_role[r] = per_role.get(r, 0) + 2 * m * k * n * b
    expected = _role_flops(c)
    if got == want and (not c.distinct or all(per_role.get(r) == expected[r] for r in want_roles)):
        return
    extra = [r for r in dict.fromkeys(roles) if r and r not in want_roles]
    twice = [r for r in want_roles if per_role.get(r, 0) > expected[r]]
    what = "the two input-side products" if half == "B" else "the two weight-gradient products"
    text = f"{where}: your {half} ran {got:,} FLOPs of matrix products, {what} take {want:,}."
    weights = [r for r in extra if "gradient of w" in r]
    if half == "B" and weights:
        text += f" Your B also computed {' and '.join(weights)}: that is W's work, which can wait; keep what W needs."
    elif half == "B" and any("forward" in r for r in extra):
        text += " Your B recomputed the forward's h: the forward saved h, and B gets it."
    elif half == "W" and any("gradient at a" in r or "gradient of x" in r for r in extra):
        bs = [r for r in extra if "gradient at a" in r or "gradient of x" in r]
        text += f" Your W recomputed {' and '.join(bs)}: that is B's work, done already; keep its result."
    elif twice:
        text += f" Your {half} computed {' and '.join(twice)} more than once."
    elif got < want:
        text += (
            f" Fewer than {what} need: did {'W' if half == 'B' else 'B'} do some of them, or are they written as "
            "something other than matrix products?"
        )
    raise AssertionError(text)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return (
        bool((got - want).abs().max() <= 1e-10 * max(1.0, want.abs().max().item())) if want.numel() else True
    )


def _as_tensor(got, where: str, what: str, want: torch.Tensor, c: _Case) -> torch.Tensor:
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{where}: {what} must be a tensor, got {type(got).__name__}")
    if tuple(got.shape) != tuple(want.shape):
        shape, why = tuple(got.shape), ""
        shared = "a parameter shared by every token of every sequence gets the sum of all their gradients"
        if len(c.lead) == 2 and shape in ((c.lead[0], *want.shape), (c.lead[1], *want.shape)):
            axis = "sequence" if shape[0] == c.lead[0] else "batch"
            why = f": summed over the {axis} axis only; {shared}"
        elif shape == (*c.lead, *want.shape):
            why = f": not summed over the tokens; {shared}"
        elif want.dim() == 2 and shape == tuple(reversed(want.shape)):
            why = ": transposed (a weight's gradient has the weight's shape)"
        raise AssertionError(f"{where}: {what} has shape {shape}, expected {tuple(want.shape)}{why}")
    if got.dtype != torch.float64:
        raise AssertionError(f"{where}: {what} is {got.dtype}, expected float64 (the stage's dtype)")
    return got


def _cases(seed: int) -> list[_Case]:
    rnd = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    fixed = [_Case(g, (6,), 5, 7, 3), _Case(g, (1,), 4, 6, 3), _Case(g, (5,), 3, 1, 4), _Case(g, (4,), 3, 5, 2, dead=True),
             _Case(g, (2, 3), 4, 5, 7)]  # fmt: skip
    drawn = []
    for i in range(6):
        while True:
            lead = (rnd.randint(3, 24),) if i % 2 == 0 else (rnd.randint(2, 4), rnd.randint(3, 9))
            d_in, d_h, d_out = rnd.sample(range(2, 15), 3)
            dims = [*lead, d_in, d_h, d_out] + ([math.prod(lead)] if len(lead) > 1 else [])
            if len(set(dims)) == len(dims):
                break
        drawn.append(_Case(g, lead, d_in, d_h, d_out))
    return fixed + drawn


def check_split_backward(backward_b: Callable, backward_w: Callable) -> None:
    """`backward_b(x, h, w1, b1, w2, b2, grad_y)` -> (grad_x, keep) and `backward_w(keep)` -> (grad_w1, grad_b1,
    grad_w2, grad_b2): the two halves of the stage's backward, each doing only its own products."""
    require_callable(backward_b, "backward_b")
    require_callable(backward_w, "backward_w")
    exercise = "this exercise (backward_b, backward_w)"
    off = split_switched_off()
    b_fn, w_fn = guarded(backward_b, off, exercise), guarded(backward_w, off, exercise)
    cases = _cases(draw_seed())  # shapes and values drawn afresh every grade run
    for c in cases:
        call, want, args = c.call(), _reference_grads(c), c.args()
        with _Watch(exercise, c.largest) as watch_b:
            got = call_learner(b_fn, call, *args)
        if not (isinstance(got, tuple) and len(got) == 2):
            raise AssertionError(f"{call}: return the pair (grad_x, keep), got {type(got).__name__}")
        grad_x = _as_tensor(got[0], call, "grad_x", want["grad_x"], c)
        if not _close(grad_x, want["grad_x"]):
            err = (grad_x - want["grad_x"]).abs().max().item()
            slip = next(
                (k for k, v in _slips_x(c).items() if _close(grad_x, v) and not _close(v, want["grad_x"])), ""
            )
            raise AssertionError(
                f"{call}: grad_x differs from autograd's by up to {err:.3g}" + (f" ({slip})" if slip else "")
            )
        in_side = ("the gradient at a = relu(h), through w2", "the gradient of x, through w1")
        _flops_verdict(c, call, "B", watch_b.products, in_side)
        where = f"backward_w(keep), keep from {call}"
        with _Watch(exercise, c.largest) as watch_w:
            out = call_learner(w_fn, where, got[1])
        names = ("grad_w1", "grad_b1", "grad_w2", "grad_b2")
        if not (isinstance(out, (tuple, list)) and len(out) == 4):
            raise AssertionError(
                f"{where}: return the four gradients ({', '.join(names)}), got {type(out).__name__}"
            )
        slips = _slips_w(c)
        for name, value in zip(names, out):
            value = _as_tensor(value, where, name, want[name], c)
            if not _close(value, want[name]):
                err = (value - want[name]).abs().max().item()
                slip = next(
                    (k for k, v in slips[name].items() if _close(value, v) and not _close(v, want[name])), ""
                )
                raise AssertionError(
                    f"{where}: {name} differs from autograd's by up to {err:.3g}"
                    + (f" ({slip})" if slip else "")
                )
        weights = (
            "the gradient of w1 (a product over the tokens)",
            "the gradient of w2 (a product over the tokens)",
        )
        _flops_verdict(c, where, "W", watch_w.products, weights)
    passed(
        "check_split_backward", f"{len(cases)} stages, gradients within 1e-10, B's and W's products counted"
    )


# ----------------------------------------------------------------------------- exercise 2: ZB-H1's bubble rate
def _zb_h1_rate(p: int, m: int, t_f: float, t_b: float, t_w: float, t_comm: float) -> float:
    """The reference: the paper's bubble rate of ZB-H1 as the lab's simulator measures it."""
    from parallel_lab.pipeline import schedule_zb_h1, simulate

    return simulate(schedule_zb_h1(p, m), t_f, t_b, t_comm, t_w=t_w).bubble_rate


def _timeline(orders: list, t: dict, c_fwd: float, c_bwd: float) -> list[tuple[float, float]]:
    """(first start, last end) per stage of compute orders (lists of Steps) when an activation arrives c_fwd
    after its forward ends and a gradient c_bwd after its B ends; `t` maps F, B, W to their times. For the
    slips that charge latency in one direction only; with c_fwd = c_bwd it is the simulator's model."""
    p = len(orders)
    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, mb) -> end
    ptr, now = [0] * p, [0.0] * p
    first = [math.inf] * p
    while any(ptr[s] < len(orders[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while ptr[s] < len(orders[s]):
                step = orders[s][ptr[s]]
                need = ("F", s - 1, step.mb, c_fwd) if step.kind == "F" and s > 0 else None
                if step.kind == "B" and s < p - 1:
                    need = ("B", s + 1, step.mb, c_bwd)
                if need and need[:3] not in done:
                    break
                start = max(now[s], done[need[:3]] + need[3]) if need else now[s]
                now[s] = done[step.kind, s, step.mb] = start + t[step.kind]
                first[s], ptr[s], moved = min(first[s], start), ptr[s] + 1, True
        if not moved:
            raise RuntimeError("the orders deadlock")
    return list(zip(first, now))


def _rate(spans: list, busy: float) -> float:
    cost = max(end - start for start, end in spans)
    return 1.0 - busy / cost if cost > 0 else 0.0


def _rate_slip(got: float, want: float, p: int, m: int, t_f: float, t_b: float, t_w: float, c: float) -> str:
    """The usual wrong answer `got` matches, named ('' for none); a slip whose value is right here is skipped."""
    from parallel_lab.pipeline import (
        add_comms,
        make_schedule,
        order_1f1b,
        order_zb_h1,
        simulate,
        split_backward,
    )

    busy = m * (t_f + t_b + t_w)

    def closed(extra: float) -> float:
        bubble = (p - 1) * (t_f + t_b - t_w) + extra
        return bubble / (busy + bubble) if busy + bubble > 0 else 0.0

    broken = [
        w
        for w, yes in (("t_w > t_f", t_w > t_f), ("t_comm > 0", c > 0), ("microbatches < stages", m < p))
        if yes
    ]
    zb = [order_zb_h1(s, p, m) for s in range(p)]
    times = {"F": t_f, "B": t_b, "W": t_w}
    sim = simulate(add_comms(zb), t_f, t_b, c, t_w=t_w)
    once = (
        "The latency is charged once per link: every message, an activation going forward and a gradient "
        "coming back, arrives t_comm after its send."
    )
    one_way = (
        "The latency is charged in one direction only: the activations going forward and the gradients coming "
        "back both arrive t_comm after their send."
    )
    split_1f1b = add_comms([split_backward(order_1f1b(s, p, m)) for s in range(p)])
    slips = [
        (closed(0.0), "That is the lesson's closed form (p-1)(T_F + T_B - T_W), which holds only when T_W <= T_F, "
                      f"messages are free and m >= p; this case has {' and '.join(broken)}."),
        # every stage is busy m(T_F + T_B + T_W), so the idle share of the step is the rate with the makespan as cost
        (sim.bubble_fraction, "That is the idle share of the whole step, 1 - busy / (p · makespan), the same as "
                              "taking the cost as the whole step's span; the paper's cost is the longest time any "
                              "one stage spends from its own first compute to its last."),
        (simulate(make_schedule("1f1b", p, m), t_f, t_b, c, t_w=t_w).bubble_rate,
         "That is 1F1B's bubble rate, B and W run as one backward; ZB-H1 splits them."),
        (simulate(split_1f1b, t_f, t_b, c, t_w=t_w).bubble_rate,
         "That is the rate with each W right after its own B; ZB-H1 runs stage s's W's s B's later."),
        (_rate(_timeline(zb, times, c, 0.0), busy), one_way),
        (_rate(_timeline(zb, times, 0.0, c), busy), one_way),
        (closed((p - 1) * c), once),
        (closed(2 * (p - 1) * c), once),
    ]  # fmt: skip
    return next((why for value, why in slips if abs(got - value) <= 1e-9 and abs(value - want) > 1e-9), "")


#: (stages, microbatches, t_f, t_b, t_w, t_comm), in the order checked: one stage; the lesson's conditions
#: (the closed form holds); W slower than F; latency (with a W so slow that the last stage ends last: the makespan
#: is no stage's span); one micro-batch and fewer micro-batches than stages
_FIXED_RATE = [(1, 6, 1.0, 2.0, 0.5, 0.0), (1, 3, 1.0, 1.0, 2.0, 0.7), (4, 8, 1.0, 1.0, 1.0, 0.0),
               (4, 8, 1.0, 2.0, 0.5, 0.0), (4, 8, 1.0, 1.0, 2.0, 0.0), (5, 12, 1.2, 2.0, 1.9, 0.0),
               (4, 8, 1.0, 1.0, 1.0, 0.5), (3, 9, 0.8, 1.5, 0.4, 1.6), (4, 8, 1.0, 0.5, 3.0, 0.5),
               (4, 1, 1.0, 1.0, 1.0, 0.0), (6, 3, 1.0, 2.0, 0.5, 0.0), (3, 5, 1.5, 1.0, 2.5, 2.0),
               (8, 24, 0.7, 1.3, 0.4, 0.35)]  # fmt: skip
_DRAWN_RATE = 30


def _drawn_rates(seed: int) -> list[tuple]:
    rnd = random.Random(seed)
    out = []
    for i in range(_DRAWN_RATE):
        t_f, t_b = round(rnd.uniform(0.5, 2.0), 3), round(rnd.uniform(0.5, 3.0), 3)
        t_w = (
            round(rnd.uniform(0.1, t_f - 0.01), 3) if i % 2 else round(rnd.uniform(t_f + 0.01, 2.5 * t_f), 3)
        )
        t_comm = 0.0 if rnd.random() < 0.2 else round(rnd.uniform(0.0, 2.0 * t_f), 3)
        out.append((rnd.randint(2, 12), rnd.randint(1, 40), t_f, t_b, t_w, t_comm))
    return out


def check_zb_h1_bubble_rate(fn: Callable) -> None:
    """`fn(stages, microbatches, t_f, t_b, t_w, t_comm)` -> ZB-H1's bubble rate when each message arrives t_comm
    after its send."""
    require_callable(fn)
    run = guarded(fn, rate_switched_off(), "this exercise (zb_h1_bubble_rate)")
    cases = _FIXED_RATE + _drawn_rates(draw_seed())
    for p, m, t_f, t_b, t_w, c in cases:
        where = f"zb_h1_bubble_rate(stages={p}, microbatches={m}, t_f={t_f!r}, t_b={t_b!r}, t_w={t_w!r}, t_comm={c!r})"
        want = _zb_h1_rate(p, m, t_f, t_b, t_w, c)
        got = call_learner(run, where, p, m, t_f, t_b, t_w, c)
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            raise AssertionError(f"{where} must return a number, got {type(got).__name__}")
        if not abs(got - want) <= 1e-9 * max(1.0, abs(want)):
            slip = _rate_slip(got, want, p, m, t_f, t_b, t_w, c)
            raise AssertionError(
                f"{where} returned {got!r}; the simulator measures {want!r} for ZB-H1.{' ' + slip if slip else ''}"
            )
    passed(
        "check_zb_h1_bubble_rate",
        f"{len(_FIXED_RATE)} fixed and {_DRAWN_RATE} drawn cases against the simulator",
    )


# ----------------------------------------------------------------------------- exercise 3: predict, then measure
@functools.cache
def idle_switched_off() -> dict[str, str]:
    """Exercise 3's switched-off list: exercise 2's (the lab's pipeline package, `measured_bubble` and
    `measured_times` among it, lesson 09's bubble formula, torch's pipeline schedules and visualizer), the
    planner's zero-bubble formula, and this module's references."""
    return {
        **rate_switched_off(),
        "parallel_lab.costmodel.planner.zero_bubble_size": "",
        **{f"{__name__}.{n}": "" for n in ("_idle_share", "_idle_slip", "_measure_live", "_live_case")},
    }


_SCHEDULES = ("1f1b", "zb-h1", "zb-h2")


def _idle_share(schedule: str, p: int, m: int, t_f: float, t_b: float, t_w: float) -> float:
    """The reference: the idle share of a step on the emulated device (F t_f, B t_b, W t_w; 1F1B's unsplit
    backward t_b + t_w, as `simulate` charges it; messages free), the span from the first compute to the last."""
    from parallel_lab.pipeline import make_schedule, simulate

    return simulate(make_schedule(schedule, p, m), t_f, t_b, t_w=t_w).bubble_fraction


#: the run: 3 ranks, 3 micro-batches, ZB-H1 or ZB-H2 (18.2% and 25.0% on the ideal device: the run tells them
#: apart), 20 ms per forward, B and W 20 ms each. It measures 2-3 points above the ideal device here (messages
#: and the host's work on the critical path) and up to about 4 with both cores busy
_LIVE = (("zb-h1", 3, 3, 1.0, 1.0, 1.0), ("zb-h2", 3, 3, 1.0, 1.0, 1.0))
_LIVE_TOLERANCE = 0.05


def _measure_live(schedule: str, stages: int, microbatches: int) -> float:
    """The idle share the lab's executor shows on `stages` ranks (lesson 09's `measured_bubble`), the median of
    steps 1 to 3 (step 0 warms up). Other work on the machine mostly adds idle time (a rank slowed on the
    critical path makes every other one wait); the median keeps one disturbed step from deciding."""
    import statistics

    import parallel_lab as pl
    from parallel_lab.pipeline import PipelineConfig, measured_bubble, train_pipeline

    m = microbatches
    cfg = PipelineConfig(schedule=schedule, microbatches=m, layers=3 * stages, batch=4 * m, steps=4,
                         compute_time=0.02)  # fmt: skip
    run = pl.launch(train_pipeline, stages, cfg, threads=1, backend="gloo")  # the tolerance was set on gloo
    return statistics.median(measured_bubble(run, step) for step in (1, 2, 3))


def _live_case(rnd: random.Random) -> tuple:
    return rnd.choice(_LIVE)


def _idle_slip(
    got: float, want: float, schedule: str, p: int, m: int, t_f: float, t_b: float, t_w: float
) -> str:
    """The usual wrong answer `got` matches, named ('' for none); a slip whose value is right here is skipped."""
    from parallel_lab.pipeline import make_schedule, simulate

    if got > 1.0:
        return "A share lies between 0 and 1 (a percentage divided by 100)."
    sim = simulate(make_schedule(schedule, p, m), t_f, t_b, t_w=t_w)
    busy = m * (t_f + t_b + t_w)  # every stage: m forwards, m B's and m W's (1F1B: m whole backwards)
    spans = [rank[-1][1] - rank[0][0] for rank in sim.spans]
    flush = (
        "That charges each stage only for its own span, from its first compute to its last; the step ends in a "
        "flush, so every stage waits until the last compute on any stage ends, and is charged the whole step."
    )
    slips: list[tuple[float, str]] = []
    if schedule == "zb-h2":
        slips.append((0.0, "That takes ZB-H2 as zero: zero is the paper's bubble rate, per stage, and only with "
                           "at least 2·stages − 1 micro-batches and equal times; a step ending in a flush charges "
                           "every stage for the whole step."))  # fmt: skip
    need = {"zb-h1": (p, "microbatches >= stages"), "zb-h2": (2 * p - 1, "microbatches >= 2·stages − 1")}
    if schedule in need and m < need[schedule][0]:
        sizes = [(p - 1) * (t_f + t_b - t_w)] + (
            [(p - 1) * (t_f + t_b - 2 * t_w)] if schedule == "zb-h2" else []
        )
        for size in sizes:  # ZB-H1's size under a flush; ZB-H2's own
            slips.append((size / (busy + size),
                          f"That is what the lesson's closed forms give (its bubble sizes, or ZB-H1's idle share "
                          f"under a flush), which hold for {schedule.upper()} only with {need[schedule][1]}; "
                          f"this case has {m} micro-batch{'es' if m > 1 else ''} on {p} stages."))  # fmt: skip
    slips.append((sim.bubble_rate,
                  "That is the paper's bubble rate: each stage measured from its own first compute to its own "
                  "last, the longest taken as the cost. A step that ends in a flush runs from the first compute "
                  "on any stage to the last on any stage, for every stage."))  # fmt: skip
    slips += [(1.0 - p * busy / sum(spans), flush), (sum(1.0 - busy / s for s in spans) / p, flush)]
    if schedule == "1f1b":
        unsplit = (
            "1F1B's backward is not split: it takes t_b + t_w, in the timeline and in the busy time alike."
        )
        b_only = simulate(make_schedule("1f1b", p, m), t_f, t_b).makespan  # its backward taken as t_b
        slips += [(1.0 - busy / b_only, unsplit), (1.0 - m * (t_f + t_b) / sim.makespan, unsplit)]
    return next((why for value, why in slips if abs(got - value) <= 1e-9 and abs(value - want) > 1e-9), "")


#: (schedule, stages, microbatches, t_f, t_b, t_w), in the order checked: one stage; one micro-batch; ZB-H2 with
#: p <= m < 2p - 1 (its closed form does not hold, ZB-H1's would); fewer micro-batches than stages; the lesson's
#: p = 4, m = 8 on the executor's device; then times that are not equal (W slower than F, B slower than F)
_FIXED_IDLE = [
    *((s, p, m, 1.0, 1.0, 1.0) for s, p, m in (
        ("1f1b", 1, 4), ("zb-h1", 1, 3), ("zb-h2", 1, 5), ("1f1b", 3, 1), ("zb-h1", 4, 1), ("zb-h2", 5, 1),
        ("zb-h2", 4, 5), ("zb-h2", 3, 4), ("zb-h2", 5, 8), ("1f1b", 5, 3), ("zb-h1", 4, 3), ("zb-h1", 7, 2),
        ("zb-h2", 4, 3), ("zb-h2", 6, 4), ("1f1b", 4, 8), ("zb-h1", 4, 8), ("zb-h2", 4, 8))),
    ("1f1b", 4, 6, 1.0, 1.5, 0.5), ("zb-h1", 4, 8, 1.0, 1.0, 1.75), ("zb-h2", 4, 8, 0.75, 1.5, 1.25),
]  # fmt: skip
_DRAWN_IDLE = 24


def _drawn_idle(rnd: random.Random) -> list[tuple]:
    """Sizes and times drawn anew: times that are not whole numbers, so no table of a finite set of cases
    can stand in for the timeline."""
    out = []
    for i in range(_DRAWN_IDLE):
        p = rnd.randint(2, 8)
        times = (
            round(rnd.uniform(0.5, 2.0), 3),
            round(rnd.uniform(0.5, 2.0), 3),
            round(rnd.uniform(0.25, 2.0), 3),
        )
        out.append((_SCHEDULES[i % 3], p, rnd.randint(1, 3 * p), *times))
    return out


def check_predicted_idle_share(fn: Callable) -> None:
    """`fn(schedule, stages, microbatches, t_f, t_b, t_w)` -> the idle share one step of the lab's executor
    shows on the emulated device; predicted for every case before anything runs, then one case measured on 3
    ranks."""
    require_callable(fn)
    rnd = random.Random(draw_seed())
    live = _live_case(rnd)
    cases = _FIXED_IDLE + _drawn_idle(rnd) + [live]

    def where(schedule: str, p: int, m: int, t_f: float, t_b: float, t_w: float) -> str:
        return (f"predicted_idle_share(schedule={schedule!r}, stages={p}, microbatches={m}, t_f={t_f!r}, "
                f"t_b={t_b!r}, t_w={t_w!r})")  # fmt: skip

    def predict_all() -> list:  # every prediction, locked in before anything is simulated or run
        return [call_learner(fn, where(*c), *c) for c in cases]

    got = guarded(predict_all, idle_switched_off(), "this exercise (predicted_idle_share)")()
    predicted = {}
    for case, value in zip(cases, got):
        value = finite_number(value, where(*case), "the step's idle share")
        want = _idle_share(*case)
        if not abs(value - want) <= 1e-9:
            slip = _idle_slip(value, want, *case)
            side = "more" if value > want else "less"
            raise AssertionError(
                f"{where(*case)} returned {value!r}, {side} than the idle share of that step on the emulated "
                f"device (compared to 1e-9).{' ' + slip if slip else ''}"
            )
        predicted[case] = value
    measured = _measure_live(live[0], live[1], live[2])
    if not abs(predicted[live] - measured) <= _LIVE_TOLERANCE:
        raise AssertionError(
            f"{where(*live)} was stored as {predicted[live]:.1%} before the run; {live[1]} ranks of the lab's "
            f"executor measured {measured:.1%} (the median of steps 1 to 3), more than "
            f"{_LIVE_TOLERANCE * 100:.0f} points apart. Every prediction matched the ideal device, so the run was "
            "disturbed (other work on this machine mostly adds idle time): grade again when it is quieter."
        )
    passed(
        "check_predicted_idle_share",
        f"{len(_FIXED_IDLE)} fixed and {_DRAWN_IDLE} drawn cases against the emulated device, and a run on "
        f"{_LIVE[0][1]} ranks within {_LIVE_TOLERANCE * 100:.0f} points of the prediction",
    )
