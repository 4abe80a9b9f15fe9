"""Lesson 04's pictures: what each rank holds per ZeRO stage, and measured memory under the formula.

- `plot_zero_states`: the ZeRO paper's Figure 1 as bars. For each stage, the bytes one
  rank holds for parameters, gradients and optimizer states (`costmodel.model_state_bytes`).
- `plot_stage_memory`: one panel per stage, a rank's measured memory stacked by category
  over a run (`plots.draw_memory`), with the formula's cumulative lines dashed over it:
  parameters, + gradients, + optimizer states, in their category colours.
Invariant: every panel of a figure shares one byte unit and one y range.
"""

from __future__ import annotations

from typing import Any

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from parallel_lab import costmodel
from parallel_lab.plots import CATEGORY_COLORS, byte_unit, draw_memory, memory_of

_STATE_CATS = ("param", "grad", "optim")


def plot_zero_states(
    num_params: int, world_size: int, optimizer: str = "adam", precision: str = "mixed", unit: str = "GB",
    ax: Any = None,
) -> Figure:  # fmt: skip
    """Horizontal stacked bars: per stage, one rank's parameter / gradient / optimizer-state bytes."""
    rows = {s: costmodel.model_state_bytes(num_params, world_size, s, optimizer, precision) for s in range(4)}
    scale, uname = byte_unit(rows[0]["total"], unit)
    if ax is None:
        fig, ax = plt.subplots(figsize=(9.4, 2.8), layout="constrained")
    fig = ax.figure
    names = {0: "stage 0 (DP)", 1: "stage 1: P_os", 2: "stage 2: P_os+g", 3: "stage 3: P_os+g+p"}
    for y, s in enumerate(range(3, -1, -1)):
        left = 0.0
        for cat in _STATE_CATS:
            w = rows[s][cat] / scale
            ax.barh(y, w, left=left, color=CATEGORY_COLORS[cat], edgecolor="white", height=0.6,
                    label=cat if y == 0 else None)  # fmt: skip
            left += w
        ax.text(left, y, f"  {rows[s]['total'] / scale:.3g} {uname}", va="center", fontsize=9)
    ax.set_yticks(range(4))
    ax.set_yticklabels([names[s] for s in range(3, -1, -1)])
    ax.set_xlabel(f"model-state bytes per rank ({uname})")
    ax.set_xlim(0, rows[0]["total"] / scale * 1.15)
    ax.legend(loc="lower right", fontsize=8, frameon=False)
    ax.set_title(f"Ψ = {num_params / 1e9:g}B parameters on N = {world_size} ranks, {precision} {optimizer}")
    ax.grid(axis="x", alpha=0.3)
    return fig


def plot_stage_memory(
    runs: dict[int, Any], rank: int = 0, predicted: dict[int, dict[str, float]] | None = None,
    title: str | None = None, unit: str = "auto",
) -> Figure:  # fmt: skip
    """One panel per stage (`runs`: stage -> RunResult with memory): `rank`'s memory by category,
    and the predicted model states as cumulative dashed lines (param, +grad, +optim)."""
    stages = sorted(runs)
    per = {s: [m for m in memory_of(runs[s])[0] if m["rank"] == rank] for s in stages}
    top = max((sum(m["bytes"].values()) for s in stages for m in per[s]), default=0)
    top = max([top, *((p or {}).get("total", 0) for p in (predicted or {}).values())])
    scale, uname = byte_unit(top, unit)
    fig, axes = plt.subplots(1, len(stages), figsize=(min(9.4, 2.2 * len(stages) + 1.0), 3.2), sharey=True,
                             squeeze=False, layout="constrained")  # fmt: skip
    axes = list(axes[0])
    for ax, s in zip(axes, stages):
        draw_memory(fig, [ax], per[s], [rank], unit=uname, legend_outside=False)
        if ax.get_legend() is not None:
            ax.get_legend().remove()
        ax.set_title(f"stage {s}: " + ax.get_title().split(": ", 1)[-1], fontsize=10)
        pred = (predicted or {}).get(s)
        if pred:
            level = 0.0
            for cat in _STATE_CATS:
                level += pred[cat]
                ax.axhline(level / scale, color=CATEGORY_COLORS[cat], linestyle="--", linewidth=1.3)
        ax.set_ylim(0, top / scale * 1.12 if top else 1)
    handles = [plt.Rectangle((0, 0), 1, 1, color=CATEGORY_COLORS[c]) for c in CATEGORY_COLORS]
    labels = list(CATEGORY_COLORS)
    if predicted:
        handles += [Line2D([], [], color=CATEGORY_COLORS[c], linestyle="--") for c in _STATE_CATS]
        labels += ["formula: param", "+ grad", "+ optim"]
    fig.legend(handles, labels, loc="outside right upper", fontsize=8, frameon=False)
    fig.suptitle(title or f"rank {rank}: memory by category, formula dashed")
    return fig


__all__ = ["plot_stage_memory", "plot_zero_states"]
