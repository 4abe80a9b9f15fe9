"""Memory over time per rank, stacked by category, with the predicted peak over it.

Lesson 02's picture: parameters, gradients, optimizer states and activations
stacked in `trace.CATEGORIES` order, step-wise between samples (a sample holds
until the next one), one subplot per rank on a shared y axis, and the analytic
prediction from `costmodel` drawn as a dashed "predicted peak" line.
Invariant: the y unit (B/KiB/MiB/GiB) is chosen once for all subplots and the
prediction, and is written in the axis label.
"""

from __future__ import annotations

import math
import numbers
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from parallel_lab.plots.base import CATEGORY_COLORS, byte_unit, bytes_value, memory_of, time_window
from parallel_lab.runtime.trace import CATEGORIES


def plot_memory(
    result_or_samples: Any,
    ranks: Sequence[int] | None = None,
    predicted: float | dict | None = None,
    unit: str = "auto",
    ax: Any = None,
    title: str | None = "Memory per rank",
    predicted_label: str = "predicted peak",
) -> Figure:
    """Per rank a subplot (shared y) of memory stacked by category over time (step-wise).

    `predicted`: a number (one "predicted peak" line on every rank), a dict rank ->
    bytes, or a dict category -> bytes (the line is drawn at their sum), labelled
    `predicted_label` (say "predicted model states" when the line is not a peak). `ax` may be
    one Axes (one rank) or a sequence with one Axes per rank.
    """
    samples, ws = memory_of(result_or_samples)
    present = sorted({s["rank"] for s in samples})
    if ranks is None:
        ranks = present or list(range(ws or 0))
    ranks = list(ranks)
    for r in ranks:
        if not isinstance(r, numbers.Integral) or r < 0 or (ws and r >= ws):
            raise ValueError(f"ranks must hold ranks in [0, {ws or 'world_size'}), got {r!r}")
    ranks = [int(r) for r in ranks]
    n = max(len(ranks), 1)
    if ax is None:
        ncols = min(n, 4)
        nrows = math.ceil(n / ncols)
        fig, axs = plt.subplots(
            nrows,
            ncols,
            sharex=True,
            sharey=True,
            squeeze=False,
            layout="constrained",
            figsize=(min(2.2 * ncols + 1.2, 9.4), 2.4 * nrows + 0.6),  # <= 940 px at 100 dpi
        )
        axes = list(axs.flat)
        for extra in axes[n:]:
            extra.set_visible(False)
    else:
        axes = list(ax.flat) if hasattr(ax, "flat") else list(ax) if isinstance(ax, (list, tuple)) else [ax]
        if len(axes) < n:
            raise ValueError(f"ax must hold one Axes per rank ({n}), got {len(axes)}")
        fig = axes[0].figure
    draw_memory(
        fig, axes[:n], samples, ranks, predicted=predicted, unit=unit, title=title, legend_outside=ax is None,
        predicted_label=predicted_label, title_on="figure" if ax is None else "axes",
    )  # fmt: skip
    return fig


