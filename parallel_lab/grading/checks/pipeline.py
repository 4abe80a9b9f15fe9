"""Checks for lesson 09's exercises: 1F1B when every stage has its own activation-memory cap, and
GPipe's bubble when stages cost different times and messages take time to arrive.

`one_f_one_b_capped(stage, stages, microbatches, caps)` is compared with the reference order
(`_capped_1f1b`) on fixed shapes (equal caps of 1, below p and above it, a tight cap on the first
stage, on a middle one, on the last; fewer micro-batches than stages; one stage) and on shapes and
caps drawn anew each grade run; then the whole pipeline is built from the learner's function (every
stage), the sends and receives are inserted, and it runs through the validator and the simulator:
no deadlock, never more than caps[s] micro-batches in flight on stage s, and the bubble of the
reference order. The usual slips are named: the caps ignored (plain 1F1B), a stage that heeds only
its own cap (the pipeline deadlocks), a warm-up of the wrong length, GPipe's order, the backward of
the newest micro-batch instead of the oldest.

`bubble_fraction(t_f, t_b, microbatches, t_comm)` (one forward and one backward time per stage) is
compared with GPipe followed step by step (`_gpipe_bubble`, equal to the simulator on equal stages)
on fixed pipelines and on pipelines drawn each run whose forwards' and backwards' slowest stages
mostly differ; the usual slips are named (one slowest stage for both directions, every stage at the
slowest pace, the forward-slowest stage's own backward, equal stages at the mean cost, latency
ignored, counted one way, on p links or paid by every micro-batch, the busiest stage's share, idle
time divided by busy time).

While the learner's function runs, the lab's schedules, simulator, bubble formula and these
references are switched off, and so are torch's pipeline schedules (`torch.distributed.pipelining`
builds 1F1B and GPipe orders and simulates them; a test searches torch for such code).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable

from parallel_lab.grading.checks import draw_seed, family, guarded, passed, require_callable

__all__ = ["check_bubble_fraction", "check_one_f_one_b_capped"]

#: torch's modules that build pipeline orders (ScheduleGPipe, Schedule1F1B, _get_1f1b_rank_ops, ...),
#: print them (_format_pipeline_order, get_schedule_ops) or simulate them (_simulate_comms_compute)
TORCH_PIPELINE_MODULES = (
    "torch.distributed.pipelining.schedules",
    "torch.distributed.pipelining._schedule_visualizer",
)


@functools.cache
def switched_off() -> dict[str, str]:
    """Everything switched off while a learner's function runs (built on first use: importing
    torch's pipelining costs a few tenths of a second, which every other lesson's grading skips)."""
    return {
        **family(
            "parallel_lab.pipeline.schedules", "parallel_lab.pipeline.simulator", "parallel_lab.pipeline.viz"
        ),
        "parallel_lab.costmodel.formulas.pipeline_bubble_fraction": "",
        f"{__name__}._capped_1f1b": "",
        f"{__name__}._gpipe_bubble": "",
        **family(*TORCH_PIPELINE_MODULES, missing_ok=True),
    }


# ----------------------------------------------------------------------------- the references
def _capped_1f1b(stage: int, stages: int, microbatches: int, caps) -> list:
    """1F1B on stage `stage` when stage s may hold at most `caps[s]` micro-batches' activations.

    At its fullest a 1F1B stage holds its warm-up forwards plus the first forward of the steady
    state (that forward runs before the first backward, and each later pair frees one for one).
    Plain 1F1B fills stage s with p - s micro-batches; its cap and m may allow fewer. The warm-up
    must never grow from one stage to the next: if stage s+1 warmed up longer than stage s, it would
    need, before its backward of some micro-batch k, a forward that stage s runs only after its own
    backward of k, which waits for stage s+1's: a deadlock. So a tight cap upstream shortens every
    warm-up after it: the bound is the smallest cap of this stage and every stage before it."""
    from parallel_lab.pipeline import Step

    held = min(stages - stage, min(caps[: stage + 1]), microbatches)  # micro-batches held at the fullest
    warmup = held - 1
    out = [Step("F", i) for i in range(warmup)]
    for i in range(microbatches - warmup):
        out += [Step("F", warmup + i), Step("B", i)]  # forward of the next, backward of the oldest
    return out + [Step("B", i) for i in range(microbatches - warmup, microbatches)]


def _gpipe_bubble(t_f, t_b, microbatches: int, t_comm: float) -> float:
    """GPipe's idle share when stage s takes t_f[s] per forward and t_b[s] per backward and each
    message arrives t_comm after its send (sends do not block), by following every step.

    F(j) on stage s starts once the stage has finished F(j-1) and F(j)'s activation has arrived from
    stage s-1; the last stage turns to its backwards once its forwards are done; B(j) on stage s
    starts once the stage has finished B(j-1) (or its last forward) and B(j)'s gradient has arrived
    from stage s+1. The step ends with the last backward anywhere; each stage is busy
    m·(t_f[s] + t_b[s]) of it."""
    p, m = len(t_f), microbatches
    f_end = [[0.0] * m for _ in range(p)]
    for s in range(p):
        for j in range(m):
            ready = f_end[s][j - 1] if j else 0.0
            if s:
                ready = max(ready, f_end[s - 1][j] + t_comm)
            f_end[s][j] = ready + t_f[s]
    b_end = [[0.0] * m for _ in range(p)]
    for s in reversed(range(p)):
        for j in range(m):
            ready = b_end[s][j - 1] if j else f_end[s][m - 1]
            if s < p - 1:
                ready = max(ready, b_end[s + 1][j] + t_comm)
            b_end[s][j] = ready + t_b[s]
    step = max(b_end[s][m - 1] for s in range(p))
    busy = m * sum(f + b for f, b in zip(t_f, t_b))
    return 1.0 - busy / (p * step) if step > 0 else 0.0


# ----------------------------------------------------------------------------- exercise 1
#: (stages, microbatches, caps), in the order they are checked: equal caps at p (plain 1F1B), below
#: it, at 1, far above p; a tight cap on the last stage, a middle one, the first; fewer micro-batches
#: than stages; one stage; one micro-batch; longer pipelines
_FIXED_1F1B = [(4, 6, (4,) * 4), (4, 6, (2,) * 4), (4, 6, (1,) * 4), (4, 6, (9,) * 4), (4, 8, (4, 4, 4, 1)),
               (4, 8, (4, 2, 4, 4)), (5, 10, (5, 5, 1, 5, 5)), (4, 8, (1, 4, 4, 4)), (6, 3, (2,) * 6),
               (6, 3, (6, 5, 4, 3, 2, 1)), (1, 1, (1,)), (1, 5, (3,)), (3, 1, (2, 1, 2)), (2, 7, (1, 2)),
               (8, 16, (8, 3, 8, 2, 8, 8, 8, 8))]  # fmt: skip
_DRAWN_1F1B = 24


def _as_steps(got, where: str):
    from parallel_lab.pipeline import Step

    if not isinstance(got, (list, tuple)):
        raise AssertionError(f"{where}: return a list of steps, got {type(got).__name__}")
    import operator

    out = []
    for i, s in enumerate(got):
        if isinstance(s, Step):
            s = (s.kind, s.mb)
        ok = (
            isinstance(s, (tuple, list)) and len(s) == 2 and s[0] in ("F", "B") and not isinstance(s[1], bool)
        )
        try:  # any integer type (a numpy or tensor int too) is a micro-batch number
            mb = operator.index(s[1]) if ok else None
        except TypeError:
            mb = None
        if mb is None:
            raise AssertionError(
                f"{where}: item {i} is {s!r}; each step is ('F', mb) or ('B', mb) with mb an integer"
            )
        out.append(Step(s[0], mb))
    return out


def _show(steps) -> str:
    return " ".join(f"{s.kind}{s.mb}" for s in steps) or "(end)"


def _window(got, want, i: int) -> str:
    lo = max(0, i - 2)
    return (
        f"steps {lo}..{i + 2}: got {_show(got[lo : i + 3])}, expected {_show(want[lo : i + 3])}"
        if want is not None
        else f"steps {lo}..{i + 2}: {_show(got[lo : i + 3])}"
    )


def _require_complete(steps, m: int, where: str) -> None:
    """Every micro-batch's forward and backward exactly once, the forward first."""
    seen: dict[tuple[str, int], int] = {}
    for i, s in enumerate(steps):
        if not 0 <= s.mb < m:
            raise AssertionError(f"{where}: step {i} is {s.kind}{s.mb}; micro-batches are 0 .. {m - 1}")
        if (s.kind, s.mb) in seen:
            raise AssertionError(
                f"{where}: {s.kind}{s.mb} appears twice (steps {seen[s.kind, s.mb]} and {i})"
            )
        if s.kind == "B" and ("F", s.mb) not in seen:
            raise AssertionError(
                f"{where}: step {i} is B{s.mb}, the backward of a micro-batch whose forward has not run"
            )
        seen[s.kind, s.mb] = i
    if len(steps) != 2 * m:
        missing = [f"{k}{i}" for i in range(m) for k in "FB" if (k, i) not in seen]
        raise AssertionError(
            f"{where}: {len(steps)} steps; every micro-batch needs one F and one B, missing {missing[:4]}"
        )


