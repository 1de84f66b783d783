"""Status bar widgets: engine state, RAM, CPU and GPU, refreshed every 2 s off the GUI thread, and the GPU
warnings (:mod:`engine_manager.gpu_warnings`: heat, power, slowdowns) as an amber label whose tooltip says what
each means and what to do; hidden while there is none (and on a machine without an NVIDIA GPU).

The engine label follows ``ctx.engineStateChanged`` — the events the engine panel's badge is drawn from (the panel
emits one whenever its badge changes) — and uses the badge's words, so the two never disagree. The bar also owns
the window's desktop notifications (:class:`app.notify.Notifier`, off unless the setting is on)."""

from __future__ import annotations

from html import escape

from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QLabel, QStatusBar

from engine_manager import sysstat
from engine_manager.fmt import GIB
from engine_manager.gpu_warnings import GpuWarning, GpuWatch, WarningReport

from .engine_panel import BADGE
from .notify import Notifier
from .workers import TaskOwner

WARNING_STYLE = ("QLabel#statusGpuWarning { background: #fff4e5; color: #7a4b00; border: 1px solid #c88a00; "
                 "border-radius: 3px; padding: 0 6px; }")


class LiveStatusBar(QStatusBar):
    def __init__(self, ctx, parent=None):
        super().__init__(parent)
        self.ctx = ctx
        # opaque: a new figure repaints the bar alone, not the main window behind it as well
        self.setAutoFillBackground(True)
        self.warning_label = QLabel()
        self.warning_label.setObjectName("statusGpuWarning")
        self.warning_label.setStyleSheet(WARNING_STYLE)
        self.warning_label.hide()
        self.addPermanentWidget(self.warning_label)
        self.warnings: list[GpuWarning] = []
        self.gpu_watch = GpuWatch()          # the hysteresis lives across readings: one per bar
        self.notifier = Notifier(ctx, parent=self)
        self.engine_label = QLabel(self.engine_text("stopped"))
        self.engine_label.setObjectName("statusEngine")
        self.ram_label = QLabel("RAM –")
        self.cpu_label = QLabel("CPU –")
        self.gpu_label = QLabel("GPU –")
        for w in (self.engine_label, self.ram_label, self.cpu_label, self.gpu_label):
            w.setMinimumWidth(90)
            self.addPermanentWidget(w)
        self.tasks = TaskOwner(self)        # "read": one reading (figures and GPU warnings) at a time
        self.timer = QTimer(self)
        self.timer.setInterval(2000)
        self.timer.timeout.connect(self.refresh)
        self.timer.start()
        ctx.statusMessage.connect(self.showMessage)
        ctx.engineStateChanged.connect(self._on_state)
        if ctx.engine_state_event is not None:      # the badge changed before this bar was built
            self._on_state(ctx.engine_state_event)
        QTimer.singleShot(0, self.refresh)

    @staticmethod
    def engine_text(state: str) -> str:
        words = BADGE.get(state, (state,))[0]
        return f"engine: {words[:1].lower() + words[1:]}"

    def _on_state(self, ev) -> None:
        state = str(getattr(ev, "state", ev))
        self.engine_label.setText(self.engine_text(state))
        self.engine_label.setToolTip(getattr(ev, "message", "") or "")

    def refresh(self) -> None:
        # a reading still under way is kept (replace=False): a slow one is not stacked up every 2 s. One task for
        # both readings: each task's start and hand-back cost the GUI thread more than both readings (~0.1 ms)
        self.tasks.start("read", self._read, on_done=self._show_both, replace=False)

    def _read(self) -> tuple[sysstat.SysStat, WarningReport | list[GpuWarning]]:     # a worker thread
        return sysstat.read(), self.gpu_watch.poll()

    def _show_both(self, got: tuple[sysstat.SysStat, WarningReport | list[GpuWarning]]) -> None:
        self._show(got[0])
        self.show_warnings(got[1])

    def show_warnings(self, report: WarningReport | list[GpuWarning]) -> None:
        """The active GPU warnings (a :class:`WarningReport` or its list): the first one's title on the amber
        label (and how many more), every one's meaning and fix in its tooltip; hidden when there is none."""
        warnings = list(report.warnings if isinstance(report, WarningReport) else report)
        self.warnings = warnings
        if not warnings:
            self.warning_label.hide()
            self.warning_label.setToolTip("")
            return
        more = f" (+{len(warnings) - 1} more)" if len(warnings) > 1 else ""
        self.warning_label.setText(f"⚠ {warnings[0].title}{more}")
        # rich text: Qt wraps it (a plain-text tooltip runs off the screen)
        self.warning_label.setToolTip("".join(f"<p><b>{escape(w.title)}</b><br>{escape(w.meaning[:1].upper())}"
                                              f"{escape(w.meaning[1:])}<br>{escape(w.fix)}</p>" for w in warnings))
        self.warning_label.show()

    def _show(self, st: sysstat.SysStat) -> None:
        self.ram_label.setText(f"RAM {st.ram_used_bytes / GIB:.1f}/{st.ram_total_bytes / GIB:.0f} GiB")
        self.cpu_label.setText(f"CPU {st.cpu_pct:.0f}%")
        if st.gpus:
            g = st.gpus[0]
            util = f"{g.util_pct:.0f}%" if g.util_pct is not None else "?"
            mem = (f" {g.vram_used_bytes / GIB:.1f}/{g.vram_total_bytes / GIB:.0f} GiB"
                   if g.vram_used_bytes is not None else "")
            self.gpu_label.setText(f"GPU {util}{mem}")
            self.gpu_label.setToolTip("")
        else:
            self.gpu_label.setText("GPU: none")
            self.gpu_label.setToolTip(st.gpu_error or "")
