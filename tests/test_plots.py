"""Plots: figures, labels, units, legends, Chrome traces, and the live view (no ranks needed)."""

from __future__ import annotations

import base64
import hashlib

import matplotlib
import nbclient
import nbformat

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from parallel_lab import plots  # noqa: E402
from parallel_lab.plots import (  # noqa: E402
    CATEGORY_COLORS,
    KIND_COLORS,
    LiveRunView,
    byte_unit,
    chrome_events,
    plot_comm_bytes,
    plot_memory,
    plot_predicted_vs_measured,
    plot_timeline,
)
from parallel_lab.plots import live as plots_live  # noqa: E402
from parallel_lab.runtime.result import RunResult  # noqa: E402
from parallel_lab.runtime.trace import CATEGORIES, KINDS, chrome_trace  # noqa: E402

MiB = 2**20


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def ev(rank, name, kind, start, end):
    return {"rank": rank, "name": name, "kind": kind, "start": start, "end": end, "args": {}}


def sample(rank, t, **cats):
    return {"rank": rank, "t": t, "label": "", "bytes": cats}


def two_rank_events():
    return [
        ev(0, "forward", "compute", 0.000, 0.004),
        ev(0, "all_reduce", "comm", 0.004, 0.006),
        ev(1, "forward", "compute", 0.000, 0.003),
        ev(1, "wait", "bubble", 0.003, 0.004),
        ev(1, "all_reduce", "comm", 0.004, 0.006),
    ]


def legend_labels(ax_or_fig):
    leg = ax_or_fig.get_legend() if hasattr(ax_or_fig, "get_legend") else None
    texts = leg.get_texts() if leg else [t for lg in ax_or_fig.legends for t in lg.get_texts()]
    return [t.get_text() for t in texts]


def predicted_lines(ax):
    return [ln for ln in ax.lines if ln.get_gid() == "predicted"]


# -- palette and units ---------------------------------------------------------
def test_palettes_cover_every_kind_and_category():
    assert set(KINDS) <= set(KIND_COLORS)
    assert set(CATEGORIES) <= set(CATEGORY_COLORS)
    # Kinds that share a lane must be told apart by colour.
    assert KIND_COLORS["compute"] != KIND_COLORS["optimizer"] != KIND_COLORS["bubble"]
    assert len(set(CATEGORY_COLORS.values())) == len(CATEGORY_COLORS)


@pytest.mark.parametrize(
    "nbytes, name", [(0, "B"), (512, "B"), (2048, "KiB"), (3 * MiB, "MiB"), (5 * 2**30, "GiB")]
)
def test_byte_unit_auto(nbytes, name):
    scale, unit = byte_unit(nbytes)
    assert unit == name
    assert 1 <= nbytes / scale < 1024 or nbytes == 0


def test_byte_unit_explicit_and_bad():
    assert byte_unit(3 * MiB, "KiB") == (1024.0, "KiB")
    assert byte_unit(7e9, "GB") == (1e9, "GB")
    with pytest.raises(ValueError, match="unit"):
        byte_unit(10, "MB/s")


# -- timeline ------------------------------------------------------------------
def test_timeline_lanes_ticks_title_and_legend():
    fig = plot_timeline(two_rank_events(), title="step 0")
    assert len(fig.axes) == 1
    ax = fig.axes[0]
    assert ax.get_title() == "step 0"
    assert ax.get_xlabel() == "time (ms)"
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "rank 0 compute",
        "rank 0 comm",
        "rank 1 compute",
        "rank 1 comm",
    ]
    assert legend_labels(ax) == ["compute", "all_reduce", "bubble"]  # comm spans by collective

    # One collection per (rank, lane, kind): r0 compute, r0 comm, r1 compute, r1 bubble, r1 comm.
    assert len(ax.collections) == 5
    hatched = [c for c in ax.collections if c.get_hatch()]
    assert len(hatched) == 1 and hatched[0].get_hatch() == "//"
    # The bubble sits on rank 1's upper lane, in ms.
    (path,) = hatched[0].get_paths()
    xs, ys = path.vertices[:, 0], path.vertices[:, 1]
    assert xs.min() == pytest.approx(3.0) and xs.max() == pytest.approx(4.0)
    assert 1.0 <= ys.min() < ys.max() <= 1.5
    # Comm spans go to the lower lane.
    comm = [c for c in ax.collections if c.get_paths()[0].vertices[:, 1].min() % 1 >= 0.5]
    assert len(comm) == 2 and all(c.get_paths()[0].vertices[:, 0].min() == pytest.approx(4.0) for c in comm)