def _peak(steps) -> tuple[int, int]:
    """(most micro-batches held at once, the step at which that is first reached)."""
    held = peak = at = 0
    for i, s in enumerate(steps):
        held += 1 if s.kind == "F" else -1
        if held > peak:
            peak, at = held, i
    return peak, at


def _forwards_first(steps) -> int:
    """Forwards run before the first backward."""
    return next((i for i, s in enumerate(steps) if s.kind == "B"), len(steps))


def _own_cap_only(stage: int, stages: int, m: int, caps) -> list:
    """The usual slip: the longest warm-up this stage's own cap allows, whatever the stages before it run."""
    return _capped_1f1b(0, stages - stage, m, [caps[stage]])


def _diagnosis(got, want, stage: int, stages: int, m: int, caps) -> str:
    """The mistake, named where it is a usual one ('' otherwise)."""
    from parallel_lab.pipeline import order_1f1b

    ahead, expected = _forwards_first(got), _forwards_first(want)
    if m > 1 and ahead == m and got != want:
        return f"All {m} forwards before any backward: that is GPipe's order, not 1F1B's."
    if (
        got == _own_cap_only(stage, stages, m, caps) and got != want
    ):  # plain 1F1B too, where its cap allows it
        return (
            f"Stage {stage}'s own cap allows this warm-up, but can the stages before it feed it? "
            "Follow the pipeline below: what does each stage wait for?"
        )
    if got == order_1f1b(stage, stages, m) and got != want:
        return "That is plain 1F1B's order: it ignores the caps."
    if ahead != expected:
        many = ahead - expected
        word = "long" if many > 0 else "short"
        count = "one forward" if abs(many) == 1 else f"{abs(many)} forwards"
        return (
            f"The warm-up is {count} too {word}: the stage runs {ahead} forward(s) before its first backward, "
            f"the reference {expected}."
        )
    return ""


