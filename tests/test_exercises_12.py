"""Lesson 12's exercises: affine (zero-point) quantization per group, the integer product with a zero point
handled outside the product (the lesson quantizes symmetrically), and the exact worst error over a span of a
quantizer calibrated on another range (narrow spans, the zero point's rounding, clamping).
Each: the solution passes, the wrong algorithms below fail naming the mistake, torch's quantization and the lab's
int8 code are switched off, and an answer table logged in one grade run fails the next."""

from __future__ import annotations

import contextlib
import io
import random

import pytest
from solution_code import edit, run_check, solution_namespace, table_cheat_fails


def test_the_solutions_pass(capsys):
    for check in ("check_quantize_affine", "check_int8_matmul_zp", "check_affine_worst_error"):
        run_check("12", check)
    assert capsys.readouterr().out.count(" passed: ") == 3


Q = "quantize_affine"


@pytest.mark.parametrize(
    "wrong, match",
    [
        # the range not widened to hold 0: an all-positive group gets no exact zero
        (edit("12", Q, "lo = xg.amin(-1).clamp(max=0.0)", "lo = xg.amin(-1)"), "scale"),
        # 256 steps for 256 codes
        (edit("12", Q, "((hi - lo) / 255)", "((hi - lo) / 256)"), "scale"),
        # the zero point truncated instead of rounded
        (edit("12", Q, "(-torch.round(lo / scale)).to(torch.int64)", "(-lo / scale).to(torch.int64)"), "zero_point"),
        # one scale for the whole tensor
        (edit("12", Q, "lo = xg.amin(-1).clamp(max=0.0)", "lo = xg.amin().clamp(max=0.0).expand(xg.shape[:-1])")
         .replace("hi = xg.amax(-1).clamp(min=0.0)", "hi = xg.amax().clamp(min=0.0).expand(xg.shape[:-1])"), "scale"),
    ],
    ids=["no-zero-in-range", "256-steps", "truncated-zero-point", "per-tensor"],
)  # fmt: skip
def test_wrong_quantizers_fail(wrong, match):
    with pytest.raises(AssertionError, match=match):
        run_check("12", "check_quantize_affine", wrong)


MM = "int8_matmul_zp"


@pytest.mark.parametrize(
    "wrong, match",
    [
        # qa shifted by the zero point before the product (the dequantized-then-multiplied way)
        ("import torch\ndef int8_matmul_zp(qa, sa, za, qb, sb):\n"
         "    return ((qa.to(torch.int32) - za) @ qb.to(torch.int32)).float() * (sa * sb)\n", "qa shifted by -"),
        # floats all the way
        ("import torch\ndef int8_matmul_zp(qa, sa, za, qb, sb):\n"
         "    return ((qa.float() - za) * sa) @ (qb.float() * sb)\n", "torch.float32"),
        # the stored bytes, but multiplied as float64 (exact here, but not an integer kernel)
        (edit("12", MM, "acc = qa.to(torch.int32) @ qb32", "acc = (qa.double() @ qb32.double()).long()"), "torch.float64 .*the stored qa"),
        # the integer product run for show, the result computed from broadcast float products
        ("import torch\ndef int8_matmul_zp(qa, sa, za, qb, sb):\n    qa.long() @ qb.long()\n"
         "    acc = ((qa.long() - za)[:, :, None] * qb.long()[None]).sum(1)\n    return acc.float() * (sa * sb)\n",
         "does not come from the integer product"),
        # the zero point forgotten
        (edit("12", MM, "acc = acc - za * qb32.sum(0, keepdim=True)", "pass"), "wrong value"),
        # row sums of qa instead of column sums of qb
        (edit("12", MM, "za * qb32.sum(0, keepdim=True)", "za * qa.to(torch.int32).sum(1, keepdim=True)"), "wrong value|size"),
        # an int16 accumulator: wraps long before the sum is done
        (edit("12", MM, "return acc.float() * (sa * sb)", "return acc.to(torch.int16).float() * (sa * sb)"), "wrong value"),
    ],
    ids=["shift-then-multiply", "floats", "float64-product", "product-for-show", "no-zero-point", "row-sums",
         "int16-accumulator"],
)  # fmt: skip
def test_wrong_products_fail(wrong, match):
    with pytest.raises((AssertionError, RuntimeError), match=match):
        run_check("12", "check_int8_matmul_zp", wrong)


@pytest.mark.parametrize(
    "right",
    [
        # einsum: torch runs it as bmm on (1, n, k) and (1, k, m) views
        edit("12", MM, "acc = qa.to(torch.int32) @ qb32", "acc = torch.einsum('ik,kj->ij', qa.to(torch.int32), qb32)"),
        # the column sums as a product with ones
        edit("12", MM, "za * qb32.sum(0, keepdim=True)", "za * (torch.ones(1, qb32.shape[0], dtype=torch.int32) @ qb32)"),
        # widened to int64
        edit("12", MM, "qb32 = qb.to(torch.int32)", "qb32 = qb.long()").replace("qa.to(torch.int32)", "qa.long()"),
    ],
    ids=["einsum", "sums-as-product-with-ones", "int64"],
)  # fmt: skip
def test_other_right_products_pass(right, capsys):
    run_check("12", "check_int8_matmul_zp", right)
    assert " passed: " in capsys.readouterr().out


