"""Start, watch and stop the engine process like a careful operator would — for the GUI and the CLI alike.

Lifecycle: stopped → starting → ready → stopping → stopped; crashed → restarting → starting (exponential backoff,
crash-loop limit). One engine at a time: starting the engine that runs re-attaches to it, starting another is
refused (``engine_running``). A start checks the port, probes the NUMA binding (:mod:`.numa`), runs the engine behind
a keeper (:mod:`.keeper`, :mod:`.launch`) as leader of a new session and process group, and polls its health up to
``settings.ready_timeout_s``. The watch classifies an exit or a silent engine from *this run's* log lines only
(:mod:`.crash`) and restarts unless the cause cannot heal. A stop: SIGTERM to the group, a grace period, SIGKILL, no
process left; its stop request also stops a start in flight in another process. The state file (atomic, 0600, the
key only as a fingerprint; :mod:`.state_files`) lets a new panel re-attach (pid + start time) or explain a dead
engine (:meth:`Supervisor.explain_dead`); an engine the panel did not start is never stopped.
Long operations are generators of typed events (:mod:`.supervisor_events`); ``stop()`` may run from another thread.
Beside it: :mod:`.engine_state` (states, typed records), :mod:`.procs`, :mod:`.logtail`, :mod:`.start_plan`,
:mod:`.dryrun`. The whole contract: docs/ARCHITECTURE.md "Supervisor".
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Generator, Iterator

if TYPE_CHECKING:
    import httpx

from . import paths
from .atomic import ensure_private_dir
from .crash import PERMANENT_CAUSES, classify_exit
from .dryrun import DryRun, build_dry_run
from .engine_process import EngineProcess, spec_from_record, status_from_record
from .engine_state import (
    CRASH_LIMIT,
    CRASH_WINDOW_S,
    CRASHED,
    READY,
    RESTARTING,
    STARTING,
    STOPPED,
    STOPPING,
    EngineStatus,
    ExitInfo,
)
from .engine_record import EngineRecord
from .engines import get_engine
from .engines.base import Engine, LaunchSpec
from .launch import LaunchRefused, launch_spec, port_refusal, prepare, start_keeper, write_run_header
from .logtail import LOG_NAME, read_log_tail, run_lines
from .numa import Binding, choose_binding
from .procs import (
    boot_clock,
    describe_owner,
    key_fingerprint,
    kill_group,
    port_free,
    port_owner,
    terminate,
    wait_keeper,
)
from .start_plan import default_plan
from .state_files import StateFiles, read_json
from .supervisor_events import (
    Attached,
    Crashed,
    Event,
    GaveUp,
    Note,
    Progress,
    Ready,
    Restarting,
    StartFailed,
    StateChanged,
    Stopped,
    engine_words,
    running_conflict,
)

#: the supervisor's generators: they yield events and return an outcome ("ready", "stopped", an ExitInfo, a status)
Events = Generator[Event, None, Any]

__all__ = ["Supervisor", "Events"]


def _emit(ev: Event | None) -> Iterator[Event]:
    if ev is not None:
        yield ev


class _Wake:
    """A flag that ends a wait at once when set, as ``threading.Event``, and that :func:`select.poll` can wait on
    together with another descriptor (an eventfd; a plain Event where the system has none)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._fd: int | None = None
        if hasattr(os, "eventfd"):
            try:
                self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            except OSError:
                self._fd = None
            else:       # closed with the object, never before: a set() from another thread never writes to a
                import weakref          # number the system gave to another file meanwhile

                weakref.finalize(self, os.close, self._fd)

    def set(self) -> None:
        self._event.set()
        if self._fd is not None:
            try:
                os.eventfd_write(self._fd, 1)
            except OSError:         # the counter is full: it is readable either way
                pass

    def clear(self) -> None:
        self._event.clear()
        if self._fd is not None:
            try:
                os.eventfd_read(self._fd)
            except BlockingIOError:         # nothing to read
                pass

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float, other_fd: int | None = None) -> bool:
        """Until set, ``other_fd`` is readable, or ``timeout`` s have passed; whether ``other_fd`` is readable."""
        if other_fd is None or self._fd is None:
            self._event.wait(timeout)
            return False
        import select

        p = select.poll()
        p.register(self._fd, select.POLLIN)
        p.register(other_fd, select.POLLIN)
        return any(fd == other_fd for fd, _ in p.poll(max(0, int(timeout * 1000))))


