"""Status bar widgets: engine state, RAM, CPU and GPU, refreshed every 2 s off the GUI thread.

The engine label follows ``ctx.engineStateChanged`` — the events the engine panel's badge is drawn from (the panel
emits one whenever its badge changes) — and uses the badge's words, so the two never disagree."""

from __future__ import annotations

from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QLabel, QStatusBar

from engine_manager import sysstat
from engine_manager.fmt import GIB

from .engine_panel import BADGE
from .workers import TaskOwner


class LiveStatusBar(QStatusBar):
    def __init__(self, ctx, parent=None):
        super().__init__(parent)
        self.ctx = ctx
        self.engine_label = QLabel(self.engine_text("stopped"))
        self.engine_label.setObjectName("statusEngine")
        self.ram_label = QLabel("RAM –")
        self.cpu_label = QLabel("CPU –")
        self.gpu_label = QLabel("GPU –")
        for w in (self.engine_label, self.ram_label, self.cpu_label, self.gpu_label):
            w.setMinimumWidth(90)
            self.addPermanentWidget(w)
        self.tasks = TaskOwner(self)        # "read": one sysstat reading at a time
        self.timer = QTimer(self)
        self.timer.setInterval(2000)
        self.timer.timeout.connect(self.refresh)
        self.timer.start()
        ctx.statusMessage.connect(self.showMessage)
        ctx.engineStateChanged.connect(self._on_state)
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
        # a reading still under way is kept (replace=False): a slow one is not stacked up every 2 s
        self.tasks.start("read", sysstat.read, on_done=self._show, replace=False)

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
