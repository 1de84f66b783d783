"""The engine controls of the control column: pick the engine, one click to start or stop it, watch it get ready.

Everything here renders what ``engine_manager.supervisor`` says; clicks go to the window's
:class:`~engine_manager.session.EngineSession` (``ctx.session``), whose generators run on worker threads
(``app.workers.TaskOwner``, ``feed=False``): every event goes to ``session.feed`` on the GUI thread, which keeps the
ready engine (``ctx.running``, ``ctx.engineRunning``) and whose log lines the context re-emits as ``ctx.engineLog``.
The panel emits ``ctx.engineStateChanged`` whenever its badge changes.
On start-up it re-attaches to an engine a previous panel (or ``dsv41 start``) left running. Under llama.cpp it
also shows where llama-server put each buffer, as its log says (folded by ``engines.llamacpp.PlacementSummary``).

At its top, "Watching" (:class:`app.connections_view.ConnectionsView`, issue 19) picks the engine the Monitor and
the chat work on: this panel's own, or a saved connection to an engine it did not start. While a connection is
watched, Start/Stop are disabled (their tooltip says why): they only ever act on the panel's own engine, and no
Stop is ever sent to an attached one.
"""

from __future__ import annotations

import html
import time
from typing import TYPE_CHECKING, Any

from PySide6.QtCore import QByteArray, QMimeData, Qt, QTimer
from PySide6.QtGui import QAction, QFontDatabase, QGuiApplication, QKeySequence
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFrame,
    QHBoxLayout,
    QLabel,
    QMessageBox,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QSizePolicy,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from engine_manager import fmt
from engine_manager.engine_state import (CRASHED, READY, RESTARTING, RUNNING_STATES, STARTING, STOPPED, STOPPING,
                                         EngineStatus)
from engine_manager.start_plan import plan_host_warning, usable_plan
from engine_manager.engines import ENGINE_NAMES, find_engine, get_engine
from engine_manager.liveness_line import LivenessLine, StallEpisode
from engine_manager.release_check import engine_release_facts
from engine_manager.settings import resolve_engine

from .connections_view import ConnectionsView
from .checks_view import ChecksView
from .panel_base import Panel
from .workers import QUIT_WAIT_MS, TaskOwner

if TYPE_CHECKING:
    from engine_manager.dryrun import DryRun
    from engine_manager.engines.llamacpp import PlacementSummary
    from engine_manager.supervisor_events import Event, Progress


def _owner_words(owner: Any) -> str:
    """Who holds the port, in words (engine_manager.procs, with psutil: imported when there is one to name, not
    with the engine column)."""
    from engine_manager.procs import describe_owner
    return describe_owner(owner)


def _text_label(name: str, text_format: Qt.TextFormat | None = None) -> QLabel:
    """A wrapping label whose text can be selected (and copied): messages, details, notes."""
    label = QLabel()
    label.setObjectName(name)
    label.setWordWrap(True)
    if text_format is not None:
        label.setTextFormat(text_format)
    label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    return label



BADGE = {  # state: (text, background, foreground)
    STOPPED: ("Stopped", "#e4e6eb", "#3a3f47"),
    STARTING: ("Starting…", "#dbe8ff", "#1f4e99"),
    READY: ("Ready", "#d9f2dd", "#1b6b2b"),
    STOPPING: ("Stopping…", "#fff0d6", "#8a5300"),
    CRASHED: ("Crashed", "#fde2e1", "#a1131c"),
    RESTARTING: ("Restarting…", "#ffe7cc", "#9a4a00"),
    "reattaching": ("Re-attaching…", "#dbe8ff", "#1f4e99"),   # the panel's own: finding the engine left running
}
POLL_MS = 3000
KEY_CLIPBOARD_S = 60          # a copied API key is taken off the clipboard after this, if it is still there


fmt_s = fmt.duration