def test_each_collective_keeps_its_colour_across_figures():
    """All-gather and reduce-scatter never share a colour; a name that says no collective is "comm"."""
    from parallel_lab.plots import COMM_OP_COLORS

    events = [ev(0, "all_gather", "comm", 0, 0.001), ev(0, "reduce_scatter", "comm", 0.001, 0.002),
              ev(0, "barrier", "comm", 0.002, 0.003), ev(0, "isend", "comm", 0.003, 0.004)]  # fmt: skip
    ax = plot_timeline(events).axes[0]
    assert legend_labels(ax) == ["comm", "all_gather", "reduce_scatter", "send/recv"]
    faces = {
        t.get_text(): h.get_facecolor()
        for t, h in zip(ax.get_legend().get_texts(), ax.get_legend().legend_handles)
    }
    assert len({faces[k] for k in faces}) == 4
    assert faces["all_gather"] == matplotlib.colors.to_rgba(COMM_OP_COLORS["all_gather"])


def test_timeline_takes_a_run_result_and_its_world_size():
    r = RunResult(values=[None] * 4, timeline=two_rank_events(), world_size=4)
    fig = r.plot_timeline()
    ax = fig.axes[0]
    assert len(ax.get_yticks()) == 8  # ranks 2 and 3 get rows even without events
    assert ax.get_ylim() == (4.0, 0.0)  # rank 0 on top


def test_timeline_color_by_name_keeps_bubbles_hatched():
    fig = plot_timeline(two_rank_events(), color_by="name")
    ax = fig.axes[0]
    labels = legend_labels(ax)
    assert labels[:2] == ["forward", "all_reduce"]  # longest-running first
    assert "bubble" in labels
    assert any(c.get_hatch() == "//" for c in ax.collections)


def test_timeline_many_events_stay_few_artists():
    events = []
    for r in range(4):
        for i in range(2500):
            kind = ("compute", "comm", "optimizer", "bubble")[i % 4]
            events.append(ev(r, f"op{i % 7}", kind, i * 1e-4, i * 1e-4 + 8e-5))
    fig = plot_timeline(events)
    ax = fig.axes[0]
    assert len(ax.collections) == 4 * 4  # ranks x kinds, not 10,000 patches
    assert len(ax.texts) == 0  # too many events for names inside bars
    assert sum(len(c.get_paths()) for c in ax.collections) == 10_000
    fig.canvas.draw()


def test_timeline_empty_input():
    fig = plot_timeline([])
    assert [t.get_text() for t in fig.axes[0].texts] == ["no events"]
    fig = plot_timeline([], world_size=2)
    assert len(fig.axes[0].get_yticks()) == 4
    assert fig.axes[0].get_legend() is None
    fig.canvas.draw()


def test_timeline_bad_input():
    with pytest.raises(ValueError, match="color_by"):
        plot_timeline(two_rank_events(), color_by="rank")
    with pytest.raises(ValueError, match="world_size"):
        plot_timeline(two_rank_events(), world_size=1)
    with pytest.raises(TypeError, match="start"):
        plot_timeline([{"rank": 0, "name": "x"}])
    with pytest.raises(TypeError, match="traceEvents"):
        plot_timeline({"events": []})
    with pytest.raises(TypeError, match="RunResult"):
        plot_timeline(42)


