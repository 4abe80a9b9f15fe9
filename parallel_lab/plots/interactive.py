"""One way to draw interactive output: controls, a Run button, progress, and one figure, replaced in place.

Every lesson's widget cell is built with `interactive(...)`, so every one behaves the same in
JupyterLab:
- the figure area holds exactly one figure, always: a redraw replaces it (the image is put in
  the `Output` widget's `outputs` as one PNG; nothing is appended, no `clear_output` wait);
- a live view (`launch(live=figure.widget)`) draws its frames into that same area while ranks
  run, and the final figure replaces the last frame;
- a status line says what is running and how long it took, with a progress bar, so a slow
  run never looks stuck; an error is shown once, in the status line, with its type;
- the cell's stored output also holds a PNG of the default run beside the widget view, so a
  saved lesson shows the picture on a web page or before its kernel runs (JupyterLab prefers
  the live widget when one exists; other renderers take the PNG).

Figures are rendered at a dpi that keeps them at most `MAX_WIDTH_PX` wide: JupyterLab shows
them at 100% in its notebook column, so their text reads without zooming.

Invariant: `show` never leaves more than one output in the figure area.
"""

from __future__ import annotations

import base64
import io
import time
from collections.abc import Callable
from typing import Any

from matplotlib.figure import Figure

from parallel_lab.plots.live import widget_run

#: Widest image a lesson stores or shows, in pixels (JupyterLab's column at 100%).
MAX_WIDTH_PX = 960


def figure_png(fig: Figure, max_width_px: int = MAX_WIDTH_PX, dpi: float = 100.0) -> str:
    """The figure as a base64 PNG at most `max_width_px` wide (the dpi shrinks to fit)."""
    width_in = fig.get_figwidth()
    dpi = min(dpi, max_width_px / width_in)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)  # no bbox "tight": the width stays what we chose
    return base64.b64encode(buf.getvalue()).decode("ascii")


def png_output(png: str, text: str = "<figure>") -> dict:
    """An Output widget's output entry holding one PNG."""
    return {"output_type": "display_data", "data": {"image/png": png, "text/plain": text}, "metadata": {}}


def stamp_figure(fig: Figure, text: str, strip: float = 0.2) -> None:
    """Write `text` in a strip `strip` inches tall added under the figure's axes, so that it never
    lands on their tick labels or x label (the figure grows by the strip). Stamping a figure again
    replaces its text and keeps the strip it has."""
    stamp = getattr(fig, "_pl_stamp", None)
    if stamp is not None and stamp in fig.texts:
        stamp.set_text(text)
        return
    w, h = fig.get_size_inches()
    fig.set_size_inches(w, h + strip)
    frac = strip / (h + strip)
    engine = fig.get_layout_engine()
    if engine is not None and type(engine).__name__ in ("ConstrainedLayoutEngine", "TightLayoutEngine"):
        engine.set(rect=(0, frac, 1, 1 - frac))  # the engine lays the axes out above the strip
    else:  # axes placed by hand or by subplots_adjust: squeeze them into the part above the strip
        for ax in fig.axes:
            x0, y0, aw, ah = ax.get_position().bounds
            ax.set_position([x0, frac + y0 * (1 - frac), aw, ah * (1 - frac)])
    fig._pl_stamp = fig.text(0.995, frac * 0.1, text, fontsize=7, color="#666666", ha="right", va="bottom")


class FigureOutput:
    """An output area that holds one figure at a time."""

    def __init__(self, max_width_px: int = MAX_WIDTH_PX) -> None:
        import ipywidgets as W

        self.widget = W.Output()
        self.max_width_px = max_width_px
        self.draws = 0
        self.last_png: str | None = None
        self.last_text: str | None = None  # when the area shows text instead of a figure

    def show(self, fig: Figure, text: str = "<figure>") -> str:
        """Replace what the area shows with `fig`; closes the figure if pyplot holds it."""
        png = figure_png(fig, self.max_width_px)
        self.show_png(png, text)
        _close(fig)
        return png

    def show_text(self, text: str) -> None:
        """Replace what the area shows with preformatted text (a table, a plan)."""
        self.widget.outputs = ({"output_type": "stream", "name": "stdout", "text": text.rstrip("\n") + "\n"},)
        self.last_png, self.last_text = None, text
        self.draws += 1

    def show_png(self, png: str, text: str = "<figure>") -> None:
        self.widget.outputs = (png_output(png, text),)
        self.last_png, self.last_text = png, None
        self.draws += 1


