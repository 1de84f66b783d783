"""Attach in the window: the panel watches three engines at once — the scripted engine it starts itself,
a llama-server the test starts (foreign to the panel) and a loopback server speaking vLLM's documented metrics and
the OpenAI API — each detected, chosen, monitored (a sample reaches the Monitor) and chatted with; the overview
lists all three; Start/Stop are never offered for the foreign ones and Stop is never sent (they still run after);
keys are never shown in the log view, the engine column or the chat line.

Real processes and servers on loopback, the real window under pytest-xvfb's X server. With ``ATTACH_SHOT``
set to a path, the window watching the three engines is saved there (benchmarks/results/attach_three.png).
"""

from __future__ import annotations

import logging
import os

import httpx
import pytest
from attach_support import FixtureServer
from PySide6.QtCore import Qt
from supervisor_helpers import hw

from engine_manager import connections as C
from engine_manager import uistate
from engine_manager.settings import load_settings

pytestmark = pytest.mark.gui

VLLM_PATHS = {"/health", "/api/health", "/v1/models", "/metrics", "/props", "/v1/chat/completions"}


def watched_sample(qtbot, win, base_url: str, timeout: int = 60_000) -> None:
    """Wait until the Monitor reads the engine at ``base_url`` and a sample of that hub reached the window
    (``ctx.sampleArrived``, re-emitted by the Monitor for every tick it shows)."""
    mon = win.monitor_view
    got: list = []

    def arrived(_sample) -> None:
        if mon.hub is not None and mon.engine_info is not None and mon.engine_info.base_url == base_url:
            got.append(mon.last_tick)
    win.ctx.sampleArrived.connect(arrived)
    try:
        qtbot.waitUntil(lambda: len(got) >= 2, timeout=timeout)    # the second: surely of the new hub
    finally:
        win.ctx.sampleArrived.disconnect(arrived)


def chat(qtbot, pane, text: str, timeout: int = 60_000) -> str:
    """Send ``text`` in a new conversation and wait for the answer to finish; the transcript's text."""
    pane.new_conversation()
    before = pane.document_text()
    assert pane.send(text)
    qtbot.waitUntil(lambda: pane.streaming_count() == 0 and pane.document_text() != before, timeout=timeout)
    return pane.document_text()