def draw_memory(
    fig: Any,
    axes: list,
    samples: list[dict],
    ranks: list[int],
    predicted: Any = None,
    unit: str = "auto",
    title: str | None = None,
    legend_outside: bool = True,
    predicted_label: str = "predicted peak",
    title_on: str = "figure",
) -> None:
    """Draw normalised samples, one Axes per rank in `ranks` (used by the live view too).

    `title_on`: "figure" (a suptitle over all panels) or "axes" (each panel's own title, for
    panels the caller placed in its own figure)."""
    pred = _predicted_per_rank(predicted, ranks)
    by_rank: dict[int, list[dict]] = defaultdict(list)
    for s in samples:
        by_rank[s["rank"]].append(s)
    seen = {c for s in samples for c, v in s["bytes"].items() if v}
    cats = [c for c in CATEGORIES if c in seen] + sorted(seen - set(CATEGORIES))
    # a sample's "high_water" is the highest total since the sample before: peaks between samples
    totals = {r: max((max(sum(s["bytes"].values()), s.get("high_water") or 0) for s in by_rank[r]), default=0)
              for r in ranks}  # fmt: skip
    # on CUDA each sample also carries the caching allocator's own counts: the axis must hold them too
    device_top = max((s["device"].get("reserved", 0) for s in samples if s.get("device")), default=0)
    scale, uname = byte_unit(max([*totals.values(), *pred.values(), device_top, 0]), unit)
    top = max([*totals.values(), *pred.values(), device_top, 0]) / scale
    t_first = min((s["t"] for s in samples), default=0.0) * 1e3
    # Each sample holds until the next; the last one gets a little width of its own, or
    # a peak taken at the very end would be drawn zero-wide.
    t_end = max((s["t"] for s in samples), default=0.0) * 1e3
    t_end += 0.03 * (t_end - t_first)
    window = time_window(t_first, t_end)
    handles: dict[str, Any] = {}
    for i, r in enumerate(ranks):
        a = axes[i]
        rs = sorted(by_rank[r], key=lambda s: s["t"])
        if rs and cats:
            # step="post": a sample holds until the next one; the last one until t_end.
            t = [s["t"] * 1e3 for s in rs] + [t_end]
            ys = [[s["bytes"].get(c, 0) / scale for s in rs] for c in cats]
            ys = [y + [y[-1]] for y in ys]
            polys = a.stackplot(
                t,
                ys,
                step="post",
                colors=[CATEGORY_COLORS.get(c, "#BBBBBB") for c in cats],
                labels=cats,
                linewidth=0,
            )
            handles.update(zip(cats, polys))
            if any(s.get("high_water") is not None for s in rs):
                hw = [max(s.get("high_water") or 0, sum(s["bytes"].values())) / scale for s in rs]
                # the high water of a sample covers the interval that ends at it
                (hl,) = a.step(
                    t[:-1], hw, where="pre", color="#333333", lw=0.7, label="highest between samples"
                )
                handles["highest between samples"] = hl
            if any(s.get("device") for s in rs):  # CUDA: what the allocator handed out, and what it holds
                for key, label, style in (("allocated", "CUDA allocator: allocated", "-"),
                                          ("reserved", "CUDA allocator: reserved", ":")):  # fmt: skip
                    ys_dev = [(s.get("device") or {}).get(key, 0) / scale for s in rs]
                    (dl,) = a.step(
                        t[:-1], ys_dev, where="post", color="#8B0000", lw=1.0, ls=style, label=label
                    )
                    handles[label] = dl
        else:
            a.text(
                0.5, 0.5, "no memory samples", transform=a.transAxes, ha="center", va="center", color="gray"
            )
        if r in pred:
            (line,) = a.plot(
                [0, 1],
                [pred[r] / scale] * 2,
                transform=a.get_yaxis_transform(),
                color="black",
                linestyle="--",
                linewidth=1.2,
                label=predicted_label,
                gid="predicted",
            )
            handles[predicted_label] = line
        head = f"{title}, rank {r}" if (title and title_on == "axes") else f"rank {r}"
        a.set_title(f"{head}: peak {totals[r] / scale:.3g} {uname}" if rs else head, fontsize=10)
        spec = a.get_subplotspec()
        ncols = spec.get_gridspec().ncols if spec is not None else 1
        if i + ncols >= len(ranks):  # nothing drawn below: this one carries the x labels
            a.set_xlabel("time (ms)")
            a.tick_params(labelbottom=True)
        if spec is None or spec.is_first_col():
            a.set_ylabel(f"memory ({uname})")
        a.set_ylim(0, top * 1.12 if top > 0 else 1.0)  # headroom so the predicted line is not the frame
        a.grid(alpha=0.3)
    for a in axes[: len(ranks)]:
        a.set_xlim(*window)
    if not ranks:
        axes[0].text(
            0.5, 0.5, "no memory samples", transform=axes[0].transAxes, ha="center", va="center", color="gray"
        )
        axes[0].set_xlabel("time (ms)")
        axes[0].set_ylabel(f"memory ({uname})")
    if handles:
        hl = list(handles.values())[::-1], list(handles)[::-1]  # legend top-down like the stack
        if legend_outside:
            # centred on the right: a long suptitle runs over a legend in the upper corner
            fig.legend(*hl, loc="outside right center", fontsize=8, frameon=False)
        else:
            axes[-1].legend(*hl, loc="upper right", fontsize=7)
    if title and title_on == "figure":
        fig.suptitle(title)


def _predicted_per_rank(predicted: Any, ranks: list[int]) -> dict[int, float]:
    if predicted is None:
        return {}
    if isinstance(predicted, dict):
        if not predicted:
            return {}
        if all(isinstance(k, numbers.Integral) and not isinstance(k, bool) for k in predicted):
            out = {int(k): bytes_value(v, f"predicted[{k}]") for k, v in predicted.items()}
            return {r: v for r, v in out.items() if r in ranks}
        if all(isinstance(k, str) for k in predicted):
            total = sum(bytes_value(v, f"predicted[{k!r}]") for k, v in predicted.items())
            return dict.fromkeys(ranks, total)
        raise TypeError("predicted dict keys must be all ranks (int) or all categories (str)")
    return dict.fromkeys(ranks, bytes_value(predicted, "predicted"))
