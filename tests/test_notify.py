"""Desktop notifications: which events become one (engine_manager.desktop_notices, pure logic: each episode said
once), the ``desktop_notifications`` setting (off by default; `dsv41 settings list` shows it), app.notify's
Notifier on a real AppContext with a recording sender, and the notify-send fallback run as a real program."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from engine_manager.checks import Check
from engine_manager.desktop_notices import NoticeFilter
from engine_manager.engine_state import CRASHED, READY, RESTARTING, STARTING, STOPPED
from engine_manager.engines.base import Sample

ROOT = Path(__file__).resolve().parents[1]


def busy(t: float, tokens: int) -> Sample:
    """A Monitor sample of an engine generating (one slot busy) with ``tokens`` generated so far."""
    s = Sample(t=t, engine="sim", simulated=True, state="generating", slots_busy=1, slots_total=1,
               tokens_generated_total=tokens, requests_total=0, decode_tok_s=None)
    s.extra["panel"] = {"engine_cpu_pct": 100.0, "gpu_util_pct": None}
    return s


def test_a_crash_is_said_once_and_only_when_the_engine_was_running():
    f = NoticeFilter()
    assert f.state(CRASHED, "found dead at start-up") is None          # a crash found at start-up: old news
    assert f.state(STARTING) is None and f.state(READY) is None
    n = f.state(CRASHED, "The engine ran out of memory (killed by SIGKILL)", "oom")
    assert n is not None and n.key == "crashed" and "ran out of memory" in n.body
    assert f.state(CRASHED, "auto-restart was turned off") is None      # the same crash, said again: not news
    assert f.state(RESTARTING) is None
    assert f.state(CRASHED, "again", "engine_stalled").key == "stalled"  # the engine's own watchdog stopped it
    assert f.state(STOPPED) is None


def test_a_stall_is_said_when_it_begins_and_again_only_after_recovery():
    f = NoticeFilter()
    said = [f.sample(busy(float(t), 5)) for t in range(0, 30)]         # 5 tokens, then nothing for 29 s
    stalls = [n for n in said if n is not None]
    assert len(stalls) == 1 and stalls[0].key == "stalled" and "nothing moved" in stalls[0].body
    assert said.index(stalls[0]) == 11                                   # the watchdog's 10-s floor passed
    assert f.sample(busy(30.0, 9)) is None                               # progress: recovered
    later = [f.sample(busy(float(t), 9)) for t in range(31, 60)]
    assert sum(n is not None for n in later) == 1
    # samples the engine did not answer: not a stall
    quiet = NoticeFilter()
    gone = Sample(t=0.0, engine="sim")
    gone.extra["missing"] = "engine did not answer"
    assert all(quiet.sample(gone) is None for _ in range(30))


def test_a_failing_check_is_said_once_until_it_passes_again():
    def check(ok):
        return Check("experts", "Experts held in VRAM", "5,825", "4,000", ok, "Raise the VRAM reserve.")

    f = NoticeFilter()
    assert f.checks([check(True)]) is None
    n = f.checks([check(False)])
    assert n is not None and "planned 5,825, measured 4,000" in n.body and "VRAM reserve" in n.body
    assert f.checks([check(False)]) is None
    assert f.checks([check(True)]) is None and f.checks([check(False)]) is not None
    f.new_own()
    assert f.checks([check(False)]) is not None                          # another engine: news again


def test_the_setting_is_off_by_default_and_listed():
    from engine_manager.settings import Settings

    assert Settings().desktop_notifications is False
    cp = subprocess.run([sys.executable, "-m", "engine_manager", "settings", "list"], capture_output=True, text=True,
                        timeout=60, cwd=str(ROOT))
    assert cp.returncode == 0 and "DSV41_DESKTOP_NOTIFICATIONS" in cp.stdout and "Desktop notifications" in cp.stdout
    from app.settings_dialog import GROUPS                      # and File ▸ Settings… has its check box

    assert "desktop_notifications" in GROUPS["Engine"]


@pytest.mark.gui
@pytest.mark.parametrize("on", [True, False])
def test_a_crash_sends_exactly_one_notification_when_the_setting_is_on(app_ctx, qtbot, on):
    from app.notify import Notifier
    from engine_manager.supervisor_events import StateChanged

    app_ctx.update_settings({"desktop_notifications": on})
    calls: list[tuple[str, str]] = []
    Notifier(app_ctx, send=lambda title, body: calls.append((title, body)), parent=app_ctx)
    app_ctx.engineStateChanged.emit(StateChanged(STARTING, STOPPED, "starting"))
    app_ctx.engineStateChanged.emit(StateChanged(READY, STARTING, "ready"))
    crash = StateChanged(CRASHED, READY, "The engine ran out of memory (killed by SIGKILL)")
    app_ctx.engineStateChanged.emit(crash)
    app_ctx.engineStateChanged.emit(crash)                 # the engine panel may tell the same state twice
    if on:
        assert calls == [("dsv41: the engine crashed", "The engine ran out of memory (killed by SIGKILL) The panel "
                          "says why and what to do.")]
    else:
        assert calls == []


@pytest.mark.gui
def test_stall_and_checks_reach_the_sender_through_the_context(app_ctx, qtbot):
    from app.notify import Notifier
    from engine_manager.checks import CheckReport

    app_ctx.update_settings({"desktop_notifications": True})
    calls: list[str] = []
    Notifier(app_ctx, send=lambda title, body: calls.append(title), parent=app_ctx)
    for t in range(30):
        app_ctx.sampleArrived.emit(busy(float(t), 5))
    bad = CheckReport([Check("vram", "VRAM as planned", "120 GiB", "90 GiB", False, "Stop the other program.")])
    app_ctx.checksReported.emit(bad)
    app_ctx.checksReported.emit(bad)
    assert calls == ["dsv41: the engine seems stalled", "dsv41: not as planned"]


@pytest.mark.gui
def test_without_a_tray_notify_send_gets_an_argument_list(qapp, qtbot, tmp_path, monkeypatch):
    from PySide6.QtWidgets import QSystemTrayIcon

    from app import notify

    if QSystemTrayIcon.isSystemTrayAvailable():
        pytest.skip("this display has a system tray: the tray is used, not notify-send")
    argv_file = tmp_path / "argv"
    exe = tmp_path / "bin" / "notify-send"
    exe.parent.mkdir()
    exe.write_text(f"#!{sys.executable}\nimport json, sys\nopen({str(argv_file)!r}, 'w').write(json.dumps("
                   "sys.argv[1:]))\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{exe.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    send = notify.desktop_sender()
    assert send is not None
    send("dsv41: the engine crashed", "-n looks like an option; it is not; $(rm -rf ~) is text")
    qtbot.waitUntil(argv_file.exists, timeout=10000)
    import json
    qtbot.waitUntil(lambda: argv_file.read_text().endswith("]"), timeout=5000)
    assert json.loads(argv_file.read_text()) == ["--app-name=dsv41 panel", "--", "dsv41: the engine crashed",
                                                 "-n looks like an option; it is not; $(rm -rf ~) is text"]
