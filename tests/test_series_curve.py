"""The Monitor's curves (:class:`app.monitor_plots.SeriesCurve`, drawn by hand in place of pyqtgraph's PlotDataItem)
under a real X server: what reaches the screen is read back from the widget's pixels — the line where readings are,
a gap where they are missing, no trace left where a line was before — and the plot's furniture still works with
them: View All, Copy figures, the PNG export, a right-click menu without pyqtgraph's "Plot Options"."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
import pytest
from PySide6.QtCore import QPointF
from PySide6.QtGui import QColor, QImage

pytestmark = pytest.mark.gui

BLUE = QColor("#1f77b4")        # decode (all slots): the first series of the throughput plot


@pytest.fixture
def tok(qtbot):
    from app.monitor_plots import MonitorPlot, plot_specs

    glw = pg.GraphicsLayoutWidget()
    glw.setBackground("w")
    qtbot.addWidget(glw)
    glw.resize(700, 360)
    spec = next(s for s in plot_specs() if s.key == "tok")
    plot = MonitorPlot(glw.ci, spec, 0, 0)
    glw.show()
    qtbot.waitExposed(glw)
    plot.item.setXRange(0.0, 60.0, padding=0)
    return glw, plot


def decode_only(plot, t: np.ndarray, y: np.ndarray) -> None:
    nan = np.full(t.size, np.nan)
    plot.set_data(t, {c: (y if c == "decode_tok_s" else nan) for c in plot.curves}, fit_y=False)
    plot.item.vb.setYRange(0.0, 20.0, padding=0)


def screen(glw) -> QImage:
    """What the X server shows in the plot's viewport: read back from the screen, not painted again for the
    test (``QWidget.grab`` would repaint everything and hide a part Qt failed to repaint)."""
    vp = glw.viewport()
    top = vp.mapTo(glw.window(), vp.rect().topLeft())
    return glw.screen().grabWindow(glw.window().winId(), top.x(), top.y(), vp.width(), vp.height()).toImage()


def blue_near(glw, plot, img: QImage, t: float, y: float, reach: int = 2) -> bool:
    """Is a pixel of the decode colour within ``reach`` px of the point (t, y)?"""
    p = glw.mapFromScene(plot.item.vb.mapViewToScene(QPointF(t, y)))
    for dx in range(-reach, reach + 1):
        for dy in range(-reach, reach + 1):
            x, yy = p.x() + dx, p.y() + dy
            if 0 <= x < img.width() and 0 <= yy < img.height() and is_blue(img.pixelColor(x, yy)):
                return True
    return False


def shows(qtbot, glw, plot, t: float, y: float) -> QImage:
    """Wait until the screen shows the line at (t, y) (the repaint has reached the X server); the picture then."""
    qtbot.waitUntil(lambda: blue_near(glw, plot, screen(glw), t, y), timeout=10_000)
    return screen(glw)


def is_blue(c: QColor) -> bool:
    """The decode colour, or it under a faint grid line (the y grid is drawn over the curves at 25 %)."""
    return abs(c.red() - BLUE.red()) + abs(c.green() - BLUE.green()) + abs(c.blue() - BLUE.blue()) < 40


def test_the_line_is_drawn_where_readings_are_and_broken_where_they_are_missing(qtbot, tok):
    glw, plot = tok
    t = np.arange(60, dtype=float)
    y = np.full(60, 7.3)
    y[20:40] = np.nan                                     # twenty missing readings
    decode_only(plot, t, y)
    shows(qtbot, glw, plot, 10.0, 7.3)
    img = shows(qtbot, glw, plot, 50.0, 7.3)              # both ends drawn, in one paint
    assert not blue_near(glw, plot, img, 30.0, 7.3)       # a gap, not a line across it
    xs, ys = plot.curves["decode_tok_s"].getData()
    assert xs.size == 60 and np.isnan(ys[25]) and ys[10] == 7.3


def test_a_line_that_moves_leaves_nothing_behind(qtbot, tok):
    """The curve's bounding box follows its data: Qt repaints where the old line was, so no trace of it stays."""
    glw, plot = tok
    t = np.arange(60, dtype=float)
    decode_only(plot, t, np.full(60, 5.3))
    shows(qtbot, glw, plot, 30.0, 5.3)
    curve = plot.curves["decode_tok_s"]                   # the curve alone: nothing else asks for a repaint
    curve.setData(t, np.full(60, 14.7))
    img = shows(qtbot, glw, plot, 30.0, 14.7)             # the paint that drew the new line ...
    assert not blue_near(glw, plot, img, 30.0, 5.3)       # ... also cleared the old one
    curve.setData(t, np.full(60, np.nan))                 # nothing to draw: the line goes
    qtbot.waitUntil(lambda: not blue_near(glw, plot, screen(glw), 30.0, 14.7), timeout=10_000)
    assert plot.curves["decode_tok_s"].boundingRect().isEmpty()


