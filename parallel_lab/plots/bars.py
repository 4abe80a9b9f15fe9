"""Bar charts: predicted vs measured per category, and bytes sent/received per rank.

The lab's habit is to state a number before measuring it (16 bytes/param,
2(N-1)/N * S per rank for a ring all-reduce...). These plots put both side by
side. Invariant: the ratio written above each pair is measured / predicted, so
1.00 means the model was exact and >1 means the run used more than predicted.
"""

from __future__ import annotations

from typing import Any

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from parallel_lab.plots.base import CATEGORY_COLORS, UNITS, byte_unit, bytes_value, new_axes
from parallel_lab.runtime.trace import CATEGORIES


def _scale(values: list[float], unit: str | None) -> tuple[float, str]:
    """Byte units (and 'auto') rescale; any other unit string only labels the axis."""
    if unit == "auto" or unit in UNITS:
        return byte_unit(max(values, default=0.0), unit)
    return 1.0, unit or ""


def plot_predicted_vs_measured(
    predicted: dict[str, float],
    measured: dict[str, float],
    unit: str | None = "auto",
    title: str | None = "Predicted vs measured",
    ax: Any = None,
) -> Figure:
    """Grouped bars per key (hatched = predicted, solid = measured), measured/predicted above each pair.

    Values are bytes when `unit` is "auto" or a byte unit (B, KiB, MiB, GiB, KB, MB,
    GB...); any other `unit` (e.g. "ms", "GFLOP") labels the raw values; None: no unit.
    """
    for name, d in (("predicted", predicted), ("measured", measured)):
        if not isinstance(d, dict):
            raise TypeError(f"{name} must be a dict key -> value, got {type(d).__name__}")
    keys = list(predicted) + [k for k in measured if k not in predicted]
    order = {c: i for i, c in enumerate(CATEGORIES)}
    if all(k in order for k in keys):
        keys.sort(key=order.__getitem__)
    p = {k: bytes_value(v, f"predicted[{k!r}]") for k, v in predicted.items()}
    m = {k: bytes_value(v, f"measured[{k!r}]") for k, v in measured.items()}
    scale, uname = _scale([*p.values(), *m.values()], unit)
    fig, ax = new_axes(ax, figsize=(min(9.4, max(4.5, 1.1 * len(keys) + 2.5)), 3.6))
    w = 0.38
    top = max([*p.values(), *m.values(), 0.0]) / scale
    for i, k in enumerate(keys):
        color = CATEGORY_COLORS.get(k, "#4C72B0")
        if k in p:
            ax.bar(
                i - w / 2,
                p[k] / scale,
                w,
                color=color,
                alpha=0.45,
                hatch="//",
                edgecolor="#333333",
                linewidth=0.6,
            )
        if k in m:
            ax.bar(i + w / 2, m[k] / scale, w, color=color, edgecolor="#333333", linewidth=0.6)
        if k in p and k in m:
            text = f"\u00d7{m[k] / p[k]:.2f}" if p[k] > 0 else ("\u00d71.00" if m[k] == 0 else "n/a")
        else:
            text = "-"
        ax.text(
            i,
            max(p.get(k, 0), m.get(k, 0)) / scale + 0.02 * (top or 1),
            text,
            ha="center",
            va="bottom",
            fontsize=9,
        )
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels(keys)
    ax.set_ylabel(f"{'bytes' if uname in UNITS else 'value'} ({uname})" if uname else "value")
    ax.set_ylim(0, (top or 1) * 1.12)
    ax.grid(axis="y", alpha=0.3)
    ax.set_xlabel("above each pair: measured / predicted", fontsize=8)
    ax.legend(
        handles=[
            Patch(facecolor="#BBBBBB", hatch="//", edgecolor="#333333", label="predicted"),
            Patch(facecolor="#555555", edgecolor="#333333", label="measured"),
        ],
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=8,
        frameon=False,
    )
    if not keys:
        ax.text(
            0.5, 0.5, "nothing to compare", transform=ax.transAxes, ha="center", va="center", color="gray"
        )
    if title:
        ax.set_title(title)
    return fig


def plot_comm_bytes(
    result: Any,
    formula: float | dict[int, float] | None = None,
    op: str | None = None,
    unit: str = "auto",
    ax: Any = None,
    title: str | None = "Bytes sent and received per rank",
) -> Figure:
    """Bars of bytes sent/received per rank (all ops, or only `op`); `formula` (a number,
    or a dict rank -> number) is drawn as a dashed line over each rank's pair."""
    per_rank = getattr(result, "comm_bytes", result)
    if not isinstance(per_rank, (list, tuple)):
        raise TypeError(
            f"result must be a RunResult or a list of per-rank byte counts, got {type(result).__name__}"
        )
    sent, recv = [], []
    for c in per_rank:
        src = c.get("by_op", {}).get(op, {}) if op is not None else c
        sent.append(float(src.get("sent", 0)))
        recv.append(float(src.get("recv", 0)))
    if isinstance(formula, dict):
        lines = {int(r): bytes_value(v, f"formula[{r}]") for r, v in formula.items()}
    elif formula is not None:
        lines = dict.fromkeys(range(len(per_rank)), bytes_value(formula, "formula"))
    else:
        lines = {}
    scale, uname = byte_unit(max([*sent, *recv, *lines.values(), 0.0]), unit)
    fig, ax = new_axes(ax, figsize=(min(9.4, max(4.5, 0.9 * len(per_rank) + 2.5)), 3.4))
    n = len(per_rank)
    w = 0.38
    xs = range(n)
    ax.bar([x - w / 2 for x in xs], [s / scale for s in sent], w, color="#DD8452", label="sent")
    ax.bar([x + w / 2 for x in xs], [v / scale for v in recv], w, color="#8172B3", label="received")
    for i, (r, v) in enumerate(sorted(lines.items())):
        ax.plot(
            [r - 0.48, r + 0.48],
            [v / scale] * 2,
            color="black",
            linestyle="--",
            linewidth=1.4,
            label="formula" if i == 0 else None,
            gid="formula",
        )
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"rank {r}" for r in xs])
    ax.set_ylabel(f"bytes ({uname})")
    ax.grid(axis="y", alpha=0.3)
    top = max([*sent, *recv, *lines.values(), 0.0]) / scale
    ax.set_ylim(0, top * 1.12 if top > 0 else 1.0)
    if n:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    else:
        ax.text(0.5, 0.5, "no byte counts", transform=ax.transAxes, ha="center", va="center", color="gray")
    if title:
        ax.set_title(title + (f" ({op})" if op else ""))
    return fig
