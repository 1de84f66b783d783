"""The shared state of the window's parts: settings, the hardware probe, and signals that connect the panels.

Panels never reach into each other; they talk through one ``AppContext``. The engine is an
:class:`engine_manager.session.EngineSession` (made by ``app/main.py``, not by a widget; made here when none is
given): the context only re-emits its events — ``engineLog`` for its log lines, ``engineRunning`` when the watched
engine changes — and keeps ``running``, the one handle.

Two engines may be known at once: the panel's **own** engine (``own``: the session's, started or
re-attached by the engine panel) and the **watched** one (``running``): what the Monitor and the chat pane work on.
They are the same until :meth:`AppContext.watch` points the window at a saved connection (an engine the panel did
not start, ``started_by_panel=False``); the own engine keeps running meanwhile, and ``watch(None)`` shows it again.
``engineRunning`` always carries the watched engine; ``ownEngineChanged`` the own one; ``watchChanged`` the name
of the watched connection (None: the panel's own engine).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from PySide6.QtCore import QObject, Signal

from engine_manager.engine_state import RunningEngine
from engine_manager.session import EngineSession
from engine_manager.settings import LoadedSettings, resolve_engine, save_settings

if TYPE_CHECKING:
    from engine_manager.hardware import HardwareReport      # the probe's module: imported by the probe's worker


class AppContext(QObject):
    settingsChanged = Signal(object)        # LoadedSettings
    hardwareChanged = Signal(object)        # HardwareReport
    planChanged = Signal(object)            # the placement plan (dict) or None
    engineStateChanged = Signal(object)     # the supervisor's state event
    engineLog = Signal(object)              # engine_manager.supervisor.LogLines: new engine log lines (batched)
    engineRunning = Signal(object)          # the watched engine's RunningEngine when ready, None when none is
    ownEngineChanged = Signal(object)       # the panel's own engine (RunningEngine) when ready, None when it stops
    watchChanged = Signal(object)           # the watched connection's name, None for the panel's own engine
    sampleArrived = Signal(object)          # engine_manager.engines.base.Sample
    livenessReported = Signal(object)       # engine_manager.watchdog.Liveness of the watched engine, per sample
    statusMessage = Signal(str, int)        # text, timeout ms
    requestStart = Signal()                 # any panel may ask the engine panel to start the engine
    requestRestart = Signal()               # … or to stop it and start it again (a setting that needs a restart)
    startWithPlan = Signal(object)          # … or to start with exactly this plan (dict): "Start with this plan"
    requestTab = Signal(str)                # ask the main window to show a tab by name
    showPlacement = Signal(object)          # metrics.presenter.PlacementFeed: Monitor → Placement (plan, trace, counts)
    engineLockChanged = Signal(object)      # why the panel's Start/Stop are held (str), None when they are free
    checksReported = Signal(object)         # engine_manager.checks.CheckReport: the engine column's planned vs measured

    def __init__(self, loaded: LoadedSettings, hardware: HardwareReport | None = None, parent=None,
                 session: EngineSession | None = None):
        super().__init__(parent)
        self.loaded = loaded
        self.hardware = hardware
        self.plan: dict[str, Any] | None = None
        self.base_url: str | None = None
        self.api_key: str | None = None
        self.running: RunningEngine | None = None   # the one handle for the watched engine (when it is ready)
        self.own: RunningEngine | None = None       # the panel's own engine, when it is ready
        self.watching: str | None = None            # the watched connection's name; None: the panel's own engine
        self.watching_remote = False                # the watched connection is reached over SSH (another machine)
        self.engine_lock: str | None = None         # set while something else drives the engine (the benchmark)
        # the badge's last state event, for a part built after it was sent (the staged start builds the status bar
        # after the engine column, whose re-attach may already have reported the engine ready)
        self.engine_state_event: Any = None
        self.engineStateChanged.connect(self._keep_engine_state)
        self.session = session if session is not None else EngineSession(loaded.settings, hardware=hardware)
        self.session.subscribe(on_event=self._session_event, on_running=self.set_running)

    @property
    def supervisor(self):
        """The window's one supervisor (the session's; the engine panel drives it), made on first use."""
        return self.session.supervisor

    @property
    def settings(self):
        return self.loaded.settings

    @property
    def has_gpu(self) -> bool:
        return bool(self.hardware and self.hardware.has_gpu)

    def engine_name(self) -> str:
        return resolve_engine(self.settings, self.has_gpu)

    def update_settings(self, updates: dict[str, Any]) -> LoadedSettings:
        self.loaded = save_settings(self.loaded, updates)
        self.settingsChanged.emit(self.loaded)
        return self.loaded

    def set_hardware(self, report: HardwareReport) -> None:
        self.hardware = report
        self.hardwareChanged.emit(report)

    def set_plan(self, plan: dict[str, Any] | None) -> None:
        self.plan = plan
        self.planChanged.emit(plan)

    # -- the engine session's events, re-emitted ----------------------------------------------------------------
    def _keep_engine_state(self, ev: Any) -> None:
        self.engine_state_event = ev

    def _session_event(self, ev: Any) -> None:
        from engine_manager.supervisor_events import LogLines      # imported by the supervisor that sent ``ev``

        if isinstance(ev, LogLines):
            self.engineLog.emit(ev)

    def set_running(self, running: RunningEngine | None) -> None:
        """The panel's own engine is ready (None: none is). It is also the watched engine (``running``,
        ``engineRunning``) unless a connection is watched (:meth:`watch`)."""
        self.own = running
        self.ownEngineChanged.emit(running)
        if self.watching is None:
            self._set_watched(running)

    def lock_engine(self, why: str | None) -> None:
        """Hold the panel's Start/Stop while something else starts and stops the engine (the benchmark), with
        ``why`` in plain words for the tooltip and the status bar; ``None`` frees them."""
        self.engine_lock = why
        self.engineLockChanged.emit(why)

    def watch(self, running: RunningEngine | None, name: str | None = None, *, remote: bool = False) -> None:
        """Point the Monitor and the chat pane at the saved connection ``name`` (``running``: its handle, None
        while it cannot be reached), or — ``name`` None — back at the panel's own engine. The own engine is not
        touched either way."""
        self.watching = name
        self.watching_remote = bool(remote) if name is not None else False
        self._set_watched(running if name is not None else self.own)
        self.watchChanged.emit(name)          # after engineRunning: listeners see the new ``running``

    def _set_watched(self, running: RunningEngine | None) -> None:
        self.running = running
        if running is not None:
            self.base_url, self.api_key = running.base_url, running.api_key
        else:
            self.base_url = self.api_key = None
        self.engineRunning.emit(running)
