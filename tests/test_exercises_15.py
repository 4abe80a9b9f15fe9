"""Lesson 15's exercises: the reference solution passes with one line; wrappers of the lab's and torch's pruning,
every way of letting torch differentiate, answer tables from an earlier grade run and wrong algorithms fail,
each with a message naming what differed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from solution_code import (
    _check_cell,
    _solution_cell,
    edit,
    fails_saying,
    run_check,
    solution_namespace,
    table_cheat_fails,
)

CHECKS = ["check_global_magnitude_masks", "check_distillation_grad"]
MASKS, GRAD = "global_magnitude_masks", "distillation_grad"
SIG = "def distillation_grad(s, t, y, T, alpha):\n"

_L = (
    "import torch\n"
    "def L(s, t, y, T, alpha):\n"
    "    log_ps, log_pt = (s / T).log_softmax(-1), (t / T).log_softmax(-1)\n"
    "    kl = (log_pt.exp() * (log_pt - log_ps)).sum(-1).mean()\n"
    "    ce = -s.log_softmax(-1).gather(1, y[:, None]).mean()\n"
    "    return alpha * T * T * kl + (1 - alpha) * ce\n"
)
_ENGINE = (
    "        x = s.clone().requires_grad_()\n        loss = _loss(x, t, y, T, alpha)\n"
    "        return Variable._execution_engine.run_backward((loss,), (torch.ones_like(loss),), False, False, (x,),"
    " False, False)[0]\n"
)
_FD = "a numerical derivative is refused"
#: numerical derivatives and ways round the graph check, each refused while the learner's function runs
CHEATS = {
    # the reviewer's three numerical derivatives: each matched autograd to 1e-10 in some grade runs
    "complex step, h = 1e-30": (_L.replace("def L(", "def _unused(") + SIG
        + "    s = s.to(torch.complex128)\n    g = torch.zeros(s.shape, dtype=torch.float64)\n    def Lc(s):\n"
        "        ls = s / T - (s / T).exp().sum(-1, keepdim=True).log()\n        lt = (t / T).log_softmax(-1)\n"
        "        l1 = s - s.exp().sum(-1, keepdim=True).log()\n"
        "        return alpha * T * T * (lt.exp() * (lt - ls)).sum(-1).mean() - (1 - alpha) * l1[torch.arange(len(y)), y].mean()\n"
        "    for i in range(s.shape[0]):\n        for j in range(s.shape[1]):\n"
        "            d = torch.zeros_like(s)\n            d[i, j] = 1e-30j\n            g[i, j] = Lc(s + d).imag / 1e-30\n"
        "    return g\n", "complex numbers are refused"),
    "Richardson-extrapolated central differences, h = 1e-3": (_L + SIG
        + "    g = torch.zeros_like(s)\n    def c(i, j, h):\n        d = torch.zeros_like(s)\n        d[i, j] = h\n"
        "        return (L(s + d, t, y, T, alpha) - L(s - d, t, y, T, alpha)) / (2 * h)\n"
        "    for i in range(s.shape[0]):\n        for j in range(s.shape[1]):\n"
        "            g[i, j] = (4 * c(i, j, 5e-4) - c(i, j, 1e-3)) / 3\n    return g\n", _FD),
    "central differences": (_L + SIG
        + "    g = torch.zeros_like(s)\n    for i in range(s.shape[0]):\n        for j in range(s.shape[1]):\n"
        "            d = torch.zeros_like(s)\n            d[i, j] = 6e-6\n"
        "            g[i, j] = (L(s + d, t, y, T, alpha) - L(s - d, t, y, T, alpha)) / 1.2e-5\n    return g\n", _FD),
    # the lean kind: only the row a logit is in, a row's V nudges at once, Richardson for the accuracy
    "row by row, every class at once, Richardson": ("import torch\n" + SIG
        + "    n, v = s.shape\n    pt = (t / T).softmax(-1)\n    E = torch.eye(v, dtype=s.dtype)\n    def r(x, i):\n"
        "        return -alpha * T * T * (pt[i] * (x / T).log_softmax(-1)).sum(-1) - (1 - alpha) * x.log_softmax(-1)[:, y[i]]\n"
        "    def c(i, h):\n        return (r(s[i] + h * E, i) - r(s[i] - h * E, i)) / (2 * h)\n"
        "    return torch.stack([(4 * c(i, 5e-4) - c(i, 1e-3)) / 3 for i in range(n)]) / n\n", _FD),
    "the logits read out as Python floats": ("import torch\n" + SIG
        + "    vals = [[float(s[i, j]) for j in range(s.shape[1])] for i in range(s.shape[0])]\n"
        + _solution_cell("15", GRAD).split(":\n", 1)[1].replace("student_logits", "s").replace("teacher_logits", "t")
          .replace("targets", "y").replace("temperature", "T"), "Python numbers one at a time"),
    "the logits moved to numpy": ("import torch\n" + SIG + "    s.numpy()\n    return s\n", "torch.Tensor.numpy is switched off"),
    "the logits as a list": ("import torch\n" + SIG + "    s.tolist()\n    return s\n", "torch.Tensor.tolist is switched off"),
    "torch's softmax backward kernel": ("import torch\n" + SIG
        + "    ps, pt, p1 = (s / T).softmax(-1), (t / T).softmax(-1), s.softmax(-1)\n"
        "    hot = torch.nn.functional.one_hot(y, s.shape[1]).double()\n    bw = torch.ops.aten._softmax_backward_data\n"
        "    return (alpha * T * bw(-pt / ps, ps, -1, s.dtype) + (1 - alpha) * bw(-hot / p1, p1, -1, s.dtype)) / len(y)\n",
        "aten._softmax_backward_data"),
    "torch's log-softmax backward kernel": ("import torch\n" + SIG
        + "    return torch.ops.aten._log_softmax_backward_data(torch.ones_like(s), s.log_softmax(-1), -1, s.dtype)\n",
        "aten._log_softmax_backward_data"),
    "torch's nll_loss backward kernel": ("import torch\n" + SIG
        + "    one = torch.tensor(1.0, dtype=s.dtype)\n"
        "    return torch.ops.aten.nll_loss_backward(one, s.log_softmax(-1), y, None, 1, -100, one * len(y))\n",
        "aten.nll_loss_backward"),
    "the learner's own saved-tensor hooks around the C++ engine": ("import torch\nfrom torch.autograd.variable import "
        "Variable\nfrom parallel_lab.grading.checks.compression import _loss\n" + SIG
        + "    with torch.autograd.graph.saved_tensors_hooks(lambda x: x, lambda x: x):\n" + _ENGINE, "requires grad"),
    "autograd on a thread of its own": ("import torch, threading\nfrom torch.autograd.variable import Variable\n"
        "from parallel_lab.grading.checks.compression import _loss\n" + SIG
        + "    out = []\n    def work():\n        out.append(run())\n    def run():\n" + _ENGINE
        + "    th = threading.Thread(target=work)\n    th.start()\n    th.join()\n    return out[0]\n",
        "threading.Thread.start is switched off"),
    "autograd in a thread pool": ("import torch\nfrom concurrent.futures import ThreadPoolExecutor\n"
        "from torch.autograd.variable import Variable\nfrom parallel_lab.grading.checks.compression import _loss\n"
        + SIG + "    def run():\n" + _ENGINE + "    with ThreadPoolExecutor(1) as pool:\n        return pool.submit(run).result()\n",
        "threading.Thread.start is switched off"),
}  # fmt: skip

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
     edit("15", GRAD, "soft = alpha * T * (", "soft = alpha * T * T * ("), "off by a factor of T (too large)"),
    ("check_distillation_grad", "the 1/T without T²",
     edit("15", GRAD, "soft = alpha * T * (", "soft = alpha / T * ("), "off by a factor of T² (too small)"),
    ("check_distillation_grad", "no mean over the batch",
     edit("15", GRAD, "return (soft + (1 - alpha) * hard) / n", "return soft + (1 - alpha) * hard"),
     "off by a factor of N"),
    ("check_distillation_grad", "student and teacher swapped",
     edit("15", GRAD, "(p_student - p_teacher)", "(p_teacher - p_student)"), "wrong sign"),
    ("check_distillation_grad", "the hard term with softened probabilities",
     edit("15", GRAD, "hard = student_logits.softmax(dim=-1)", "hard = (student_logits / T).softmax(dim=-1)"),
     "the hard term differs"),
    ("check_distillation_grad", "the one-hot label left out",
     edit("15", GRAD, "hard[torch.arange(n, device=hard.device), targets] -= 1", "pass"), "differs from the loss's"),
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
     "requires grad"),
] + [("check_distillation_grad", label, source, want) for label, (source, want) in CHEATS.items()]  # fmt: skip


@pytest.mark.parametrize("check", CHECKS)
def test_the_solution_passes_with_one_line(check, capsys):
    solution_namespace("15")  # the imports first: what they print is not the check's
    capsys.readouterr()
    run_check("15", check)
    out, err = capsys.readouterr()
    assert out.splitlines() == [out.splitlines()[0]] and out.startswith(f"{check} passed") and not err


@pytest.mark.parametrize(("check", "label", "source", "want"), WRONG, ids=[w[1] for w in WRONG])
def test_a_wrong_answer_fails_saying_what_differed(check, label, source, want):
    fails_saying("15", check, label, source, want)


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

    raw = torch._C.TensorBase.numpy  # the key only: Tensor.numpy is switched off while the check runs
    table_cheat_fails("15", GRAD, "check_distillation_grad", torch.zeros(1), "expected a tensor of shape",
                      key=lambda s, t, y, T, a: (raw(s).tobytes(), raw(t).tobytes(), T, a))  # fmt: skip


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


def test_a_near_miss_names_no_slip_that_equals_the_answer():
    """On one row, "N times too large" is the right gradient: an answer off by 3e-10 there is told only that it
    differs, not that it made a slip whose value is the expected one."""
    import torch

    from parallel_lab.grading.checks.compression import _mistake

    ns = solution_namespace("15")
    g = torch.Generator().manual_seed(0)
    for n, v, T, alpha in [(1, 5, 3.0, 0.5), (4, 7, 1.0, 0.3), (3, 6, 2.5, 0.0), (5, 4, 4.0, 1.0)]:
        s, t = (
            torch.randn(n, v, generator=g, dtype=torch.float64),
            torch.randn(n, v, generator=g, dtype=torch.float64),
        )
        y = torch.randint(v, (n,), generator=g)
        want = ns[GRAD](s, t, y, T, alpha)
        assert _mistake(want + 3e-10, want, s, t, y, T, alpha) == "", (n, T, alpha)
    with pytest.raises(AssertionError) as info:
        run_check("15", "check_distillation_grad", edit("15", GRAD, "return (soft + (1 - alpha) * hard) / n",
                                                        "return (soft + (1 - alpha) * hard) / n + 3e-10"))  # fmt: skip
    assert "differs from the loss's" in str(info.value) and "(" not in str(info.value).split("up to")[1]


def test_a_gradient_by_hand_row_by_row_is_not_taken_for_a_finite_difference(capsys):
    """The work bound leaves room for a slow hand-written gradient: a loop over the rows, softmax spelled out."""
    run_check("15", "check_distillation_grad", SIG
              + "    import torch\n    out = torch.empty_like(s)\n    for i in range(s.shape[0]):\n"
              "        a = (s[i] / T).exp() / (s[i] / T).exp().sum()\n        b = (t[i] / T).exp() / (t[i] / T).exp().sum()\n"
              "        c = s[i].exp() / s[i].exp().sum()\n        c[y[i]] = c[y[i]] - 1\n"
              "        out[i] = (alpha * T * (a - b) + (1 - alpha) * c) / s.shape[0]\n    return out\n")  # fmt: skip
    assert "check_distillation_grad passed" in capsys.readouterr().out


def test_the_answers_keep_the_inputs_device():
    """The solution and the check's reference build every tensor on the weights' device (on CUDA, a mask made on
    the CPU and indexed by CUDA indices raises): on the meta device, every mask and gradient stays there."""
    import torch

    from parallel_lab.grading.checks.compression import _reference_masks

    ns = solution_namespace("15")
    w = {"a": torch.randn(3, 4, device="meta"), "b": torch.randn(5, device="meta")}
    for fn in (ns[MASKS], _reference_masks):
        assert {m.device.type for m in fn(w, 0.5).values()} == {"meta"}
    s = torch.randn(3, 4, device="meta", dtype=torch.float64)
    assert ns[GRAD](s, s, torch.zeros(3, dtype=torch.long, device="meta"), 2.0, 0.5).device.type == "meta"
