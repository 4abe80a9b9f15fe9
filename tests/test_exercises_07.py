"""Lesson 07's exercises: selective recomputation of an MLP (the lesson recomputes whole blocks), the cut of
unequal blocks with the smallest peak (the lesson cuts equal ones), and the bytes each policy keeps. Each: the solution passes, the wrong algorithms below fail naming the mistake, the lab's and
torch's checkpointing is switched off, and an answer table logged in one grade run fails the next."""

from __future__ import annotations

import pytest
from solution_code import edit, run_check, table_cheat_fails


def test_the_solutions_pass(capsys):
    for check in ("check_selective_mlp", "check_best_segments", "check_peak_saved"):
        run_check("07", check)
    assert capsys.readouterr().out.count(" passed: ") == 3


MLP = "SelectiveMLP"


@pytest.mark.parametrize(
    "wrong, match",
    [
        # gelu(h) kept too: twice the bytes
        (edit("07", MLP, "ctx.save_for_backward(x, w1, w2, h)", "ctx.save_for_backward(x, w1, w2, h, torch.nn.functional.gelu(h))"),
         "it should keep exactly the first product"),
        # the full checkpoint of the lesson: keep only the input, rebuild h with a product
        (edit("07", MLP, "ctx.save_for_backward(x, w1, w2, h)", "ctx.save_for_backward(x, w1, w2)")
         .replace("x, w1, w2, h = ctx.saved_tensors", "x, w1, w2 = ctx.saved_tensors\n        h = x @ w1.T"),
         "keeps 0 bytes"),
        # gelu(h) stored on the context, where the saved-tensor hooks do not look
        (edit("07", MLP, "ctx.save_for_backward(x, w1, w2, h)", "ctx.save_for_backward(x, w1, w2, h)\n        ctx.a = torch.nn.functional.gelu(h)"),
         "keeps .* bytes .* on ctx"),
        # the same, hidden in nested containers
        (edit("07", MLP, "ctx.save_for_backward(x, w1, w2, h)", "ctx.save_for_backward(x, w1, w2, h)\n        ctx.stash = {'a': [torch.nn.functional.gelu(h)]}"),
         "keeps .* bytes"),
        # x w1^T rebuilt in backward although h was kept: a fifth product
        (edit("07", MLP, "x, w1, w2, h = ctx.saved_tensors", "x, w1, w2, h = ctx.saved_tensors\n        h = x @ w1.T"),
         "backward ran 5 matrix products; four are enough"),
        # gelu's derivative forgotten
        (edit("07", MLP, "(grad_h,) = torch.autograd.grad(a, h, grad_a)", "grad_h = grad_a"), "gradient of x differs"),
        # the weight gradients transposed
        (edit("07", MLP, "grad_h.T @ x, grad_y.T @ a.detach()", "x.T @ grad_h, a.detach().T @ grad_y"), "gradient of w1|shape|size"),
    ],
    ids=["keeps-gelu-too", "full-recompute", "gelu-on-ctx", "gelu-nested-on-ctx", "rebuilds-h", "no-gelu-derivative",
         "transposed-weight-grads"],
)  # fmt: skip
def test_wrong_selective_functions_fail(wrong, match):
    with pytest.raises((AssertionError, RuntimeError), match=match):
        run_check("07", "check_selective_mlp", wrong)


def test_h_kept_on_the_context_passes(capsys):
    """Keeping h as a ctx attribute instead of through save_for_backward is the same memory: accepted."""
    right = edit(
        "07",
        MLP,
        "ctx.save_for_backward(x, w1, w2, h)",
        "ctx.save_for_backward(x, w1, w2)\n        ctx.h = h",
    )
    right = right.replace(
        "x, w1, w2, h = ctx.saved_tensors", "x, w1, w2 = ctx.saved_tensors\n        h = ctx.h"
    )
    run_check("07", "check_selective_mlp", right)
    assert " passed: " in capsys.readouterr().out


def test_torchs_selective_checkpoint_is_switched_off():
    cheat = (
        "import torch\nfrom torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts\n"
        "class SelectiveMLP(torch.autograd.Function):\n"
        "    @staticmethod\n    def forward(ctx, x, w1, w2):\n"
        "        create_selective_checkpoint_contexts([torch.ops.aten.mm.default])\n"
    )
    with pytest.raises(AssertionError, match="switched off"):
        run_check("07", "check_selective_mlp", cheat)


