"""The engine panel and the log view under a real X server (pytest-xvfb), driving the real scripted engine."""

from __future__ import annotations

import os
import re
import signal
import socket

import psutil
import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication, QStyle, QStyleOptionButton
from supervisor_helpers import hw, listening, live_group, tiny_engine, wait_until

from app.context import AppContext
from app.engine_panel import EnginePanel
from app.log_view import LogView
from app.statusbar import LiveStatusBar
from engine_manager import supervisor as sv
from engine_manager.procs import alive
from engine_manager.settings import load_settings, save_settings


@pytest.fixture
def port(panel_engine_port):
    """The panel's own scripted engine on a free port, stopped at the end (``gui_conftest.panel_engine_port``)."""
    return panel_engine_port


def make_panel(qtbot) -> tuple[AppContext, EnginePanel, LogView]:
    ctx = AppContext(load_settings(), hw())
    panel = EnginePanel(ctx)
    log = LogView(ctx)
    qtbot.addWidget(panel)
    qtbot.addWidget(log)
    panel.sup.grace_s = 5.0
    panel.sup.backoff_base_s = 0.1
    panel.show()
    qtbot.waitUntil(lambda: not panel.tasks.running("run"), timeout=10_000)     # the start-up re-attach look
    return ctx, panel, log


def idle(panel) -> bool:
    return not panel.tasks.running("run") and not panel.tasks.running("stop")


def test_click_start_see_ready_click_stop_see_stopped(qtbot, port):
    ctx, panel, log = make_panel(qtbot)
    assert panel.badge.text() == "Stopped" and panel.start_button.text() == "Start"
    states = []
    ctx.engineStateChanged.connect(lambda ev: states.append(ev.state))
    handles = []
    ctx.engineRunning.connect(handles.append)
    with qtbot.waitSignal(ctx.ownEngineChanged, timeout=30_000, check_params_cb=lambda r: r is not None) as ready:
        qtbot.mouseClick(panel.start_button, Qt.MouseButton.LeftButton)
    assert ready.args[0].base_url == f"http://127.0.0.1:{port}" and ready.args[0].api_key == ctx.settings.api_key
    assert ctx.base_url == f"http://127.0.0.1:{port}" and ctx.supervisor is panel.sup
    # the one handle, from the session: what the supervisor knows about this engine (own and watched)
    running = ctx.running
    assert handles == [running] and running.base_url == ctx.base_url and running.api_key == ctx.settings.api_key
    assert running.pid == panel.sup.snapshot().pid and running.started_by_panel and running.simulated
    assert running.log_path == str(panel.sup.log_path) and running.spec is not None
    qtbot.waitUntil(lambda: panel.badge.text() == "Ready", timeout=5_000)
    assert panel.start_button.text() == "Stop" and not panel.engine_box.isEnabled()
    # while the benchmark drives the engine, Start/Stop are held and say why; a Stop asked anyway is refused
    ctx.lock_engine("The benchmark is running.")
    assert not panel.start_button.isEnabled() and panel.start_button.toolTip() == "The benchmark is running."
    assert not panel.stop_action.isEnabled()
    panel.stop()
    assert panel.badge.text() == "Ready" and not panel.tasks.running("stop")
    ctx.lock_engine(None)
    assert panel.start_button.isEnabled() and panel.stop_action.isEnabled()
    assert "numactl" in panel.details.text() and str(port) in panel.details.text()
    assert "up under a minute" in panel.details.text()
    # the uptime is said to the minute: the details are made again just past the next whole minute, not every second
    assert panel.clock.isActive() and panel.clock.isSingleShot() and 0 < panel.clock.remainingTime() <= 60_050
    assert "starting" in states and "ready" in states
    st = panel.sup.snapshot()
    pid, pgid = st.pid, st.pgid
    assert psutil.pid_exists(pid)
    # the log view got the engine's lines live; search finds READY
    qtbot.waitUntil(lambda: "READY" in log.text.toPlainText(), timeout=5_000)
    log.search.setText("READY")
    assert log.find_next() and log.text.textCursor().selectedText() == "READY"
    assert "match" in log.matches.text()
    log.copy_all()
    assert "READY" in QApplication.clipboard().text()
    with qtbot.waitSignal(ctx.ownEngineChanged, timeout=30_000, check_params_cb=lambda r: r is None):
        qtbot.mouseClick(panel.start_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: panel.badge.text() == "Stopped" and idle(panel), timeout=30_000)
    assert panel.start_button.text() == "Start" and ctx.base_url is None
    assert ctx.running is None and handles[-1] is None
    assert "stopped" in states
    assert wait_until(lambda: not live_group(pgid), timeout=5) and not listening(port)


