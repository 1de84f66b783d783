"""Attaching to your own engine on day one, and watching a saved connection that does not answer.

- "Copy API key…" beside the engine's address asks first, puts the key on the clipboard, and takes it off again
  after a while if it is still there (never what was copied since);
- the window says what to do in its own words (the API key field, Copy API key), never `--api-key-file`; the
  CLI keeps its words;
- the Attach dialog on a real 1280×800 screen (an X server of that size, the dialog in a process of its own):
  fields at their height and a usable width, the test's whole message readable (wrapped, scrolled when long), and
  nothing under the buttons;
- a watched connection that does not answer: the Monitor's cards say "unreachable" with the reason and when it was
  last seen — never "engine stopped" — and no figure of the engine watched before is left on them.

Real processes and servers on loopback; the real widgets under pytest-xvfb's X server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QApplication, QMessageBox
from supervisor_helpers import hw

from engine_manager import connections as C
from engine_manager.settings import load_settings

pytestmark = pytest.mark.gui
ROOT = Path(__file__).resolve().parents[1]


def answer_next_question(qtbot, button: QMessageBox.StandardButton, seen: list[str]) -> None:
    """Answer the next modal question with ``button`` (its words go to ``seen``)."""
    def look() -> None:
        box = QApplication.activeModalWidget()
        if not isinstance(box, QMessageBox):
            QTimer.singleShot(50, look)
            return
        seen.append(f"{box.text()}\n{box.informativeText()}")
        box.button(button).click()
    QTimer.singleShot(50, look)


def test_copy_api_key_asks_first_and_takes_the_key_off_the_clipboard_again(qtbot, panel_engine_port):
    from app.context import AppContext
    from app.engine_panel import EnginePanel

    ctx = AppContext(load_settings(), hw())
    panel = EnginePanel(ctx)
    qtbot.addWidget(panel)
    panel.show()
    qtbot.waitUntil(lambda: not panel.tasks.running("run"), timeout=10_000)
    assert not panel.copy_key_button.isVisible()            # no engine: no key to copy
    panel.start()
    qtbot.waitUntil(lambda: ctx.own is not None and panel.badge.text() == "Ready", timeout=30_000)
    qtbot.waitUntil(panel.copy_key_button.isVisible, timeout=5_000)
    key = ctx.own.api_key
    assert key and key not in panel.details.text() and ctx.own.base_url in panel.details.text()
    clip = QGuiApplication.clipboard()
    clip.setText("what the user had")
    # asked first: Cancel copies nothing
    seen: list[str] = []
    answer_next_question(qtbot, QMessageBox.StandardButton.Cancel, seen)
    qtbot.mouseClick(panel.copy_key_button, Qt.MouseButton.LeftButton)
    assert seen and ctx.own.base_url in seen[0] and "clipboard" in seen[0] and key not in seen[0]
    assert clip.text() == "what the user had"
    # Copy: the key is there, marked secret for clipboard managers; it is taken off after key_clear_s
    panel.key_clear_s = 1.0
    answer_next_question(qtbot, QMessageBox.StandardButton.Yes, seen)
    qtbot.mouseClick(panel.copy_key_button, Qt.MouseButton.LeftButton)
    assert clip.text() == key
    assert bytes(clip.mimeData().data("x-kde-passwordManagerHint")) == b"secret"
    qtbot.waitUntil(lambda: clip.text() != key, timeout=20_000)
    assert clip.text() == ""
    # something copied since is never taken off
    answer_next_question(qtbot, QMessageBox.StandardButton.Yes, seen)
    qtbot.mouseClick(panel.copy_key_button, Qt.MouseButton.LeftButton)
    assert clip.text() == key
    clip.setText("copied since")
    qtbot.waitUntil(lambda: not panel._key_timer.isActive(), timeout=20_000)
    assert clip.text() == "copied since"
    panel.stop()
    qtbot.waitUntil(lambda: panel.badge.text() == "Stopped", timeout=30_000)
    assert not panel.copy_key_button.isVisible()
    panel.shutdown()


def test_the_window_says_what_to_do_about_a_missing_key_in_its_own_words(qtbot, fixture_server):
    """The engine asks for a key and none was given: the dialog and the engine column say where to put it (the
    API key field) and where this panel's key is (Copy API key); `dsv41` keeps naming its options."""
    from app.connections_view import AddConnectionDialog, ConnectionsView
    from app.context import AppContext

    srv = fixture_server("vllm")
    det = C.check_unsaved(srv.base_url, None)
    assert det.problem == "auth" and "--api-key-file" in det.message           # the CLI's words
    assert "--api-key-file" not in det.words(gui=True) and "API key field" in det.words(gui=True)

    dlg = AddConnectionDialog()
    qtbot.addWidget(dlg)
    dlg.show()
    dlg.url.setText(srv.base_url)
    qtbot.mouseClick(dlg.test_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: dlg.result.text().startswith("✗"), timeout=20_000)
    text = dlg.result.text()
    assert "asks for an API key" in text and "API key field" in text and "Copy API key" in text
    assert "--api-key" not in text and "dsv41" not in text

    # saved without a key, then watched: the engine column says it in the window's words too
    C.add_connection("nokey", srv.base_url)
    ctx = AppContext(load_settings())
    view = ConnectionsView(ctx, period_s=60.0)
    qtbot.addWidget(view)
    view.select("nokey")
    qtbot.waitUntil(lambda: "asks for an API key" in view.info.text(), timeout=20_000)
    assert "API key field" in view.info.text() and "--api-key" not in view.info.text()
    # the CLI's record of the last test keeps its words; the window's are kept beside them
    lt = C.get_connection("nokey").last_test
    assert "--api-key-file" in lt.message and "API key field" in lt.words(gui=True)
    view.shutdown()