@pytest.mark.llamacpp
@pytest.mark.timeout(300)
def test_the_window_watches_three_engines_at_once(qtbot, panel_engine_port, foreign_llama, caplog):
    from app.context import AppContext
    from app.main_window import MainWindow

    caplog.set_level(logging.DEBUG)
    proc, spec = foreign_llama
    vllm = FixtureServer("vllm", "fx-vllm-key-0123456789abcdef")
    try:
        C.add_connection("llama", spec.base_url, spec.api_key)    # saved before the window opens
        ctx = AppContext(load_settings(), hw())
        win = MainWindow(ctx, show_first_run=False)
        win.ask_on_close = False        # a failing test closes the window without a question (the fixture stops)
        qtbot.addWidget(win)
        win.resize(1600, 1000)
        win.show()
        qtbot.waitExposed(win)
        panel = win.engine_panel
        qtbot.waitUntil(lambda: not panel.tasks.running("run"), timeout=10_000)     # the start-up re-attach look
        view = panel.connections
        strip = view.overview
        strip.timer.setInterval(1000)                      # the test's pace; the panel polls every 5 s
        mon, pane = win.monitor_view, win._chat_pane
        assert [view.picker.itemText(i) for i in range(view.picker.count())][0] == "This panel's engine"
        assert view.names() == ["llama"]

        # 1. the panel's own engine: started with its button, watched by default
        qtbot.mouseClick(panel.start_button, Qt.MouseButton.LeftButton)
        qtbot.waitUntil(lambda: ctx.own is not None and panel.badge.text() == "Ready", timeout=30_000)
        own = ctx.own
        assert own.started_by_panel and ctx.running is own and ctx.watching is None
        watched_sample(qtbot, win, own.base_url)
        assert mon.last_tick.simulated
        assert "(simulated engine)" in pane.engine_label.text() or "Engine ready" in pane.engine_label.text()
        n_before = len(pane.document_text())
        assert len(chat(qtbot, pane, "Tell me about NUMA")) > n_before + 20

        # 2. the vLLM fixture, added through the Attach to… dialog: tested, then saved, then watched at once
        dlg = view.add_dialog()
        qtbot.waitExposed(dlg)
        assert dlg.key.echoMode() == dlg.key.EchoMode.Password
        qtbot.keyClicks(dlg.name, "vllm")
        qtbot.keyClicks(dlg.url, vllm.base_url)
        qtbot.keyClicks(dlg.key, "not-the-key")
        qtbot.mouseClick(dlg.test_button, Qt.MouseButton.LeftButton)
        qtbot.waitUntil(lambda: dlg.result.text().startswith("✗"), timeout=20_000)
        assert "refused the API key" in dlg.result.text() and "not-the-key" not in dlg.result.text()
        dlg.key.clear()
        qtbot.keyClicks(dlg.key, vllm.key)
        qtbot.mouseClick(dlg.test_button, Qt.MouseButton.LeftButton)
        qtbot.waitUntil(lambda: dlg.result.text().startswith("✓"), timeout=20_000)
        assert "vLLM" in dlg.result.text() and "found:" in dlg.result.text() and vllm.key not in dlg.result.text()
        qtbot.mouseClick(dlg.save_button, Qt.MouseButton.LeftButton)
        qtbot.waitUntil(lambda: ctx.watching == "vllm" and ctx.running is not None, timeout=20_000)
        assert view.names() == ["llama", "vllm"] and view.picker.currentData() == "vllm"
        assert ctx.running.engine == "vllm" and not ctx.running.started_by_panel
        assert ctx.own is own                               # the own engine keeps running, unwatched
        watched_sample(qtbot, win, vllm.base_url)
        vllm.advance()                                      # the second scrape: rates from the counters
        qtbot.waitUntil(lambda: mon.last_tick.values.get("decode_tok_s") is not None, timeout=20_000)
        # what vLLM cannot give is missing, never 0
        assert mon.last_tick.values["hit_rate"] is None
        assert mon.cards["hit"].value.text().startswith("—"), mon.cards["hit"].value.text()
        assert mon.cards["swaps"].value.text().startswith("—"), mon.cards["swaps"].value.text()
        # no Start/Stop for what the panel did not start; the reason is said
        assert not panel.start_button.isEnabled() and "did not start" in panel.start_button.toolTip()
        assert not panel.stop_action.isEnabled() and not panel.start_action.isEnabled()
        panel.toggle()                                      # (a shortcut or script): refused, nothing is sent
        assert "Attached to vllm" in pane.engine_label.text()
        assert "Attached and answering." in chat(qtbot, pane, "Say hello.")

        # 3. the foreign llama-server, chosen by a click on its line in the overview
        qtbot.waitUntil(lambda: strip.row_text("llama")[1] == "ok", timeout=30_000)
        item = strip._items["llama"]
        rect = strip.visualItemRect(item)
        qtbot.mouseClick(strip.viewport(), Qt.MouseButton.LeftButton, pos=rect.center())
        qtbot.waitUntil(lambda: ctx.watching == "llama" and ctx.running is not None, timeout=20_000)
        assert ctx.running.engine == "llamacpp" and view.picker.currentData() == "llama"
        assert view.info.text().startswith("Watching llama: llama.cpp") and "never started or stopped" in \
            view.info.text()
        watched_sample(qtbot, win, spec.base_url)
        assert not mon.last_tick.simulated and mon.last_tick.values["slots_total"] == 1
        assert not panel.start_button.isEnabled()
        n_before = len(pane.document_text())
        assert len(chat(qtbot, pane, "Hello")) > n_before
        assert uistate.load()["attach_connection"] == "llama"           # survives a restart

        # 4. the overview lists all three, each with its state, users and tok/s
        qtbot.waitUntil(lambda: all(strip.row_text(n)[1].startswith("ok") for n in (None, "llama", "vllm"))
                        and strip.statuses["vllm"].decode_tok_s is not None, timeout=30_000)
        assert strip.row_text(None)[0] == "This panel" and strip.row_text(None)[1] == "ok (sim)"
        assert strip.row_text("vllm")[2] != "—" and strip.row_text("vllm")[3] != "—"
        assert strip.row_text("llama")[2] != "—"
        shot = os.environ.get("ATTACH_SHOT")
        if shot:
            view.select("vllm")
            qtbot.waitUntil(lambda: ctx.watching == "vllm" and ctx.running is not None, timeout=20_000)
            watched_sample(qtbot, win, vllm.base_url)
            assert "Watching vllm: vLLM" in view.info.text()
            said = pane.conv_list.findItems("Say hello.", Qt.MatchFlag.MatchStartsWith)
            if said:
                pane.conv_list.setCurrentItem(said[0])     # the conversation with the watched engine
            qtbot.wait(2500)                               # a few ticks and an overview poll drawn
            assert win.grab().save(shot)

        # 5. back to the panel's own engine: shown again, and its Stop stops only it
        view.select(None)
        qtbot.waitUntil(lambda: ctx.watching is None and ctx.running is own, timeout=10_000)
        watched_sample(qtbot, win, own.base_url)
        assert panel.start_button.isEnabled() and panel.start_button.text() == "Stop"
        qtbot.mouseClick(panel.start_button, Qt.MouseButton.LeftButton)
        qtbot.waitUntil(lambda: ctx.own is None and panel.badge.text() == "Stopped", timeout=30_000)
        # the foreign engines were never stopped: both still run and answer
        assert proc.poll() is None and httpx.get(spec.base_url + "/health", timeout=5).status_code == 200
        assert set(vllm.paths) <= VLLM_PATHS, set(vllm.paths) - VLLM_PATHS

        # keys: never in the log view, the engine column, the chat line or the panel's log records
        log_text = win.pages["Log"].text.toPlainText()
        shown = "\n".join([log_text, panel.details.text(), panel.notes.text(), view.info.text(),
                           pane.engine_label.text(), mon.status.text()])
        for key in (spec.api_key, vllm.key):
            assert key not in shown and key not in caplog.text
        # a new window watches the connection chosen last … of this run: the own engine
        assert uistate.load()["attach_connection"] == ""
        win.close()
    finally:
        vllm.stop()


