"""Executed notebooks keep their widgets: a notebook run by papermill (widget state saved with the outputs, as
``make demo`` and the GPU runs do), reopened in JupyterLab without running anything, and rendered by nbconvert
to HTML, shows its panels and the dashboard's last frame as widgets, not as ``VBox(children=...`` text.

For each notebook of ``EXECUTED`` (``NOTEBOOKKIT_BROWSER_NOTEBOOKS=all`` runs all six) it:

1. runs the notebook with papermill (``store_widget_state``: every widget view in the outputs must have its
   model in the saved state);
2. opens the executed copy in JupyterLab (headless Chromium), waits for the widgets, fails on a widget shown as
   text or as "Error displaying widget", checks that the dashboard's stats row fits its box, and screenshots
   the panels and the dashboard;
3. renders it with nbconvert (``--to html``, the html-manager and require.js served from a local copy, since
   the page may not reach a CDN) and makes the same checks and screenshots in the HTML.

Screenshots: runs/screenshots/executed/<notebook>-{lab,html}-{panels,dashboard}.png
(``NOTEBOOKKIT_SCREENSHOTS=tests/browser/screenshots`` refreshes the committed ones). Set
``NOTEBOOKKIT_EXECUTED_DIR`` to a folder of already executed notebooks (``<stem>.ipynb``) to skip step 1.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from tests.browser.test_chat_sft_browser import CHROMIUM_ARGS, SHOTS_ROOT, _chromium

ROOT = Path(__file__).resolve().parents[2]
SHOTS = SHOTS_ROOT if "NOTEBOOKKIT_SCREENSHOTS" in os.environ else SHOTS_ROOT / "executed"
WIDGET_JS = Path(os.environ.get("NOTEBOOKKIT_WIDGET_JS", ROOT / ".cache" / "widget-js"))

#: notebook -> papermill parameters: short runs (the widgets are what is checked here; whether each notebook
#: learns is checked by its last cell under nbmake), so the learning thresholds are off
_SHORT_SFT = {"CALIBRATION_STEPS": 0, "MAX_STEPS": 8, "MIN_LOSS_DROP": -1.0, "MIN_HELDOUT_DROP": -1.0}
ALL = {
    "chat_sft": ("notebooks/sft/chat_sft.ipynb", _SHORT_SFT),
    "grpo": ("notebooks/grpo/grpo.ipynb", {"PRIME_STEPS": 8, "GRPO_STEPS": 6, "FIRST_LAST": 3,
                                          "MIN_REWARD_RISE": -10.0, "N_EVAL": 2}),
    "alpaca_sft": ("notebooks/sft/alpaca_sft.ipynb", _SHORT_SFT),
    "dpo": ("notebooks/dpo/dpo.ipynb", {}),
    "vision_sft": ("notebooks/vision/vision_sft.ipynb", {}),
    "export": ("notebooks/export/export.ipynb", {}),
}
EXECUTED = ALL if os.environ.get("NOTEBOOKKIT_BROWSER_NOTEBOOKS") == "all" else {k: ALL[k] for k in ("chat_sft", "grpo")}
TEXT_REPRS = ("VBox(children", "HBox(children", "ConfigPanels(", "LiveDashboard(", "Error displaying widget")

pytestmark = pytest.mark.browser


def _executed(name: str, tmp_path: Path) -> Path:
    import nbformat

    given = os.environ.get("NOTEBOOKKIT_EXECUTED_DIR")
    if given:
        from tests.notebooks.papermill_run import trust

        path = Path(given) / f"{Path(ALL[name][0]).stem}.ipynb"
        assert path.is_file(), f"NOTEBOOKKIT_EXECUTED_DIR has no {path.name}"
        trust(path)
    else:
        from tests.notebooks.papermill_run import run_with_papermill

        notebook, params = ALL[name]
        out = tmp_path / "executed"
        run = run_with_papermill(notebook, out / Path(notebook).name, dict(params, OUTPUT_DIR=str(out / name)),
                                 timeout=1200)
        print(run.log_line())
        assert run.ok, run.error
        path = run.output
    nb = nbformat.read(str(path), as_version=4)
    state = nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})
    views = [o["data"]["application/vnd.jupyter.widget-view+json"]["model_id"] for c in nb.cells
             if c.cell_type == "code" for o in c.get("outputs", [])
             if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert views, f"{path.name} shows no widget"
    missing = [v for v in views if v not in state]
    assert not missing, f"{path.name}: {len(missing)} of {len(views)} widget views have no saved state"
    return path


def _check_widgets(page, where: str, name: str) -> None:
    """The panels and the dashboard render as widgets; no widget output shows a text repr; the stats row fits."""
    page.wait_for_selector(".nbk-dashboard .nbk-dashboard-plot img, .nbk-dashboard img", timeout=120_000)
    texts = " ".join(page.eval_on_selector_all(
        ".jp-OutputArea-output pre, .jp-RenderedText, .widget-subarea, .jp-OutputArea-output",
        "els => els.map(e => e.textContent)"))
    shown_as_text = [t for t in TEXT_REPRS if t in texts]
    assert not shown_as_text, f"{name} in {where}: widgets rendered as text ({shown_as_text})"
    panels = page.locator(".nbk-config-panels, .nbk-export-panel").first
    if panels.count():
        panels.scroll_into_view_if_needed()
        panels.screenshot(path=str(SHOTS / f"{name}-{where}-panels.png"))
    dash = page.locator(".nbk-dashboard").last
    dash.scroll_into_view_if_needed()
    size = page.locator(".nbk-dashboard").last.locator("img").first.evaluate(
        "img => [img.naturalWidth, img.naturalHeight]")
    assert size[0] > 100 and size[1] > 100, f"{name} in {where}: the dashboard's plot is {size}"
    widths = page.locator(".nbk-dashboard-stats").last.evaluate(
        "el => [el.scrollWidth, el.clientWidth, el.closest('.nbk-dashboard').clientWidth]")
    assert widths[0] <= widths[1] + 1 and widths[1] <= widths[2] + 1, (
        f"{name} in {where}: the stats row is wider than its box (scroll {widths[0]}, box {widths[1]}, "
        f"dashboard {widths[2]} px): its last columns are cut")
    dash.screenshot(path=str(SHOTS / f"{name}-{where}-dashboard.png"))


def _html(executed: Path, out_dir: Path) -> Path:
    """nbconvert's HTML of ``executed``, loading the widget manager from the local copy in WIDGET_JS."""
    from nbconvert import HTMLExporter

    embed, require = WIDGET_JS / "embed-amd.js", WIDGET_JS / "require.js"
    if not (embed.is_file() and require.is_file()):
        pytest.fail(f"the widget manager's JavaScript is not in {WIDGET_JS}: run `make browser-deps` (npm pack "
                    "@jupyter-widgets/html-manager and requirejs), or set NOTEBOOKKIT_WIDGET_JS to a folder with "
                    "embed-amd.js and require.js")
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in (embed, require):
        shutil.copy(f, out_dir / f.name)
    exporter = HTMLExporter(template_name="lab", widget_renderer_url="embed-amd.js", require_js_url="require.js")
    body, _ = exporter.from_filename(str(executed))
    page = out_dir / f"{executed.stem}.html"
    page.write_text(body)
    return page