class Supervisor:
    """Owns one engine process at a time.

    Generators (yield :class:`Event`, return :class:`EngineStatus`): :meth:`run` (start — port, binding,
    provisioning, launch behind the keeper: :mod:`engine_manager.launch` —, wait until ready, then supervise: an
    exit within ~0.1 s or ``silent_after_s`` without health → classify from this run's log lines → restart with
    backoff unless the cause cannot heal or a crash loop is detected), :meth:`watch` (re-attach to an engine started
    earlier — pid and start time must match — and supervise it, or clean up after it and say how it ended:
    :meth:`explain_dead`), :meth:`stop` (:func:`engine_manager.procs.terminate`; a stop beats a start in flight in
    another process). Plain calls: :meth:`status`, :meth:`dry_run`, :meth:`binding`; and from any thread
    :meth:`cancel`, :meth:`request_force`, :meth:`detach`. An engine the panel did not start is shown, never
    stopped."""

    def __init__(self, settings: Any, *, hardware: Any = None, grace_s: float = 20.0,
                 silent_after_s: float = 60.0, backoff_base_s: float = 2.0, backoff_max_s: float = 60.0,
                 crash_limit: int = CRASH_LIMIT, crash_window_s: float = CRASH_WINDOW_S, poll_s: float = 0.1,
                 health_every_s: float = 5.0, progress_every_s: float = 0.5, log_max_bytes: int = 10 * 2**20,
                 log_backups: int = 3, auto_restart: bool | None = None,
                 engine_resolver: Callable[[str], Engine] = get_engine,
                 ready_timeout_s: float | None = None, started_by: str = "panel"):
        self.settings = settings
        self.started_by = started_by             # written into the state file with the engine it starts
        self.hardware = hardware
        self.grace_s = grace_s
        self.silent_after_s = silent_after_s
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.crash_limit = crash_limit
        self.crash_window_s = crash_window_s
        self.poll_s = poll_s
        # A ready engine's log lines are looked at once a second; its exit, a stop and a detach wake the watch at
        # once (a pidfd of the keeper and an eventfd, polled together). Each wake of a thread costs ~0.13 ms of CPU
        # here before any work (a thread that only waits 0.25 s in a loop used 0.51 ms a second; 1 s: 0.14), and
        # looking 4 times a second made the watch ~0.2 % of a core, the window's largest thread after the GUI's
        # and the engine poll (benchmarks/panel_cpu.py). Without a pidfd (an old kernel) it looks 4 times a second.
        self.watch_poll_s = max(poll_s, 1.0)
        self.watch_poll_blind_s = max(poll_s, 0.25)
        # a ready engine's health check (through httpx, ~1.5 ms of CPU on loopback) every 5 s: every 2 s it was
        # most of the watch's 0.43 % of a core (benchmarks/results/panel_cpu.md); a hung engine is still stopped
        # after silent_after_s (60 s), 12 checks later
        self.health_every_s = health_every_s
        self.progress_every_s = progress_every_s
        self.log_max_bytes = log_max_bytes
        self.log_backups = log_backups
        self.auto_restart = settings.auto_restart if auto_restart is None else auto_restart
        self.ready_timeout_s = float(ready_timeout_s if ready_timeout_s is not None else settings.ready_timeout_s)
        self.resolve_engine = engine_resolver
        # where this supervisor keeps its files, fixed when it is made (an environment that changes later — a test's
        # temporary dirs being undone — must not move a running engine's state file)
        self.data_dir = paths.data_dir()
        self.logs_dir = paths.logs_dir()
        self.runs_dir = paths.runs_dir()
        self.last_failure: Crashed | None = None
        self._lock = threading.RLock()
        self._state = STOPPED
        self._message = ""
        self._handle: EngineProcess | None = None
        self._stop_req = threading.Event()
        self._force_req = threading.Event()
        self._detach_req = threading.Event()
        self._wake = _Wake()                        # set with each request above: the watch's wait ends at once
        self._stop_active = threading.Event()
        self._crashes: deque[float] = deque()
        self._binding_cache: dict[tuple, Binding] = {}
        self._http: httpx.Client | None = None
        self._plans: dict[tuple, tuple[dict[str, Any] | None, list[str]]] = {}
        self._mark_since()
        self.files = StateFiles(self.data_dir, f"{os.getpid()}:{id(self)}:{time.time_ns()}")

    # -- http ------------------------------------------------------------------------------------------------
    def http(self) -> httpx.Client:
        """One client for health checks: loopback only (no proxies from the environment), no TLS context to
        build, no kept-alive sockets (so nothing lingers after an engine is gone)."""
        if self._http is None:
            import httpx        # on first use: ~70 ms of imports a panel start that checks no engine yet skips
            self._http = httpx.Client(timeout=httpx.Timeout(2.0, connect=1.0), trust_env=False, verify=False,
                                      limits=httpx.Limits(max_keepalive_connections=0))
        return self._http

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None

    # -- paths -----------------------------------------------------------------------------------------------
    @property
    def state_path(self) -> Path:
        return self.files.state_path

    @property
    def log_path(self) -> Path:
        return self.logs_dir / LOG_NAME

    @property
    def state(self) -> str:
        return self._state

    # -- controls from other threads -----------------------------------------------------------------------------
    def cancel(self) -> None:
        """Ask a start in progress (or a pending restart) to give up; the owning generator then stops the engine.
        (:meth:`stop` from another thread does the same and reports the stop as it goes.)"""
        self._stop_req.set()
        self._wake.set()

    def request_force(self) -> None:
        """During a stop: skip the rest of the grace period and SIGKILL now."""
        self._force_req.set()

    def detach(self) -> None:
        """Stop watching but leave the engine running (the window closes; the next panel re-attaches)."""
        self._detach_req.set()
        self._wake.set()

    def _reset_requests(self) -> None:
        self._stop_req.clear()
        self._force_req.clear()
        self._detach_req.clear()

    # -- state -------------------------------------------------------------------------------------------------
    def _set_state(self, state: str, message: str = "") -> StateChanged | None:
        with self._lock:
            prev = self._state
            self._state, self._message = state, message
            h = self._handle
        if prev == state and not message:
            return None
        return StateChanged(state, prev, message, h.spec.engine if h else None, h.engine_pid if h else None)

    def _pop_state_notes(self) -> Iterator[Note]:
        for n in self.files.pop_notes():
            yield Note(n, "warning")

    def _mark_since(self) -> None:
        """Stop requests older than now are not for this run/watch: now on the wall clock, and on the boot clock
        (no clock step moves it), which a request of this boot is compared on."""
        self._since, self._since_boot = time.time(), boot_clock()

    def _stop_requested_elsewhere(self) -> dict[str, Any] | None:
        """A `dsv41 stop` (another supervisor, usually another process) asked since this run/watch began."""
        return self.files.stop_requested(self._since, self._since_boot)

    def _stopped_by_request(self, h: EngineProcess | None, req: dict[str, Any]) -> Events:
        """Another `dsv41 stop` asked for the engine to stop while this supervisor starts (or restarts) it: it
        stops here too (the engine goes either way), says so, and nothing is restarted."""
        self._stop_req.set()
        who = req.get("by_pid")
        msg = f"stopped by request (`dsv41 stop`{f', pid {who}' if who else ''}); not restarted"
        if h is not None:
            # the `dsv41 stop` that asked signals the engine itself; an engine that stops through its top process
            # (Engine.stop_leader_grace_s) must not get a second SIGTERM from here (Strata's server kills its engine
            # at once on a second one): wait for that stop first, then make sure
            if not h.wait_exit(h.leader_grace_s, self.poll_s):
                yield from self._terminate(h, grace=self.grace_s, quiet=True)
            yield from self._final_lines(h)
            self._forget(h)
        self._write_state_file(None, STOPPED, engine=h.spec.engine if h else None, message=msg)
        yield from _emit(self._set_state(STOPPED, msg))
        yield Stopped(msg[:1].upper() + msg[1:] + ".")
        return "stopped"

    def _write_state_file(self, h: EngineProcess | None, state: str, **extra: Any) -> None:
        if h is None:
            self.files.write_bare(state, **extra)
            return
        rec = h.record(state, log_path=self.log_path, exit_path=self.files.exit_path, started_by=self.started_by)
        rec.update(extra)
        self.files.write_state(rec)

    # -- engines, hardware, binding ----------------------------------------------------------------------------
    def _engine(self, engine: str | Engine | None) -> Engine:
        if isinstance(engine, Engine):
            return engine
        if engine is None:
            from .settings import resolve_engine
            hw = self._hardware()
            engine = resolve_engine(self.settings, bool(hw and hw.has_gpu))
        return self.resolve_engine(engine)

    def _engine_or_none(self, name: str | None) -> Engine | None:
        try:
            return self.resolve_engine(name or "sim")
        except Exception:  # an unknown engine name
            return None

    def _hardware(self):
        if self.hardware is None:
            from .hardware import probe
            self.hardware = probe(self.settings.cache_path)
        return self.hardware

    def binding(self, refresh: bool = False) -> Binding:
        """The probed binding (probed once per supervisor; ``refresh`` probes again)."""
        hw = self._hardware()
        key = (self.settings.numa_binding, self.settings.gpu_index, id(hw))
        if refresh or key not in self._binding_cache:
            self._binding_cache[key] = choose_binding(hw, self.settings.gpu_index, self.settings.numa_binding)
        return self._binding_cache[key]

    def _default_plan(self, engine_name: str) -> tuple[dict[str, Any] | None, list[str]]:
        key = (engine_name, self.settings.model_dump_json())
        if key not in self._plans:
            self._plans[key] = default_plan(engine_name, self.settings, self.hardware)
        plan, notes = self._plans[key]
        return plan, list(notes)

    # -- status -----------------------------------------------------------------------------------------------------
    def status(self, check_health: bool = True) -> EngineStatus:
        """What runs now: this supervisor's engine, else the one in the state file (verified), else whatever
        else listens on the port (shown, never stopped)."""
        with self._lock:
            h, state, message = self._handle, self._state, self._message
        if h is not None:
            return self._status_of(h, state, message)
        rec = self.files.read_state()
        st = EngineStatus(STOPPED, log_path=str(self.log_path), port=self.settings.port)
        bad = " ".join(n.text for n in self._pop_state_notes())
        if rec and rec.keeper_pid:
            alive = rec.alive()
            st = self._status_from_record(rec, alive)
            if alive:
                if check_health:
                    if self._health_ok_record(rec):
                        st.state, st.message = READY, "answering its health check"
                    elif rec.state == READY:
                        st.message = "running, but not answering its health check right now"
                return st
        elif rec:
            st.state = rec.state if rec.state in (STOPPED, CRASHED) else STOPPED
            st.engine = rec.engine
            st.last_failure = rec.last_failure
            st.message = (rec.message or "")
        if state in (STARTING, RESTARTING, CRASHED) and st.state != CRASHED:
            st.state, st.message = state, message
        if self.last_failure is not None and st.state in (CRASHED, RESTARTING):
            st.last_failure = self.last_failure.to_dict()
        if st.state == STOPPED and not (isinstance(st.last_failure, dict)
                                        and st.last_failure.get("kind") == "start_failed"):
            st.last_failure = None
        if not port_free(self.settings.host, self.settings.port):
            owner = port_owner(self.settings.host, self.settings.port)
            st.external = owner or {"pid": None}
            ext = (f"Something not started by this panel is listening on port {self.settings.port}: "
                   f"{describe_owner(owner)}. The panel shows it but never stops it.")
            # after a crash, what happened stays first (the port may still be closing a moment after the exit)
            st.message = f"{st.message} {ext}" if st.state == CRASHED and st.message else ext
        if bad:
            st.message = f"{bad} {st.message}".strip()
        return st

    def snapshot(self) -> EngineStatus | None:
        """This supervisor's own engine, from memory (no I/O: safe on a GUI thread); None when it has none."""
        with self._lock:
            h, state, message = self._handle, self._state, self._message
        return self._status_of(h, state, message) if h is not None else None

    def _status_from_record(self, rec: EngineRecord, alive: bool) -> EngineStatus:
        st = status_from_record(rec, alive, log_path=self.log_path, api_key=self.settings.api_key,
                                spec=self._spec_from_record(rec) if alive else None)
        if not alive and st.state == CRASHED:
            ex, crash = self.explain_dead(rec)
            st.message = (f"The engine started earlier (pid {rec.pid}) ended while no panel was watching "
                          f"({ex.words()}).")
            st.last_failure = crash.to_dict()
        return st

    def _status_of(self, h: EngineProcess, state: str, message: str) -> EngineStatus:
        return h.status(state, message, log_path=self.log_path, api_key=self.settings.api_key,
                        last_failure=self.last_failure.to_dict() if self.last_failure else None,
                        started_by=self.started_by)

    def _health_ok_record(self, rec: EngineRecord) -> bool:
        try:
            eng = self.resolve_engine(rec.engine or "sim")
            return eng.readiness(self.http(), self._spec_from_record(rec)).state == "ready"
        except Exception:
            return False

    def _spec_from_record(self, rec: EngineRecord) -> LaunchSpec:
        return spec_from_record(rec, self.settings.host, self.settings.api_key)

    # -- dry run -------------------------------------------------------------------------------------------------
    def dry_run(self, engine: str | Engine | None = None, plan: dict[str, Any] | None = None) -> DryRun:
        """Every command start would run on this machine, without starting anything (the binding probes do run:
        they are ``<prefix> true``). Generated files are written, so the printed command works as is."""
        eng = self._engine(engine)
        notes: list[str] = []
        if plan is None:
            plan, notes = self._default_plan(eng.name)
        return build_dry_run(eng, plan, self.settings, self.binding(refresh=True), self.runs_dir / eng.name,
                             own=self._own_running_record(), log_path=self.log_path, exit_path=self.files.exit_path,
                             log_max_bytes=self.log_max_bytes, log_backups=self.log_backups,
                             ready_timeout_s=self.ready_timeout_s, grace_s=self.grace_s, notes=notes)

    def _own_running_record(self) -> EngineRecord | None:
        """The state file's record when it names a live engine this panel (or `dsv41 start`) started."""
        with self._lock:
            h = self._handle
        rec = self.files.read_state()
        if rec and rec.keeper_pid and (h is not None and h.keeper_pid == rec.keeper_pid or rec.alive()):
            return rec
        return None

    # -- run / watch -----------------------------------------------------------------------------------------
    def run(self, engine: str | Engine | None = None, plan: dict[str, Any] | None = None, *,
            watch: bool = True) -> Events:
        """Start the engine and wait until ready; with ``watch`` keep supervising it until :meth:`stop` or
        :meth:`detach` (a crash is classified and, with auto-restart, restarted with backoff)."""
        self._reset_requests()
        self._mark_since()
        self._crashes.clear()
        self.last_failure = None
        eng = self._engine(engine)
        if plan is None:
            plan, notes = self._default_plan(eng.name)
            for n in notes:
                yield Note(n)
        outcome = yield from self._start_once(eng, plan)
        return (yield from self._supervise(eng, plan, outcome, watch=watch))

    def watch(self) -> Events:
        """Re-attach to the engine a previous panel (or ``dsv41 start``) started — when its pid and start time
        match; health decides ready or still starting — and supervise it like :meth:`run`. With the engine
        dead, clean up (kill stragglers of its group) and report how it ended."""
        self._reset_requests()
        self._mark_since()
        h = yield from self._attach()
        if h is None:
            return self.status(check_health=False)
        outcome = "ready" if h.ready_at is not None else (yield from self._wait_ready(h))
        rec = self.files.read_state() or EngineRecord.empty()
        plan_file = rec.plan_path
        plan = read_json(Path(plan_file)) if plan_file else None   # for a restart: the plan it ran with
        return (yield from self._supervise(h.engine, plan, outcome))

    def _supervise(self, eng: Engine | None, plan: dict[str, Any] | None, outcome: Any,
                   watch: bool = True) -> Events:
        while True:
            if outcome == "ready" and not watch:
                with self._lock:
                    h = self._handle
                if h is not None:
                    h.close()      # the engine keeps running on its own; `dsv41 status` / a panel finds it
                return self.status(check_health=False)
            if outcome == "ready":
                outcome = yield from self._watch_loop()
            if not isinstance(outcome, ExitInfo):
                if outcome == "stopped":
                    yield from self._await_stop()
                if outcome == "detached":
                    with self._lock:
                        h, self._handle = self._handle, None
                    if h is not None:
                        h.close()
                return self.status(check_health=False)
            go = yield from self._after_crash(outcome, eng)
            if not go or eng is None:
                return self.status(check_health=False)
            outcome = yield from self._start_once(eng, plan, restart=True)

    def _await_stop(self) -> Events:
        """The owning generator saw a stop request: let the :meth:`stop` in progress finish (so the final status
        is "stopped"), or — after :meth:`cancel` alone — stop the engine here."""
        end = time.monotonic() + self.grace_s + 15.0
        while time.monotonic() < end:
            with self._lock:
                h = self._handle
            if h is None and not self._stop_active.is_set():
                return
            if not self._stop_active.is_set():
                yield from self.stop()
                return
            time.sleep(self.poll_s)

    # -- attach / clean up ----------------------------------------------------------------------------------
    def _attach(self) -> Events:
        rec = self.files.read_state()
        yield from self._pop_state_notes()
        if not rec or not rec.keeper_pid:
            if rec and rec.state == CRASHED and isinstance(rec.last_failure, dict):
                crash = Crashed.recorded(rec.last_failure)
                if crash is not None:               # what happened last time stays visible until the next start
                    self.last_failure = crash
                    yield from _emit(self._set_state(CRASHED, (rec.message or "")))
                    yield crash
            return None
        ok = rec.alive()
        eng = self._engine_or_none(rec.engine)
        if not ok or eng is None:
            yield from self._cleanup_dead(rec, eng)
            return None
        spec = self._spec_from_record(rec)
        binding = Binding.from_dict(rec.binding) if rec.binding else None
        h = EngineProcess.attached_to(rec, eng, spec, binding, log_path=self.log_path)
        healthy = h.healthy(self.http())
        with self._lock:
            self._handle = h
        if healthy:
            h.ready_at = rec.ready_at or time.time()
            self._write_state_file(h, READY)
        msg = (f"Re-attached to the {spec.label or spec.engine} engine started earlier (pid {h.engine_pid}, "
               f"{'ready' if healthy else 'still starting'}).")
        yield Attached(h.engine_pid or h.keeper_pid, spec.engine, READY if healthy else STARTING, msg)
        if rec.key_fingerprint and rec.key_fingerprint != key_fingerprint(self.settings.api_key):
            yield Note("The running engine was started with a different API key than the one in the settings now; "
                       "chat requests will be refused (401). Stop and start it to use the current key.", "warning")
        yield from _emit(self._set_state(READY if healthy else STARTING, msg))
        if healthy:
            yield Ready(spec.base_url, h.age(), spec.engine, h.engine_pid, spec.simulated,
                        attached=True)
        return h

    def _cleanup_dead(self, rec: EngineRecord, eng: Engine | None) -> Events:
        """The state file names an engine that is gone: kill stragglers of its group, say how it ended."""
        if rec.pgid and rec.keeper_start_time:
            kill_group(int(rec.pgid), rec.keeper_start_time, boot=rec.boot_id)
        if rec.state == STOPPING or rec.stop_requested:
            self._write_state_file(None, STOPPED, engine=rec.engine, message="stopped")
            return
        ex, crash = self.explain_dead(rec, eng)
        self.last_failure = crash
        msg = (f"The engine started earlier (pid {rec.pid}) ended while no panel was watching "
               f"({ex.words()}); cleaned up.")
        self._write_state_file(None, CRASHED, engine=rec.engine, message=msg, last_failure=crash.to_dict())
        yield Note(msg, "warning")
        yield from _emit(self._set_state(CRASHED, msg))
        yield crash

    def explain_dead(self, rec: EngineRecord, eng: Engine | None = None) -> tuple[ExitInfo, Crashed]:
        """How the engine a state file names ended, classified like a crash the panel watched (cause in plain words
        and the fix): the one code path behind a panel's clean-up, ``dsv41 stop`` and ``dsv41 status``."""
        if eng is None or eng.name != rec.engine:
            eng = self._engine_or_none(rec.engine)     # an unknown engine: the generic signatures still apply
        ex = self.files.read_exit(rec.keeper_pid) or ExitInfo(None, None, None, "unknown")
        tail = run_lines(read_log_tail(self.log_path, 64_000), rec.run_id)[-200:]
        hint = classify_exit(eng, ex, tail)
        return ex, Crashed(hint.cause, hint.title, hint.fix, ex.returncode, ex.signal,
                           [ln for ln in tail if not ln.startswith("[dsv41")][-20:])

    # -- start -------------------------------------------------------------------------------------------------
    def _start_once(self, eng: Engine, plan: dict[str, Any] | None, restart: bool = False) -> Events:
        """Spawn and wait until ready. Returns ``"ready"``, ``"failed"``, ``"stopped"``, ``"detached"`` or an
        :class:`ExitInfo` when the engine died while starting."""
        if self._stop_req.is_set():
            return "stopped"
        req = self._stop_requested_elsewhere()
        if req is not None:
            return (yield from self._stopped_by_request(None, req))
        yield from _emit(self._set_state(STARTING, f"starting {eng.label or eng.name}"))
        if plan and plan.get("refused"):
            yield from self._fail("placement_refused", f"The placement was refused: {plan['refused']}",
                                  "Re-plan on the Placement tab (or `dsv41 plan`) with settings this machine can "
                                  "hold, or use a machine that passes `dsv41 doctor`.")
            return "failed"
        ensure_private_dir(self.data_dir)
        ensure_private_dir(self.logs_dir)
        h: EngineProcess | None = None
        with self.files.start_lock() as held:
            if not held:
                yield from self._fail("busy", "Another dsv41 is starting the engine right now.",
                                      "Wait for it to finish, then look at `dsv41 status`.")
                return "failed"
            rec = self.files.read_state()
            yield from self._pop_state_notes()
            req = self._stop_requested_elsewhere()
            if req is not None:
                return (yield from self._stopped_by_request(None, req))
            if rec and rec.keeper_pid:
                if rec.alive():
                    attach = True
                else:
                    attach = False
                    yield from self._cleanup_dead(rec, eng)
                    yield from _emit(self._set_state(STARTING, f"starting {eng.label or eng.name}"))
            else:
                attach = False
            if not attach:
                h = yield from self._launch(eng, plan, restart)
                if h is None:
                    return "failed"
        if h is None:       # ours already runs (started by `dsv41 start` or another panel)
            rec = self.files.read_state() or EngineRecord.empty()
            if rec.engine and rec.engine != eng.name:
                # another engine: never attach to it as if it were the one asked for, never start a second one
                msg, fix = running_conflict(rec, eng.name)
                yield from self._fail("engine_running", msg, fix)
                return "failed"
            yield Note(f"{engine_words(eng.name, True)} is already running (pid {rec.pid}, port "
                       f"{rec.port}); attaching to it instead of starting another — starting the same "
                       "engine again re-attaches; `dsv41 stop` stops it.")
            h = yield from self._attach()
            if h is None:
                return "failed"
            if h.ready_at is not None:
                return "ready"
        return (yield from self._wait_ready(h))

    def _launch(self, eng: Engine, plan: dict[str, Any] | None, restart: bool) -> Events:
        refused = port_refusal(self.settings.host, self.settings.port)
        if refused is not None:
            return (yield from self._refused(refused))
        binding = self.binding()
        if not restart:
            for line in binding.describe():
                yield Note(line)
        workdir = self.runs_dir / eng.name
        ensure_private_dir(workdir)
        if getattr(eng, "prepare", None) is not None:      # Strata: the model's pack, made once by the release's tool
            refused = yield from prepare(eng, self.settings, plan, lambda: self._stop_req.is_set()
                                         or self._stop_requested_elsewhere() is not None)
            if refused is not None:
                return (yield from self._refused(refused))
        try:
            spec = launch_spec(eng, self.settings, plan, workdir)
        except LaunchRefused as exc:
            return (yield from self._refused(exc))
        return (yield from self._spawn(eng, spec, binding))

    def _fail(self, cause: str, message: str, fix: str, tail: list[str] | None = None,
              suggested_port: int | None = None) -> Events:
        self.files.record_start_failure(cause, message, fix, tail or [], self.log_path)
        yield from _emit(self._set_state(STOPPED, message))
        yield StartFailed(cause, message, fix, tail or [], suggested_port=suggested_port)

    def _refused(self, r: LaunchRefused) -> Events:
        """:meth:`_fail` for a refusal of :mod:`engine_manager.launch`; returns None (no engine was started)."""
        yield from self._fail(r.cause, r.message, r.fix, suggested_port=r.suggested_port)
        return None

    def _spawn(self, eng: Engine, spec: LaunchSpec, binding: Binding | None) -> Events:
        req = self._stop_requested_elsewhere()
        if req is not None:                  # a `dsv41 stop` came while this start prepared: nothing is started
            yield from self._stopped_by_request(None, req)
            return None
        run_id = f"{int(time.time())}-{os.getpid()}-{secrets.token_hex(3)}"
        try:
            offset = write_run_header(self.log_path, run_id, spec, binding)
            self.files.clear_exit()
            popen = start_keeper(spec, binding, log_path=self.log_path, exit_path=self.files.exit_path,
                                 max_bytes=self.log_max_bytes, backups=self.log_backups)
        except LaunchRefused as exc:
            return (yield from self._refused(exc))
        h = EngineProcess.started(eng, spec, binding, popen, run_id=run_id, started_by=self.started_by,
                                  log_path=self.log_path, log_offset=offset)
        with self._lock:
            self._handle = h
        self._write_state_file(h, STARTING)
        yield Note(f"Started {spec.label or spec.engine} (pid {h.engine_pid or '?'}, process group {popen.pid}); "
                   f"log: {self.log_path}")
        return h

    # -- readiness ---------------------------------------------------------------------------------------------
    def _final_lines(self, h: EngineProcess) -> Events:
        time.sleep(0.02)                       # the keeper's last line lands right before it exits
        batch = h.drain()
        if batch is not None:
            yield batch

    def _wait_ready(self, h: EngineProcess) -> Events:
        # an engine with a READY deadline of its own (Strata's server) is given the panel's timeout and waited for a
        # margin longer, so that its own words ("did not report READY within N s") arrive before the panel gives up
        timeout = self.ready_timeout_s + (h.engine.ready_margin_s if h.engine is not None else 0.0)
        h.phase, h.fraction = "starting", None
        # intervals on the monotonic clock, the time since the start on the boot clock (h.age()): a step of the
        # wall clock (NTP, a person setting the time) neither times a loading engine out nor starves the checks
        last_out = time.monotonic()
        next_check = next_progress = 0.0
        client = self.http()
        while True:
            if self._detach_req.is_set():
                return "detached"
            if self._stop_req.is_set():
                return "stopped"
            req = self._stop_requested_elsewhere()
            if req is not None:
                return (yield from self._stopped_by_request(h, req))
            batch = h.drain()
            if batch is not None:
                last_out = time.monotonic()
                yield batch
                if any(e.kind == "ready" for e in batch.events):
                    next_check = 0.0
            if h.exited():
                yield from self._final_lines(h)
                if self._stop_req.is_set():
                    return "stopped"
                req = self._stop_requested_elsewhere()
                if req is not None:
                    return (yield from self._stopped_by_request(h, req))
                return h.exit_info(self.files)
            now = time.monotonic()
            elapsed = h.age()
            if now >= next_check and h.engine is not None:
                next_check = now + (0.1 if elapsed < 10 else 0.5)   # often at first, then every 0.5 s
                try:
                    r = h.engine.readiness(client, h.spec)
                except Exception:          # adapters map "refused" to loading; anything else: not yet
                    r = None
                if r is not None and r.state == "ready":
                    req = self._stop_requested_elsewhere()
                    if req is not None:           # never mark it ready over a stop that came meanwhile
                        return (yield from self._stopped_by_request(h, req))
                    h.ready_at, took = time.time(), h.age()
                    batch = h.drain()            # the lines written up to readiness come before "ready"
                    if batch is not None:
                        yield batch
                    self._write_state_file(h, READY)
                    yield from _emit(self._set_state(READY, f"ready after {took:.1f} s "
                                                            f"at {h.spec.base_url}"))
                    yield Ready(h.spec.base_url, took, h.spec.engine, h.engine_pid,
                                h.spec.simulated, attached=h.attached)
                    return "ready"
            if elapsed > timeout:
                tail = list(h.recent)[-20:]
                yield from self._terminate(h, grace=min(self.grace_s, 10.0))
                self._forget(h)
                self._write_state_file(None, STOPPED, engine=h.spec.engine, message="not ready in time")
                yield from self._fail(
                    "ready_timeout",
                    f"The engine did not become ready within {timeout:.0f} s (last phase: "
                    f"{h.phase or 'unknown'}); it was stopped.",
                    "If it was still loading (a first start downloads and loads the model), raise "
                    "ready_timeout_s (DSV41_READY_TIMEOUT) and start again; otherwise read the log lines.",
                    tail)
                return "failed"
            if now >= next_progress:
                next_progress = now + self.progress_every_s
                frac = h.fraction
                eta = elapsed * (1 - frac) / frac if frac and 0 < frac < 1 else None
                yield Progress(elapsed, timeout, h.phase or "starting", frac, eta, now - last_out,
                               h.engine_pid)
            time.sleep(self.poll_s)

    # -- watching a ready engine ------------------------------------------------------------------------------
    def _watch_loop(self) -> Events:
        with self._lock:
            h = self._handle
        if h is None:
            return "stopped"
        last_ok = time.monotonic()                  # monotonic: a step of the wall clock neither starves the
        next_health = last_ok + self.health_every_s  # health checks nor makes a busy engine look silent
        client = self.http()
        exit_fd = [h.exit_fd()]
        try:
            return (yield from self._watching(h, client, last_ok, next_health, exit_fd))
        finally:
            if exit_fd[0] is not None:
                os.close(exit_fd[0])

    def _watching(self, h: EngineProcess, client: Any, last_ok: float, next_health: float,
                  exit_fd: list[int | None]) -> Events:
        """The watch loop; ``exit_fd[0]``: the keeper's pidfd (None: none), closed by the caller."""
        while True:
            self._wake.clear()          # before the requests are looked at: one made after this wakes the wait
            if self._detach_req.is_set():
                return "detached"
            batch = h.drain()
            if batch is not None:
                yield batch
            if h.exited():
                yield from self._final_lines(h)
                if self._stop_req.is_set():
                    return "stopped"        # our own stop() reports the rest
                if self._stopped_elsewhere() or self._stop_requested_elsewhere() is not None:
                    return (yield from self._stopped_by_other(h))
                return h.exit_info(self.files)
            if self._stop_req.is_set():
                return "stopped"
            now = time.monotonic()
            if now >= next_health and h.engine is not None:
                next_health = now + self.health_every_s
                if h.healthy(client):
                    last_ok = time.monotonic()
                elif time.monotonic() - last_ok >= self.silent_after_s and not h.exited() \
                        and not self._stop_req.is_set():
                    silent = time.monotonic() - last_ok
                    yield Note(f"The engine has not answered its health check for {silent:.0f} s while its "
                               "process is alive; stopping it.", "warning")
                    yield from self._terminate(h, grace=min(self.grace_s, 5.0), quiet=True)
                    info = h.exit_info(self.files)
                    info.silent_s = silent
                    return info
            # the keeper's exit, a stop or a detach wakes it at once (watch_poll_s: see __init__)
            fd = exit_fd[0]
            if self._wake.wait(self.watch_poll_s if fd is not None else self.watch_poll_blind_s, fd) \
                    and fd is not None and not h.exited():
                # readable while the keeper runs: not a descriptor to wait on (it would be readable at every
                # pass); looked at on the clock from now on
                os.close(fd)
                exit_fd[0] = None

    def _stopped_elsewhere(self) -> bool:
        rec = self.files.read_state()
        return bool(rec and (rec.stop_requested or rec.state in (STOPPING, STOPPED)))

    def _stopped_by_other(self, h: EngineProcess) -> Events:
        rec = self.files.read_state() or EngineRecord.empty()
        req = rec.stop_requested
        who = req.get("by_pid") if isinstance(req, dict) else None
        if h.popen is not None:
            h.popen.wait()
        self._forget(h)
        msg = f"stopped by another dsv41 (pid {who})" if who else "stopped by another dsv41"
        yield from _emit(self._set_state(STOPPED, msg))
        yield Stopped(msg)
        return "stopped"

    def _forget(self, h: EngineProcess) -> None:
        h.close()
        with self._lock:
            if self._handle is h:
                self._handle = None

    # -- crash handling ---------------------------------------------------------------------------------------
    def _after_crash(self, info: ExitInfo, eng: Engine | None) -> Events:
        """Classify, record, and decide. Returns True to start again (after the backoff wait)."""
        with self._lock:
            h = self._handle
        while_starting = bool(h and h.ready_at is None)
        tail = list(h.recent)[-200:] if h is not None else []
        if h is not None:
            yield from self._reap_group(h)        # never leave a child behind
        if not tail:
            tail = run_lines(read_log_tail(self.log_path, 64_000), h.run_id if h is not None else None)[-200:]
        hint = classify_exit(eng, info, tail)
        now = time.monotonic()
        self._crashes.append(now)
        while self._crashes and now - self._crashes[0] > self.crash_window_s:
            self._crashes.popleft()
        n = len(self._crashes)
        permanent = hint.cause in PERMANENT_CAUSES
        loop = n >= self.crash_limit
        stop_req = self._stop_requested_elsewhere()
        will = bool(self.auto_restart and not permanent and not loop and not self._stop_req.is_set()
                    and stop_req is None)
        delay = min(self.backoff_max_s, self.backoff_base_s * (2 ** (n - 1))) if will else None
        crash = Crashed(hint.cause, hint.title, hint.fix, info.returncode, info.signal,
                        [ln for ln in tail if not ln.startswith("[dsv41")][-20:], while_starting, will, delay, n)
        self.last_failure = crash
        msg = f"{hint.title} ({info.words()})"
        self._write_state_file(None, CRASHED, engine=eng.name if eng else None, message=msg,
                               last_failure=crash.to_dict())
        yield from _emit(self._set_state(CRASHED, msg))
        yield crash
        if not will:
            if self.auto_restart and loop:
                yield GaveUp(f"The engine crashed {n} times within {self.crash_window_s / 60:.0f} min — a crash "
                             f"loop — so it is not restarted again. Last cause: {hint.title}", hint.cause, hint.fix)
            elif self.auto_restart and permanent:
                yield GaveUp(f"Not restarting: {hint.title} Another try cannot fix this by itself.", hint.cause,
                             hint.fix)
            return False
        yield from _emit(self._set_state(RESTARTING, f"restarting in {delay:.1f} s (crash {n}; gives up at "
                                                     f"{self.crash_limit} within "
                                                     f"{self.crash_window_s / 60:.0f} min)"))
        t_end = time.monotonic() + (delay or 0.0)
        next_tick = 0.0
        while True:
            if self._stop_req.is_set() or self._detach_req.is_set() or self._stop_requested_elsewhere():
                self._write_state_file(None, STOPPED, engine=eng.name if eng else None, message="restart cancelled")
                yield from _emit(self._set_state(STOPPED, "restart cancelled"))
                yield Stopped("Auto-restart cancelled; the engine is stopped.")
                return False
            if not self.auto_restart:
                yield from _emit(self._set_state(CRASHED, "auto-restart was turned off"))
                return False
            left = t_end - time.monotonic()
            if left <= 0:
                return True
            if time.monotonic() >= next_tick:
                next_tick = time.monotonic() + 0.25
                yield Restarting(n, delay or 0.0, max(0.0, left))
            time.sleep(min(self.poll_s, max(0.0, left)))

    def _reap_group(self, h: EngineProcess) -> Events:
        n = kill_group(h.pgid, h.keeper_ctime, not_waited=h.popen.pid if h.popen is not None else None)
        if n:
            yield Note(f"Killed {n} leftover process(es) of the engine's group.", "warning")
        wait_keeper(h.popen)
        self._forget(h)

    # -- stop --------------------------------------------------------------------------------------------------
    def stop(self, force: bool = False) -> Events:
        """SIGTERM to the engine's group, the grace period, then SIGKILL; checks that nothing of the group is
        left. ``force``: SIGKILL at once. Never touches a process the panel did not start."""
        self._stop_active.set()
        try:
            return (yield from self._stop(force))
        finally:
            self._stop_active.clear()

    def _stop(self, force: bool) -> Events:
        self._stop_req.set()
        self._wake.set()
        if force:
            self._force_req.set()
        self.files.write_stop_request()     # a start in flight in another process obeys it (stop beats start)
        with self._lock:
            h = self._handle
            was = self._state
        if h is None:
            rec = self.files.read_state()
            yield from self._pop_state_notes()
            if not (rec and rec.keeper_pid and rec.alive()):
                holder = self.files.start_in_flight()
                if holder is not None:
                    yield Note(f"A start is in progress ({holder}); it was asked to stop and stops by itself. "
                               "Waiting for it…")
                    still, rec = self.files.await_start(self.grace_s + 15.0, self.poll_s)
                    yield from self._pop_state_notes()
                    if still is not None and not (rec and rec.keeper_pid and rec.alive()):
                        msg = (f"The start in progress ({still}) was asked to stop; it stops by itself before the "
                               "engine answers (it is still preparing). `dsv41 status` shows when it has.")
                        yield from _emit(self._set_state(STOPPED, msg))
                        yield Stopped(msg)
                        return self.status(check_health=False)
            if rec and rec.keeper_pid:
                if rec.alive():
                    h = EngineProcess.attached_to(rec, self._engine_or_none(rec.engine), self._spec_from_record(rec))
                else:
                    yield from self._cleanup_dead(rec, None)
        if h is None:
            st = self.status(check_health=False)
            if st.external:
                yield Note(st.message + " Stop it where it was started.", "warning", cause="external_engine")
            msg = "Auto-restart cancelled; the engine is stopped." if was == RESTARTING else \
                "The engine is not running."
            yield from _emit(self._set_state(STOPPED, msg))
            yield Stopped(msg)
            return self.status(check_health=False)
        self.files.mark_state(state=STOPPING, stop_requested={"by_pid": os.getpid(), "at": time.time()})
        yield from _emit(self._set_state(STOPPING, "stopping" + (" (SIGKILL)" if force else "")))
        forced, leftovers = yield from self._terminate(h, grace=0.0 if force else self.grace_s, leader_first=True)
        if h.tail is not None:                  # the engine's last words (and the keeper's exit line)
            time.sleep(0.02)
            batch = h.drain()
            if batch is not None:
                yield batch
        self._forget(h)
        self._write_state_file(None, STOPPED, engine=h.spec.engine, message="stopped")
        # a Force stop asked for during the grace period (request_force) is a SIGKILL at once, too
        at_once = force or self._force_req.is_set()
        how = (" with SIGKILL" if at_once else " with SIGKILL after the grace period") if forced else ""
        msg = f"Stopped{how}." + (f" {len(leftovers)} process(es) could not be killed: {leftovers}."
                                  if leftovers else "")
        yield from _emit(self._set_state(STOPPED, msg))
        yield Stopped(msg, forced, leftovers)
        return self.status(check_health=False)

    def _terminate(self, h: EngineProcess, grace: float, quiet: bool = False, leader_first: bool = False) -> Events:
        """:func:`engine_manager.procs.terminate` for ``h`` (``leader_first``: a stop asked for, which an engine
        with ``stop_leader_grace_s`` takes through its top process first). Returns ``(forced, leftover pids)``."""
        return (yield from terminate(h.group, grace, self._force_req, quiet=quiet,
                                     leader_s=h.leader_grace_s if leader_first else 0.0))
