"""The engine as one session, for every front end: :class:`EngineSession`.

It owns a :class:`~engine_manager.supervisor.Supervisor` and is the one door to it: every front end (the panel,
the CLI, the bench, chat, the InferenceKey backend and watchdog) starts, stops and watches the engine through its
methods (:meth:`EngineSession.start`, :meth:`~EngineSession.stop`, :meth:`~EngineSession.watch`,
:meth:`~EngineSession.status` …), never a Supervisor of its own. It keeps the
:class:`~engine_manager.engine_state.RunningEngine` that is ready from the supervisor's events, tells its listeners
(the GUI's ``AppContext`` re-emits them as signals) and holds the rule for carrying the plots across a restart.

The values it hands around — the states, ``RunningEngine`` (the one handle every front end takes instead of loose
``(base_url, api_key)`` pairs), ``EngineRecord``, ``EngineStatus`` — live in :mod:`engine_manager.engine_state`; how
front ends use them: docs/ARCHITECTURE.md "The one handle". Never imports Qt.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Generator, Iterator

from .engine_state import CRASHED, STOPPED, RunningEngine


class EngineSession:
    """The engine as a front end sees it: owns the :class:`~engine_manager.supervisor.Supervisor` (made on first
    use with the options given here: ``hardware``, ``started_by``, ``grace_s``, ``auto_restart`` …), keeps the
    :class:`RunningEngine` that is ready (``running``; None when none is), and tells its listeners.

    Its generators (:meth:`start`, :meth:`watch`, :meth:`stop`) hand every event to :meth:`feed` as it passes;
    the engine panel runs them on ``app.workers`` threads with ``feed=False`` and feeds each event on the GUI
    thread. Listeners are called on the thread that feeds: ``on_event(ev)`` for every event and
    ``on_running(running_or_None)`` when the ready engine changes. ``AppContext`` subscribes and re-emits them as
    Qt signals; the session itself never imports Qt.

    The rule for carrying plots across a restart lives here (:meth:`carries_plots`): an engine back at the same
    address within :attr:`CONTINUE_PLOT_S` of the last sample (a crash and restart, a rate change) continues the
    previous plots; :func:`engine_manager.metrics.hub_for_running_engine` then fills the new store from the
    recording of the same process or the previous store."""

    CONTINUE_PLOT_S = 600.0    # an engine back at the same address within this (a restart) continues the plots

    def __init__(self, settings: Any, *, hardware: Any = None, supervisor: Any = None, **supervisor_kwargs: Any):
        self._settings, self._hardware, self._kwargs = settings, hardware, supervisor_kwargs
        self._supervisor = supervisor
        self.running: RunningEngine | None = None
        self._lock = threading.Lock()
        self._making = threading.Lock()     # the supervisor is made once, by the first thread that needs it
        self._on_event: list[Callable[[Any], None]] = []
        self._on_running: list[Callable[[RunningEngine | None], None]] = []

    @property
    def supervisor(self) -> Any:
        """The :class:`~engine_manager.supervisor.Supervisor`, made on first use (the window paints before the
        supervisor's imports — httpx, psutil — are loaded)."""
        if self._supervisor is None:
            with self._making:
                if self._supervisor is None:
                    from .supervisor import Supervisor

                    with self._lock:
                        settings, hardware, kwargs = self._settings, self._hardware, dict(self._kwargs)
                    sup = Supervisor(settings, hardware=hardware, **kwargs)
                    with self._lock:    # what configure() was told meanwhile
                        sup.settings, sup.hardware = self._settings, self._hardware
                        if "auto_restart" in self._kwargs:
                            sup.auto_restart = self._kwargs["auto_restart"]
                        self._supervisor = sup
        return self._supervisor

    _KEEP = object()

    def configure(self, *, settings: Any = _KEEP, hardware: Any = _KEEP, auto_restart: Any = _KEEP) -> None:
        """The settings, hardware report or restart choice the supervisor works with: given to it when it is made,
        or set on it now if it is. A front end calls this instead of reading :attr:`supervisor`, so that nothing
        on its GUI thread makes the supervisor (its imports: the state file's pydantic model, httpx, psutil);
        the first task that needs it — the re-attach check, the idle poll — makes it on its own thread. Never
        waits for a supervisor being made."""
        given = {k: v for k, v in (("settings", settings), ("hardware", hardware), ("auto_restart", auto_restart))
                 if v is not self._KEEP}
        with self._lock:
            if "settings" in given:
                self._settings = given["settings"]
            if "hardware" in given:
                self._hardware = given["hardware"]
            if "auto_restart" in given:
                self._kwargs["auto_restart"] = given["auto_restart"]
            for name, value in given.items() if self._supervisor is not None else ():
                setattr(self._supervisor, name, value)

    def crash_rule(self) -> tuple[int, float]:
        """The crash loop the supervisor gives up after: (crashes, within seconds) — made supervisor or not."""
        from .engine_state import CRASH_LIMIT, CRASH_WINDOW_S
        sup = self._supervisor
        if sup is not None:
            return int(sup.crash_limit), float(sup.crash_window_s)
        return int(self._kwargs.get("crash_limit", CRASH_LIMIT)), float(self._kwargs.get("crash_window_s",
                                                                                           CRASH_WINDOW_S))

    def record_exists(self) -> bool:
        """An engine's state file is there (an engine was left running, or its record was); made supervisor or
        not."""
        if self._supervisor is not None:
            return bool(self._supervisor.state_path.exists())
        from . import paths
        from .engine_state import STATE_FILE
        return (paths.data_dir() / STATE_FILE).exists()

    @property
    def log_path(self) -> Any:
        """The engine log's path (:attr:`Supervisor.log_path <engine_manager.supervisor.Supervisor.log_path>`)."""
        return self.supervisor.log_path

    # -- the one door: what front ends call instead of a Supervisor of their own ------------------------------
    def start(self, engine: Any = None, plan: dict[str, Any] | None = None, *, watch: bool = True,
              feed: bool = True) -> Generator[Any, None, Any]:
        """Start ``engine`` with ``plan`` (:meth:`Supervisor.run <engine_manager.supervisor.Supervisor.run>`): its
        events, each handed to :meth:`feed` first (so :attr:`running` stays right); returns its final status.
        ``feed=False``: the caller feeds them itself, on its own thread (the panel, on the GUI's)."""
        return (yield from self._fed(self.supervisor.run(engine, plan, watch=watch), feed))

    def watch(self, *, feed: bool = True) -> Generator[Any, None, Any]:
        """Re-attach to the engine started earlier and supervise it (``Supervisor.watch``), fed like :meth:`start`."""
        return (yield from self._fed(self.supervisor.watch(), feed))

    def stop(self, force: bool = False, *, feed: bool = True) -> Generator[Any, None, Any]:
        """Stop the engine (``Supervisor.stop``; ``force``: SIGKILL at once), fed like :meth:`start`."""
        return (yield from self._fed(self.supervisor.stop(force), feed))

    def status(self, check_health: bool = True) -> Any:
        """What runs now (``Supervisor.status``: the state file, pid and start time verified, the port's owner)."""
        return self.supervisor.status(check_health=check_health)

    def dry_run(self, engine: Any = None, plan: dict[str, Any] | None = None) -> Any:
        """Every command a start would run, run nothing (``Supervisor.dry_run``)."""
        return self.supervisor.dry_run(engine, plan)

    def request_force(self) -> None:
        """During a stop (any thread): SIGKILL now (``Supervisor.request_force``)."""
        self.supervisor.request_force()

    def detach(self) -> None:
        """Stop watching, leave the engine running (any thread; ``Supervisor.detach``)."""
        self.supervisor.detach()

    def _fed(self, events: Iterator[Any], feed: bool) -> Generator[Any, None, Any]:
        if not feed:
            return (yield from events)
        try:
            while True:
                try:
                    ev = next(events)
                except StopIteration as end:
                    return end.value
                self.feed(ev)
                yield ev
        finally:
            close = getattr(events, "close", None)
            if close is not None:
                close()

    def snapshot(self) -> Any:
        """The supervisor's in-memory status of its own engine (no I/O); None when it has none or is not made."""
        return self._supervisor.snapshot() if self._supervisor is not None else None

    # -- listeners -----------------------------------------------------------------------------------------
    def subscribe(self, on_event: Callable[[Any], None] | None = None,
                  on_running: Callable[[RunningEngine | None], None] | None = None) -> None:
        with self._lock:
            if on_event is not None:
                self._on_event.append(on_event)
            if on_running is not None:
                self._on_running.append(on_running)

    def unsubscribe(self, fn: Callable[..., None]) -> None:
        with self._lock:
            self._on_event = [f for f in self._on_event if f != fn]
            self._on_running = [f for f in self._on_running if f != fn]

    # -- events --------------------------------------------------------------------------------------------
    def feed(self, ev: Any) -> RunningEngine | None:
        """One supervisor event: listeners hear it; a ``Ready`` makes the :class:`RunningEngine` (from the
        supervisor's in-memory snapshot: no I/O); an end (stopped, crashed, a failed start, a state that is not
        running) clears it. Returns ``running`` after the event."""
        from .supervisor_events import Crashed, GaveUp, Ready, StartFailed, StateChanged, Stopped

        with self._lock:
            on_event, on_running = list(self._on_event), list(self._on_running)
        for fn in on_event:
            fn(ev)
        match ev:
            case Ready():
                self.set_running(self.running_for(ev), on_running)
            case Stopped() | Crashed() | GaveUp() | StartFailed():
                self.set_running(None, on_running)
            case StateChanged(state=state) if state in (STOPPED, CRASHED):
                self.set_running(None, on_running)
        return self.running

    def running_for(self, ev: Any) -> RunningEngine:
        """The handle for a ``Ready`` event: what the supervisor holds in memory about its engine (pid, binding,
        log, launch spec, plan file), or the event's URL alone when it holds another (or none)."""
        try:
            snap = self.snapshot()
        except Exception:  # a handle from the event alone still reaches the engine
            snap = None
        settings = self.supervisor.settings       # (the panel hands it the settings of each start)
        return RunningEngine.from_status(snap, ev.base_url, getattr(settings, "api_key", "") or "",
                                         engine=ev.engine, pid=ev.pid,
                                         gpu_index=getattr(settings, "gpu_index", 0), read_plan=False)

    def set_running(self, running: RunningEngine | None,
                    listeners: list[Callable[[RunningEngine | None], None]] | None = None) -> None:
        if running is None and self.running is None:
            return
        self.running = running
        if listeners is None:
            with self._lock:
                listeners = list(self._on_running)
        for fn in listeners:
            fn(running)

    # -- plots across a restart ----------------------------------------------------------------------------
    @classmethod
    def carries_plots(cls, previous: RunningEngine | None, new: RunningEngine, last_sample_t: float | None,
                      now: float | None = None) -> bool:
        """Continue the previous plots for ``new``: it answers at the same address as ``previous`` and the last
        sample is less than :attr:`CONTINUE_PLOT_S` old."""
        if previous is None or last_sample_t is None:
            return False
        now = time.time() if now is None else now
        return previous.base_url == new.base_url and now - last_sample_t < cls.CONTINUE_PLOT_S

    def close(self) -> None:
        if self._supervisor is not None:
            self._supervisor.close()
