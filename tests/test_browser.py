"""Real-browser smoke test: JupyterLab + headless Chromium run the tour from a clean kernel.

What nbval cannot see: that figures and widgets actually render in JupyterLab. The tour is copied
to a temporary root first (the repository's file is never touched), JupyterLab serves that root,
Chromium (driven by playwright's sync API) clears all outputs, runs all cells, and we assert on the
rendered page. Needs Debian's chromium (`apt-get install -y chromium`) and the `playwright` package;
their absence is a failure, not a skip.
"""

from __future__ import annotations

import contextlib
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
JS_DONE = (
    "() => { const k = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;"
    " if (k && k.status === 'dead') return true;"
    " if (!k || k.status !== 'idle') return false;"
    f" const cells = ({JS_CELLS})();"
    " if (cells.some(c => c.pending)) return false;"
    " return cells.every(c => c.count !== null) || cells.some(c => c.errors.length > 0); }"
)
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


def run_in_browser(base: str, token: str, notebook: str, shots: Path) -> dict:
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


def test_tour_runs_in_jupyterlab_with_figures_and_widgets(tmp_path):
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.fail("the playwright package is missing: pip install -e '.[test]' (or pip install playwright)")
    if not Path(CHROMIUM).exists():
        pytest.fail(
            f"Chromium not found at {CHROMIUM}: install it with `apt-get install -y chromium` (Debian)"
        )
    source = REPO / NOTEBOOK
    assert source.is_file(), f"{NOTEBOOK} is missing"
    before = source.read_bytes()
    # A private copy of the lesson folder; ../runs exists because the tour writes traces there.
    root = tmp_path / "root"
    shutil.copytree(
        source.parent, root / source.parent.name, ignore=shutil.ignore_patterns(".ipynb_checkpoints")
    )
    (root / "runs").mkdir()
    (tmp_path / "home").mkdir()
    with jupyter_lab(root, tmp_path / "home") as (base, token):
        seen = run_in_browser(base, token, NOTEBOOK, tmp_path)
    print(f"screenshots in {tmp_path}; ran in {seen['seconds']:.1f} s; per cell (JupyterLab's timing):")
    for c in seen["cells"]:
        print(f"  {_cell_seconds(c.get('timing')):6.1f} s  {c['head']}")
    assert source.read_bytes() == before, f"{NOTEBOOK} changed on disk"
    not_run = [i for i, c in enumerate(seen["cells"]) if c["count"] is None]
    errors = [e for c in seen["cells"] for e in c["errors"]]
    assert not errors and not seen["error_outputs"] and not seen["tracebacks"], (
        f"errors in the notebook: {errors} {seen['error_outputs']} {seen['tracebacks']}"
    )
    assert not not_run, (
        f"code cells {not_run} (0-based, among code cells) never ran; kernel: {seen['kernel']}"
    )
    assert seen["images"] >= 1, "no matplotlib figure rendered (.jp-RenderedImage img)"
    assert seen["widgets"] >= 1 and seen["widget_errors"] == 0, (
        f"no widget rendered ({seen['widgets']} views, {seen['widget_errors']} 'Error displaying widget')"
    )