def _oldest_first(got, want, i: int) -> str:
    if not (got[i].kind == want[i].kind == "B" and got[i].mb != want[i].mb):
        return ""
    done = {(s.kind, s.mb) for s in got[:i]}
    held = sorted(s.mb for s in got[:i] if s.kind == "F" and ("B", s.mb) not in done)
    if held and got[i].mb != held[0]:
        return (
            f"Step {i} is the backward of micro-batch {got[i].mb} while micro-batch {held[0]}, older, is still "
            f"held: 1F1B runs the backward of the oldest micro-batch the stage holds."
        )
    return ""


def _pipeline_outcome(orders, m: int, caps, want_bubble: float) -> str:
    """What the whole pipeline built from these lists does (for a message)."""
    from parallel_lab.pipeline import ScheduleError, add_comms, simulate, validate_schedule

    try:
        validate_schedule(add_comms(orders), m, bound=max(caps))
        sim = simulate(add_comms(orders))
    except ScheduleError as e:
        return f"The whole pipeline built from your function fails: {e}"
    except Exception:  # another stage's list is malformed: say nothing about the pipeline
        return ""
    if sim.bubble_fraction < want_bubble - 1e-9:
        return (
            f"The whole pipeline built from your function runs within the cap, with bubble {sim.bubble_fraction:.4f}, "
            f"smaller than the reference's {want_bubble:.4f}: a better schedule, but not the one asked for (a stage "
            f"whose plain 1F1B order does not fit keeps the longest warm-up it can run within its cap)."
        )
    return (
        f"The whole pipeline built from your function runs, with bubble {sim.bubble_fraction:.4f} "
        f"(the reference's {want_bubble:.4f})."
    )