def test_crash_banner_says_cause_and_fix(qtbot, port, monkeypatch):
    monkeypatch.setenv("DSV41_SIM_ARGS", "--load-time 0 --fail-at-load driver")
    ctx, panel, _ = make_panel(qtbot)
    panel.start()
    qtbot.waitUntil(lambda: panel.banner.isVisible() and idle(panel), timeout=30_000)
    assert "driver" in panel.banner.title.text().lower() and "580.65" in panel.banner.fix.text()
    assert "Another try cannot fix" in panel.banner.extra.text()             # no pointless restart
    assert panel.badge.text() == "Crashed" and panel.start_button.text() == "Start"


def test_sigkill_shows_oom_banner_and_auto_restart_recovers(qtbot, port):
    ctx, panel, _ = make_panel(qtbot)
    bar = LiveStatusBar(ctx)
    qtbot.addWidget(bar)
    panel.sup.backoff_base_s = 2.0                  # a countdown long enough to look at
    assert panel.auto_restart.isChecked()
    with qtbot.waitSignal(ctx.ownEngineChanged, timeout=30_000, check_params_cb=lambda r: r is not None):
        panel.start()
        # the status bar follows the badge at once (it said "engine: stopped" under "Starting…")
        assert panel.badge.text() == "Starting…" and bar.engine_label.text() == "engine: starting…"
    assert panel.badge.text() == "Ready" and bar.engine_label.text() == "engine: ready"
    pid = panel.sup.snapshot().pid
    os.kill(pid, signal.SIGKILL)
    qtbot.waitUntil(lambda: panel.banner.isVisible() and panel.phase.text().startswith("Restarting in"),
                    timeout=5_000)
    assert "out-of-memory killer" in panel.banner.title.text() and "journalctl" in panel.banner.fix.text()
    assert panel.badge.text() == "Restarting…" and bar.engine_label.text() == "engine: restarting…"
    # one countdown (the phase line, from the supervisor's Restarting events); the banner carries no second,
    # drifting figure of the time left
    assert not re.search(r"\d+(\.\d+)? s\b", panel.banner.extra.text()), panel.banner.extra.text()
    assert "restarts it automatically" in panel.banner.extra.text()
    first = float(re.search(r"Restarting in ([\d.]+) s", panel.phase.text()).group(1))
    qtbot.waitUntil(lambda: "Restarting in" in panel.phase.text() and
                    float(re.search(r"in ([\d.]+) s", panel.phase.text()).group(1)) < first, timeout=5_000)
    qtbot.waitUntil(lambda: panel.badge.text() == "Ready" and panel.sup.snapshot() is not None
                    and panel.sup.snapshot().pid != pid, timeout=30_000)
    # the badge turns on the supervisor's "ready" state event; the Ready event right after it hides the banner (two
    # queued signals: a check between them saw the banner still up)
    qtbot.waitUntil(lambda: not panel.banner.isVisible(), timeout=5_000)
    assert ctx.running is not None and ctx.running.pid == panel.sup.snapshot().pid     # the restarted engine
    panel.stop()
    qtbot.waitUntil(lambda: panel.badge.text() == "Stopped" and idle(panel), timeout=30_000)


def click_check_box(qtbot, box) -> None:
    """A click on the box's indicator (a click in the middle of a stretched check box can land on empty space)."""
    opt = QStyleOptionButton()
    opt.initFrom(box)
    at = box.style().subElementRect(QStyle.SubElement.SE_CheckBoxIndicator, opt, box).center()
    qtbot.mouseClick(box, Qt.MouseButton.LeftButton, pos=at)


def test_force_stop_kills_an_engine_that_ignores_sigterm(qtbot, port):
    ctx, panel, _ = make_panel(qtbot)
    panel.sup.resolve_engine = lambda name: tiny_engine("ignore-term")     # what Start runs: the supervisor's hook
    panel.sup.grace_s = 600.0                    # only Force stop can end it within the waits below
    with qtbot.waitSignal(ctx.ownEngineChanged, timeout=30_000, check_params_cb=lambda r: r is not None):
        qtbot.mouseClick(panel.start_button, Qt.MouseButton.LeftButton)
    st = panel.sup.snapshot()
    pid, pgid = st.pid, st.pgid
    assert "ignore-term" in psutil.Process(pid).cmdline()
    qtbot.mouseClick(panel.start_button, Qt.MouseButton.LeftButton)        # Stop: SIGTERM, which it ignores
    qtbot.waitUntil(lambda: panel.badge.text() == "Stopping…" and panel.start_button.text() == "Force stop"
                    and "SIGTERM sent" in panel.phase.text() and "Force stop now" in panel.phase.text(),
                    timeout=10_000)
    assert alive(pid) and listening(port)
    messages = []
    ctx.statusMessage.connect(lambda text, *_: messages.append(text))
    qtbot.mouseClick(panel.start_button, Qt.MouseButton.LeftButton)        # Force stop
    qtbot.waitUntil(lambda: panel.badge.text() == "Stopped" and idle(panel), timeout=20_000)
    assert panel.start_button.text() == "Start" and ctx.base_url is None
    assert "Stopped with SIGKILL." in messages, messages                  # not "after the grace period"
    assert wait_until(lambda: not live_group(pgid), timeout=5) and not listening(port)


