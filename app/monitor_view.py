"""The Monitor tab: live plots of what the engine and the machine are doing, "now" cards, and a card comparing
the live figures with the deepseek-one-gpu guides'.

All collecting happens in :mod:`engine_manager.metrics` (a :class:`MetricsHub` per running engine, driven
through ``app.workers.run_generator``); this view only draws. Plots follow pyqtgraph's PlotSpeedTest idioms:
curves are created once and fed with ``setData``; ``setClipToView(True)`` and ``setDownsampling(mode='peak')``
keep long series cheap, and the view asks the store only for the visible range, reduced to about two points
per pixel.

Missing values are gaps in the curves and "—" on the cards, never zero. Numbers from the scripted engine are
labelled "simulated".
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPointF, Qt, QTimer, Signal
from PySide6.QtGui import QAction, QFont, QFontMetricsF, QKeySequence, QPalette, QShortcut
from PySide6.QtWidgets import (
    QButtonGroup,
    QComboBox,
    QFileDialog,
    QFrame,
    QGraphicsItem,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QSizePolicy,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from engine_manager import metrics as M
from engine_manager import uistate
from engine_manager.metrics import guides

from .workers import run_function, run_generator

GiB = float(1024**3)
WINDOWS: tuple[tuple[str, float | None], ...] = (("1 min", 60.0), ("10 min", 600.0), ("1 h", 3600.0), ("All", None))
RATES = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0)
DASH = Qt.PenStyle.DashLine
PREFILL_SLOTS_NOTE = ("All slots together: Strata and the scripted engine report no per-slot prefill, so none is "
                      "drawn.")
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


def _plot_specs() -> list[PlotSpec]:
    pct = dict(scale=100.0, fmt="{:.1f}", unit="%")
    gib = dict(scale=1 / GiB, fmt="{:.1f}", unit="GiB")
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
        PlotSpec("hit", "Hot-set hit rate", "%", [
            Series("hit_rate", "observed", "#9ecae1", **pct),
            Series("hit_rate_rolling", "rolling 60 s", "#08519c", **pct),
            Series("hit_rate_last", "newest finished request", "#31a354", style=DASH, **pct),
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


def nice_ceil(x: float) -> float:
    """The smallest of 1, 1.5, 2, 2.5, 3, 4, 5, 6, 8 × 10^k that is ≥ x (x > 0)."""
    if x <= 0:
        return 1.0
    k = math.floor(math.log10(x))
    for m in (1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0):
        if m * 10**k >= x * (1 - 1e-12):
            return m * 10**k
    return 10.0 ** (k + 1)


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


def fmt_value(v: float | None, fmt: str = "{:.1f}", unit: str = "") -> str:
    if v is None or not math.isfinite(v):
        return "—"
    s = fmt.format(v)
    return f"{s} {unit}".strip()


# -- small widgets --------------------------------------------------------------------------------------------
class ElidedLabel(QLabel):
    """One line that never runs off its box: too long, it is shortened in the middle ("…"), the whole text in
    the tooltip; ``text()`` gives the whole text."""

    def __init__(self, text: str = "", parent=None):
        super().__init__(parent)
        self._full = ""
        self.setText(text)

    def setText(self, text: str) -> None:  # noqa: N802 - Qt naming
        if text == self._full:
            return
        self._full = text
        self.setToolTip(text)
        self._elide()

    def text(self) -> str:
        return self._full

    def shown_text(self) -> str:
        return super().text()

    def _elide(self) -> None:
        width = max(20, self.contentsRect().width())
        shown = self.fontMetrics().elidedText(self._full, Qt.TextElideMode.ElideMiddle, width)
        if super().text() != shown:
            super().setText(shown)

    def resizeEvent(self, ev) -> None:
        super().resizeEvent(ev)
        self._elide()


class FitLabel(QLabel):
    """A card's big value: too long for its box at the full size, it is drawn smaller (down to MIN_SCALE), and
    only then shortened ("…", the whole text in the tooltip); ``text()`` is always the whole text."""

    MIN_SCALE = 0.68

    def __init__(self, text: str = "", parent=None):
        super().__init__(parent)
        self._full = ""
        self._base_pt: float | None = None
        self.setText(text)

    def setFont(self, font) -> None:  # noqa: N802 - Qt naming
        self._base_pt = font.pointSizeF()
        super().setFont(font)
        self._fit()

    def setText(self, text: str) -> None:  # noqa: N802 - Qt naming
        if text == self._full and super().text():
            return
        self._full = text
        self._fit()

    def text(self) -> str:
        return self._full

    def shown_text(self) -> str:
        return super().text()

    def _fit(self) -> None:
        width = self.contentsRect().width()
        if width <= 20 or not self._full:
            super().setText(self._full)
            return
        f = self.font()
        base = self._base_pt or f.pointSizeF()
        shown = self._full
        for scale in (1.0, 0.9, 0.8, self.MIN_SCALE):
            f.setPointSizeF(base * scale)
            if QFontMetricsF(f).horizontalAdvance(self._full) <= width:
                break
        else:
            shown = QFontMetricsF(f).elidedText(self._full, Qt.TextElideMode.ElideRight, width)
        if abs(self.font().pointSizeF() - f.pointSizeF()) > 1e-3:
            QLabel.setFont(self, f)
        self.setToolTip(self._full if shown != self._full else "")
        if super().text() != shown:
            super().setText(shown)

    def fits(self) -> bool:
        return self.shown_text() == self._full and \
            QFontMetricsF(self.font()).horizontalAdvance(self._full) <= self.contentsRect().width()

    def resizeEvent(self, ev) -> None:  # noqa: N802 - Qt naming
        super().resizeEvent(ev)
        self._fit()


class NowCard(QFrame):
    """One metric's current value: a title, a big value, a line of detail, an optional "simulated" tag."""

    def __init__(self, key: str, title: str, parent=None):
        super().__init__(parent)
        self.key = key
        self.setObjectName(f"nowCard_{key}")
        self.setFrameShape(QFrame.Shape.StyledPanel)
        self.setStyleSheet("NowCard { background: palette(base); border-radius: 4px; }")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(6, 3, 6, 3)
        lay.setSpacing(0)
        top = QHBoxLayout()
        self.title = QLabel(title)
        f = self.title.font()
        f.setPointSizeF(max(7.0, f.pointSizeF() * 0.85))
        self.title.setFont(f)
        self.title.setStyleSheet("color: palette(mid);")
        # short, so the title beside it keeps its room ("Expert swap…" was cut by "simulated")
        self.tag = QLabel("sim.")
        self.tag.setToolTip("simulated: modelled by the scripted engine, not measured on hardware")
        self.tag.setFont(f)
        self.tag.setStyleSheet("color: #8a5a00; background: #fff1cc; border-radius: 3px; padding: 0 3px;")
        self.tag.hide()
        top.addWidget(self.title, 1)
        top.addWidget(self.tag)
        self.value = FitLabel("—")
        self.value.setObjectName(f"nowValue_{key}")
        vf = self.value.font()
        vf.setPointSizeF(vf.pointSizeF() * 1.35)
        vf.setBold(True)
        self.value.setFont(vf)
        # up to two lines of detail ("rolling 81.2% · planner 89.6%" was cut at one); a fixed height, so a
        # change of text never relays the cards out
        self.detail = QLabel("")
        self.detail.setFont(f)
        self.detail.setWordWrap(True)
        self.detail.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
        self.detail.setFixedHeight(QFontMetricsF(f).lineSpacing() * 2 + 2)
        self.detail.setStyleSheet("color: palette(mid);")
        lay.addLayout(top)
        lay.addWidget(self.value)
        lay.addWidget(self.detail)
        for w in (self.title, self.value, self.detail):
            w.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.title.setMinimumWidth(0)
        self.setMinimumWidth(96)
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Fixed)

    def show_value(self, text: str, detail: str = "", simulated: bool = False, tip: str = "",
                   stale: bool = False) -> None:
        """``stale``: the value is not a live reading (the last request's, or the engine stopped): greyed."""
        if self.value.text() != text:
            self.value.setText(text)
        if self.detail.text() != detail:
            self.detail.setText(detail)
            self.detail.setToolTip(detail)
        if self.tag.isVisibleTo(self) != simulated:
            self.tag.setVisible(simulated)
        if self.toolTip() != tip:
            self.setToolTip(tip)
        self.set_stale(stale)

    def set_stale(self, stale: bool) -> None:
        if getattr(self, "_stale", False) != stale:          # only on change; a palette, not a style sheet
            self._stale = stale                               # (re-polishing a style sheet costs more)
            pal = self.value.palette()
            role = self.value.foregroundRole()
            if not hasattr(self, "_live_color"):
                self._live_color = pal.color(role)
            pal.setColor(role, pal.color(QPalette.ColorRole.Mid) if stale else self._live_color)
            self.value.setPalette(pal)

    def is_stale(self) -> bool:
        return getattr(self, "_stale", False)