def test_timeline_from_our_chrome_trace_dict_and_file(tmp_path):
    events = two_rank_events()
    trace = chrome_trace(events, [])
    got = chrome_events(trace)
    key = lambda e: (e["rank"], e["start"], e["name"])
    for a, b in zip(sorted(got, key=key), sorted(events, key=key)):
        assert (a["rank"], a["name"], a["kind"]) == (b["rank"], b["name"], b["kind"])
        assert a["start"] == pytest.approx(b["start"]) and a["end"] == pytest.approx(b["end"])
    fig = plot_timeline(trace)
    assert len(fig.axes[0].collections) == 5
    r = RunResult(values=[1, 2], timeline=events, world_size=3)
    path = r.save_chrome_trace(str(tmp_path / "run.json"))
    fig = plot_timeline(path)
    assert len(fig.axes[0].get_yticks()) == 6  # world_size comes from the file


# chrome://tracing's reserved colours (its colour scheme), the only colours an event can ask for.
_RESERVED_RGB = {
    "thread_state_uninterruptible": (182, 125, 143), "thread_state_iowait": (255, 140, 0),
    "thread_state_running": (126, 200, 148), "thread_state_runnable": (133, 160, 210),
    "thread_state_unknown": (199, 155, 125), "detailed_memory_dump": (180, 0, 180),
    "light_memory_dump": (0, 0, 180), "generic_work": (125, 125, 125), "good": (0, 125, 0),
    "bad": (180, 125, 0), "terrible": (180, 0, 0), "grey": (221, 221, 221), "rail_animation": (244, 74, 63),
    "rail_response": (67, 135, 253), "rail_load": (13, 168, 97), "yellow": (255, 255, 0),
}  # fmt: skip


def test_a_saved_trace_colours_each_kind_like_the_plots(tmp_path):
    """Every kind gets its own reserved colour, of the same hue as the plots' colour for it."""
    import colorsys
    import json

    from parallel_lab.plots.base import KIND_COLORS, KIND_TRACE_COLORS

    assert set(KIND_TRACE_COLORS) == set(KINDS) and len(set(KIND_TRACE_COLORS.values())) == len(KINDS)
    for kind, name in KIND_TRACE_COLORS.items():
        ours = colorsys.rgb_to_hsv(*matplotlib.colors.to_rgb(KIND_COLORS[kind]))
        theirs = colorsys.rgb_to_hsv(*(c / 255 for c in _RESERVED_RGB[name]))
        if ours[1] < 0.1:  # a grey stays a grey
            assert theirs[1] < 0.1, kind
        else:
            gap = abs(ours[0] - theirs[0]) * 360
            assert min(gap, 360 - gap) <= 50, (kind, name, gap)
    events = [{"rank": 0, "name": k, "kind": k, "start": i, "end": i + 0.5} for i, k in enumerate(KINDS)]
    path = RunResult(values=[None], timeline=events).save_chrome_trace(str(tmp_path / "t.json"))
    with open(path) as f:
        xs = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
    assert {e["cat"]: e["cname"] for e in xs} == KIND_TRACE_COLORS