class Interactive:
    """Controls + Run + status + one figure; `run(**values)` returns the figure to show (or a
    text, e.g. a table), or (figure, note): the note (a short measured result, or a value
    the run had to change) follows "done" in the status line.

    `run` receives the controls' values by name, and `figure` (this object's `FigureOutput`)
    when it accepts it, e.g. to pass `live=figure.widget` to `launch`."""

    def __init__(
        self,
        run: Callable[..., Figure],
        controls: dict[str, Any],
        describe: Callable[..., str] | None = None,
        auto: bool = False,
    ) -> None:
        import inspect

        import ipywidgets as W

        self.run_fn, self.controls = run, dict(controls)
        self.describe = describe or (lambda **v: ", ".join(f"{k}={x}" for k, x in v.items()))
        self.figure = FigureOutput()
        self.button = W.Button(description="Run", button_style="primary", tooltip="run with these values")
        self.progress = W.IntProgress(value=0, min=0, max=1, layout=W.Layout(width="120px"))
        self.status = W.HTML(value="")
        self.runs = 0
        self.errors = 0
        self.note = ""
        self._pass_figure = "figure" in inspect.signature(run).parameters
        self.button.on_click(lambda _: self.run())
        if auto:  # redraw on every change (cheap runs only)
            for w in self.controls.values():
                w.observe(lambda _: self.run(), names="value")
        wrap = W.Layout(flex_flow="row wrap")  # controls wrap to the column's width
        header = W.HBox([*self.controls.values(), self.button, self.progress], layout=wrap)
        self.box = W.VBox([header, self.status, self.figure.widget])
        # class names the browser tests (and a learner's CSS) can find the parts by
        self.box.add_class("pl-interactive")
        header.add_class("pl-controls")
        self.status.add_class("pl-status")
        self.figure.widget.add_class("pl-figure")
        if auto:
            self.box.add_class("pl-auto")
        if self._pass_figure:
            self.box.add_class("pl-live")

    def values(self) -> dict[str, Any]:
        return {k: w.value for k, w in self.controls.items()}

    def run(self) -> Figure | None:
        """Run once with the current values; the figure replaces the previous one."""
        values = self.values()
        what = self.describe(**values)
        self.button.disabled = True
        self.progress.bar_style, self.progress.value = "info", 0
        self.status.value = f"running: {_html(what)}"
        start = time.perf_counter()
        try:
            with widget_run():  # launches inside show no progress line of their own
                fig = self.run_fn(**values, **({"figure": self.figure} if self._pass_figure else {}))
            fig, note = fig if isinstance(fig, tuple) else (fig, "")
            if isinstance(fig, str):
                self.figure.show_text(f"[{what}]\n{fig}")
            else:
                # the picture says what produced it: every control's value, those that did not apply too
                stamp_figure(fig, ", ".join(f"{k}={v}" for k, v in values.items()))
                self.figure.show(fig, f"<{what}>")
        except Exception as e:  # shown once, in the status line; the last good figure stays
            self.errors += 1
            self.progress.bar_style = "danger"
            self.status.value = (
                f"<b>{type(e).__name__}</b>: {_html(str(e).splitlines()[0] if str(e) else '')}"
            )
            return None
        finally:
            self.button.disabled = False
        self.runs += 1
        self.progress.bar_style, self.progress.value = "success", 1
        self.note = note
        done = f"{_html(what)}: done in {time.perf_counter() - start:.1f} s"
        self.status.value = done + (f"; {_html(note)}" if note else "")
        return fig

    def bundle(self) -> dict:
        """The widget view, with the current figure as a PNG beside it (what a saved notebook keeps)."""
        bundle = dict(self.box._repr_mimebundle_())
        if self.figure.last_png is not None:
            bundle["image/png"] = self.figure.last_png
        # a text result (a table, a plan) is what a saved notebook shows in its place
        text = self.figure.last_text
        bundle["text/plain"] = text if text else f"<interactive figure: {self.describe(**self.values())}>"
        return bundle

    def display(self) -> None:
        """Show the widget, then run once (the live view, if any, draws in it); the stored output
        is then updated to carry the default figure as a PNG too."""
        from IPython.display import display

        handle = display(self.bundle(), raw=True, display_id=True)
        if self.figure.last_png is None and self.figure.draws == 0:
            self.run()
        if handle is not None:
            handle.update(self.bundle(), raw=True)


def interactive(
    run: Callable[..., Figure], controls: dict[str, Any], describe: Callable[..., str] | None = None,
    auto: bool = False, show: bool = True,
) -> Interactive:  # fmt: skip
    """Build an `Interactive`, display it and run it once with the default values."""
    view = Interactive(run, controls, describe, auto)
    if show:
        view.display()
    else:
        view.run()
    return view


def _close(fig: Figure) -> None:
    import matplotlib.pyplot as plt

    if plt.fignum_exists(
        getattr(fig, "number", -1)
    ):  # a pyplot figure: the inline backend would show it again
        plt.close(fig)


def _html(s: str) -> str:
    import html

    return html.escape(s)


__all__ = ["MAX_WIDTH_PX", "FigureOutput", "Interactive", "figure_png", "interactive", "png_output"]