class CompareCard(QFrame):
    """The live figures beside the guides' for the same number of active users: a strip under the cards."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setObjectName("compareCard")
        self.setFrameShape(QFrame.Shape.StyledPanel)
        self.setStyleSheet("CompareCard { background: palette(base); border-radius: 4px; }")
        # badge | table | hint (wide) — or, when the hint would be squeezed, the hint on one line under them
        lay = QGridLayout(self)
        lay.setContentsMargins(8, 3, 8, 3)
        lay.setHorizontalSpacing(12)
        lay.setVerticalSpacing(0)
        self.badge = QLabel("")
        self.badge.setObjectName("compareBadge")
        self.badge.setAlignment(Qt.AlignmentFlag.AlignCenter)
        lay.addWidget(self.badge, 0, 0, Qt.AlignmentFlag.AlignTop)
        small = self.font()
        small.setPointSizeF(max(7.0, small.pointSizeF() * 0.9))
        # plain labels in a grid, not a rich-text table: a rich-text relayout on every change cost ~5 ms
        self.table = QWidget()
        self.table.setObjectName("compareTable")
        grid = QGridLayout(self.table)
        grid.setContentsMargins(0, 0, 0, 0)
        grid.setHorizontalSpacing(12)
        grid.setVerticalSpacing(0)
        bold = QFont(small)
        bold.setBold(True)
        self.cells: dict[tuple[int, int], QLabel] = {}
        for r in range(3):
            for col in range(5):
                cell = QLabel("")
                cell.setFont(bold if r == 0 or col == 0 else small)
                grid.addWidget(cell, r, col, Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignTop)
                self.cells[(r, col)] = cell
        for col, text in enumerate(("Compared with the guides", "users", "decode, total", "per user",
                                    "GPU hit rate")):
            self.cells[(0, col)].setText(text)
        self.cells[(2, 4)].setText("~90%")
        grid.setRowStretch(3, 1)
        lay.addWidget(self.table, 0, 1, Qt.AlignmentFlag.AlignTop)
        self.hints = QLabel("")
        self.hints.setObjectName("compareHints")
        self.hints.setWordWrap(True)
        self.hints.setTextFormat(Qt.TextFormat.RichText)
        self.hints.setFont(small)
        self.hints.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
        self.hints.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        lay.addWidget(self.hints, 0, 2)
        self.hints_below = ElidedLabel("")
        self.hints_below.setObjectName("compareHintsBelow")
        self.hints_below.setFont(small)
        self.hints_below.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.hints_below.hide()
        lay.addWidget(self.hints_below, 1, 0, 1, 3)
        lay.setColumnStretch(2, 1)
        lay.setRowStretch(0, 1)
        self.base_tip = (f"The guides' figures: DeepSeek-V4.1-Flash Q2_K on {guides.GUIDE_HOST}. 63.11 tok/s at "
                         "1 user; 127.58 total / 31.87 slowest at 4; 152.53 total / ~19 each at 8; ~9 in 10 "
                         "expert picks hit the GPU; NUMA binding took 1 user from ~53 to 63 tok/s.")
        self.setToolTip(self.base_tip)
        self.comparison: guides.Comparison | None = None
        # a fixed height: text that changes length must not resize the plots below (that would redraw all six)
        from PySide6.QtGui import QFontMetrics
        self.setFixedHeight(QFontMetrics(small).lineSpacing() * 4 + 12)
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Fixed)
        self.show_comparison(None)

    def _cell(self, r: int, col: int, text: str) -> None:
        cell = self.cells[(r, col)]
        if cell.text() != text:
            cell.setText(text)

    def table_text(self) -> str:
        return "\n".join(" | ".join(self.cells[(r, c)].text() for c in range(5)) for r in range(3))

    VERDICTS = {"as_published": ("#e6f4ea", "#1e6b34", "as published"),
                "below": ("#fdecea", "#a02a1a", "below"),
                "measuring": ("#e8f0fe", "#1a4d8f", "measuring…"),
                "not_comparable": ("#eeeeee", "#555555", "n/a"),
                "idle": ("#eeeeee", "#555555", "idle"),
                "stopped": ("#eeeeee", "#555555", "stopped"),
                "unknown": ("#eeeeee", "#555555", "—")}

    def _badge(self, verdict: str, simulated: bool = False) -> None:
        bg, fg, word = self.VERDICTS.get(verdict, self.VERDICTS["unknown"])
        if simulated and verdict in ("as_published", "below"):
            word += " · sim."
        if self.badge.text() != word:
            self.badge.setText(word)
        style = f"background: {bg}; color: {fg}; border-radius: 3px; padding: 1px 6px;"
        if self.badge.styleSheet() != style:          # re-styling costs a repolish: only on change
            self.badge.setStyleSheet(style)

    def _hints(self, shown: str, tip: str) -> None:
        if self.hints.text() != shown:
            self.hints.setText(shown)
            self.hints.setToolTip(tip)
            self.hints_below.setText(shown)
            self.hints_below.setToolTip("\n\n".join(x for x in (shown, tip) if x))

    HINT_MIN_WIDTH = 240       # narrower than this beside the table, the hint goes on a line of its own below

    def _set_table_visible(self, visible: bool) -> None:
        if self.table.isVisibleTo(self) != visible or getattr(self, "_placed_for", None) is None:
            self.table.setVisible(visible)
            self._place_hints()

    def _place_hints(self) -> None:
        """Beside the table when there is room, else one line (shortened, whole in the tooltip) under it; only
        on a resize or when the table shows or hides, never per tick."""
        shown = self.table.isVisibleTo(self)
        lay = self.layout()
        room = (self.width() - lay.contentsMargins().left() - lay.contentsMargins().right()
                - self.badge.sizeHint().width() - (self.table.sizeHint().width() if shown else 0)
                - 2 * lay.horizontalSpacing())
        below = shown and room < self.HINT_MIN_WIDTH
        self._placed_for = (self.width(), shown)
        if self.hints_below.isVisibleTo(self) != below:
            self.hints_below.setVisible(below)
            self.hints.setVisible(not below)

    def hint_is_below(self) -> bool:
        return self.hints_below.isVisibleTo(self)

    def resizeEvent(self, ev) -> None:
        super().resizeEvent(ev)
        self._place_hints()

    def show_comparison(self, c: guides.Comparison | None) -> None:
        self.comparison = c
        if c is None:
            self.badge.setText("")
            self.badge.setStyleSheet("")
            self._set_table_visible(False)
            self._hints("Start the engine to compare this host with the published figures: 63.11 tok/s "
                        "at 1 user, 127.58 total at 4, 152.53 total at 8; ~9 in 10 expert picks on the GPU.", "")
            return
        self._badge(c.verdict, c.simulated)
        if c.verdict in ("idle", "unknown") and c.measured_tok_s is None:
            # nothing measured to show: no "0 users, 13 tok/s" from a window still emptying
            self._set_table_visible(False)
            self._hints(c.headline, "")
            self.setToolTip("\n\n".join([c.headline, self.base_tip]))
            return
        na = c.verdict == "not_comparable"
        users = "—" if c.users is None else str(c.users)
        host = "last steady" if not c.live else "this host"
        self._cell(1, 0, f"{host} (simulated)" if c.simulated else host)
        self._cell(2, 0, "guides (interpolated)" if c.guide_kind == "interpolated" else "guides")
        measuring = c.verdict == "measuring"
        self._cell(1, 1, users)
        self._cell(1, 2, "measuring…" if measuring else fmt_value(c.measured_tok_s, "{:.1f}", "tok/s"))
        self._cell(1, 3, "" if measuring else fmt_value(c.measured_each_tok_s, "{:.1f}", "tok/s"))
        self._cell(1, 4, "—" if c.hit_rate is None else f"{c.hit_rate * 100:.0f}%")
        self._cell(2, 1, "—" if na else users)
        self._cell(2, 2, "n/a" if na else fmt_value(c.guide_tok_s, "{:.2f}", "tok/s"))
        self._cell(2, 3, "n/a" if na else fmt_value(c.guide_each_tok_s, "{:.1f}", "tok/s"))
        self._cell(2, 4, "n/a" if na else "~90%")
        self._set_table_visible(True)
        # the headline and one short hint: the card has room for a few lines; the tooltip has everything
        shown = " ".join(x for x in (c.headline, c.short_hint) if x)
        basis = f"Judged on {c.basis}." if c.basis else ""
        self._hints(shown, "\n\n".join([*c.hints, basis]).strip())
        self.setToolTip("\n\n".join(x for x in [c.headline, basis, *c.hints, self.base_tip] if x))

    def show_stopped(self, last: guides.Comparison | None) -> None:
        """The engine stopped: nothing live; the last steady figure, if there was one, said as such."""
        self.comparison = None
        self._badge("stopped")
        self._set_table_visible(False)
        text = "Engine stopped."
        if last is not None and last.measured_tok_s is not None and last.users and \
                last.verdict in ("as_published", "below", "idle"):
            ratio = f" ({last.ratio * 100:.0f}% of the guides' figure)" if last.ratio is not None else ""
            text += (f" Last steady decode: {last.measured_tok_s:.1f} tok/s at {last.users} "
                     f"user{'s' if last.users != 1 else ''}{ratio}.")
        self._hints(text, "")
        self.setToolTip(self.base_tip)


# -- one plot ---------------------------------------------------------------------------------------------------
class _TitleItem(pg.LabelItem):
    """A plot's title row. Unlike a plain LabelItem it does not pin its minimum width to its text's (that kept
    the plots from narrowing with the window, so they ran off its edge): the text is wrapped to the width by
    :meth:`_Plot.relayout_title` instead; its height follows the lines."""

    def updateMin(self) -> None:  # noqa: N802 - pyqtgraph naming
        h = self.itemRect().height()
        self.setMinimumWidth(40)
        self.setMinimumHeight(h)
        self._sizeHint = {Qt.SizeHint.MinimumSize: (40, h), Qt.SizeHint.PreferredSize: (40, h),
                          Qt.SizeHint.MaximumSize: (-1, -1), Qt.SizeHint.MinimumDescent: (0, 0)}
        self.updateGeometry()


class _Plot:
    """A PlotItem with its curves (created once), an optional right axis, a legend and a hover read-out."""

    def __init__(self, layout: pg.GraphicsLayout, spec: PlotSpec, row: int, col: int):
        self.spec = spec
        axis = pg.DateAxisItem(orientation="bottom")
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
        it.setClipToView(True)
        it.setDownsampling(auto=True, mode="peak")
        it.setMenuEnabled(True)
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
        self.curves: dict[str, pg.PlotDataItem] = {}
        self.series: dict[str, Series] = {}
        self.dots: dict[str, pg.ScatterPlotItem] = {}
        for s in spec.series:
            pen = pg.mkPen(s.color, width=s.width, style=s.style)
            if s.right and self.right_vb is not None:
                c = pg.PlotDataItem(pen=pen, name=f"{s.name} (right)", connect="finite")
                c.setClipToView(True)
                c.setDownsampling(auto=True, method="peak")
                self.right_vb.addItem(c)
            else:
                c = it.plot(pen=pen, name=s.name, connect="finite")
                c.setClipToView(True)
                c.setDownsampling(auto=True, method="peak")
            self.curves[s.column] = c
            self.series[s.column] = s
            # a reading with no neighbour (a prompt read within one poll, a slot busy for one tick) has no line
            # segment to draw: it is a dot, so every reading shows and the y range never holds an invisible one
            dots = pg.ScatterPlotItem(size=5, pen=None, brush=pg.mkBrush(s.color))
            dots.setZValue(c.zValue() + 1)
            (self.right_vb if s.right and self.right_vb is not None else it.vb).addItem(dots)
            self.dots[s.column] = dots
        # The legend sits in the title row, above the data, never over it (a legend inside the plot covered
        # the newest values); it is laid out again only when the plot's width or its set of curves changes.
        self.legend_cols: set[str] = set(self.curves)
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
        self.ref_line: pg.InfiniteLine | None = None
        self.note = pg.TextItem("", anchor=(0, 1), color="#8a5a00")
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
        return out

    def relayout_title(self, width: float) -> None:
        """The title and the legend above the plot, wrapped into as many lines as ``width`` px needs."""
        width = max(160.0, float(width))
        if abs(width - self._title_width) < 8 and getattr(self, "_title_cols", None) == self.legend_cols:
            return
        self._title_width = width
        self._title_cols = set(self.legend_cols)
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
        for swatch, color, name in self.legend_entries():
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
            self.dots[col].setVisible(want)
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
                    self.dots[col].setData([], [])
                    self.empty[col] = True
            else:
                curve.setData(t, y, connect="finite")
                lone = isolated(y)
                if lone.any() or self.dots[col].data.size:
                    self.dots[col].setData(t[lone], y[lone])
                self.empty[col] = False
        if fit_y:
            self.fit_y(x_range)

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

    def set_reference(self, value: float | None, label: str, unknown_note: str = "") -> None:
        """A horizontal reference line (the planner's predicted hit rate)."""
        if value is None:
            if self.ref_line is not None:
                self.ref_line.hide()
            self.note.setText(unknown_note)
            return
        if self.ref_line is None:
            self.ref_line = pg.InfiniteLine(angle=0, movable=False,
                                            pen=pg.mkPen("#e6550d", style=Qt.PenStyle.DashDotLine),
                                            label=label, labelOpts={"position": 0.55, "color": "#e6550d",
                                                                    "fill": (255, 255, 255, 200)})
            self.ref_line.setZValue(-5)       # under the curves: an observed rate on the prediction stays visible
            self.item.addItem(self.ref_line, ignoreBounds=False)
        self.ref_line.setValue(value)
        self.ref_line.label.setFormat(label)
        self.ref_line.show()
        self.note.setText("")

    def place_note(self) -> None:
        (x0, x1), (y0, y1) = self.item.vb.viewRange()
        self.note.setPos(x0, y0 + 0.02 * (y1 - y0))

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


# -- the view ---------------------------------------------------------------------------------------------------
class MonitorView(QWidget):
    """Live plots, now cards and the guides card. Starts collecting on ``ctx.engineReady`` and stops on
    ``ctx.engineStopped``; every tick is re-emitted as ``ctx.sampleArrived(Sample)``."""

    hubStarted = Signal(object)        # MetricsHub
    tickShown = Signal(object)         # Tick, after the view drew it

    MAX_POINTS_PER_PIXEL = 1   # min/max per 2-px bucket: peaks survive; a jagged 1,100-point path costs ~3 ms
    CARDS_HZ = 4.0
    COMPARE_EVERY_S = 1.0      # the guides card compares 10-s means: redoing its rich text faster buys nothing
    BATCH_BELOW_HZ = 2.0       # at or below this rate all plots are drawn in one pass
    STEP_INTERVAL_MS = 15       # between one plot's update and the next: room for Qt to paint the first alone

    def __init__(self, ctx, parent=None):
        super().__init__(parent)
        self.ctx = ctx
        self.hub: M.MetricsHub | None = None
        self.store: M.RingStore | None = None
        self.worker = None
        self.last_tick: M.Tick | None = None
        self.engine_info: dict[str, Any] = {}
        self.window_s: float | None = 600.0
        self.paused = False
        self._dirty = False
        self._setting_range = False
        self._redraws = 0
        self._stopping: list[M.MetricsHub] = []
        self._generation = 0
        st = uistate.load()
        if isinstance(st.get("monitor_window"), str):
            for label, secs in WINDOWS:
                if label == st["monitor_window"]:
                    self.window_s = secs
        self._build()
        ctx.engineReady.connect(self.on_engine_ready)
        ctx.engineStopped.connect(self.on_engine_stopped)
        ctx.planChanged.connect(self._on_plan)
        ctx.settingsChanged.connect(self._on_settings)
        # redraws are coalesced: at most one per event-loop pass, and never while the tab is hidden
        self._redraw_timer = QTimer(self)
        self._redraw_timer.setSingleShot(True)
        self._redraw_timer.setInterval(0)
        self._redraw_timer.timeout.connect(self.redraw)
        # observed routing reaches the Placement heatmap at most every ROUTING_EVERY_S; the newest counts that
        # arrive in between wait for this timer, so the last update is never lost
        self.routing_counts = None
        self._routing_latest = None
        self._routing_fed = -1e9
        self._routing_timer = QTimer(self)
        self._routing_timer.setSingleShot(True)
        self._routing_timer.timeout.connect(self._push_routing)
        if ctx.base_url and ctx.api_key:
            QTimer.singleShot(0, lambda: self.on_engine_ready(ctx.base_url, ctx.api_key))

    # -- layout ---------------------------------------------------------------------------------------------
    def _build(self) -> None:
        root = QVBoxLayout(self)
        root.setContentsMargins(4, 4, 4, 4)
        root.setSpacing(4)

        bar = QHBoxLayout()
        self.window_group = QButtonGroup(self)
        self.window_group.setExclusive(True)
        for i, (label, secs) in enumerate(WINDOWS):
            b = QToolButton()
            b.setText(label)
            b.setCheckable(True)
            b.setObjectName(f"window_{label.replace(' ', '')}")
            b.setToolTip(f"Show the last {label}" if secs else "Show everything recorded since the engine started")
            b.setChecked(secs == self.window_s)
            self.window_group.addButton(b, i)
            bar.addWidget(b)
        self.window_group.idClicked.connect(self.set_window_index)
        bar.addSpacing(8)
        self.pause_btn = QPushButton("Pause")
        self.pause_btn.setObjectName("pauseButton")
        self.pause_btn.setCheckable(True)
        self.pause_btn.setToolTip("Freeze the plots to read or scroll back (Space); collecting and recording go on")
        self.pause_btn.toggled.connect(self.set_paused)
        # Space pauses while the Monitor has the focus (a window-wide Space would eat the chat's spaces)
        self._space = QShortcut(QKeySequence(Qt.Key.Key_Space), self)
        self._space.setContext(Qt.ShortcutContext.WidgetWithChildrenShortcut)
        self._space.activated.connect(self.pause_btn.toggle)
        bar.addWidget(self.pause_btn)
        self.live_btn = QPushButton("Live ▶")
        self.live_btn.setObjectName("liveButton")
        self.live_btn.setToolTip("Back to the live view")
        self.live_btn.clicked.connect(lambda: self.set_paused(False))
        self.live_btn.setVisible(False)
        bar.addWidget(self.live_btn)
        bar.addSpacing(8)
        bar.addWidget(QLabel("Rate"))
        self.rate_box = QComboBox()
        self.rate_box.setObjectName("rateBox")
        for r in RATES:
            self.rate_box.addItem(f"{r:g} Hz", r)
        self._select_rate(self.ctx.settings.metrics_hz)
        self._lock_rate_box(self.ctx.loaded)
        self.rate_box.activated.connect(self._rate_chosen)
        bar.addWidget(self.rate_box)
        bar.addSpacing(8)
        self.status = ElidedLabel("Not collecting: no engine is running.")
        self.status.setObjectName("monitorStatus")
        self.status.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.status.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        bar.addWidget(self.status, 1)
        root.addLayout(bar)

        top = QVBoxLayout()
        top.setSpacing(4)
        top.setContentsMargins(0, 0, 0, 0)
        cards = QGridLayout()
        cards.setSpacing(4)
        cards.setAlignment(Qt.AlignmentFlag.AlignTop)
        self.cards: dict[str, NowCard] = {}
        for i, (key, title) in enumerate((
                ("decode", "Decode"), ("prefill", "Prefill"), ("hit", "GPU hit rate"), ("swaps", "Expert swaps"),
                ("pcie", "PCIe"), ("vram", "VRAM"), ("ram", "RAM"), ("cpu", "CPU"), ("gpu", "GPU"),
                ("engine", "Engine process"))):
            card = NowCard(key, title)
            self.cards[key] = card
            cards.addWidget(card, i // 5, i % 5)
        top.addLayout(cards)
        self.compare = CompareCard()
        top.addWidget(self.compare)
        top_box = QWidget()
        top_box.setLayout(top)
        top_box.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Fixed)
        root.addWidget(top_box)

        self.glw = pg.GraphicsLayoutWidget()
        self.glw.setBackground("w")
        self.glw.setObjectName("monitorPlots")
        self.glw.ci.setSpacing(2)
        self.plots: dict[str, _Plot] = {}
        for i, spec in enumerate(_plot_specs()):
            self.plots[spec.key] = _Plot(self.glw.ci, spec, i // 2, i % 2)
        for col in (0, 1):                          # two columns of the same width, whatever their titles hold
            self.glw.ci.layout.setColumnStretchFactor(col, 1)
            self.glw.ci.layout.setColumnPreferredWidth(col, 200)
        # The plots share their time range, kept in step by this view rather than by pyqtgraph's x-link: a link
        # moves every plot in one go, so one redraw would repaint all six at once (~45 ms on a software X
        # server); stepping them one per event-loop pass keeps every pass short (see redraw()).
        for key, p in self.plots.items():
            p.item.vb.sigRangeChangedManually.connect(lambda *_a, k=key: self._user_moved(k))
            p.item.vb.sigXRangeChanged.connect(lambda *_a, k=key: self._x_changed(k))
        self._ref_plot = "tok"
        self._queue: list[str] = []
        self._target: tuple[float, float, bool] | None = None
        self._step_timer = QTimer(self)
        self._step_timer.setSingleShot(True)
        self._step_timer.setInterval(self.STEP_INTERVAL_MS)
        self._step_timer.timeout.connect(self._redraw_step)
        self.plots["hit"].set_reference(None, "", "planner's prediction: unknown")
        self._empty_range()
        self._hover_proxy = pg.SignalProxy(self.glw.scene().sigMouseMoved, rateLimit=30, slot=self._mouse_moved)
        root.addWidget(self.glw, 1)

    def _empty_range(self) -> None:
        """Before any data: the time axes show the window ending now (clock times, not "00.250 00.500" of an
        empty range at the epoch)."""
        now = time.time()
        span = self.window_s or 600.0
        for p in self.plots.values():
            p.item.setXRange(now - span, now, padding=0)

    def resizeEvent(self, ev) -> None:
        super().resizeEvent(ev)
        # the legends above the plots wrap to the plots' new width (only on a resize: a title change relays out)
        width = self.glw.width() / 2 - 12
        for p in self.plots.values():
            p.relayout_title(width)

    def file_actions(self) -> list[QAction]:
        act = QAction("&Export metrics CSV…", self)
        act.setObjectName("actionExportMetrics")
        act.setShortcut(QKeySequence("Ctrl+E"))
        act.setToolTip("Save the current run's samples (every column, full precision) as CSV")
        act.triggered.connect(self.export_dialog)
        self.export_action = act
        return [act]

    # -- engine lifecycle -------------------------------------------------------------------------------------
    CONTINUE_PLOT_S = 600.0    # an engine back at the same address within this (a restart) continues the plots

    def on_engine_ready(self, base_url: str, api_key: str) -> None:
        """A (re)started engine: a new hub, since its pid, binding or log may differ. Back at the same address
        soon after the last tick (a crash and restart, a rate change), the plots continue across the gap."""
        last = self.last_tick
        if getattr(self, "_carry", None) is None and self.store is not None and last is not None \
                and self.engine_info.get("base_url") == base_url and time.time() - last.t < self.CONTINUE_PLOT_S:
            self._carry = self.store
        self._stop_hub()
        self._generation += 1
        gen = self._generation
        self.status.setText(f"Connecting to the engine at {base_url}…")
        info = self._engine_info(base_url, api_key)
        hz = M.clamp_hz(self.ctx.settings.metrics_hz)
        carry, self._carry = getattr(self, "_carry", None), None
        carry_rec, self._carry_recorder = getattr(self, "_carry_recorder", None), None
        run_function(_make_hub, info, hz, self.ctx.plan, carry, carry_rec,
                     on_done=lambda res, g=gen: self._hub_made(res, g),
                     on_error=lambda exc: self.status.setText(f"Monitor could not start: {exc}"))

    def _engine_info(self, base_url: str, api_key: str) -> dict[str, Any]:
        """What the supervisor knows about the running engine (engine name, pid, binding, log path, launch spec);
        read without I/O here — only attributes of the last status the supervisor holds."""
        info: dict[str, Any] = {"base_url": base_url, "api_key": api_key, "engine": None, "pid": None,
                                "binding": None, "log_path": None, "spec": None,
                                "gpu_index": self.ctx.settings.gpu_index}
        sup = getattr(self.ctx, "supervisor", None)
        info["supervisor"] = sup
        try:
            info["engine_default"] = self.ctx.engine_name()
        except Exception:
            info["engine_default"] = "sim"
        return info

    def _hub_made(self, res: tuple[M.MetricsHub, M.RingStore, dict[str, Any], int] | None, gen: int) -> None:
        if res is None:
            return
        hub, store, info, loaded = res
        if gen != self._generation:          # the engine stopped (or restarted) while the hub was being made
            run_function(hub.stop)
            return
        self.hub, self.store, self.engine_info = hub, store, info
        self._update_status()
        self.worker = run_generator(hub.iter_ticks, on_event=self._on_tick,
                                    on_error=lambda exc: self.status.setText(f"Monitor stopped: {exc}"))
        self.hubStarted.emit(hub)
        self._apply_plan(info.get("plan") if info.get("plan") is not None else self.ctx.plan)
        self._tell_placement(info.get("plan"), hub)
        self.schedule_redraw()

    def _tell_placement(self, plan, hub) -> None:
        """The Placement tab shows the plan the engine runs and takes its routing trace as its data, no click."""
        trace = next((str(s.path) for s in hub.sources if isinstance(s, M.RoutingSource)), None)
        target = getattr(self.window(), "placement_view", None)
        fn = getattr(target, "show_running", None)
        if callable(fn):
            try:
                fn(plan, trace)
            except Exception as exc:  # the other view's problem must not stop the monitor
                self.ctx.statusMessage.emit(f"Placement tab could not show the running plan: {exc}", 6000)

    def on_engine_stopped(self) -> None:
        self._generation += 1
        self._stop_hub()
        self.show_stopped_cards()
        if self.last_tick is not None:
            self.status.setText("Engine stopped. Ctrl+E exports the run.")     # short: it fit no status row
        else:
            self.status.setText("Not collecting: no engine is running.")

    def show_stopped_cards(self) -> None:
        """Nothing is live any more: every card shows "—" and says so (the plots keep the history)."""
        for card in self.cards.values():
            card.show_value("—", "engine stopped", False, "The engine is not running: no live figures.",
                            stale=True)
        self.compare.show_stopped(getattr(self, "last_comparison", None))

    def _stop_hub(self) -> None:
        hub, self.hub = self.hub, None
        self.worker = None          # its generator returns by itself once the hub is stopped
        if hub is not None:
            self._stopping.append(hub)
            run_function(hub.stop, on_finished=lambda h=hub: self._stopping.remove(h) if h in self._stopping else None)

    def shutdown(self) -> None:
        """The window is closing: stop collecting and close the recording (waits at most a few seconds)."""
        self._generation += 1
        hub, self.hub = self.hub, None
        self.worker = None
        self._routing_timer.stop()
        for h in [hub, *self._stopping]:
            if h is not None:
                h.stop(timeout=2.0)
        uistate.save({"monitor_window": self._window_label()})

    # -- settings / plan ------------------------------------------------------------------------------------
    def _select_rate(self, hz: float) -> None:
        best = min(range(len(RATES)), key=lambda i: abs(RATES[i] - hz))
        self.rate_box.setCurrentIndex(best)

    def _rate_chosen(self, index: int) -> None:
        hz = RATES[index]
        if abs(hz - self.ctx.settings.metrics_hz) < 1e-9:
            return
        try:
            self.ctx.update_settings({"metrics_hz": hz})
        except Exception as exc:
            self.ctx.statusMessage.emit(f"Could not save the rate: {exc}", 6000)
            self._select_rate(self.ctx.settings.metrics_hz)

    def _lock_rate_box(self, loaded) -> None:
        locked = bool(getattr(loaded, "env_locked", lambda _n: False)("metrics_hz"))
        self.rate_box.setEnabled(not locked)
        self.rate_box.setToolTip("Set by DSV41_METRICS_HZ in the environment; unset it to choose here." if locked
                                 else "How often the monitor reads the engine and the machine (setting metrics_hz)")

    def _on_settings(self, loaded) -> None:
        hz = M.clamp_hz(loaded.settings.metrics_hz)
        self._select_rate(hz)
        self._lock_rate_box(loaded)
        if self.hub is not None and abs(self.hub.hz - hz) > 1e-9:
            info = dict(self.engine_info)
            self._carry = self.store
            self._carry_recorder = self.hub.detach_recorder()
            self.on_engine_ready(info["base_url"], info["api_key"])     # stops this hub, starts one at the rate

    def _on_plan(self, plan) -> None:
        if self.engine_info.get("plan") is None:   # a running engine keeps the prediction of the plan it runs
            self._apply_plan(plan)

    def _apply_plan(self, plan) -> None:
        engine = self.engine_info.get("engine") or ""
        pred = M.predicted_hit_rate(plan, engine, self.engine_info.get("spec"))
        if self.hub is not None:
            self.hub.set_predicted(pred)
            self.hub.expert_bytes = M.plan_expert_bytes(plan)
        if pred is None:
            why = ("unknown: no plan" if not plan else
                   f"{plan.get('predicted_hit_rate_note') or 'unknown until the engine has seen traffic'}")
            self.plots["hit"].set_reference(None, "", f"planner's prediction: {why}")
        else:
            self.plots["hit"].set_reference(pred * 100.0, f"planner predicted {pred * 100:.1f}%")

    # -- ticks ------------------------------------------------------------------------------------------------
    def _on_tick(self, tick: M.Tick) -> None:
        self.last_tick = tick
        self.ctx.sampleArrived.emit(tick.to_sample())
        # the cards at most CARDS_HZ (numbers changing faster cannot be read; each change relays them out)
        if abs(tick.t - getattr(self, "_cards_at", -1e18)) >= 1.0 / self.CARDS_HZ - 0.01:
            self._cards_at = tick.t
            self.update_cards(tick)
        self.schedule_redraw()
        counts = tick.notes.get("routing_counts")
        if counts is not None:
            self._feed_routing(counts)
        self.tickShown.emit(tick)

    ROUTING_EVERY_S = 5.0

    def _feed_routing(self, counts) -> None:
        """Observed routing → the Placement view's heatmap (``PlacementView.update_observed(counts)``), at most
        every ``ROUTING_EVERY_S``: counts that arrive sooner are kept, and the newest are pushed when the
        interval ends."""
        self._routing_latest = counts
        if self._routing_timer.isActive():
            return
        wait_s = self._routing_fed + self.ROUTING_EVERY_S - time.monotonic()
        if wait_s > 0:
            self._routing_timer.start(int(wait_s * 1000) + 1)
        else:
            self._push_routing()

    def _push_routing(self) -> None:
        counts, self._routing_latest = self._routing_latest, None
        if counts is None:
            return
        self._routing_fed = time.monotonic()
        self.routing_counts = counts
        target = getattr(self.window(), "placement_view", None)
        fn = getattr(target, "update_observed", None)
        if callable(fn):
            try:
                fn(counts)
            except Exception as exc:  # the other view's problem must not stop the monitor
                self.ctx.statusMessage.emit(f"Placement heatmap could not take the observed routing: {exc}", 6000)

    def feed(self, tick: M.Tick, store: M.RingStore | None = None) -> None:
        """Show a tick that did not come from this view's hub (benchmarks, tests, a replay)."""
        if store is not None:
            self.store = store
        self.feed_hz = tick.hz
        self._on_tick(tick)

    def schedule_redraw(self) -> None:
        if self.paused:
            return
        if not self.isVisible():
            self._dirty = True
            return
        if not self._redraw_timer.isActive():
            self._redraw_timer.start()

    def showEvent(self, ev) -> None:
        super().showEvent(ev)
        if self._dirty:
            self._dirty = False
            self.schedule_redraw()

    def _window_label(self) -> str:
        for label, secs in WINDOWS:
            if secs == self.window_s:
                return label
        return "10 min"

    def set_window_index(self, i: int) -> None:
        self.window_s = WINDOWS[i][1]
        b = self.window_group.button(i)
        if b is not None and not b.isChecked():
            b.setChecked(True)
        self.set_paused(False)
        self.redraw()

    def set_paused(self, paused: bool) -> None:
        self.paused = bool(paused)
        if self.pause_btn.isChecked() != self.paused:
            self.pause_btn.blockSignals(True)
            self.pause_btn.setChecked(self.paused)
            self.pause_btn.blockSignals(False)
        self.pause_btn.setText("Paused" if self.paused else "Pause")
        self.live_btn.setVisible(self.paused)
        if not self.paused:
            self.redraw()

    def _user_moved(self, key: str) -> None:
        """Panning or zooming a plot by hand freezes the live follow (scroll back); Live ▶ resumes. The other
        plots follow the moved one's time range."""
        if self._setting_range:
            return
        self._ref_plot = key
        if not self.paused:
            self.set_paused(True)
        self._fetch_later()

    def _x_changed(self, key: str) -> None:
        if self.paused and not self._setting_range and key == self._ref_plot:
            self._fetch_later()

    def _fetch_later(self) -> None:
        if not hasattr(self, "_fetch_timer"):
            self._fetch_timer = QTimer(self)
            self._fetch_timer.setSingleShot(True)
            self._fetch_timer.setInterval(60)
            self._fetch_timer.timeout.connect(self._fetch_visible)
        self._fetch_timer.start()

    def _fetch_visible(self) -> None:
        """While paused, scrolling back shows whatever the store holds for the visible range, in every plot."""
        if self.store is None:
            return
        (x0, x1), _ = self.plots[self._ref_plot].item.vb.viewRange()
        self._draw_range(x0, x1, follow=False)

    def redraw(self) -> None:
        if self.store is None or self.paused:
            return
        span = self.store.span()
        if span is None:
            return
        now = span[1]
        # The right edge advances in steps of 1/30 of the window (a chart recorder's jump) rather than every
        # tick: between steps the axes and the grid stay as painted and only the curves are redrawn.
        if self.window_s is not None:
            step = max(1.0, self.window_s / 30.0)
            x1 = math.ceil((now + 1e-6) / step) * step
            x0 = x1 - self.window_s
            if span[0] > x0:                      # a run younger than the window fills the plot, with up to
                step = nice_ceil(max(30.0, now - span[0]) / 6.0)   # 1/6 of room to grow before it steps on
                x1 = math.ceil((now + 1e-6) / step) * step
                x0 = min(span[0], x1 - 10.0)
        else:                                     # everything: from the first sample, in "nice" steps
            step = nice_ceil(max(60.0, now - span[0]) / 10.0)
            x1 = math.ceil((now + 1e-6) / step) * step
            x0 = span[0]
        self._draw_range(x0, x1, follow=True)

    def _draw_range(self, x0: float, x1: float, follow: bool) -> None:
        """Queue every plot for (x0, x1); :meth:`_redraw_step` draws one plot per event-loop pass, so no single
        pass repaints all six (a newer request replaces the target of the plots not drawn yet)."""
        self._target = (x0, x1, follow)
        if follow:
            # round robin: plots still waiting keep their turn, the others queue behind them
            self._queue = self._queue + [k for k in self.plots if k not in self._queue]
        else:
            self._queue = sorted(self.plots, key=lambda k: k != self._ref_plot)
        if not self._step_timer.isActive():
            self._step_timer.start()

    def redraw_pending(self) -> bool:
        return bool(self._queue)

    def _redraw_step(self) -> None:
        if not self._queue or self._target is None or self.store is None:
            self._queue = []
            return
        # At high rates one plot per pass keeps every pass short; at low rates (≤ 2 Hz) drawing all six in one
        # pass costs less CPU in all (one paint instead of six) and the pass is still short enough.
        rate = self.hub.hz if self.hub is not None else getattr(self, "feed_hz", 1.0)
        n = 1 if rate > self.BATCH_BELOW_HZ else len(self._queue)
        for _ in range(n):
            self._draw_one(self._queue.pop(0))
        if self._queue:
            self._step_timer.start()
        else:
            self._redraws += 1

    def _draw_one(self, key: str) -> None:
        x0, x1, follow = self._target
        p = self.plots[key]
        width = max(200, self.glw.width() // 2)
        pad = (x1 - x0) * 0.02
        t, data = self.store.window(x0 - pad, x1 + pad, list(p.curves),
                                    max_points=width * self.MAX_POINTS_PER_PIXEL)
        p.set_data(t, data, fit_y=follow, x_range=(x0, x1))
        vx0, vx1 = p.item.vb.viewRange()[0]
        if abs(vx0 - x0) > 1e-6 or abs(vx1 - x1) > 1e-6:
            self._setting_range = True
            try:
                p.item.setXRange(x0, x1, padding=0)
            finally:
                self._setting_range = False
        p.place_note()

    # -- hover ------------------------------------------------------------------------------------------------
    def _mouse_moved(self, evt) -> None:
        pos = evt[0]
        x = None
        for p in self.plots.values():
            if p.item.sceneBoundingRect().contains(pos):
                x = p.item.vb.mapSceneToView(pos).x()
                break
        for p in self.plots.values():
            p.hover(x)

    def leaveEvent(self, ev) -> None:
        super().leaveEvent(ev)
        for p in self.plots.values():
            p.hover(None)

    # -- cards ------------------------------------------------------------------------------------------------
    def update_cards(self, tick: M.Tick) -> None:
        v = tick.values
        sim = tick.simulated
        miss = tick.missing

        def why(source: str) -> str:
            return f"missing: {miss[source]}" if source in miss else ""

        dec, pre = v.get("decode_tok_s"), v.get("prefill_tok_s")
        busy, total = v.get("slots_busy"), v.get("slots_total")
        if total is not None and total != getattr(self, "_slots_shown", None):
            self._slots_shown = total
            self.plots["slots"].show_columns({M.SLOT_COLUMNS[i] for i in range(min(M.MAX_SLOTS, int(total)))})
        slots = (f"{busy:.0f}/{total:.0f} slots busy" if busy is not None and total is not None
                 else f"{busy:.0f} slots busy" if busy is not None else "")
        q = v.get("queued")
        if q:
            slots += f" · {q:.0f} queued"
        snap = tick.notes.get("steady")
        last_reply = getattr(snap, "last_reply_tok_s", None)
        idle = busy == 0
        if idle:
            slots = f"idle · last reply {last_reply:,.0f} tok/s" if last_reply is not None else "idle"
        # nothing decodes while every slot is idle: no rate, whatever a window still emptying says ("48.1 tok/s
        # · idle" read as a live rate); the last reply's own figure is in the detail line
        self.cards["decode"].show_value("—" if idle else fmt_value(dec, "{:.1f}", "tok/s"), slots, sim,
                                        why("engine") or self._decode_tip(tick, last_reply))
        live = tick.notes.get("prefill_live")
        state = self._state_text(tick)
        # not live: the last request's rate, said in the value itself (the value changes every tick anyway;
        # a title that changed would relay the card out)
        pre_text = fmt_value(pre, "{:.0f}", "tok/s")
        self.cards["prefill"].show_value(pre_text if live is not False or pre is None else f"last {pre_text}",
                                         state if live is not False else
                                         f"last request · {state.removeprefix('state: ')}".rstrip(" ·"),
                                         sim, why("engine") or (
                                             "Prompt tokens read per second, live while a prompt is read. "
                                             + PREFILL_SLOTS_NOTE if live is not False else
                                             "No prompt is being read now: this is the last request's prompt "
                                             "rate, not a live one; the Throughput plot leaves a gap here. "
                                             + PREFILL_SLOTS_NOTE),
                                         stale=live is False)
        hr, roll, pred = v.get("hit_rate"), v.get("hit_rate_rolling"), tick.predicted_hit_rate
        pred_s = "planner: unknown" if pred is None else f"planner {pred * 100:.1f}%"
        # Strata reports a hit rate only when a request finishes (no live figure): the adapter's extra says the
        # newest finished request's (hit_rate_last) and a token-weighted one over the recent finished requests
        hx = getattr(tick.sample, "extra", None) or {}
        hr_last, hr_recent, hr_n = hx.get("hit_rate_last"), hx.get("hit_rate_recent"), hx.get("hit_rate_recent_requests")
        no_live = hr is None and hr_last is not None
        if no_live:
            hr = hr_last
        hr_text = fmt_value(None if hr is None else hr * 100, "{:.1f}", "%")
        idle_hr = (busy == 0 and hr is not None and tick.engine != "llamacpp") or no_live  # llama.cpp's: placement's
        rolling = (f"last {hr_n:.0f} requests {fmt_value(hr_recent * 100, '{:.1f}', '%')}"
                   if hr_recent is not None and hr_n else
                   f"rolling {fmt_value(None if roll is None else roll * 100, '{:.1f}', '%')}")
        self.cards["hit"].show_value(f"last request {hr_text}" if hr_last is not None and idle_hr else
                                     f"last {hr_text}" if idle_hr else hr_text,
                                     f"{rolling} · {pred_s}", sim, why("engine") or (
                                         "The newest finished request's share of expert picks that hit the GPU: "
                                         "the engine reports it when a request finishes, not while one runs."
                                         if no_live else
                                         "Idle: the last request's share of expert picks that hit the GPU."
                                         if idle_hr else "Expert picks that hit the GPU, while decoding."),
                                     stale=idle_hr)
        sw, swmb, swt = v.get("swaps_per_s"), v.get("swap_mb_s"), v.get("swaps_total")
        det = fmt_value(swmb, "{:.0f}", "MB/s")
        if swt is not None:
            det += f" · {swt:,.0f} total"
        if "swap_mb_s" in tick.origin and tick.origin["swap_mb_s"].startswith("estimate"):
            det += " (est.)"
        self.cards["swaps"].show_value(fmt_value(sw, "{:.2f}", "/s"), det,
                                       sim and tick.origin.get("swaps_per_s") == "simulated",
                                       "; ".join(x for x in (why("engine"), why("log")) if x))
        rx, tx = v.get("pcie_rx_mb_s"), v.get("pcie_tx_mb_s")
        gen_, width = v.get("gpu_pcie_gen"), v.get("gpu_pcie_width")
        link = f" · gen {gen_:.0f} ×{width:.0f}" if gen_ is not None and width is not None else ""
        self.cards["pcie"].show_value(f"RX {fmt_value(rx, '{:.0f}', 'MB/s')}",
                                      f"TX {fmt_value(tx, '{:.0f}', 'MB/s')}{link}",
                                      tick.origin.get("pcie_rx_mb_s") == "simulated", why("gpu"))
        vu, vt = v.get("vram_used_bytes"), v.get("vram_total_bytes")
        self.cards["vram"].show_value(self._gib_pair(vu, vt), _origin_words(tick.origin.get("vram_used_bytes")),
                                      tick.origin.get("vram_used_bytes") == "simulated",
                                      "; ".join(x for x in (why("gpu"), why("engine")) if x))
        ru, rt = v.get("ram_used_bytes"), v.get("ram_total_bytes")
        self.cards["ram"].show_value(self._gib_pair(ru, rt), "host (psutil)", False, why("host"))
        cb, cr, ct = v.get("cpu_bound_pct"), v.get("cpu_rest_pct"), v.get("cpu_total_pct")
        if cb is not None:
            self.cards["cpu"].show_value(f"bound {fmt_value(cb, '{:.0f}', '%')}",
                                         f"rest {fmt_value(cr, '{:.0f}', '%')} · all {fmt_value(ct, '{:.0f}', '%')}",
                                         False, why("host"))
        else:
            self.cards["cpu"].show_value(f"all {fmt_value(ct, '{:.0f}', '%')}", "engine not bound to a node",
                                         False, why("host") or "The engine runs without a NUMA binding, so there "
                                         "is no bound/rest split.")
        gu, pw, tc = v.get("gpu_util_pct"), v.get("gpu_power_w"), v.get("gpu_temp_c")
        self.cards["gpu"].show_value(fmt_value(gu, "{:.0f}", "%"),
                                     "no NVIDIA GPU" if "gpu" in miss and gu is None
                                     else f"{fmt_value(pw, '{:.0f}', 'W')} · {fmt_value(tc, '{:.0f}', '°C')}",
                                     False, why("gpu"))
        rss, ecpu = v.get("engine_rss_bytes"), v.get("engine_cpu_pct")
        self.cards["engine"].show_value(fmt_value(None if rss is None else rss / GiB, "{:.2f}", "GiB"),
                                        f"CPU {fmt_value(ecpu, '{:.0f}', '%')} of a core",
                                        False, why("host") or str(tick.notes.get("engine_process", "")))
        if abs(tick.t - getattr(self, "_compared_at", -1e18)) >= self.COMPARE_EVERY_S - 0.01:
            self._compared_at = tick.t
            self._update_compare(tick)
        self._update_status()

    def _decode_tip(self, tick: M.Tick, last_reply: float | None) -> str:
        per = f"{1.0 / tick.hz:g} s poll interval" if tick.engine == "llamacpp" else "last 2 s (the engine's window)"
        tip = (f"Tokens generated per second over the {per}, all slots together. A reply shorter than that is "
               "averaged with the idle time around it, so a short burst reads lower than the chat's own figure.")
        if last_reply is not None:
            tip += f" The newest finished reply decoded at {last_reply:,.1f} tok/s by the engine's own timing."
        return tip

    def _state_text(self, tick: M.Tick) -> str:
        st = tick.sample.state if tick.sample is not None else None
        return f"state: {st}" if st else ""

    @staticmethod
    def _gib_pair(used: float | None, total: float | None) -> str:
        if used is None:
            return "—"
        if total is None:
            return f"{used / GiB:.1f} GiB"
        return f"{used / GiB:.1f} / {total / GiB:.0f} GiB"

    def _update_compare(self, tick: M.Tick) -> None:
        """The guides card judges the steady decode rate the hub tracks (``tick.notes["steady"]``): not the
        live window rate, which reads low while users start and finish."""
        v = tick.values
        hr = v.get("hit_rate_rolling")
        if hr is None:
            hr = v.get("hit_rate")
        model = tick.notes.get("model")
        if model:
            self.engine_info["model"] = model
        c = guides.judge(tick.notes.get("steady"), hr, simulated=tick.simulated,
                         numa_bound=self.engine_info.get("numa_bound"), pcie_gen=v.get("gpu_pcie_gen"),
                         pcie_width=v.get("gpu_pcie_width"), model=model or self.engine_info.get("model"))
        self.compare.show_comparison(c)
        self.last_comparison = c

    def _update_status(self) -> None:
        hub = self.hub
        if hub is None:
            return
        parts = [f"{hub.engine}" + (" (simulated)" if hub.simulated else "") + f" · {hub.hz:g} Hz"]
        if hub.recorder is not None and not hub.record_error:
            # the run's folder and file; the whole path is in the tooltip
            csv = hub.recorder.csv_path
            parts.append(f"recording to {csv.parent.name}/{csv.name}")
        if hub.record_error:
            parts.append(hub.record_error)
        t = self.last_tick
        # a source that cannot work on this machine (no NVIDIA GPU) is said on its card, not here every tick
        never = {s.name for s in hub.sources if s.unavailable}
        missing = {k: v for k, v in (t.missing.items() if t is not None else ()) if k not in never}
        if missing:
            parts.append("missing: " + "; ".join(f"{k} ({v})" for k, v in sorted(missing.items())))
        text = " · ".join(parts)
        self.status.setText(text)
        if hub.recorder is not None and not hub.record_error:
            self.status.setToolTip(f"{text}\n\nRecording: {hub.recorder.csv_path}")

    # -- export -----------------------------------------------------------------------------------------------
    def current_recording(self) -> Path | None:
        hub = self.hub
        if hub is not None and hub.recorder is not None:
            return hub.recorder.csv_path
        runs = M.list_runs()
        return runs[0].csv_path if runs else None

    def export_dialog(self) -> None:
        rec = self.current_recording()
        if rec is None and self.store is None:
            self.ctx.statusMessage.emit("Nothing to export yet: start the engine first.", 5000)
            return
        default = str(Path.home() / f"dsv41-metrics-{time.strftime('%Y%m%d-%H%M%S')}.csv")
        path, _ = QFileDialog.getSaveFileName(self, "Export metrics as CSV", default, "CSV files (*.csv)")
        if not path:
            return
        self.export_to(Path(path))

    def export_to(self, dest: Path, on_done: Callable[[int], None] | None = None) -> None:
        rec = self.current_recording()
        store = self.store

        def done(n: int) -> None:
            self.ctx.statusMessage.emit(f"Exported {n:,} samples to {dest}", 8000)
            if on_done is not None:
                on_done(n)

        def failed(exc: BaseException) -> None:
            self.ctx.statusMessage.emit(f"Export failed: {exc}. Choose another folder and try again.", 10000)

        if rec is not None and rec.exists():
            run_function(M.export_csv, dest, recording=rec, on_done=done, on_error=failed)
        else:
            run_function(M.export_csv, dest, store=store, on_done=done, on_error=failed)


def _origin_words(origin: str | None) -> str:
    return {"simulated": "modelled by the scripted engine", "driver": "GPU driver (NVML)",
            "engine": "reported by the engine"}.get(origin or "", "")


def _make_hub(info: dict[str, Any], hz: float, plan: dict | None, old_store: M.RingStore | None,
              recorder: M.Recorder | None = None) -> tuple[M.MetricsHub, M.RingStore, dict[str, Any], int]:
    """Off the GUI thread: :func:`engine_manager.metrics.hub_for_running_engine` (asks the supervisor, builds
    the hub, loads the run recorded so far)."""
    info = dict(info)
    sup = info.pop("supervisor", None)
    return M.hub_for_running_engine(info, hz, plan, supervisor=sup, old_store=old_store, recorder=recorder)