def test_auto_restart_off_leaves_a_crash_crashed(qtbot, port):
    ctx, panel, _ = make_panel(qtbot)
    assert panel.auto_restart.isChecked()
    click_check_box(qtbot, panel.auto_restart)
    assert not panel.auto_restart.isChecked() and panel.sup.auto_restart is False
    assert load_settings().settings.auto_restart is False                  # the choice is saved
    states = []
    ctx.engineStateChanged.connect(lambda ev: states.append(ev.state))
    with qtbot.waitSignal(ctx.ownEngineChanged, timeout=30_000, check_params_cb=lambda r: r is not None):
        qtbot.mouseClick(panel.start_button, Qt.MouseButton.LeftButton)
    st = panel.sup.snapshot()
    pid, pgid = st.pid, st.pgid
    os.kill(pid, signal.SIGKILL)
    # the supervision ends (nothing left to restart); the panel shows the crash and offers Start
    qtbot.waitUntil(lambda: panel.banner.isVisible() and idle(panel), timeout=10_000)
    assert panel.badge.text() == "Crashed" and panel.start_button.text() == "Start"
    assert "out-of-memory killer" in panel.banner.title.text()
    assert "restarts it automatically" not in panel.banner.extra.text()
    assert "crashed" in states and ctx.base_url is None
    assert not {"restarting", "starting"} & set(states[states.index("crashed"):]), states
    assert wait_until(lambda: not live_group(pgid), timeout=5) and not listening(port)
    # the idle look for an engine to re-attach to finds the crash, not a new engine: crashed stays
    panel.reattach()
    qtbot.waitUntil(lambda: idle(panel), timeout=10_000)
    assert panel.badge.text() == "Crashed"
    assert not {"restarting", "starting"} & set(states[states.index("crashed"):]), states
    assert panel.sup.status(check_health=False).state == "crashed" and not listening(port)


def test_slow_start_shows_progress_with_phase_and_elapsed(qtbot, port, monkeypatch):
    monkeypatch.setenv("DSV41_SIM_ARGS", "--load-time 3")
    ctx, panel, _ = make_panel(qtbot)
    panel.start()
    qtbot.waitUntil(lambda: panel.progress.isVisible() and "elapsed" in panel.phase.text()
                    and "%" in panel.progress.format() and panel.progress.value() > 0, timeout=30_000)
    assert "of up to 2 h" in panel.phase.text()
    qtbot.waitUntil(lambda: panel.badge.text() == "Ready", timeout=30_000)
    assert not panel.progress.isVisible()
    panel.stop()
    qtbot.waitUntil(lambda: panel.badge.text() == "Stopped" and idle(panel), timeout=30_000)


def test_close_leave_running_then_a_new_panel_reattaches(qtbot, port):
    ctx, panel, _ = make_panel(qtbot)
    with qtbot.waitSignal(ctx.ownEngineChanged, timeout=30_000, check_params_cb=lambda r: r is not None):
        panel.start()
    pid = panel.sup.snapshot().pid
    panel.ask_close_choice = lambda win: "cancel"
    assert panel.confirm_close(None) is False
    panel.ask_close_choice = lambda win: "leave"
    assert panel.confirm_close(None) is True
    panel.shutdown()
    qtbot.waitUntil(lambda: not panel.tasks.running("run"), timeout=10_000)
    assert psutil.pid_exists(pid)                                           # left running
    ctx2 = AppContext(load_settings(), hw())
    with qtbot.waitSignal(ctx2.ownEngineChanged, timeout=30_000, check_params_cb=lambda r: r is not None):
        panel2 = EnginePanel(ctx2)
        qtbot.addWidget(panel2)
    assert panel2.badge.text() == "Ready" and panel2.sup.snapshot().pid == pid
    # closing with "stop" stops it and then closes the window
    closed = []

    class Win:
        def close(self):
            closed.append(True)

    panel2.ask_close_choice = lambda win: "stop"
    assert panel2.confirm_close(Win()) is False
    qtbot.waitUntil(lambda: closed == [True], timeout=30_000)
    assert panel2.badge.text() == "Stopped" and not listening(port)


