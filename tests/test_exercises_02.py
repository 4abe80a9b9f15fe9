"""Lesson 02's exercises: the memory calculator for optimizers the lesson did not show (exact against real
steps measured under the tracker), and the peak of a trace under a caching allocator's rounding.

Each check passes the reference solution with one deterministic line, rejects each known wrong algorithm with
a message naming the mistake, switches off the lab's and torch's own versions while the learner's function
runs, and draws cases afresh every grade run, so an answer table logged in one run fails the next."""

from __future__ import annotations

import ast
import random
import re
from pathlib import Path

import pytest
from solution_code import edit, run_check, table_cheat_fails

from parallel_lab.grading.checks import memory


def _fails(check: str, cell: str, match: str) -> None:
    with pytest.raises(AssertionError) as info:
        run_check("02", check, cell)
    assert re.search(match, str(info.value)), str(info.value)


# ----------------------------------------------------------------------------- the reference passes
def test_the_solutions_pass_with_one_deterministic_line(capfd):
    run_check("02", "check_memory_calculator")
    run_check("02", "check_peak_memory")
    out = capfd.readouterr()
    lines = [line for line in out.out.splitlines() if line.startswith("check_")]
    assert lines == [
        "check_memory_calculator passed: 6 optimizers x 3 precisions, exact against real steps, at 5 sizes "
        "(2 drawn this run)",
        "check_peak_memory passed: 6 fixed traces and 5 drawn this run",
    ]
    assert out.err == ""


# ----------------------------------------------------------------------------- 1. the calculator
CALC = [
    ("AMSGrad counted as Adam", edit("02", "memory_calculator", '"adam_amsgrad": 3', '"adam_amsgrad": 2'),
     r"optimizer='adam_amsgrad'.*fewer than .* holds: with amsgrad=True"),
    ("RMSprop counted with momentum always", edit("02", "memory_calculator", '"rmsprop": 1', '"rmsprop": 2'),
     r"optimizer='rmsprop'.*more than .* holds: torch's RMSprop defaults to momentum=0"),
    ("Adagrad with zero states", edit("02", "memory_calculator", '"adagrad": 1', '"adagrad": 0'),
     r"optimizer='adagrad'.*accumulates over every step"),
    ("mixed precision without the master copy", edit("02", "memory_calculator", "4 + 4 * buffers", "4 * buffers"),
     r"precision='mixed'.*fp32 master copy"),
    ("mixed precision without the master copy and one state short",
     edit("02", "memory_calculator", "4 + 4 * buffers", "4 * (buffers - 1)"),
     r"precision='mixed'.*fp32 master copy .*; and with it added you still count fewer state bytes than measured"),
    ("centered RMSprop without the gradient average",
     edit("02", "memory_calculator", '"rmsprop_centered": 3', '"rmsprop_centered": 2'),
     r"optimizer='rmsprop_centered'.*fewer than .* holds: reread centered RMSprop with momentum's "
     r"update rule .* read back from step t-1"),
    ("Adadelta with an extra state", edit("02", "memory_calculator", '"adadelta": 2', '"adadelta": 3'),
     r"optimizer='adadelta'.*more than .* holds: reread Adadelta's update rule"),
    ("bf16 weights counted as fp32", edit("02", "memory_calculator", "param, grad, optim = 2, 2, 2 * buffers",
                                          "param, grad, optim = 4, 4, 2 * buffers"),
     r"precision='bf16'.*param is .*weights are bf16"),
    ("total is not the sum", edit("02", "memory_calculator", 'out["total"] = out["param"] + out["grad"] + out["optim"]',
                                  'out["total"] = 0'), r"is not param \+ grad \+ optim"),
]  # fmt: skip


@pytest.mark.parametrize(("label", "cell", "match"), CALC, ids=[c[0] for c in CALC])
def test_each_wrong_calculator_fails_naming_the_mistake(label, cell, match):
    _fails("check_memory_calculator", cell, match)


