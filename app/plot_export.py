"""Save a plot as PNG or SVG, or copy its figures, from the plot's own context menu (right click).

:func:`add_export` adds three entries to a pyqtgraph ``PlotItem``'s menu — "Save plot as PNG…", "Save plot as
SVG…", "Copy figures" — and is all a plot's owner calls. The PNG comes from pyqtgraph's
``pyqtgraph.exporters.ImageExporter``, the SVG from Qt's ``QSvgGenerator``, both rendered to memory and written
atomically and owner-only, never through a symbolic link (``engine_manager.atomic``). The figures are the plot's
curves (and a map's values) as tab-separated text (curve, x, y), ready to paste into a spreadsheet.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path

import pyqtgraph as pg
import pyqtgraph.exporters as pg_exporters
from PySide6.QtCore import QBuffer, QIODevice, QRectF
from PySide6.QtGui import QAction, QGuiApplication, QPainter
from PySide6.QtSvg import QSvgGenerator
from PySide6.QtWidgets import QFileDialog, QMenu, QMessageBox, QWidget

from engine_manager.atomic import atomic_write_bytes

MAX_ROWS = 200_000          # figures copied at most (a long window at 10 Hz is far below)


def _plot_title(item: pg.PlotItem, fallback: str) -> str:
    text = item.titleLabel.text if getattr(item, "titleLabel", None) is not None else ""
    return re.sub(r"<[^>]+>", "", text or "").strip() or fallback


def png_bytes(item: pg.PlotItem, width: int | None = None) -> bytes:
    """The plot as a PNG (``width`` pixels wide; default: as shown)."""
    exp = pg_exporters.ImageExporter(item)
    if width:
        exp.parameters()["width"] = int(width)
    image = exp.export(toBytes=True)
    buf = QBuffer()
    buf.open(QIODevice.OpenModeFlag.WriteOnly)
    if not image.save(buf, "PNG"):
        raise OSError("the plot could not be rendered as PNG")
    return bytes(buf.data())


def svg_bytes(item: pg.PlotItem) -> bytes:
    """The plot as SVG (vector: sharp at any size, editable), drawn by Qt's own SVG generator from the plot's
    part of the scene. (pyqtgraph's SVGExporter fails on the paths Qt 6.11 writes: ``x,y = c.split(',')`` in
    ``pyqtgraph/exporters/SVGExporter.py`` ``correctCoordinates``, pyqtgraph 0.14.0.)"""
    rect = item.sceneBoundingRect()
    buf = QBuffer()
    buf.open(QIODevice.OpenModeFlag.WriteOnly)
    gen = QSvgGenerator()
    gen.setOutputDevice(buf)
    gen.setSize(rect.size().toSize())
    gen.setViewBox(QRectF(0, 0, rect.width(), rect.height()))
    gen.setTitle(_plot_title(item, "plot"))
    gen.setDescription("dsv41 panel")
    painter = QPainter(gen)
    try:
        item.scene().render(painter, QRectF(0, 0, rect.width(), rect.height()), rect)
    finally:
        painter.end()
    return bytes(buf.data())


def save(item: pg.PlotItem, path: str | Path, kind: str | None = None) -> Path:
    """Write the plot to ``path`` as PNG or SVG (``kind``, else from the suffix; a missing suffix is added)."""
    p = Path(path)
    kind = (kind or p.suffix.lstrip(".") or "png").lower()
    if kind not in ("png", "svg"):
        raise ValueError(f"cannot save a plot as {kind!r}: PNG or SVG")
    if p.suffix.lower() != f".{kind}":
        p = p.with_name(p.name + f".{kind}")
    atomic_write_bytes(p, png_bytes(item) if kind == "png" else svg_bytes(item))
    return p


def _fmt(v: float) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.6g}"


def figures_text(item: pg.PlotItem, name: str = "") -> str:
    """The plot's curves as tab-separated text: a header line, then one line per point (curve, x, y)."""
    title = _plot_title(item, name)
    lines = [f"# {title}" if title else "# plot", "curve\tx\ty"]
    for i, curve in enumerate(item.listDataItems()):
        xs, ys = curve.getOriginalDataset() if hasattr(curve, "getOriginalDataset") else curve.getData()
        if xs is None or ys is None:
            continue
        label = curve.name() or f"curve {i + 1}"
        for x, y in zip(xs, ys):
            if len(lines) > MAX_ROWS:
                break
            lines.append(f"{label}\t{_fmt(x)}\t{_fmt(y)}")
    for img in (i for i in item.items if isinstance(i, pg.ImageItem) and i.image is not None):
        data = img.image                # (x, y) as pyqtgraph draws it: one line per x (column of the picture)
        lines.append(f"# image: {data.shape[0]} × {data.shape[1]} values, one line per x")
        for row in data[: MAX_ROWS]:
            lines.append("\t".join(_fmt(float(v)) for v in row))
    return "\n".join(lines) + "\n"


def add_export(item: pg.PlotItem, name: str = "", parent: QWidget | None = None,
               figures: Callable[[], str] | None = None) -> list[QAction]:
    """Add "Save plot as PNG…", "Save plot as SVG…" and "Copy figures" to ``item``'s context menu. ``name``: the
    plot's name for the file and the header (default: its title); ``figures``: the text to copy instead of the
    curves' points. Returns the actions (tests trigger them)."""
    vb = item.getViewBox()
    if not vb.menuEnabled():           # a plot without pan/zoom options (the placement maps): these entries only
        vb.menu = QMenu()
        vb.setMenuEnabled(True)
    menu = vb.menu
    menu.addSeparator()
    stem = re.sub(r"[^\w.-]+", "_", (name or _plot_title(item, "plot")).strip()).strip("_")[:60] or "plot"

    def ask_and_save(kind: str) -> None:
        start = str(Path.home() / f"{stem}.{kind}")
        path, _ = QFileDialog.getSaveFileName(parent, f"Save plot as {kind.upper()}", start,
                                              f"{kind.upper()} (*.{kind})")
        if path:
            try:
                save(item, path, kind)
            except OSError as exc:
                QMessageBox.warning(parent, "Could not save the plot",
                                    f"Could not write {path}: {exc}. Choose another folder or file name.")

    def copy() -> None:
        QGuiApplication.clipboard().setText(figures() if figures is not None else figures_text(item, name))

    out = []
    for text, slot, obj in (("Save plot as PNG…", lambda: ask_and_save("png"), "plotSavePng"),
                            ("Save plot as SVG…", lambda: ask_and_save("svg"), "plotSaveSvg"),
                            ("Copy figures", copy, "plotCopyFigures")):
        act = QAction(text, menu)
        act.setObjectName(obj)
        act.triggered.connect(slot)
        menu.addAction(act)
        out.append(act)
    item.export_actions = out          # for tests and for the owner's own menus
    return out
