"""Lesson 15's exercises: the reference solution passes with one line; wrappers of the lab's and torch's pruning,
every way of letting torch differentiate, answer tables from an earlier grade run and wrong algorithms fail,
each with a message naming what differed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from solution_code import _check_cell, edit, run_check, solution_namespace, table_cheat_fails

CHECKS = ["check_global_magnitude_masks", "check_distillation_grad"]
MASKS, GRAD = "global_magnitude_masks", "distillation_grad"
SIG = "def distillation_grad(s, t, y, T, alpha):\n"

WRONG = [
    # ---- exercise 1: one threshold over every tensor
    ("check_global_magnitude_masks", "each tensor pruned to the sparsity on its own",
     "import torch\ndef global_magnitude_masks(weights, sparsity):\n    out = {}\n    for n, w in weights.items():\n"
     "        k = round(sparsity * w.numel())\n        keep = torch.ones(w.numel(), dtype=torch.bool)\n"
     "        keep[w.abs().reshape(-1).argsort()[:k]] = False\n        out[n] = keep.view(w.shape)\n    return out\n",
     "one threshold on |w| for every tensor"),
    ("check_global_magnitude_masks", "per-tensor counts rounded and summed",
     edit("15", MASKS, "k = round(sparsity * flat.numel())",
          "k = sum(round(sparsity * weights[n].numel()) for n in names)"), "over the union"),
    ("check_global_magnitude_masks", "threshold on signed values",
     edit("15", MASKS, "weights[n].detach().abs().reshape(-1)", "weights[n].detach().reshape(-1)"),
     "prune the smallest magnitudes"),
    ("check_global_magnitude_masks", "count truncated, not rounded",
     edit("15", MASKS, "k = round(sparsity * flat.numel())", "k = int(sparsity * flat.numel())"),
     "expected round("),
    ("check_global_magnitude_masks", "masks as 0/1 floats",
     edit("15", MASKS, "masks[n] = keep[start : start + size].view(weights[n].shape)",
          "masks[n] = keep[start : start + size].view(weights[n].shape).float()"), "must be a bool tensor"),
    ("check_global_magnitude_masks", "prunes in place",
     edit("15", MASKS, "    return masks", "    for n in names:\n        weights[n].mul_(masks[n])\n    return masks"),
     "the weights were changed"),
    ("check_global_magnitude_masks", "torch's global_unstructured",
     "import torch, torch.nn as nn\nimport torch.nn.utils.prune as P\ndef global_magnitude_masks(weights, sparsity):\n"
     "    mods = {n: nn.Module() for n in weights}\n    for n, m in mods.items():\n"
     "        m.weight = nn.Parameter(weights[n].clone())\n"
     "    P.global_unstructured([(m, 'weight') for m in mods.values()], pruning_method=P.L1Unstructured,"
     " amount=sparsity)\n    return {n: m.weight_mask.bool() for n, m in mods.items()}\n", "switched off"),
    ("check_global_magnitude_masks", "torch's L1Unstructured on the concatenation",
     "import torch\nimport torch.nn.utils.prune as P\ndef global_magnitude_masks(weights, sparsity):\n"
     "    flat = torch.cat([w.reshape(-1) for w in weights.values()])\n"
     "    keep = P.L1Unstructured(sparsity).compute_mask(flat, torch.ones_like(flat)).bool()\n"
     "    out, at = {}, 0\n    for n, w in weights.items():\n"
     "        out[n] = keep[at:at + w.numel()].view(w.shape)\n        at += w.numel()\n    return out\n",
     "switched off"),
    ("check_global_magnitude_masks", "torch.ao's WeightNormSparsifier",
     "import torch, torch.nn as nn\nfrom torch.ao.pruning import WeightNormSparsifier\n"
     "def global_magnitude_masks(weights, sparsity):\n"
     "    WeightNormSparsifier(sparsity_level=sparsity, sparse_block_shape=(1, 1))\n    return {}\n",
     "switched off"),
    ("check_global_magnitude_masks", "the lab's magnitude_mask on the concatenation",
     "import torch\nfrom parallel_lab.compression import magnitude_mask as ours\n"
     "def global_magnitude_masks(weights, sparsity):\n    flat = torch.cat([w.reshape(-1) for w in weights.values()])\n"
     "    keep = ours(flat, sparsity)\n    out, at = {}, 0\n    for n, w in weights.items():\n"
     "        out[n] = keep[at:at + w.numel()].view(w.shape)\n        at += w.numel()\n    return out\n",
     "switched off"),
    ("check_global_magnitude_masks", "the check's own masks",
     "from parallel_lab.grading.checks.compression import _reference_masks as global_magnitude_masks\n",
     "switched off"),
    # ---- exercise 2: the gradient by hand
    ("check_distillation_grad", "T² kept without the chain rule's 1/T",
     edit("15", GRAD, "soft = alpha * T * (", "soft = alpha * T * T * ("), "T times too large"),
    ("check_distillation_grad", "the 1/T without T²",
     edit("15", GRAD, "soft = alpha * T * (", "soft = alpha / T * ("), "T² times too small"),
    ("check_distillation_grad", "no mean over the batch",
     edit("15", GRAD, "return (soft + (1 - alpha) * hard) / n", "return soft + (1 - alpha) * hard"),
     "N times too large"),
    ("check_distillation_grad", "student and teacher swapped",
     edit("15", GRAD, "(p_student - p_teacher)", "(p_teacher - p_student)"), "wrong sign"),
    ("check_distillation_grad", "the hard term with softened probabilities",
     edit("15", GRAD, "hard = student_logits.softmax(dim=-1)", "hard = (student_logits / T).softmax(dim=-1)"),
     "the cross-entropy is at temperature 1"),
    ("check_distillation_grad", "the one-hot label left out",
     edit("15", GRAD, "hard[torch.arange(n), targets] -= 1", "pass"), "differs from the loss's"),
    ("check_distillation_grad", "torch.autograd.grad",
     "import torch\nfrom parallel_lab.grading.checks.compression import _loss\n" + SIG
     + "    s = s.clone().requires_grad_()\n    return torch.autograd.grad(_loss(s, t, y, T, alpha), s)[0]\n",
     "switched off"),
    ("check_distillation_grad", "Tensor.backward on the lab's loss",
     "import torch\nfrom parallel_lab.compression.distillation import distillation_loss\n" + SIG
     + "    s = s.clone().requires_grad_()\n    (alpha * T * T * torch.nn.functional.kl_div((s / T).log_softmax(-1),"
     " (t / T).log_softmax(-1), log_target=True, reduction='batchmean') + (1 - alpha) *"
     " torch.nn.functional.cross_entropy(s, y)).backward()\n    return s.grad\n",
     "switched off"),
    ("check_distillation_grad", "the lab's loss, differentiated",
     "import torch\nfrom parallel_lab.compression import distillation_loss as ours\n" + SIG
     + "    return ours(s, t, y, T, alpha)\n", "switched off"),
    ("check_distillation_grad", "torch.func.grad",
     "import torch\nfrom torch.func import grad\nfrom parallel_lab.grading.checks.compression import _loss\n" + SIG
     + "    return grad(lambda x: _loss(x, t, y, T, alpha))(s)\n", "switched off"),
    ("check_distillation_grad", "torch.func.jacrev",
     "import torch\nfrom torch.func import jacrev\nfrom parallel_lab.grading.checks.compression import _loss\n" + SIG
     + "    return jacrev(lambda x: _loss(x, t, y, T, alpha))(s)\n", "switched off"),
    ("check_distillation_grad", "torch.autograd.functional.vjp",
     "import torch\nfrom torch.autograd.functional import vjp\nfrom parallel_lab.grading.checks.compression import _loss\n"
     + SIG + "    return vjp(lambda x: _loss(x, t, y, T, alpha), s)[1]\n", "switched off"),
    ("check_distillation_grad", "forward-mode AD, one class at a time",
     "import torch\nimport torch.autograd.forward_ad as fwAD\nfrom parallel_lab.grading.checks.compression import _loss\n"
     + SIG + "    out = torch.zeros_like(s)\n    with fwAD.dual_level():\n        for i in range(s.numel()):\n"
     "            d = torch.zeros_like(s).view(-1)\n            d[i] = 1\n"
     "            out.view(-1)[i] = fwAD.unpack_dual(_loss(fwAD.make_dual(s, d.view_as(s)), t, y, T, alpha)).tangent\n"
     "    return out\n", "switched off"),
    ("check_distillation_grad", "the C++ engine called directly",
     "import torch\nfrom torch.autograd.variable import Variable\nfrom parallel_lab.grading.checks.compression import _loss\n"
     + SIG + "    x = s.clone().requires_grad_()\n    loss = _loss(x, t, y, T, alpha)\n"
     "    return Variable._execution_engine.run_backward((loss,), (torch.ones_like(loss),), False, False, (x,), False, False)[0]\n",
     "recorded an autograd graph"),
]  # fmt: skip


@pytest.mark.parametrize("check", CHECKS)
def test_the_solution_passes_with_one_line(check, capsys):
    solution_namespace("15")  # the imports first: what they print is not the check's
    capsys.readouterr()
    run_check("15", check)
    out, err = capsys.readouterr()
    assert out.splitlines() == [out.splitlines()[0]] and out.startswith(f"{check} passed") and not err


@pytest.mark.parametrize(("check", "label", "source", "want"), WRONG, ids=[w[1] for w in WRONG])
def test_a_wrong_answer_fails_saying_what_differed(check, label, source, want):
    with pytest.raises(AssertionError) as info:
        run_check("15", check, source)
    assert want in str(info.value), f"{label}: {info.value}"


def test_the_failure_shows_the_call():
    with pytest.raises(
        AssertionError, match=r"distillation_grad\(student_logits=<\d+x\d+ float64>.*temperature="
    ):
        run_check("15", "check_distillation_grad", edit("15", GRAD, "/ n", "/ (n + 1)"))
    with pytest.raises(AssertionError, match=r"global_magnitude_masks\(weights=\{'.*sparsity="):
        run_check("15", "check_global_magnitude_masks", WRONG[0][2])


def test_sorting_by_value_then_sign_is_still_right(capsys):
    """Another right design (torch.kthvalue for the threshold, then a comparison) passes: the values are distinct."""
    run_check("15", "check_global_magnitude_masks",
              "import torch\ndef global_magnitude_masks(weights, sparsity):\n"
              "    flat = torch.cat([w.abs().reshape(-1) for w in weights.values()])\n"
              "    k = round(sparsity * flat.numel())\n"
              "    cut = torch.kthvalue(flat, k).values if k else -1.0\n"
              "    return {n: w.abs() > cut for n, w in weights.items()}\n")  # fmt: skip
    assert "check_global_magnitude_masks passed" in capsys.readouterr().out


def test_the_checks_are_quick():
    import time

    ns = solution_namespace("15")
    for check in CHECKS:
        start = time.perf_counter()
        exec(compile(_check_cell("15", check), "<check>", "exec"), ns)  # noqa: S102
        assert time.perf_counter() - start < 2.0, check  # about 0.02 s alone; room for a busy machine


# ----------------------------------------------------------------------------- cases drawn at grade time
def test_a_table_of_one_grade_runs_masks_fails_the_next():
    table_cheat_fails("15", MASKS, "check_global_magnitude_masks", {}, "expected a dict",
                      key=lambda w, s: (tuple((n, x.numpy().tobytes()) for n, x in w.items()), s))  # fmt: skip


def test_a_table_of_one_grade_runs_gradients_fails_the_next():
    import torch

    table_cheat_fails("15", GRAD, "check_distillation_grad", torch.zeros(1), "expected a tensor of shape",
                      key=lambda s, t, y, T, a: (s.numpy().tobytes(), t.numpy().tobytes(), T, a))  # fmt: skip


# ----------------------------------------------------------------------------- torch's own versions
# Names of torch's functions and classes that prune weights by magnitude (or by norm) or make pruning masks.
JOB = re.compile(
    r"^[ \t]*(?:class|def) (_?\w*(?:Sparsifier|Pruner|PruningMethod|[Uu]nstructured|[Mm]agnitude_?[Pp]run"
    r"|toprune)\w*)",
    re.M,
)


def test_torchs_own_versions_of_an_exercise_are_switched_off():
    """torch's pruners (found by name in torch's source) are all in the mask check's switched-off list: a new
    torch that adds one fails here, not in a learner's notebook."""
    import torch

    from parallel_lab.grading.checks import compression

    root = Path(torch.__file__).parent
    off = compression.PRUNE_FORBIDDEN
    found = {}
    for f in root.rglob("*.py"):
        text = f.read_text(encoding="utf-8", errors="ignore")
        if not JOB.search(text) or "testing" in f.parts or "test" in f.stem or "lightning" in f.parts:
            continue
        module = ".".join(f.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        found.setdefault(module, []).extend(m.group(1) for m in JOB.finditer(text))
    assert "torch.nn.utils.prune" in found, "the search finds nothing: torch's layout changed"
    missing = {
        m: [n for n in names if not any(k.startswith(m + ".") and n in k.split(".") for k in off)]
        for m, names in found.items()
    }
    missing = {m: names for m, names in missing.items() if names}
    assert not missing, f"torch functions doing an exercise's job, not switched off: {missing}"


def test_every_way_to_differentiate_is_switched_off():
    """torch's public differentiation entry points are all in the gradient check's switched-off list."""

    from parallel_lab.grading.checks import compression

    off = compression.GRAD_FORBIDDEN
    for name in ("grad", "grad_and_value", "vjp", "jvp", "jacrev", "jacfwd", "hessian", "linearize"):
        assert f"torch.func.{name}" in off, name
    for name in ("torch.autograd.grad", "torch.autograd.backward", "torch.Tensor.backward",
                 "torch.autograd.graph._engine_run_backward", "torch.autograd.functional.vjp",
                 "torch.autograd.functional.jacobian", "torch.autograd.forward_ad.make_dual"):  # fmt: skip
        assert name in off, name


@pytest.mark.parametrize(
    ("check", "source"),
    [
        ("check_global_magnitude_masks", "def global_magnitude_masks(weights, sparsity):\n    raise NotImplementedError('todo')\n"),
        ("check_distillation_grad", SIG + "    raise NotImplementedError('todo')\n"),
    ],
)  # fmt: skip
def test_an_unfinished_exercise_stays_not_implemented(check, source):
    with pytest.raises(NotImplementedError, match="todo"):
        run_check("15", check, source)
