"""Real-browser test: JupyterLab on loopback + headless Chromium (Debian's ``chromium``) via Playwright.

It opens a copy of notebooks/sft/chat_sft.ipynb, runs all cells from the Run menu, and checks what a
user sees:

1. the configuration panels render as live widgets (not as a text repr),
2. moving the LoRA rank slider changes the VRAM estimate shown beside the model panel,
3. the training cell leaves a dashboard with a loss plot (an image), and every cell ran without error
   (the notebook's last cell asserts the learning signal).

Screenshots go to runs/screenshots/chat_sft/ (``NOTEBOOKKIT_SCREENSHOTS=tests/browser/screenshots`` refreshes the
committed ones; a test run leaves the repository as it was). A missing Chromium or Playwright fails the test with
the command that installs it (``make browser-deps``), it is never skipped silently.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "sft" / "chat_sft.ipynb"
#: where the screenshots go: runs/ (ignored) unless NOTEBOOKKIT_SCREENSHOTS names the committed folder
SHOTS_ROOT = Path(os.environ.get("NOTEBOOKKIT_SCREENSHOTS", Path(__file__).resolve().parents[2] / "runs" / "screenshots"))
SHOTS = SHOTS_ROOT if "NOTEBOOKKIT_SCREENSHOTS" in os.environ else SHOTS_ROOT / "chat_sft"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
RUN_TIMEOUT_S = int(os.environ.get("NOTEBOOKKIT_BROWSER_TIMEOUT", "900"))

pytestmark = pytest.mark.browser


def _chromium() -> str:
    for candidate in ("/usr/bin/chromium", shutil.which("chromium") or "", shutil.which("chromium-browser") or ""):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    pytest.fail(
        "Chromium is not installed, so the browser test cannot run. Install it with `make browser-deps` "
        "(runs `apt-get install -y chromium`) or `sudo apt-get install -y chromium`, then run the test again."
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lab_settings(settings_dir: Path) -> None:
    """User settings for a quiet, fully rendered lab: no cell windowing, no news, no update checks."""
    files = {
        "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none", "autoStartDefaultKernel": True},
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
            "fetchNews": "false", "checkForUpdates": False},
    }
    for rel, content in files.items():
        path = settings_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content))


@pytest.fixture
def lab(tmp_path):
    """A JupyterLab server on 127.0.0.1 with a random port and token, serving a copy of the notebook."""
    root = tmp_path / "lab"
    root.mkdir()
    import nbformat
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    nb = load_notebook_node(str(NOTEBOOK))  # papermill's reader: every cell gets the tags list it looks for
    overrides = json.loads(os.environ.get("NOTEBOOKKIT_BROWSER_PARAMS", "{}"))
    nb = parameterize_notebook(nb, {"OUTPUT_DIR": "outputs", **overrides})
    nbformat.write(nb, str(root / NOTEBOOK.name))
    _lab_settings(tmp_path / "settings")
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ)
    env.update(
        JUPYTERLAB_SETTINGS_DIR=str(tmp_path / "settings"),
        JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"),
        JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    log = open(tmp_path / "jupyterlab.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
         f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
         f"--ServerApp.root_dir={root}", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         "--LabApp.extension_manager=readonly", *(["--allow-root"] if os.geteuid() == 0 else [])],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root, start_new_session=True,
    )
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
    try:
        yield dict(url=f"{base}/lab/tree/{NOTEBOOK.name}?token={token}", root=root, log=tmp_path / "jupyterlab.log")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def _estimate_text(page) -> str:
    return page.locator(".nbk-vram-estimate").first.inner_text()


def _prompts(page) -> list[str]:
    return page.eval_on_selector_all(
        ".jp-CodeCell .jp-InputArea-prompt", "els => els.map(e => e.textContent.trim())"
    )


def test_chat_sft_in_jupyterlab(lab, tmp_path):
    executable = _chromium()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("Playwright is not installed: `.venv/bin/pip install playwright` (it is in the dev extra).")
    SHOTS.mkdir(parents=True, exist_ok=True)
    for old in SHOTS.glob("0*.png"):  # this test's own numbered shots of an earlier run
        old.unlink()

    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=executable, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 1000},
        )
        page = context.pages[0] if context.pages else context.new_page()
        try:
            page.set_default_timeout(60_000)
            page.goto(lab["url"])
            page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=120_000)
            select = page.locator(".jp-Dialog button.jp-mod-accept")
            try:  # a "Select Kernel" dialog, if the lab asks despite autoStartDefaultKernel
                select.wait_for(state="visible", timeout=5_000)
                select.click()
            except Exception:
                pass
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=120_000)

            # Run all cells from the menu, as a user would.
            page.get_by_role("menuitem", name="Run", exact=True).click()
            page.get_by_role("menuitem", name="Run All Cells", exact=True).click()

            # 1. The panels render as widgets.
            rank = page.locator(".nbk-rank-slider").first
            rank.wait_for(state="visible", timeout=300_000)
            panel_out = page.locator(".nbk-model-panel").first
            panel_out.wait_for(state="visible")
            assert page.locator(".nbk-lora-panel").count() >= 1
            assert page.locator(".nbk-training-panel").count() >= 1
            texts = " ".join(page.eval_on_selector_all(".jp-OutputArea-output pre",
                                                       "els => els.map(e => e.textContent)"))
            assert "ConfigPanels(" not in texts and "VBox(children" not in texts, "panels rendered as text"
            page.wait_for_function(
                "() => (document.querySelector('.nbk-vram-estimate')?.innerText || '').includes('GiB')")
            page.locator(".nbk-config-panels").first.screenshot(path=str(SHOTS / "01-panels.png"))

            # 2. Wait for every cell to finish.
            deadline = time.time() + RUN_TIMEOUT_S
            while True:
                prompts = _prompts(page)
                errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.error']")
                if errors.count():
                    errors.first.scroll_into_view_if_needed()
                    page.screenshot(path=str(SHOTS / "error.png"))
                    pytest.fail("a cell failed in the browser:\n" + errors.first.inner_text()[-3000:])
                if prompts and all(p.strip("[]: ").isdigit() for p in prompts):
                    break
                if time.time() > deadline:
                    page.screenshot(path=str(SHOTS / "timeout.png"))
                    pytest.fail(f"cells still running after {RUN_TIMEOUT_S} s: {prompts}")
                time.sleep(2)

            # 3. With the kernel idle again, moving the rank slider updates the estimate (widget messages
            #    are handled between cell executions, so this waits for the run to finish).
            before = _estimate_text(page)
            rank.scroll_into_view_if_needed()
            readout = rank.locator(".widget-readout")
            readout.click()
            page.keyboard.press("Control+A")
            page.keyboard.type("128")
            page.keyboard.press("Enter")
            page.wait_for_function(
                "old => (document.querySelector('.nbk-vram-estimate')?.innerText || '') !== old", arg=before,
                timeout=30_000)
            after = _estimate_text(page)
            assert after != before
            page.locator(".nbk-config-panels").first.screenshot(path=str(SHOTS / "02-rank-128.png"))

            # 4. The training cell left a dashboard with a loss plot.
            dash = page.locator(".nbk-dashboard").first
            dash.wait_for(state="attached")
            plot = page.locator(".nbk-dashboard img, .nbk-dashboard-plot").first
            plot.scroll_into_view_if_needed()
            size = plot.evaluate("img => [img.naturalWidth || img.width, img.naturalHeight || img.height]")
            assert size[0] > 100 and size[1] > 100, f"dashboard plot has size {size}"
            dash.screenshot(path=str(SHOTS / "03-dashboard.png"))
            stats = page.locator(".nbk-dashboard-stats").first.inner_text().lower()
            assert "loss" in stats

            body = page.locator(".jp-NotebookPanel").first.inner_text()
            assert "learning signal: OK" in body
            page.locator(".jp-Cell").last.scroll_into_view_if_needed()
            page.screenshot(path=str(SHOTS / "04-finished.png"))
        except BaseException:
            page.screenshot(path=str(SHOTS / "failure.png"))
            print("JupyterLab log (tail):\n" + Path(lab["log"]).read_text()[-2000:])
            raise
        finally:
            context.close()
