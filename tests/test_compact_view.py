"""The compact view (app.compact_view, lines from engine_manager.metrics.compact): fed by the Monitor's ticks,
a missing figure is "—" and never 0; View ▸ Compact view (Ctrl+Shift+M) opens it on top, its position is
remembered; and Help ▸ Save a diagnostic bundle… writes the bundle `dsv41 diagnose` writes, off the GUI thread."""

from __future__ import annotations

import stat
import zipfile

import pytest

from engine_manager.engines.base import Sample
from engine_manager.metrics.compact import compact_figures, empty_figures
from engine_manager.metrics.hub import Tick
from engine_manager.metrics.presenter import cards


def tick(state="generating", **values) -> Tick:
    return Tick(seq=1, t=1.0, values=dict(values), engine="sim", simulated=True,
                sample=Sample(t=1.0, engine="sim", simulated=True, state=state))


FULL = dict(decode_tok_s=12.34, slots_busy=1, vram_share=0.8123, swaps_per_s=0.5, vram_used_bytes=100 * 2**30,
            vram_total_bytes=140 * 2**30)


def test_the_lines_of_one_tick_are_the_monitor_cards_values():
    t = tick(**FULL)
    assert compact_figures(t, "Ready") == {
        "state": "Ready · generating · simulated", "decode": "12.3 tok/s", "hit": "81.2 %", "swaps": "0.50 /s",
        "vram": "100.0 / 140 GiB"}
    c = cards(t)
    assert [compact_figures(t)[k] for k in ("hit", "swaps", "vram")] == [c[k].value for k in ("hit", "swaps", "vram")]
    # missing is "—", a real zero is a zero
    got = compact_figures(tick(swaps_per_s=0.0), "Ready")
    assert got["swaps"] == "0.00 /s"
    assert got["decode"] == got["hit"] == got["vram"] == "—"
    # every slot idle: no rate, and the share of picks is the last request's, as the card says
    idle = compact_figures(tick("idle", **{**FULL, "slots_busy": 0}), "Ready")
    assert idle["decode"] == "— (idle)" and idle["hit"] == "last request 81.2 %"
    gone = Tick(seq=2, t=2.0, values={}, engine="sim", simulated=True, missing={"engine": "engine did not answer"})
    assert compact_figures(gone, "Ready")["state"] == "Ready · no figures · simulated"
    assert compact_figures(None, "Stopped") == empty_figures("Stopped") == {
        "state": "Stopped", "decode": "—", "hit": "—", "swaps": "—", "vram": "—"}


@pytest.mark.gui
def test_the_view_follows_the_context(app_ctx, shown):
    from PySide6.QtCore import Qt

    from app.compact_view import CompactView
    from engine_manager.supervisor_events import StateChanged

    view = shown(CompactView(app_ctx))
    assert view.windowFlags() & Qt.WindowType.WindowStaysOnTopHint
    assert set(view.texts().values()) == {"—"}
    app_ctx.engineStateChanged.emit(StateChanged("ready", "starting", "ready"))
    view.on_tick(tick(**FULL))
    assert view.texts() == compact_figures(tick(**FULL), "Ready")
    view.on_tick(tick(decode_tok_s=None, slots_busy=1))
    assert view.texts()["decode"] == "—" and "0" not in view.texts()["vram"]
    app_ctx.engineStateChanged.emit(StateChanged("stopped", "ready", "stopped"))
    app_ctx.engineRunning.emit(None)
    assert view.texts() == empty_figures("Stopped")


@pytest.mark.gui
def test_menu_items_compact_view_and_diagnostic_bundle(qtbot, tmp_path):
    from PySide6.QtCore import Qt
    from PySide6.QtGui import QKeySequence

    from app.compact_view import STATE_KEY, CompactView
    from app.context import AppContext
    from app.main_window import MainWindow
    from engine_manager import uistate
    from engine_manager.settings import load_settings

    win = MainWindow(AppContext(load_settings()))
    qtbot.addWidget(win)
    win.show()
    qtbot.waitExposed(win)
    act = win.findChild(type(win.settings_action), "actionCompactView")
    assert act is not None and act.shortcut() == QKeySequence("Ctrl+Shift+M")
    act.trigger()
    view = win.findChild(CompactView)
    qtbot.waitExposed(view)
    assert view.isVisible() and view.windowFlags() & Qt.WindowType.WindowStaysOnTopHint
    win.monitor_view.tickShown.emit(tick(**FULL))              # what the Monitor shows, the view shows
    assert view.texts()["decode"] == "12.3 tok/s" and view.texts()["vram"] == "100.0 / 140 GiB"
    view.move(123, 145)
    qtbot.waitUntil(lambda: uistate.load().get(STATE_KEY, {}).get("x") == view.x(), timeout=5000)
    where = (view.x(), view.y())
    act.trigger()                                              # the same item hides it
    assert not view.isVisible()
    view.deleteLater()
    qtbot.waitUntil(lambda: win.findChild(CompactView) is None, timeout=5000)
    act.trigger()                                              # a new view opens where the last one was
    again = win.findChild(CompactView)
    qtbot.waitExposed(again)
    assert (again.x(), again.y()) == where

    diag = win.findChild(type(act), "actionDiagnose")
    assert diag is not None and diag.text().replace("&", "") == "Save a diagnostic bundle…"
    out = tmp_path / "bundle.zip"
    win.save_diagnostic_bundle(out)
    qtbot.waitUntil(lambda: getattr(win, "bundle_box", None) is not None, timeout=60000)
    assert str(out) in win.bundle_box.text() and stat.S_IMODE(out.stat().st_mode) == 0o600
    with zipfile.ZipFile(out) as z:
        assert {"README.txt", "settings.json"} <= set(z.namelist())
    win.bundle_box.close()
    win.close()
