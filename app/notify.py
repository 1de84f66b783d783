"""Desktop notifications, off by default (the ``desktop_notifications`` setting): the engine crashed, stalled, or a
planned-vs-measured check failed — each said once (:class:`engine_manager.desktop_notices.NoticeFilter` decides).

:class:`Notifier` listens to the window's :class:`~app.context.AppContext`: ``engineStateChanged`` (the crash; its
cause from the supervisor's ``last_failure``), ``sampleArrived`` (the watchdog's stall; each verdict is also
re-emitted as ``ctx.livenessReported``, the engine panel's stalled line), ``checksReported`` (the engine column's
checks). It sends through ``send(title, body)``: given (tests), else chosen at the first notice —
``QSystemTrayIcon.showMessage`` when the desktop has a tray, else ``notify-send`` (an argument list, off the GUI
thread) when it is installed, else nothing.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import Any, Callable

from PySide6.QtCore import QObject
from PySide6.QtWidgets import QApplication, QStyle, QSystemTrayIcon

from engine_manager.desktop_notices import Notice, NoticeFilter
from engine_manager.engine_state import CRASHED

from .workers import run_function

Sender = Callable[[str, str], None]
NOTIFY_SEND_TIMEOUT_S = 10.0
APP_NAME = "dsv41 panel"


def _notify_send(argv: list[str]) -> int:
    try:
        return subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=NOTIFY_SEND_TIMEOUT_S, check=False).returncode
    except (OSError, subprocess.TimeoutExpired):      # a notification that cannot be shown is no error of the panel
        return -1


def notify_send_sender(exe: str) -> Sender:
    """Send with the ``notify-send`` at ``exe``, on a worker thread (it may wait for the desktop's bus)."""
    def send(title: str, body: str) -> None:
        run_function(_notify_send, [exe, f"--app-name={APP_NAME}", "--", title, body], on_error=lambda _exc: None)
    return send


def tray_sender(parent: QObject | None = None) -> Sender:
    """Send as a message of a tray icon (shown when the first message is sent)."""
    holder: list[QSystemTrayIcon] = []

    def send(title: str, body: str) -> None:
        if not holder:
            app = QApplication.instance()
            icon = app.windowIcon() if isinstance(app, QApplication) else None
            if icon is None or icon.isNull():
                icon = QApplication.style().standardIcon(QStyle.StandardPixmap.SP_MessageBoxInformation)
            tray = QSystemTrayIcon(icon, parent)
            tray.setToolTip(APP_NAME)
            tray.show()
            holder.append(tray)
        holder[0].showMessage(title, body, QSystemTrayIcon.MessageIcon.Information, 10_000)
    return send


def desktop_sender(parent: QObject | None = None) -> Sender | None:
    """The tray when the desktop has one, else ``notify-send`` when installed, else None (nothing is sent)."""
    if QSystemTrayIcon.isSystemTrayAvailable():
        return tray_sender(parent)
    exe = shutil.which("notify-send")
    return notify_send_sender(exe) if exe else None


class Notifier(QObject):
    """Turns the context's engine events into desktop notifications while the setting is on. ``send``: the
    sender to use (default: :func:`desktop_sender`, chosen at the first notice)."""

    def __init__(self, ctx, send: Sender | None = None, parent: QObject | None = None):
        super().__init__(parent)
        self.ctx = ctx
        self.filter = NoticeFilter()
        self._send = send
        self._chosen = send is not None
        ctx.engineStateChanged.connect(self._on_state)
        ctx.sampleArrived.connect(self._on_sample)
        ctx.checksReported.connect(self._on_checks)
        ctx.engineRunning.connect(lambda _r: self.filter.new_watched())
        ctx.ownEngineChanged.connect(lambda _r: self.filter.new_own())

    @property
    def enabled(self) -> bool:
        return bool(getattr(self.ctx.settings, "desktop_notifications", False))

    def _on_state(self, ev: Any) -> None:
        state = str(getattr(ev, "state", ev))
        cause = None
        if state == CRASHED:
            try:
                cause = getattr(self.ctx.supervisor.last_failure, "cause", None)
            except Exception:  # noqa: BLE001 - no supervisor to ask: a crash without its cause
                cause = None
        self._say(self.filter.state(state, str(getattr(ev, "message", "") or ""), cause))

    def _on_sample(self, sample: Any) -> None:
        # the window's one watchdog (the filter's) judges the sample; its verdict goes to the engine panel too
        notice = self.filter.sample(sample)
        if self.filter.watchdog.last is not None:
            self.ctx.livenessReported.emit(self.filter.watchdog.last)
        self._say(notice)

    def _on_checks(self, report: Any) -> None:
        if report is not None:
            self._say(self.filter.checks(report.checks))

    def _say(self, notice: Notice | None) -> None:
        # the filter hears every event whether or not the setting is on: turning it on later says no old news
        if notice is None or not self.enabled:
            return
        if not self._chosen:
            self._send, self._chosen = desktop_sender(self), True
        if self._send is not None:
            self._send(notice.title, notice.body)