def _check_case(run, p: int, m: int, caps) -> None:
    from parallel_lab.pipeline import ScheduleError, add_comms, simulate, validate_schedule

    caps = list(caps)
    raw = run(p, m, caps)
    wants = [_capped_1f1b(s, p, m, caps) for s in range(p)]
    want_bubble = simulate(add_comms(wants)).bubble_fraction

    def where(s: int) -> str:
        return f"one_f_one_b_capped(stage={s}, stages={p}, microbatches={m}, caps={caps})"

    orders = [_as_steps(raw[s], where(s)) for s in range(p)]
    for s, (got, want) in enumerate(zip(orders, wants)):
        _require_complete(got, m, where(s))
        peak, at = _peak(got)
        if peak > caps[s]:
            raise AssertionError(
                f"{where(s)}: the stage holds {peak} micro-batches' activations at once (after step {at}), more "
                f"than its cap, caps[{s}] = {caps[s]}.\n  {_window(got, None, at)}\n  "
                f"{_diagnosis(got, want, s, p, m, caps)}".rstrip()
            )
        if got != want:
            i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            named = _oldest_first(got, want, i) or _diagnosis(got, want, s, p, m, caps)
            raise AssertionError(
                f"{where(s)}: first difference at step {i}.\n  {_window(got, want, i)}\n  "
                + "\n  ".join(x for x in (named, _pipeline_outcome(orders, m, caps, want_bubble)) if x)
            )
    case = f"stages={p}, microbatches={m}, caps={caps}"
    try:  # unreachable when every list matches the reference; kept as the real judge
        info = validate_schedule(add_comms(orders), m, bound=max(caps))
    except ScheduleError as e:
        raise AssertionError(f"{case}: the pipeline built from your lists fails: {e}") from None
    sim = simulate(add_comms(orders))
    assert all(peak <= cap for peak, cap in zip(info["peak_in_flight"], caps))
    assert abs(sim.bubble_fraction - want_bubble) < 1e-9, (
        f"{case}: simulated bubble {sim.bubble_fraction:.4f}, the reference's {want_bubble:.4f}"
    )


def check_one_f_one_b_capped(fn: Callable[[int, int, int, list], list]) -> None:
    """`fn(stage, stages, microbatches, caps)` -> the stage's 1F1B order, stage s holding at most `caps[s]`
    micro-batches."""
    require_callable(fn)
    run = guarded(
        lambda p, m, caps: [fn(s, p, m, list(caps)) for s in range(p)],  # a copy each: a learner may edit it
        switched_off(),
        "this exercise (one_f_one_b_capped)",
    )
    rnd = random.Random(draw_seed())
    drawn = []
    for _ in range(_DRAWN_1F1B):
        p = rnd.randint(1, 12)
        drawn.append((p, rnd.randint(1, 3 * p), tuple(rnd.randint(1, p + 2) for _ in range(p))))
    for p, m, caps in _FIXED_1F1B + drawn:
        _check_case(run, p, m, caps)
    passed(
        "check_one_f_one_b_capped",
        f"{len(_FIXED_1F1B)} fixed and {_DRAWN_1F1B} drawn pipelines validated and simulated",
    )


# ----------------------------------------------------------------------------- exercise 2
#: (t_f per stage, t_b per stage, microbatches, t_comm): equal stages (the lesson's case) free and with
#: latency; one stage; one micro-batch; the forwards' and the backwards' slowest on different stages;
#: a slow first stage (the embedding), a slow last stage (the output layer and the loss); latency far
#: above the compute
_FIXED_BUBBLE = [((1.0,) * 4, (2.0,) * 4, 8, 0.0), ((1.0,) * 4, (2.0,) * 4, 8, 0.5), ((1.0,), (2.0,), 1, 0.7),
                 ((1.5,), (1.0,), 8, 2.0), ((1.0, 3.0, 1.0), (4.0, 2.0, 1.0), 1, 0.25),
                 ((1.0, 3.0, 1.0, 1.0), (2.0, 2.0, 2.0, 5.0), 6, 0.0), ((2.5, 1.0, 1.0, 1.0), (4.0, 2.0, 2.0, 2.0), 8, 0.5),
                 ((1.0, 1.0, 1.0, 2.0), (2.0, 2.0, 2.0, 4.5), 16, 1.0), ((2.0, 1.0), (1.0, 3.0), 3, 10.0),
                 ((0.75,) * 16, (1.5,) * 16, 64, 3.0)]  # fmt: skip
_DRAWN_BUBBLE = 30


