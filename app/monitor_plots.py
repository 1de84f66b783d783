"""The Monitor's plots: what each plot shows (:class:`PlotSpec`), and :class:`MonitorPlot`, a pyqtgraph PlotItem
with its curves created once and fed with ``setData`` (the visible range only, reduced by the store to min/max per
two pixels), sticky "nice" y ranges, a legend in the title row and a hover read-out.

Missing values are gaps in the curves, never zero; a lone reading is drawn as a dot.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QFont, QFontMetricsF, QPainterPath
from PySide6.QtWidgets import QGraphicsItem

from engine_manager import metrics as M
from engine_manager.fmt import GIB, nice_ceil
from engine_manager.metrics.presenter import fmt_value

DASH = Qt.PenStyle.DashLine
REF_COLOR = "#e6550d"            # the planner's prediction: the line and its legend entry
SLOT_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")

# -- what the plots show --------------------------------------------------------------------------------------
@dataclass
class Series:
    column: str
    name: str
    color: str
    scale: float = 1.0              # value × scale is drawn (bytes → GiB, 0..1 → %)
    style: Qt.PenStyle = Qt.PenStyle.SolidLine
    width: float = 1.0             # wider pens cost ~100× more to stroke in Qt's raster engine (measured:
    # a 1,100-point jagged path, 3 ms at width 1 vs 190–270 ms at 1.6–2.4): keep 1, tell curves apart by colour
    right: bool = False             # on the plot's right axis
    fmt: str = "{:.1f}"
    unit: str = ""


@dataclass
class PlotSpec:
    key: str
    title: str
    unit: str
    series: list[Series]
    right_unit: str | None = None
    y_min: float | None = 0.0
    y_max: float | None = None


def plot_specs() -> list[PlotSpec]:
    pct = dict(scale=100.0, fmt="{:.1f}", unit="%")
    gib = dict(scale=1 / GIB, fmt="{:.1f}", unit="GiB")
    return [
        PlotSpec("tok", "Throughput", "tok/s", [
            Series("decode_tok_s", "decode (all slots)", "#1f77b4", unit="tok/s"),
            # only while a prompt is read (a gap between prompts, where the card shows the last request's); Strata
            # and the sim report prefill for all slots together, none per slot: no per-slot prefill is drawn
            # on its own (right) axis: prompts read at hundreds of tok/s squashed a decode of ~50 to the bottom
            Series("prefill_live_tok_s", "prefill, live (all slots; no per-slot figure)", "#ff7f0e", right=True,
                   unit="tok/s"),
        ], right_unit="prefill tok/s"),
        PlotSpec("slots", "Decode per slot", "tok/s", [
            Series(M.SLOT_COLUMNS[i], f"slot {i}", SLOT_COLORS[i], unit="tok/s")
            for i in range(M.MAX_SLOTS)
        ]),
        # the observed VRAM share of routed picks is what the planner predicts (its line); the engine's own hit
        # rate (its lookups leave out the experts read over PCIe) and the PCIe share are drawn under their names
        PlotSpec("hit", "Expert picks served from VRAM", "%", [
            Series("vram_share", "in VRAM (observed)", "#9ecae1", **pct),
            Series("hit_rate_rolling", "in VRAM, last minute", "#08519c", **pct),
            Series("hit_rate", "engine's hit rate (PCIe excluded)", "#31a354", style=DASH, **pct),
            Series("pcie_share", "read over PCIe", "#756bb1", **pct),
        ], y_max=100.0),
        PlotSpec("swaps", "PCIe expert swaps", "swaps/s", [
            Series("swaps_per_s", "swaps/s", "#d62728", fmt="{:.2f}", unit="/s"),
            Series("swap_mb_s", "swap MB/s", "#ff9896", right=True, fmt="{:.0f}", unit="MB/s"),
            Series("pcie_rx_mb_s", "PCIe host→GPU MB/s", "#7f7f7f", style=DASH, right=True,
                   fmt="{:.0f}", unit="MB/s"),
        ], right_unit="MB/s"),
        PlotSpec("mem", "VRAM and RAM", "GiB", [
            Series("vram_used_bytes", "VRAM used", "#2ca02c", **gib),
            Series("vram_total_bytes", "VRAM total", "#2ca02c", style=DASH, **gib),
            Series("ram_used_bytes", "RAM used (host)", "#9467bd", **gib),
            Series("ram_total_bytes", "RAM total (host)", "#9467bd", style=DASH, **gib),
            Series("engine_ram_used_bytes", "RAM, engine-reported", "#bcbd22", **gib),
            Series("engine_rss_bytes", "engine RSS", "#8c564b", **gib),
        ]),
        PlotSpec("util", "CPU and GPU", "%", [
            Series("cpu_bound_pct", "CPU bound cores", "#d62728", unit="%"),
            Series("cpu_rest_pct", "CPU other cores", "#ff9896", unit="%"),
            Series("cpu_total_pct", "CPU all cores", "#7f7f7f", style=DASH, unit="%"),
            Series("gpu_util_pct", "GPU util", "#2ca02c", unit="%"),
        ], y_max=100.0),
    ]


def nice_range(lo: float, hi: float, floor: float | None, cap: float | None) -> tuple[float, float]:
    """A readable y range holding [lo, hi]: from ``floor`` (0 for rates) when given, else a little below the
    data; up to a nice number above it (capped, e.g. 100 for percentages)."""
    if floor is not None and lo >= floor:
        bottom = floor
        span = hi - bottom
        top = bottom + nice_ceil(span * 1.1 if span > 0 else 1.0)
    else:
        span = max(hi - lo, abs(hi) * 0.05, 1e-9)
        step = nice_ceil(span / 4)
        bottom = math.floor((lo - 0.1 * span) / step) * step
        top = math.ceil((hi + 0.1 * span) / step) * step
    if cap is not None and top > cap and hi <= cap:
        top = cap * 1.02
    return float(bottom), float(top)


def isolated(y: np.ndarray) -> np.ndarray:
    """Finite values whose neighbours are both missing (or absent): a line joining finite neighbours cannot draw
    them, so they are drawn as dots."""
    f = np.isfinite(y)
    prev = np.zeros_like(f)
    nxt = np.zeros_like(f)
    prev[1:] = f[:-1]
    nxt[:-1] = f[1:]
    return f & ~prev & ~nxt



class SeriesCurve(pg.GraphicsObject):
    """One series of a Monitor plot: a polyline through the finite points (a missing value breaks it), with the
    path and the bounding box made once per ``setData`` and only drawn on a paint.

    Written by hand in place of ``pg.PlotDataItem``: that item's per-curve Python — ``setData`` 175 µs a curve, 19
    curves a second, and ``PlotCurveItem.boundingRect`` worked out again from the data and the pixel size after
    every change (pixelVectors, dataBounds) — was ~40 % of the whole window's CPU at 1 Hz, the largest part left
    (``benchmarks/panel_cpu.py --off plots``, ``benchmarks/results/panel_cpu.md``). What it adds over this
    (log/FFT transforms, decimation, averaging: the "Plot Options" menu) is off on the Monitor's plots, whose y
    ranges the view sets; the path itself is pyqtgraph's (``arrayToQPath``). It implements what a PlotItem and a
    ViewBox ask of a data item: ``name``, ``getData``, ``dataBounds``, ``implements('plotData')``."""

    def __init__(self, pen, name: str = ""):
        super().__init__()
        self._pen = pen
        self._name = name
        self._x: np.ndarray = np.empty(0)
        self._y: np.ndarray = np.empty(0)
        self._path = QPainterPath()
        self._bounds: tuple[float, float, float, float] | None = None    # x0, x1, y0, y1 of the finite points
        self._rect: QRectF | None = None

    def implements(self, interface=None):        # pyqtgraph's interface check (PlotItem.addItem, ViewBox)
        ints = ["plotData"]
        return ints if interface is None else interface in ints

    def name(self) -> str:
        return self._name

    def getData(self) -> tuple[np.ndarray, np.ndarray]:  # noqa: N802 - pyqtgraph naming
        return self._x, self._y

    def setData(self, x, y) -> None:  # noqa: N802 - pyqtgraph naming
        x = np.asarray(x, dtype=np.float64)
        y = np.asarray(y, dtype=np.float64)
        if x.shape != y.shape or x.ndim != 1:
            raise ValueError(f"x and y differ: {x.shape} and {y.shape}")
        self.prepareGeometryChange()
        self._x, self._y = x, y
        finite = np.isfinite(x) & np.isfinite(y)
        if finite.any():
            fx, fy = x[finite], y[finite]
            self._bounds = (float(fx.min()), float(fx.max()), float(fy.min()), float(fy.max()))
            self._path = pg.arrayToQPath(x, y, connect="finite")
        else:
            self._bounds = None
            self._path = QPainterPath()
        self._rect = None
        self.informViewBoundsChanged()
        self.update()

    def dataBounds(self, ax: int, frac: float = 1.0, orthoRange=None):  # noqa: N802 - pyqtgraph naming
        if self._bounds is None:
            return None, None
        return (self._bounds[0], self._bounds[1]) if ax == 0 else (self._bounds[2], self._bounds[3])

    def boundingRect(self) -> QRectF:  # noqa: N802 - Qt naming
        if self._rect is None:
            if self._bounds is None:
                self._rect = QRectF()
            else:
                x0, x1, y0, y1 = self._bounds
                # half the pen's width beyond the points, in data units: what Qt repaints when the curve moves
                px = py = 0.0
                scene = self.scene()
                views = scene.views() if scene is not None else []
                if views:
                    t = self.deviceTransform(views[0].viewportTransform())
                    if t.m11() and t.m22():
                        pad = max(1.0, self._pen.widthF()) * 0.7072 + 1.0
                        px, py = pad / abs(t.m11()), pad / abs(t.m22())
                self._rect = QRectF(x0 - px, y0 - py, (x1 - x0) + 2 * px, (y1 - y0) + 2 * py)
        return self._rect

    def viewTransformChanged(self) -> None:  # noqa: N802 - pyqtgraph naming: the pixel padding changes
        super().viewTransformChanged()
        self.prepareGeometryChange()
        self._rect = None

    def paint(self, p, *args) -> None:
        if self._bounds is None:
            return
        p.setRenderHint(p.RenderHint.Antialiasing, False)
        p.setPen(self._pen)
        p.drawPath(self._path)


class _TitleItem(pg.LabelItem):
    """A plot's title row. Unlike a plain LabelItem it does not pin its minimum width to its text's (that kept
    the plots from narrowing with the window, so they ran off its edge): the text is wrapped to the width by
    :meth:`MonitorPlot.relayout_title` instead; its height follows the lines."""

    def updateMin(self) -> None:  # noqa: N802 - pyqtgraph naming
        h = self.itemRect().height()
        self.setMinimumWidth(40)
        self.setMinimumHeight(h)
        self._sizeHint = {Qt.SizeHint.MinimumSize: (40, h), Qt.SizeHint.PreferredSize: (40, h),
                          Qt.SizeHint.MaximumSize: (-1, -1), Qt.SizeHint.MinimumDescent: (0, 0)}
        self.updateGeometry()


class ClockAxis(pg.DateAxisItem):
    """A plot's time axis (clock times). The plots of one view share their time range, so the axes of one width
    draw the same picture: the first of them to paint after a step of the time axis draws it, the others replay
    it. Each axis drew its own before, ~1.3 ms of tick and text layout per axis, six per step (py-spy of
    benchmarks/gui_load.py part 2: the time axes' tick layout was ~11 % of the GUI thread's work at 1 Hz).
    ``shared`` belongs to one view; every axis in it is configured alike (:class:`MonitorPlot`)."""

    KEEP = 4                 # pictures kept: the view's axes come in one or two widths, for this step and the last

    def __init__(self, shared: dict):
        super().__init__(orientation="bottom")
        self._shared = shared

    def share_key(self, p) -> tuple:
        """What the picture depends on beyond the configuration the axes share: the range, the size, the scale
        the painter draws at and the room kept for the text. (The painter's transform: calling the item's own
        ``deviceTransform()`` here crashed the process, PySide6 6.11.)"""
        b = self.mapRectFromParent(self.geometry())
        t = p.worldTransform()
        return (tuple(self.range), b.width(), b.height(), (t.m11(), t.m12(), t.m21(), t.m22()), self.textHeight)

    def paint(self, p, opt, widget) -> None:
        if self.picture is None:
            key = self.share_key(p)
            got = self._shared.get(key)
            if got is None:
                super().paint(p, opt, widget)            # draws self.picture and plays it
                self._shared[key] = (self.picture, self.textHeight)
                while len(self._shared) > self.KEEP:
                    del self._shared[next(iter(self._shared))]
                return
            picture, text_height = got
            if text_height != self.textHeight:         # the room for the text, as the first axis settled it
                self.textHeight = text_height
                self._updateHeight()
            self.picture = picture
        self.picture.play(p)


class MonitorPlot:
    """A PlotItem with its curves (created once), an optional right axis, a legend and a hover read-out."""

    def __init__(self, layout: pg.GraphicsLayout, spec: PlotSpec, row: int, col: int,
                 clock_pictures: dict | None = None):
        self.spec = spec
        axis = ClockAxis({} if clock_pictures is None else clock_pictures)
        self.item: pg.PlotItem = layout.addPlot(row=row, col=col, axisItems={"bottom": axis})
        it = self.item
        # the title row holds the title and the legend (see relayout_title), in place of the plot's own title
        self.title = _TitleItem()
        it.layout.removeItem(it.titleLabel)
        it.titleLabel.hide()
        it.layout.addItem(self.title, 0, 1)
        it.setLabel("left", spec.unit)
        it.getAxis("left").enableAutoSIPrefix(False)
        # no "time" label under the clock-time ticks: the rows it took hold the legends above the plots
        # horizontal grid lines only: the time axis redraws as the window advances, and with vertical grid
        # lines its cached picture would span the whole plot (measured ~30 ms per plot on a software X server)
        it.showGrid(x=False, y=True, alpha=0.25)
        # no clipToView/auto-downsampling: the store hands each curve only the visible range, already reduced to
        # min/max per two pixels (MonitorView._rows); pyqtgraph's own pass over the same points was ~30 % of
        # the GUI thread's work at 1 Hz (cProfile of benchmarks/gui_load.py part 2)
        # the view's menu (View All, axis ranges, mouse mode, and the export entries below) stays; pyqtgraph's
        # "Plot Options" (log/FFT transforms, decimation, averaging) acts on PlotDataItems, which these curves are
        # not (SeriesCurve), and would fight the y ranges this plot sets
        it.setMenuEnabled(enableMenu=False, enableViewBoxMenu=True)
        from .plot_export import add_export     # right click: Save plot as PNG/SVG…, Copy figures
        add_export(it, spec.title)
        it.hideButtons()              # the auto-range "A" would fight the sticky y ranges set below
        for name in ("left", "bottom", "right"):
            ax = it.getAxis(name)
            ax.setPen(pg.mkPen("#444"))
            ax.setTextPen(pg.mkPen("#333"))
        it.getAxis("left").setWidth(44)
        self.right_vb: pg.ViewBox | None = None
        if spec.right_unit:
            self.right_vb = pg.ViewBox()
            it.showAxis("right")
            it.scene().addItem(self.right_vb)
            ax = it.getAxis("right")
            ax.linkToView(self.right_vb)
            ax.setLabel(spec.right_unit)
            ax.enableAutoSIPrefix(False)
            self.right_vb.setXLink(it)
            it.vb.sigResized.connect(self._sync_right)
        self.curves: dict[str, SeriesCurve] = {}
        self.series: dict[str, Series] = {}
        self.dots: dict[str, pg.ScatterPlotItem] = {}
        for s in spec.series:
            pen = pg.mkPen(s.color, width=s.width, style=s.style)
            if s.right and self.right_vb is not None:
                c = SeriesCurve(pen, f"{s.name} (right)")
                self.right_vb.addItem(c)
            else:
                c = SeriesCurve(pen, s.name)
                it.addItem(c)
            self.curves[s.column] = c
            self.series[s.column] = s
            # a reading with no neighbour (a prompt read within one poll, a slot busy for one tick) has no line
            # segment to draw: it is a dot, so every reading shows and the y range never holds an invisible one
            dots = pg.ScatterPlotItem(size=5, pen=None, brush=pg.mkBrush(s.color))
            dots.setZValue(c.zValue() + 1)
            dots.setVisible(False)                 # until it has a dot to draw
            (self.right_vb if s.right and self.right_vb is not None else it.vb).addItem(dots)
            self.dots[s.column] = dots
        # The legend sits in the title row, above the data, never over it (a legend inside the plot covered
        # the newest values); it is laid out again only when the plot's width or its set of curves changes.
        self.legend_cols: set[str] = set(self.curves)
        self.ref_line: pg.InfiniteLine | None = None
        self.ref_legend = ""               # what the reference line is, in the legend (its own label is short)
        self._title_width = 0.0
        self.relayout_title(300.0)
        self.empty: dict[str, bool] = {}
        if spec.y_min is not None:
            it.vb.setLimits(yMin=spec.y_min - (spec.y_max or 1) * 0.05)
        # y ranges are set by set_data (sticky "nice" bounds), not re-fitted on every tick: an axis whose range
        # is unchanged is not redrawn, and the scale does not jitter while you read it
        it.vb.disableAutoRange(axis=pg.ViewBox.YAxis)
        self.y_ranges: dict[str, tuple[float, float]] = {}
        # static parts are painted once into a pixmap and blitted (Qt's device-coordinate cache): a tick then
        # repaints the curves, not the legend, the axes' text and the grid (those redraw when their range moves)
        for name in ("left", "bottom", "right"):
            it.getAxis(name).setCacheMode(QGraphicsItem.CacheMode.DeviceCoordinateCache)
        self.title.setCacheMode(QGraphicsItem.CacheMode.DeviceCoordinateCache)
        self.cursor = pg.InfiniteLine(angle=90, movable=False, pen=pg.mkPen("#888", style=DASH))
        self.cursor.setZValue(50)
        self.cursor.hide()
        it.addItem(self.cursor, ignoreBounds=True)
        self.readout = pg.TextItem("", anchor=(0, 1), color="#222", fill=pg.mkBrush(255, 255, 255, 230),
                                   border=pg.mkPen("#bbb"))
        # a child of the view box itself (not of its data group), so it stays above the curves
        self.readout.setParentItem(it.vb)
        self.readout.setZValue(200)
        f = QFont()
        f.setPointSizeF(8.0)
        self.readout.setFont(f)
        self.readout.hide()
        # white behind it: a curve under the words stays a curve, the words stay words
        self.note = pg.TextItem("", anchor=(0, 1), color="#8a5a00", fill=pg.mkBrush(255, 255, 255, 215))
        note_font = QFont()
        note_font.setPointSizeF(8.0)
        self.note.setFont(note_font)
        self.note.setZValue(90)
        it.addItem(self.note, ignoreBounds=True)
        self.data_t: np.ndarray = np.empty(0)
        self.data: dict[str, np.ndarray] = {}

    LEGEND_PT = 7.5

    def legend_entries(self) -> list[tuple[str, str, str]]:
        """(swatch, colour, name) of the curves shown, in order."""
        out = []
        for col, s in self.series.items():
            if col not in self.legend_cols:
                continue
            swatch = "╍╍" if s.style != Qt.PenStyle.SolidLine else "━━"
            name = f"{s.name} (right axis)" if s.right and self.right_vb is not None else s.name
            out.append((swatch, s.color, name))
        if self.ref_legend and self.ref_line is not None and self.ref_line.isVisible():
            out.append(("-·-", REF_COLOR, self.ref_legend))
        return out

    def relayout_title(self, width: float) -> None:
        """The title and the legend above the plot, wrapped into as many lines as ``width`` px needs."""
        width = max(160.0, float(width))
        entries = self.legend_entries()
        if abs(width - self._title_width) < 8 and getattr(self, "_title_entries", None) == entries:
            return
        self._title_width = width
        self._title_entries = entries
        small = QFont()
        small.setPointSizeF(self.LEGEND_PT)
        big = QFont()
        big.setPointSizeF(9.0)
        big.setBold(True)
        fm_s, fm_b = QFontMetricsF(small), QFontMetricsF(big)
        esc = lambda t: t.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")   # noqa: E731
        width -= 50 + (50 if self.right_vb is not None else 0)     # the axes beside the title row
        lines: list[list[str]] = [[f"<span style='font-size:9pt; color:#222'><b>{esc(self.spec.title)}</b></span>"]]
        used = fm_b.horizontalAdvance(self.spec.title) + 14
        for swatch, color, name in entries:
            w = fm_s.horizontalAdvance(f"{swatch} {name}") + 14
            if used + w > width - 10 and len(lines[-1]) > 0 and used > 0:
                lines.append([])
                used = 0
            lines[-1].append(f"<span style='font-size:{self.LEGEND_PT}pt; color:{color}'>{swatch}</span>"
                             f"<span style='font-size:{self.LEGEND_PT}pt; color:#333'>&nbsp;{esc(name)}</span>")
            used += w
        html = "<br>".join("&nbsp;&nbsp;&nbsp;".join(parts) for parts in lines if parts)
        self.title.setText(html)
        self.item.layout.setRowFixedHeight(0, self.title.itemRect().height())

    def show_columns(self, visible: set[str]) -> None:
        """Show only these curves (and their legend entries): e.g. the slots the engine has."""
        changed = False
        for col, curve in self.curves.items():
            want = col in visible
            if want == curve.isVisible() and (col in self.legend_cols) == want:
                continue
            curve.setVisible(want)
            self.dots[col].setVisible(want and self.dots[col].data.size > 0)
            changed = True
            if want:
                self.legend_cols.add(col)
            else:
                self.legend_cols.discard(col)
        if changed:
            self.relayout_title(self._title_width or 300.0)

    def _sync_right(self) -> None:
        if self.right_vb is not None:
            self.right_vb.setGeometry(self.item.vb.sceneBoundingRect())
            self.right_vb.linkedViewChanged(self.item.vb, self.right_vb.XAxis)

    def set_data(self, t: np.ndarray, cols: dict[str, np.ndarray], fit_y: bool = True,
                 x_range: tuple[float, float] | None = None) -> None:
        self.data_t = t
        self.data = {}
        for col, curve in self.curves.items():
            y = cols.get(col)
            if y is None:
                continue
            s = self.series[col]
            y = y.astype(np.float64) * s.scale if s.scale != 1.0 else y.astype(np.float64)
            self.data[col] = y
            if not curve.isVisible():
                continue
            if t.size == 0 or not np.isfinite(y).any():
                if self.empty.get(col) is not True:        # already empty: nothing to redraw
                    curve.setData([], [])
                    self._set_dots(col, None, None)
                    self.empty[col] = True
            else:
                curve.setData(t, y)
                lone = isolated(y)
                if lone.any() or self.dots[col].data.size:
                    self._set_dots(col, t[lone], y[lone])
                self.empty[col] = False
        if fit_y:
            self.fit_y(x_range)

    def _set_dots(self, col: str, t: np.ndarray | None, y: np.ndarray | None) -> None:
        """The lone readings of ``col`` as dots; a scatter item with none is hidden: drawn empty, each of the
        plots' ~10 scatter items cost ~0.4 ms per paint (cProfile, benchmarks/gui_load.py part 2)."""
        dots = self.dots[col]
        if t is not None and y is not None and t.size and t.size == dots.data.size \
                and np.array_equal(dots.data["x"], t) and np.array_equal(dots.data["y"], y):
            return                  # the same dots (a tick that added none): setting them again cost ~0.3 ms
        if t is None or y is None or t.size == 0:
            dots.setData([], [])
            dots.setVisible(False)
        else:
            dots.setData(t, y)
            dots.setVisible(self.curves[col].isVisible())

    def fit_y(self, x_range: tuple[float, float] | None = None) -> None:
        """Sticky 'nice' y ranges over the visible data: changed only when the data leaves the range or fills
        less than 40% of it."""
        if self.data_t.size and x_range is not None:
            vis = (self.data_t >= x_range[0]) & (self.data_t <= x_range[1])
        else:
            vis = slice(None)
        for side, vb in (("left", self.item.vb), ("right", self.right_vb)):
            if vb is None:
                continue
            vals = [self.data[c][vis] for c, s in self.series.items()
                    if c in self.data and s.right == (side == "right") and self.curves[c].isVisible()]
            if side == "left" and self.ref_line is not None and self.ref_line.isVisible():
                vals.append(np.array([self.ref_line.value()]))
            finite = np.concatenate([v[np.isfinite(v)] for v in vals]) if vals else np.empty(0)
            if finite.size == 0:
                continue
            lo_d, hi_d = float(finite.min()), float(finite.max())
            cur = self.y_ranges.get(side)
            if cur is not None and cur[0] <= lo_d and hi_d <= cur[1] and \
                    (hi_d - min(lo_d, cur[0] if self.spec.y_min is not None else lo_d)) >= 0.4 * (cur[1] - cur[0]):
                continue
            rng = nice_range(lo_d, hi_d, self.spec.y_min, self.spec.y_max if side == "left" else None)
            if rng != cur:
                self.y_ranges[side] = rng
                vb.setYRange(*rng, padding=0)

    def set_reference(self, value: float | None, label: str, unknown_note: str = "", legend: str = "") -> None:
        """A horizontal reference line (the planner's predicted hit rate): ``label`` short, on the line (a long
        one ran off both sides of a narrow plot); ``legend`` says what it is, in the legend above the plot,
        which wraps."""
        self.ref_legend = legend
        if value is None:
            if self.ref_line is not None:
                self.ref_line.hide()
            self.note.setText(unknown_note)
            self.relayout_title(self._title_width)
            return
        if self.ref_line is None:
            self.ref_line = pg.InfiniteLine(angle=0, movable=False,
                                            pen=pg.mkPen(REF_COLOR, style=Qt.PenStyle.DashDotLine),
                                            label=label, labelOpts={"position": 0.98, "color": REF_COLOR,
                                                                    "anchors": [(1, 0), (1, 1)],
                                                                    "fill": (255, 255, 255, 200)})
            self.ref_line.setZValue(-5)       # under the curves: an observed rate on the prediction stays visible
            self.item.addItem(self.ref_line, ignoreBounds=False)
        self.ref_line.setValue(value)
        self.ref_line.label.setFormat(label)
        self.ref_line.show()
        self.note.setText("")
        self.relayout_title(self._title_width)

    def set_note(self, text: str) -> None:
        """A line of words at the bottom of the plot (e.g. why the planner and the observed figure differ)."""
        if self.note.toPlainText() != text:
            self.note.setText(text)

    def place_note(self) -> None:
        """At the bottom left of the plot, wrapped to 60 % of the plot's width (one long line ran off its right
        edge), so it never reaches the reference line's label, drawn right-aligned at the right edge (the two
        overlapped at 1280×800)."""
        (x0, x1), (y0, y1) = self.item.vb.viewRange()
        width = max(60.0, 0.6 * self.item.vb.width() - 8)
        if abs(self.note.textItem.textWidth() - width) > 1:
            self.note.setTextWidth(width)
        self.note.setPos(x0, y0 + 0.02 * (y1 - y0))

    def note_fits(self) -> bool:
        """The note is no wider than the plot's view box and within it left to right, and no taller than it
        (tests; :meth:`place_note` wraps it)."""
        if not self.note.toPlainText():
            return True
        vb, note = self.item.vb.sceneBoundingRect(), self.note.sceneBoundingRect()
        return vb.left() - 1 <= note.left() and note.right() <= vb.right() + 1 and note.height() <= vb.height()

    def hover(self, x: float | None) -> None:
        if x is None or self.data_t.size == 0:
            self.cursor.hide()
            self.readout.hide()
            return
        i = int(np.clip(np.searchsorted(self.data_t, x), 0, self.data_t.size - 1))
        if i > 0 and abs(self.data_t[i - 1] - x) < abs(self.data_t[i] - x):
            i -= 1
        t = float(self.data_t[i])
        lines = [time.strftime("%H:%M:%S", time.localtime(t))]
        for col, y in self.data.items():
            if not self.curves[col].isVisible():
                continue
            s = self.series[col]
            v = float(y[i]) if i < y.size else float("nan")
            lines.append(f"{s.name}: {fmt_value(v, s.fmt, s.unit)}")
        self.cursor.setPos(t)
        self.cursor.show()
        self.readout.setText("\n".join(lines))
        # beside the cursor, at the bottom of the plot, on whichever side has room
        (x0, x1), (y0, y1) = self.item.vb.viewRange()
        right_half = t > (x0 + x1) / 2
        self.readout.setAnchor((1.03, 1) if right_half else (-0.03, 1))
        self.readout.setPos(self.item.vb.mapFromView(QPointF(t, y0)))
        self.readout.show()