def test_timeline_from_a_foreign_chrome_trace():
    # torch.profiler style: OS pids, absolute microseconds, kinds only in the names.
    t0 = 1.7e15
    trace = {
        "traceEvents": [
            {"ph": "X", "pid": 4242, "tid": 1, "name": "aten::mm", "cat": "cpu_op", "ts": t0, "dur": 500},
            {"ph": "X", "pid": 4242, "tid": 1, "name": "c10d::allreduce_", "cat": "cpu_op", "ts": t0 + 600, "dur": 300},
            {"ph": "X", "pid": 5151, "tid": 1, "name": "Optimizer.step#Adam.step", "cat": "user_annotation",
             "ts": t0 + 100, "dur": 200},
            {"ph": "X", "pid": 5151, "tid": 7, "name": "Memcpy HtoD", "cat": "gpu_memcpy", "ts": t0 + 400, "dur": 50},
            {"ph": "i", "pid": 4242, "name": "marker", "ts": t0},
        ]
    }  # fmt: skip
    got = {e["name"]: e for e in chrome_events(trace)}
    assert [
        got[n]["kind"] for n in ("aten::mm", "c10d::allreduce_", "Optimizer.step#Adam.step", "Memcpy HtoD")
    ] == [
        "compute",
        "comm",
        "optimizer",
        "memcpy",
    ]
    assert got["aten::mm"]["rank"] == 0 and got["Memcpy HtoD"]["rank"] == 1
    assert got["aten::mm"]["start"] == 0.0 and got["c10d::allreduce_"]["end"] == pytest.approx(900e-6)
    fig = plot_timeline(trace)
    assert len(fig.axes[0].get_yticks()) == 4
    # "rank N" process names win over pids.
    trace["traceEvents"] += [
        {"ph": "M", "name": "process_name", "pid": 4242, "args": {"name": "rank 1"}},
        {"ph": "M", "name": "process_name", "pid": 5151, "args": {"name": "rank 0"}},
    ]
    got = {e["name"]: e for e in chrome_events(trace)}
    assert got["aten::mm"]["rank"] == 1 and got["Memcpy HtoD"]["rank"] == 0


# -- memory --------------------------------------------------------------------
def memory_samples():
    out = []
    for r in range(2):
        out += [
            sample(r, 0.001, param=MiB),
            sample(r, 0.002, param=MiB, activation=2 * MiB),  # peak 3 MiB
            sample(r, 0.003, param=MiB, grad=MiB),
        ]
    return out


def test_memory_subplots_units_legend_and_predicted_number():
    fig = plot_memory(memory_samples(), predicted=3.5 * MiB, title="ZeRO-1")
    axes = [a for a in fig.axes if a.get_visible()]
    assert len(axes) == 2
    assert fig.get_suptitle() == "ZeRO-1"
    assert [a.get_title() for a in axes] == ["rank 0: peak 3 MiB", "rank 1: peak 3 MiB"]
    assert axes[0].get_ylabel() == "memory (MiB)"
    assert all(a.get_xlabel() == "time (ms)" for a in axes)
    assert axes[0].get_shared_y_axes().joined(axes[0], axes[1])
    labels = legend_labels(fig)
    assert labels == ["predicted peak", "activation", "grad", "param"]  # top-down like the stack
    for a in axes:
        (line,) = predicted_lines(a)
        assert list(line.get_ydata()) == [3.5, 3.5]
        assert line.get_linestyle() == "--"
    assert axes[0].get_ylim()[1] > 3.5  # the line is inside the frame
    fig.canvas.draw()
    fig = plot_memory(memory_samples(), predicted=3.5 * MiB, predicted_label="predicted model states")
    assert legend_labels(fig)[0] == "predicted model states"


def test_memory_predicted_per_rank_and_per_category():
    fig = plot_memory(memory_samples(), predicted={1: 4 * MiB})
    a0, a1 = fig.axes[:2]
    assert predicted_lines(a0) == []
    assert list(predicted_lines(a1)[0].get_ydata()) == [4.0, 4.0]
    fig = plot_memory(memory_samples(), predicted={"param": MiB, "grad": MiB, "activation": 2 * MiB})
    assert all(list(predicted_lines(a)[0].get_ydata()) == [4.0, 4.0] for a in fig.axes[:2])


def test_memory_units_ranks_and_grid():
    small = [sample(r, 0.001 * i, param=1500 * i) for r in range(8) for i in range(1, 4)]
    fig = plot_memory(small)
    visible = [a for a in fig.axes if a.get_visible()]
    assert len(visible) == 8 and visible[0].get_ylabel() == "memory (KiB)"
    assert [a.get_xlabel() for a in visible] == [""] * 4 + ["time (ms)"] * 4  # bottom row only
    assert [a.get_ylabel() != "" for a in visible] == [True, False, False, False] * 2
    fig = plot_memory(small, ranks=[2, 5], unit="B")
    visible = [a for a in fig.axes if a.get_visible()]
    assert [a.get_title().split(":")[0] for a in visible] == ["rank 2", "rank 5"]
    assert visible[0].get_ylabel() == "memory (B)"