def _draw_uneven(rnd: random.Random):
    """A pipeline whose forwards' and backwards' slowest stages differ (most of the time), so that
    every rule but the right one misses."""
    p = rnd.randint(2, 12)
    t_f = [round(rnd.uniform(0.2, 3.0), 3) for _ in range(p)]
    t_b = [round(rnd.uniform(0.4, 6.0), 3) for _ in range(p)]
    c = 0.0 if rnd.random() < 0.15 else round(rnd.uniform(0.0, 4.0), 3)
    return tuple(t_f), tuple(t_b), rnd.randint(1, 48), c


def _bubble_slip(got: float, t_f, t_b, m: int, c: float) -> str:
    """The usual wrong rule `got` matches, named ('' for none)."""
    p = len(t_f)
    both = [f + b for f, b in zip(t_f, t_b)]
    busy = m * sum(both)
    path = sum(both) + (m - 1) * (max(t_f) + max(t_b))

    def share(step: float) -> float:
        return 1 - busy / (p * step) if step > 0 else 0.0

    right = share(path + 2 * (p - 1) * c)
    slips = [
        (share(sum(both) + (m - 1) * max(both) + 2 * (p - 1) * c),
         "The m - 1 micro-batches behind the first are paid at the stage whose forward plus backward is slowest: "
         "is the stage that holds the forwards back also the one that holds the backwards back?"),
        (share((m + p - 1) * max(both) + 2 * (p - 1) * c),
         "Every stage is paid at the slowest stage's pace: does the first micro-batch wait for the slowest stage "
         "on its way through the others?"),
        (share((m + p - 1) * (max(t_f) + max(t_b)) + 2 * (p - 1) * c),
         "Every stage is paid at the slowest stages' pace: does the first micro-batch wait for the slowest stage "
         "on its way through the others?"),
        (share((m + p - 1) * sum(both) / p + 2 * (p - 1) * c), "That treats the stages as equal, each at the mean cost."),
        (share(sum(both) + (m - 1) * (max(t_f) + t_b[t_f.index(max(t_f))]) + 2 * (p - 1) * c),
         "The backwards behind the first are paid at the stage whose forward is slowest: is it also the stage "
         "whose backward is slowest?"),
        (share(path + (m - 1) * 2 * c + 2 * (p - 1) * c),
         "The latency is paid by every micro-batch: once a stage's first message has arrived, do the ones behind it "
         "still keep it waiting?"),
        (share(path + 2 * p * c), "The latency is counted on p links each way; p stages have p - 1 links between them."),
        (share(path), "The latency is ignored."),
        (share(path + (p - 1) * c), "The latency is counted in one direction only: the gradients cross the links back as well."),
        (1 - m * max(both) / (path + 2 * (p - 1) * c),
         "That is the idle share of the busiest stage alone; the exercise asks for the idle share of all p stages together."),
        ((p * (path + 2 * (p - 1) * c) - busy) / busy, "That is idle time over busy time; the exercise asks for idle time over the whole step."),
    ]  # fmt: skip
    return next((why for value, why in slips if abs(got - value) < 1e-9 and abs(value - right) > 1e-9), "")


def check_bubble_fraction(fn: Callable[[list, list, int, float], float]) -> None:
    """`fn(t_f, t_b, microbatches, t_comm)` -> GPipe's idle share when stage s takes t_f[s] and t_b[s] and
    messages take t_comm to arrive."""
    require_callable(fn)
    fn = guarded(fn, switched_off(), "this exercise (bubble_fraction)")
    rnd = random.Random(draw_seed())
    drawn = [_draw_uneven(rnd) for _ in range(_DRAWN_BUBBLE)]
    for t_f, t_b, m, c in _FIXED_BUBBLE + drawn:
        where = f"bubble_fraction(t_f={list(t_f)}, t_b={list(t_b)}, microbatches={m}, t_comm={c!r})"
        got = fn(list(t_f), list(t_b), m, c)  # a copy each: a learner may edit them
        assert isinstance(got, (int, float)) and not isinstance(got, bool), (
            f"{where} must return a number, got {type(got).__name__}"
        )
        want = _gpipe_bubble(t_f, t_b, m, c)
        if not abs(got - want) <= 1e-9:  # also catches nan
            slip = _bubble_slip(got, t_f, t_b, m, c)
            raise AssertionError(
                f"{where} returned {got!r}; following every step of GPipe gives {want!r}.{' ' + slip if slip else ''}"
            )
    passed(
        "check_bubble_fraction",
        f"{len(_FIXED_BUBBLE)} fixed and {_DRAWN_BUBBLE} drawn pipelines, every step followed",
    )