@pytest.mark.parametrize("opt", memory.OPTIMIZERS)
@pytest.mark.parametrize("off", [-2, -1, 1, 2])
def test_a_wrong_state_count_is_never_told_the_count(opt, off):
    """Off by one or two state tensors, in any precision: the message says more or fewer and what to reread,
    never by how many tensors (that count is the exercise)."""
    cell = edit(
        "02", "memory_calculator", "}[optimizer]", f"}}[optimizer] + ({off} if optimizer == {opt!r} else 0)"
    )
    with pytest.raises(AssertionError) as info:
        run_check("02", "check_memory_calculator", cell)
    message = str(info.value)
    assert f"optimizer={opt!r}" in message and ("more" if off > 0 else "fewer") in message, message
    assert not re.search(r"\d+ state tensors?|too (many|few)", message), message


def test_numpy_numbers_are_accepted():
    cell = edit(
        "02",
        "memory_calculator",
        'out = {"param": param * num_params',
        'import numpy as np\n    num_params = np.int64(num_params)\n    out = {"param": param * num_params',
    )
    run_check("02", "check_memory_calculator", cell)
    cell = edit(
        "02",
        "peak_memory",
        "return peak, at_peak",
        "import numpy as np\n    return np.int64(peak), {k: np.int64(v) for k, v in at_peak.items()}",
    )
    run_check("02", "check_peak_memory", cell)


CALC_CHEATS = {
    "the lab's formula": "from parallel_lab.costmodel import model_state_bytes\n"
    "def memory_calculator(n, optimizer, precision):\n    return model_state_bytes(n, 1, 0, optimizer, precision)\n",
    "the lab's measurement": "from parallel_lab.runtime.memory_state import model_state_bytes_measured as m\n"
    "from parallel_lab.models import MLPConfig, build_model\n"
    "def memory_calculator(n, optimizer, precision):\n"
    "    per = m(build_model(MLPConfig(), 0), optimizer, precision)\n    return per\n",
    "torch's optimizer, run and counted (public)": "import torch\n"
    "def memory_calculator(n, optimizer, precision):\n"
    "    w = torch.nn.Parameter(torch.zeros(1)); w.grad = torch.ones(1)\n"
    "    opt = torch.optim.Adagrad([w], lr=0.1); opt.step()\n"
    "    k = sum(1 for v in opt.state[w].values() if v.dim())\n"
    "    return {'param': 4 * n, 'grad': 4 * n, 'optim': 4 * k * n, 'total': (8 + 4 * k) * n}\n",
    "torch's functional optimizer (private)": "import torch\nfrom torch.optim.rmsprop import rmsprop\n"
    "def memory_calculator(n, optimizer, precision):\n"
    "    w, g, v = torch.zeros(1), torch.ones(1), torch.zeros(1)\n"
    "    rmsprop([w], [g], [v], [], [], [torch.tensor(0.0)], lr=0.1, alpha=0.99, eps=1e-8, weight_decay=0,\n"
    "            momentum=0, centered=False)\n",
    "torch's MemTracker (private)": "from torch.distributed._tools.mem_tracker import MemTracker\n"
    "def memory_calculator(n, optimizer, precision):\n    MemTracker()\n",
    # torch's functional optimizers build the state in __init__ / step: reading `.state` after a failed step
    "torch's functional RMSprop's state (private)": "import torch\n"
    "from torch.distributed.optim.functional_rmsprop import _FunctionalRMSprop\n"
    "def memory_calculator(n, optimizer, precision):\n"
    "    w = torch.zeros(1)\n"
    "    opt = _FunctionalRMSprop([w], momentum=0.9, centered=True)\n"
    "    try:\n        opt.step([torch.ones(1)])\n    except Exception:\n        pass\n"
    "    k = sum(1 for v in opt.state[w].values() if v.dim())\n"
    "    return {'param': 4 * n, 'grad': 4 * n, 'optim': 4 * k * n, 'total': (8 + 4 * k) * n}\n",
    "torch's functional Adagrad's state (private)": "import torch\n"
    "from torch.distributed.optim.functional_adagrad import _FunctionalAdagrad\n"
    "def memory_calculator(n, optimizer, precision):\n"
    "    w = torch.zeros(1)\n    k = len(_FunctionalAdagrad([w]).state[w]) - 1\n",
    "torch's functional AdamW with amsgrad (private)": "import torch\n"
    "from torch.distributed.optim.functional_adamw import _FunctionalAdamW\n"
    "def memory_calculator(n, optimizer, precision):\n"
    "    w = torch.zeros(1)\n    _FunctionalAdamW([w], amsgrad=True).step([torch.ones(1)])\n",
    "the check's own measurements": "from parallel_lab.grading.checks import memory\n"
    "def memory_calculator(n, optimizer, precision):\n"
    "    n0, per = memory.calculator_measurements()\n"
    "    out = {k: v * n for k, v in per[optimizer, precision].items()}\n"
    "    return {**out, 'total': sum(out.values())}\n",
    "the check's own measurements, imported before the check": "from parallel_lab.grading.checks.memory import "
    "calculator_measurements as measured\n"
    "def memory_calculator(n, optimizer, precision):\n"
    "    out = {k: v * n for k, v in measured()[1][optimizer, precision].items()}\n"
    "    return {**out, 'total': sum(out.values())}\n",
}


