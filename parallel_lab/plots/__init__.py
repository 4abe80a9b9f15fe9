"""Plots of a run: timeline (Gantt per rank), memory (stacked by category), bars.

Every lesson reads the same three pictures: *when* each rank computed, talked or
waited (timeline), *what* filled its memory over time (stacked areas, with the
analytic prediction drawn over it), and predicted-vs-measured bars. One palette
(`KIND_COLORS`, `CATEGORY_COLORS`) keeps them consistent from lesson to lesson.

Invariant: every function takes a `RunResult` (anything with `.timeline`,
`.memory`, `.world_size`, `.comm_bytes`) or the raw lists, draws with matplotlib
only, and returns the Figure. Figures are made with pyplot, so a notebook shows
one when it is assigned (`fig = plot_timeline(r)` or `_ = ...`); a bare trailing
call shows it twice, as with any pyplot figure. Timelines batch every
(rank, lane, colour) into one `broken_barh` collection, so thousands of spans
cost a handful of artists.

Read in this order:
  base.py      the palette (`KIND_COLORS`, `CATEGORY_COLORS`, `KIND_TRACE_COLORS` for saved traces), byte units, readers of run records
  timeline.py  plot_timeline: one row per rank, compute and comm lanes, bubbles visible
  memory.py    plot_memory: stacked live bytes by category, the prediction drawn over it
  bars.py      predicted-vs-measured bars and bytes per collective
  live.py      LiveRunView: the figure `launch(live=True)` redraws while ranks run
  interactive.py  interactive(): controls, Run, progress and one figure replaced in place (every
               lesson's widget cell), figures sized to read at 100% in JupyterLab

This `__init__` is the public door.
"""

from parallel_lab.plots.bars import plot_comm_bytes, plot_predicted_vs_measured
from parallel_lab.plots.base import (
    CATEGORY_COLORS,
    COMM_OP_COLORS,
    KIND_COLORS,
    KIND_TRACE_COLORS,
    PHASE_COLORS,
    byte_unit,
    chrome_events,
    comm_op,
    memory_of,
    phase_color,
)
from parallel_lab.plots.interactive import MAX_WIDTH_PX, FigureOutput, Interactive, figure_png, interactive
from parallel_lab.plots.live import LiveRunView, RunProgress, StatusLine, progress, run_command, widget_run
from parallel_lab.plots.memory import draw_memory, plot_memory
from parallel_lab.plots.timeline import plot_timeline

__all__ = [
    "COMM_OP_COLORS",
    "comm_op",
    "PHASE_COLORS",
    "RunProgress",
    "StatusLine",
    "progress",
    "run_command",
    "phase_color",
    "widget_run",
    "MAX_WIDTH_PX",
    "FigureOutput",
    "Interactive",
    "figure_png",
    "interactive",
    "CATEGORY_COLORS",
    "KIND_COLORS",
    "KIND_TRACE_COLORS",
    "LiveRunView",
    "byte_unit",
    "chrome_events",
    "draw_memory",
    "memory_of",
    "plot_comm_bytes",
    "plot_memory",
    "plot_predicted_vs_measured",
    "plot_timeline",
]