class CrashBanner(QFrame):
    """Cause and fix of the last failure, in plain words; dismissible."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setObjectName("crashBanner")
        self.setFrameShape(QFrame.Shape.StyledPanel)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(8, 6, 8, 6)
        top = QHBoxLayout()
        self.title = QLabel()
        self.title.setObjectName("crashTitle")
        self.title.setWordWrap(True)
        self.title.setTextFormat(Qt.TextFormat.PlainText)
        f = self.title.font()
        f.setBold(True)
        self.title.setFont(f)
        close = QToolButton()
        close.setText("✕")
        close.setToolTip("Dismiss")
        close.setAutoRaise(True)
        close.clicked.connect(self.hide)
        top.addWidget(self.title, 1)
        top.addWidget(close, 0, Qt.AlignmentFlag.AlignTop)
        lay.addLayout(top)
        self.fix = _text_label("crashFix", Qt.TextFormat.PlainText)
        lay.addWidget(self.fix)
        self.extra = QLabel()
        self.extra.setObjectName("crashExtra")
        self.extra.setWordWrap(True)
        lay.addWidget(self.extra)
        self.log_button = QPushButton("Show the log")
        self.log_button.setObjectName("crashShowLog")
        lay.addWidget(self.log_button, 0, Qt.AlignmentFlag.AlignLeft)
        self.hide()

    def show_problem(self, title: str, fix: str, extra: str = "", severe: bool = True,
                     show_log: bool = True) -> None:
        bg, fg = ("#fde2e1", "#7d0d14") if severe else ("#fff4e5", "#6b4100")
        self.setStyleSheet(f"QFrame#crashBanner {{ background: {bg}; border: 1px solid {fg}; border-radius: 4px; }}"
                           f" QLabel {{ color: {fg}; }}")
        self.title.setText(title)
        self.fix.setText(fix)
        self.extra.setText(extra)
        self.extra.setVisible(bool(extra))
        self.log_button.setVisible(show_log)       # (a refusal before any start has nothing in the log)
        self.show()


class DryRunDialog(QDialog):
    def __init__(self, text: str, parent=None):
        super().__init__(parent)
        self.setWindowTitle("Dry run: every command a start would run here")
        self.resize(900, 520)
        lay = QVBoxLayout(self)
        self.text = QPlainTextEdit(text)
        self.text.setObjectName("dryRunText")
        self.text.setReadOnly(True)
        self.text.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
        self.text.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        lay.addWidget(self.text)
        bb = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        copy = bb.addButton("Copy", QDialogButtonBox.ButtonRole.ActionRole)
        copy.setObjectName("dryRunCopy")
        copy.clicked.connect(lambda: QGuiApplication.clipboard().setText(self.text.toPlainText()))
        bb.rejected.connect(self.reject)
        lay.addWidget(bb)


class EnginePanel(Panel, QWidget):
    def __init__(self, ctx, parent=None, *, list_later: bool = False):
        """``list_later``: the saved connections are read later, by ``connections.read_list()`` (the staged
        start)."""
        super().__init__(parent)
        self.ctx = ctx
        self._list_later = list_later
        self.setObjectName("enginePanel")
        self.session = ctx.session
        self._state = STOPPED
        # background tasks by key: "run" (run/watch: owns the engine), "stop", "status" (the idle poll), "dry",
        # "placement"; callbacks are dropped once the panel shuts down
        self.tasks = TaskOwner(self)
        self._chosen_plan: dict | None = None     # the Placement tab's "Start with this plan", taken once by start()
        self._close_after_stop = None
        self._stop_started: float | None = None
        self._last_notes: list[str] = []
        self._emitted_state = STOPPED        # the state the rest of the window was last told (status bar …)
        self._refused_cause: str | None = None  # a start refused because another engine runs: keep saying why
        # where llama-server put each buffer, folded (in engine_manager) from the log events of this run: made on
        # first use, with the llama.cpp adapter's module (:attr:`placement`)
        self._placement: PlacementSummary | None = None
        self._build()
        self._build_actions()
        ctx.requestStart.connect(self.start)
        ctx.startWithPlan.connect(self.start_with_plan)
        ctx.requestRestart.connect(self.restart)
        self._restart_after_stop = False
        ctx.settingsChanged.connect(self._settings_changed)
        ctx.hardwareChanged.connect(self._hardware_changed)
        ctx.watchChanged.connect(lambda _name: self._render_state(self._state, ""))
        ctx.engineLockChanged.connect(lambda _why: self._render_state(self._state, ""))
        ctx.ownEngineChanged.connect(lambda _r: self._refresh_details())      # "Copy API key" follows it
        self.stall_episode = StallEpisode()
        self._stall_restart_note: str | None = None     # said once the engine restarted after a stall is ready
        ctx.livenessReported.connect(self.show_liveness)
        ctx.engineRunning.connect(self._watched_changed)
        self.poll_timer = QTimer(self)
        self.poll_timer.setInterval(POLL_MS)
        self.poll_timer.timeout.connect(self._poll_status)
        self.poll_timer.start()
        # the details' uptime, again when its words change (to the minute): a 1 s clock read the engine's status
        # and rebuilt the details 60 times for each change
        self.clock = QTimer(self)
        self.clock.setSingleShot(True)
        self.clock.timeout.connect(lambda: self._state == READY and self._refresh_details())
        self._render_state(STOPPED, "")
        QTimer.singleShot(0, self.reattach)

    @property
    def sup(self):
        """The session's supervisor, made on first use — by the first task that needs it, on its own thread
        (:meth:`EngineSession.configure`)."""
        return self.session.supervisor

    # -- layout ----------------------------------------------------------------------------------------------------
    def _build(self) -> None:
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 4, 0, 0)
        lay.setSpacing(6)
        self.connections = ConnectionsView(self.ctx, list_later=self._list_later)
        lay.addWidget(self.connections)
        line = QFrame()
        line.setFrameShape(QFrame.Shape.HLine)
        line.setFrameShadow(QFrame.Shadow.Sunken)
        lay.addWidget(line)
        row = QHBoxLayout()
        row.addWidget(QLabel("Engine"))
        self.engine_box = QComboBox()
        self.engine_box.setObjectName("engineSelector")
        self.engine_box.addItem("Auto", "auto")
        for name in ENGINE_NAMES:                       # engines.registry's order, each Engine.choice_label
            self.engine_box.addItem(get_engine(name).choice_label, name)
        self.engine_box.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.engine_box.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.engine_box.setMinimumContentsLength(12)
        idx = self.engine_box.findData(self.ctx.settings.server_engine)
        self.engine_box.setCurrentIndex(max(0, idx))
        self.engine_box.currentIndexChanged.connect(self._engine_chosen)
        row.addWidget(self.engine_box, 1)
        lay.addLayout(row)
        self.resolved = QLabel()
        self.resolved.setObjectName("engineResolved")
        self.resolved.setWordWrap(True)
        self.resolved.setStyleSheet("color: palette(mid);")
        lay.addWidget(self.resolved)

        self.badge = QLabel()
        self.badge.setObjectName("stateBadge")
        self.badge.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.badge.setMinimumHeight(30)
        f = self.badge.font()
        f.setBold(True)
        f.setPointSizeF(f.pointSizeF() * 1.15)
        self.badge.setFont(f)
        lay.addWidget(self.badge)

        self.start_button = QPushButton("Start")
        self.start_button.setObjectName("startStopButton")
        self.start_button.setMinimumHeight(36)
        self.start_button.clicked.connect(self.toggle)
        lay.addWidget(self.start_button)

        self.progress = QProgressBar()
        self.progress.setObjectName("readyProgress")
        self.progress.setTextVisible(True)
        self.progress.hide()
        lay.addWidget(self.progress)
        self.phase = QLabel()
        self.phase.setObjectName("readyPhase")
        self.phase.setWordWrap(True)
        self.phase.hide()
        lay.addWidget(self.phase)

        # the watchdog's verdict (engine_manager.liveness_line): stalled / unavailable, with Restart for its own engine
        self.liveness_box = QFrame()
        self.liveness_box.setObjectName("livenessBox")
        self.liveness_box.setFrameShape(QFrame.Shape.StyledPanel)
        live_lay = QVBoxLayout(self.liveness_box)
        live_lay.setContentsMargins(8, 6, 8, 6)
        self.liveness_label = _text_label("livenessLine", Qt.TextFormat.PlainText)
        live_lay.addWidget(self.liveness_label)
        self.liveness_restart = QPushButton("Restart")
        self.liveness_restart.setObjectName("livenessRestart")
        self.liveness_restart.setToolTip("Stop the engine, then start it again with the settings as they are now")
        self.liveness_restart.clicked.connect(self.restart_stalled)
        live_lay.addWidget(self.liveness_restart, 0, Qt.AlignmentFlag.AlignLeft)
        self.liveness_box.hide()
        lay.addWidget(self.liveness_box)

        self.banner = CrashBanner()
        self.banner.log_button.clicked.connect(lambda: self.ctx.requestTab.emit("Log"))
        lay.addWidget(self.banner)
        self.checks = ChecksView(self.ctx)       # planned vs measured: amber when not as planned
        lay.addWidget(self.checks)

        self.details = _text_label("engineDetails", Qt.TextFormat.RichText)
        lay.addWidget(self.details)
        # beside the engine's address: its key, for attaching to it from elsewhere (masked everywhere else)
        self.copy_key_button = QPushButton("Copy API key…")
        self.copy_key_button.setObjectName("copyApiKey")
        self.copy_key_button.setToolTip(f"Copy this engine's API key to the clipboard, to attach to it from another "
                                        f"program (asks first; taken off the clipboard after {KEY_CLIPBOARD_S} s)")
        self.copy_key_button.clicked.connect(self.copy_api_key)
        self.copy_key_button.hide()
        lay.addWidget(self.copy_key_button)
        self.key_clear_s = float(KEY_CLIPBOARD_S)
        self._copied_key: str | None = None
        self._key_timer = QTimer(self)
        self._key_timer.setSingleShot(True)
        self._key_timer.timeout.connect(self.clear_copied_key)

        self.placement_box = QFrame()
        self.placement_box.setObjectName("enginePlacementBox")
        self.placement_box.setFrameShape(QFrame.Shape.StyledPanel)
        self.placement_box.setToolTip("llama-server prints where it put each buffer while it loads the model; this "
                                      "is what it printed, so you can see the plan's placement took effect")
        box = QVBoxLayout(self.placement_box)
        box.setContentsMargins(6, 4, 6, 4)
        box.setSpacing(2)
        head = QLabel("Placement (from llama-server's log)")
        f = head.font()
        f.setBold(True)
        head.setFont(f)
        box.addWidget(head)
        self.placement_label = _text_label("enginePlacement", Qt.TextFormat.PlainText)
        box.addWidget(self.placement_label)
        self.placement_box.hide()
        lay.addWidget(self.placement_box)

        self.auto_restart = QCheckBox("Restart after a crash")
        self.auto_restart.setObjectName("autoRestart")
        limit, window_s = self.session.crash_rule()
        self.auto_restart.setToolTip("Restart the engine after a crash, waiting longer after each one, and give up "
                                     f"after {limit} crashes within {window_s / 60:.0f} minutes (a crash loop)")
        self.auto_restart.setChecked(bool(self.ctx.settings.auto_restart))
        self.auto_restart.toggled.connect(self._auto_restart_toggled)
        lay.addWidget(self.auto_restart)

        self.dry_button = QPushButton("Dry run…")
        self.dry_button.setObjectName("dryRunButton")
        self.dry_button.setToolTip("Show every command a start would run on this machine (copyable)")
        self.dry_button.clicked.connect(self.dry_run)
        lay.addWidget(self.dry_button)

        self.notes_toggle = QToolButton()
        self.notes_toggle.setObjectName("engineNotesToggle")
        self.notes_toggle.setText("Start details")
        self.notes_toggle.setCheckable(True)
        self.notes_toggle.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.notes_toggle.setArrowType(Qt.ArrowType.RightArrow)
        self.notes_toggle.setAutoRaise(True)
        self.notes_toggle.setToolTip("The plan, the NUMA binding probes and where the log is")
        self.notes_toggle.toggled.connect(self._toggle_notes)
        self.notes_toggle.hide()
        lay.addWidget(self.notes_toggle)
        self.notes = _text_label("engineNotes")
        self.notes.setStyleSheet("color: palette(mid); font-size: 90%;")
        self.notes.hide()
        lay.addWidget(self.notes)
        lay.addStretch(1)
        self._update_resolved()

    def _build_actions(self) -> None:
        self.start_action = QAction("&Start engine", self)
        self.start_action.setObjectName("actionStart")
        self.start_action.setShortcut(QKeySequence("Ctrl+R"))
        self.start_action.triggered.connect(self.start)
        self.stop_action = QAction("S&top engine", self)
        self.stop_action.setObjectName("actionStop")
        self.stop_action.setShortcut(QKeySequence("Ctrl+."))
        self.stop_action.triggered.connect(self.stop)
        self.force_action = QAction("&Force stop (SIGKILL)", self)
        self.force_action.setObjectName("actionForceStop")
        self.force_action.triggered.connect(self.force_stop)
        self.dry_action = QAction("&Dry run…", self)
        self.dry_action.setObjectName("actionDryRun")
        self.dry_action.triggered.connect(self.dry_run)
        for a in (self.start_action, self.stop_action, self.force_action, self.dry_action):
            self.addAction(a)

    def actions_for_menu(self) -> list[QAction]:
        return [self.start_action, self.stop_action, self.force_action, self.dry_action,
                *self.connections.actions_for_menu()]

    # -- helpers ----------------------------------------------------------------------------------------------------
    def selected_engine(self) -> str:
        return self.engine_box.currentData() or "auto"

    def resolved_engine(self) -> str:
        choice = self.selected_engine()
        if choice != "auto":
            return choice
        return resolve_engine(self.ctx.settings, self.ctx.has_gpu)

    @property
    def placement(self) -> PlacementSummary:
        if self._placement is None:
            from engine_manager.engines.llamacpp import PlacementSummary
            self._placement = PlacementSummary()
        return self._placement

    @placement.setter
    def placement(self, summary: PlacementSummary) -> None:
        self._placement = summary

    def _update_resolved(self) -> None:
        name = self.resolved_engine()
        if self.selected_engine() == "auto":
            why = "a GPU was found" if self.ctx.has_gpu else (
                "no NVIDIA GPU here" if self.ctx.hardware is not None else "probing the hardware…")
            self.resolved.setText(f"→ {find_engine(name).words or name} ({why})")
        elif find_engine(name).simulated:
            self.resolved.setText("Every figure it reports is simulated.")
        else:
            self.resolved.setText("")
        build = engine_release_facts(name, self.ctx.settings)     # e.g. Strata's engine/BUILD.json
        if build:
            shown = self.resolved.text()
            self.resolved.setText((shown + "\n" if shown else "") + f"Engine build: {build}")
        self.resolved.setVisible(bool(self.resolved.text()))

    @property
    def state(self) -> str:
        return self._state

    def is_running(self) -> bool:
        return self._state in RUNNING_STATES or self.tasks.running("run")

    # -- intents ----------------------------------------------------------------------------------------------------
    def _watch_refusal(self) -> str | None:
        """Why Start/Stop are not offered now: something else drives the engine (the benchmark), or a connection
        (an engine this panel did not start) is watched."""
        lock = getattr(self.ctx, "engine_lock", None)
        if lock:
            return lock
        name = getattr(self.ctx, "watching", None)
        if not name:
            return None
        return (f"You are watching {name!r}, an engine this panel did not start: it is never started or stopped "
                "from here. Choose “This panel's engine” under Watching (Ctrl+Shift+H) to start or stop the "
                "panel's own engine.")

    def toggle(self) -> None:
        why = self._watch_refusal()
        if why:
            self.ctx.statusMessage.emit(why, 8000)
            return
        if self._state == STOPPING:
            self.force_stop()
        elif self.is_running():
            self.stop()
        else:
            self.start()

    def start_with_plan(self, plan: dict) -> None:
        """The Placement tab's "Start with this plan": start with exactly ``plan`` (taken once), or — an engine
        runs — offer to restart it with that plan."""
        self._chosen_plan = plan
        self.start()

    def start(self) -> None:
        if self.is_running() or self.tasks.running("stop"):
            if self._chosen_plan is not None:         # "Start with this plan" while one runs
                self._offer_restart_with_plan()
            return
        why = self._watch_refusal()
        if why:                              # (the chat pane's Start, a shortcut): never while a connection is shown
            self.ctx.statusMessage.emit(why, 8000)
            return
        self.banner.hide()
        self._refused_cause = None
        self._last_notes = []
        self.notes.setText("")
        self.notes_toggle.hide()
        self.placement.reset()
        self._show_placement()
        self.session.configure(settings=self.ctx.settings, hardware=self.ctx.hardware,
                               auto_restart=self.auto_restart.isChecked())
        engine = self.resolved_engine()
        self._render_state(STARTING, f"starting {find_engine(engine).words or engine}")
        # the Placement tab's "Start with this plan": that plan as it is, even one made for another host (warned)
        chosen, self._chosen_plan = self._chosen_plan, None
        plan = chosen if chosen is not None else usable_plan(engine, self.ctx.plan)
        warning = plan_host_warning(chosen, self.ctx.hardware) if chosen is not None else None
        if warning:
            self._add_note(warning[0].upper() + warning[1:], "warning")
        self.tasks.start("run", self.session.start, engine, plan, feed=False, on_event=self._on_event,
                         on_done=self._run_done, on_error=self._on_error, on_finished=self._run_finished)

    def ask_restart(self, text: str, action: str) -> bool:
        """Ask whether to restart the running engine now (a dialog; tests replace this method)."""
        box = QMessageBox(self.window())
        box.setIcon(QMessageBox.Icon.Question)
        box.setWindowTitle("The engine is running")
        box.setText(text)
        yes = box.addButton(action, QMessageBox.ButtonRole.AcceptRole)
        box.addButton("Not now", QMessageBox.ButtonRole.RejectRole)
        box.setDefaultButton(yes)
        box.exec()
        return box.clickedButton() is yes

    def _offer_restart_with_plan(self) -> None:
        if self.tasks.running("stop") or self._restart_after_stop:
            return
        label = ((self._chosen_plan or {}).get("hardware") or {}).get("label")
        text = ("The engine is already running, with the plan it was started with. Restart it with this plan"
                + (f" (made for {label})" if label else "") + "? It stops, then starts again with the plan.")
        if self.ask_restart(text, "Restart with this plan"):
            self.restart()              # start() takes the chosen plan once the engine has stopped
        else:
            self._chosen_plan = None
            self.ctx.statusMessage.emit("Not restarted: the engine keeps running with its plan.", 6000)

    def restart(self) -> None:
        """Stop the engine, then start it again with the settings as they are now (and the Placement tab's plan,
        when one was chosen: :meth:`start_with_plan`)."""
        why = self._watch_refusal()
        if why:
            self.ctx.statusMessage.emit(why, 8000)
            return
        if not self.is_running() and not self.tasks.running("stop"):
            self.start()
            return
        self._restart_after_stop = True
        self.ctx.statusMessage.emit("Restarting the engine: stopping it first…", 8000)
        if not self.tasks.running("stop"):
            self.stop()

    def _start_when_stopped(self) -> None:
        if self.tasks.shut_down or not self._restart_after_stop:
            return
        if self.is_running() or self.tasks.running("stop"):
            QTimer.singleShot(100, self._start_when_stopped)
            return
        self._restart_after_stop = False
        self.start()

    def stop(self) -> None:
        why = self._watch_refusal()
        if why:
            self.ctx.statusMessage.emit(why, 8000)
            return
        self._refused_cause = None
        if self._state == STOPPING:
            self.force_stop()
            return
        if self.tasks.running("stop"):
            return
        if not self.is_running() and self._state not in (CRASHED,):
            return
        self._stop_started = time.monotonic()
        self.tasks.start("stop", self.session.stop, feed=False, on_event=self._on_event, on_error=self._on_error,
                         on_finished=self._stop_finished)

    def force_stop(self) -> None:
        if self.tasks.running("stop"):
            self.session.request_force()
            return
        if not self.is_running():
            return
        self._stop_started = time.monotonic()
        self.tasks.start("stop", self.session.stop, True, feed=False, on_event=self._on_event,
                         on_error=self._on_error, on_finished=self._stop_finished)

    def reattach(self) -> None:
        """Find an engine a previous panel or `dsv41 start` left running (pid + start time + health must match)
        and supervise it; after a dead one, clean up and show how it ended."""
        if self.tasks.running("run") or self.tasks.shut_down:
            return
        self.session.configure(settings=self.ctx.settings, auto_restart=self.auto_restart.isChecked())
        if self._state == STOPPED and self.session.record_exists():
            # an engine was left running (or its record was): say so for the seconds the check takes, not "Stopped"
            self._render_state("reattaching", "re-attaching to the running engine…")
        self.tasks.start("run", self.session.watch, feed=False, on_event=self._on_event, on_done=self._run_done,
                         on_error=self._on_error, on_finished=self._run_finished)

    def dry_run(self) -> None:
        self.session.configure(settings=self.ctx.settings, hardware=self.ctx.hardware)
        self.dry_button.setEnabled(False)
        self.ctx.statusMessage.emit("Preparing the dry run (probing the binding)…", 3000)
        engine = self.resolved_engine()
        self.tasks.start("dry", self.session.dry_run, engine, usable_plan(engine, self.ctx.plan),
                         on_done=self._show_dry_run, on_error=self._on_error,
                         on_finished=lambda: self.dry_button.setEnabled(True))

    def _show_dry_run(self, dr: DryRun) -> None:
        self.last_dry_run = DryRunDialog(dr.render(), self)
        self.last_dry_run.setModal(False)
        self.last_dry_run.show()

    # -- events from the supervisor ----------------------------------------------------------------------------------
    def _on_event(self, ev: Event) -> None:
        # the events' module (a dozen frozen dataclasses: 10–17 ms of import) comes with the first event, not with
        # the engine column's first step
        from engine_manager.supervisor_events import (Attached, Crashed, GaveUp, LogLines, Note, Progress, Ready,
                                                      Restarting, StartFailed, StateChanged, Stopped, Stopping)

        self.session.feed(ev)          # the ready engine (ctx.running, engineRunning) and the log (engineLog)
        match ev:
            case LogLines():
                if self.placement.add_log_lines(ev.lines, ev.events):
                    self._show_placement()
            case StateChanged():
                self._render_state(ev.state, ev.message, ev)
            case Progress():
                self._show_progress(ev)
            case Ready():
                self.progress.hide()
                self.phase.hide()
                if not (ev.attached and self._refused_cause == "engine_running"):
                    self.banner.hide()          # (a refused start's reason stays: it names the engine now shown)
                self.ctx.statusMessage.emit(f"Engine ready at {ev.base_url}"
                                            + (" (re-attached)" if ev.attached else f" after {fmt_s(ev.elapsed_s)}"),
                                            6000)
                self._refresh_details()
            case Crashed():
                extra = ""
                if ev.will_restart:
                    # the countdown itself is one line (the phase line above the banner), fed by the supervisor's
                    # Restarting events: the banner says what happens, not a second, drifting number
                    extra = (f"The panel restarts it automatically (crash {ev.crashes_in_window}; it gives up after "
                             f"{self.sup.crash_limit} within {self.sup.crash_window_s / 60:.0f} min).")
                    self._show_restart_countdown(ev.restart_in_s or 0.0, ev.crashes_in_window)
                self.banner.show_problem(ev.title, self._gui_fix(ev.cause, ev.fix), extra)
            case Restarting():
                self._show_restart_countdown(ev.remaining_s, ev.attempt)
            case GaveUp():
                self.banner.show_problem(self.banner.title.text() or "The engine keeps crashing",
                                         self.banner.fix.text(), ev.message)
            case StartFailed():
                extra = ("Last log lines:\n" + "\n".join(ev.log_tail[-8:])) if ev.log_tail else ""
                if ev.cause == "engine_running":
                    self._refused_cause = ev.cause
                quiet = ev.cause in ("port_in_use", "busy", "engine_running")
                self.banner.show_problem(ev.message, self._gui_fix(ev.cause, ev.fix, ev.suggested_port), extra,
                                         severe=not quiet, show_log=not quiet)
                self.progress.hide()
                self.phase.hide()
            case Stopping():
                left = max(0.0, ev.grace_s - ev.elapsed_s)
                self.phase.setText(f"{ev.signal_name} sent {fmt_s(ev.elapsed_s)} ago; {ev.remaining} process(es) "
                                   "left" + (f" — SIGKILL in {fmt_s(left)} (or Force stop now)"
                                             if ev.signal_name == "SIGTERM" else ""))
                self.phase.show()
            case Stopped():
                self.progress.hide()
                self.phase.hide()
                self.banner.hide()                        # a stop the user asked for ends the crash story
                self.ctx.statusMessage.emit(ev.message, 5000)
            case Attached():
                self.ctx.statusMessage.emit(ev.message, 8000)
                self._emitted_state = ev.state
                self.ctx.engineStateChanged.emit(ev)
                if find_engine(ev.engine).placement_in_log:   # its loading lines went by before this panel watched
                    from engine_manager.engines.llamacpp import placement_from_log
                    self.tasks.start("placement", placement_from_log, self.session.log_path,
                                     on_done=self._placement_read,
                                     on_error=lambda _exc: None)  # an unreadable log: the box just stays empty
            case Note():
                self._add_note(ev.text, ev.level)

    # -- the watchdog's verdict ---------------------------------------------------------------------------------------
    def _restartable(self) -> bool:
        """The watched engine is the panel's own (the session's, which Start/Stop act on — not an attached
        connection) and nothing else holds it (the benchmark)."""
        own = getattr(self.ctx, "own", None)
        return own is not None and getattr(self.ctx, "running", None) is own and self._watch_refusal() is None

    def show_liveness(self, live: Any) -> None:
        """The watchdog's verdict on the watched engine (``ctx.livenessReported``): an amber "Engine stalled: …" or
        red "Engine unavailable: …" line with Restart for the panel's own engine; a stall of its own engine is
        restarted automatically once per episode while "Restart after a crash" is on; hidden once it moves."""
        line = self.stall_episode.judge(live, own=self._restartable(), auto_restart=self.auto_restart.isChecked())
        if line is None:
            if getattr(live, "state", None) in ("ok", "idle"):
                self.liveness_box.hide()
            return
        self._draw_liveness(line)
        if line.restart_now:
            self._stall_restart_note = f"Restarted automatically after a stall: {getattr(live, 'detail', '')}."
            self.ctx.statusMessage.emit("The engine stalled: restarting it (“Restart after a crash” is on)…", 15000)
            self.restart()

    def _draw_liveness(self, line: LivenessLine) -> None:
        bg, fg = ("#fde2e1", "#7d0d14") if line.severe else ("#fff4e5", "#6b4100")
        self.liveness_box.setStyleSheet(f"QFrame#livenessBox {{ background: {bg}; border: 1px solid {fg}; "
                                        f"border-radius: 4px; }} QLabel {{ color: {fg}; font-weight: bold; }}")
        self.liveness_label.setText(line.text)
        self.liveness_restart.setVisible(line.offer_restart)
        self.liveness_box.show()

    def restart_stalled(self) -> None:
        """The line's Restart: the panel's own engine, through the session (:meth:`restart`)."""
        if not self._restartable():
            return
        self.liveness_box.hide()
        self.restart()

    def _watched_changed(self, running: Any) -> None:
        # another engine (or a restarted one) is watched: the old verdict is not about it; the watchdog starts over
        if running is None and self._stall_restart_note is not None:
            return                      # the automatic restart's stop: its line stays until the engine is back
        self.liveness_box.hide()
        if running is not None and self._stall_restart_note is not None:
            note, self._stall_restart_note = self._stall_restart_note, None
            self._add_note(note, "warning")

    def _placement_read(self, summary: PlacementSummary) -> None:
        # the file holds every line the live events brought since the attach, and those before it
        if summary.has_placement and summary.events >= self.placement.events:
            self.placement = summary
            self._show_placement()

    def _show_placement(self) -> None:
        has = self.placement.has_placement
        self.placement_label.setText(self.placement.text() if has else "")
        self.placement_box.setVisible(has)

    def _add_note(self, text: str, level: str) -> None:
        self._last_notes = (self._last_notes + [("⚠ " if level == "warning" else "") + text.strip()])[-8:]
        self.notes.setText("\n".join(self._last_notes))
        self.notes_toggle.show()
        if level == "warning":
            self.ctx.statusMessage.emit(text, 8000)

    def _toggle_notes(self, on: bool) -> None:
        self.notes_toggle.setArrowType(Qt.ArrowType.DownArrow if on else Qt.ArrowType.RightArrow)
        self.notes.setVisible(on)

    def _show_restart_countdown(self, remaining_s: float, attempt: int) -> None:
        self.progress.hide()
        self.phase.setText(f"Restarting in {remaining_s:.1f} s (crash {attempt})")
        self.phase.show()

    def _gui_fix(self, cause: str, fix: str, suggested_port: int | None = None) -> str:
        """The supervisor's fix, worded for the window: a port is changed in File ▸ Settings… (``suggested_port``:
        one that is free now), a running engine is stopped with the Stop button."""
        if cause == "engine_running":
            return (f"Press Stop above (it stops the engine that runs; `dsv41 stop` does the same in a terminal), "
                    f"then Start {find_engine(self.resolved_engine()).words or 'the engine'}. Only one engine runs at "
                    "a time; starting the same engine again re-attaches to it.")
        if cause != "port_in_use":
            return fix
        alt = f" ({suggested_port} is free now)" if suggested_port else ""
        if self.ctx.loaded.env_locked("port"):
            where = (f"DSV41_PORT is set in the environment, so change it there{alt} and restart the panel "
                     "(File ▸ Settings… shows it locked).")
        else:
            where = f"choose another port in File ▸ Settings… → Port{alt}, then Start again."
        cli = f" From a terminal: `dsv41 settings set port {suggested_port or '<N>'}`."
        return f"Stop that program (`ss -ltnp` shows it), or {where}{cli}"

    def _show_progress(self, ev: Progress) -> None:
        if ev.fraction is not None:
            self.progress.setRange(0, 1000)
            self.progress.setValue(int(ev.fraction * 1000))
            self.progress.setFormat(f"{ev.fraction * 100:.0f} %")
        else:
            self.progress.setRange(0, 0)          # busy: the engine does not say how far it is
        self.progress.show()
        eta = f" · about {fmt_s(ev.eta_s)} left" if ev.eta_s else ""
        quiet = (f" · no output for {fmt_s(ev.last_output_age_s)}" if ev.last_output_age_s and
                 ev.last_output_age_s > 30 else "")
        self.phase.setText(f"{ev.phase}\n{fmt_s(ev.elapsed_s)} elapsed of up to {fmt_s(ev.timeout_s)}{eta}{quiet}")
        self.phase.show()

    def _clear_ready(self) -> None:
        self.session.set_running(None)

    def _run_done(self, st: EngineStatus | None) -> None:
        if st is not None:
            self._render_state(st.state, st.message)

    def _run_finished(self) -> None:
        if self._state == "reattaching":        # the look found nothing to re-attach to
            self._state = STOPPED
        if self._state in (STOPPED, CRASHED):
            self._clear_ready()
            if not self._restart_after_stop:            # an automatic stall restart that did not start again
                self._stall_restart_note = None
                self.liveness_box.hide()
        self._render_state(self._state, "")
        if self._refused_cause == "engine_running" and not self.tasks.shut_down:
            QTimer.singleShot(0, self.reattach)     # show (and offer to stop) the engine that runs

    def _stop_finished(self) -> None:
        self._stop_started = None
        self._render_state(self._state, "")
        if self._restart_after_stop and self._close_after_stop is None:
            QTimer.singleShot(0, self._start_when_stopped)
        if self._close_after_stop is not None and not self.tasks.running("run"):
            win, self._close_after_stop = self._close_after_stop, None
            QTimer.singleShot(0, win.close)
        elif self._close_after_stop is not None:
            QTimer.singleShot(100, self._stop_finished)

    def _on_error(self, exc: BaseException) -> None:
        self.banner.show_problem("The panel hit an error while handling the engine",
                                 f"{exc.__class__.__name__}: {exc}", "Details are in the terminal; `dsv41 status` "
                                 "shows what runs.", severe=True)

    # -- rendering --------------------------------------------------------------------------------------------------
    def _render_state(self, state: str, message: str, ev: Any = None) -> None:
        """Show ``state`` on the badge and buttons, and tell the rest of the window (``ctx.engineStateChanged``:
        the status bar, the chat pane) whenever what the badge shows changes — the supervisor's own event when
        there is one, else a StateChanged made here — so they never disagree with the badge."""
        prev = self._state
        self._state = state
        if ev is not None or state != self._emitted_state:
            self._emitted_state = state
            if ev is None:
                from engine_manager.supervisor_events import StateChanged
                ev = StateChanged(state, prev, message)
            self.ctx.engineStateChanged.emit(ev)
        text, bg, fg = BADGE.get(state, (state, "#eee", "#333"))
        self.badge.setText(text)
        self.badge.setToolTip(message or text)
        self.badge.setStyleSheet(f"QLabel#stateBadge {{ background: {bg}; color: {fg}; border-radius: 4px; "
                                 "padding: 4px; }")
        running = self.is_running()
        stopping = state == STOPPING or self.tasks.running("stop")
        if stopping:
            self.start_button.setText("Force stop")
            self.start_button.setToolTip("Kill the engine now (SIGKILL) instead of waiting for the grace period")
        elif running:
            self.start_button.setText("Stop")
            self.start_button.setToolTip("Stop the engine: SIGTERM, a grace period, then SIGKILL (Ctrl+.)")
        else:
            self.start_button.setText("Start")
            self.start_button.setToolTip("Start the engine (Ctrl+R)")
        why = self._watch_refusal()
        self.start_button.setEnabled(why is None)
        if why:
            self.start_button.setToolTip(why)
        self.start_action.setEnabled(not running and not stopping and why is None)
        self.stop_action.setEnabled(running and not stopping and why is None)
        self.force_action.setEnabled((running or stopping) and why is None)
        self.engine_box.setEnabled(not running and not stopping)
        if state == READY:
            self.progress.hide()                      # (the Ready event that follows hides them too)
            self.phase.hide()
        if state in (STOPPED, CRASHED) and not running:
            self.progress.hide()
            if not stopping:
                self.phase.hide()
        self._refresh_details()

    def _refresh_details(self) -> None:
        st = self.session.snapshot()
        own = getattr(self.ctx, "own", None)
        self.copy_key_button.setVisible(st is not None and bool(st.ready_at) and own is not None
                                        and bool(own.api_key) and self._state == READY)
        if st is None or self._state in (STOPPED, CRASHED):
            if not self.details.text().startswith("<b>Port"):
                self.details.setText("")
                self.details.hide()
            return
        parts = [f"<b>{html.escape(st.label or st.engine or '')}</b>"
                 + (f" · {html.escape(st.started_by_words)}" if st.started_by_words else "")]
        # to the minute: a label that changed every second relaid and repainted the whole column each second
        up_s = st.uptime_s() if self._state == READY else None
        up = f" · up {fmt.uptime(up_s)}" if up_s is not None else ""
        if up_s is not None:        # just past the next whole minute of uptime
            self.clock.start(int((60.0 - up_s % 60.0) * 1000) + 50)
        parts.append(f"pid {st.pid or '?'} · port {st.port}{up}")
        if st.ready_at:
            parts.append(f"<code>{html.escape(st.base_url or '')}</code>")
        if st.binding:
            parts.append(f"binding: {html.escape(st.binding)}")
        if st.binding_note and "one NUMA node" in st.binding_note:
            parts.append("<i>one NUMA node here: binding cannot change speed</i>")
        self.details.setToolTip(st.binding_note or "")
        text = "<br>".join(parts)
        if self.details.text() != text:
            self.details.setText(text)
        self.details.show()

    # -- the API key, on request ------------------------------------------------------------------------------------
    def ask_copy_key(self, base_url: str) -> bool:
        """Whether to put the key on the clipboard (a question that says what that means)."""
        box = QMessageBox(QMessageBox.Icon.Question, "Copy the API key",
                          f"Copy the API key of the engine at {base_url} to the clipboard?", parent=self.window())
        box.setObjectName("copyKeyConfirm")
        box.setInformativeText("Any program you run can read the clipboard, and a clipboard history may keep it. "
                               "Paste it only where this engine should be reached from (Attach to… in another "
                               "panel, a client's settings). The panel takes it off the clipboard after "
                               f"{self.key_clear_s:g} s if it is still there.")
        box.setStandardButtons(QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.Cancel)
        box.button(QMessageBox.StandardButton.Yes).setText("Copy API key")
        box.setDefaultButton(QMessageBox.StandardButton.Cancel)
        return box.exec() == QMessageBox.StandardButton.Yes

    def copy_api_key(self) -> bool:
        """Copy the panel's own engine's API key to the clipboard, after a confirmation; it is taken off the
        clipboard after ``key_clear_s`` (and when the panel closes) if it is still there. True when copied."""
        own = getattr(self.ctx, "own", None)
        if own is None or not own.api_key:
            self.ctx.statusMessage.emit("No engine of this panel is running: there is no key to copy.", 6000)
            return False
        if not self.ask_copy_key(own.base_url):
            return False
        data = QMimeData()
        data.setText(own.api_key)
        data.setData("x-kde-passwordManagerHint", QByteArray(b"secret"))   # clipboard managers: keep no history
        QGuiApplication.clipboard().setMimeData(data)
        self._copied_key = own.api_key
        self._key_timer.start(int(self.key_clear_s * 1000))
        self.ctx.statusMessage.emit(f"The API key is on the clipboard for {self.key_clear_s:g} s.", 8000)
        return True

    def clear_copied_key(self) -> None:
        """Take the copied key off the clipboard, unless something else was copied since."""
        key, self._copied_key = self._copied_key, None
        self._key_timer.stop()
        if key and QGuiApplication.clipboard().text() == key:
            QGuiApplication.clipboard().clear()

    # -- settings / hardware -----------------------------------------------------------------------------------------
    def _engine_chosen(self, _i: int) -> None:
        name = self.selected_engine()
        self._update_resolved()
        if name != self.ctx.settings.server_engine and not self.ctx.loaded.env_locked("server_engine"):
            try:
                self.ctx.update_settings({"server_engine": name})
            except Exception as exc:  # a settings file that cannot be written: say so, keep the choice
                self.ctx.statusMessage.emit(f"Could not save the engine choice: {exc}", 6000)

    def _auto_restart_toggled(self, on: bool) -> None:
        self.session.configure(auto_restart=on)
        if bool(self.ctx.settings.auto_restart) != on and not self.ctx.loaded.env_locked("auto_restart"):
            try:
                self.ctx.update_settings({"auto_restart": on})
            except Exception as exc:
                self.ctx.statusMessage.emit(f"Could not save the auto-restart choice: {exc}", 6000)

    def _settings_changed(self, loaded) -> None:
        if not self.is_running():
            self.session.configure(settings=loaded.settings)
        self.auto_restart.blockSignals(True)
        self.auto_restart.setChecked(bool(loaded.settings.auto_restart))
        self.auto_restart.blockSignals(False)
        self.session.configure(auto_restart=bool(loaded.settings.auto_restart))
        idx = self.engine_box.findData(loaded.settings.server_engine)
        if idx >= 0 and idx != self.engine_box.currentIndex():
            self.engine_box.blockSignals(True)
            self.engine_box.setCurrentIndex(idx)
            self.engine_box.blockSignals(False)
        self._update_resolved()

    def _hardware_changed(self, report) -> None:
        if not self.is_running():
            self.session.configure(hardware=report)
        self._update_resolved()

    # -- engines started elsewhere ----------------------------------------------------------------------------------
    def _poll_status(self) -> None:
        """While idle, notice an engine started by `dsv41 start` (then attach) or a foreign one on the port."""
        if self.tasks.running("status") or self.is_running() or self.tasks.running("stop") or self.tasks.shut_down:
            return
        self.tasks.start("status", self.session.status, on_done=self._polled)

    def _polled(self, st: EngineStatus) -> None:
        if self.is_running() or self.tasks.shut_down:
            return
        if st.owner == "panel" and st.running:
            self.reattach()
        elif st.external:
            self.details.setText(f"<b>Port {self.ctx.settings.port} is taken</b> by something this panel did not "
                                 f"start: {html.escape(_owner_words(st.external))}. It is shown, never "
                                 "stopped; to start an engine, choose another port in File ▸ Settings… → Port.")
            self.details.show()
        elif self.details.text().startswith("<b>Port"):
            self.details.hide()

    # -- closing -----------------------------------------------------------------------------------------------------
    def ask_close_choice(self, win) -> str:
        """"stop", "leave" or "cancel" (a dialog; tests replace this method)."""
        box = QMessageBox(win)
        box.setIcon(QMessageBox.Icon.Question)
        box.setWindowTitle("The engine is running")
        box.setText("The engine is still running. Stop it before closing?")
        box.setInformativeText("Leave it running to keep serving (for example to `dsv41 chat`); the next start of "
                               "the panel re-attaches to it.")
        stop = box.addButton("Stop the engine", QMessageBox.ButtonRole.AcceptRole)
        leave = box.addButton("Leave it running", QMessageBox.ButtonRole.DestructiveRole)
        box.addButton(QMessageBox.StandardButton.Cancel)
        box.setDefaultButton(stop)
        box.exec()
        clicked = box.clickedButton()
        return "stop" if clicked is stop else "leave" if clicked is leave else "cancel"

    def confirm_close(self, win) -> bool:
        if self._close_after_stop is not None:
            return False                              # still stopping: the window closes when it is done
        if self._state not in RUNNING_STATES and not self.tasks.running("stop"):
            # no engine known to run — at most the start-up look for one a previous panel left (a quit in the
            # first ~0.2 s asked "The engine is still running…" about nothing, and under automation nobody
            # answered: `dsv41-panel --quit-after 0` hung); shutdown() stops that look
            return True
        choice = self.ask_close_choice(win)
        if choice == "leave":
            self.session.detach()
            return True
        if choice == "stop":
            self._close_after_stop = win
            self.ctx.statusMessage.emit("Stopping the engine before closing…", 0)
            self.stop()
            return False
        return False

    def closeEvent(self, event) -> None:  # noqa: N802 - Qt's name; only when the panel is a window of its own
        self.shutdown()
        super().closeEvent(event)

    def shutdown(self, wait_ms: int = QUIT_WAIT_MS) -> None:
        self.poll_timer.stop()
        self.clock.stop()
        self.clear_copied_key()
        self.connections.shutdown()
        self.checks.shutdown()
        if self.tasks.running("run") and self._state not in (STOPPING,):
            self.session.detach()                     # stop watching; the engine keeps running
        self.tasks.shutdown(wait_ms)                  # later callbacks are dropped; the workers are asked to end