@pytest.mark.parametrize("label", CALC_CHEATS)
def test_calculator_cheats_are_switched_off(label):
    _fails("check_memory_calculator", CALC_CHEATS[label], "switched off")


def test_a_table_of_one_grade_runs_calculator_answers_fails_the_next():
    zero = dict.fromkeys(("param", "grad", "optim", "total"), 0)
    table_cheat_fails(
        "02", "memory_calculator", "check_memory_calculator", zero, "memory_calculator(num_params="
    )


def test_the_checks_measurements_are_kept_in_no_cache():
    """What the check measures is not stored where a learner's function could read it back: the measuring
    function is a plain function (switched off with its module) and the module holds no table of answers."""
    assert type(memory.calculator_measurements).__name__ == "function"
    assert "parallel_lab.grading.checks.memory.calculator_measurements" in memory.calculator_forbidden()
    run_check("02", "check_memory_calculator")
    tables = [k for k, v in vars(memory).items() if isinstance(v, dict) and any(
        isinstance(key, tuple) and key and key[0] in memory.OPTIMIZERS for key in v)]  # fmt: skip
    assert not tables, tables


def test_the_calculators_answers_are_measured_and_exact():
    """The check's expectations come from real steps (no table of buffer counts in its source), every count
    a whole number of bytes per parameter, 0-d step counters left out; they match the torch algorithms."""
    n, per = memory.calculator_measurements()
    assert n > 0 and set(per) == {(o, p) for o in memory.OPTIMIZERS for p in memory.PRECISIONS}
    tensors = {"adagrad": 1, "rmsprop": 1, "rmsprop_momentum": 2, "rmsprop_centered": 3, "adam_amsgrad": 3,
               "adadelta": 2}  # fmt: skip
    for (opt, prec), b in per.items():
        k = tensors[opt]
        want = {"fp32": (4, 4, 4 * k), "mixed": (2, 2, 4 + 4 * k), "bf16": (2, 2, 2 * k)}[prec]
        assert (b["param"], b["grad"], b["optim"]) == want, (opt, prec, b)


