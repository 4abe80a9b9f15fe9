"""Lesson 18's exercises: the reference solution passes; wrappers of the lab's, torch's and torchao's functions,
answer tables from an earlier grade run and wrong algorithms fail, each with a message naming what differed;
the rounding reference equals torch's E5M2 cast and torchao's MX casts."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch
from solution_code import (
    _check_cell,
    edit,
    fails_saying,
    functions_doing,
    passes_with_one_line,
    run_check,
    solution_namespace,
)

CHECKS = ["check_round_float", "check_ef_sign", "check_smallest_margin"]

WRONG = [
    # ---- exercise 1: round_float
    ("check_round_float", "subnormals flushed",
     edit("18", "round_float", "a.clamp_min(2.0 ** (1 - bias))", "a.clamp_min(2.0 ** (-200))"), "subnormal"),
    ("check_round_float", "the bias off by one", edit("18", "round_float", "bias = 2 ** (exp_bits - 1) - 1",
                                                      "bias = 2 ** (exp_bits - 1)"), "expected"),
    ("check_round_float", "ties away from zero",
     edit("18", "round_float", "torch.round(a / spacing)", "torch.floor(a / spacing + 0.5)"), "last mantissa bit is 0"),
    ("check_round_float", "the IEEE top for an MX format",
     edit("18", "round_float", "top = 2**exp_bits - 1 - int(ieee)", "top = 2**exp_bits - 2"), "no infinity"),
    ("check_round_float", "saturates where IEEE overflows",
     edit("18", "round_float", "torch.inf if ieee else largest", "largest"), "infinity"),
    ("check_round_float", "torch's own float8 cast",
     "import torch\ndef round_float(x, exp_bits, man_bits, ieee):\n    return x.to(torch.float8_e5m2).float()\n",
     "torch's cast would round for you"),
    ("check_round_float", "a half-precision detour",
     "import torch\ndef round_float(x, exp_bits, man_bits, ieee):\n    return x.half().float()\n",
     "torch's cast would round for you"),
    ("check_round_float", "the lab's fp8_round",
     "from parallel_lab.precision import fp8\ndef round_float(x, exp_bits, man_bits, ieee):\n"
     "    return fp8.fp8_round(x, 'e5m2')\n", "switched off"),
    ("check_round_float", "torchao's own rounding, imported inside",
     "def round_float(x, exp_bits, man_bits, ieee):\n    from torchao.prototype.custom_fp_utils import "
     "_f32_to_floatx_unpacked\n    return x\n", "switched off"),
    ("check_round_float", "torchao's rounding loaded from its file",
     "import importlib.util, os, torch\n"
     "def round_float(x, exp_bits, man_bits, ieee):\n"
     "    spec = importlib.util.find_spec('torchao')\n"
     "    path = os.path.join(spec.submodule_search_locations[0], 'prototype', 'custom_fp_utils.py')\n"
     "    m = importlib.util.module_from_spec(importlib.util.spec_from_file_location('fp_utils', path))\n"
     "    m.__spec__.loader.exec_module(m)\n"
     "    return m._floatx_unpacked_to_f32(m._f32_to_floatx_unpacked(x, exp_bits, man_bits), exp_bits, man_bits)\n",
     "switched off"),
    ("check_round_float", "near-ties treated as ties",
     edit("18", "round_float", "    r = torch.round(a / spacing) * spacing  # torch.round sends halves to even",
          "    q = a / spacing\n    frac = q - torch.floor(q)\n"
          "    near = (frac - 0.5).abs() < 1e-5\n"
          "    r = torch.where(near, torch.round(torch.floor(q) + 0.5), torch.round(q)) * spacing"), "expected"),
    ("check_round_float", "torch's cast on a thread of its own",
     "import threading, torch\ndef round_float(x, exp_bits, man_bits, ieee):\n    out = []\n"
     "    t = threading.Thread(target=lambda: out.append(x.to(torch.float8_e5m2).float()))\n"
     "    t.start(); t.join()\n    return out[0]\n", "switched off"),
    # ---- exercise 2: ef_sign_step
    ("check_ef_sign", "no residual", edit("18", "ef_sign_step", "p = lr * grad + residual", "p = lr * grad"),
     "ignores the residual"),
    ("check_ef_sign", "an L2 scale", edit("18", "ef_sign_step", "p.abs().mean()", "p.norm()"), "not an L2 norm"),
    ("check_ef_sign", "the scale from the gradient",
     edit("18", "ef_sign_step", "p.abs().mean()", "(lr * grad).abs().mean()"), "not from the gradient alone"),
    ("check_ef_sign", "the learning rate after compression",
     "import torch\ndef ef_sign_step(grad, residual, lr):\n    p = grad + residual\n"
     "    delta = lr * p.abs().mean() * torch.sign(p)\n    return delta, p - delta\n", "learning rate"),
    ("check_ef_sign", "the residual of the unscaled sign",
     edit("18", "ef_sign_step", "return delta, p - delta", "return delta, p - torch.sign(p)"), "not p minus sign(p)"),
    ("check_ef_sign", "the residual dropped",
     edit("18", "ef_sign_step", "return delta, p - delta", "return delta, torch.zeros_like(p)"), "loses it"),
    ("check_ef_sign", "wraps the lab's compression",
     "from parallel_lab.data_parallel import compression\ndef ef_sign_step(grad, residual, lr):\n"
     "    compression.TopK(0.5).k(grad.numel())\n    return grad, residual\n", "switched off"),
    # ---- exercise 3: smallest_margin
    ("check_smallest_margin", "this step's amax in its own history",
     edit("18", "smallest_margin", "amaxes[max(0, t - length) : t]", "amaxes[max(0, t - length + 1) : t + 1]"),
     "still saturates"),
    ("check_smallest_margin", "the whole past, not the history",
     edit("18", "smallest_margin", "amaxes[max(0, t - length) : t]", "amaxes[:t]"), "saturates"),
    ("check_smallest_margin", "a logarithm rounded down",
     "import math\ndef smallest_margin(amaxes, largest, length):\n    need = 0\n    for t in range(1, len(amaxes)):\n"
     "        r = amaxes[t] / max(amaxes[max(0, t - length):t])\n        need = max(need, math.floor(math.log2(r)) if r > 1 "
     "else 0)\n    return need\n", "still saturates"),
    ("check_smallest_margin", "a float, not a count",
     "import math\ndef smallest_margin(amaxes, largest, length):\n    need = 0.0\n    for t in range(1, len(amaxes)):\n"
     "        need = max(need, math.log2(amaxes[t] / max(amaxes[max(0, t - length):t])))\n    return need\n",
     "must return an int"),
    ("check_smallest_margin", "always generous", "def smallest_margin(amaxes, largest, length):\n    return 12\n",
     "never saturates either"),
    ("check_smallest_margin", "asks the lab's recipe",
     "from parallel_lab.precision import fp8\ndef smallest_margin(amaxes, largest, length):\n"
     "    fp8.DelayedScaling('e4m3', length, 0)\n    return 0\n", "switched off"),
]  # fmt: skip


@pytest.mark.parametrize("check", CHECKS)
def test_the_solution_passes_with_one_line(check, capsys):
    passes_with_one_line("18", check, capsys)


@pytest.mark.parametrize(("check", "label", "source", "want"), WRONG, ids=[w[1] for w in WRONG])
def test_a_wrong_answer_fails_saying_what_differed(check, label, source, want):
    fails_saying("18", check, label, source, want)


def test_torchs_vendored_mx_helpers_are_switched_off_where_they_import():
    """torch._vendor.quack needs CUDA's Python bindings: where it imports, the check switches it off."""
    try:
        import torch._vendor.quack.mx_utils  # noqa: F401
    except ImportError:
        pytest.skip("torch._vendor.quack does not import here (no CUDA Python bindings)")
    cheat = "from torch._vendor.quack import mx_utils\ndef round_float(x, e, m, ieee):\n    return mx_utils.to_mxfp4(x)\n"
    with pytest.raises(AssertionError, match="switched off"):
        run_check("18", "check_round_float", cheat)


