"""The Placement tab: the plan drawn — itemised VRAM and RAM budget bars, a layer × expert heatmap of placement and
routing frequency (hover: layer, expert, bytes, frequency), the coverage curve with the chosen point, a refusal in
plain words with the missing amount, and a Plan button that runs the planner off the GUI thread.

Everything is rendered from the plan's JSON dict (``ctx.plan``), so a plan made elsewhere (the engine panel, the CLI)
shows here too. The planning itself is ``engine_manager.plans.make_plan`` on a worker (``app.workers``).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPointF, QRectF, Qt, Signal
from PySide6.QtGui import QColor, QKeySequence, QPainter, QPen
from PySide6.QtWidgets import (QComboBox, QDoubleSpinBox, QFileDialog, QFrame, QHBoxLayout, QLabel, QPushButton,
                               QSizePolicy, QSplitter, QStackedWidget, QToolTip, QVBoxLayout, QWidget)

from engine_manager import placement, plans
from engine_manager import uistate
from engine_manager.fmt import GB, GIB, MIB
from engine_manager.metrics import presenter

from . import workers
from .panel_base import Panel

TERM_COLORS = {
    "non-expert weights": "#4e79a7", "KV cache": "#59a14f", "compute buffers": "#9c755f", "CUDA context": "#bab0ac",
    "reserve (--vram-reserve-mib)": "#d3d3d3", "hot experts": "#f28e2b",
    "cold experts (pinned)": "#76b7b2", "host copies of the hot experts (pinned)": "#f1ce63",
    "CPU-resident tensors": "#4e79a7", "pinned staging": "#9c755f", "OS headroom": "#bab0ac",
}
FALLBACK = ["#e15759", "#af7aa1", "#ff9da7", "#86bcb6", "#8cd17d"]


def _color(name: str, i: int) -> QColor:
    return QColor(TERM_COLORS.get(name, FALLBACK[i % len(FALLBACK)]))


class BudgetBar(QWidget):
    """One horizontal bar: the budget as the full width, each term a segment; overflow past the budget in red."""

    def __init__(self, title: str, unit: str, parent=None):
        super().__init__(parent)
        self.title, self.unit = title, unit              # unit: "GiB" or "GB"
        self.budget = 0
        self.terms: list[dict[str, Any]] = []
        self.setMinimumHeight(30)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setMouseTracking(True)
        self._rects: list[tuple[QRectF, str]] = []

    def fmt(self, n: float) -> str:
        return f"{n / GIB:.2f} GiB" if self.unit == "GiB" else f"{n / GB:.1f} GB"

    def set_budget(self, budget: int, terms: list[dict[str, Any]]) -> None:
        self.budget, self.terms = int(budget), list(terms)
        total = sum(int(t["bytes"]) for t in self.terms)
        self.setToolTip(f"{self.title}: {self.fmt(total)} of {self.fmt(self.budget)}")
        self.update()

    def paintEvent(self, _ev) -> None:
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing, False)
        r = self.rect().adjusted(0, 2, -1, -3)
        total = sum(int(t["bytes"]) for t in self.terms)
        scale_to = max(self.budget, total, 1)
        p.fillRect(r, self.palette().base())
        if not self.terms:                   # no plan yet: an empty bar, not a stray 0-wide outline
            p.setPen(QPen(self.palette().placeholderText().color(), 1))
            p.drawText(r, Qt.AlignmentFlag.AlignCenter, "no plan yet")
            p.end()
            return
        x = float(r.left())
        self._rects = []
        for i, t in enumerate(self.terms):
            w = r.width() * int(t["bytes"]) / scale_to
            rect = QRectF(x, r.top(), max(0.0, w), r.height())
            p.fillRect(rect, _color(t["name"], i))
            self._rects.append((rect, f"{t['name']}: {self.fmt(int(t['bytes']))}" +
                                (f"\n{t['note']}" if t.get("note") else "")))
            x += w
        if self.budget and total > self.budget:
            bx = r.left() + r.width() * self.budget / scale_to
            p.fillRect(QRectF(bx, r.top(), r.right() - bx, r.height() / 4), QColor("#e15759"))
            p.setPen(QPen(QColor("#e15759"), 2))
            p.drawLine(QPointF(bx, r.top() - 2), QPointF(bx, r.bottom() + 2))
        p.setPen(QPen(self.palette().text().color(), 1))
        p.drawRect(QRectF(r.left(), r.top(), r.width() * (self.budget / scale_to if scale_to else 1), r.height()))
        p.end()

    def mouseMoveEvent(self, ev) -> None:
        pos = ev.position()
        for rect, text in self._rects:
            if rect.contains(pos):
                QToolTip.showText(ev.globalPosition().toPoint(), text, self)
                return
        QToolTip.hideText()


class PlacementView(Panel, QWidget):
    planMade = Signal(object)              # the plan dict, after a plan made here

    def __init__(self, ctx, parent=None):
        super().__init__(parent)
        self.ctx = ctx
        self.plan: dict[str, Any] | None = None
        self.observed: np.ndarray | None = None
        self._observed_counts: np.ndarray | None = None    # as the monitor gave them (all blocks or MoE rows)
        self.usage_paths: list[str] = []
        self.tasks = workers.TaskOwner(self)       # "plan": the planner on a worker
        self._grid: dict[str, Any] = {}
        self.running_trace: str | None = None     # the running engine's --dump-routing trace (from the monitor)
        self.running_plan: dict[str, Any] | None = None
        self._mode_chosen = False                 # the user picked a heatmap mode: no automatic switch after that

        lay = QVBoxLayout(self)
        lay.setContentsMargins(6, 6, 6, 6)

        # -- controls ------------------------------------------------------------------------------------------
        row = QHBoxLayout()
        self.plan_button = QPushButton("&Plan")
        self.plan_button.setToolTip("Plan the placement for the chosen host (Ctrl+Shift+P)")
        self.plan_button.setShortcut(QKeySequence("Ctrl+Shift+P"))
        self.plan_button.clicked.connect(self.start_plan)
        row.addWidget(self.plan_button)
        row.addWidget(QLabel("for"))
        self.host = QComboBox()
        self.host.addItem("this host", "this")
        self.host.addItem("the guides' workstation (hypothetical)", "reference")
        self.host.setItemData(1, "RTX PRO 6000 Blackwell, 96 GB (97,887 MiB) VRAM, 280 GB RAM: the guides' "
                                 "reference host — not this machine", Qt.ItemDataRole.ToolTipRole)
        self.host.addItem("another host…", "custom")
        # as wide as its longest entry ("the guides' workstation (hypothetical)" was cut at 24 characters)
        self.host.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToContents)
        self.host.currentIndexChanged.connect(self._host_changed)
        row.addWidget(self.host)
        # Both sizes in GiB, as `dsv41 plan --vram-gib/--ram-gib` take them, so the same number gives the same plan
        # here and there; the RAM's GB figure (how RAM is sold) is shown beside it.
        self.vram = QDoubleSpinBox()
        self.vram.setRange(1, 4096)
        self.vram.setDecimals(2)
        self.vram.setSuffix(" GiB VRAM")
        self.vram.setToolTip("The GPU's memory in GiB (as `dsv41 plan --vram-gib` takes it); the guides' card has "
                             "97,887 MiB = 95.59 GiB")
        self.vram.setValue(placement.REFERENCE_VRAM_MIB / 1024)
        self.ram = QDoubleSpinBox()
        self.ram.setRange(1, 65536)
        self.ram.setDecimals(1)
        self.ram.setSuffix(" GiB RAM")
        self.ram.setToolTip("The host's RAM in GiB (as `dsv41 plan --ram-gib` takes it); 280 GB = 260.8 GiB")
        self.ram.setValue(placement.REFERENCE_RAM_BYTES / GIB)
        self.ram_gb = QLabel()
        self.ram_gb.setObjectName("ramInGB")
        self.ram.valueChanged.connect(self._ram_units)
        self._ram_units()
        row.addWidget(self.vram)
        row.addWidget(self.ram)
        row.addWidget(self.ram_gb)
        row.addStretch(1)
        # start with the plan on screen even when it was made for another host (the engine panel warns, naming it)
        self.start_with_plan = QPushButton("Start with this plan")
        self.start_with_plan.setObjectName("startWithPlan")
        self.start_with_plan.setToolTip("Start the engine with the plan shown here, even one made for another host "
                                        "(as `dsv41 start --plan FILE` does); a refused plan cannot start")
        self.start_with_plan.setEnabled(False)
        self.start_with_plan.clicked.connect(self.start_with_shown_plan)
        row.addWidget(self.start_with_plan)
        lay.addLayout(row)
        row = QHBoxLayout()
        self.add_usage = QPushButton("Add routing data…")
        self.add_usage.setToolTip("A --dump-routing trace, a saved frequency table, or a Strata profile")
        self.add_usage.clicked.connect(self._pick_usage)
        self.clear_usage = QPushButton("Clear")
        self.clear_usage.clicked.connect(self._clear_usage)
        # the running engine's routing trace is this tab's data without a click; this plans again from it
        self.replan_observed = QPushButton("Re-plan from observed routing")
        self.replan_observed.setObjectName("replanObserved")
        self.replan_observed.setToolTip("Plan again with the routing the running engine has observed (its "
                                        "--dump-routing trace) as the frequencies")
        self.replan_observed.clicked.connect(self.start_replan_observed)
        self.replan_observed.hide()
        row.addWidget(self.add_usage)
        row.addWidget(self.clear_usage)
        row.addWidget(self.replan_observed)
        row.addStretch(1)
        lay.addLayout(row)
        self.usage_label = QLabel()
        self.usage_label.setWordWrap(True)
        lay.addWidget(self.usage_label)

        # -- summary / refusal -----------------------------------------------------------------------------------
        self.summary = QLabel("No plan yet. Press Plan (Ctrl+Shift+P) to decide which experts live in VRAM.")
        self.summary.setWordWrap(True)
        self.summary.setTextFormat(Qt.TextFormat.RichText)
        self.summary.setFrameShape(QFrame.Shape.StyledPanel)
        self.summary.setMargin(6)
        lay.addWidget(self.summary)
        self.saved_note = QLabel()
        self.saved_note.setObjectName("planSavedNote")
        self.saved_note.setWordWrap(True)
        self.saved_note.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.saved_note.setStyleSheet("QLabel { color: #555; }")
        self.saved_note.hide()
        lay.addWidget(self.saved_note)

        # -- budget bars --------------------------------------------------------------------------------------------
        self.vram_title = QLabel("VRAM")
        self.vram_bar = BudgetBar("VRAM", "GiB")
        self.vram_legend = QLabel()
        self.vram_legend.setWordWrap(True)
        self.ram_title = QLabel("RAM")
        self.ram_bar = BudgetBar("RAM", "GB")
        self.ram_legend = QLabel()
        self.ram_legend.setWordWrap(True)
        for w in (self.vram_title, self.vram_bar, self.vram_legend, self.ram_title, self.ram_bar, self.ram_legend):
            lay.addWidget(w)

        # -- heatmap + coverage ------------------------------------------------------------------------------------
        split = QSplitter(Qt.Orientation.Horizontal)
        left = QWidget()
        ll = QVBoxLayout(left)
        ll.setContentsMargins(0, 0, 0, 0)
        hm_row = QHBoxLayout()
        hm_row.addWidget(QLabel("Heatmap:"))
        self.mode = QComboBox()
        self.mode.addItem("placement (VRAM / RAM)", "placement")
        self.mode.addItem("planned routing frequency", "frequency")
        self.mode.addItem("observed routing", "observed")
        self.mode.currentIndexChanged.connect(self._redraw_heatmap)
        self.mode.activated.connect(lambda _i: setattr(self, "_mode_chosen", True))
        hm_row.addWidget(self.mode)
        hm_row.addStretch(1)
        ll.addLayout(hm_row)
        self.heat = pg.PlotWidget()
        self.heat.setMenuEnabled(False)
        self.heat.setLabel("bottom", "expert")
        self.heat.setLabel("left", "MoE layer (block)")
        self.heat.invertY(True)
        self.image = pg.ImageItem()
        self.heat.addItem(self.image)
        # the colour scale beside the map: what a colour means in each mode (set in _redraw_heatmap)
        self.colorbar = pg.ColorBarItem(values=(0.0, 1.0), colorMap=pg.colormap.get("viridis"), interactive=False,
                                        width=14)
        self.colorbar.setImageItem(self.image, insert_in=self.heat.getPlotItem())
        self.heat.scene().sigMouseMoved.connect(self._hover)
        self.heat_stack = QStackedWidget()
        self.heat_empty = _empty_label("No plan yet: the layer × expert map appears here once you press Plan "
                                       "(Ctrl+Shift+P) — which experts live in VRAM, which in RAM.")
        self.heat_stack.addWidget(self.heat_empty)
        self.heat_stack.addWidget(self.heat)
        ll.addWidget(self.heat_stack, 1)
        self.hover = QLabel("Orange: in VRAM (hot); teal: in RAM (cold); brighter = routed more often. Hover for a "
                           "layer's expert: bytes, placement, frequency.")
        self.hover.setWordWrap(True)
        ll.addWidget(self.hover)
        split.addWidget(left)
        right = QWidget()
        rl = QVBoxLayout(right)
        rl.setContentsMargins(0, 0, 0, 0)
        rl.addWidget(QLabel("Coverage: expected hit rate against experts in VRAM"))
        self.cov = pg.PlotWidget()
        self.cov.setMenuEnabled(False)
        self.cov.setLabel("bottom", "experts in VRAM")
        self.cov.setLabel("left", "expected hit rate", units="%")
        self.cov.setYRange(0, 100)
        self.cov_curve = self.cov.plot([], [], pen=pg.mkPen("#4e79a7", width=2))
        self.cov_point = pg.ScatterPlotItem(size=10, brush=pg.mkBrush("#f28e2b"))
        self.cov.addItem(self.cov_point)
        self.cov_line = pg.InfiniteLine(angle=90, pen=pg.mkPen("#f28e2b", style=Qt.PenStyle.DashLine))
        self.cov.addItem(self.cov_line)
        self.cov_line.hide()
        # the "no routing data" note is a wrapped label above the plot, not text inside it (it was cut at the
        # plot's edge in a narrow column)
        self.cov_text = QLabel("")
        self.cov_text.setObjectName("coverageNote")
        self.cov_text.setWordWrap(True)
        self.cov_text.setStyleSheet("QLabel { color: #666; }")
        self.cov_text.hide()
        rl.addWidget(self.cov_text)
        self.cov_stack = QStackedWidget()
        self.cov_empty = _empty_label("No plan yet: the coverage curve (expected hit rate against experts in VRAM) "
                                      "appears here once a plan is made from real routing data.")
        self.cov_stack.addWidget(self.cov_empty)
        self.cov_stack.addWidget(self.cov)
        rl.addWidget(self.cov_stack, 1)
        self.llama = QLabel()
        self.llama.setWordWrap(True)
        rl.addWidget(self.llama)
        split.addWidget(right)
        split.setSizes([700, 400])
        lay.addWidget(split, 1)
        from .plot_export import add_export     # right click: Save plot as PNG/SVG…, Copy figures
        add_export(self.heat.getPlotItem(), "placement_heatmap", self)
        add_export(self.cov.getPlotItem(), "coverage", self)

        self._restore()
        self._host_changed()
        self._usage_text()
        ctx.planChanged.connect(self._on_plan_changed)
        if hasattr(ctx, "showPlacement"):
            ctx.showPlacement.connect(self.on_feed)
        if ctx.plan:
            self.show_plan(ctx.plan)
        else:
            saved = plans.load_shown_plan()
            if saved:
                self.show_plan(saved, saved=True)

    # -- state ---------------------------------------------------------------------------------------------------
    def _restore(self) -> None:
        st = uistate.load().get("placement_view") or {}
        if isinstance(st, dict):
            i = self.host.findData(st.get("host"))
            if i >= 0:
                self.host.setCurrentIndex(i)
            elif not getattr(self.ctx, "has_gpu", False):
                self.host.setCurrentIndex(self.host.findData("reference"))
            if isinstance(st.get("vram_gib"), (int, float)):
                self.vram.setValue(float(st["vram_gib"]))
            if isinstance(st.get("ram_gib"), (int, float)):
                self.ram.setValue(float(st["ram_gib"]))
            elif isinstance(st.get("ram_gb"), (int, float)):       # saved by a version that took GB here
                self.ram.setValue(float(st["ram_gb"]) * GB / GIB)
            self.usage_paths = [str(x) for x in st.get("usage") or [] if isinstance(x, str)]

    def _persist(self) -> None:
        try:
            uistate.save({"placement_view": {"host": self.host.currentData(), "vram_gib": self.vram.value(),
                                             "ram_gib": self.ram.value(), "usage": self.usage_paths}})
        except OSError:
            pass

    def _host_changed(self) -> None:
        custom = self.host.currentData() == "custom"
        self.vram.setVisible(custom)
        self.ram.setVisible(custom)
        self.ram_gb.setVisible(custom)

    def _ram_units(self) -> None:
        self.ram_gb.setText(f"= {self.ram.value() * GIB / GB:,.1f} GB")

    def _pick_usage(self) -> None:
        dlg = QFileDialog(self, "Routing data: traces, frequency tables, Strata profiles")
        dlg.setFileMode(QFileDialog.FileMode.ExistingFiles)
        dlg.filesSelected.connect(self._add_usage_files)
        dlg.open()

    def _add_usage_files(self, files) -> None:
        for f in files:
            if f not in self.usage_paths:
                self.usage_paths.append(str(f))
        self._usage_text()
        self._persist()

    def _clear_usage(self) -> None:
        self.usage_paths = []
        self._usage_text()
        self._persist()

    def _usage_text(self) -> None:
        picks = float(self.observed.sum()) if self.observed is not None else 0.0
        if self.running_trace:
            seen = (f"{picks:,.0f} expert picks observed so far" if picks else
                    "observed picks appear here as the engine serves requests")
            extra = f"; also: {', '.join(self.usage_paths)}" if self.usage_paths else ""
            self.usage_label.setText(f"Routing data: the running engine's trace ({self.running_trace}) — {seen}"
                                     f"{extra}. Re-plan from observed routing uses it.")
        elif self.usage_paths:
            self.usage_label.setText("Routing data: " + ", ".join(self.usage_paths))
        elif picks:
            self.usage_label.setText(f"Routing data: {picks:,.0f} expert picks observed by the monitor (heatmap: "
                                     "observed routing).")
        else:
            self.usage_label.setText("Routing data: none — the predicted hit rate stays unknown until the engine "
                                     "has seen traffic (add a --dump-routing trace, or plan again once the monitor "
                                     "has observed routing).")

    # -- planning ----------------------------------------------------------------------------------------------------
    def request(self, extra_usage: tuple[str, ...] = ()) -> plans.PlanRequest:
        host = self.host.currentData()
        return plans.PlanRequest(host=host, vram_bytes=int(self.vram.value() * GIB) if host == "custom" else None,
                                     ram_bytes=int(self.ram.value() * GIB) if host == "custom" else None,
                                     usage_paths=tuple(self.usage_paths) + tuple(extra_usage))

    def start_replan_observed(self) -> None:
        """Plan again with the running engine's routing trace (what it has observed) as the frequencies."""
        if self.running_trace:
            self.start_plan(extra_usage=(self.running_trace,))

    def start_plan(self, extra_usage: tuple[str, ...] = ()) -> None:
        if self.tasks.running("plan"):
            return
        extra_usage = tuple(x for x in (extra_usage or ()) if isinstance(x, str) and x not in self.usage_paths)
        self._persist()
        self.plan_button.setEnabled(False)
        self.plan_button.setText("Planning…")
        self.summary.setText("Planning: reading the model's headers and the host…")
        hw = self.ctx.hardware if self.host.currentData() == "this" else None
        # a plan that finishes while the window closes is saved; its callbacks are dropped (nothing to draw)
        self.tasks.start("plan", plans.make_plan, self.ctx.settings, self.request(extra_usage), hw,
                         on_done=self._on_done, on_error=self._on_error, on_finished=self._on_finished)

    def _on_done(self, outcome: plans.PlanOutcome) -> None:
        self.ctx.set_plan(outcome.plan_dict)           # → planChanged → show_plan
        if self.plan is not outcome.plan_dict:
            self.show_plan(outcome.plan_dict)
        self.planMade.emit(outcome.plan_dict)
        msg = "Plan refused" if outcome.plan_dict.get("refused") else \
            f"Planned: {outcome.plan_dict['hot_experts']:,} experts in VRAM"
        self.saved_note.setText(_esc(outcome.saved_note))
        self.saved_note.setVisible(bool(outcome.saved_note))
        try:
            # the message alone: where the plan was saved is said in the tab (it ran into the status bar's
            # indicators when it was appended here)
            self.ctx.statusMessage.emit(f"{msg} (where it is saved: Placement tab)." if outcome.saved_note else msg,
                                        10000)
        except (AttributeError, RuntimeError):
            pass

    def _on_error(self, exc: BaseException) -> None:
        self.summary.setText(f"<b>Could not plan:</b> {_esc(str(exc))}")

    def _on_finished(self) -> None:
        self.plan_button.setEnabled(True)
        self.plan_button.setText("&Plan")

    def _on_plan_changed(self, plan_dict) -> None:
        if plan_dict is not None and plan_dict is not self.plan:
            self.show_plan(plan_dict)

    def shutdown(self, wait_ms: int = 0) -> None:
        # a plan that is being made still finishes and is saved; its callbacks are dropped (nothing to draw)
        self.tasks.shutdown(wait_ms)

    # -- rendering --------------------------------------------------------------------------------------------------
    def start_with_shown_plan(self) -> None:
        """Ask the engine panel to start with exactly the plan on screen (``ctx.startWithPlan``)."""
        if not self.plan or self.plan.get("refused"):
            return
        self.ctx.startWithPlan.emit(self.plan)

    def show_plan(self, d: dict[str, Any], saved: bool = False) -> None:
        self.plan = d
        self.start_with_plan.setEnabled(not d.get("refused"))
        m = d.get("model") or {}
        hw = d.get("hardware") or {}
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(d.get("created_at") or time.time()))
        head = (f"{_esc(m.get('name', '?'))} ({m.get('total_bytes', 0) / GB:.1f} GB) on "
                f"{_esc(hw.get('label', '?'))}" + (" — <i>saved plan from " + when + "</i>" if saved else ""))
        self.saved_note.hide()
        if saved:
            why = plans.why_not_startable(d)
            self.saved_note.setText(_esc(f"Not the plan `dsv41 start` uses: {why}.") if why else
                                    _esc(f"The plan `dsv41 start` uses ({plans.last_plan_path()})."))
            self.saved_note.setVisible(True)
        if m.get("source", "").startswith("the header-faithful replica"):
            head += "<br><i>No model found: sizes come from the header-faithful replica.</i>"
        if d.get("refused"):
            parts = []
            host = "the host" if hw.get("hypothetical") else "this host"
            for sf in d.get("shortfalls") or []:
                if sf["resource"] == "ram":
                    parts.append(f"RAM: needs {_both(sf['needed_bytes'])}, {host} has {_both(sf['available_bytes'])}"
                                 f" — <b>{_both(sf['missing_bytes'])} missing</b>")
                elif sf["resource"] == "vram":
                    parts.append(f"VRAM: needs {sf['needed_bytes'] / GIB:.1f} GiB before any expert, the GPU has "
                                 f"{sf['available_bytes'] / GIB:.1f} GiB — <b>{sf['missing_bytes'] / GIB:.1f} GiB "
                                 f"missing</b>")
                else:
                    parts.append("GPU: none found")
            self.summary.setStyleSheet("QLabel { color: #b00020; }")
            self.summary.setText(f"{head}<br><b>This host cannot hold the model.</b> " + "<br>".join(parts)
                                 + f"<br>{_esc(d['refused'])}.")
        else:
            hr = d.get("predicted_hit_rate")
            hr_s = f"<b>{hr:.1%}</b> ({_esc(d.get('predicted_hit_rate_note', ''))})" if hr is not None else \
                f"<b>{_esc(placement.UNKNOWN_HIT_RATE)}</b>"
            self.summary.setStyleSheet("")
            self.summary.setText(
                f"{head}<br><b>{d['hot_experts']:,}</b> of {d['total_experts']:,} experts in VRAM "
                f"({d['hot_expert_bytes'] / GIB:.1f} GiB), {d['cold_experts']:,} in RAM "
                f"({d.get('cold_expert_bytes', 0) / GIB:.1f} GiB). Predicted share of expert picks in VRAM: {hr_s}.<br>"
                f"Strata: <code>{_esc(' '.join(d.get('strata_args') or []))}</code>")
        v, r = d.get("vram") or {}, d.get("ram") or {}
        self.vram_bar.set_budget(v.get("budget_bytes", 0), v.get("terms") or [])
        self.ram_bar.set_budget(r.get("budget_bytes", 0), r.get("terms") or [])
        self.vram_title.setText(f"<b>VRAM</b> — {v.get('total_bytes', 0) / GIB:.2f} of "
                                f"{v.get('budget_bytes', 0) / GIB:.2f} GiB")
        self.ram_title.setText(f"<b>RAM</b> — {r.get('total_bytes', 0) / GB:.1f} of "
                               f"{r.get('budget_bytes', 0) / GB:.1f} GB"
                               + (" — <span style='color:#b00020'><b>short "
                                  f"{(r.get('total_bytes', 0) - r.get('budget_bytes', 0)) / GB:.1f} GB</b></span>"
                                  if r.get("total_bytes", 0) > r.get("budget_bytes", 0) else ""))
        self.vram_legend.setText(_legend(v.get("terms") or [], "GiB"))
        self.ram_legend.setText(_legend(r.get("terms") or [], "GB"))
        self._build_grid(d)
        if self._observed_counts is not None:          # the counts so far, on this plan's rows
            self.observed = self._observed_rows(self._observed_counts)
        self._redraw_heatmap()
        self.cov_stack.setCurrentWidget(self.cov)
        self._draw_coverage(d)
        lh = d.get("llamacpp_predicted_hit_rate")
        cpu = d.get("llamacpp_cpu_layers") or []
        n_moe = len(m.get("moe_layers") or [])
        self.llama.setText(f"Stock llama.cpp at the same budget (per layer): {n_moe - len(cpu)} of {n_moe} MoE "
                           f"layers' experts on the GPU, {len(cpu)} on the CPU → hit rate "
                           + (f"<b>{lh:.1%}</b>" if lh is not None else "unknown")
                           + f" <small>({_esc(d.get('llamacpp_note', ''))})</small>")

    def _build_grid(self, d: dict[str, Any]) -> None:
        m = d.get("model") or {}
        layers = list(m.get("moe_layers") or [])
        ne = int(m.get("n_experts") or 0)
        pos = {b: i for i, b in enumerate(layers)}
        hot_rank = np.full((len(layers), ne), -1, dtype=np.int64)
        for rank, (b, e) in enumerate(d.get("hot_set") or []):
            i = pos.get(int(b))
            if i is not None and 0 <= int(e) < ne:
                hot_rank[i, int(e)] = rank
        counts = (d.get("usage") or {}).get("counts")
        freq = None
        if counts:
            c = np.asarray(counts, dtype=np.float64)
            if c.shape == (len(layers), ne) and c.sum() > 0:
                freq = c / c.sum()
        ebl = m.get("expert_bytes_by_layer") or [m.get("expert_bytes", 0)] * len(layers)
        # planned without routing data, the hot set is only a count (the planner lists experts 0..N of every
        # layer); which experts the engine keeps hot is unknown until it has seen traffic
        usage = d.get("usage") or {}
        # (a saved plan always has a Strata profile file: that alone says nothing about which experts are hot)
        hot_known = bool(usage.get("sources") or counts or d.get("usage_note"))
        self._grid = {"layers": layers, "n_experts": ne, "hot_rank": hot_rank, "freq": freq,
                      "bytes": np.asarray(ebl, dtype=np.int64), "hot_known": hot_known}

    def _redraw_heatmap(self) -> None:
        g = self._grid
        if not g or not g["layers"]:
            self.image.clear()
            self.heat_empty.setText("No plan yet: the layer × expert map appears here once you press Plan "
                                    "(Ctrl+Shift+P)." if not g else
                                    "This model has no routed experts: nothing to place, every weight goes to the GPU.")
            self.heat_stack.setCurrentWidget(self.heat_empty)
            return
        self.heat_stack.setCurrentWidget(self.heat)
        mode = self.mode.currentData()
        hot = g["hot_rank"] >= 0
        if mode == "frequency" and g["freq"] is not None:
            img = np.log10(g["freq"] * 1e6 + 1)
            cmap, label = pg.colormap.get("viridis"), "planned picks per million, log10(x + 1)"
            levels = (0, max(1e-9, float(img.max())))
        elif mode == "observed" and self.observed is not None:
            o = self.observed
            img = np.log10(o / max(o.sum(), 1e-12) * 1e6 + 1)
            cmap, label = pg.colormap.get("inferno"), "observed picks per million, log10(x + 1)"
            levels = (0, max(1e-9, float(img.max())))
        elif not g.get("hot_known", True):
            # no routing data: which experts are hot is unknown — one flat, neutral field, said in words, never
            # a pattern of "experts 0..N of every layer"
            img = np.full(hot.shape, 0.5)
            cmap, label = pg.ColorMap([0.0, 1.0], ["#d9d9d9", "#d9d9d9"]), "hot set unknown"
            levels = (0.0, 1.0)
            per_layer = int(hot.sum()) / max(1, len(g["layers"]))
            self.hover.setText(f"Hot set unknown: the plan keeps {int(hot.sum()):,} experts in VRAM (~{per_layer:.0f} "
                               "per layer) but had no routing data to say which — the engine fills them from "
                               "traffic. Choose \"observed routing\" once it has run, or re-plan from it.")
        else:
            # placement: hot experts bright, cold dim; with frequencies the shade follows the frequency
            base = np.where(hot, 0.8, 0.3)
            if g["freq"] is not None:
                f = g["freq"] / max(g["freq"].max(), 1e-12)
                base = base + 0.2 * np.sqrt(f)
            img = base
            cmap = pg.ColorMap([0.0, 0.3, 0.55, 0.8, 1.0], ["#0b1d2e", "#2f6f6a", "#76b7b2", "#f28e2b", "#ffd27f"])
            label = "RAM (cold) 0.3 … 0.8 VRAM (hot); brighter = routed more"
            levels = (0.0, 1.0)
        # ImageItem's first axis is x: experts across, layers down
        self.image.setImage(img.T, levels=levels, autoLevels=False)
        self.colorbar.setColorMap(cmap)                 # the bar sets the image's colours and levels too
        self.colorbar.setLevels(levels)
        self.colorbar.axis.setLabel(label)
        self.colorbar_label = label
        self.image.setRect(QRectF(0, 0, g["n_experts"], len(g["layers"])))
        self.heat.getAxis("left").setTicks([[(i + 0.5, str(b)) for i, b in enumerate(g["layers"]) if i % 5 == 0]])

    def _hover(self, scene_pos) -> None:
        g = self._grid
        if not g or not g["layers"]:
            return
        vb = self.heat.getPlotItem().vb
        if not self.heat.sceneBoundingRect().contains(scene_pos):
            return
        pt = vb.mapSceneToView(scene_pos)
        self.hover.setText(self.describe_cell(int(np.floor(pt.y())), int(np.floor(pt.x()))))

    def describe_cell(self, row: int, expert: int) -> str:
        """The hover readout for MoE-layer row ``row`` and expert ``expert`` (also used by tests)."""
        g = self._grid
        if not g or not (0 <= row < len(g["layers"]) and 0 <= expert < g["n_experts"]):
            return ""
        b = g["layers"][row]
        rank = int(g["hot_rank"][row, expert])
        nbytes = int(g["bytes"][row]) if row < len(g["bytes"]) else 0
        where = f"VRAM (hot, rank {rank + 1:,})" if rank >= 0 else "RAM (cold)"
        if not g.get("hot_known", True):
            where = "VRAM or RAM: unknown (planned without routing data)"
        if g["freq"] is not None:
            freq = f"{g['freq'][row, expert]:.4%} of planned picks"
        else:
            freq = "frequency unknown (no routing data)"
        obs = ""
        if self.observed is not None:
            o = self.observed
            obs = f"; observed {o[row, expert] / max(o.sum(), 1e-12):.4%} ({int(o[row, expert]):,} picks)"
        return (f"layer {b} (MoE row {row}), expert {expert}: {nbytes / MIB:.2f} MiB, {where}, {freq}{obs}")

    def _draw_coverage(self, d: dict[str, Any]) -> None:
        cov = d.get("coverage")
        if cov:
            x = np.asarray(cov["n_hot"], dtype=float)
            y = np.asarray(cov["hit_rate"], dtype=float) * 100
            self.cov_curve.setData(x, y)
            ch = cov.get("chosen") or {}
            if ch.get("hit_rate") is not None:
                self.cov_point.setData([ch["n_hot"]], [ch["hit_rate"] * 100])
            self.cov_line.setValue(d.get("hot_experts", 0))
            self.cov_line.show()
            self.cov_text.setText("")
            self.cov_text.hide()
        else:
            self.cov_curve.setData([], [])
            self.cov_point.setData([], [])
            self.cov_line.setValue(d.get("hot_experts", 0))
            self.cov_line.show()
            self.cov.setXRange(0, max(1, d.get("total_experts", 1)))
            self.cov_text.setText(self._no_coverage_text(d))
            self.cov_text.show()

    def _no_coverage_text(self, d: dict[str, Any]) -> str:
        """Why the shown plan has no coverage curve — never "no routing data" while the engine's picks are being
        observed: the plan was made before them."""
        planned = (f"The dashed line marks the {d.get('hot_experts', 0):,} experts planned for VRAM.")
        picks = float(self.observed.sum()) if self.observed is not None else 0.0
        if picks:
            return (f"This plan was made without routing data, so it has no coverage curve; {picks:,.0f} expert picks "
                    f"observed since — re-plan from observed routing to draw it. {planned}")
        return (f"No routing data: the curve needs real frequencies, so the predicted share is unknown until the "
                f"engine has seen traffic. {planned}")

    # -- observed routing (fed by the monitor) -------------------------------------------------------------------
    def on_feed(self, feed) -> None:
        """``ctx.showPlacement``: the Monitor's word about the running engine (a
        :class:`engine_manager.metrics.presenter.PlacementFeed`): observed counts, else its plan and trace."""
        try:
            if feed.counts is not None:
                self.update_observed(feed.counts)
            else:
                self.show_running(feed.plan, feed.trace)
        except Exception as exc:  # noqa: BLE001 - this tab's problem must not stop the monitor that feeds it
            self.ctx.statusMessage.emit(f"Placement tab could not show the running engine: {exc}", 6000)

    def show_running(self, plan: dict[str, Any] | None, trace: str | None) -> None:
        """The engine that just became ready: the plan it runs (shown when this tab shows none, or the running
        one changed) and its routing trace, which becomes this tab's routing data without a click."""
        self.running_trace = str(trace) if trace else None
        self.replan_observed.setVisible(bool(self.running_trace))
        if plan and not self.tasks.running("plan"):   # what runs is what this tab shows (unless a plan is being made)
            self.running_plan = plan
            self.show_plan(plan)
            self.saved_note.setText(_esc("The plan the running engine was started with."))
            self.saved_note.setVisible(True)
        self._usage_text()

    def update_observed(self, counts) -> None:
        """Observed routing counts, (MoE layers or all blocks) × experts; shown in the heatmap's observed mode and
        compared with the planned hot set. Kept as given, so a plan shown later takes them on its own rows."""
        arr = np.asarray(counts, dtype=np.float64)
        if arr.ndim != 2:
            return
        rows = self._observed_rows(arr)
        if rows is None:
            return
        self._observed_counts = arr
        first = self.observed is None or not self.observed.sum()
        self.observed = rows
        if first and rows.sum() > 0 and not self._mode_chosen and self.mode.currentData() != "observed":
            # the engine's routing is the tab's data without a click: its first counts switch the heatmap to it
            self.mode.setCurrentIndex(self.mode.findData("observed"))
        self._usage_text()
        g = self._grid
        if g and g["layers"] and rows.sum() > 0:
            self.hover.setText(self.observed_share_text(rows))
        if self.plan is not None and not self.plan.get("coverage") and not self.cov_text.isHidden():
            self.cov_text.setText(self._no_coverage_text(self.plan))
        if self.mode.currentData() == "observed":
            self._redraw_heatmap()

    def observed_share_text(self, rows: np.ndarray) -> str:
        """The observed routing against the plan, said as what it measures and how it differs from the other two
        figures (the planner's and the Monitor's)."""
        g = self._grid
        hot = g["hot_rank"] >= 0
        share = float(rows[hot].sum() / rows.sum())
        pred = (self.plan or {}).get("predicted_hit_rate")
        text = (f"Observed routing: {rows.sum():,.0f} picks; {share:.1%} of them fall in the planned hot set "
                f"({presenter.PLACEMENT_MEANS}, since the trace began).")
        if pred is not None:
            text += (f" The planner's {pred:.1%} was {presenter.PLANNER_MEANS}; the Monitor's figure is the "
                     "observed VRAM share over the last minute, after the adaptive tier moved experts in, so the "
                     "three differ.")
        else:
            text += (" The Monitor's figure is the observed VRAM share over the last minute, after the adaptive tier "
                     "moved experts in, so it runs higher than this.")
        return text

    def _observed_rows(self, arr: np.ndarray) -> np.ndarray | None:
        """The counts on the shown plan's MoE rows (all blocks → the MoE ones); as given without a plan; None when
        they do not fit the plan's model (another layer or expert count)."""
        g = self._grid
        if not g or not g["layers"]:
            return arr
        n_l, ne = len(g["layers"]), g["n_experts"]
        if arr.shape == (n_l, ne):
            return arr
        if arr.shape[1] == ne and arr.shape[0] > max(g["layers"]):
            return arr[g["layers"], :]
        return None


def _empty_label(text: str) -> QLabel:
    """What an empty plot area says instead of showing bare axes."""
    lab = QLabel(text)
    lab.setObjectName("emptyState")
    lab.setWordWrap(True)
    lab.setAlignment(Qt.AlignmentFlag.AlignCenter)
    lab.setMargin(24)
    lab.setFrameShape(QFrame.Shape.StyledPanel)
    lab.setStyleSheet("QLabel#emptyState { color: #666; }")
    return lab


def _both(n: float) -> str:
    """RAM in GB (how it is sold) with GiB beside it (what the spin box and `--ram-gib` take)."""
    return f"{n / GB:.1f} GB ({n / GIB:.1f} GiB)"


def _esc(s: str) -> str:
    return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _legend(terms: list[dict[str, Any]], unit: str) -> str:
    out = []
    for i, t in enumerate(terms):
        c = _color(t["name"], i).name()
        v = f"{t['bytes'] / GIB:.2f} GiB" if unit == "GiB" else f"{t['bytes'] / GB:.1f} GB"
        out.append(f"<span style='color:{c}'>■</span> {_esc(t['name'])} <b>{v}</b>")
    return " &nbsp; ".join(out)
