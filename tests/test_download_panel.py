"""The Downloads tab and the first-run flow under a real X server, against the local hub."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from engine_manager import fmt
from engine_manager import download as dl, uistate
from engine_manager.testing.hub import LocalHub, write_demo_shards
from engine_manager.settings import load_settings

pytestmark = pytest.mark.gui

REPO = "vcruz305/DeepSeek-V4.1-Flash-GGUF"


@pytest.fixture
def shards(tmp_path):
    return write_demo_shards(tmp_path / "src", bytes_per_shard=512 * 1024)


@pytest.fixture
def hub(shards, monkeypatch):
    with LocalHub() as h:
        for s in shards:
            h.repo(REPO).add_file(s.name, s)
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        yield h


@pytest.fixture
def ctx(qapp):
    from app.context import AppContext
    return AppContext(load_settings())


@pytest.fixture
def panel(qtbot, ctx):
    from app.download_panel import DownloadPanel
    w = DownloadPanel(ctx)
    qtbot.addWidget(w)
    w.resize(1000, 600)
    w.show()
    yield w
    w.shutdown()
    qtbot.waitUntil(lambda: w.worker is None, timeout=15000)


def test_initial_state_shows_seven_missing_shards_and_the_engine_line(panel, qtbot):
    qtbot.waitUntil(lambda: panel.table.rowCount() == 7 and panel.engine_label.text() != "", timeout=5000)
    assert all(panel.shard_state(n) == "not downloaded" for n in dl.shard_names())
    assert "264.5 GB" in panel.status.text()
    assert "never runs a binary it has not verified" in panel.engine_label.text()   # the placeholder manifest
    assert not panel.engine_btn.isEnabled() and not panel.pause_btn.isEnabled()


def test_download_to_verified_ticks(panel, hub, qtbot):
    done = []
    panel.modelFinished.connect(done.append)
    qtbot.mouseClick(panel.download_btn, qtbot_left())
    qtbot.waitUntil(lambda: bool(done), timeout=30000)
    qtbot.waitUntil(lambda: panel.worker is None, timeout=10000)
    assert panel.verified_count() == 7
    assert all(panel.shard_state(n) == "verified" for n in dl.shard_names())
    assert panel.total_bar.value() == 1000 and "All seven shards verified" in panel.status.text()
    assert "pinned" in panel.where.text()
    assert panel.download_btn.isEnabled() and not panel.cancel_btn.isEnabled()


def qtbot_left():
    from PySide6.QtCore import Qt
    return Qt.MouseButton.LeftButton


def test_pause_resume_cancel_buttons(panel, hub, qtbot):
    hub.add_fault(kind="slow", rate_bps=250_000, times=None)
    qtbot.mouseClick(panel.download_btn, qtbot_left())
    qtbot.waitUntil(lambda: panel.last_progress is not None and panel.last_progress.done_bytes > 100_000,
                    timeout=20000)
    qtbot.mouseClick(panel.pause_btn, qtbot_left())
    assert panel.resume_btn.isEnabled() and not panel.pause_btn.isEnabled()
    qtbot.waitUntil(lambda: any(panel.shard_state(n) == "paused" for n in dl.shard_names()), timeout=5000)
    assert "Paused" in panel.status.text() and "paused" in panel.total_label.text()
    qtbot.mouseClick(panel.resume_btn, qtbot_left())
    qtbot.waitUntil(lambda: any(panel.shard_state(n) == "downloading" for n in dl.shard_names()), timeout=5000)
    qtbot.mouseClick(panel.cancel_btn, qtbot_left())
    qtbot.waitUntil(lambda: panel.worker is None, timeout=15000)
    assert "Stopped" in panel.status.text() and "resumes" in panel.status.text()
    st = dl.local_status(panel.ctx.settings)
    assert st.partial_bytes > 0 and not st.verified


def test_an_error_is_shown_with_the_fix(panel, hub, qtbot):
    hub.add_fault(kind="status", path="*00004-of*", status=404, times=None, method="any")
    errors = []
    panel.errorRaised.connect(lambda m, f: errors.append((m, f)))
    panel.start_model()
    qtbot.waitUntil(lambda: bool(errors), timeout=30000)
    qtbot.waitUntil(lambda: panel.worker is None, timeout=10000)
    assert panel.error.isVisible()
    assert "404" in panel.error.message.text()
    assert "What to do" in panel.error.fix.text() and "DSV41_MODEL_REVISION" in panel.error.fix.text()


def test_use_a_folder_that_already_has_the_shards(panel, hub, shards, tmp_path, qtbot):
    folder = tmp_path / "my-model"
    folder.mkdir()
    for s in shards[:6]:
        shutil.copy(s, folder / s.name)
    panel.use_folder(folder)
    qtbot.waitUntil(lambda: panel.worker is None, timeout=20000)
    assert panel.error.isVisible() and "missing" in panel.error.message.text()
    assert panel.ctx.settings.model_dir is None
    shutil.copy(shards[6], folder / shards[6].name)
    changed = []
    panel.ctx.settingsChanged.connect(changed.append)
    panel.use_folder(folder)
    qtbot.waitUntil(lambda: panel.worker is None and bool(changed), timeout=20000)
    assert Path(panel.ctx.settings.model_dir) == folder
    assert dl.model_present(panel.ctx.settings)


def test_first_run_flow(panel, hub, ctx, shards, tmp_path, qtbot):
    from app.first_run import FirstRunDialog, should_show
    from engine_manager.hardware import probe

    assert should_show(ctx)
    ctx.set_hardware(probe(ctx.settings.cache_path))
    dlg = FirstRunDialog(ctx, panel)
    qtbot.addWidget(dlg)
    dlg.show()
    text = dlg.doctor_page.table.text()
    assert "RAM" in text and "What to do" in text
    dlg.next()
    assert dlg.currentPage() is dlg.model_page
    qtbot.mouseClick(dlg.model_page.download_btn, qtbot_left())
    qtbot.waitUntil(lambda: "All seven shards verified" in dlg.model_page.state.text(), timeout=30000)
    qtbot.waitUntil(lambda: panel.worker is None, timeout=10000)
    assert dlg.model_page.bar.value() == 1000
    with qtbot.waitSignal(ctx.requestTab, timeout=2000) as tab:
        dlg.next()
    assert tab.args == ["Placement"]
    dlg.next()
    assert dlg.currentPage() is dlg.start_page
    dlg.dont_show.setChecked(True)
    with qtbot.waitSignal(ctx.requestStart, timeout=2000):
        qtbot.mouseClick(dlg.start_page.start_btn, qtbot_left())
    assert not dlg.isVisible()
    assert uistate.load().get("first_run_dismissed") is True
    assert not should_show(ctx)


def test_main_window_shows_getting_started_on_first_launch(qtbot, ctx):
    from app.main_window import MainWindow

    win = MainWindow(ctx)
    qtbot.addWidget(win)
    win.show()
    qtbot.waitUntil(lambda: win.first_run_dialog is not None and win.first_run_dialog.isVisible(), timeout=10000)
    names = [a.objectName() for a in win.menuBar().actions()[-1].menu().actions()]
    assert "actionGettingStarted" in names
    win.first_run_dialog.dont_show.setChecked(True)
    win.first_run_dialog.reject()
    assert uistate.load().get("first_run_dismissed") is True
    win.close()


# -- closing mid-download (m7), rows after a restart (p8), the pinned commit gone (m8) --------------------------------

def _start_and_wait_for_bytes(panel, hub, qtbot, nbytes=100_000):
    hub.add_fault(kind="slow", rate_bps=250_000, times=None)
    panel.start_model()
    qtbot.waitUntil(lambda: panel.last_progress is not None and panel.last_progress.done_bytes > nbytes,
                    timeout=20000)


def test_shutdown_stops_the_download_and_late_signals_are_harmless(panel, hub, qtbot):
    _start_and_wait_for_bytes(panel, hub, qtbot)
    worker = panel.worker
    panel.shutdown()
    assert panel.stopped_in_time is True                   # stopped within the wait, not left running
    assert panel.worker is None and not worker.is_running
    sent = hub.bytes_sent()
    st = dl.local_status(panel.ctx.settings)
    assert st.partial_bytes > 0 and not st.verified        # partial files kept for the next Download
    text = panel.status.text()
    qtbot.wait(600)
    assert hub.bytes_sent() == sent                        # nothing flows after the window closed
    # a signal that arrives late reaches a panel that ignores it: no new work, no change on screen
    panel._on_event(dl.Progress([], 1, 2, None, None, 0.0))
    panel._on_event(dl.Stopped(1, 2, st.folder))
    panel._on_error(dl.DownloadError("late", "late"))
    panel._on_finished()
    panel.start_model()
    assert panel.status.text() == text and not panel.error.isVisible() and panel.worker is None


def test_closing_the_window_mid_download_prints_no_qt_errors(hub, tmp_path):
    """The QA repro of m7 in a real process: closing the main window during a download used to print
    'Error calling Python override of QRunnable::run() … Signal source has been deleted'."""
    import os
    import subprocess
    import sys
    script = tmp_path / "close.py"
    script.write_text(
        "import sys, time\n"
        "from PySide6.QtCore import QTimer\n"
        "from PySide6.QtWidgets import QApplication\n"
        "app = QApplication([sys.argv[0]])\n"
        "from app.context import AppContext\n"
        "from app.main_window import MainWindow\n"
        "from engine_manager.settings import load_settings\n"
        "win = MainWindow(AppContext(load_settings())); win.show()\n"
        "dp = win.download_panel\n"
        "def go():\n"
        "    for w in QApplication.topLevelWidgets():\n"
        "        if w.isVisible() and type(w).__name__ == 'FirstRunDialog': w.close()\n"
        "    dp.start_model(); QTimer.singleShot(200, wait)\n"
        "def wait():\n"
        "    p = dp.last_progress\n"
        "    if p is None or p.done_bytes < 100000: QTimer.singleShot(100, wait); return\n"
        "    print('closing at', p.done_bytes, flush=True); win.close(); app.quit()\n"
        "QTimer.singleShot(500, go)\n"
        "QTimer.singleShot(60000, app.quit)\n"
        "app.exec()\n"
        "print('exited', flush=True)\n")
    hub.add_fault(kind="slow", rate_bps=250_000, times=None)
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, HF_ENDPOINT=hub.url, PYTHONPATH=str(root), PYTHONWARNINGS="always")
    p = subprocess.run([sys.executable, str(script)], cwd=root, env=env, capture_output=True, text=True,
                       timeout=120)
    out = p.stdout + p.stderr
    assert "closing at" in p.stdout and "exited" in p.stdout, out
    assert "Signal source has been deleted" not in out and "Error calling Python override" not in out, out
    assert "RuntimeError" not in out, out
    st = dl.local_status(load_settings().settings)
    assert st.partial_bytes > 0                           # partial files kept


def test_rows_after_a_restart_show_the_partial_files(panel, hub, ctx, qtbot):
    from app.download_panel import DownloadPanel
    _start_and_wait_for_bytes(panel, hub, qtbot, 300_000)
    panel.cancel()
    qtbot.waitUntil(lambda: panel.worker is None, timeout=15000)
    st = dl.local_status(ctx.settings)
    assert st.kept and st.partial_bytes == sum(st.kept.values())
    again = DownloadPanel(ctx)                              # the panel after a restart
    qtbot.addWidget(again)
    again.resize(1000, 600)
    again.show()
    qtbot.waitUntil(lambda: again.table.rowCount() == 7 and "partial" in again.status.text(), timeout=5000)
    try:
        for n in dl.shard_names():
            if n in st.kept:
                assert again.shard_state(n) == "partly downloaded"
                assert again.bars[n].value() == int(st.kept[n] / st.sizes[n] * 1000) > 0
                assert again.table.item(again.rows[n], 3).text() == fmt.bytes_si(st.sizes[n])
            else:
                assert again.shard_state(n) == "not downloaded" and again.bars[n].value() == 0
        assert fmt.bytes_si(st.partial_bytes) in again.status.text()
        assert again.total_bar.value() == int(st.partial_bytes / sum(st.sizes.values()) * 1000)
    finally:
        again.shutdown()


def test_column_widths_stay_put_between_states(panel, hub, qtbot):
    hh = panel.table.horizontalHeader()
    def widths():
        return [hh.sectionSize(c) for c in (0, 1, 3, 4, 5, 6)]
    qtbot.waitUntil(lambda: panel.table.rowCount() == 7, timeout=5000)
    before = widths()
    label_w = panel.total_label.width()
    _start_and_wait_for_bytes(panel, hub, qtbot)
    qtbot.waitUntil(lambda: bool(panel.last_progress.speed_bps), timeout=5000)
    assert widths() == before
    panel.pause()
    qtbot.waitUntil(lambda: any(panel.shard_state(n) == "paused" for n in dl.shard_names()), timeout=5000)
    assert widths() == before and panel.total_label.width() == label_w
    fm = panel.table.fontMetrics()
    assert hh.sectionSize(6) >= fm.horizontalAdvance("damaged: will be fetched again")


def test_pinned_commit_gone_offers_to_repin(panel, hub, tmp_path, qtbot):
    _start_and_wait_for_bytes(panel, hub, qtbot)
    panel.cancel()
    qtbot.waitUntil(lambda: panel.worker is None, timeout=15000)
    hub.clear_faults()
    repo = hub.repo(REPO)
    old = repo.head
    new = repo.new_commit()
    repo.drop_commit(old)
    errors = []
    panel.errorRaised.connect(lambda m, f: errors.append(m))
    panel.start_model()
    qtbot.waitUntil(lambda: bool(errors) and panel.worker is None, timeout=20000)
    assert old in panel.error.message.text() and "--repin" in panel.error.fix.text()
    assert panel.error.action.isVisible() and "Re-pin" in panel.error.action.text()
    done = []
    panel.modelFinished.connect(done.append)
    qtbot.mouseClick(panel.error.action, qtbot_left())
    qtbot.waitUntil(lambda: bool(done), timeout=30000)
    assert done[0].commit == new and panel.verified_count() == 7 and not panel.error.isVisible()
    qtbot.waitUntil(lambda: panel.worker is None, timeout=10000)


def test_the_panel_is_refused_while_the_cli_downloads_into_the_same_folder(panel, hub, qtbot):
    """the Downloads tab and `dsv41 download` into one folder — the second one (here
    the panel) is refused and says who holds the folder (real CLI process, real hub on loopback)."""
    import os
    import subprocess
    import sys
    import time

    hub.add_fault(kind="slow", rate_bps=200_000, times=None)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent), HF_HUB_DISABLE_PROGRESS_BARS="1")
    cli = subprocess.Popen([sys.executable, "-m", "engine_manager", "download", "--model"],
                           cwd=Path(__file__).resolve().parent.parent, env=env,
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
