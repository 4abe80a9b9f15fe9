"""Live view of a running launch: timeline (and memory) redrawn in place.

What a learner sees: when `launch(..., live=True)` starts, one figure appears under
the cell (empty axes, "no events"); it refreshes in place at most every
`min_interval` seconds while ranks report spans and memory samples; when the run
ends it is drawn once more and that final picture stays as the cell's output. A
saved notebook holds exactly one image per live view (plus whatever the cell
itself displays afterwards, e.g. `_ = r.plot_memory()`).

How: the figure is a bare `matplotlib.figure.Figure`, never registered with
pyplot, so the inline backend cannot show it a second time at the end of the
cell, and no figure is left open. It is rendered to PNG by Agg and published with
`display(..., display_id=True)` once, then `handle.update(...)`: an
update_display_data message replaces the image in place (no `clear_output` loop,
which nbval would record frame by frame). A PNG bundle rather than `display(fig)`
keeps this independent of which matplotlib backend the kernel runs (inline,
ipympl) and of whether pyplot has registered its formatters yet.

Inside a widget: `target` (an ipywidgets `Output`, e.g. `interactive`'s figure area, passed
as `launch(live=out)`) gets each frame as its one output instead. A display handle cannot be
updated inside an `Output` (the frames would never show), so the frame replaces the Output's
`outputs` tuple, and the run's final figure, drawn by the caller, replaces the last frame.

Invariant: outside a Jupyter kernel (scripts, pytest) the view is inactive: every
call is a cheap no-op, nothing is drawn or printed.
"""

from __future__ import annotations

import base64
import contextlib
import contextvars
import html
import io
import math
import time
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from parallel_lab.plots.base import memory_of, timeline_of
from parallel_lab.plots.memory import draw_memory
from parallel_lab.plots.timeline import draw_timeline


def in_kernel() -> bool:
    """True inside a Jupyter kernel (where display handles can be updated)."""
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - IPython is a dependency
        return False
    ip = get_ipython()
    return ip is not None and getattr(ip, "kernel", None) is not None


class LiveRunView:
    """A figure redrawn in place while a run goes; see the module docstring.

    `update(timeline, memory)` is cheap to call after every message: it redraws
    only when `min_interval` seconds have passed since the last draw and there
    are new events or samples.
    `finish(timeline, memory)` always draws the final state. `active` is False
    outside a kernel (pass `active=True/False` to force it); `draws` counts renders.
    """

    def __init__(
        self,
        world_size: int,
        timeline: bool = True,
        memory: bool = False,
        min_interval: float = 0.2,
        title: str | None = None,
        active: bool | None = None,
        target: Any = None,
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int):
            raise TypeError(f"world_size must be an int, got {type(world_size).__name__}")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not (timeline or memory):
            raise ValueError("timeline and memory are both False: the view would draw nothing")
        if not isinstance(min_interval, (int, float)) or not min_interval >= 0:
            raise ValueError(f"min_interval must be a number of seconds >= 0, got {min_interval!r}")
        self.world_size = world_size
        self.timeline = timeline
        self.memory = memory
        self.min_interval = float(min_interval)
        self.title = title or f"live run: {world_size} rank{'s' if world_size > 1 else ''}"
        self.target = target
        self.active = (in_kernel() or target is not None) if active is None else bool(active)
        self.draws = 0
        self.updates = 0
        self.finished = False
        self.fig: Figure | None = None
        self.handle: Any = None
        self.last_png: str | None = None  # base64 of the image on screen
        self._clock = time.monotonic
        self._next = -math.inf  # clock time before which update() does not redraw
        self._drawn: tuple[int, int] | None = None  # (events, samples) in the image on screen
        if self.active:
            self.fig = Figure(figsize=(9.4, sum(h for _, h in self._parts())), layout="constrained")
            FigureCanvasAgg(self.fig)
            self.handle = _TargetHandle(target) if target is not None else None
            if self.handle is not None:
                self.handle.update(self._render([], []), raw=True)
            else:
                self.handle = _display(self._render([], []))

    def update(self, timeline: list[dict] | None = None, memory: list[dict] | None = None) -> bool:
        """Redraw if there is something new and `min_interval` (and 3x the last frame's
        drawing time) has passed since the last frame; True when it drew."""
        self.updates += 1
        if not self.active or self.finished:
            return False
        if self._clock() < self._next:
            return False
        # The launcher only appends, so equal lengths mean nothing new to draw.
        if (len(timeline or ()), len(memory or ())) == self._drawn:
            return False
        self.handle.update(self._render(timeline or [], memory or []), raw=True)
        return True

    def finish(self, timeline: list[dict] | None = None, memory: list[dict] | None = None) -> None:
        """Draw the final state; later calls to update/finish do nothing."""
        if self.finished:
            return
        self.finished = True
        if self.active:
            self.handle.update(self._render(timeline or [], memory or []), raw=True)

    # -- drawing ----------------------------------------------------------------
    def _parts(self) -> list[tuple[str, float]]:
        """The panels drawn, with their heights in inches."""
        parts = [("timeline", 1.2 + 0.55 * self.world_size)] if self.timeline else []
        if self.memory:
            parts.append(("memory", 2.3 * math.ceil(self.world_size / 4) + 0.4))
        return parts

    def _render(self, timeline: list[dict], memory: list[dict]) -> dict:
        """Draw the figure and return it as a PNG display bundle."""
        start = self._clock()
        self._draw(timeline, memory)
        buf = io.BytesIO()
        self.fig.savefig(buf, format="png", dpi=80)
        self.last_png = base64.b64encode(buf.getvalue()).decode("ascii")
        # Drawing runs on the launcher's thread, between messages from the ranks: after a
        # frame that took d seconds, wait at least 3d so drawing takes at most ~1/4 of it.
        end = self._clock()
        self._next = end + max(self.min_interval, 3.0 * (end - start))
        self._drawn = (len(timeline), len(memory))
        self.draws += 1
        return {"image/png": self.last_png, "text/plain": f"<{self.title}>"}

    def _draw(self, timeline: list[dict], memory: list[dict]) -> None:
        # Rebuilding the axes each time is simpler than patching artists and costs
        # little next to rendering; the Figure object (and the display) stay the same.
        fig = self.fig
        fig.clear()
        parts = self._parts()
        subs = fig.subfigures(len(parts), 1, height_ratios=[h for _, h in parts], squeeze=False).flat
        xlim = None
        for (what, _), sub in zip(parts, subs):
            if what == "timeline":
                events, _ = timeline_of(list(timeline))
                ax = sub.subplots()
                draw_timeline(ax, events, self.world_size, title=f"{self.title}: timeline", labels=False)
                xlim = ax.get_xlim() if events else None
            else:
                samples, _ = memory_of(list(memory))
                ncols = min(self.world_size, 4)
                axs = sub.subplots(
                    math.ceil(self.world_size / ncols), ncols, sharex=True, sharey=True, squeeze=False
                ).flat
                axes = list(axs)
                for extra in axes[self.world_size :]:
                    extra.set_visible(False)
                draw_memory(
                    sub,
                    axes[: self.world_size],
                    samples,
                    list(range(self.world_size)),
                    title=f"{self.title}: memory",
                )
                if xlim is not None:  # one time window for both panels (memory axes share x)
                    axes[0].set_xlim(*xlim)