SEG = "best_segments"


@pytest.mark.parametrize(
    "wrong, match",
    [
        # the lesson's equal cut, whatever the blocks
        ("def best_segments(linears, segments):\n    q, r = divmod(len(linears), segments)\n"
         "    return [q + (1 if j < r else 0) for j in range(segments)]\n", "another cut holds only"),
        # the last segment's length forgotten
        (edit("07", SEG, "sizes = [b - a for a, b in zip(edges, edges[1:])]", "sizes = [b - a for a, b in zip(edges, edges[1:])][:-1]"),
         "segment sizes that add up"),
    ],
    ids=["equal-cut", "drops-last-segment"],
)  # fmt: skip
def test_wrong_cuts_fail(wrong, match):
    for _ in range(3):  # a drawn stack may be one where the mistake costs nothing: a few runs expose it
        try:
            run_check("07", "check_best_segments", wrong)
        except AssertionError as e:
            assert match in str(e), e
            return
    pytest.fail("three grade runs in a row accepted a wrong cut")


@pytest.mark.parametrize("tie", ["<", "<="], ids=["first-of-ties", "last-of-ties"])
def test_minimising_the_largest_segment_fails_whatever_the_tie_order(tie):
    """The smallest largest-segment sum, earlier segments' held inputs ignored: the fixed stack [1, 2, 1, 1] in 3
    segments has one such cut, [1, 1, 2] (peak 4), where [2, 1, 1] holds 3; so every grade run fails it, whichever
    of several equal cuts the search keeps elsewhere."""
    wrong = (
        "import itertools\n"
        "def best_segments(linears, segments):\n"
        "    def largest(sizes):\n"
        "        edges = list(itertools.accumulate([0, *sizes]))\n"
        "        return max(sum(linears[a:b]) for a, b in zip(edges, edges[1:]))\n"
        "    best = None\n"
        "    for cut in itertools.combinations(range(1, len(linears)), segments - 1):\n"
        "        edges = (0, *cut, len(linears))\n"
        "        sizes = [b - a for a, b in zip(edges, edges[1:])]\n"
        f"        if best is None or largest(sizes) {tie} largest(best):\n"
        "            best = sizes\n"
        "    return best\n"
    )
    with pytest.raises(
        AssertionError, match=r"segments=3\): your segments \[1, 1, 2\] hold up to 4 .* only 3"
    ):
        run_check("07", "check_best_segments", wrong)


PEAK = "peak_saved"


@pytest.mark.parametrize(
    "wrong, match",
    [
        # gelu's saved input forgotten: only the two products' inputs
        (edit("07", PEAK, "return layers * (x + 2 * h)", "return layers * (x + h)"), "autograd held"),
        # the full checkpoint's recomputation forgotten: inputs only
        (edit("07", PEAK, "return layers * x + 2 * h", "return layers * x"), "autograd held"),
        # selective taken to keep gelu(h) as well
        (edit("07", PEAK, "return layers * (x + h)", "return layers * (x + 2 * h)"), "autograd held"),
        # float64 assumed
        (edit("07", PEAK, "x, h = 4 * n * d, 4 * n * f", "x, h = 8 * n * d, 8 * n * f"), "autograd held"),
    ],
    ids=["none-without-gelu-input", "full-without-recompute", "selective-keeps-gelu", "float64"],
)  # fmt: skip
def test_wrong_peaks_fail(wrong, match):
    with pytest.raises(AssertionError, match=match):
        run_check("07", "check_peak_saved", wrong)


def test_the_labs_measurements_are_switched_off():
    cheat = (
        "from parallel_lab.checkpointing import predict_saved\n"
        "def peak_saved(layers, n, d, f, policy):\n    return predict_saved(layers, 3, layers)\n"
    )
    with pytest.raises(AssertionError, match="switched off"):
        run_check("07", "check_peak_saved", cheat)


def test_a_table_of_one_runs_peaks_fails_the_next():
    table_cheat_fails("07", PEAK, "check_peak_saved", 0, "you predict 0 bytes", tries=3)


def test_a_table_of_one_runs_cuts_fails_the_next():
    key = lambda linears, segments: (tuple(linears), segments)  # noqa: E731
    table_cheat_fails("07", SEG, "check_best_segments", [], "positive segment sizes", key=key, tries=3)