def test_memory_peak_at_the_last_sample_is_drawn():
    fig = plot_memory([sample(0, 0.001, param=MiB), sample(0, 0.002, param=MiB, activation=MiB)])
    ax = fig.axes[0]
    top = max(p.vertices[:, 1].max() for c in ax.collections for p in c.get_paths())
    assert top == pytest.approx(2.0)
    widths = [p.vertices[:, 0] for c in ax.collections for p in c.get_paths()]
    # the last sample's step has width: the stack reaches past t = 2 ms
    assert max(w.max() for w in widths) > 2.0


def test_memory_from_run_result_and_trace_file(tmp_path):
    r = RunResult(values=[0, 0], memory=memory_samples(), world_size=2)
    fig = r.plot_memory()
    assert len([a for a in fig.axes if a.get_visible()]) == 2
    path = r.save_chrome_trace(str(tmp_path / "mem.json"))
    fig = plot_memory(path)
    assert [a.get_title() for a in fig.axes] == ["rank 0: peak 3 MiB", "rank 1: peak 3 MiB"]


def test_memory_empty_and_into_given_axes():
    fig = plot_memory([])
    assert "no memory samples" in [t.get_text() for t in fig.axes[0].texts]
    fig.canvas.draw()
    fig2, (a, b) = plt.subplots(1, 2)
    assert plot_memory(memory_samples(), ax=[a, b]) is fig2
    assert a.get_legend() is None and b.get_legend() is not None
    with pytest.raises(ValueError, match="one Axes per rank"):
        plot_memory(memory_samples(), ax=a)


def test_memory_bad_input():
    with pytest.raises(ValueError, match="predicted"):
        plot_memory(memory_samples(), predicted=-1)
    with pytest.raises(TypeError, match="predicted"):
        plot_memory(memory_samples(), predicted={0: 1, "param": 2})
    with pytest.raises(TypeError, match="predicted"):
        plot_memory(memory_samples(), predicted="3 MiB")
    with pytest.raises(ValueError, match="ranks"):
        plot_memory(RunResult(values=[0, 0], memory=memory_samples(), world_size=2), ranks=[2])
    with pytest.raises(TypeError, match="bytes"):
        plot_memory([{"rank": 0, "t": 0.0}])


# -- bars ----------------------------------------------------------------------
def test_predicted_vs_measured_bars_and_ratios():
    pred = {"param": MiB, "grad": MiB, "optim": 2 * MiB, "activation": 3 * MiB}
    meas = {"activation": 3.6 * MiB, "param": MiB, "grad": 1.1 * MiB, "optim": 2 * MiB}
    fig = plot_predicted_vs_measured(pred, meas, title="lesson 02")
    ax = fig.axes[0]
    assert ax.get_title() == "lesson 02"
    assert ax.get_ylabel() == "bytes (MiB)"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["param", "grad", "optim", "activation"]
    assert len(ax.patches) == 8
    assert [t.get_text() for t in ax.texts] == ["\u00d71.00", "\u00d71.10", "\u00d71.00", "\u00d71.20"]
    assert legend_labels(ax) == ["predicted", "measured"]
    assert max(p.get_height() for p in ax.patches) == pytest.approx(3.6)


