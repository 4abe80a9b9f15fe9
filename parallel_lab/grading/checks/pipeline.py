"""Checks for lesson 09's exercises: the 1F1B instruction list of one stage, and the bubble formula.

The 1F1B check compares the learner's list with PipeDream-Flush's order on many
(stage, stages, microbatches), including fewer micro-batches than stages, then
builds the whole pipeline from the learner's function (every stage), inserts the
sends and receives, and runs it through the validator and the simulator: it must
not deadlock, must keep at most p micro-batches in flight, and must leave the
bubble (p-1)/(m+p-1). The bubble check compares with the cost model and with the
simulator, and recognises the two usual slips (Megatron's ratio, a missing v).
"""

from __future__ import annotations

from collections.abc import Callable

from parallel_lab.grading.checks import family, guarded, passed, require_callable

# The lab's schedules, simulator and bubble formula, switched off while the learner's function runs.
FORBIDDEN = {
    **family("parallel_lab.pipeline.schedules", "parallel_lab.pipeline.simulator"),
    "parallel_lab.costmodel.formulas.pipeline_bubble_fraction": "",
}

__all__ = ["check_bubble_fraction", "check_one_f_one_b"]

_CASES_1F1B = [(p, m) for p in (1, 2, 3, 4, 6, 8) for m in (1, 2, 3, 4, 5, 8, 13)]


def _as_steps(got, where: str):
    from parallel_lab.pipeline import Step

    if not isinstance(got, (list, tuple)):
        raise AssertionError(f"{where}: return a list of steps, got {type(got).__name__}")
    out = []
    for i, s in enumerate(got):
        if isinstance(s, Step):
            s = (s.kind, s.mb)
        ok = isinstance(s, (tuple, list)) and len(s) == 2 and s[0] in ("F", "B") and isinstance(s[1], int)
        if not ok:
            raise AssertionError(f"{where}: item {i} is {s!r}; each step is ('F', mb) or ('B', mb)")
        out.append(Step(s[0], s[1]))
    return out


def _show(steps) -> str:
    return " ".join(f"{s.kind}{s.mb}" for s in steps)


def check_one_f_one_b(fn: Callable[[int, int, int], list]) -> None:
    """`fn(stage, stages, microbatches)` -> stage's 1F1B order: [('F', 0), ('F', 1), ..., ('B', m-1)]."""
    require_callable(fn)
    fn = guarded(fn, FORBIDDEN, "this exercise (one_f_one_b)")
    from parallel_lab.costmodel import pipeline_bubble_fraction
    from parallel_lab.pipeline import ScheduleError, add_comms, order_1f1b, simulate, validate_schedule

    for p, m in _CASES_1F1B:
        orders = []
        for s in range(p):
            where = f"one_f_one_b(stage={s}, stages={p}, microbatches={m})"
            got = _as_steps(fn(s, p, m), where)
            want = order_1f1b(s, p, m)
            if got != want:
                i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                warm = min(p - s - 1, m)
                raise AssertionError(
                    f"{where}: first difference at position {i}: got {_show(got[i : i + 4]) or '(end)'}, expected "
                    f"{_show(want[i : i + 4]) or '(end)'}.\n  expected: {_show(want)}\n  got:      {_show(got)}\n"
                    f"  (stage {s} of {p} warms up with min(p - s - 1, m) = {warm} forwards)"
                )
            orders.append(got)
        try:
            info = validate_schedule(add_comms(orders), m, bound=min(p, m))
        except ScheduleError as e:  # unreachable when the orders match, kept as the real judge
            raise AssertionError(
                f"stages={p}, microbatches={m}: the pipeline built from your lists fails: {e}"
            ) from None
        sim = simulate(add_comms(orders))
        assert abs(sim.bubble_fraction - pipeline_bubble_fraction(p, m)) < 1e-9, (
            f"stages={p}, microbatches={m}: simulated bubble {sim.bubble_fraction:.4f}, "
            f"expected {pipeline_bubble_fraction(p, m):.4f}"
        )
        assert max(info["peak_in_flight"]) <= p
    passed("check_one_f_one_b", f"{len(_CASES_1F1B)} pipelines validated and simulated")


def check_bubble_fraction(fn: Callable[[int, int, int], float]) -> None:
    """`fn(stages, microbatches, chunks)` -> the idle share of a pipeline step, (p-1)/(v*m + p-1)."""
    require_callable(fn)
    fn = guarded(fn, FORBIDDEN, "this exercise (bubble_fraction)")
    from parallel_lab.costmodel import pipeline_bubble_fraction
    from parallel_lab.pipeline import make_schedule, simulate

    cases = 0
    for p in (1, 2, 4, 8, 64):
        for m in (1, 4, 8, 16, 256):
            for v in (1, 2, 4):
                want = pipeline_bubble_fraction(p, m, v)
                got = fn(p, m, v)
                where = f"bubble_fraction(stages={p}, microbatches={m}, chunks={v})"
                assert isinstance(got, (int, float)) and not isinstance(got, bool), (
                    f"{where} must return a number, got {type(got).__name__}"
                )
                if abs(got - want) > 1e-12:
                    hint = ""
                    if v > 1 and abs(got - (p - 1) / (m + p - 1)) < 1e-12:
                        hint = " With v chunks per rank each unit of work is v times shorter: the bubble shrinks by v."
                    elif p > 1 and abs(got - (p - 1) / (v * m)) < 1e-12:
                        hint = (" That is Megatron's bubble-to-compute ratio (p-1)/(v*m): idle time over busy "
                                "time. The exercise asks for idle time over the whole step.")  # fmt: skip
                    raise AssertionError(f"{where} returned {got!r}, expected {want!r}.{hint}")
                cases += 1
    for name, p, m, v in (
        ("gpipe", 4, 8, 1),
        ("1f1b", 3, 5, 1),
        ("interleaved", 4, 8, 2),
        ("interleaved", 2, 6, 3),
    ):
        sim = simulate(make_schedule(name, p, m, v), chunks=v)
        assert abs(fn(p, m, v) - sim.bubble_fraction) < 1e-9, (
            f"{name} p={p} m={m} v={v}: the simulator measures {sim.bubble_fraction:.6f}, you say {fn(p, m, v)!r}"
        )
    passed("check_bubble_fraction", f"{cases} cases and 4 simulated schedules")
