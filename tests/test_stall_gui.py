"""The engine panel's stalled line (engine_manager.liveness_line, app.engine_panel.EnginePanel.show_liveness) against
the real scripted engine started by the panel: a request stops moving while the engine lives (the sim's
``--stall-after-tokens`` fault), the window's one watchdog (app.notify.Notifier's, fed the Monitor hub's samples
through ``ctx.sampleArrived``) says "stalled", the panel shows it with Restart, and Restart brings a ready engine.
With ``PANEL_SCREENSHOTS=<folder>`` the stalled panel is saved there as ``stalled.png``."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import httpx
from PySide6.QtCore import Qt, QTimer
from supervisor_helpers import hw

from app.context import AppContext
from app.engine_panel import EnginePanel
from app.notify import Notifier
from engine_manager.liveness_line import StallEpisode
from engine_manager.metrics import build_hub
from engine_manager.settings import load_settings
from engine_manager.watchdog import Liveness, Watchdog


def ask(base_url: str, api_key: str) -> None:
    try:
        httpx.post(base_url + "/v1/chat/completions", headers={"Authorization": f"Bearer {api_key}"},
                   json={"messages": [{"role": "user", "content": "How does expert offload work?"}],
                         "max_tokens": 300, "stream": False}, timeout=120, trust_env=False)
    except httpx.HTTPError:
        pass                     # the engine is restarted (or stopped at the end) mid-answer


def test_a_stalled_engine_shows_the_line_and_restart_brings_it_back(qtbot, panel_engine_port, monkeypatch):
    monkeypatch.setenv("DSV41_SIM_ARGS", "--load-time 0.3 --stall-after-tokens 20 --stall-s 300")
    ctx = AppContext(load_settings(), hw())
    panel = EnginePanel(ctx)
    qtbot.addWidget(panel)
    panel.sup.grace_s = 5.0
    notifier = Notifier(ctx, send=lambda _title, _body: None, parent=panel)
    notifier.filter.watchdog = Watchdog(stall_after_s=2.0)     # the window's one watchdog; a short limit for a test
    panel.resize(420, 780)
    panel.show()
    qtbot.waitUntil(lambda: not panel.tasks.running("run"), timeout=10_000)     # the start-up re-attach look
    panel.auto_restart.setChecked(False)              # "Restart after a crash" off: the user restarts
    with qtbot.waitSignal(ctx.ownEngineChanged, timeout=30_000, check_params_cb=lambda r: r is not None):
        panel.start()
    first = ctx.running
    hubs = [build_hub(first, hz=4, record=False, use_nvml=False)]
    timer = QTimer()
    timer.setInterval(250)                  # what the Monitor does: every tick re-emitted as ctx.sampleArrived
    timer.timeout.connect(lambda: ctx.sampleArrived.emit(hubs[-1].tick_once().to_sample()))
    timer.start()
    try:
        threading.Thread(target=ask, args=(first.base_url, first.api_key), daemon=True).start()
        qtbot.waitUntil(lambda: panel.liveness_box.isVisible(), timeout=60_000)
        text = panel.liveness_label.text()
        assert text.startswith("Engine stalled: a request is in flight and nothing moved for "), text
        assert "the limit is 2 s" in text and "engine CPU time +" in text
        assert panel.liveness_restart.isVisible() and notifier.filter.watchdog.last.state == "stalled"
        assert panel.badge.text() == "Ready"            # alive all along: not a crash
        shots = os.environ.get("PANEL_SCREENSHOTS")
        if shots:
            assert panel.window().grab().save(str(Path(shots) / "stalled.png"))
        pid = panel.sup.snapshot().pid
        with qtbot.waitSignal(ctx.ownEngineChanged, timeout=60_000, check_params_cb=lambda r: r is not None):
            qtbot.mouseClick(panel.liveness_restart, Qt.MouseButton.LeftButton)
        qtbot.waitUntil(lambda: panel.badge.text() == "Ready", timeout=10_000)
        assert panel.sup.snapshot().pid != pid and not panel.liveness_box.isVisible()
        hubs[-1].stop()
        hubs.append(build_hub(ctx.running, hz=4, record=False, use_nvml=False))
        qtbot.waitUntil(lambda: notifier.filter.watchdog.last is not None
                        and notifier.filter.watchdog.last.state == "idle", timeout=20_000)
        assert not panel.liveness_box.isVisible()
        # "Restart after a crash" on: the next stall restarts the engine by itself, and the panel says so
        panel.auto_restart.setChecked(True)
        second = ctx.running
        pid = panel.sup.snapshot().pid
        threading.Thread(target=ask, args=(second.base_url, second.api_key), daemon=True).start()
        qtbot.waitUntil(lambda: "the panel restarts it now" in panel.liveness_label.text(), timeout=60_000)
        assert not panel.liveness_restart.isVisible()
        qtbot.waitUntil(lambda: ctx.running is not None and ctx.running is not second
                        and panel.badge.text() == "Ready", timeout=60_000)
        assert panel.sup.snapshot().pid != pid and not panel.liveness_box.isVisible()
        assert "Restarted automatically after a stall: a request is in flight" in panel.notes.text()
    finally:
        timer.stop()
        for hub in hubs:
            hub.stop()


def _live(state: str, detail: str = "") -> Liveness:
    return Liveness(state, stall_after_s=10.0, detail=detail)


def test_a_stall_restarts_by_itself_once_per_episode_and_only_the_panels_own_engine():
    ep = StallEpisode()
    stalled = _live("stalled", "a request is in flight and nothing moved for 12 s")
    line = ep.judge(stalled, own=True, auto_restart=True)
    assert line is not None and line.restart_now and not line.offer_restart and "restarts it now" in line.text
    again = ep.judge(stalled, own=True, auto_restart=True)                  # the same episode: once only
    assert again is not None and not again.restart_now and again.offer_restart
    assert ep.judge(_live("not answering"), own=True, auto_restart=True) is None      # the episode goes on
    assert not ep.judge(stalled, own=True, auto_restart=True).restart_now
    assert ep.judge(_live("ok"), own=True, auto_restart=True) is None                 # progress: it ends
    assert ep.judge(stalled, own=True, auto_restart=True).restart_now
    attached = StallEpisode().judge(stalled, own=False, auto_restart=True)           # an engine it did not start
    assert attached is not None and not attached.restart_now and not attached.offer_restart
    assert attached.text == "Engine stalled: a request is in flight and nothing moved for 12 s"
    off = StallEpisode().judge(stalled, own=True, auto_restart=False)
    assert off is not None and off.offer_restart and not off.restart_now and not off.severe
    bad = StallEpisode().judge(_live("unavailable", "its last 3 requests all ended in an error"), own=True,
                               auto_restart=True)
    assert bad is not None and bad.severe and bad.offer_restart and not bad.restart_now
    assert bad.text.startswith("Engine unavailable: ")
