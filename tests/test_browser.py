"""Real-browser tests: every lesson run in JupyterLab + headless Chromium, its widgets moved as a learner would.

What nbval cannot see: that figures and widgets render and respond in JupyterLab. The lessons are
copied to a temporary root (the repository's files are never touched), one JupyterLab serves it,
and for each lesson Chromium (playwright's sync API) clears all outputs, runs the cells down to
the lesson's last interactive view (every cell an `interactive` view or a live view can depend on;
nbval runs all of them headless), and then moves every control of every view to two other values. After each move: exactly one
figure in that view's figure area, a different image than before, no error. A view that draws
live must show more than one frame during a run and end on the final figure. Screenshots go to
runs/browser/ (not committed), each beside a text report: the time to run those cells, the views,
the controls moved and the redraws checked. Needs Debian's chromium (`apt-get install -y chromium`) and the
`playwright` package; their absence is a failure, not a skip.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = "notebooks/00_tour.ipynb"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
]
RUN_TIMEOUT_S = 420
# Lab settings for a deterministic page: every cell attached to the DOM (no virtual scrolling that
# would leave off-screen figures unrendered), no autosave, no news fetched from the network.
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {
        "windowingMode": "none",
        "recordTiming": True,
    },
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false",
        "checkForUpdates": False,
    },
}

# JavaScript run in the page; window.jupyterapp exists because of --LabApp.expose_app_in_browser.
JS_READY = """() => {
  const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  if (!w || !w.content || !w.context || !w.context.isReady || !w.sessionContext) return false;
  const k = w.sessionContext.session && w.sessionContext.session.kernel;
  return !!k && k.status === 'idle' && w.content.widgets.length > 0;
}"""
JS_CELLS = """() => {
  const w = window.jupyterapp.shell.currentWidget;
  return w.content.widgets.filter(c => c.model.type === 'code').map(c => ({
    count: c.model.executionCount,
    errors: c.model.outputs.toJSON().filter(o => o.output_type === 'error').map(o => o.ename + ': ' + o.evalue),
    pending: !!(c.node.querySelector('.jp-InputPrompt') || {textContent: ''}).textContent.includes('*'),
    timing: c.model.getMetadata('execution') || null,
    head: c.model.sharedModel.getSource().split('\\n')[0].slice(0, 60),
  }));
}"""
# Kernel idle and the first n code cells run (or one failed, or the kernel died); the lesson walk
# runs down to its last interactive view, run_in_browser every cell.
JS_DONE_UPTO = (
    "([n]) => { const k = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;"
    " if (k && k.status === 'dead') return true;"
    " if (!k || k.status !== 'idle') return false;"
    f" const cells = ({JS_CELLS})().slice(0, n);"
    " if (cells.some(c => c.pending)) return false;"
    " return cells.every(c => c.count !== null) || cells.some(c => c.errors.length > 0); }"
)
JS_DONE = f"() => ({JS_DONE_UPTO})([Infinity])"
JS_KERNEL = """() => {
  const s = window.jupyterapp.shell.currentWidget.sessionContext.session;
  return s && s.kernel ? s.kernel.status : 'none';
}"""
IMAGES = ".jp-RenderedImage img"
WIDGETS = ".jp-OutputArea-output .widget-slider, .jp-OutputArea-output .jupyter-widgets"
ERRORS = '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.error"]'
STDERR = '.jp-RenderedText[data-mime-type="application/vnd.jupyter.stderr"]'


def _get(url: str, method: str = "GET") -> bytes:
    with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=5) as r:
        return r.read()


@contextlib.contextmanager
def jupyter_lab(root: Path, home: Path):
    """JupyterLab serving `root`; yields (base_url, token); always stops the server and its kernels."""
    token = secrets.token_hex(16)
    for name, value in LAB_SETTINGS.items():
        (home / "settings" / name).parent.mkdir(parents=True, exist_ok=True)
        (home / "settings" / name).write_text(json.dumps(value))
    runtime = home / "runtime"
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_RUNTIME_DIR=str(runtime))
    cmd = [
        sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", "--port=0",
        "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", "--ServerApp.allow_root=True", f"--ServerApp.root_dir={root}",
        "--ServerApp.open_browser=False", "--LabApp.expose_app_in_browser=True",
        f"--LabApp.user_settings_dir={home / 'settings'}", f"--LabApp.workspaces_dir={home / 'workspaces'}",
    ]  # fmt: skip
    log_path = home / "server.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    # Port 0: the server binds a port the kernel picks and writes it to its info file (a port
    # chosen here and bound later by the server could be taken in between).
    base = ""
    children: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 90
        while True:
            if server.poll() is not None:
                pytest.fail(f"JupyterLab exited with {server.returncode}:\n{log_path.read_text()[-3000:]}")
            info = runtime / f"jpserver-{server.pid}.json"
            with contextlib.suppress(OSError, ValueError):
                base = f"http://127.0.0.1:{json.loads(info.read_text())['port']}"
                _get(f"{base}/api/status?token={token}")
                break
            if time.monotonic() > deadline:
                pytest.fail(f"JupyterLab did not answer within 90 s:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        yield base, token
    finally:
        # Kernels run in their own sessions: note them now, ask the server to shut them down, stop the
        # server, then kill (by pid) whatever of what it started is still alive.
        with contextlib.suppress(psutil.Error):
            children = psutil.Process(server.pid).children(recursive=True)
        with contextlib.suppress(Exception):
            for kernel in json.loads(_get(f"{base}/api/kernels?token={token}")):
                _get(f"{base}/api/kernels/{kernel['id']}?token={token}", method="DELETE")
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)
        _, alive = psutil.wait_procs(children, timeout=10)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(alive, timeout=10)


def run_in_browser(base: str, token: str, notebook: str, shots: Path) -> dict:  # noqa: D401 - kept for tools
    """Open `notebook`, clear outputs, run all cells, wait; returns what rendered (and takes screenshots)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page_errors: list[str] = []
            page.on("pageerror", lambda e: page_errors.append(str(e)))
            page.goto(
                f"{base}/lab/tree/{notebook}?token={token}", wait_until="domcontentloaded", timeout=90_000
            )
            page.wait_for_function(JS_READY, timeout=120_000, polling=250)
            # Stored outputs must not count: clear them, and check that nothing is left to mistake for a result.
            page.evaluate("() => window.jupyterapp.commands.execute('notebook:clear-all-cell-outputs')")
            page.wait_for_function(
                f"() => document.querySelectorAll('{IMAGES}').length === 0", timeout=30_000
            )
            assert all(c["count"] is None for c in page.evaluate(JS_CELLS)), (
                "clearing outputs left execution counts"
            )
            page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
            start = time.monotonic()
            page.wait_for_function(JS_DONE, timeout=RUN_TIMEOUT_S * 1000, polling=500)
            elapsed = time.monotonic() - start
            with contextlib.suppress(
                Exception
            ):  # widget views attach asynchronously after the kernel is idle
                page.wait_for_selector(WIDGETS, timeout=20_000)
            # The screenshot shows the first widget (or figure) the run produced, not the page's last screen.
            for sel in (WIDGETS, IMAGES):
                if page.locator(sel).count():
                    page.locator(sel).first.scroll_into_view_if_needed()
                    break
            page.screenshot(path=str(shots / "page.png"))
            if page.locator(IMAGES).count():
                page.locator(IMAGES).first.screenshot(path=str(shots / "figure.png"))
            return {
                "cells": page.evaluate(JS_CELLS),
                "images": page.locator(IMAGES).count(),
                "widgets": page.locator(WIDGETS).count(),
                "widget_errors": page.get_by_text("Error displaying widget").count(),
                "error_outputs": [
                    page.locator(ERRORS).nth(i).inner_text()[:2000]
                    for i in range(page.locator(ERRORS).count())
                ],
                "tracebacks": [t[:2000] for t in page.locator(STDERR).all_inner_texts() if "Traceback" in t],
                "page_errors": page_errors,
                "kernel": page.evaluate(JS_KERNEL),
                "seconds": elapsed,
            }
        finally:
            browser.close()