# ----------------------------------------------------------------------------- 2. the peak under rounding
RUNNING_TOTAL = """
def peak_memory(events, block=512):
    live, total, peak, at_peak = {}, 0, 0, {}
    for ev in events:
        if ev[0] == "alloc":
            live[ev[1]] = (ev[2], ev[3])
            total += ev[2]
        else:
            total -= live.pop(ev[1])[0]
        rounded = -(-total // block) * block
        if rounded > peak:
            peak, at_peak = rounded, {}
            for size, cat in live.values():
                if size:
                    at_peak[cat] = at_peak.get(cat, 0) + -(-size // block) * block
    return peak, at_peak
"""
ROUND = "size = -(-nbytes // block) * block"
PEAK = [
    ("rounding to nearest", edit("02", "peak_memory", ROUND, "size = round(nbytes / block) * block"), "nearest"),
    ("rounding the running total", RUNNING_TOTAL, "rounds the running total"),
    ("ignoring rounding", edit("02", "peak_memory", ROUND, "size = nbytes"), "the bytes asked for"),
    ("last peak instead of first", edit("02", "peak_memory", "if total > peak:", "if total >= peak and total:"),
     "the last moment"),
    ("always one block more", edit("02", "peak_memory", ROUND, "size = (nbytes // block + 1) * block"),
     r"peak [\d,]+ bytes, expected"),
    ("a zero-byte tensor takes a block", edit("02", "peak_memory", ROUND, "size = max(1, -(-nbytes // block)) * block"),
     r"zero-byte"),
    ("never subtracts frees", edit("02", "peak_memory", "total -= live.pop(ev[1])[0]", "live.pop(ev[1])"), "peak"),
    ("block ignored, always 512", edit("02", "peak_memory", ROUND, "size = -(-nbytes // 512) * 512"), r"block=1\b"),
]  # fmt: skip


@pytest.mark.parametrize(("label", "cell", "match"), PEAK, ids=[c[0] for c in PEAK])
def test_each_wrong_peak_fails_naming_the_mistake(label, cell, match):
    _fails("check_peak_memory", cell, match)


def test_a_by_category_that_is_not_a_mapping_is_named():
    cell = edit("02", "peak_memory", "return peak, at_peak", "return peak, list(at_peak.items())")
    _fails(
        "check_peak_memory",
        cell,
        r"peak_memory\(events=.*\): by_category must be a dict \{category: bytes\}, "
        "got list",
    )


# Wrong only where the fixed traces cannot show it: on drawn traces, which are too long to print whole.
WRONG_ON_DRAWN = {
    "wrong beyond 16 events": edit("02", "peak_memory", "return peak, at_peak",
                                   "return (peak + 1 if len(events) > 16 else peak), at_peak"),
    "wrong for blocks other than 1 and 512": edit("02", "peak_memory", "return peak, at_peak",
                                                  "return (peak if block in (1, 512) else peak + block), at_peak"),
    "rounds the running total on long traces": edit("02", "peak_memory", "total += size",
                                                    "total += size if len(events) < 20 else nbytes"),
}  # fmt: skip


@pytest.mark.parametrize("label", WRONG_ON_DRAWN)
def test_a_failure_on_a_long_drawn_trace_shows_a_short_trace_that_fails(label):
    """The message prints the shortest start of the drawn trace the answer gets wrong, in full: pasting it
    reproduces the failure, and no shorter start would."""
    with pytest.raises(AssertionError) as info:
        run_check("02", "check_peak_memory", WRONG_ON_DRAWN[label])
    message = str(info.value)
    found = re.search(r"drawn trace.*?its first (\d+) events .*?: peak_memory\(events=(\[.*?\]), block=(\d+)\)",
                      message)  # fmt: skip
    assert found, message
    k, events, block = int(found[1]), ast.literal_eval(found[2]), int(found[3])
    assert len(events) == k and "<" not in found[2], message
    ns = {}
    exec(WRONG_ON_DRAWN[label], ns)  # noqa: S102 - our own wrong answer
    wrong = ns["peak_memory"]
    assert wrong(events, block) != memory.reference_peak(events, block)
    if k > 1:  # starts are tried from one event on (the empty trace is a fixed case)
        assert wrong(events[:-1], block) == memory.reference_peak(events[:-1], block)
    if label == "wrong beyond 16 events":
        assert k == 17, message