WORST = "affine_worst_error"
_HEAD = "import math\nimport torch\ndef affine_worst_error(cmin, cmax, xmin, xmax):\n"
_QPARAMS = "    lo, hi = min(cmin, 0.0), max(cmax, 0.0)\n    s = (hi - lo) / 255\n    zp = min(255, max(0, -round(lo / s)))\n"


@pytest.mark.parametrize(
    "wrong, match",
    [
        # the lesson's half a step, whatever the span
        (_HEAD + _QPARAMS + "    return s / 2\n", r"xmin=4.0, xmax=4.005\).*no value of the span errs that much"),
        # the calibrated range's own half step: the span ignored
        (_HEAD + "    return (max(cmax, 0.0) - min(cmin, 0.0)) / 255 / 2\n", r"xmin=4.0, xmax=4.005"),
        # the grid placed at the range's bottom, as if the zero point were not rounded to a code
        (_HEAD + _QPARAMS + "    g = lambda x: lo + min(255, max(0, round((x - lo) / s))) * s\n"
         "    mids = [lo + (k + 0.5) * s for k in range(255) if xmin <= lo + (k + 0.5) * s <= xmax]\n"
         "    return max([abs(xmin - g(xmin)), abs(xmax - g(xmax))] + [s / 2 for _ in mids])\n",
         r"xmin=-1.3, xmax=-1.298"),
        # no clamping: every value within half a step of some grid value
        (_HEAD + _QPARAMS + "    g = lambda x: (round(x / s) + zp - zp) * s\n"
         "    mids = [m for q in range(-1000, 1000) if xmin <= (m := (q + 0.5) * s) <= xmax]\n"
         "    return max([abs(xmin - g(xmin)), abs(xmax - g(xmax))] + [s / 2 for _ in mids])\n",
         r"xmin=-0.05, xmax=0.05\).*quantizing x = "),
    ],
    ids=["half-step", "calibrated-range-only", "zero-point-not-rounded", "no-clamping"],
)  # fmt: skip
def test_wrong_worst_errors_fail(wrong, match):
    with pytest.raises(AssertionError, match=match):
        run_check("12", "check_affine_worst_error", wrong)


def test_the_reference_passes_500_grade_runs():
    """The old exercise's answer (half a step) failed about one grade run in twenty on spans narrower than a step;
    the exact worst error must pass every run."""
    from parallel_lab.grading.checks.quantization import check_affine_worst_error

    fn = solution_namespace("12")[WORST]
    for _ in range(500):
        with contextlib.redirect_stdout(io.StringIO()):
            check_affine_worst_error(fn)


def test_the_checks_exact_worst_error_is_torchs():
    """The check's exact value equals the largest error torch's quantizer makes on dense float32 values over the
    span (the point the check names included), within the check's tolerance, over many drawn cases."""
    import warnings

    import torch

    from parallel_lab.grading.checks.quantization import _exact_worst, _observed, _worst_error_cases

    rnd = random.Random(0)
    for _ in range(15):
        for what, (cmin, cmax, xmin, xmax) in _worst_error_cases(rnd):
            exact, at = _exact_worst(cmin, cmax, xmin, xmax)
            scale, zp = _observed(torch.tensor([cmin, cmax]))
            x = torch.cat(
                [torch.linspace(xmin, xmax, 100_001, dtype=torch.float64), torch.tensor([at])]
            ).float()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                back = torch.quantize_per_tensor(x, scale, zp, torch.quint8).dequantize()
            measured = (x.double() - back.double()).abs().max().item()
            tol = 2e-6 * max(abs(cmin), abs(cmax), abs(xmin), abs(xmax)) + 1e-9
            assert abs(measured - exact) <= tol, (what, (cmin, cmax, xmin, xmax), exact, measured)