def test_the_rounding_reference_is_torchs_e5m2_cast():
    """IEEE-style rounding, overflow to inf included, is what torch's float8_e5m2 cast does."""
    from parallel_lab.grading.checks.fewer_bytes import _probe_values, _round_reference

    x = _probe_values(5, 2, True, torch.Generator().manual_seed(0))
    assert torch.equal(_round_reference(x, 5, 2, True), x.to(torch.float8_e5m2).float())


@pytest.mark.parametrize(("e", "m"), [(2, 1), (3, 2), (2, 3)])
def test_the_rounding_reference_is_torchaos_mx_cast(e, m):
    """The MX formats (no infinity, saturated) as torchao rounds them."""
    import importlib.util

    from parallel_lab.grading.checks.fewer_bytes import _probe_values, _round_reference, _values

    spec = importlib.util.find_spec(
        "torchao"
    )  # torchao's package __init__ needs CUDA libraries: load the file
    if spec is None:
        pytest.skip("torchao is not installed")
    path = Path(spec.origin).parent / "prototype" / "custom_fp_utils.py"
    fp = importlib.util.module_from_spec(
        importlib.util.spec_from_file_location("_torchao_custom_fp_utils", path)
    )
    fp.__spec__.loader.exec_module(fp)

    x = _probe_values(e, m, False, torch.Generator().manual_seed(1))
    assert float(_values(e, m, False)[-1]) == {(2, 1): 6.0, (3, 2): 28.0, (2, 3): 7.5}[(e, m)]
    theirs = fp._floatx_unpacked_to_f32(fp._f32_to_floatx_unpacked(x, e, m), e, m)
    assert torch.equal(_round_reference(x, e, m, False), theirs)