PEAK_CHEATS = {
    "the lab's tracker": "from parallel_lab.runtime.memory import MemoryTracker\n"
    "def peak_memory(events, block=512):\n    MemoryTracker()._add(None, 0, 0, 'other')\n",
    "torch's inductor peak estimate (private)": "from torch._inductor.memory import estimate_peak_memory_allocfree\n"
    "def peak_memory(events, block=512):\n    return estimate_peak_memory_allocfree([], {}, {})\n",
    "torch's memory timeline (private)": "from torch.profiler._memory_profiler import MemoryProfileTimeline\n"
    "def peak_memory(events, block=512):\n    MemoryProfileTimeline(None)\n",
    "torch's profiler memory timeline (public)": "import torch\n"
    "def peak_memory(events, block=512):\n    torch.profiler.profile().export_memory_timeline('x.html')\n",
    "torch's MemTracker (private)": "from torch.distributed._tools.mem_tracker import MemTracker\n"
    "def peak_memory(events, block=512):\n    MemTracker()\n",
}


@pytest.mark.parametrize("label", PEAK_CHEATS)
def test_peak_cheats_are_switched_off(label):
    _fails("check_peak_memory", PEAK_CHEATS[label], "switched off")


def test_a_table_of_one_grade_runs_peaks_fails_the_next():
    table_cheat_fails(
        "02", "peak_memory", "check_peak_memory", (0, {}), "drawn trace", key=lambda *a: repr(a)
    )


def test_every_request_stays_in_the_small_pool():
    """The exercise models the allocator's small pool (requests up to 1 MiB, rounded to 512-byte multiples);
    no fixed or drawn trace asks for more, so its text needs no word on the large pool's rounding."""
    rnd = random.Random(1)
    traces = [events for _, events, _ in memory.FIXED]
    for _ in range(200):
        traces += [events for _, events, _ in memory.drawn_cases(rnd.getrandbits(62))]
    sizes = [ev[2] for events in traces for ev in events if ev[0] == "alloc"]
    assert sizes and max(sizes) <= 1 << 20, max(sizes)


def test_drawn_traces_include_a_peak_that_rounding_moves():
    rnd = random.Random(0)
    for _ in range(200):
        cases = memory.drawn_cases(rnd.getrandbits(62))
        moved = [label for label, events, block in cases if memory.peak_moves(events, block)]
        assert "drawn trace whose peak moves under rounding" in moved, cases[-1]
        assert any(block & (block - 1) for _, _, block in cases), "a block that is not a power of two"
    fixed = {label: (events, block) for label, events, block in memory.FIXED}
    assert memory.peak_moves(*fixed["rounding moves the peak"])
    events, _ = fixed["block=1: nothing is rounded, the lesson's bookkeeping"]
    assert memory.reference_peak(events, 1) == (164, {"param": 64, "other": 100})


# ----------------------------------------------------------------------------- torch's own versions
# The search reads torch's source for classes and functions whose names say they track memory, profile it,
# or replay or estimate a peak. Left on, with the reason: device statistics (`reset_peak_memory_stats`: they
# reset a real allocator's counters, they replay no list), code generators (torch._inductor.codegen, IR
# nodes' `codegen_memory_tracking`: they emit code), and estimates of a single kernel's or collective's
# footprint (`get_shared_memory_estimation`, `estimate_fx_collective_memory_footprint`: one op, no trace).
JOB = re.compile(
    r"^[ \t]*(?:async )?(?:def|class) (\w*(?:peak_?mem|mem(?:ory)?_?track|memory_?profil|memory_?timeline"
    r"|mem(?:ory)?_?estimat|estimate_\w*mem)\w*)",
    re.M | re.I,
)
LEFT_ON = {"reset_peak_memory_stats", "codegen_memory_tracking", "get_shared_memory_estimation",
           "estimate_fx_collective_memory_footprint"}  # fmt: skip