def test_predicted_vs_measured_other_units_and_missing_keys():
    fig = plot_predicted_vs_measured({"ring": 10.0, "tree": 4.0}, {"ring": 12.0, "naive": 30.0}, unit="ms")
    ax = fig.axes[0]
    assert ax.get_ylabel() == "value (ms)"
    assert [t.get_text() for t in ax.texts] == ["\u00d71.20", "-", "-"]
    assert len(ax.patches) == 4  # ring: both; tree: predicted only; naive: measured only
    with pytest.raises(TypeError, match="measured"):
        plot_predicted_vs_measured({"a": 1.0}, [1.0])
    with pytest.raises(ValueError, match="predicted"):
        plot_predicted_vs_measured({"a": float("nan")}, {"a": 1.0})


def test_comm_bytes_bars_and_formula():
    per_rank = [
        {"sent": 3 * MiB, "recv": 3 * MiB, "by_op": {"ring_all_reduce": {"sent": 3 * MiB, "recv": 3 * MiB, "calls": 1}}},
        {"sent": 3 * MiB, "recv": 2 * MiB, "by_op": {"ring_all_reduce": {"sent": 2 * MiB, "recv": 2 * MiB, "calls": 1}}},
    ]  # fmt: skip
    r = RunResult(values=[0, 0], comm_bytes=per_rank, world_size=2)
    fig = plot_comm_bytes(r, formula=3 * MiB)
    ax = fig.axes[0]
    assert len(ax.patches) == 4
    assert ax.get_ylabel() == "bytes (MiB)"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["rank 0", "rank 1"]
    assert legend_labels(ax) == ["formula", "sent", "received"]
    lines = [ln for ln in ax.lines if ln.get_gid() == "formula"]
    assert len(lines) == 2 and all(list(ln.get_ydata()) == [3.0, 3.0] for ln in lines)
    fig = plot_comm_bytes(per_rank, op="ring_all_reduce", formula={1: 2 * MiB})
    ax = fig.axes[0]
    assert ax.get_title().endswith("(ring_all_reduce)")
    assert [p.get_height() for p in ax.patches] == [3.0, 2.0, 3.0, 2.0]
    assert len([ln for ln in ax.lines if ln.get_gid() == "formula"]) == 1
    with pytest.raises(TypeError, match="result"):
        plot_comm_bytes(5)


# -- live view -----------------------------------------------------------------
def test_live_view_is_a_silent_no_op_outside_ipython(capsys):
    view = LiveRunView(4, timeline=True, memory=True)
    assert view.active is False and view.fig is None
    assert view.update(two_rank_events(), memory_samples()) is False
    view.finish(two_rank_events(), memory_samples())
    assert view.draws == 0 and view.updates == 1 and view.finished
    assert capsys.readouterr() == ("", "")
    assert plt.get_fignums() == []


class FakeHandle:
    def __init__(self, bundle):
        self.bundles = [bundle]

    def update(self, bundle, raw=False):
        assert raw
        self.bundles.append(bundle)


def test_live_view_rate_limits_and_finishes(monkeypatch):
    monkeypatch.setattr(plots_live, "_display", FakeHandle)
    now = [100.0]
    view = LiveRunView(2, timeline=True, memory=True, min_interval=0.2, active=True)
    view._clock = lambda: now[0]
    view._next = now[0] + 0.2  # as if the first frame was drawn just now
    assert view.draws == 1 and len(view.handle.bundles) == 1  # the empty first frame
    events, samples = two_rank_events(), memory_samples()
    for i in range(50):  # a burst of messages inside one interval: no redraw
        assert view.update(events[: i % 5 + 1], samples) is False
    assert view.draws == 1
    now[0] += 0.25
    assert view.update(events, samples) is True
    assert view.update(events, samples) is False  # too soon
    now[0] += 0.25
    assert view.update(events, samples) is False  # nothing new since the last frame
    assert view.draws == 2 and view.updates == 53
    view.finish(events + [ev(0, "step", "optimizer", 0.006, 0.007)], samples)
    assert view.draws == 3 and len(view.handle.bundles) == 3
    now[0] += 10
    assert view.update(events, samples) is False and view.draws == 3
    png = base64.b64decode(view.handle.bundles[-1]["image/png"])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert plt.get_fignums() == []  # never registered with pyplot: nothing to show twice


