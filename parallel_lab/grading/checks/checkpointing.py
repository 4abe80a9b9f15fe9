"""Checks for lesson 07 (activation checkpointing): a recompute Function and checkpoint_sequential.

Both run on a stack of layers of 5 Linear layers each and compare gradients
with the un-checkpointed model bit for bit (the same ops on the same values), count
what autograd keeps with `SavedTensorCounter`, and count forward calls to see the
recomputation. `torch.utils.checkpoint` is switched off inside the learner's code:
the point is to build it.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator

import torch
import torch.nn as nn

from parallel_lab.grading.checks import draw_seed, family, passed, require_callable, unavailable

# The lab's recomputation and torch's, switched off while the learner's code runs.
FORBIDDEN = {
    **family("parallel_lab.checkpointing.recompute"),
    "torch.utils.checkpoint.CheckpointFunction.forward": "",
    "torch.utils.checkpoint.CheckpointFunction.backward": "",
}

__all__ = ["check_checkpoint_sequential", "check_peak_saved", "check_recompute"]


@contextlib.contextmanager
def _no_torch_checkpoint() -> Iterator[None]:
    import torch.utils.checkpoint as tuc

    saved = {n: getattr(tuc, n) for n in ("checkpoint", "checkpoint_sequential")}

    def forbid(name):
        def call(*a, **k):
            raise AssertionError(
                f"your code called torch.utils.checkpoint.{name}: build the recomputation yourself"
            )

        return call

    try:
        for n in saved:
            setattr(tuc, n, forbid(n))
        yield
    finally:
        for n, f in saved.items():
            setattr(tuc, n, f)


def _calls(model: nn.Module) -> tuple[dict, list]:
    """Count forward calls of each top-level block."""
    counts: dict[int, int] = {}
    handles = []
    for i, blk in enumerate(model):
        counts[i] = 0
        handles.append(blk.register_forward_pre_hook(lambda m, a, i=i: counts.__setitem__(i, counts[i] + 1)))
    return counts, handles


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters()] + [x.grad]


def _compare(where: str, got: list, want: list, names: list[str]) -> None:
    for name, g, w in zip(names, got, want):
        assert g is not None, f"{where}: {name} got no gradient"
        assert torch.equal(g, w), (
            f"{where}: gradient of {name} differs from the un-checkpointed model by {(g - w).abs().max():.3g} "
            "(the recomputation must run the same ops on the same input)"
        )


def check_recompute(Function: type) -> None:
    """`Function.apply(run, x)` returns `run(x)`, keeps only `x` for backward, and in backward runs
    `run` again with grad enabled and back-propagates through it."""
    require_callable(getattr(Function, "apply", None), "Function.apply")
    from parallel_lab.checkpointing import SavedTensorCounter, linear_stack

    seed = draw_seed() % 2**31  # weights and data drawn afresh every grade run
    torch.manual_seed(seed)
    block = linear_stack(layers=1, linears=5, hidden=16, seed=seed + 1)
    ref = copy.deepcopy(block)
    x = torch.randn(6, 16, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    gout = torch.randn(6, 16)
    ref(xr).backward(gout)
    counts, handles = _calls(block[0])
    try:
        with (
            _no_torch_checkpoint(),
            unavailable(FORBIDDEN, "this exercise (Recompute)"),
            SavedTensorCounter(block.parameters()) as c,
        ):
            y = Function.apply(block, x)
            kept = c.live_count
            calls_fwd = counts[0]
            assert isinstance(y, torch.Tensor), f"Function.apply must return a tensor, got {type(y).__name__}"
            assert torch.equal(y, block(x.detach())), "the output differs from run(x)"
            calls_fwd_check = counts[0]
            y.backward(gout)
    finally:
        for h in handles:
            h.remove()
    assert kept == 1, (
        f"after forward autograd keeps {kept} activations for this 5-Linear block; a checkpoint keeps exactly 1, "
        "its input (save it with ctx.save_for_backward and run the block under torch.no_grad())"
    )
    recomputed = counts[0] - calls_fwd_check
    assert calls_fwd == 1 and recomputed == 1, (
        f"the block ran {calls_fwd} time(s) in forward and {recomputed} in backward; expected once each"
    )
    names = [f"parameter {n}" for n, _ in block.named_parameters()] + ["the input x"]
    _compare("one block", _grads(block, x), _grads(ref, xr), names)
    passed("check_recompute", "1 activation kept, the block recomputed once, gradients bit-exact")


def check_checkpoint_sequential(fn: Callable[[nn.Sequential, int, torch.Tensor], torch.Tensor]) -> None:
    """`fn(blocks, segments, x)`: every segment (the last too) keeps only its input; gradients equal the
    plain model's; segments < 1 or more than the blocks -> ValueError."""
    require_callable(fn)
    import random

    from parallel_lab.checkpointing import SavedTensorCounter, linear_stack

    layers, rnd = 24, random.Random(draw_seed())  # weights, data and one spacing drawn afresh every grade run
    for segments in (24, 5, 7, 1, rnd.choice([s for s in range(2, 24) if s not in (5, 7)])):
        model = linear_stack(layers=layers, linears=5, hidden=16, seed=rnd.getrandbits(31))
        ref = copy.deepcopy(model)
        x = torch.randn(
            4, 16, generator=torch.Generator().manual_seed(rnd.getrandbits(31)), requires_grad=True
        )
        xr = x.detach().clone().requires_grad_()
        ref(xr).sum().backward()
        counts, handles = _calls(model)
        where = f"{layers} layers x 5 linears, segments={segments}"
        try:
            with (
                _no_torch_checkpoint(),
                unavailable(FORBIDDEN, "this exercise (checkpoint_sequential)"),
                SavedTensorCounter(model.parameters()) as c,
            ):
                y = fn(model, segments, x)
                kept = c.live_count
                assert isinstance(y, torch.Tensor), (
                    f"{where}: return the output tensor, got {type(y).__name__}"
                )
                assert y.requires_grad, (
                    f"{where}: the output does not require grad: nothing to back-propagate"
                )
                y.sum().backward()
        finally:
            for h in handles:
                h.remove()
        assert kept == segments, (
            f"{where}: autograd keeps {kept} activations after forward; with every segment checkpointed it keeps "
            f"one per segment ({segments}; without checkpointing it would be {layers * 5})"
        )
        twice = [i for i, n in counts.items() if n != 2]
        assert not twice, (
            f"{where}: blocks {twice[:5]} ran {[counts[i] for i in twice[:5]]} times; each should run twice (forward + recompute)"
        )
        names = [f"parameter {n}" for n, _ in model.named_parameters()] + ["the input x"]
        _compare(where, _grads(model, x), _grads(ref, xr), names)
    small = linear_stack(layers=3, linears=2, hidden=4)
    for bad in (0, -1, 4):
        try:
            with unavailable(FORBIDDEN, "this exercise (checkpoint_sequential)"):
                fn(small, bad, torch.randn(2, 4, requires_grad=True))
        except ValueError:
            continue
        raise AssertionError(
            f"segments={bad} for 3 blocks must raise ValueError (segments must be between 1 and 3)"
        )
    passed(
        "check_checkpoint_sequential", "24 x 5 = 120 activations -> 24, gradients bit-exact for 5 spacings"
    )