# Set while an interactive widget runs its callback: the widget has its own status line and
# progress bar, and its output area must hold exactly one figure.
_WIDGET_RUNNING: contextvars.ContextVar[bool] = contextvars.ContextVar("widget_running", default=False)


@contextlib.contextmanager
def widget_run() -> Any:
    """Inside: launches show no progress line of their own (the widget shows its own)."""
    token = _WIDGET_RUNNING.set(True)
    try:
        yield
    finally:
        _WIDGET_RUNNING.reset(token)


class StatusLine:
    """One line of text under a cell, refreshed in place at most every `min_interval` seconds
    and replaced by nothing at `finish()`, so a stored notebook keeps only the cell's own output.
    Inactive outside a kernel and inside an interactive widget's run (see `widget_run`)."""

    def __init__(self, min_interval: float = 0.5) -> None:
        self.min_interval = min_interval
        self.start = time.perf_counter()
        self._last = -math.inf
        self.handle = None
        self.active = in_kernel() and not _WIDGET_RUNNING.get()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def show(self, line: str, force: bool = False) -> None:
        if not self.active:
            return
        now = time.perf_counter()
        if self.handle is None:
            # Displayed empty, then filled by updates: a saved or headless run (nbval records the
            # display, not its updates) keeps exactly what the final update leaves, an empty line.
            self.handle = _display({"text/plain": ""})
        elif not force and now - self._last < self.min_interval:
            return
        self._last = now
        bundle = {
            "text/plain": line,
            "text/html": f"<div class='pl-progress'><tt>{html.escape(line)}</tt></div>",
        }
        self.handle.update(bundle, raw=True)

    def finish(self) -> None:
        if self.handle is not None:
            self.handle.update({"text/plain": ""}, raw=True)
            self.handle = None
        self.active = False


class RunProgress(StatusLine):
    """The status line of a launch: "running train_dp on 4 ranks: 3.2 s, 2 of 4 done, 148 spans"."""

    def __init__(self, what: str, world_size: int, min_interval: float = 0.5) -> None:
        super().__init__(min_interval)
        self.what, self.world_size = what, world_size
        self.update(0, 0, force=True)

    def update(self, done: int, spans: int, force: bool = False) -> None:
        ranks = f"{self.world_size} rank{'s' if self.world_size > 1 else ''}"
        line = f"running {self.what} on {ranks}: {self.elapsed():.1f} s, {done} of {self.world_size} done, {spans} spans"
        self.show(line, force)


def progress(items: Any, what: str, total: int | None = None) -> Any:
    """Iterate `items` with a status line under the cell: "what: 3 of 24, 2.1 s"."""
    n = total if total is not None else (len(items) if hasattr(items, "__len__") else None)
    line = StatusLine()
    try:
        for i, item in enumerate(items):
            line.show(
                f"{what}: {i} of {n if n is not None else '?'} done, {line.elapsed():.1f} s", force=i == 0
            )
            yield item
    finally:
        line.finish()


def run_command(cmd: list[str], what: str | None = None, **kwargs: Any) -> Any:
    """`subprocess.run(cmd, capture_output=True, text=True, **kwargs)`, with a status line while it
    runs ("running torchrun ... : 4.5 s"). Returns the CompletedProcess."""
    import os
    import subprocess

    what = what or " ".join(os.path.basename(c) if i == 0 else c for i, c in enumerate(cmd[:6]))
    line = StatusLine()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    try:
        while True:
            try:
                out, err = proc.communicate(timeout=0.25)
                break
            except subprocess.TimeoutExpired:
                line.show(f"running {what}: {line.elapsed():.1f} s", force=line.handle is None)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        line.finish()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


class _TargetHandle:
    """A display handle's `update`, for an ipywidgets Output: the frame becomes its one output."""

    def __init__(self, out: Any) -> None:
        self.out = out

    def update(self, bundle: dict, raw: bool = True) -> None:
        self.out.outputs = ({"output_type": "display_data", "data": bundle, "metadata": {}},)


def _display(bundle: dict) -> Any:
    from IPython.display import display

    return display(bundle, raw=True, display_id=True)
