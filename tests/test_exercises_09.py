"""Lesson 09's exercises: the reference solution passes, and wrappers of the lab's and torch's
functions, answer tables from an earlier grade run and wrong algorithms fail, each with a message
naming what differed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from solution_code import _check_cell, edit, fails_saying, run_check, solution_namespace

from parallel_lab.grading import check_bubble_fraction, check_one_f_one_b_capped
from parallel_lab.grading.checks import pipeline as checks

# The reference answers (the solution notebook's code): the lab's own are switched off in a check.
_NS = solution_namespace("09")
capped = _NS["one_f_one_b_capped"]
bubble = _NS["bubble_fraction"]

_GPIPE = "def one_f_one_b_capped(stage, stages, m, caps):\n    return [('F', i) for i in range(m)] + [('B', i) for i in range(m)]\n"
_NEWEST = """
def one_f_one_b_capped(stage, stages, m, caps):
    warm = min(stages - stage, min(caps[: stage + 1]), m) - 1
    order, held = [], []
    for i in range(m):
        order.append(("F", i))
        held.append(i)
        if i >= warm:
            order.append(("B", held.pop()))  # the newest micro-batch held
    return order + [("B", i) for i in reversed(held)]
"""
_SPREAD = """
def one_f_one_b_capped(stage, stages, m, caps):
    # warm-ups spread evenly over the stages: another valid order (a smaller bubble, even), not the one asked
    warm = min(-(-(stages - stage) * min(min(caps), stages) // stages), m) - 1
    order = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        order += [("F", warm + i), ("B", i)]
    return order + [("B", i) for i in range(m - warm, m)]
"""
_BF = "def bubble_fraction(t_f, t_b, m, t_comm):\n"
STEP = "step = sum(t_f) + sum(t_b) + (m - 1) * (max(t_f) + max(t_b)) + 2 * (p - 1) * t_comm"
LAT = " + 2 * (p - 1) * t_comm"
QUEUE = "(m - 1) * (max(t_f) + max(t_b))"

WRONG = [
    # ---- exercise 1: 1F1B under a cap
    ("09", "check_one_f_one_b_capped", "wraps the lab's 1F1B (cut to the cap)", "from parallel_lab.pipeline import order_1f1b\ndef one_f_one_b_capped(stage, stages, m, caps):\n    return order_1f1b(stage, min(stages, stage + min(caps)), m)\n", "switched off"),
    ("09", "check_one_f_one_b_capped", "wraps the lab's schedule builder", "from parallel_lab.pipeline import make_schedule\ndef one_f_one_b_capped(stage, stages, m, caps):\n    return [s for s in make_schedule('1f1b', stages, m)[stage] if s.kind in 'FB']\n", "switched off"),
    ("09", "check_one_f_one_b_capped", "wraps the check's reference", "from parallel_lab.grading.checks.pipeline import _capped_1f1b\ndef one_f_one_b_capped(stage, stages, m, caps):\n    return _capped_1f1b(stage, stages, m, caps)\n", "switched off"),
    ("09", "check_one_f_one_b_capped", "torch's schedule IR", "from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops\ndef one_f_one_b_capped(stage, stages, m, caps):\n    ops = get_schedule_ops('1F1B', stages, m)[stage]\n    return [(str(a.computation_type)[0], a.microbatch_index) for a in ops if a is not None]\n", "switched off"),
    ("09", "check_one_f_one_b_capped", "torch's private 1F1B rank ops", "from torch.distributed.pipelining.schedules import _get_1f1b_rank_ops\ndef one_f_one_b_capped(stage, stages, m, caps):\n    return _get_1f1b_rank_ops(1, stages, stages - stage - 1, m, 0, stage, lambda s: s, lambda s: s)\n", "switched off"),
    ("09", "check_one_f_one_b_capped", "plain 1F1B, the cap ignored", edit("09", "one_f_one_b_capped", "held = min(stages - stage, microbatches, min(caps[: stage + 1]))", "held = min(stages - stage, microbatches)"), "it ignores the caps"),
    ("09", "check_one_f_one_b_capped", "each stage heeds its own cap only", edit("09", "one_f_one_b_capped", "min(caps[: stage + 1])", "caps[stage]"), "can the stages before it feed it"),
    ("09", "check_one_f_one_b_capped", "warm-up one too many", edit("09", "one_f_one_b_capped", "warmup = held - 1", "warmup = held"), "warm-up is one forward too long"),
    ("09", "check_one_f_one_b_capped", "GPipe's order", _GPIPE, "GPipe's order"),
    ("09", "check_one_f_one_b_capped", "backward of the newest micro-batch", _NEWEST, "backward of the oldest micro-batch"),
    ("09", "check_one_f_one_b_capped", "a warm-up one too short", edit("09", "one_f_one_b_capped", "warmup = held - 1", "warmup = max(held - 2, 0)"), "warm-up is one forward too short"),
    ("09", "check_one_f_one_b_capped", "another valid order", _SPREAD, "a better schedule, but not the one asked for"),
    # ---- exercise 2: GPipe's bubble with uneven stages and message latency
    ("09", "check_bubble_fraction", "wraps the lab's simulator (mean costs)", "from parallel_lab.pipeline import make_schedule, simulate\n" + _BF + "    p = len(t_f)\n    return simulate(make_schedule('gpipe', p, m), sum(t_f) / p, sum(t_b) / p, t_comm).bubble_fraction\n", "switched off"),
    ("09", "check_bubble_fraction", "wraps the lab's bubble formula", "from parallel_lab.costmodel import pipeline_bubble_fraction as ours\n" + _BF + "    return ours(len(t_f), m)\n", "switched off"),
    ("09", "check_bubble_fraction", "wraps the check's reference", "from parallel_lab.grading.checks.pipeline import _gpipe_bubble\n" + _BF + "    return _gpipe_bubble(t_f, t_b, m, t_comm)\n", "switched off"),
    ("09", "check_bubble_fraction", "torch's private simulator", "from torch.distributed.pipelining.schedules import _simulate_comms_compute\n" + _BF + "    return _simulate_comms_compute({}, lambda r, a: None, len(t_f))\n", "switched off"),
    ("09", "check_bubble_fraction", "latency ignored", edit("09", "bubble_fraction", LAT, ""), "The latency is ignored"),
    ("09", "check_bubble_fraction", "latency one way only", edit("09", "bubble_fraction", LAT, " + (p - 1) * t_comm"), "one direction only"),
    ("09", "check_bubble_fraction", "one slowest stage for both directions", edit("09", "bubble_fraction", QUEUE, "(m - 1) * max(f + b for f, b in zip(t_f, t_b))"), "also the one that holds the backwards back"),
    ("09", "check_bubble_fraction", "the forward-slowest stage's own backward", edit("09", "bubble_fraction", QUEUE, "(m - 1) * (max(t_f) + t_b[t_f.index(max(t_f))])"), "is it also the stage whose backward is slowest"),
    ("09", "check_bubble_fraction", "latency paid by every micro-batch", edit("09", "bubble_fraction", QUEUE, "(m - 1) * (max(t_f) + max(t_b) + 2 * t_comm)"), "paid by every micro-batch"),
    ("09", "check_bubble_fraction", "latency on p links", edit("09", "bubble_fraction", LAT, " + 2 * p * t_comm"), "p - 1 links between them"),
    ("09", "check_bubble_fraction", "every stage at the slowest pace", edit("09", "bubble_fraction", STEP, "step = (m + p - 1) * max(f + b for f, b in zip(t_f, t_b)) + 2 * (p - 1) * t_comm"), "on its way through the others"),
    ("09", "check_bubble_fraction", "equal stages at the mean cost", edit("09", "bubble_fraction", STEP, "step = (m + p - 1) * (sum(t_f) + sum(t_b)) / p + 2 * (p - 1) * t_comm"), "each at the mean cost"),
    ("09", "check_bubble_fraction", "the busiest stage's idle share", edit("09", "bubble_fraction", "return 1 - busy / (p * step)", "return 1 - m * max(f + b for f, b in zip(t_f, t_b)) / step"), "the busiest stage alone"),
    ("09", "check_bubble_fraction", "idle over busy time", edit("09", "bubble_fraction", "return 1 - busy / (p * step) if step > 0 else 0.0", "return (p * step - busy) / busy"), "idle time over busy time"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("check", "label", "source", "want"), [w[1:] for w in WRONG], ids=[w[2] for w in WRONG]
)
def test_a_wrong_answer_fails_saying_what_differed(check, label, source, want):
    fails_saying("09", check, label, source, want)


def test_the_solution_passes_with_one_fixed_line(capsys):
    run_check("09", "check_one_f_one_b_capped")
    run_check("09", "check_bubble_fraction")
    lines = capsys.readouterr().out.splitlines()  # the solution's other cells print too
    assert [line for line in lines if line.startswith("check_")] == [
        "check_one_f_one_b_capped passed: 15 fixed and 24 drawn pipelines validated and simulated",
        "check_bubble_fraction passed: 10 fixed and 30 drawn pipelines, every step followed",
    ]


def test_a_mismatch_names_the_call_and_shows_steps_around_it_only():
    with pytest.raises(AssertionError) as info:
        run_check("09", "check_one_f_one_b_capped", _NEWEST)
    text = str(info.value)
    assert text.startswith(
        "one_f_one_b_capped(stage=0, stages=4, microbatches=6, caps=[4, 4, 4, 4]): first difference at step 4"
    )
    assert "steps 2..6: got F2 F3 B3 F4 B4, expected F2 F3 B0 F4 B1" in text
    assert "F5" not in text  # a window around the difference, not the whole expected list


# ----------------------------------------------------------------------------- malformed answers
def test_malformed_lists_are_named():
    with pytest.raises(AssertionError, match="each step is"):
        check_one_f_one_b_capped(lambda s, p, m, caps: [("X", 0)])
    with pytest.raises(AssertionError, match="return a list of steps"):
        check_one_f_one_b_capped(lambda s, p, m, caps: "F0 B0")
    with pytest.raises(AssertionError, match="F0 appears twice"):
        check_one_f_one_b_capped(lambda s, p, m, caps: [("F", 0)] + capped(s, p, m, caps))
    with pytest.raises(AssertionError, match="whose forward has not run"):
        check_one_f_one_b_capped(
            lambda s, p, m, caps: [("B", i) for i in range(m)] + [("F", i) for i in range(m)]
        )
    with pytest.raises(AssertionError, match="must return a number"):
        check_bubble_fraction(lambda *a: str(bubble(*a)))
    with pytest.raises(AssertionError, match="returned nan"):
        check_bubble_fraction(lambda *a: float("nan"))


def test_unfinished_exercise_stays_not_implemented():
    def stub(*a):
        raise NotImplementedError("exercise 1")

    with pytest.raises(NotImplementedError):
        check_one_f_one_b_capped(stub)
    with pytest.raises(NotImplementedError):
        check_bubble_fraction(stub)


# ----------------------------------------------------------------------------- the references
def test_the_capped_reference_never_deadlocks_and_keeps_the_caps():
    """The reference order is valid for every shape and caps (validator, which also runs the NCCL
    blocking-send model), holds exactly min(p - s, m, the tightest cap up to s) on stage s at its
    fullest, and is plain 1F1B when every cap is at least p. The slip of heeding only a stage's own
    cap deadlocks whenever it differs from the reference."""
    import random

    from parallel_lab.pipeline import ScheduleError, add_comms, order_1f1b, validate_schedule

    rnd = random.Random(0)
    shapes = [(p, m, (cap,) * p) for p in range(1, 7) for m in range(1, 10) for cap in range(1, p + 3)]
    shapes += [(p, rnd.randint(1, 3 * p), tuple(rnd.randint(1, p + 2) for _ in range(p)))
               for p in (rnd.randint(1, 9) for _ in range(300))]  # fmt: skip
    deadlocks = 0
    for p, m, caps in shapes:
        orders = [checks._capped_1f1b(s, p, m, caps) for s in range(p)]
        info = validate_schedule(add_comms(orders), m, bound=max(caps))
        assert info["peak_in_flight"] == [min(p - s, m, min(caps[: s + 1])) for s in range(p)], (p, m, caps)
        if min(caps) >= p:
            assert orders == [order_1f1b(s, p, m) for s in range(p)]
        own = [checks._own_cap_only(s, p, m, caps) for s in range(p)]
        if own != orders:
            with pytest.raises(ScheduleError):
                validate_schedule(add_comms(own), m, bound=max(caps))
            deadlocks += 1
    assert deadlocks > 50


def test_the_gpipe_reference_is_the_simulators_on_equal_stages_and_the_path_on_uneven_ones():
    """On equal stages the step-by-step reference equals the lab's simulator; on uneven ones its step
    is the longest path: every stage once each way, m - 1 more at each direction's slowest stage."""
    import random

    from parallel_lab.pipeline import make_schedule, simulate

    for p in (1, 2, 3, 5, 8):
        for m in (1, 2, 7, 16):
            for t_f, t_b, c in ((1.0, 2.0, 0.0), (1.0, 2.0, 0.5), (0.3, 1.7, 2.25), (2.0, 0.5, 9.0)):
                sim = simulate(make_schedule("gpipe", p, m), t_f, t_b, c)
                assert checks._gpipe_bubble([t_f] * p, [t_b] * p, m, c) == pytest.approx(
                    sim.bubble_fraction, abs=1e-12
                )
    rnd = random.Random(1)
    differ = 0
    for _ in range(200):
        t_f, t_b, m, c = checks._draw_uneven(rnd)
        p = len(t_f)
        step = sum(t_f) + sum(t_b) + (m - 1) * (max(t_f) + max(t_b)) + 2 * (p - 1) * c
        got = checks._gpipe_bubble(t_f, t_b, m, c)
        assert got == pytest.approx(1 - m * (sum(t_f) + sum(t_b)) / (p * step), abs=1e-12)
        differ += t_f.index(max(t_f)) != t_b.index(max(t_b))
    assert differ > 150  # the forwards' and backwards' slowest stages differ in most drawn pipelines


# ----------------------------------------------------------------------------- cases drawn at grade time
def _logged_then_replayed(check: str, name: str, replay) -> dict:
    ns = solution_namespace("09")
    real, table = ns[name], {}

    def key(args):  # the caps come as a list
        return tuple(tuple(a) if isinstance(a, list) else a for a in args)

    def logging(*args):
        table[key(args)] = out = real(*args)
        return out

    ns[name] = logging
    exec(compile(_check_cell("09", check), "<check>", "exec"), ns)  # noqa: S102
    ns[name] = lambda *args: replay(table, key(args))
    with pytest.raises(AssertionError) as info:
        exec(compile(_check_cell("09", check), "<check>", "exec"), ns)  # noqa: S102
    return info


def test_a_table_of_one_grade_runs_answers_fails_the_next():
    """A learner who logs the cases of one grade run and answers from that table passes the fixed
    cases but not the ones drawn the next run."""
    info = _logged_then_replayed("check_one_f_one_b_capped", "one_f_one_b_capped", lambda t, a: t.get(a, []))
    assert "one_f_one_b_capped(stage=" in str(info.value) and "missing" in str(info.value)
    info = _logged_then_replayed("check_bubble_fraction", "bubble_fraction", lambda t, a: t.get(a, 0.0))
    assert "bubble_fraction(t_f=" in str(info.value) and "returned 0.0" in str(info.value)


# ----------------------------------------------------------------------------- torch's own
def test_torchs_own_versions_of_an_exercise_are_switched_off():
    """torch's modules that build, print or simulate pipeline orders (found by name in torch's
    source) are all in the checks' switched-off list, and so is each such top-level class or
    function: a new torch that adds one fails here, not in a learner's notebook."""
    import torch

    root = Path(torch.__file__).parent / "distributed"
    job = re.compile(
        r"^(\s*)(?:class|def) (\w*(?:1f1b|gpipe|pipeline_order|schedule_ops|simulate_comms|LoopedBFS|ZeroBubble|"
        r"ZBV|DualPipe|PipelineSchedule|warmup_ops|bfs_ops)\w*)",
        re.M | re.I,
    )
    found: dict[str, list[tuple[bool, str]]] = {}
    for f in root.rglob("*.py"):
        for indent, name in job.findall(f.read_text(encoding="utf-8", errors="ignore")):
            module = ".".join(f.relative_to(root.parent.parent).with_suffix("").parts)
            found.setdefault(module, []).append((not indent, name))
    assert "torch.distributed.pipelining.schedules" in found, (
        "the search finds nothing: torch's layout changed"
    )
    off = checks.switched_off()
    covered = {k.rsplit(".", n)[0] for k in off for n in (1, 2)}
    missing = {m: [n for _, n in names] for m, names in found.items() if m not in covered}
    assert not missing, f"torch modules doing an exercise's job, not switched off: {missing}"
    names_off = {k.rsplit(".", 1)[0] for k in off} | set(off)
    bare = [
        f"{m}.{n}" for m, names in found.items() for top, n in names if top and f"{m}.{n}" not in names_off
    ]
    assert not bare, f"torch classes and functions doing an exercise's job, not switched off: {bare}"