def test_view_all_copy_figures_and_the_png_see_the_curves(qtbot, tok):
    from PySide6.QtWidgets import QApplication

    from app import plot_export

    glw, plot = tok
    t = np.arange(100.0, 130.0)
    decode_only(plot, t, np.linspace(40.0, 70.0, 30))
    plot.item.vb.autoRange(padding=0)                     # "View All" in the plot's menu: from the curves' bounds
    (x0, x1), (y0, y1) = plot.item.vb.viewRange()
    assert x0 <= 100.0 < 129.0 <= x1 and y0 <= 40.0 < 70.0 <= y1 and x0 > 50.0
    copy = next(a for a in plot.item.export_actions if a.text() == "Copy figures")
    copy.trigger()
    lines = QApplication.clipboard().text().splitlines()
    assert lines[1] == "curve\tx\ty" and "decode (all slots)\t100\t40" in lines
    assert "decode (all slots)\t129\t70" in lines
    png = QImage.fromData(plot_export.png_bytes(plot.item))
    assert not png.isNull()
    blues = sum(is_blue(png.pixelColor(x, y))
                for x in range(0, png.width(), 2) for y in range(png.height()))
    assert blues > 20                                     # the line is in the picture, not only the axes


def test_the_right_click_menu_has_the_view_and_export_entries_not_plot_options(qtbot, tok):
    _, plot = tok
    texts = [a.text() for a in plot.item.getViewBox().menu.actions()]
    assert {"View All", "Save plot as PNG…", "Save plot as SVG…", "Copy figures"} <= set(texts), texts
    assert plot.item.getContextMenus(None) is None        # pyqtgraph's transforms act on PlotDataItems only
    assert all(c.implements("plotData") for c in plot.curves.values())


def test_pyqtgraphs_own_csv_export_writes_the_curves(qtbot, tok, tmp_path):
    """The plot's menu also has pyqtgraph's Export… dialog; its CSV exporter reads the curves as data items."""
    import csv

    from pyqtgraph.exporters import CSVExporter

    _, plot = tok
    t = np.arange(10.0, 15.0)
    decode_only(plot, t, np.array([1.0, 2.0, np.nan, 4.0, 5.0]))
    out = tmp_path / "tok.csv"
    CSVExporter(plot.item).export(str(out))
    rows = list(csv.reader(out.open()))
    assert rows[0][:2] == ["decode (all slots)_x", "decode (all slots)_y"]
    assert [r[:2] for r in rows[1:6]] == [["10.", "1."], ["11.", "2."], ["12.", "nan"], ["13.", "4."], ["14.", "5."]]


def test_lone_readings_are_dots_and_a_tick_that_adds_none_leaves_them_alone(qtbot, tok):
    """A reading with no neighbour is drawn as a dot; a tick whose lone readings are the ones already drawn does
    not set the dots again (~0.3 ms each time, once a tick for a curve with any dot in view)."""
    _, plot = tok
    dots = plot.dots["decode_tok_s"]
    calls = []
    set_dots = dots.setData

    def counted(*a, **k):
        calls.append(1)
        return set_dots(*a, **k)

    dots.setData = counted
    t = np.arange(31, dtype=float)
    y = np.full(31, np.nan)
    y[10] = 5.0                                            # lone
    y[20:31] = 7.0                                         # a line
    decode_only(plot, t, y)
    assert list(dots.data["x"]) == [10.0] and dots.isVisible() and len(calls) == 1
    t, y = np.arange(32, dtype=float), np.append(y, 7.0)   # the line grows; no new lone reading
    decode_only(plot, t, y)
    assert len(calls) == 1 and list(dots.data["x"]) == [10.0] and dots.isVisible()
    t, y = np.arange(34, dtype=float), np.append(y, [np.nan, 9.0])   # a gap, then a lone reading at 33
    decode_only(plot, t, y)
    assert len(calls) == 2 and list(dots.data["x"]) == [10.0, 33.0]
    t, y = np.arange(35, dtype=float), np.append(y, 9.0)   # its neighbour arrives: a line, no longer a dot
    decode_only(plot, t, y)
    assert len(calls) == 3 and list(dots.data["x"]) == [10.0]