def test_torchs_own_versions_of_an_exercise_are_switched_off():
    """torch's memory trackers and peak replays (found by name in torch's source) are all in the peak
    check's switched-off list, and its trackers in the calculator's: a new torch that adds one fails here,
    not in a learner's notebook."""
    import torch

    root = Path(torch.__file__).parent
    found: dict[str, list[str]] = {}
    for f in root.rglob("*.py"):
        module = ".".join(f.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        if module.startswith(("torch._inductor.codegen.", "torch.testing.")):
            continue
        for match in JOB.finditer(f.read_text(encoding="utf-8", errors="ignore")):
            if match.group(1) not in LEFT_ON:
                found.setdefault(module, []).append(match.group(1))
    assert "torch.distributed._tools.mem_tracker" in found and "torch._inductor.memory" in found, (
        "the search finds nothing: torch's layout changed"
    )

    def missing(off: dict, modules: dict) -> dict:
        out = {m: [n for n in names if not any(k.startswith(m + ".") and n in k.split(".") for k in off)]
               for m, names in modules.items()}  # fmt: skip
        return {m: names for m, names in out.items() if names}

    assert not missing(memory.peak_forbidden(), found), "torch's peak replays not switched off"
    trackers = {m: n for m, n in found.items() if any(re.search(r"mem(ory)?_?track", x, re.I) for x in n)}
    trackers = {m: n for m, n in trackers.items() if m.startswith("torch.distributed._tools.")}
    assert trackers and not missing(memory.calculator_forbidden(), trackers), (
        "torch's trackers not switched off"
    )
    # the calculator's optimizers cannot be run for their state while the learner's function runs
    for name in ("Adagrad", "RMSprop", "Adam", "Adadelta"):
        module = f"torch.optim.{name.lower()}"
        assert f"{module}.{name}.step" in memory.calculator_forbidden(), name


# The state the calculator's optimizers keep, by the keys torch stores it under: "sum" (Adagrad), "square_avg"
# (RMSprop, Adadelta), "acc_delta" (Adadelta), "max_exp_avg_sq" (AMSGrad). "momentum_buffer", "grad_avg" and
# "exp_avg" are left out of the search: SGD and plain Adam, which the lesson shows, keep them too.
STATE_KEYS = re.compile(
    r"""["'](?:square_avg|max_exp_avg_sq|acc_delta)["']|\bstate\w*\[\s*["']sum["']\s*\]|["']sum["']\s*:\s*torch\."""
)
# Modules that name those keys without building an optimizer's state, with the reason.
STATE_KEYS_LEFT_ON: dict[str, str] = {}


def test_every_torch_module_that_builds_the_calculators_state_is_switched_off():
    """Any module of torch's that creates one of these optimizers' state tensors (found by the key it stores
    them under) is switched off while the learner's calculator runs, or is listed above with its reason."""
    import torch

    root = Path(torch.__file__).parent
    found = set()
    for f in root.rglob("*.py"):
        module = ".".join(f.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        if not module.startswith("torch.testing.") and STATE_KEYS.search(
            f.read_text("utf-8", errors="ignore")
        ):
            found.add(module)
    assert {
        "torch.optim.adagrad",
        "torch.optim.rmsprop",
        "torch.optim.adadelta",
        "torch.optim.adam",
    } <= found, "the search finds nothing: torch's layout changed"
    off = memory.calculator_forbidden()
    on = sorted(m for m in found - set(STATE_KEYS_LEFT_ON) if not any(k.startswith(m + ".") for k in off))
    assert not on, f"torch modules building the calculator's optimizer state, not switched off: {on}"
    assert {"torch.distributed.optim.functional_adamw", "torch.distributed.optim.functional_rmsprop"} <= found