# ----------------------------------------------------------------------------- predict, then measure
def check_peak_saved(fn: Callable[[int, int, int], int]) -> None:
    """`fn(layers, linears, segments)` -> the most saved activations alive at once during one forward and
    backward of `layers` blocks of `linears` Linear layers, every one of `segments` segments checkpointed
    (the first `layers % segments` segments one block longer); predicted, then counted by autograd's
    saved-tensor hooks on a real run (exactly)."""
    require_callable(fn)
    from parallel_lab.checkpointing import SavedTensorCounter, checkpoint_sequential, linear_stack

    targets = {**FORBIDDEN, **family("parallel_lab.checkpointing.measure")}
    import random

    rnd = random.Random(draw_seed())  # two shapes drawn afresh every grade run
    drawn = []
    for _ in range(2):
        layers = rnd.randint(2, 30)
        drawn.append((layers, rnd.randint(1, 6), rnd.randint(1, layers)))
    cases = 0
    for layers, linears, segments in (
        (24, 5, 24),
        (24, 5, 5),
        (24, 5, 1),
        (10, 3, 4),
        (7, 2, 3),
        (12, 4, 6),
        *drawn,
    ):
        model = linear_stack(layers=layers, linears=linears, hidden=8, seed=3)
        x = torch.randn(2, 8, requires_grad=True)
        with SavedTensorCounter(model.parameters()) as c:
            checkpoint_sequential(model, segments, x, checkpoint_last=True).sum().backward()
        with unavailable(targets, "this exercise (peak_saved)"):
            said = fn(layers, linears, segments)
        assert said == c.peak_count, (
            f"{layers} layers x {linears} linears in {segments} checkpointed segments: you predict a peak of "
            f"{said} saved tensors, autograd held {c.peak_count} at once"
        )
        cases += 1
    passed("check_peak_saved", f"{cases} peaks predicted exactly")