def test_the_last_watched_connection_is_watched_again_after_a_restart(qtbot, fixture_server):
    """The choice is kept in the UI state; a window opened later watches it again (and an unknown name is
    ignored)."""
    from app.connections_view import ConnectionsView
    from app.context import AppContext

    srv = fixture_server("openai")
    C.add_connection("plain", srv.base_url, srv.key)
    uistate.save({"attach_connection": "plain"})
    ctx = AppContext(load_settings())
    view = ConnectionsView(ctx, period_s=1.0)
    qtbot.addWidget(view)
    view.show()
    qtbot.waitUntil(lambda: ctx.watching == "plain" and ctx.running is not None, timeout=20_000)
    assert ctx.running.engine == "openai_compat" and view.picker.currentData() == "plain"
    # a plain OpenAI server reports no load: its overview line shows the figures missing, never 0
    qtbot.waitUntil(lambda: strip_state(view, "plain") == "ok", timeout=20_000)
    assert view.overview.row_text("plain")[2:] == ["—", "—"]
    # removed: forgotten, and the window goes back to its own engine
    view.ask_remove = lambda name: True
    view.remove_current()
    qtbot.waitUntil(lambda: view.names() == [] and ctx.watching is None, timeout=20_000)
    assert C.load_connections() == []
    uistate.save({"attach_connection": "gone"})
    ctx2 = AppContext(load_settings())
    view2 = ConnectionsView(ctx2, period_s=1.0)
    qtbot.addWidget(view2)
    qtbot.wait(200)
    assert ctx2.watching is None and view2.picker.currentIndex() == 0
    view.shutdown()
    view2.shutdown()


def strip_state(view, name: str) -> str:
    return view.overview.row_text(name)[1]


def test_one_slow_connection_holds_up_no_other_line(qtbot, free_port, monkeypatch):
    """Each line of the overview is polled on its own worker: a connection whose server stalls holds up only its
    own line; one that does not answer is "unreachable", with the reason and when it was last seen, and no
    figures."""
    from hostile_servers import HostileServer

    from app.connections_view import ConnectionsView
    from app.context import AppContext

    monkeypatch.setattr(C, "OVERVIEW_TIMEOUT_S", 120.0)     # the stalled line's poll outlasts the whole test
    slow, fast = HostileServer({"/api/health": "stall"}), HostileServer()
    view = None
    try:
        C.add_connection("slow", slow.base_url, "k-slow")
        C.add_connection("fast", fast.base_url, "k-fast")
        C.add_connection("gone", f"http://127.0.0.1:{free_port}")
        ctx = AppContext(load_settings())
        view = ConnectionsView(ctx, period_s=0.5)
        qtbot.addWidget(view)
        strip = view.overview
        qtbot.waitUntil(lambda: strip.row_text("fast")[1] == "ok" and strip.row_text("gone")[1] == "unreachable",
                        timeout=30_000)
        assert strip.tasks.running("poll:slow") and strip.row_text("slow")[1] == "…"
        tip = strip.row_tooltip("gone")
        assert "cannot be reached" in tip and "Nothing listens" in tip and "Not seen answering" in tip
        assert strip.row_text("gone")[2:] == ["—", "—"]
        # the fast line keeps being polled while the slow one still waits
        n = strip.polls
        qtbot.waitUntil(lambda: strip.polls >= n + 2, timeout=30_000)
        assert strip.tasks.running("poll:slow") and strip.row_text("fast")[1] == "ok"
    finally:
        slow.stop()                 # the stalled answer ends: its worker finishes
        fast.stop()
        if view is not None:
            qtbot.waitUntil(lambda: not view.overview.tasks.running("poll:slow"), timeout=30_000)
            view.shutdown()


def test_a_connections_file_of_the_wrong_shape_does_not_brick_the_view(qtbot, fixture_server):
    """``{"connections": null}`` once left every pane at "Loading…": the file is set aside with a note in the view,
    the picker and the overview work, and a connection added then is watched as usual."""
    from app.connections_view import ConnectionsView
    from app.context import AppContext

    path = C.connections_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"schema": 1, "connections": null}')
    ctx = AppContext(load_settings())
    view = ConnectionsView(ctx, period_s=1.0)
    qtbot.addWidget(view)
    assert view.picker.count() == 1 and view.names() == []
    assert "kept as" in view.info.text() and "connections.json" in view.info.text()
    srv = fixture_server("openai")
    C.add_connection("plain", srv.base_url, srv.key)
    view.refresh()
    view.select("plain")
    qtbot.waitUntil(lambda: ctx.watching == "plain" and ctx.running is not None, timeout=20_000)
    view.shutdown()