def test_dry_run_dialog_is_copyable_and_masks_the_key(qtbot, port):
    ctx, panel, _ = make_panel(qtbot)
    qtbot.mouseClick(panel.dry_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: getattr(panel, "last_dry_run", None) is not None, timeout=30_000)
    text = panel.last_dry_run.text.toPlainText()
    assert "engine_manager.sim" in text and "--api-key-file" in text and ctx.settings.api_key not in text
    assert "--cpunodebind" in text or "taskset" in text
    panel.last_dry_run.findChild(type(panel.start_button), "dryRunCopy").click()
    assert QApplication.clipboard().text() == text
    panel.last_dry_run.close()
    assert not listening(port)


def test_menu_actions_and_shortcuts(qtbot, port):
    ctx, panel, _ = make_panel(qtbot)
    acts = {a.objectName(): a for a in panel.actions_for_menu()}
    assert set(acts) == {"actionStart", "actionStop", "actionForceStop", "actionDryRun", "actionAttach",
                         "actionWatchNext", "actionWatchOwn"}
    assert acts["actionStart"].shortcut().toString() == "Ctrl+R"
    assert acts["actionStop"].shortcut().toString() == "Ctrl+."
    assert acts["actionAttach"].shortcut().toString() == "Ctrl+Shift+A"
    assert acts["actionWatchNext"].shortcut().toString() == "Ctrl+Shift+W"
    assert acts["actionWatchOwn"].shortcut().toString() == "Ctrl+Shift+H"
    assert acts["actionStart"].isEnabled() and not acts["actionStop"].isEnabled()


def test_starting_another_engine_while_one_runs_says_what_runs_and_where(qtbot, port):
    ctx, panel, _ = make_panel(qtbot)
    panel.poll_timer.stop()               # the idle poll would re-attach first; this is the click that beats it
    other = sv.Supervisor(load_settings().settings, hardware=hw())
    for _ in other.run("sim", watch=False):      # `dsv41 start` in a terminal: the scripted engine runs
        pass
    pid = other.status(check_health=False).pid
    assert pid and psutil.pid_exists(pid)
    panel.engine_box.setCurrentIndex(panel.engine_box.findData("llamacpp"))
    qtbot.mouseClick(panel.start_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: panel.banner.isVisible() and "already running" in panel.banner.title.text(),
                    timeout=30_000)
    title = panel.banner.title.text()
    assert "scripted engine (simulated) is already running" in title and f"port {port}" in title
    assert f"pid {pid}" in title and "llama.cpp was not started" in title
    assert "Press Stop above" in panel.banner.fix.text() and "dsv41 stop" in panel.banner.fix.text()
    # the panel then shows the engine that runs (so Stop is at hand), and keeps saying why llama.cpp did not start
    qtbot.waitUntil(lambda: panel.badge.text() == "Ready" and panel.sup.snapshot() is not None
                    and panel.sup.snapshot().pid == pid, timeout=30_000)
    assert panel.banner.isVisible() and "already running" in panel.banner.title.text()
    # the details line is filled from the attached engine's status a moment after the badge turns Ready
    qtbot.waitUntil(lambda: "SIMULATED" in panel.details.text(), timeout=10_000)
    assert panel.start_button.text() == "Stop"
    panel.stop()
    qtbot.waitUntil(lambda: panel.badge.text() == "Stopped" and idle(panel), timeout=30_000)
    assert wait_until(lambda: not alive(pid), timeout=5) and not listening(port)


def test_port_in_use_fix_points_to_the_settings_dialog(qtbot, port, monkeypatch):
    monkeypatch.delenv("DSV41_PORT")
    save_settings(load_settings(), {"port": port})      # the port from the settings file, as a user sets it
    ctx, panel, _ = make_panel(qtbot)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
    try:
        panel.start()
        qtbot.waitUntil(lambda: panel.banner.isVisible() and idle(panel), timeout=30_000)
        assert f"Port {port} is in use by pid {os.getpid()}" in panel.banner.title.text()
        fix = panel.banner.fix.text()
        assert "File ▸ Settings… → Port" in fix and "is free now" in fix
        # the free port comes from the event's own field, the same one the CLI's fix names
        free = int(re.search(r"\((\d+) is free now\)", fix).group(1))
        assert free != port and f"`dsv41 settings set port {free}`" in fix
        assert "From a terminal: `dsv41 settings set port" in fix            # the CLI way still said, second
        assert fix.index("File ▸ Settings") < fix.index("dsv41 settings set port")
    finally:
        s.close()
