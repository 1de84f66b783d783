"""The engine column's "planned vs measured" line: amber with the failed check's figures and fix, a quiet line when
every known check is ok, hidden while no engine of the panel's own is ready.

The checks (:func:`engine_manager.checks.collect_checks`: one ``/metrics`` read, /proc, NVML) run on a worker a few
seconds after the engine is ready and then every minute; the widget only renders them.
"""

from __future__ import annotations

from html import escape

from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import QLabel

from .panel_base import Panel
from .workers import TaskOwner

FIRST_MS = 3000          # right after start (the engine has printed its INFO line; a first request may follow)
EVERY_MS = 60_000        # then every minute
AMBER = "#9a6a00"


class ChecksView(Panel, QLabel):
    def __init__(self, ctx, parent=None):
        super().__init__(parent)
        self.setObjectName("engineChecks")
        self.setWordWrap(True)
        self.setTextFormat(Qt.TextFormat.RichText)
        self.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.hide()
        self.report = None
        self.ctx = ctx
        self._running = None
        self.tasks = TaskOwner(self)
        self.timer = QTimer(self)
        self.timer.timeout.connect(self.refresh)
        ctx.ownEngineChanged.connect(self._engine_changed)

    def _engine_changed(self, running) -> None:
        self._running = running
        self.timer.stop()
        self.tasks.cancel("checks")
        if running is None:
            self.report = None
            self.hide()
            return
        self.timer.start(EVERY_MS)
        QTimer.singleShot(FIRST_MS, self.refresh)

    def refresh(self) -> None:
        running = self._running
        if running is None or self.tasks.shut_down:
            return
        from engine_manager.checks import collect_checks    # with the first engine: not on the column's first step

        self.tasks.start("checks", collect_checks, running, on_done=self.show_report)

    def show_report(self, report) -> None:
        from engine_manager.checks import failed, summary

        self.report = report
        if report is None or self._running is None:
            self.hide()
            return
        self.ctx.checksReported.emit(report)     # the desktop notifications hear it (app.notify)
        bad = failed(report.checks)
        self.setToolTip("<br>".join(escape(c.line()) for c in report.checks))
        if bad:
            lines = [f"<b>Not as planned</b> — {escape(summary(report.checks))}"]
            lines += [f"<b>{escape(c.title)}</b>: planned {escape(c.planned or '—')}, measured "
                      f"{escape(c.measured or '—')}. {escape(c.fix)}" for c in bad]
            self.setStyleSheet(f"color: {AMBER}; border: 1px solid {AMBER}; border-radius: 4px; padding: 4px;")
            self.setText("<br>".join(lines))
        else:
            self.setStyleSheet("color: palette(mid);")
            self.setText(f"Planned vs measured: {escape(summary(report.checks))}")
        self.show()

    def shutdown(self, wait_ms: int = 0) -> None:
        self.timer.stop()
        self.tasks.shutdown(wait_ms)