def _run(ns: dict, check: str) -> None:
    exec(compile(_check_cell("18", check), "<check>", "exec"), ns)  # noqa: S102


def test_a_table_of_one_runs_roundings_fails_the_next():
    """Per value and format: a table of every value one run rounded, answering the rest with the value itself."""
    ns = solution_namespace("18")
    real, table = ns["round_float"], {}

    def logging(x, e, m, ieee):
        out = real(x, e, m, ieee)
        table.update(((v, e, m, ieee), w) for v, w in zip(x.tolist(), out.tolist()))
        return out

    ns["round_float"] = logging
    _run(ns, "check_round_float")
    ns["round_float"] = lambda x, e, m, ieee: torch.tensor(
        [table.get((v, e, m, ieee), v) for v in x.tolist()]
    )
    with pytest.raises(AssertionError, match="round_float"):
        _run(ns, "check_round_float")


def test_a_table_of_one_runs_steps_fails_the_next():
    ns = solution_namespace("18")
    real, table = ns["ef_sign_step"], {}
    key = lambda g, r, lr: (g.numpy().tobytes(), r.numpy().tobytes(), lr)  # noqa: E731

    def logging(g, r, lr):
        table[key(g, r, lr)] = out = real(g, r, lr)
        return out

    ns["ef_sign_step"] = logging
    _run(ns, "check_ef_sign")
    ns["ef_sign_step"] = lambda g, r, lr: table.get(key(g, r, lr), (g, r))
    with pytest.raises(AssertionError, match="ef_sign_step"):
        _run(ns, "check_ef_sign")


def test_a_table_of_one_runs_margins_fails_the_next():
    ns = solution_namespace("18")
    real, table = ns["smallest_margin"], {}

    def logging(a, big, n):
        table[(tuple(a), big, n)] = out = real(a, big, n)
        return out

    ns["smallest_margin"] = logging
    _run(ns, "check_smallest_margin")
    ns["smallest_margin"] = lambda a, big, n: table.get((tuple(a), big, n), 0)
    with pytest.raises(AssertionError, match="smallest_margin"):
        _run(ns, "check_smallest_margin")


JOB = re.compile(
    r"^\s*def (_?f32_to_f(?:4|6)\w*|_f32_to_floatx_unpacked|to_mxfp\d\w*|to_nvfp4\w*|_fp4_e2m1fn_value_table|"
    r"_pack_fp4_e2m1fn_codes|to_fp8_saturated|fp16_compress_hook|bf16_compress_hook|quantization_\w+_hook)\b",
    re.M,
)


def test_torchs_own_versions_of_an_exercise_are_switched_off():
    """torch's (and, where installed, torchao's) functions that round to small formats or compress gradients are
    in the checks' switched-off lists: a new release that adds one fails here, not in a learner's notebook."""
    from parallel_lab.grading.checks import fewer_bytes as fb

    found = functions_doing(JOB)
    assert "torch.distributed.algorithms.ddp_comm_hooks.default_hooks" in found, "the search finds nothing"
    if importlib.util.find_spec("torchao") is not None:
        found.update(functions_doing(JOB, "torchao", skip=("testing", "test", "benchmarks")))
    covered = (*fb.TORCH_ROUNDING, *fb.TORCHAO_ROUNDING, *fb.EF_FORBIDDEN_MODULES)
    missing = {m: names for m, names in found.items() if m not in covered}
    assert not missing, f"functions doing an exercise's job, not switched off: {missing}"


@pytest.mark.parametrize(
    ("check", "source"),
    [
        ("check_round_float", "def round_float(x, e, m, ieee):\n    raise NotImplementedError('todo')\n"),
        ("check_ef_sign", "def ef_sign_step(g, r, lr):\n    raise NotImplementedError('todo')\n"),
        ("check_smallest_margin", "def smallest_margin(a, big, n):\n    raise NotImplementedError('todo')\n"),
    ],
)
def test_an_unfinished_exercise_stays_not_implemented(check, source):
    with pytest.raises(NotImplementedError, match="todo"):
        run_check("18", check, source)
