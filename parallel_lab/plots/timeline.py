"""Timeline: a Gantt chart per rank of what each rank did and when.

One row per rank with two lanes: compute/optimizer/bubble/idle above,
comm/memcpy below, so overlap of communication with compute (bucketed DDP,
ZeRO prefetch) and pipeline bubbles show at a glance. Bubbles and idle time are
hatched: waiting must be visible, not just a pale bar.
Invariant: every (rank, lane, colour) is one `broken_barh` collection, so
thousands of spans cost a handful of artists; times are drawn in ms.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from parallel_lab.plots.base import (
    COMM_OP_COLORS,
    KIND_COLORS,
    comm_op,
    new_axes,
    phase_color,
    time_window,
    timeline_of,
)
from parallel_lab.runtime.trace import KINDS

_HATCHED = {"bubble": "//", "idle": ".."}  # waiting must be visible, not just a pale bar
_HATCH_EDGE = {"bubble": "#7F2A2A", "idle": "#707070"}
_LOWER_LANE = {"comm", "memcpy"}  # everything else shares the upper (compute) lane


def plot_timeline(
    result_or_events: Any,
    ax: Any = None,
    world_size: int | None = None,
    title: str | None = "Timeline per rank",
    color_by: str = "kind",
    show_legend: bool = True,
    labels: bool | None = None,
) -> Figure:
    """Gantt chart: one row per rank, an upper lane (compute/optimizer/bubble/idle) and
    a lower lane (comm/memcpy). Bubbles and idle time are hatched.

    Accepts a RunResult, a list of event dicts, or a Chrome trace dict/path (ph "X"
    events, pid = rank). `color_by` is "kind" or "name" (one colour per op name).
    `labels` writes op names inside bars wide enough to hold them (auto: when there
    are at most 200 events).
    """
    events, ws = timeline_of(result_or_events)
    if color_by not in ("kind", "name"):  # before a figure exists: a refused call leaves none open
        raise ValueError(f"color_by must be 'kind' or 'name', got {color_by!r}")
    if world_size is not None and (
        isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 0
    ):
        raise ValueError(f"world_size must be a non-negative int, got {world_size!r}")
    if ax is None:
        n = world_size or ws or (max((e["rank"] for e in events), default=0) + 1)
        fig, ax = new_axes(None, figsize=(9.4, 1.1 + 0.75 * n))
    fig = ax.figure
    draw_timeline(
        ax, events, world_size or ws, title=title, color_by=color_by, show_legend=show_legend, labels=labels
    )
    return fig


def draw_timeline(
    ax: Any,
    events: list[dict],
    world_size: int | None = None,
    title: str | None = None,
    color_by: str = "kind",
    show_legend: bool = True,
    labels: bool | None = None,
) -> None:
    """Draw normalised events into `ax` (used by `plot_timeline` and the live view)."""
    if color_by not in ("kind", "name"):
        raise ValueError(f"color_by must be 'kind' or 'name', got {color_by!r}")
    top = max((e["rank"] for e in events), default=-1) + 1
    if world_size is None:
        world_size = top
    elif not isinstance(world_size, int) or world_size < 0:
        raise ValueError(f"world_size must be a non-negative int, got {world_size!r}")
    elif top > world_size:
        raise ValueError(f"world_size={world_size} but the events name rank {top - 1}")

    colors = _name_colors(events) if color_by == "name" else KIND_COLORS

    def key_of(e: dict) -> str:
        if e["kind"] in _HATCHED:  # waiting keeps its kind's look whatever the colouring
            return e["kind"]
        if color_by == "kind" and e["kind"] == "comm":  # each collective its own colour
            return comm_op(e["name"]) or "comm"
        k = e["kind"] if color_by == "kind" else e["name"]
        return k if k in colors else "other"

    def color_of(key: str) -> Any:
        if key in COMM_OP_COLORS and color_by == "kind":
            return COMM_OP_COLORS[key]
        return KIND_COLORS[key] if key in _HATCHED else colors[key]

    # One broken_barh per (rank, lane, colour key): a handful of artists for any number of spans.
    groups: dict[tuple[int, bool, str], list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        groups[(e["rank"], e["kind"] in _LOWER_LANE, key_of(e))].append(
            (e["start"] * 1e3, max(0.0, e["end"] - e["start"]) * 1e3)
        )
    for (rank, lower, key), spans in groups.items():
        ax.broken_barh(
            spans,
            (rank + (0.5 if lower else 0.05), 0.4),
            facecolors=color_of(key),
            edgecolor=_HATCH_EDGE.get(key, "none"),
            hatch=_HATCHED.get(key),
            linewidth=0,
        )

    t_end = max((e["end"] for e in events), default=0.0) * 1e3
    window = time_window(min((e["start"] for e in events), default=0.0) * 1e3, t_end)
    if labels is None:
        labels = 0 < len(events) <= 200
    if labels and t_end > 0:
        for e in events:
            w = (e["end"] - e["start"]) * 1e3
            if w > 0.035 * (window[1] - window[0]) * max(1, len(e["name"]) / 6):  # only where the text fits
                y = e["rank"] + (0.7 if e["kind"] in _LOWER_LANE else 0.25)
                ax.text(
                    (e["start"] * 1e3) + w / 2,
                    y,
                    e["name"],
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="black",
                    clip_on=True,
                )

    ax.set_ylim(max(world_size, 1), 0)  # rank 0 on top
    ax.set_yticks([r + off for r in range(world_size) for off in (0.25, 0.7)])
    ax.set_yticklabels(
        [f"rank {r} {lane}" for r in range(world_size) for lane in ("compute", "comm")], fontsize=8
    )
    for r in range(1, world_size):
        ax.axhline(r, color="#BBBBBB", linewidth=0.6)
    ax.set_xlabel("time (ms)")
    ax.set_xlim(*window)
    ax.grid(axis="x", alpha=0.3)
    if not events:
        ax.text(0.5, 0.5, "no events", transform=ax.transAxes, ha="center", va="center", color="gray")
    if title:
        ax.set_title(title)
    if show_legend and events:
        used = {k for (_, _, k) in groups}
        ops = list(COMM_OP_COLORS) if color_by == "kind" else []
        named = [x for k in colors if k != "other" for x in ([k, *ops] if k == "comm" else [k])]
        order = dict.fromkeys(named + [k for k in KINDS if k in _HATCHED] + ["other"])
        handles = [
            Patch(
                facecolor=color_of(k),
                hatch=_HATCHED.get(k),
                edgecolor=_HATCH_EDGE.get(k, "none"),
                label="other ops" if (k == "other" and color_by == "name") else k,
            )
            for k in order
            if k in used
        ]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)


def _name_colors(events: list[dict], limit: int = 12) -> dict[str, str]:
    """One colour per op name, the longest-running names first; the rest are "other"."""
    total: dict[str, float] = defaultdict(float)
    for e in events:
        if e["kind"] not in _HATCHED:
            total[e["name"]] += e["end"] - e["start"]
    # tab10 without its brown and grey (those mean "other" and "idle" here), then tab20's light shades.
    palette = [plt.get_cmap("tab10")(i) for i in (0, 1, 2, 3, 4, 6, 8, 9)]
    palette += [plt.get_cmap("tab20")(2 * i + 1) for i in (0, 1, 2, 3, 4, 6, 8, 9)]
    names = sorted(total, key=lambda n: -total[n])[:limit]
    out = {n: phase_color(n) for n in names if phase_color(n) is not None}  # fixed across lessons
    rest = [n for n in names if n not in out]
    out.update({n: palette[i % len(palette)] for i, n in enumerate(rest)})
    out["other"] = KIND_COLORS["other"]
    return out
