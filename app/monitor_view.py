"""The Monitor tab: live plots of what the engine and the machine are doing, "now" cards, and a card comparing
the live figures with the deepseek-one-gpu guides'.

All collecting happens in :mod:`engine_manager.metrics` (a :class:`MetricsHub` per running engine, run as a task
of ``app.workers.TaskOwner``); what the cards say comes from :mod:`engine_manager.metrics.presenter` (shared with
``dsv41 monitor``); this view only draws. The plots (:mod:`app.monitor_plots`) follow pyqtgraph's PlotSpeedTest
idioms: curves are created once and fed with ``setData``; ``setClipToView(True)`` and
``setDownsampling(mode='peak')`` keep long series cheap, and the view asks the store only for the visible range,
reduced to about two points per pixel. The cards are in :mod:`app.monitor_cards`.

Missing values are gaps in the curves and "—" on the cards, never zero. Numbers from the scripted engine are
labelled "simulated". The Placement tab hears about the running engine through ``ctx.showPlacement``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PySide6.QtCore import QEvent, QSize, Qt, QTimer, Signal
from PySide6.QtGui import QAction, QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QButtonGroup,
    QComboBox,
    QFileDialog,
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
from engine_manager.metrics import guides, presenter
from engine_manager.engine_state import RunningEngine
from engine_manager.session import EngineSession

from .monitor_cards import CompareCard, ElidedLabel, NowCard
from .panel_base import Panel
from .workers import TaskOwner

if TYPE_CHECKING:
    import numpy as np      # with the plots (pyqtgraph brings it): not on the page's first step

WINDOWS: tuple[tuple[str, float | None], ...] = (("1 min", 60.0), ("10 min", 600.0), ("1 h", 3600.0), ("All", None))
RATES = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0)


class _LayoutBarrier(QWidget):
    """Holds ``inner`` (the cards) without a layout of its own, at the height ``inner`` asks for. A label's new
    text asks its parents for a new layout, and Qt passes that request up to the window: every card's new value
    re-laid out the Monitor, the tabs, the splitter and the main window once a second, ~7 layouts for a size
    that had not changed. Here the request stops: the cards are laid out again inside, and the page only when
    their height really changes."""

    def __init__(self, inner: QWidget, parent=None):
        super().__init__(parent)
        self.inner = inner
        inner.setParent(self)
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Fixed)
        # opaque: a card's new value repaints the cards, not the six widgets behind them up to the main window as
        # well (a paint-event count of the running window: 7 paint events a tick → 2)
        self.setAutoFillBackground(True)
        self._fit()

    def _wanted(self) -> int:
        inner = self.inner
        if inner.hasHeightForWidth() and self.width() > 0:
            return max(0, inner.heightForWidth(self.width()))
        return max(0, inner.sizeHint().height())

    def _fit(self) -> None:
        h = self._wanted()
        if h != self.height() or self.minimumHeight() != h:
            self.setFixedHeight(h)              # a real change of height: the page is laid out again
        self.inner.setGeometry(0, 0, self.width(), self.height())

    def minimumSizeHint(self):  # noqa: N802 - Qt's name
        return QSize(self.inner.minimumSizeHint().width(), self.height())

    def sizeHint(self):  # noqa: N802 - Qt's name
        return QSize(self.inner.sizeHint().width(), self.height())

    def event(self, ev) -> bool:
        if ev.type() == QEvent.Type.LayoutRequest:        # inner asks: only its own height matters here
            self._fit()
            return True
        return super().event(ev)

    def resizeEvent(self, ev) -> None:  # noqa: N802 - Qt's name
        super().resizeEvent(ev)
        self._fit()


class MonitorView(Panel, QWidget):
    """Live plots, now cards and the guides card. Starts collecting on ``ctx.engineRunning`` (a
    :class:`RunningEngine`: the watched engine — the panel's own, or an attached one) and stops when it carries
    None; every tick is re-emitted as ``ctx.sampleArrived(Sample)``. Its background work (making the hub, the hub's
    ticks, stopping a hub, exports) runs as tasks of one :class:`TaskOwner`. An engine the panel did not start
    gets no plan of the panel's and — on another machine — no local GPU figures (missing, never this box's)."""

    hubStarted = Signal(object)        # MetricsHub
    tickShown = Signal(object)         # Tick, after the view drew it

    MAX_POINTS_PER_PIXEL = 1   # min/max per 2-px bucket: peaks survive; a jagged 1,100-point path costs ~3 ms
    CARDS_HZ = 4.0
    COMPARE_EVERY_S = 1.0      # the guides card compares 10-s means: redoing its rich text faster buys nothing
    BATCH_BELOW_HZ = 2.0       # at or below this rate all plots are drawn in one pass
    STEP_INTERVAL_MS = 15       # between one plot's update and the next: room for Qt to paint the first alone

    plotsBuilt = Signal()              # the plots are in place of their placeholder (at once unless plots_later)

    def __init__(self, ctx, parent=None, plots_later: bool = False):
        """``plots_later``: the bar and the cards now, the plots (pyqtgraph) when :meth:`build_plots` is called or
        when first needed — the panel's staged start paints the page and takes input before pyqtgraph is
        imported (its import and the six plots were ~0.5 s of a 1.3-s first step, benchmarks/results/startup.md)."""
        super().__init__(parent)
        self.ctx = ctx
        self.hub: M.MetricsHub | None = None
        self.store: M.RingStore | None = None
        self.tasks = TaskOwner(self)
        self.last_tick: M.Tick | None = None
        self.engine_info: RunningEngine | None = None     # the engine the hub reads (None: none yet)
        self.attached = False                             # it is a watched connection (ctx.watch), not the own one
        self.model_name: str | None = None                # the model the engine reports
        self._started_for: RunningEngine | None = None    # the handle the hub was last started for
        self.window_s: float | None = 600.0
        self.paused = False
        self._dirty = False
        self._setting_range = False
        self._redraws = 0
        self._stopping: list[M.MetricsHub] = []
        self._order: _HubOrder | None = None               # the hub being made off the GUI thread
        self._exports = 0
        st = uistate.load()
        if isinstance(st.get("monitor_window"), str):
            for label, secs in WINDOWS:
                if label == st["monitor_window"]:
                    self.window_s = secs
        self.plots: dict = {}                             # key → app.monitor_plots.MonitorPlot, once built
        self.plots_built = False
        self._slots_shown: int | None = None              # the slot count the slots plot shows columns for
        self._ref_plot = "tok"                            # the plot whose range the others follow when paused
        self._hit_reference: tuple[tuple, dict] = ((None, "", "planner's prediction: unknown"), {})
        self._queue: list[str] = []
        self._target: tuple[float, float, bool] | None = None
        self._step_timer = QTimer(self)
        self._step_timer.setSingleShot(True)
        self._step_timer.setInterval(self.STEP_INTERVAL_MS)
        self._step_timer.timeout.connect(self._redraw_step)
        self._build()
        if not plots_later:
            self.build_plots()
        ctx.engineRunning.connect(self.on_engine_running)
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
        if isinstance(getattr(ctx, "running", None), RunningEngine):
            QTimer.singleShot(0, lambda: self.on_engine_running(ctx.running))

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
        # the start of the line (which engine, recording or not) matters most: cut at the end, whole in the tip
        self.status = ElidedLabel("Not collecting: no engine is running.", mode=Qt.TextElideMode.ElideRight)
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
        for i, (key, title) in enumerate(presenter.CARDS):
            card = NowCard(key, title, full_title=presenter.CARD_TITLES_IN_FULL.get(key, ""))
            self.cards[key] = card
            cards.addWidget(card, i // 5, i % 5)
        top.addLayout(cards)
        self.compare = CompareCard()
        top.addWidget(self.compare)
        top_box = QWidget()
        top_box.setLayout(top)
        top_box.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Fixed)
        self.top_holder = _LayoutBarrier(top_box)
        root.addWidget(self.top_holder)

        # the plots' place: a quiet word until build_plots() puts them there
        self.plots_placeholder = QLabel("Drawing the plots…")
        self.plots_placeholder.setObjectName("monitorPlotsPlaceholder")
        self.plots_placeholder.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.plots_placeholder.setStyleSheet("QLabel { background: white; color: #888; }")
        root.addWidget(self.plots_placeholder, 1)

    def build_plots(self) -> None:
        """Put the six plots in place of their placeholder (once; pyqtgraph is imported here), then draw what the
        view already holds."""
        if self.plots_built:
            return
        import pyqtgraph as pg

        from .monitor_plots import MonitorPlot, plot_specs

        self.plots_built = True
        self.glw = pg.GraphicsLayoutWidget()
        self.glw.setBackground("w")
        self.glw.setObjectName("monitorPlots")
        self.glw.ci.setSpacing(2)
        plots: dict[str, MonitorPlot] = {}
        clock_pictures: dict = {}                   # the time axes' pictures, shared by axes of one width
        for i, spec in enumerate(plot_specs()):
            plots[spec.key] = MonitorPlot(self.glw.ci, spec, i // 2, i % 2, clock_pictures)
        for col in (0, 1):                          # two columns of the same width, whatever their titles hold
            self.glw.ci.layout.setColumnStretchFactor(col, 1)
            self.glw.ci.layout.setColumnPreferredWidth(col, 200)
        # The plots share their time range, kept in step by this view rather than by pyqtgraph's x-link: a link
        # moves every plot in one go, so one redraw would repaint all six at once (~45 ms on a software X
        # server); stepping them one per event-loop pass keeps every pass short (see redraw()).
        for key, p in plots.items():
            p.item.vb.sigRangeChangedManually.connect(lambda *_a, k=key: self._user_moved(k))
            p.item.vb.sigXRangeChanged.connect(lambda *_a, k=key: self._x_changed(k))
        self.plots = plots
        self._show_hit_reference()
        if self._slots_shown is not None:
            plots["slots"].show_columns(presenter.slot_columns(self._slots_shown))
        self._empty_range()
        self._hover_proxy = pg.SignalProxy(self.glw.scene().sigMouseMoved, rateLimit=30, slot=self._mouse_moved)
        self.layout().replaceWidget(self.plots_placeholder, self.glw)
        self.glw.show()                             # now, not on the layout's queued show: drawn in this pass
        self.plots_placeholder.hide()
        self.plots_placeholder.deleteLater()
        self._resize_titles()
        if self.last_tick is not None:
            self.update_cards(self.last_tick)
        self.plotsBuilt.emit()
        self.schedule_redraw()

    def _empty_range(self) -> None:
        """Before any data: the time axes show the window ending now (clock times, not "00.250 00.500" of an
        empty range at the epoch)."""
        now = time.time()
        span = self.window_s or 600.0
        for p in self.plots.values():
            p.item.setXRange(now - span, now, padding=0)

    def resizeEvent(self, ev) -> None:
        super().resizeEvent(ev)
        self._resize_titles()

    def _resize_titles(self) -> None:
        # the legends above the plots wrap to the plots' new width (only on a resize: a title change relays out)
        if not self.plots_built:
            return
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
    def on_engine_running(self, running: RunningEngine | None) -> None:
        """``ctx.engineRunning``: a (re)started engine, or None when it stopped. The same handle reaching the
        view through both signals starts one hub."""
        if running is None:
            self.on_engine_stopped()
            return
        if running is self._started_for:
            return
        self._started_for = running
        self.start_hub(running)

    def start_hub(self, running: RunningEngine) -> None:
        """A new hub for ``running``, since its pid, binding or log may differ. Back at the same address soon
        after the last tick (a crash and restart, a rate change), the plots continue across the gap."""
        last = self.last_tick
        if getattr(self, "_carry", None) is None and self.store is not None and \
                EngineSession.carries_plots(self.engine_info, running, last.t if last is not None else None):
            self._carry = self.store
        self._cancel_order()
        self._stop_hub()
        self.status.setText(f"Connecting to the engine at {running.base_url}…")
        hz = M.clamp_hz(self.ctx.settings.metrics_hz)
        carry, self._carry = getattr(self, "_carry", None), None
        carry_rec, self._carry_recorder = getattr(self, "_carry_recorder", None), None
        self._order = order = _HubOrder()
        # an attached engine (not started by this panel) runs no plan of the panel's; one on another machine
        # (over SSH) is not measured by this machine's GPU
        self.attached = getattr(self.ctx, "watching", None) is not None
        plan = None if self.attached else self.ctx.plan
        use_nvml = not (self.attached and getattr(self.ctx, "watching_remote", False))
        self.tasks.start("hub", _make_hub, order, running, hz, plan, use_nvml, carry, carry_rec,
                         on_done=self._hub_made,
                         on_error=lambda exc: self.status.setText(f"Monitor could not start: {exc}"))

    def _cancel_order(self) -> None:
        """The engine stopped (or restarted) while its hub was being made: that hub is stopped, never shown (a
        cancelled worker emits no result, so the order itself hands the hub back)."""
        self.tasks.cancel("hub")
        order, self._order = self._order, None
        hub = order.cancel() if order is not None else None
        if hub is not None:
            self._stop_in_background(hub)

    def _hub_made(self, res: tuple[M.MetricsHub, M.RingStore, RunningEngine, int] | None) -> None:
        if res is None:
            return
        hub, store, running, _loaded = res
        if self._order is not None:
            self._order.take()
        self._order = None
        self.hub, self.store, self.engine_info = hub, store, running
        self._update_status()
        self.tasks.start("ticks", hub.iter_ticks, on_event=self._on_tick,
                         on_error=lambda exc: self.status.setText(f"Monitor stopped: {exc}"))
        self.hubStarted.emit(hub)
        self._apply_plan(running.plan if running.plan is not None else None if self.attached else self.ctx.plan)
        self._tell_placement(running.plan, hub)
        self.schedule_redraw()

    def _tell_placement(self, plan, hub) -> None:
        """The Placement tab shows the plan the engine runs and takes its routing trace as its data, no click."""
        trace = next((str(s.path) for s in hub.sources if isinstance(s, M.RoutingSource)), None)
        self._show_placement(presenter.PlacementFeed(plan=plan, trace=trace))

    def _show_placement(self, feed: presenter.PlacementFeed) -> None:
        show = getattr(self.ctx, "showPlacement", None)
        if show is not None:
            show.emit(feed)

    def on_engine_stopped(self) -> None:
        self._started_for = None
        self._cancel_order()
        self._stop_hub()
        name = getattr(self.ctx, "watching", None)
        if name is not None:                # a saved connection is watched, and cannot be used: not "stopped"
            self.show_unreachable(name)
            return
        self.show_stopped_cards()
        self.status.setText(presenter.stopped_status(self.last_tick is not None))

    def show_unreachable(self, name: str) -> None:
        """The watched saved connection ``name`` does not answer (or says no): every card, the guides card and the
        status line say so, with the reason and when it was last seen (its last test, kept by
        :mod:`engine_manager.connections`), in the window's words; the figures and plots of the engine watched
        before are cleared, so none is shown as this one's."""
        from engine_manager import connections as C

        try:
            lt = C.get_connection(name).last_test
        except C.ConnectionSetupError:
            lt = None
        failed = lt is not None and lt.state != "ok"
        state = lt.state if lt is not None and failed else "unreachable"
        reason = lt.words(gui=True) if lt is not None and failed else ""
        last_seen = lt.last_ok if lt is not None else None
        self.forget_figures()
        for key, text in presenter.unreachable_cards(name, state, reason, last_seen).items():
            self.cards[key].show(text)
        _short, whole = presenter.unreachable_words(name, state, reason, last_seen)
        self.compare.show_unreachable(state, whole)
        self.status.setText(whole)

    def forget_figures(self) -> None:
        """Drop every figure of the engine shown so far (the plots' history, the last tick and comparison): the
        next one shown is of another engine."""
        self.store = None
        self.engine_info = None
        self.last_tick = None
        self.last_comparison = None
        self._queue = []
        self._slots_shown = None
        if self.plots_built:
            import numpy as np      # the plots are built: pyqtgraph has imported it

            for p in self.plots.values():
                p.set_data(np.empty(0), {c: np.empty(0) for c in p.curves}, fit_y=False)
                p.set_note("")
        self._apply_plan(None)

    def show_stopped_cards(self) -> None:
        """Nothing is live any more: every card shows "—" and says so (the plots keep the history)."""
        for key, text in presenter.stopped_cards().items():
            self.cards[key].show(text)
        self.compare.show_stopped(getattr(self, "last_comparison", None))

    def _stop_hub(self) -> None:
        hub, self.hub = self.hub, None
        self.tasks.cancel("ticks")          # the generator returns by itself once the hub is stopped
        if hub is not None:
            self._stop_in_background(hub)

    def _stop_in_background(self, hub: M.MetricsHub) -> None:
        self._stopping.append(hub)
        self.tasks.start(f"stop-{id(hub)}", hub.stop,
                         on_finished=lambda h=hub: self._stopping.remove(h) if h in self._stopping else None)

    def shutdown(self, wait_ms: int = 2000) -> None:
        """The window is closing: stop collecting and close the recording (waits up to ``wait_ms`` per hub)."""
        self._cancel_order()
        self.tasks.shutdown(0)              # the ticks end; later callbacks are dropped; the hubs are stopped here
        hub, self.hub = self.hub, None
        self._routing_timer.stop()
        for h in [hub, *self._stopping]:
            if h is not None:
                h.stop(timeout=wait_ms / 1000.0)
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
        if self.hub is not None and self.engine_info is not None and abs(self.hub.hz - hz) > 1e-9:
            self._carry = self.store
            self._carry_recorder = self.hub.detach_recorder()
            self.start_hub(self.engine_info)        # stops this hub, starts one at the rate

    def _on_plan(self, plan) -> None:
        if self.attached:
            return                              # an attached engine runs no plan of this panel's
        if self.engine_info is None or self.engine_info.plan is None:   # a running engine keeps the prediction
    # of the plan it runs
            self._apply_plan(plan)

    def _apply_plan(self, plan) -> None:
        running = self.engine_info
        engine = running.engine if running is not None else ""
        pred = M.predicted_hit_rate(plan, engine, running.spec if running is not None else None)
        if self.hub is not None:
            self.hub.set_predicted(pred)
            self.hub.expert_bytes = M.plan_expert_bytes(plan)
        if pred is None:
            why = ("unknown: no plan" if not plan else
                   f"{plan.get('predicted_hit_rate_note') or 'unknown until the engine has seen traffic'}")
            self._hit_reference = ((None, "", f"planner's prediction: {why}"), {})
        else:
            self._hit_reference = ((pred * 100.0, f"planner {pred * 100:.1f}%"),
                                   {"legend": f"planner: {presenter.PLANNER_MEANS}"})
        self._show_hit_reference()

    def _show_hit_reference(self) -> None:
        """The planner's line on the hit-rate plot, as last set (kept until the plots exist)."""
        if self.plots_built:
            args, kwargs = self._hit_reference
            self.plots["hit"].set_reference(*args, **kwargs)

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
        self._show_placement(presenter.PlacementFeed(counts=counts))

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
        if not self.plots_built:            # figures to show before the staged start built the plots
            self.build_plots()
        span = self.store.span()
        if span is None:
            return
        # the right edge moves in steps (a young run's span grows in steps), not on every tick: between steps the
        # axes and the grid stay as painted and only the curves are drawn again
        x0, x1 = presenter.follow_range(span[0], span[1], self.window_s)
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
        keys, self._queue = self._queue[:n], self._queue[n:]
        # one read of the store for the plots of this pass: the same rows and buckets for every column, and
        # each read has its own cost (an old run's six reads 0.9–1.4 ms a tick against 0.53 ms for one)
        rows = self._rows(keys)
        for key in keys:
            self._draw_one(key, rows)
        if self._queue:
            self._step_timer.start()
        else:
            self._redraws += 1

    def _rows(self, keys: list[str]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The store's rows for the target range and the curves of the plots ``keys``: about one point a pixel of a
        plot at most (longer stretches come as the min and max of each bucket of rows)."""
        assert self._target is not None and self.store is not None
        x0, x1, _ = self._target
        width = max(200, self.glw.width() // 2)
        pad = (x1 - x0) * 0.02
        cols = list(dict.fromkeys(c for k in keys for c in self.plots[k].curves))
        return self.store.window(x0 - pad, x1 + pad, cols, max_points=width * self.MAX_POINTS_PER_PIXEL)

    def _draw_one(self, key: str, rows: tuple[np.ndarray, dict[str, np.ndarray]]) -> None:
        x0, x1, follow = self._target
        p = self.plots[key]
        t, data = rows
        p.set_data(t, data, fit_y=follow, x_range=(x0, x1))
        vx0, vx1 = p.item.vb.viewRange()[0]
        if abs(vx0 - x0) > 1e-6 or abs(vx1 - x1) > 1e-6:
            self._setting_range = True
            try:
                p.item.setXRange(x0, x1, padding=0)
                # the new range applied now, not in the paint: applied there, it moved every item of the plot
                # once more and Qt painted the plot twice for each step of the time axis
                p.item.vb.updateMatrix()
                if p.right_vb is not None:
                    p.right_vb.updateMatrix()
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
    _not_exported_noted: set[str] = set()     # the plots whose note says "not exported" now

    def update_cards(self, tick: M.Tick) -> None:
        """The cards for one tick, as :func:`engine_manager.metrics.presenter.cards` words them."""
        total = presenter.slots_total(tick)
        if total is not None and total != self._slots_shown:
            self._slots_shown = total
            if self.plots_built:
                self.plots["slots"].show_columns(presenter.slot_columns(total))
        for key, text in presenter.cards(tick).items():
            self.cards[key].show(text)
        gone = presenter.plot_notes(tick, {k: p.curves for k, p in self.plots.items()})
        for key, p in self.plots.items():
            if key in gone:
                p.set_note(gone[key])
            elif key == "hit":
                if tick.predicted_hit_rate is not None:    # else the note says why the prediction is unknown
                    p.set_note(presenter.hit_difference_line(tick))
            elif key in self._not_exported_noted:
                p.set_note("")                            # an engine that exports it after all
        self._not_exported_noted = set(gone)
        if abs(tick.t - getattr(self, "_compared_at", -1e18)) >= self.COMPARE_EVERY_S - 0.01:
            self._compared_at = tick.t
            self._update_compare(tick)
        self._update_status()

    def _update_compare(self, tick: M.Tick) -> None:
        """The guides card judges the steady decode rate the hub tracks (``tick.notes["steady"]``): not the
        live window rate, which reads low while users start and finish."""
        v = tick.values
        hr = v.get("hit_rate_rolling")           # the observed VRAM share over the last minute
        if hr is None:
            hr = v.get("vram_share")
        model = tick.notes.get("model")
        if model:
            self.model_name = model
        numa_bound = self.engine_info.numa_bound if self.engine_info is not None else None
        c = guides.judge(tick.notes.get("steady"), hr, simulated=tick.simulated, numa_bound=numa_bound,
                         pcie_gen=v.get("gpu_pcie_gen"), pcie_width=v.get("gpu_pcie_width"),
                         model=model or self.model_name)
        self.compare.show_comparison(c)
        self.last_comparison = c

    def _update_status(self) -> None:
        if self.hub is None:
            return
        text, tip = presenter.status_text(self.hub, self.last_tick, compact=True)
        self.status.setText(text)
        if tip is not None:
            self.status.setToolTip(tip)

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

        self._exports += 1                  # each export its own task: a second one does not drop the first's
        key = f"export-{self._exports}"
        if rec is not None and rec.exists():
            self.tasks.start(key, M.export_csv, dest, recording=rec, on_done=done, on_error=failed)
        else:
            self.tasks.start(key, M.export_csv, dest, store=store, on_done=done, on_error=failed)


# -- making the hub (off the GUI thread) -------------------------------------------------------------------------
class _HubOrder:
    """One hub being made off the GUI thread for one engine. Cancelled (the engine stopped or restarted), the hub
    made for it is handed back to be stopped — whichever of the worker and the GUI thread comes second does it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancelled = False
        self._hub: M.MetricsHub | None = None

    def made(self, hub: M.MetricsHub) -> bool:
        """Worker thread: the hub is made; False when the order was cancelled meanwhile (the caller stops it)."""
        with self._lock:
            if self._cancelled:
                return False
            self._hub = hub
            return True

    def take(self) -> None:
        """GUI thread: the view took the hub; a later cancel is not this order's to stop."""
        with self._lock:
            self._hub = None

    def cancel(self) -> M.MetricsHub | None:
        """GUI thread: the hub made for the order and not taken (to be stopped), if any."""
        with self._lock:
            self._cancelled = True
            hub, self._hub = self._hub, None
            return hub


def _make_hub(order: _HubOrder, running: RunningEngine, hz: float, plan: Mapping[str, Any] | None, use_nvml: bool,
              old_store: M.RingStore | None, recorder: M.Recorder | None = None
              ) -> tuple[M.MetricsHub, M.RingStore, RunningEngine, int] | None:
    """:func:`engine_manager.metrics.hub_for_running_engine` (builds the hub with the plan the engine runs, loads
    the run recorded so far) off the GUI thread; ``use_nvml`` False for an engine on another machine."""
    res = M.hub_for_running_engine(running, hz, plan, old_store=old_store, recorder=recorder, use_nvml=use_nvml)
    if not order.made(res[0]):
        res[0].stop()
        return None
    return res
