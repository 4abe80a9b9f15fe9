"""Drawing simulated schedules, and comparing them with torch.distributed.pipelining's.

`sim_events` turns a `pipeline.simulate` result into timeline events (F and B as
"compute", the gaps as "bubble"), so `plots.plot_timeline` draws a simulated
schedule exactly like a measured run. `torch_orders` reads the per-rank F/B order
of torch's own schedule classes (`ScheduleGPipe`, `Schedule1F1B`,
`ScheduleInterleaved1F1B`) without running anything, and `compare_with_torch`
lists where they differ from ours.

Invariant: a simulated unit of time is drawn as 1 ms; bubbles fill exactly the
time each rank is not computing between 0 and the makespan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from parallel_lab.pipeline.schedules import V_SCHEDULES, chunks_of, make_schedule, placement_of
from parallel_lab.pipeline.simulator import SimResult, Step, simulate, stage_of

#: our schedule name -> torch.distributed.pipelining's
TORCH_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B", "zb-v": "ZBVZeroBubble",
               "dualpipev": "DualPipeV"}  # fmt: skip


def sim_events(sim: SimResult, chunks: int = 1, unit_s: float = 1e-3) -> list[dict]:
    """Timeline events of a simulation: "F"/"B"/"W" (with ".c<chunk>" when chunks > 1) and "bubble" gaps."""
    events = []
    for r, spans in enumerate(sim.spans):
        t = 0.0
        for start, end, kind, mb, chunk in spans:
            if start > t + 1e-12:
                events.append(_ev(r, "bubble", "bubble", t, start, unit_s))
            name = f"{kind}.c{chunk}" if chunks > 1 else kind
            events.append(_ev(r, name, "compute", start, end, unit_s, mb=mb, chunk=chunk))
            t = end
        if sim.makespan > t + 1e-12:
            events.append(_ev(r, "bubble", "bubble", t, sim.makespan, unit_s))
    return events


def _ev(rank: int, name: str, kind: str, start: float, end: float, unit_s: float, **args: Any) -> dict:
    return {
        "rank": rank,
        "name": name,
        "kind": kind,
        "start": start * unit_s,
        "end": end * unit_s,
        "args": args,
    }


def plot_schedule(
    name: str,
    stages: int,
    microbatches: int,
    chunks: int = 1,
    t_f: float = 1.0,
    t_b: float = 2.0,
    ax: Any = None,
    numbers: bool | None = None,
    t_w: float | None = None,
):
    """Simulate schedule `name` and draw it with `plots.plot_timeline`; returns the Figure.

    Each bar is one F, B or W; its micro-batch number is written inside when there is room
    (`numbers`, default: up to 40 micro-batch-chunks). The title carries the simulated bubble
    next to the formula (p-1)/(v*m + p-1); a zero-bubble schedule (B split from W) splits `t_b`
    into B and W halves unless `t_w` is given, and names 1F1B's formula for comparison.
    """
    from parallel_lab.costmodel import pipeline_bubble_fraction
    from parallel_lab.plots import plot_timeline

    m = 1 if name == "naive" else microbatches
    v, placement = chunks_of(name, chunks), placement_of(name)
    split = name.startswith("zb-") or name in V_SCHEDULES
    if split and t_w is None:
        t_b, t_w = t_b / 2, t_b / 2
    sim = simulate(make_schedule(name, stages, m, v), t_f, t_b, chunks=v, t_w=t_w or 0.0, placement=placement)
    events = sim_events(sim, v)
    formula = f"1F1B's formula {pipeline_bubble_fraction(stages, m, 1):.1%}" if split else (
        f"formula {pipeline_bubble_fraction(stages, m, v):.1%}")  # fmt: skip
    title = (
        f"{name}: p={stages}, m={m}"
        + (f", v={v}" if v > 1 else "")
        + f"; bubble {sim.bubble_fraction:.1%} ({formula})"
    )
    if split:  # Qi et al.'s bubble rate measures each stage from its first instruction to its last
        title += f"; the paper's bubble rate {sim.bubble_rate:.1%}"
    fig = plot_timeline(events, ax=ax, world_size=stages, title=title, color_by="name", labels=False)
    ax = fig.axes[0] if ax is None else ax
    if numbers is None:
        numbers = m * v <= 40 and stages <= 16
    if numbers:
        for e in events:
            if e["kind"] == "compute":
                ax.text((e["start"] + e["end"]) / 2 * 1e3, e["rank"] + 0.25, str(e["args"]["mb"]),
                        ha="center", va="center", fontsize=7, color="white", clip_on=True)  # fmt: skip
    # an unsplit B is the whole backward: with t_w given it lasts t_b + t_w (the simulator's rule)
    units = f"F = {t_f:g}, B = {t_b:g}, W = {t_w:g}" if split else f"F = {t_f:g}, B = {t_b + (t_w or 0.0):g}"
    ax.set_xlabel(f"time (units: {units} per stage)")
    ax.set_yticks([r + 0.25 for r in range(stages)])
    ax.set_yticklabels([f"{'rank' if v > 1 else 'stage'} {r}" for r in range(stages)], fontsize=8)
    return fig


# ----------------------------------------------------------------------------- torch's schedules
def torch_orders(name: str, stages: int, microbatches: int, chunks: int = 1) -> list[list[Step]]:
    """torch.distributed.pipelining's per-rank F/B(/W) order for our schedule `name` (compute steps only).

    Read from `_schedule_visualizer.get_schedule_ops` (a private API): torch builds
    its schedule's action lists for mocked stages, nothing runs. A stage index is mapped to
    the chunk that holds it on its rank (s // p; in a V, 0 for stage r, 1 for 2p-1-r).
    BACKWARD_INPUT is our B and BACKWARD_WEIGHT our W; in a split schedule (the V's) a
    FULL_BACKWARD is our B then W, and an OVERLAP_F_B its forward, then its full backward.
    """
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    if name not in TORCH_NAMES:
        raise ValueError(f"name must be one of {tuple(TORCH_NAMES)}, got {name!r}")
    v, placement, split = chunks_of(name, chunks), placement_of(name), name in V_SCHEDULES
    ops = get_schedule_ops(TORCH_NAMES[name], stages, microbatches, num_stages_per_rank=v if v > 1 else None)
    out = []
    for r, rank_ops in enumerate(ops):
        steps = []
        todo = list(rank_ops)
        while todo:
            a = todo.pop(0)
            kind = getattr(a, "computation_type", None)
            if kind is None:
                continue
            if kind.name == "OVERLAP_F_B":
                todo[:0] = list(a.sub_actions)
                continue
            c = [stage_of(r, k, stages, placement) for k in range(v)].index(a.stage_index) if v > 1 else 0
            if kind.name == "FULL_BACKWARD" and split:
                steps += [Step("B", a.microbatch_index, c), Step("W", a.microbatch_index, c)]
                continue
            k = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}.get(
                kind.name
            )
            if k is not None:
                steps.append(Step(k, a.microbatch_index, c))
        out.append(steps)
    return out


def compare_with_torch(name: str, stages: int, microbatches: int, chunks: int = 1) -> list[str]:
    """Where torch's per-rank F/B order differs from ours: one line per differing rank ([] = equal)."""
    ours = make_schedule(name, stages, microbatches, chunks)
    theirs = torch_orders(name, stages, microbatches, chunks)
    diffs = []
    for r, (a, b) in enumerate(zip(ours, theirs)):
        a = [s for s in a if s.kind in ("F", "B", "W")]
        if a != b:
            i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            diffs.append(
                f"rank {r}: first difference at position {i}: ours {a[i : i + 3]} vs torch {b[i : i + 3]}"
                + (f" (lengths {len(a)} vs {len(b)})" if len(a) != len(b) else "")
            )
    return diffs


# ----------------------------------------------------------------------------- measured runs
def measured_bubble(result: Any, step: int | None = None) -> float:
    """Idle share of a measured pipeline step: 1 - mean over ranks of F/B/W busy time / the step's span.

    The span runs from the first compute (an F) to the last (a B, or a W when the backward is
    split) of `step` on any rank (default: the last step recorded), so start-up, the DP all-reduce
    and the optimizer are left out, as in the formula (p-1)/(v*m + p-1).
    """
    spans = [e for e in result.timeline if e["kind"] == "compute" and "step" in e.get("args", {})]
    if not spans:
        raise ValueError("no pipeline compute spans in this result (was it a train_pipeline run?)")
    step = max(e["args"]["step"] for e in spans) if step is None else step
    spans = [e for e in spans if e["args"]["step"] == step]
    window = max(e["end"] for e in spans) - min(e["start"] for e in spans)
    ranks = sorted({e["rank"] for e in spans})
    busy = [sum(e["end"] - e["start"] for e in spans if e["rank"] == r) for r in ranks]
    return 1.0 - sum(busy) / (len(ranks) * window)


def measured_times(result: Any, step: int | None = None, placement: str = "loop") -> dict[str, float]:
    """What the simulator needs to predict a measured step: `simulate(schedule, **measured_times(run))`.

    t_f, t_b, t_w: the median F, B and W span of `step` (default: the last), per stage (a chunk's
    span times the chunks per rank, as `simulate` divides by them); t_w is 0 when the backward was
    not split. t_comm: the median time from a span's end to the start of the span on the next rank
    that waited for its message (an F on the rank after, a B on the rank before), when that rank
    had nothing else to do: latency and the host's work around a message, which the padded
    compute spans leave out. 0 with one rank. Whose span a message came from is read from the virtual
    stage each executor span records; `placement` (simulator.PLACEMENTS) stands in for traces without it.
    A message to the rank itself (stage p-1 to p in a V) crosses no link and is left out.
    """
    import statistics

    spans = [e for e in result.timeline if e["kind"] == "compute" and "step" in e.get("args", {})]
    if not spans:
        raise ValueError("no pipeline compute spans in this result (was it a train_pipeline run?)")
    step = max(e["args"]["step"] for e in spans) if step is None else step
    spans = [e for e in spans if e["args"]["step"] == step]
    v = 1 + max(e["args"].get("chunk", 0) for e in spans)
    times = {}
    for kind in ("F", "B", "W"):
        mine = [e["end"] - e["start"] for e in spans if e["name"][0] == kind]
        times[f"t_{kind.lower()}"] = v * statistics.median(mine) if mine else 0.0
    at = {(e["rank"], e["name"][0], e["args"]["mb"], e["args"].get("chunk", 0)): e for e in spans}
    ends = {}
    for e in spans:
        ends.setdefault(e["rank"], []).append(e["end"])
    gaps = []
    p = result.world_size
    # the executor's spans name their virtual stage; older traces fall back on `placement`
    stage = {k: e["args"].get("stage", stage_of(k[0], k[3], p, placement)) for k, e in at.items()}
    by_stage = {(kind, mb, stage[k]): e for k, e in at.items() for (_, kind, mb, _) in [k]}
    for k, e in at.items():
        r, kind, mb, _ = k
        if kind == "W":
            continue
        src = by_stage.get(
            (kind, mb, stage[k] + (-1 if kind == "F" else 1))
        )  # the span that sent its message
        if src is None or src["rank"] == r:  # none, or a message to itself (a V's turn): no link crossed
            continue
        free = max((t for t in ends[r] if t <= e["start"] + 1e-9), default=float("-inf"))
        if free < src["end"]:  # this rank was idle, waiting for that message
            gaps.append(e["start"] - src["end"])
    times["t_comm"] = max(0.0, statistics.median(gaps)) if gaps else 0.0
    return times


@dataclass
class MeasuredBubble:
    """A measured pipeline run beside the simulator fed with its own times (`measure_against_simulator`)."""

    run: Any  # the last run's RunResult
    bubbles: dict[int, float]  # step -> measured bubble (warm-up steps left out)
    best: int  # the step compared: the least disturbed one (smallest bubble)
    times: dict[str, float]  # its F, B, W and message times (`measured_times`)
    simulated: float  # the simulator's bubble with those times
    attempts: list[tuple[float, float]]  # (measured, simulated) of every run, the last one included

    @property
    def measured(self) -> float:
        return self.bubbles[self.best]


def measure_against_simulator(
    cfg: Any, world_size: int, *, warmup: int = 1, margin: float = 0.03, tries: int = 3, **launch_kwargs: Any
) -> MeasuredBubble:
    """Run `train_pipeline(cfg)` on `world_size` ranks and compare its least disturbed step with
    `simulate` fed with that step's own F, B, W and message times. Asserts nothing: the caller does.

    Steps before `warmup` are not measured; the least disturbed of the others (smallest bubble) is
    compared. Other work on the machine mostly delays ranks, which adds idle time the simulator
    cannot know of, so a run whose bubble is `margin` or more above the prediction runs again, at
    most `tries` runs in all; one below that (also one far below the prediction) is not run again:
    a busy machine does not make a schedule look better than it is. `attempts` keeps every run's
    (measured, simulated) pair for the caller to print; the other fields are the last run's.
    Pass backend="gloo" for the emulated device (each span padded to its target on the host); under
    NCCL a spin kernel adds the target after the real kernels and spans are timed with CUDA events.
    """
    from parallel_lab.pipeline.executor import train_pipeline
    from parallel_lab.runtime.launch import launch

    if tries < 1:
        raise ValueError(f"tries must be >= 1, got {tries}")
    if not 0 <= warmup < cfg.steps:
        raise ValueError(f"warmup must be in [0, cfg.steps={cfg.steps}), got {warmup}")
    v, where = chunks_of(cfg.schedule, cfg.chunks), placement_of(cfg.schedule)
    sched = make_schedule(cfg.schedule, world_size, cfg.microbatches, v)
    attempts: list[tuple[float, float]] = []
    for _ in range(tries):
        run = launch(train_pipeline, world_size, cfg, **launch_kwargs)
        bubbles = {s: measured_bubble(run, s) for s in range(warmup, cfg.steps)}
        best = min(bubbles, key=bubbles.get)
        times = measured_times(run, best, placement=where)
        simulated = simulate(sched, chunks=v, placement=where, **times).bubble_fraction
        attempts.append((bubbles[best], simulated))
        if bubbles[best] - simulated < margin:
            break
    return MeasuredBubble(run, bubbles, best, times, simulated, attempts)


def peak_activation(result: Any, step: int | None = None) -> list[int]:
    """Per rank, the most "activation" bytes seen in any memory sample (of `step`, default all steps).

    Samples are taken at every span boundary (each F, B and W), so the peak right after a
    forward is seen. Needs a run launched with track_memory=True.
    """
    if not result.memory:
        raise ValueError("no memory samples: launch with track_memory=True")
    peaks = [0] * result.world_size
    bounds = None
    if step is not None:
        spans = [e for e in result.timeline if e.get("args", {}).get("step") == step]
        bounds = (min(e["start"] for e in spans), max(e["end"] for e in spans))
    for s in result.memory:
        if bounds is None or bounds[0] <= s["t"] <= bounds[1]:
            peaks[s["rank"]] = max(peaks[s["rank"]], s["bytes"].get("activation", 0))
    return peaks


def plot_run(result: Any, step: int | None = None, title: str | None = None, ax: Any = None):
    """The timeline of one step of a `train_pipeline` run: F/B bars with micro-batch numbers,
    waiting hatched as bubbles, messages on the comm lane. Returns the Figure."""
    from parallel_lab.plots import plot_timeline

    steps = [
        e["args"]["step"] for e in result.timeline if e["kind"] == "compute" and "step" in e.get("args", {})
    ]
    step = max(steps) if step is None else step
    mine = [e for e in result.timeline if e.get("args", {}).get("step") == step]
    t0, t1 = min(e["start"] for e in mine), max(e["end"] for e in mine)
    events = [
        e
        for e in result.timeline
        if e["start"] >= t0 - 1e-4 and e["end"] <= t1 + 1e-4 and e["name"] != "barrier"
    ]
    title = title or f"measured step {step}: bubble {measured_bubble(result, step):.1%}"
    fig = plot_timeline(
        events, ax=ax, world_size=result.world_size, title=title, color_by="name", labels=False
    )
    ax = fig.axes[0] if ax is None else ax
    comp = [e for e in events if e["kind"] == "compute"]
    if len(comp) <= 160:
        for e in comp:
            ax.text((e["start"] + e["end"]) / 2 * 1e3, e["rank"] + 0.25, str(e["args"]["mb"]),
                    ha="center", va="center", fontsize=7, color="white", clip_on=True)  # fmt: skip
    return fig
