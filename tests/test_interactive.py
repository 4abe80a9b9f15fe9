"""interactive(): one figure per output area, replaced in place; live frames inside a widget."""

from __future__ import annotations

import base64
import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

pytest.importorskip("ipywidgets")
import ipywidgets as W  # noqa: E402

import parallel_lab as pl  # noqa: E402
from parallel_lab.plots import MAX_WIDTH_PX, FigureOutput, Interactive, figure_png  # noqa: E402


def _width(png: str) -> int:
    from PIL import Image

    return Image.open(io.BytesIO(base64.b64decode(png))).size[0]


def _fig(k: float):
    fig, ax = plt.subplots(figsize=(14, 3))  # wider than the column on purpose
    ax.plot([0, 1], [0, k])
    return fig


def test_show_replaces_the_figure_in_place():
    out = FigureOutput()
    first = out.show(_fig(1))
    second = out.show(_fig(2))
    assert len(out.widget.outputs) == 1 and out.draws == 2 and first != second
    assert out.widget.outputs[0]["data"]["image/png"] == second
    assert not plt.get_fignums(), "a shown pyplot figure must be closed (else the cell shows it again)"


def test_figures_fit_the_column():
    assert _width(figure_png(_fig(1))) <= MAX_WIDTH_PX
    plt.close("all")


def test_interactive_runs_reports_and_keeps_one_figure():
    k = W.IntSlider(value=1, min=1, max=3)

    def draw(k):
        if k == 3:
            raise ValueError("k=3 is not allowed here")
        return _fig(k), f"slope {k}"

    view = Interactive(draw, {"k": k})
    view.run()
    png1 = view.figure.last_png
    k.value = 2
    view.run()
    assert view.runs == 2 and len(view.figure.widget.outputs) == 1 and view.figure.last_png != png1
    assert "done in" in view.status.value and "slope 2" in view.status.value
    k.value = 3
    assert view.run() is None and view.errors == 1
    assert "ValueError" in view.status.value and "k=3 is not allowed" in view.status.value
    assert len(view.figure.widget.outputs) == 1  # the last good figure stays, the error is said once


def _steps(ctx):
    for _ in range(3):
        with ctx.span("work", "compute"):
            torch.ones(1000).sum()
        dist.barrier()
    return ctx.rank


def test_live_view_draws_inside_a_widget_output():
    out = W.Output()
    res = pl.launch(_steps, 2, live=out)
    assert res.values == [0, 1]
    assert len(out.outputs) == 1 and "image/png" in out.outputs[0]["data"]


def test_live_must_be_a_bool_or_an_output():
    with pytest.raises(TypeError, match="live must be True, False or an ipywidgets Output"):
        pl.launch(_steps, 2, live="yes")


class _Handle:
    def __init__(self, bundle):
        self.frames = [bundle]

    def update(self, bundle, raw=True):
        self.frames.append(bundle)


def _slow_rank(ctx, seconds):
    import time

    with ctx.span("work", "compute"):
        time.sleep(seconds)
    return ctx.rank


def test_a_launch_in_a_notebook_shows_one_progress_line_then_clears_it(monkeypatch):
    import importlib

    import parallel_lab as pl
    from parallel_lab.plots import live

    importlib.import_module("ipykernel")  # what launch looks for to know it runs in a notebook
    handles: list[_Handle] = []
    monkeypatch.setattr(live, "in_kernel", lambda: True)
    monkeypatch.setattr(live, "_display", lambda b: handles.append(_Handle(b)) or handles[-1])
    res = pl.launch(_slow_rank, 2, 1.5)
    assert res.values == [0, 1]
    assert len(handles) == 1, "one status line per launch"
    lines = [f.get("text/plain", "") for f in handles[0].frames]
    assert lines[0] == "", "displayed empty (what a headless run records), then filled by updates"
    assert lines[1].startswith("running _slow_rank on 2 ranks: ")
    assert len(lines) >= 4, lines  # refreshed while the ranks sleep
    assert lines[-1] == "", "the line goes away when the run ends"

    with live.widget_run():  # an interactive widget shows its own status: no second line
        pl.launch(_slow_rank, 2, 0.0)
    assert len(handles) == 1


def test_progress_and_run_command_show_a_line_and_clear_it(monkeypatch):
    import sys
    import time

    from parallel_lab.plots import live

    handles: list[_Handle] = []
    monkeypatch.setattr(live, "in_kernel", lambda: True)
    monkeypatch.setattr(live, "_display", lambda b: handles.append(_Handle(b)) or handles[-1])
    got = []
    for i in live.progress(range(3), "three things"):
        got.append(i)
        time.sleep(0.3)
    assert got == [0, 1, 2]
    lines = [f.get("text/plain", "") for f in handles[0].frames]
    assert lines[0] == "" and lines[1] == "three things: 0 of 3 done, 0.0 s" and lines[-1] == ""
    assert any(line.startswith("three things: 2 of 3 done") for line in lines), lines

    done = live.run_command(
        [sys.executable, "-c", "import time; time.sleep(1); print('hi')"], what="a sleeper"
    )
    assert done.returncode == 0 and done.stdout == "hi\n"
    lines = [f.get("text/plain", "") for f in handles[1].frames]
    assert lines[0] == "" and lines[1].startswith("running a sleeper: ") and lines[-1] == "", lines


def test_a_caption_strip_is_added_once_per_figure():
    from parallel_lab.plots.interactive import stamp_figure

    for layout in (None, "constrained"):
        fig, ax = plt.subplots(figsize=(4, 3), layout=layout)
        ax.plot([0, 1], [0, 1])
        stamp_figure(fig, "a=1")
        size = tuple(fig.get_size_inches())
        pos = ax.get_position().bounds
        stamp_figure(fig, "a=2")  # a redraw of the same figure with new control values
        assert tuple(fig.get_size_inches()) == size and ax.get_position().bounds == pos
        assert [t.get_text() for t in fig.texts] == ["a=2"]
        plt.close(fig)
