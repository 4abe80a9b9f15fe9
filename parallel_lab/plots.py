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

Modules: `plots_timeline`, `plots_memory`, `plots_bars`, `plots_live` (the view
`launch(live=True)` draws), `plots_base` (palette, units, input readers); this
module is the public door.
"""

from .plots_bars import plot_comm_bytes, plot_predicted_vs_measured
from .plots_base import CATEGORY_COLORS, KIND_COLORS, byte_unit, chrome_events
from .plots_live import LiveRunView
from .plots_memory import plot_memory
from .plots_timeline import plot_timeline

__all__ = [
    "CATEGORY_COLORS",
    "KIND_COLORS",
    "LiveRunView",
    "byte_unit",
    "chrome_events",
    "plot_comm_bytes",
    "plot_memory",
    "plot_predicted_vs_measured",
    "plot_timeline",
]