@pytest.mark.parametrize("name", list(EXECUTED))
def test_executed_notebook_shows_its_widgets_in_jupyterlab_and_in_html(name, tmp_path):
    executable = _chromium()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("Playwright is not installed: `.venv/bin/pip install playwright` (it is in the dev extra).")
    SHOTS.mkdir(parents=True, exist_ok=True)
    executed = _executed(name, tmp_path)
    html = _html(executed, tmp_path / "html")
    root = tmp_path / "lab"
    root.mkdir()
    shutil.copy(executed, root / executed.name)
    server = _start_lab(root, tmp_path)
    try:
        with sync_playwright() as pw:
            context = pw.chromium.launch_persistent_context(
                str(tmp_path / "chromium-profile"), executable_path=executable, headless=True, args=CHROMIUM_ARGS,
                viewport={"width": 1400, "height": 1000})
            page = context.pages[0] if context.pages else context.new_page()
            try:
                page.set_default_timeout(60_000)
                page.goto(f"{server['base']}/lab/tree/{executed.name}?token={server['token']}")
                page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=120_000)
                _check_widgets(page, "lab", name)
                page.goto(html.as_uri())
                _check_widgets(page, "html", name)
            except BaseException:
                page.screenshot(path=str(SHOTS / f"{name}-failure.png"))
                raise
            finally:
                context.close()
    finally:
        server["stop"]()


def _start_lab(root: Path, tmp_path: Path) -> dict:
    """JupyterLab on 127.0.0.1 serving ``root`` (the same settings as the chat SFT browser test)."""
    import secrets
    import signal
    import subprocess
    import sys
    import urllib.request

    from tests.browser.test_chat_sft_browser import _free_port, _lab_settings

    _lab_settings(tmp_path / "settings")
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"))
    log = open(tmp_path / "jupyterlab.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
         f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
         f"--ServerApp.root_dir={root}", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         "--LabApp.extension_manager=readonly", *(["--allow-root"] if os.geteuid() == 0 else [])],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
            break
        except Exception:
            if proc.poll() is not None or time.time() > deadline:
                log.close()
                pytest.fail("JupyterLab did not start:\n" + (tmp_path / "jupyterlab.log").read_text()[-3000:])
            time.sleep(0.5)

    def stop() -> None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()

    return dict(base=base, token=token, stop=stop)