def test_live_view_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        LiveRunView(0)
    with pytest.raises(TypeError, match="world_size"):
        LiveRunView("2")
    with pytest.raises(ValueError, match="both False"):
        LiveRunView(2, timeline=False, memory=False)
    with pytest.raises(ValueError, match="min_interval"):
        LiveRunView(2, min_interval=-1)


LIVE_CELL = r"""
import hashlib
from parallel_lab.plots import LiveRunView
view = LiveRunView(2, timeline=True, memory=True, min_interval=0.0)
ev, sm = [], []
for i in range(6):
    kind = "compute" if i % 3 else "comm"
    ev.append({"rank": i % 2, "name": "step", "kind": kind, "start": i * 0.01, "end": i * 0.01 + 0.008, "args": {}})
    sm.append({"rank": i % 2, "t": i * 0.01, "label": "", "bytes": {"param": 1000 * (i + 1), "activation": 500 * i}})
    view.update(ev, sm)
view.finish(ev, sm)
print(view.active, view.draws, hashlib.md5(view.last_png.encode()).hexdigest())
"""

PLOT_CELL = r"""
from parallel_lab.plots import plot_timeline
_ = plot_timeline(ev)
"""


def test_live_view_in_a_notebook_leaves_exactly_one_image():
    nb = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(LIVE_CELL), nbformat.v4.new_code_cell(PLOT_CELL)]
    )
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=120, allow_errors=False)
    client.execute()
    live, plot = nb.cells
    images = [o for o in live.outputs if o.output_type == "display_data" and "image/png" in o.data]
    assert len(images) == 1, [o.output_type for o in live.outputs]
    assert not [o for o in live.outputs if o.output_type == "stream" and o.name == "stderr"]
    (stdout,) = [o for o in live.outputs if o.output_type == "stream" and o.name == "stdout"]
    active, draws, digest = stdout.text.split()
    # First frame + finish, and updates in between as the drawing-time budget allows.
    assert active == "True" and 2 <= int(draws) <= 8
    # The image left in the notebook is the final frame, updated in place.
    assert hashlib.md5(images[0].data["image/png"].encode()).hexdigest() == digest
    assert images[0].data["text/plain"] == "<live run: 2 ranks>"
    # A static plot assigned to `_` shows once, with no stderr.
    assert [o.output_type for o in plot.outputs] == ["display_data"]
    assert "image/png" in plot.outputs[0].data


def test_plots_module_exports():
    assert all(hasattr(plots, name) for name in plots.__all__)
    assert plots.LiveRunView is plots_live.LiveRunView


def test_memory_plot_draws_the_cuda_allocator_when_samples_carry_it():
    """One interface: samples from a CUDA rank carry the caching allocator's counts ("device", as
    `MemoryTracker.cross_check` gives them) and the same plot_memory call draws them over the
    categories; CPU samples draw none."""
    import matplotlib.pyplot as plt

    from parallel_lab.plots import plot_memory

    def sample(t, params, act, device=None):
        s = {"rank": 0, "t": t, "label": "", "bytes": {"param": params, "activation": act}}
        if device:
            s["device"] = device
        return s

    cuda = [sample(0.0, 100, 0, {"allocated": 512, "reserved": 2048, "max_allocated": 512}),
            sample(0.1, 100, 300, {"allocated": 1024, "reserved": 4096, "max_allocated": 1024})]  # fmt: skip
    fig = plot_memory(cuda)
    labels = {line.get_label() for line in fig.axes[0].lines}
    assert {"CUDA allocator: allocated", "CUDA allocator: reserved"} <= labels
    assert fig.axes[0].get_ylim()[1] * 1024 >= 4096  # the axis holds the reserved bytes
    plt.close(fig)
    fig = plot_memory([sample(0.0, 100, 0), sample(0.1, 100, 300)])
    assert not any("CUDA" in line.get_label() for line in fig.axes[0].lines)
    plt.close(fig)