def points(mon, plot: str) -> int:
    """How many points the curves of one Monitor plot draw."""
    return sum(0 if c.getData()[0] is None else len(c.getData()[0]) for c in mon.plots[plot].curves.values())


def test_a_watched_connection_that_does_not_answer_is_unreachable_on_the_monitor(qtbot, free_port):
    """Cards: "—" and "unreachable, last seen <when>" (the reason in the tooltip); the guides card and the status
    line: the whole reason; never "engine stopped", and no figure of the engine watched before."""
    from app.connections_view import ConnectionsView
    from app.context import AppContext
    from app.monitor_view import MonitorView
    from engine_manager import metrics as M
    from engine_manager.metrics.hub import Tick

    ctx = AppContext(load_settings())
    mon = MonitorView(ctx)
    qtbot.addWidget(mon)
    mon.resize(612, 640)
    mon.show()
    # the engine watched before: figures on the cards and in the plots
    now = time.time()
    store = M.RingStore(M.COLUMN_NAMES)
    figures = {"decode_tok_s": 58.1, "slots_busy": 1.0, "slots_total": 1.0, "hit_rate": 0.9}
    for k in range(5):
        store.append(now - 5 + k, figures)
    values = {c: None for c in M.COLUMN_NAMES}
    values.update(figures)
    mon.feed(Tick(seq=1, t=now, values=values, engine="sim", simulated=True), store)
    qtbot.waitUntil(lambda: points(mon, "tok") > 0, timeout=5_000)
    qtbot.waitUntil(lambda: "58.1" in mon.cards["decode"].value.text(), timeout=5_000)

    url = f"http://127.0.0.1:{free_port}"
    C.add_connection("gone", url)
    seen_at = now - 3600
    C.record_test("gone", C.Detection(base_url=url, ok=True, kind="sim", message="answered"), t=seen_at)
    view = ConnectionsView(ctx, period_s=60.0)
    qtbot.addWidget(view)
    view.select("gone")
    qtbot.waitUntil(lambda: mon.cards["decode"].detail.text().startswith("unreachable"), timeout=20_000)
    when = time.strftime("%H:%M:%S", time.localtime(seen_at))
    for key, card in mon.cards.items():
        assert card.value.text() == "—", key
        assert card.detail.text() == f"unreachable, last seen {when}", key
        assert "Nothing listens" in card.toolTip() and when in card.toolTip(), key
    shown = "\n".join([mon.status.text(), mon.compare.hints.text(), mon.compare.badge.text(),
                       *(c.detail.text() + c.value.text() + c.toolTip() for c in mon.cards.values())])
    assert "stopped" not in shown.lower() and "58.1" not in shown
    assert mon.compare.badge.text() == "unreachable" and "gone is unreachable: Nothing listens" in \
        mon.compare.hints.text()
    assert mon.status.text().startswith("gone is unreachable") and when in mon.status.text()
    assert mon.store is None and mon.last_tick is None
    for key in mon.plots:                         # the plots hold nothing of the engine watched before
        assert points(mon, key) == 0, key
    view.shutdown()
    mon.shutdown()


