"""Lesson 06's exercises: how many steps GradScaler skips over a whole run (the lesson runs its rule one step
at a time), bf16 weights kept with compensated summation instead of fp32 masters, and the smallest update a weight feels in four formats (the lesson shows
fp16 next to 1.0). Each check draws its cases afresh every grade run: an answer table logged in one run fails
the next; wrong algorithms fail naming the mistake; torch's GradScaler and the lab's scaler are switched off."""

from __future__ import annotations

import pytest
from solution_code import edit, run_check, table_cheat_fails


def test_the_solutions_pass(capsys):
    for check in ("check_skipped_steps", "check_compensated_step", "check_smallest_update"):
        run_check("06", check)
    out = capsys.readouterr().out
    assert out.count(" passed: ") == 3, out


def test_a_table_of_one_runs_skip_counts_fails_the_next():
    table_cheat_fails("06", "skipped_steps", "check_skipped_steps", -1, "you predict -1")


SKIPS = "skipped_steps"


@pytest.mark.parametrize(
    "wrong, match",
    [
        # overflow taken as "above fp16's largest number": 65,510 rounds down to 65,504 and does not overflow
        (edit("06", SKIPS, "inf_from = 65504.0 + 16.0", "inf_from = 65504.0 + 1e-9"), "grad_max=1.99920654296875"),
        # overflow only past the next power of two
        (edit("06", SKIPS, "inf_from = 65504.0 + 16.0", "inf_from = 65536.0 + 1e-9"), "GradScaler skipped"),
        # the scale grows one step late
        (edit("06", SKIPS, "if clean == growth_interval:", "if clean > growth_interval:"), "GradScaler skipped"),
        # the first steps' descent from a scale that overflows is not counted
        (edit("06", SKIPS, "skipped, scale, clean = skipped + 1,", "skipped, scale, clean = skipped + (clean > 0 or scale < init_scale),"),
         "GradScaler skipped"),
    ],
    ids=["max-not-rounding", "next-power-of-two", "grows-late", "descent-uncounted"],
)  # fmt: skip
def test_wrong_skip_counts_fail(wrong, match):
    with pytest.raises(AssertionError, match=match):
        run_check("06", "check_skipped_steps", wrong)


@pytest.mark.parametrize(
    "cheat",
    [
        "import torch\ndef skipped_steps(steps, grad_max, init_scale, growth_interval):\n"
        "    s = torch.amp.GradScaler('cpu', init_scale=init_scale)\n    s.update()\n",
        "from parallel_lab.precision import update_scale\ndef skipped_steps(steps, grad_max, init_scale, growth_interval):\n"
        "    update_scale(init_scale, 0, True, 2.0, 0.5, growth_interval)\n",
        "import torch\ndef skipped_steps(steps, grad_max, init_scale, growth_interval):\n"
        "    s, t = torch.tensor(init_scale), torch.tensor(0, dtype=torch.int32)\n"
        "    torch._amp_update_scale_(s, t, torch.tensor(1.0), 2.0, 0.5, growth_interval)\n",
    ],
    ids=["torch-gradscaler", "lab-update-scale", "torch-kernel"],
)
def test_wrappers_of_a_scaler_are_switched_off(cheat):
    with pytest.raises(AssertionError, match="switched off"):
        run_check("06", "check_skipped_steps", cheat)


SMALL = "smallest_update"


@pytest.mark.parametrize(
    "wrong, match",
    [
        (edit("06", SMALL, "    return gap / 2\n", "    return gap\n"), "you predict"),  # a whole gap
        (edit("06", SMALL, "if weight < 0 and", "if False and"), "-1.0, 'fp16'"),  # the denser binade below a power of two
        (edit("06", SMALL, "e = max(math.floor(math.log2(abs(weight))), emin)", "e = math.floor(math.log2(abs(weight)))"),
         "9.5367431640625e-07, 'fp16'"),  # subnormals taken for normals
        (edit("06", SMALL, "    if weight == 0:", "    if False:"), "0.0, 'e5m2'"),  # zero
        (edit("06", SMALL, '"e4m3": (3, -6)', '"e4m3": (3, -7)'), "e4m3"),  # e4m3 read as fp8 with a bias of 8
    ],
    ids=["whole-gap", "no-denser-binade", "no-subnormals", "no-zero", "wrong-e4m3-range"],
)  # fmt: skip
def test_wrong_thresholds_fail(wrong, match):
    with pytest.raises(AssertionError, match=match):
        run_check("06", "check_smallest_update", wrong)


def test_a_table_of_one_runs_thresholds_fails_the_next():
    table_cheat_fails("06", "smallest_update", "check_smallest_update", 1.0, "you predict")


COMP = "compensated_step"


