"""Day-one window furniture under a real X server (pytest-xvfb): "Save plot as PNG/SVG" and "Copy figures" on the
plots, times on the engine's log lines, a dark theme that follows the desktop or the View menu's choice."""

from __future__ import annotations

import os
import stat
import time

import pyqtgraph as pg
import pytest

pytestmark = pytest.mark.gui


def _plot(qtbot):
    w = pg.PlotWidget(title="Decode tok/s")
    qtbot.addWidget(w)
    item = w.getPlotItem()
    item.plot([1.0, 2.0, 3.0], [10.0, 20.5, 30.0], name="total")
    item.plot([1.0, 2.0], [5.0, 6.0], name="slot 1")
    w.resize(500, 300)
    w.show()
    qtbot.waitExposed(w)
    return w, item


def test_a_plot_saves_as_png_and_svg_owner_only_and_never_through_a_link(qtbot, tmp_path):
    from app import plot_export

    _, item = _plot(qtbot)
    actions = plot_export.add_export(item, "decode")
    assert [a.text() for a in actions] == ["Save plot as PNG…", "Save plot as SVG…", "Copy figures"]
    assert all(a in item.getViewBox().menu.actions() for a in actions)        # in the plot's right-click menu
    png = plot_export.save(item, tmp_path / "decode.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert stat.S_IMODE(os.stat(png).st_mode) == 0o600
    svg = plot_export.save(item, tmp_path / "decode", "svg")              # the suffix is added
    assert svg.name == "decode.svg" and b"<svg" in svg.read_bytes()[:2000]
    target = tmp_path / "elsewhere.txt"
    target.write_text("keep me")
    (tmp_path / "link.png").symlink_to(target)
    plot_export.save(item, tmp_path / "link.png")
    assert target.read_text() == "keep me" and not (tmp_path / "link.png").is_symlink()


def test_copy_figures_puts_the_curves_on_the_clipboard(qtbot):
    from PySide6.QtWidgets import QApplication

    from app import plot_export

    _, item = _plot(qtbot)
    copy = plot_export.add_export(item, "decode")[2]
    copy.trigger()
    text = QApplication.clipboard().text().splitlines()
    assert text[0] == "# Decode tok/s" and text[1] == "curve\tx\ty"
    assert "total\t2\t20.5" in text and "slot 1\t2\t6" in text and len(text) == 2 + 5


def test_every_plot_of_the_window_has_the_export_entries(qtbot):
    from app.context import AppContext
    from app.main_window import MainWindow
    from engine_manager.settings import load_settings

    win = MainWindow(AppContext(load_settings()), show_first_run=False)
    win.ask_on_close = False
    qtbot.addWidget(win)
    items = [it for it in win.findChildren(pg.PlotWidget)]
    items = [w.getPlotItem() for w in items]
    for gl in win.findChildren(pg.GraphicsLayoutWidget):
        items += [i for i in gl.ci.items if isinstance(i, pg.PlotItem)]
    assert len(items) >= 8                           # the Monitor's plots, the placement maps, the bench plots
    for it in items:
        texts = [a.text() for a in it.getViewBox().menu.actions()]
        assert {"Save plot as PNG…", "Save plot as SVG…", "Copy figures"} <= set(texts), texts
        assert it.getViewBox().menuEnabled()


def test_engine_log_lines_carry_the_time_they_arrived(qtbot):
    from app.context import AppContext
    from app.log_view import LogView, stamp
    from engine_manager.settings import load_settings
    from engine_manager.logtail import log_path

    path = log_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("[dsv41 keeper 2026-01-01 10:00:00] engine started\nold line\n")
    view = LogView(AppContext(load_settings()))
    qtbot.addWidget(view)
    qtbot.waitUntil(lambda: view.line_count() >= 2, timeout=10_000)
    before = time.time()
    view.append_lines(["phase: loading experts", "READY"])
    after = time.time()
    lines = view.text.toPlainText().splitlines()
    assert lines[:2] == ["[dsv41 keeper 2026-01-01 10:00:00] engine started", "old line"]   # from the file
    assert lines[2] in (stamp(before) + "phase: loading experts", stamp(after) + "phase: loading experts")
    assert lines[3].endswith("  READY") and lines[3][:8].count(":") == 2
    view.times.setChecked(False)                     # Times off: the lines as the engine wrote them
    assert view.text.toPlainText().splitlines()[2:] == ["phase: loading experts", "READY"]
    view.times.setChecked(True)
    assert view.text.toPlainText().splitlines()[3] == lines[3]


def test_the_theme_follows_the_desktop_or_the_view_menu_and_is_remembered(qtbot, qapp):
    from app import theme
    from app.context import AppContext
    from app.main_window import MainWindow
    from engine_manager import uistate
    from engine_manager.settings import load_settings

    def dark() -> bool:
        return qapp.palette().window().color().lightness() < 128

    win = MainWindow(AppContext(load_settings()), show_first_run=False)
    win.ask_on_close = False
    qtbot.addWidget(win)
    try:
        assert win.theme_actions["auto"].isChecked()              # follow the desktop, by default
        assert dark() == theme.desktop_is_dark()
        win.theme_actions["dark"].trigger()
        assert dark() and uistate.load()["theme"] == "dark"
        win2 = MainWindow(AppContext(load_settings()), show_first_run=False)      # the next start: still dark
        win2.ask_on_close = False
        qtbot.addWidget(win2)
        assert win2.theme_actions["dark"].isChecked() and dark()
        win2.theme_actions["light"].trigger()
        assert not dark() and uistate.load()["theme"] == "light"
    finally:
        theme.apply("auto")