def _cell_seconds(timing: dict | None) -> float:
    """Seconds between the kernel starting a cell and its reply (NaN if it never ran)."""
    from datetime import datetime

    if not timing or "shell.execute_reply" not in timing or "iopub.execute_input" not in timing:
        return float("nan")
    t = {k: datetime.fromisoformat(v.replace("Z", "+00:00")) for k, v in timing.items()}
    return (t["shell.execute_reply"] - t["iopub.execute_input"]).total_seconds()


LESSONS = sorted(p.name for p in (REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
SHOTS = REPO / "runs" / "browser"

# JavaScript for the interactive views (plots.interactive marks their parts with these classes).
JS_VIEWS = """() => [...document.querySelectorAll('.pl-interactive')].map(v => ({
  status: (v.querySelector('.pl-status') || {innerText: ''}).innerText,
  images: v.querySelectorAll('.pl-figure img').length,
  outputs: v.querySelectorAll('.pl-figure .jp-OutputArea-child').length,
  src: (v.querySelector('.pl-figure img') || {src: ''}).src,
  text: (v.querySelector('.pl-figure pre') || {innerText: ''}).innerText,
  running: !!(v.querySelector('.pl-controls button') || {disabled: false}).disabled,
}))"""


def _requirements() -> None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.fail("the playwright package is missing: pip install -e '.[test]' (or pip install playwright)")
    if not Path(CHROMIUM).exists():
        pytest.fail(
            f"Chromium not found at {CHROMIUM}: install it with `apt-get install -y chromium` (Debian)"
        )


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """One JupyterLab for every lesson, serving a private copy of notebooks/ (and ../runs)."""
    _requirements()
    root = tmp_path_factory.mktemp("root")
    shutil.copytree(
        REPO / "notebooks", root / "notebooks", ignore=shutil.ignore_patterns(".ipynb_checkpoints")
    )
    (root / "runs").mkdir()
    home = tmp_path_factory.mktemp("home")
    with jupyter_lab(root, home) as (base, token):
        yield base, token


def _last_interactive(lesson: str) -> tuple[int, int]:
    """(index among all cells, count of code cells up to it) of the lesson's last cell whose stored
    outputs hold a widget (an `interactive` view or a live view). Cells after it feed no view."""
    cells = json.loads((REPO / "notebooks" / lesson).read_text(encoding="utf-8"))["cells"]
    widget = "application/vnd.jupyter.widget-view+json"
    last = max(
        i for i, c in enumerate(cells) if any(widget in o.get("data", {}) for o in c.get("outputs", []))
    )
    return last, sum(c["cell_type"] == "code" for c in cells[: last + 1])


def _digest(view: dict) -> str:
    return hashlib.sha1((view["src"] or view["text"]).encode()).hexdigest()


def _wait_view(page, i: int, before: str | None, timeout_s: float = 240.0) -> tuple[dict, int]:
    """Wait until view i has finished a run (button enabled again, status says done or an error);
    returns its state and how many distinct images it showed meanwhile (live frames)."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout_s
    started = False
    while time.monotonic() < deadline:
        v = page.evaluate(JS_VIEWS)[i]
        if v["src"]:
            seen.add(v["src"])
        started = started or v["running"] or (before is not None and _digest(v) != before)
        if started and not v["running"] and ("done in" in v["status"] or "Error" in v["status"]):
            return v, len(seen)
        time.sleep(0.05)
    raise AssertionError(f"view {i} did not finish a run within {timeout_s} s: {page.evaluate(JS_VIEWS)[i]}")


def _move(page, view, control, k: int) -> str:
    """Move one control of a view to another value (k = 1: one way, k = 2: the other); returns what it did."""
    kind = control.evaluate(
        "n => n.querySelector('select') ? 'select' : n.querySelector('.noUi-handle') ? 'slider' :"
        " n.querySelector('input[type=checkbox]') ? 'checkbox' : n.querySelector('input') ? 'input' : 'other'"
    )
    if kind == "select":
        sel = control.locator("select")
        n = sel.locator("option").count()
        idx = (sel.evaluate("s => s.selectedIndex") + 1) % n  # the next option, each time
        sel.select_option(index=idx)
        return f"select -> option {idx}"
    if kind == "slider":
        handle = control.locator(".noUi-handle").first
        now, low, top = (
            float(handle.get_attribute(a) or 0) for a in ("aria-valuenow", "aria-valuemin", "aria-valuemax")
        )
        up = now < top if k == 1 else now <= low  # first move up (down at the top), then two steps down
        key = "ArrowRight" if up else "ArrowLeft"
        for step in range(k):  # one key at a time: each press is one change the view reacts to
            if step:
                page.wait_for_timeout(400)
                page.wait_for_function(
                    "([n]) => !document.querySelectorAll('.pl-interactive')[n].querySelector('.pl-controls button')"
                    ".disabled",
                    arg=[_index(page, view)],
                    timeout=240_000,
                )
            handle.focus()
            handle.press(key)
        return f"slider {key} x{k}"
    if kind == "checkbox":
        control.locator("input[type=checkbox]").click()
        return "checkbox toggled"
    if kind == "input":
        box = control.locator("input").first
        value = int(box.input_value() or 0)
        box.fill(str(value + (7 if k == 1 else -3)))
        box.press("Enter")
        return f"input {value} -> {value + (7 if k == 1 else -3)}"
    return "untouched"


@pytest.mark.slow
@pytest.mark.parametrize("lesson", LESSONS)
def test_lesson_in_jupyterlab(lesson, lab):
    """The cells down to the last interactive view run, then every control of every view moved twice;
    one figure per area, always."""
    from playwright.sync_api import sync_playwright

    base, token = lab
    notebook = f"notebooks/{lesson}"
    SHOTS.mkdir(parents=True, exist_ok=True)
    stem = lesson.removesuffix(".ipynb")
    report: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page_errors: list[str] = []
            page.on("pageerror", lambda e: page_errors.append(str(e)))
            # a workspace of its own: the page holds this lesson only (not the tabs a previous test left)
            page.goto(
                f"{base}/lab/workspaces/{stem}/tree/{notebook}?token={token}&reset",
                wait_until="domcontentloaded",
                timeout=90_000,
            )
            page.wait_for_function(JS_READY, timeout=120_000, polling=250)
            page.evaluate("() => window.jupyterapp.commands.execute('notebook:clear-all-cell-outputs')")
            page.wait_for_function(
                f"() => document.querySelectorAll('{IMAGES}').length === 0", timeout=30_000
            )
            last, n_code = _last_interactive(lesson)
            page.evaluate(  # Run All Above the last view's cell, then that cell
                "([i]) => { const app = window.jupyterapp; app.shell.currentWidget.content.activeCellIndex = i;"
                " app.commands.execute('notebook:run-all-above').then(() => app.commands.execute('notebook:run-cell')); }",
                [last],
            )
            start = time.monotonic()
            page.wait_for_function(JS_DONE_UPTO, arg=[n_code], timeout=RUN_TIMEOUT_S * 1000, polling=500)
            run_all = time.monotonic() - start
            cells = page.evaluate(JS_CELLS)
            errors = [e for c in cells for e in c["errors"]]
            assert not errors, f"{lesson}: errors after running down to the last view: {errors}"
            assert all(c["count"] is not None for c in cells[:n_code]), f"{lesson}: some cells never ran"
            page.wait_for_timeout(500)  # widget views attach after the kernel is idle
            views = page.evaluate(JS_VIEWS)
            report.append(
                f"{lesson}: code cells 1-{n_code} of {len(cells)} run in {run_all:.1f} s, {len(views)} interactive view(s)"
            )
            for i, v in enumerate(views):
                assert v["images"] + (1 if v["text"] else 0) == 1, f"{lesson} view {i}: {v}"
                assert "done in" in v["status"], f"{lesson} view {i} after its cells ran: {v['status']}"
                box = page.locator(".pl-interactive").nth(i)
                controls = box.locator(".pl-controls > .widget-inline-hbox")
                auto = "pl-auto" in (box.get_attribute("class") or "")
                redraws = 0
                for c in range(controls.count()):
                    for k in (1, 2):
                        before = _digest(page.evaluate(JS_VIEWS)[i])
                        did = _move(page, box, controls.nth(c), k)
                        if did == "untouched":  # not a control (the progress bar)
                            break
                        if not auto:  # an auto view redraws on the change itself
                            box.locator(".pl-controls button").click()
                        after, frames = _wait_view(page, i, before)
                        where = f"{lesson} view {i}, control {c} ({did})"
                        assert "Error" not in after["status"], f"{where}: {after['status']}"
                        assert after["images"] + (1 if after["text"] else 0) == 1, f"{where}: {after}"
                        assert after["outputs"] == 1, (
                            f"{where}: {after['outputs']} outputs in the figure area"
                        )
                        assert _digest(after) != before, f"{where}: the figure did not change"
                        redraws += 1
                report.append(
                    f"  view {i}: {redraws // 2} controls moved, {redraws} redraws checked"
                    + (" (auto)" if auto else "")
                )
            live = _live_frames(page) if page.locator(".pl-live").count() else None
            if live is not None:
                assert live[0] > 1, f"{lesson}: the live view showed {live[0]} frame(s) during a run"
                assert live[1], f"{lesson}: the live view did not end on the final figure"
                report.append(f"  live view: {live[0]} frames, ended on the final figure")
            assert not page_errors, f"{lesson}: page errors {page_errors}"
            page.screenshot(path=str(SHOTS / f"{stem}.png"), full_page=False)
            # what was checked, beside the screenshot: the widgets moved, redraws, the time to run the cells
            (SHOTS / f"{stem}.txt").write_text("\n".join(report) + "\n")
        finally:
            browser.close()
            with contextlib.suppress(Exception):  # this lesson's kernel: the next lesson gets the cores
                for kernel in json.loads(_get(f"{base}/api/kernels?token={token}")):
                    _get(f"{base}/api/kernels/{kernel['id']}?token={token}", method="DELETE")
    print("\n".join(report))


def _index(page, view) -> int:
    """The position of `view` among the page's interactive views."""
    return view.evaluate("v => [...document.querySelectorAll('.pl-interactive')].indexOf(v)")


def _live_frames(page) -> tuple[int, bool]:
    """Press Run on the first view that draws live and count the distinct images it shows."""
    views = page.locator(".pl-interactive")
    i = next(j for j in range(views.count()) if "pl-live" in (views.nth(j).get_attribute("class") or ""))
    before = _digest(page.evaluate(JS_VIEWS)[i])
    views.nth(i).locator(".pl-controls button").click()
    after, frames = _wait_view(page, i, before)
    final = after["src"]
    page.wait_for_timeout(300)
    return frames, page.evaluate(JS_VIEWS)[i]["src"] == final and after["images"] == 1
