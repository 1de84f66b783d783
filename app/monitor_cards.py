"""The Monitor's cards: a "now" card per metric (:class:`NowCard`, drawn from
:class:`engine_manager.metrics.presenter.CardText`) and the card comparing the live figures with the guides'
(:class:`CompareCard`). What the cards say is computed in :mod:`engine_manager.metrics.presenter`, which
``dsv41 monitor`` shares; these widgets only draw it.
"""

from __future__ import annotations

import html

from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QColor, QFont, QFontMetrics, QFontMetricsF, QPainter, QPalette
from PySide6.QtWidgets import (
    QFrame,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QSizePolicy,
    QVBoxLayout,
    QWidget,
)

from engine_manager.metrics import guides
from engine_manager.metrics.presenter import CardText, fmt_value


class ElidedLabel(QLabel):
    """One line that never runs off its box: too long, it is shortened ("…", in the middle unless ``mode`` says
    otherwise), the whole text in the tooltip; ``text()`` gives the whole text."""

    def __init__(self, text: str = "", parent=None, mode: Qt.TextElideMode = Qt.TextElideMode.ElideMiddle):
        super().__init__(parent)
        self._full = ""
        self._mode = mode
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
        shown = self.fontMetrics().elidedText(self._full, self._mode, width)
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


# The cards paint their own rounded background and coloured words (palette roles and a paintEvent) instead of
# style sheets: a style sheet on a card made Qt draw each of its labels through the style-sheet style, and the
# cards' repaints cost ~0.15 % of a core at 1 Hz more (benchmarks/panel_cpu.py, the cards' style sheets taken off in
# the same run: the GUI thread 1.72–1.75 % → 1.57–1.60 %).
CARD_RADIUS = 4.0


def _paint_patch(w: QWidget, color: QColor, radius: float) -> None:
    """A rounded patch of ``color`` over the whole of ``w``."""
    p = QPainter(w)
    p.setRenderHint(QPainter.RenderHint.Antialiasing)
    p.setPen(Qt.PenStyle.NoPen)
    p.setBrush(color)
    p.drawRoundedRect(QRectF(w.rect()), radius, radius)
    p.end()


def _paint_card(w: QWidget) -> None:
    """The card's patch: the palette's base colour (white, or dark in the dark theme), rounded corners."""
    _paint_patch(w, w.palette().color(QPalette.ColorRole.Base), CARD_RADIUS)


class Pill(QLabel):
    """A short word on a rounded patch of colour: the "sim." tag, the guides card's verdict."""

    def __init__(self, text: str = "", bg: str | None = None, fg: str | None = None, pad: tuple[int, int] = (3, 0),
                 parent=None):
        super().__init__(text, parent)
        self.setContentsMargins(pad[0], pad[1], pad[0], pad[1])
        self._bg: QColor | None = None
        self.colors: tuple[str | None, str | None] = (None, None)
        self.set_colors(bg, fg)

    def set_colors(self, bg: str | None, fg: str | None) -> None:
        """``bg``/``fg`` as "#rrggbb"; None: no patch / the palette's text colour."""
        if (bg, fg) == self.colors:
            return
        self.colors = (bg, fg)
        self._bg = QColor(bg) if bg else None
        pal = self.palette()
        if fg:
            pal.setColor(QPalette.ColorRole.WindowText, QColor(fg))
            self.setPalette(pal)
        else:
            self.setPalette(QPalette())            # back to the inherited one
        self.update()

    def paintEvent(self, ev) -> None:  # noqa: N802 - Qt's name
        if self._bg is not None and self.text():
            _paint_patch(self, self._bg, 3.0)
        super().paintEvent(ev)


class NowCard(QFrame):
    """One metric's current value: a title, a big value, a line of detail, an optional "simulated" tag."""

    def __init__(self, key: str, title: str, parent=None, full_title: str = ""):
        super().__init__(parent)
        self.key = key
        self.setObjectName(f"nowCard_{key}")
        self.setFrameShape(QFrame.Shape.NoFrame)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(6, 3, 6, 3)
        lay.setSpacing(0)
        top = QHBoxLayout()
        # never cut silently: a title too long for the card is shortened with "…", the whole one in its tooltip
        self.title = ElidedLabel(title, mode=Qt.TextElideMode.ElideRight)
        self.title.setToolTip(full_title or title)
        f = self.title.font()
        f.setPointSizeF(max(7.0, f.pointSizeF() * 0.85))
        self.title.setFont(f)
        self.title.setForegroundRole(QPalette.ColorRole.PlaceholderText)   # greyed, readable in both themes
        # short, so the title beside it keeps its room ("Expert swap…" was cut by "simulated")
        self.tag = Pill("sim.", "#fff1cc", "#8a5a00")
        self.tag.setToolTip("simulated: modelled by the scripted engine, not measured on hardware")
        self.tag.setFont(f)
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
        self.detail.setForegroundRole(QPalette.ColorRole.PlaceholderText)
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

    def show(self, c: CardText) -> None:
        """Draw what :func:`engine_manager.metrics.presenter.cards` computed for this card."""
        self.show_value(c.value, c.detail, c.simulated, c.tip, stale=c.stale)

    def set_stale(self, stale: bool) -> None:
        if getattr(self, "_stale", False) != stale:          # only on change; a palette role, not a style sheet
            self._stale = stale                               # (re-polishing a style sheet costs more)
            self.value.setForegroundRole(QPalette.ColorRole.PlaceholderText if stale else QPalette.ColorRole.WindowText)

    def paintEvent(self, ev) -> None:  # noqa: N802 - Qt's name
        _paint_card(self)

    def is_stale(self) -> bool:
        return getattr(self, "_stale", False)



class CompareCard(QFrame):
    """The live figures beside the guides' for the same number of active users: a strip under the cards."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setObjectName("compareCard")
        self.setFrameShape(QFrame.Shape.NoFrame)
        # badge | table | hint (wide) — or, when the hint would be squeezed, the hint on one line under them
        lay = QGridLayout(self)
        lay.setContentsMargins(8, 3, 8, 3)
        lay.setHorizontalSpacing(12)
        lay.setVerticalSpacing(0)
        self.badge = Pill("", pad=(6, 1))
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
                                    "picks in VRAM, 1 min")):
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
                "unreachable": ("#fff1cc", "#8a5a00", "unreachable"),
                "problem": ("#fdecea", "#a02a1a", "not usable"),
                "unknown": ("#eeeeee", "#555555", "—")}

    def _badge(self, verdict: str, simulated: bool = False) -> None:
        bg, fg, word = self.VERDICTS.get(verdict, self.VERDICTS["unknown"])
        if simulated and verdict in ("as_published", "below"):
            word += " · sim."
        if self.badge.text() != word:
            self.badge.setText(word)
        self.badge.set_colors(bg, fg)                 # only on change

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

    def paintEvent(self, ev) -> None:  # noqa: N802 - Qt's name
        _paint_card(self)

    def resizeEvent(self, ev) -> None:
        super().resizeEvent(ev)
        self._place_hints()

    def show_comparison(self, c: guides.Comparison | None) -> None:
        self.comparison = c
        if c is None:
            self.badge.setText("")
            self.badge.set_colors(None, None)
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

    def show_unreachable(self, state: str, text: str) -> None:
        """The watched connection cannot be used (``state`` "unreachable" or "problem"): the reason and when it
        was last seen, whole (it wraps; the tooltip has it too), and no figure — of it or of another engine."""
        self.comparison = None
        self._badge("unreachable" if state == "unreachable" else "problem")
        self._set_table_visible(False)
        self._hints(html.escape(text), text)
        self.setToolTip(text)

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

