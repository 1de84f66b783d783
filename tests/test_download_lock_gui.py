"""Issue 15 item 12 in the panel: the Downloads tab and `dsv41 download` into one folder — the second one (here the
panel) is refused and says who holds the folder (real CLI process, real hub on loopback, real X server)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine_manager.hub import LocalHub, write_demo_shards
from engine_manager.settings import load_settings

pytestmark = pytest.mark.gui

REPO = "vcruz305/DeepSeek-V4.1-Flash-GGUF"
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def hub(tmp_path, monkeypatch):
    shards = write_demo_shards(tmp_path / "src", bytes_per_shard=512 * 1024)
    with LocalHub() as h:
        for s in shards:
            h.repo(REPO).add_file(s.name, s)
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        yield h


@pytest.fixture
def panel(qtbot, qapp):
    from app.context import AppContext
    from app.download_panel import DownloadPanel
    w = DownloadPanel(AppContext(load_settings()))
    qtbot.addWidget(w)
    w.show()
    yield w
    w.shutdown()
    qtbot.waitUntil(lambda: w.worker is None, timeout=15000)


def test_the_panel_is_refused_while_the_cli_downloads_into_the_same_folder(panel, hub, qtbot):
    hub.add_fault(kind="slow", rate_bps=200_000, times=None)
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_DISABLE_PROGRESS_BARS="1")
    cli = subprocess.Popen([sys.executable, "-m", "engine_manager", "download", "--model"], cwd=ROOT, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while hub.bytes_sent() < 50_000 and time.monotonic() < deadline and cli.poll() is None:
            time.sleep(0.02)
        assert cli.poll() is None
        errors = []
        panel.errorRaised.connect(lambda m, f: errors.append((m, f)))
        panel.start_model()
        qtbot.waitUntil(lambda: bool(errors), timeout=60000)
        qtbot.waitUntil(lambda: panel.worker is None, timeout=15000)
        msg, fix = errors[0]
        assert "Another download is writing into" in msg and f"pid {cli.pid}" in msg and "download --model" in msg
        assert "Wait for that download to finish" in fix
        assert panel.error.isVisible() and "another download is writing into this folder" in panel.status.text()
        assert cli.poll() is None                       # the CLI's download was not disturbed
    finally:
        if cli.poll() is None:          # (not SIGINT: a test run as a background job inherits it ignored)
            cli.kill()
            cli.communicate(timeout=30)