# -- the Attach dialog on a real 1280×800 screen ---------------------------------------------------------------
CHILD = r"""
import json, os, sys
from PySide6.QtWidgets import QApplication
app = QApplication(sys.argv)
from app.connections_view import AddConnectionDialog
from engine_manager.errors import UserError
dlg = AddConnectionDialog()
dlg.show()
dlg.name.setText("my-engine")
dlg.url.setText(os.environ["ATTACH_URL"])
dlg.test()
import time
end = time.monotonic() + 60
while not dlg.result.text().startswith(("✓", "✗")) and time.monotonic() < end:
    app.processEvents()
    time.sleep(0.02)
for _ in range(20):
    app.processEvents()

def measure():
    for _ in range(20):
        app.processEvents()
    def rect(w):
        p = w.mapTo(dlg, w.rect().topLeft())
        return [p.x(), p.y(), w.width(), w.height()]
    fields = {n: rect(w) + [w.sizeHint().height()] for n, w in
              (("name", dlg.name), ("url", dlg.url), ("key", dlg.key), ("ssh", dlg.ssh))}
    lab, area = dlg.result, dlg.result_area
    return {"frame": [dlg.frameGeometry().x(), dlg.frameGeometry().y(), dlg.frameGeometry().width(),
                      dlg.frameGeometry().height()],
            "size": [dlg.width(), dlg.height()],
            "fields": fields, "area": rect(area), "buttons": rect(dlg.buttons), "test": rect(dlg.test_button),
            "label_h": lab.height(), "label_need": lab.heightForWidth(lab.width()),
            "label_w": lab.width(), "viewport_w": area.viewport().width(),
            "scroll_max": area.verticalScrollBar().maximum(), "text": lab.text()}

first = measure()
dlg._refused(UserError("The engine said: " + " ".join(f"reason {i} of a very long message;" for i in range(150))
                       + " THE END"))
second = measure()
print(json.dumps({"avail": [dlg.screen().availableGeometry().width(), dlg.screen().availableGeometry().height()],
                  "first": first, "second": second}))
"""


def test_the_attach_dialog_lays_out_on_a_1280x800_screen(fixture_server):
    from test_dayone_window import SmallScreen

    srv = fixture_server("vllm")
    scr = SmallScreen()
    try:
        env = dict(os.environ, DISPLAY=scr.display, QT_QPA_PLATFORM="xcb", ATTACH_URL=srv.base_url,
                   PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("WAYLAND_DISPLAY", None)
        r = subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=ROOT, capture_output=True, text=True,
                           timeout=180)
    finally:
        scr.close()
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["avail"] == [1280, 800]
    for case in ("first", "second"):
        m = got[case]
        x, y, w, h = m["frame"]
        assert 0 <= x and 0 <= y and x + w <= 1280 and y + h <= 800, (case, m["frame"])
        for name, (_fx, _fy, fw, fh, want_h) in m["fields"].items():
            assert fh >= want_h and fw >= 280, (case, name, m["fields"][name])   # not squashed
        ax, ay, aw, ah = m["area"]
        bx, by, bw, bh = m["buttons"]
        assert ay + ah <= by, (case, m["area"], m["buttons"])                    # the message never under them
        assert ay >= m["test"][1] + m["test"][3]                                 # nor over the Test button
        assert m["label_h"] >= m["label_need"], case                             # laid out whole (wrapped)
        assert m["label_w"] <= m["viewport_w"], case                             # no line runs off the side
    first, second = got["first"], got["second"]
    assert first["text"].startswith("✗") and "API key field" in first["text"] and "--api-key" not in first["text"]
    assert first["area"][3] >= first["label_need"] or first["scroll_max"] > 0
    # the long message: scrolled to its end, never cut off
    assert second["text"].endswith("THE END") and second["scroll_max"] > 0