@pytest.mark.parametrize(
    "cheat, check",
    [
        ("import torch\ndef quantize_affine(x, group):\n    torch.quantize_per_tensor(x, 1.0, 0, torch.quint8)\n",
         "check_quantize_affine"),
        ("from torch.ao.quantization.observer import MinMaxObserver\ndef quantize_affine(x, group):\n"
         "    MinMaxObserver().calculate_qparams()\n", "check_quantize_affine"),
        ("import torch\ndef int8_matmul_zp(qa, sa, za, qb, sb):\n    torch._int_mm(qa, qb)\n", "check_int8_matmul_zp"),
        ("from parallel_lab.quantization import int8\ndef affine_worst_error(cmin, cmax, xmin, xmax):\n"
         "    int8.absmax_scale(None)\n", "check_affine_worst_error"),
        ("import torch\ndef quantize_affine(x, group):\n    torch.quantize_per_tensor_dynamic(x, torch.quint8, False)\n",
         "check_quantize_affine"),
        ("import torch\ndef quantize_affine(x, group):\n    torch.ops.aten.quantize_per_tensor(x, 1.0, 0, torch.quint8)\n",
         "check_quantize_affine"),
        ("import torch\nimport torch.ao.quantization.fx._decomposed\ndef quantize_affine(x, group):\n"
         "    torch.ops.quantized_decomposed.quantize_per_tensor(x, 1.0, 0, 0, 255, torch.uint8)\n", "check_quantize_affine"),
        ("import torch\ndef quantize_affine(x, group):\n    torch.ops.aten._choose_qparams_per_tensor(x, False)\n",
         "check_quantize_affine"),
        ("import torch\ndef quantize_affine(x, group):\n    torch.ops.aten.quantize_per_channel(x, torch.ones(x.shape[0]),"
         " torch.zeros(x.shape[0], dtype=torch.long), 0, torch.quint8)\n", "check_quantize_affine"),
        ("import torch\ndef affine_worst_error(cmin, cmax, xmin, xmax):\n"
         "    torch.ops.aten.quantize_per_tensor(torch.tensor([xmin]), 1.0, 0, torch.quint8)\n", "check_affine_worst_error"),
        ("import torch\ndef int8_matmul_zp(qa, sa, za, qb, sb):\n    torch.ops.aten.quantize_per_tensor(sa, 1.0, 0, torch.quint8)\n",
         "check_int8_matmul_zp"),
    ],
    ids=["torch-quantize", "torch-observer", "torch-int-mm", "lab-int8", "torch-dynamic", "aten-quantize",
         "quantized-decomposed", "aten-choose-qparams", "aten-per-channel", "aten-in-worst-error", "aten-in-matmul"],
)  # fmt: skip
def test_torch_and_lab_quantization_are_switched_off(cheat, check):
    with pytest.raises(AssertionError, match="switched off"):
        run_check("12", check, cheat)


def test_a_table_of_one_runs_worst_errors_fails_the_next():
    table_cheat_fails("12", WORST, "check_affine_worst_error", 0.0, "you say 0;", tries=3)


# torch modules whose quantization-named functions cannot quantize a learner's tensor, by why
_NOT_THE_JOB = {
    "torch._inductor.lowering": "compiler lowerings (IR, not tensors)",
    "torch._inductor.fx_passes.quantization": "graph patterns",
    "torch._meta_registrations": "shape functions",
    "torch.ao.ns.fx.graph_passes": "graph rewriting",
    "torch.onnx._internal.torchscript_exporter.symbolic_opset10": "graph exporters",
    "torch.onnx._internal.torchscript_exporter.symbolic_opset13": "graph exporters",
    "torch.testing._internal.common_quantized": "imports only with torch's test dependencies (expecttest)",
    "torch.testing._internal.common_quantization": "imports only with torch's test dependencies (expecttest)",
}


def test_torchs_own_quantizers_are_switched_off():
    """torch's Python functions named for quantizing or choosing qparams (found in torch's source) are switched
    off while the learner's functions run, or listed above with the reason they cannot do the job."""
    import importlib
    import re
    from pathlib import Path

    import torch

    from parallel_lab.grading.checks.quantization import FORBIDDEN

    job = re.compile(
        r"^\s*def (\w*(?:quantize_per_(?:tensor|channel|group|token)|choose_qparams|quantize_affine)\w*)\(",
        re.M,
    )
    root = Path(torch.__file__).parent
    found: dict[str, list[str]] = {}
    for f in root.rglob("*.py"):
        text = f.read_text(encoding="utf-8", errors="ignore")
        module = ".".join(f.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        for m in job.finditer(text):
            found.setdefault(module, []).append(m.group(1))
    assert "torch.ao.quantization.fx._decomposed" in found, "the search finds nothing: torch's layout changed"
    missing = {
        module: [
            n for n in names if not any(k.startswith(module + ".") and n in k.split(".") for k in FORBIDDEN)
        ]
        for module, names in found.items()
        if module not in _NOT_THE_JOB
    }
    # a function defined inside another (or a method) is not an attribute of its module: its outer one is checked
    missing = {
        m: [n for n in names if hasattr(importlib.import_module(m), n)]
        for m, names in missing.items()
        if names
    }
    missing = {m: n for m, n in missing.items() if n}
    assert not missing, f"torch quantizers not switched off: {missing}"


@pytest.mark.parametrize(
    "cheat",
    [
        "import torch\nfrom torch.ao.quantization.fx._decomposed import choose_qparams_tensor\n"
        "def quantize_affine(x, group):\n    choose_qparams_tensor(x, 0, 255, 1e-7, torch.uint8)\n",
        "import torch\nfrom torch._inductor.decomposition import choose_qparams_tensor\n"
        "def quantize_affine(x, group):\n    choose_qparams_tensor(x, 0, 255, 1e-7, torch.uint8)\n",
    ],
    ids=["decomposed-qparams", "inductor-qparams"],
)
def test_torchs_python_quantizers_are_switched_off(cheat):
    with pytest.raises(AssertionError, match="switched off"):
        run_check("12", "check_quantize_affine", cheat)
