"""The compact view (View ▸ Compact view, Ctrl+Shift+M): a small window that stays on top of the others, with the
engine's state, decode tok/s, the share of expert picks served from VRAM, swaps/s and VRAM.

It is fed by the ticks the Monitor shows (``MonitorView.tickShown``, given as ``ticks``) and the engine column's
state events (``ctx.engineStateChanged``, in the badge's words); the lines are
:func:`engine_manager.metrics.compact.compact_figures`, the Monitor cards' own values — a missing figure is "—",
never 0. Its position is remembered (``engine_manager.uistate``, key ``compact_view``). This module imports only
Qt and ``uistate`` at first: the main window imports it to build its menu, the rest comes when the view opens.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QPoint, Qt, QTimer
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QGridLayout, QLabel, QWidget

from engine_manager import uistate

STATE_KEY = "compact_view"          # uistate: {"x": int, "y": int}
SAVE_DELAY_MS = 500                 # a window dragged across the screen is saved once it rests


def saved_position() -> tuple[int, int] | None:
    try:
        st = uistate.load().get(STATE_KEY)
    except (OSError, ValueError):
        return None
    if isinstance(st, dict) and all(isinstance(st.get(k), int) and not isinstance(st.get(k), bool)
                                    for k in ("x", "y")):
        return int(st["x"]), int(st["y"])
    return None


class CompactView(QWidget):
    """``ticks``: the signal that carries each Tick the Monitor shows (None: fed through :meth:`on_tick`)."""

    def __init__(self, ctx, parent=None, ticks=None):
        super().__init__(parent, Qt.WindowType.Window | Qt.WindowType.WindowStaysOnTopHint)
        from engine_manager.metrics.compact import ROWS

        self.ctx = ctx
        self.setObjectName("compactView")
        self.setWindowTitle("dsv41 — compact")
        self._state_words: str | None = None
        self._tick: Any = None
        grid = QGridLayout(self)
        grid.setContentsMargins(10, 8, 10, 8)
        grid.setHorizontalSpacing(12)
        grid.setVerticalSpacing(4)
        self.values: dict[str, QLabel] = {}
        for row, (key, label) in enumerate(ROWS):
            name = QLabel(label)
            name.setStyleSheet("QLabel { color: palette(mid); }")
            value = QLabel("—")
            value.setObjectName(f"compact_{key}")
            value.setStyleSheet("QLabel { font-weight: bold; }")
            value.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
            grid.addWidget(name, row, 0)
            grid.addWidget(value, row, 1)
            self.values[key] = value
        self.setMinimumWidth(340)             # "Ready · generating · simulated" on one line
        self._save_timer = QTimer(self)
        self._save_timer.setSingleShot(True)
        self._save_timer.setInterval(SAVE_DELAY_MS)
        self._save_timer.timeout.connect(self.save_position)
        self._restored = False
        if ticks is not None:
            ticks.connect(self.on_tick)
        ctx.engineStateChanged.connect(self.on_state)
        ctx.engineRunning.connect(self.on_running)
        snap = ctx.session.snapshot()              # the state now (no I/O); later ones come as events
        if snap is not None:
            self.on_state(snap)
        else:
            self.render()

    # -- what it shows ----------------------------------------------------------------------------------------
    def on_state(self, ev: Any) -> None:
        from .engine_panel import BADGE

        state = str(getattr(ev, "state", ev))
        self._state_words = BADGE.get(state, (state,))[0]
        self.render()

    def on_tick(self, tick: Any) -> None:
        self._tick = tick
        self.render()

    def on_running(self, running: Any) -> None:
        if running is None:                        # no engine watched: no live figures
            self._tick = None
            self.render()

    def render(self) -> None:
        from engine_manager.metrics.compact import compact_figures

        figures = compact_figures(self._tick, self._state_words)
        for key, text in figures.items():
            self.values[key].setText(text)
        watching = self.ctx.watching
        self.values["state"].setToolTip(f"The figures are the watched connection's ({watching}); the state is "
                                        "this panel's own engine's" if watching else "The panel's own engine")

    def texts(self) -> dict[str, str]:
        return {key: label.text() for key, label in self.values.items()}

    # -- where it is --------------------------------------------------------------------------------------------
    def restore_position(self) -> bool:
        """Move to the remembered position when it is still on a screen; True when it moved."""
        pos = saved_position()
        if pos is None or QGuiApplication.screenAt(QPoint(pos[0] + 20, pos[1] + 20)) is None:
            return False
        self.move(*pos)
        return True

    def save_position(self) -> None:
        try:
            uistate.save({STATE_KEY: {"x": int(self.x()), "y": int(self.y())}})
        except OSError:
            pass                                    # not remembered: the view still works

    def showEvent(self, ev) -> None:  # noqa: N802 - Qt's name
        if not self._restored:
            self._restored = True
            self.restore_position()
        super().showEvent(ev)

    def moveEvent(self, ev) -> None:  # noqa: N802 - Qt's name
        super().moveEvent(ev)
        if self.isVisible():
            self._save_timer.start()

    def hideEvent(self, ev) -> None:  # noqa: N802 - Qt's name
        super().hideEvent(ev)
        if self._save_timer.isActive():
            self._save_timer.stop()
            self.save_position()


def open_compact_view(win) -> CompactView | None:
    """View ▸ Compact view: show the window's compact view (made on first use), or hide it when it is shown."""
    if not getattr(win, "built", True):
        win.build_pages()
    if getattr(win, "ctx", None) is None:
        return None
    view = win.findChild(CompactView)
    if view is None:
        monitor = win.monitor_view
        view = CompactView(win.ctx, win, ticks=monitor.tickShown)
        if win.ctx.running is not None and monitor.last_tick is not None:
            view.on_tick(monitor.last_tick)
    if view.isVisible():
        view.hide()
        return view
    view.show()
    view.raise_()
    return view