@pytest.mark.parametrize(
    "wrong, match",
    [
        # plain bf16 addition: every update below half a gap is lost
        (edit("06", COMP, "y = u - c.float()", "y = u"), "gaps from an fp32 run"),
        # the compensation added with the wrong sign
        (edit("06", COMP, "y = u - c.float()", "y = u + c.float()"), "gaps from an fp32 run"),
        # the compensation kept in fp32 (4 bytes per weight: the master copy again)
        (edit("06", COMP, "c.copy_(((t.float() - p.float()) - y).to(torch.bfloat16))",
              "comps[comps.index(c) if False else 0] = ((t.float() - p.float()) - y)"), "must stay bf16"),
        # fp32 master weights kept outside, keyed by tensor: new tensors every call leave them behind
        ("import torch\n_m = {}\ndef compensated_step(params, comps, updates):\n"
         "    for p, u in zip(params, updates):\n        m = _m.setdefault(id(p), p.float())\n"
         "        m += u\n        p.copy_(m.to(torch.bfloat16))\n", "gaps from|raised"),
        # fp32 masters kept by position, rebuilt when the weight no longer matches: two runs in turn mix them
        ("import torch\n_m = {}\ndef compensated_step(params, comps, updates):\n"
         "    for i, (p, u) in enumerate(zip(params, updates)):\n        m = _m.get(i)\n"
         "        if m is None or not torch.equal(m.to(torch.bfloat16), p):\n            m = p.float()\n"
         "        m = m + u\n        _m[i] = m\n        p.copy_(m.to(torch.bfloat16))\n", "gaps from"),
    ],
    ids=["plain-bf16", "wrong-sign", "fp32-compensation", "hidden-fp32-masters", "positional-fp32-masters"],
)  # fmt: skip
def test_wrong_compensated_steps_fail(wrong, match):
    with pytest.raises(AssertionError, match=match):
        run_check("06", "check_compensated_step", wrong)


def test_the_labs_optimizer_is_switched_off():
    cheat = (
        "from parallel_lab.precision import MixedPrecisionOptimizer\n"
        "def compensated_step(params, comps, updates):\n    MixedPrecisionOptimizer.step(None)\n"
    )
    with pytest.raises(AssertionError, match="switched off"):
        run_check("06", "check_compensated_step", cheat)


def test_every_grad_scaler_in_torch_is_switched_off():
    """torch's classes that implement the loss-scale rule (found by name in its source) either inherit
    torch.amp.GradScaler's switched-off methods or have their own switched off."""
    import re
    from pathlib import Path

    import torch

    from parallel_lab.grading.checks.precision import FORBIDDEN

    root = Path(torch.__file__).parent
    found = []
    for f in root.rglob("*.py"):
        for name in re.findall(
            r"^class (\w*GradScaler)\b", f.read_text(encoding="utf-8", errors="ignore"), re.M
        ):
            module = ".".join(f.relative_to(root.parent).with_suffix("").parts)
            found.append((module, name))
    assert ("torch.amp.grad_scaler", "GradScaler") in found, (
        "the search finds nothing: torch's layout changed"
    )
    for module, name in found:
        cls = getattr(__import__(module, fromlist=[name]), name)
        own = [m for m in ("update", "_amp_update_scale_cpu_") if m in vars(cls)]
        assert issubclass(cls, torch.amp.GradScaler), f"{module}.{name} is not a GradScaler"
        missing = [m for m in own if f"{module}.{name}.{m}" not in FORBIDDEN]
        assert not missing, f"{module}.{name} defines {missing} itself, and they are not switched off"


def test_torchs_own_rounding_is_refused():
    """A bisection with torch's casts (the check's own method) or a probe of fp16's overflow makes low-precision
    tensors: refused, since the exercises ask for the format's reasoning."""
    bisect = (
        "import torch\ndef smallest_update(weight, dtype):\n"
        "    d = {'fp16': torch.float16, 'bf16': torch.bfloat16, 'e4m3': torch.float8_e4m3fn, 'e5m2': torch.float8_e5m2}[dtype]\n"
        "    lo, hi = 1e-45, abs(weight) or 1.0\n"
        "    for _ in range(200):\n        mid = (lo + hi) / 2\n"
        "        if torch.tensor(weight + mid, dtype=torch.float64).to(d).item() != weight:\n            hi = mid\n"
        "        else:\n            lo = mid\n    return hi\n"
    )
    with pytest.raises(AssertionError, match="without low-precision arithmetic"):
        run_check("06", "check_smallest_update", bisect)
    probe = (
        "import torch\ndef skipped_steps(steps, grad_max, init_scale, growth_interval):\n"
        "    return int(torch.tensor(init_scale * grad_max).half().isinf())\n"
    )
    with pytest.raises(AssertionError, match="without low-precision arithmetic"):
        run_check("06", "check_skipped_steps", probe)
