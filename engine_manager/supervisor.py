"""Start, watch and stop the engine process like a careful operator would — for the GUI and the CLI alike.

The lifecycle::

    stopped ─► starting ─► ready ─► stopping ─► stopped
                  │          │
                  ▼          ▼
               crashed ─► restarting ─► starting …   (auto-restart, exponential backoff, crash-loop limit)

- **one engine at a time**: starting the engine that already runs (started by a panel or ``dsv41 start``)
  re-attaches to it; starting *another* engine while one runs is refused (``engine_running``: what runs, on which
  port, and how to stop it) — never attached to as if it were the one asked for.
- **start**: refuses when the port is taken ("port N is in use by <process>" and what to do), probes the NUMA
  binding (:mod:`engine_manager.numa`), builds the engine's command (:mod:`engine_manager.engines`), and starts it
  behind a *keeper* (:mod:`engine_manager.keeper`) as the leader of a new session and process group. The keeper
  writes the engine's output to a size-rotated log (``logs/engine.log``) and records how it ended.
- **readiness**: polls the engine's health until ready, up to ``settings.ready_timeout_s`` (7200 s by default: the
  first start downloads and loads), reporting the phase (from the log lines) and the elapsed time; cancellable.
- **watch**: notices an exit within ~0.1 s, and an engine that stopped answering its health check for
  ``silent_after_s``; classifies the cause in plain words with a fix (engine-specific first, then generic:
  SIGKILL → the OOM killer, port in use, driver too old, CUDA out of memory, placement refused, silent, unknown
  with the last 20 log lines); restarts with backoff unless the cause cannot heal by itself or a crash loop is
  detected.
- **stop**: SIGTERM to the whole group, a grace period, then SIGKILL — an engine whose top process stops its own
  children (``Engine.stop_leader_grace_s``: Strata's server sends its engine QUIT) gets one SIGTERM to that process
  alone first, and the group only after that budget — and it checks that no process of the group
  (nor any descendant that left it) is left. A stop beats a start in flight in another process: it leaves a stop
  request (``engine-stop-request.json``) that the starting supervisor checks while it waits, at the engine's exit
  and before any restart, so that start ends "stopped by request" instead of reporting a crash and restarting.
- **crash causes** are read from *this run's* log lines only (each start writes ``[dsv41 …] run ID: starting …``;
  the state file names the run) and its exit status — never from an earlier run's lines in the same log.
- **files**: the state file is validated as a typed record (:class:`~engine_manager.session.EngineRecord`); a bad
  one (wrong types, not JSON, a symbolic link) is moved aside and the next status/start/stop says so. The log and
  the state file are opened without following symbolic links.
- **state file** (``engine-state.json`` in the data dir, atomic, 0600): pid and start time of the engine and of its
  keeper, pgid, port, engine, the masked command line, the binding, a fingerprint of the key (never the key).
  A panel that was killed re-attaches to the live engine it started (pid + start time must match, health decides
  ready vs still starting) or cleans up after a dead one and says how it ended. An engine the panel did not start
  (something else answering on the port) is shown but never stopped.
- **dry run**: every command start would run on this machine (binding probes, port check, the keeper and engine
  command line, environment with the key masked, readiness check, stop) — also under a refused plan, with the
  refusal at the top; a port held by the panel's own engine is named as such.
- **status** of an engine that died while no panel watched is classified by the same code as the clean-up
  (:meth:`Supervisor.explain_dead`): cause and fix, not just the signal.

Everything long is a generator yielding typed events (:mod:`engine_manager.events`): the CLI prints them, the GUI
turns them into signals through ``app.workers``, tests assert on them. Thread model: one generator
(``run``/``watch``) owns the engine; ``stop()`` may run from another thread and the owning generator then returns
quietly.

This module holds the lifecycle class and its process handle; what it uses lives beside it:
:mod:`.events` (states, events), :mod:`.crash` (exit info, classification), :mod:`.procs` (pids, groups, ports),
:mod:`.logtail` (the log), :mod:`.start_plan` (which plan), :mod:`.dryrun` (``--dry-run``), :mod:`.session` (the typed
state file, the status). Their names stay importable from here (``from engine_manager.supervisor import X``):
many tests and modules use them.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shlex
import signal
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Generator, Iterator

import httpx
import psutil
from pydantic import ValidationError

from . import paths
from .atomic import (
    LinkRefused,
    atomic_write_json,
    ensure_private_dir,
    move_aside,
    open_append_nofollow,
    read_bytes_nofollow,
)
from .crash import GENERIC_PATTERNS, PERMANENT_CAUSES, ExitInfo, classify_exit
from .crash import signame as _signame
from .dryrun import DryRun
from .engines import get_engine
from .engines.base import Engine, FailureHint, LaunchSpec, LogEvent
from .events import (
    CRASHED,
    ENGINE_WORDS,
    READY,
    RESTARTING,
    RUNNING_STATES,
    STARTING,
    STATES,
    STOPPED,
    STOPPING,
    Attached,
    Crashed,
    Event,
    GaveUp,
    LogLines,
    Note,
    Progress,
    Ready,
    Restarting,
    StartFailed,
    StateChanged,
    Stopped,
    Stopping,
    engine_words,
    running_conflict,
)
from .frozen import module_argv  # the keeper's command line, also in the one-folder bundle
from .logtail import LOG_NAME, RUN_MARK, LogTail, log_path, read_log_tail, run_lines
from .numa import Binding, choose_binding
from .start_plan import default_plan, plan_host_warning, usable_plan
from .procs import alive as _alive
from .procs import ctime_of as _ctime
from .procs import describe_owner, group_members, key_fingerprint, port_free, port_owner, suggest_port
from .procs import find_child as _find_child
from .procs import live as _live
from .session import EngineRecord, EngineStatus, why_invalid

STATE_FILE = "engine-state.json"
EXIT_FILE = "engine-exit.json"
LOCK_FILE = "engine.lock"
STOP_FILE = "engine-stop-request.json"   # `dsv41 stop` leaves it: a start in flight (another process) obeys it
STATE_SCHEMA = 1
KEEPER = Path(__file__).with_name("keeper.py")

StateRecord = EngineRecord          # its name before issue 17

#: the supervisor's generators: they yield events and return an outcome ("ready", "stopped", an ExitInfo, a status)
Events = Generator[Event, None, Any]

__all__ = [
    "STOPPED", "STARTING", "READY", "STOPPING", "CRASHED", "RESTARTING", "STATES", "RUNNING_STATES",
    "STATE_FILE", "EXIT_FILE", "LOCK_FILE", "STOP_FILE", "LOG_NAME", "STATE_SCHEMA", "KEEPER", "ENGINE_WORDS",
    "engine_words", "running_conflict", "PERMANENT_CAUSES", "GENERIC_PATTERNS", "Event", "StateChanged", "Note",
    "Progress", "LogLines", "Ready", "Crashed", "Restarting", "GaveUp", "StartFailed", "Stopping", "Stopped",
    "Attached", "EngineStatus", "EngineRecord", "StateRecord", "ExitInfo", "FailureHint", "classify_exit",
    "RUN_MARK", "run_lines", "group_members", "record_alive", "port_owner", "describe_owner", "port_free",
    "suggest_port", "key_fingerprint", "LogTail", "log_path", "read_log_tail", "usable_plan", "plan_host_warning",
    "default_plan", "DryRun", "Supervisor", "module_argv",
]


def record_alive(rec: EngineRecord | dict[str, Any] | None) -> bool:
    """The state file's engine runs: keeper and engine both alive with their recorded start times."""
    if rec is None:
        return False
    if isinstance(rec, dict):
        try:
            rec = EngineRecord.model_validate(rec)
        except ValidationError:
            return False
    return rec.alive()


# -- the supervisor -------------------------------------------------------------------------------------------

@dataclass
class _Handle:
    """One engine process the supervisor started (``popen`` set) or re-attached to (``attached``)."""

    engine: Engine | None
    spec: LaunchSpec
    binding: Binding | None
    keeper_pid: int
    keeper_ctime: float
    pgid: int
    engine_pid: int | None
    engine_ctime: float | None
    started_at: float
    popen: subprocess.Popen | None = None
    ready_at: float | None = None
    attached: bool = False
    tail: LogTail | None = None
    recent: deque = field(default_factory=lambda: deque(maxlen=400))
    argv_shown: list[str] | None = None      # masked, binding prefix included (from the state file when attached)
    env_shown: dict[str, str] | None = None
    run_id: str | None = None                # marks this run's first line in the log (see run_lines)
    started_by: str | None = None            # who started it (session.STARTED_BY_WORDS), kept in the state file

    def shown_argv(self) -> list[str]:
        if self.argv_shown is not None:
            return list(self.argv_shown)
        return self.spec.masked_argv(self.binding.prefix if self.binding else [])

    def shown_env(self) -> dict[str, str]:
        return dict(self.env_shown) if self.env_shown is not None else self.spec.masked_env()

    def exited(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is not None
        return not _alive(self.keeper_pid, self.keeper_ctime)

    def close(self) -> None:
        if self.tail is not None:
            self.tail.close()
            self.tail = None



def _emit(ev: Event | None) -> Iterator[Event]:
    if ev is not None:
        yield ev


class Supervisor:
    """Owns one engine process at a time.

    Generators (yield :class:`Event`, return :class:`EngineStatus`): :meth:`run` (start, wait until ready, then
    supervise: crash → classify → restart), :meth:`watch` (re-attach to an engine started earlier and supervise
    it, or clean up after it), :meth:`stop`. Plain calls: :meth:`status`, :meth:`dry_run`, :meth:`binding`; and
    from any thread :meth:`cancel`, :meth:`request_force`, :meth:`detach`."""

    def __init__(self, settings: Any, *, hardware: Any = None, grace_s: float = 20.0,
                 silent_after_s: float = 60.0, backoff_base_s: float = 2.0, backoff_max_s: float = 60.0,
                 crash_limit: int = 5, crash_window_s: float = 600.0, poll_s: float = 0.1,
                 health_every_s: float = 2.0, progress_every_s: float = 0.5, log_max_bytes: int = 10 * 2**20,
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
        self._handle: _Handle | None = None
        self._stop_req = threading.Event()
        self._force_req = threading.Event()
        self._detach_req = threading.Event()
        self._stop_active = threading.Event()
        self._crashes: deque[float] = deque()
        self._phase = ""
        self._fraction: float | None = None
        self._binding_cache: dict[tuple, Binding] = {}
        self._http: httpx.Client | None = None
        self._plans: dict[tuple, tuple[dict[str, Any] | None, list[str]]] = {}
        self._state_notes: list[str] = []       # a bad state file moved aside: said once, by whoever asks next
        self._since = time.time()               # stop requests older than this run/watch are not for it
        self._token = f"{os.getpid()}:{id(self)}:{time.time_ns()}"
        self._stop_file_seen: tuple | None = None
        self._stop_file_req: dict[str, Any] | None = None

    # -- http ------------------------------------------------------------------------------------------------
    def http(self) -> httpx.Client:
        """One client for health checks: loopback only (no proxies from the environment), no TLS context to
        build, no kept-alive sockets (so nothing lingers after an engine is gone)."""
        if self._http is None:
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
        return self.data_dir / STATE_FILE

    @property
    def exit_path(self) -> Path:
        return self.data_dir / EXIT_FILE

    @property
    def lock_path(self) -> Path:
        return self.data_dir / LOCK_FILE

    @property
    def stop_request_path(self) -> Path:
        return self.data_dir / STOP_FILE

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

    def request_force(self) -> None:
        """During a stop: skip the rest of the grace period and SIGKILL now."""
        self._force_req.set()

    def detach(self) -> None:
        """Stop watching but leave the engine running (the window closes; the next panel re-attaches)."""
        self._detach_req.set()

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

    def _read_json(self, path: Path) -> dict[str, Any] | None:
        try:
            d = json.loads(read_bytes_nofollow(path, 16 * 2**20).decode("utf-8"))
            return d if isinstance(d, dict) else None
        except (OSError, ValueError, RecursionError):
            return None

    def _read_state_file(self) -> EngineRecord | None:
        """The state file's record, validated (:class:`EngineRecord`); None when there is none. A bad one (not
        JSON, wrong types, a symbolic link) is moved aside and a note says so (:meth:`_pop_state_notes`)."""
        path = self.state_path
        try:
            raw = read_bytes_nofollow(path, 16 * 2**20)
        except FileNotFoundError:
            return None
        except LinkRefused:
            why = "it is a symbolic link, which the panel never follows"
        except OSError as exc:
            self._note_state(f"The engine state file {path} cannot be read ({exc.strerror or exc}); the panel goes "
                             f"on as if no engine were recorded. Fix its permissions or remove it.")
            return None
        else:
            try:
                return EngineRecord.from_json(raw)
            except (ValueError, ValidationError) as exc:
                why = why_invalid(exc)
        try:
            where = f"moved aside to {move_aside(path, 'bad')}"
        except OSError as exc:
            where = f"and could not be moved aside ({exc.strerror or exc}); remove it"
        self._note_state(f"The engine state file {path} was not valid ({why}); it was {where}. The panel went on "
                         f"as if no engine were recorded: if one still runs, `dsv41 status` shows what holds "
                         f"the port.")
        return None

    def _note_state(self, text: str) -> None:
        if text not in self._state_notes:
            self._state_notes.append(text)

    def _pop_state_notes(self) -> Iterator[Note]:
        notes, self._state_notes = self._state_notes, []
        for n in notes:
            yield Note(n, "warning")

    # -- stop requests from another process (a `dsv41 stop` while this one starts the engine) -----------------
    def _write_stop_request(self) -> None:
        try:
            ensure_private_dir(self.data_dir)
            atomic_write_json(self.stop_request_path, {"by_pid": os.getpid(), "by": self._token, "at": time.time()})
        except OSError:
            pass        # the stop itself goes on; only a start in flight elsewhere would miss it

    def _stop_requested_elsewhere(self) -> dict[str, Any] | None:
        """A stop request written (by another supervisor, usually another process) since this one's run/watch
        began: a start in flight must obey it rather than report the engine's end as a crash and restart it."""
        try:
            st = os.stat(self.stop_request_path, follow_symlinks=False)
        except OSError:
            return None
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key != self._stop_file_seen:
            self._stop_file_seen = key
            self._stop_file_req = self._read_json(self.stop_request_path)
        req = self._stop_file_req
        if not req or req.get("by") == self._token:
            return None
        at = req.get("at")
        return req if isinstance(at, (int, float)) and at >= self._since else None

    def _stopped_by_request(self, h: _Handle | None, req: dict[str, Any]) -> Events:
        """Another `dsv41 stop` asked for the engine to stop while this supervisor starts (or restarts) it: it
        stops here too (the engine goes either way), says so, and nothing is restarted."""
        self._stop_req.set()
        who = req.get("by_pid")
        msg = f"stopped by request (`dsv41 stop`{f', pid {who}' if who else ''}); not restarted"
        if h is not None:
            # the `dsv41 stop` that asked signals the engine itself; an engine that stops through its top process
            # (Engine.stop_leader_grace_s) must not get a second SIGTERM from here (Strata's server kills its engine
            # at once on a second one): wait for that stop first, then make sure
            end = time.monotonic() + float(getattr(h.engine, "stop_leader_grace_s", 0.0) or 0.0)
            while not h.exited() and time.monotonic() < end:
                time.sleep(self.poll_s)
            if not h.exited():
                yield from self._terminate(h, grace=self.grace_s, quiet=True)
            yield from self._final_lines(h)
            self._forget(h)
        self._write_state_file(None, STOPPED, engine=h.spec.engine if h else None, message=msg)
        yield from _emit(self._set_state(STOPPED, msg))
        yield Stopped(msg[:1].upper() + msg[1:] + ".")
        return "stopped"

    def _write_state_file(self, h: _Handle | None, state: str, **extra: Any) -> None:
        if h is None:
            rec: dict[str, Any] = {"schema": STATE_SCHEMA, "state": state, "updated_at": time.time()}
        else:
            rec = {
                "schema": STATE_SCHEMA, "owner": "dsv41", "state": state, "updated_at": time.time(),
                "engine": h.spec.engine, "label": h.spec.label, "simulated": h.spec.simulated,
                "pid": h.engine_pid, "pid_start_time": h.engine_ctime,
                "keeper_pid": h.keeper_pid, "keeper_start_time": h.keeper_ctime, "pgid": h.pgid,
                "host": h.spec.host, "port": h.spec.port, "base_url": h.spec.base_url,
                "health_path": h.spec.health_path,
                "argv": h.shown_argv(), "env": h.shown_env(), "files": dict(h.spec.files), "cwd": h.spec.cwd,
                "binding": h.binding.to_dict() if h.binding else None,
                "log_path": str(self.log_path), "exit_file": str(self.exit_path),
                "started_at": h.started_at, "ready_at": h.ready_at,
                "supervisor_pid": os.getpid(), "key_fingerprint": key_fingerprint(h.spec.api_key),
                "run_id": h.run_id, "started_by": h.started_by or self.started_by,
            }
        rec.update(extra)
        atomic_write_json(self.state_path, rec)

    def _mark_state_file(self, **updates: Any) -> None:
        rec = self._read_state_file()
        if rec is None:
            return
        d = rec.to_json_dict()
        d.update(updates, updated_at=time.time())
        atomic_write_json(self.state_path, d)

    def _read_exit_file(self, keeper_pid: int | None) -> ExitInfo | None:
        d = self._read_json(self.exit_path)
        if d is None or (keeper_pid is not None and d.get("keeper_pid") != keeper_pid):
            return None
        if not all(d.get(k) is None or type(d.get(k)) is int for k in ("returncode", "signal")):
            return None
        return ExitInfo(d.get("returncode"), d.get("signal"), d.get("signal_name"), "exit-file")

    def _exit_info(self, h: _Handle) -> ExitInfo:
        info = self._read_exit_file(h.keeper_pid)
        if info is not None:
            return info
        rc = h.popen.returncode if h.popen is not None else None
        if rc is None:
            return ExitInfo(None, None, None, "unknown")
        if rc == -signal.SIGKILL:      # keeper and engine killed together (e.g. a cgroup OOM kill of the group)
            return ExitInfo(-9, 9, "SIGKILL", "keeper")
        if rc < 0:
            return ExitInfo(None, None, None, "keeper", keeper_killed=True)
        if rc > 128:
            return ExitInfo(-(rc - 128), rc - 128, _signame(rc - 128), "keeper")
        return ExitInfo(rc, None, None, "keeper")

    # -- engines, hardware, binding ----------------------------------------------------------------------------
    def _engine(self, engine: str | Engine | None) -> Engine:
        if isinstance(engine, Engine):
            return engine
        if engine is None:
            from .settings import resolve_engine
            hw = self._hardware()
            engine = resolve_engine(self.settings, bool(hw and hw.has_gpu))
        return self.resolve_engine(engine)

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
        rec = self._read_state_file()
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
        stopping = rec.state == STOPPING or bool(rec.stop_requested)
        st = EngineStatus(
            state=(rec.state if rec.state in RUNNING_STATES else STARTING) if alive
            else (STOPPED if stopping else CRASHED),
            engine=rec.engine, label=(rec.label or ""), simulated=bool(rec.simulated),
            pid=rec.pid, pgid=rec.pgid, keeper_pid=rec.keeper_pid, port=rec.port,
            base_url=rec.base_url,
            binding=(rec.binding or {}).get("summary") if rec.binding else None,
            log_path=(rec.log_path or str(self.log_path)), started_at=rec.started_at,
            ready_at=rec.ready_at, argv=list(rec.argv or []), owner="panel",
            key_matches=(rec.key_fingerprint == key_fingerprint(self.settings.api_key))
            if rec.key_fingerprint else None,
            plan_path=rec.plan_path,
            # the launch as recorded: its files (plan, routing trace) let a monitor started after a panel restart,
            # or `dsv41 monitor`, find what the command line does not show (Strata's trace flag sits in its config)
            spec=self._spec_from_record(rec) if alive else None, started_by=rec.started_by,
        )
        if not alive and not stopping:
            ex, crash = self.explain_dead(rec)
            st.message = (f"The engine started earlier (pid {rec.pid}) ended while no panel was watching "
                          f"({ex.words()}).")
            st.last_failure = crash.to_dict()
        return st

    def _status_of(self, h: _Handle, state: str, message: str) -> EngineStatus:
        return EngineStatus(
            state=state, engine=h.spec.engine, label=h.spec.label, simulated=h.spec.simulated,
            pid=h.engine_pid, pgid=h.pgid, keeper_pid=h.keeper_pid, port=h.spec.port, base_url=h.spec.base_url,
            binding=h.binding.summary() if h.binding else None, log_path=str(self.log_path),
            started_at=h.started_at, ready_at=h.ready_at,
            argv=h.shown_argv(), owner="panel", message=message,
            last_failure=self.last_failure.to_dict() if self.last_failure else None,
            key_matches=(h.spec.api_key == self.settings.api_key) if self.settings.api_key else None,
            binding_note=h.binding.note if h.binding else None, plan_path=h.spec.files.get("plan"), spec=h.spec,
            started_by=h.started_by or self.started_by)

    def _health_ok_record(self, rec: EngineRecord) -> bool:
        try:
            eng = self.resolve_engine(rec.engine or "sim")
            return eng.readiness(self.http(), self._spec_from_record(rec)).state == "ready"
        except Exception:
            return False

    def _spec_from_record(self, rec: EngineRecord) -> LaunchSpec:
        return LaunchSpec(engine=rec.engine or "sim", argv=list(rec.argv or []),
                          host=rec.host or self.settings.host, port=int(rec.port or 0),
                          api_key=self.settings.api_key, env={}, cwd=rec.cwd,
                          health_path=rec.health_path or "/health", files=dict(rec.files or {}),
                          simulated=bool(rec.simulated), label=rec.label or "")

    # -- dry run -------------------------------------------------------------------------------------------------
    def dry_run(self, engine: str | Engine | None = None, plan: dict[str, Any] | None = None) -> DryRun:
        """Every command start would run on this machine, without starting anything (the binding probes do run:
        they are ``<prefix> true``). Generated files are written, so the printed command works as is."""
        from .dryrun import build_dry_run

        return build_dry_run(self, engine, plan)

    def _own_running_record(self) -> EngineRecord | None:
        """The state file's record when it names a live engine this panel (or `dsv41 start`) started."""
        with self._lock:
            h = self._handle
        rec = self._read_state_file()
        if rec and rec.keeper_pid and (h is not None and h.keeper_pid == rec.keeper_pid
                                              or rec.alive()):
            return rec
        return None

    # -- run / watch -----------------------------------------------------------------------------------------
    def run(self, engine: str | Engine | None = None, plan: dict[str, Any] | None = None, *,
            watch: bool = True) -> Events:
        """Start the engine and wait until ready; with ``watch`` keep supervising it until :meth:`stop` or
        :meth:`detach` (a crash is classified and, with auto-restart, restarted with backoff)."""
        self._reset_requests()
        self._since = time.time()
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
        self._since = time.time()
        h = yield from self._attach()
        if h is None:
            return self.status(check_health=False)
        outcome = "ready" if h.ready_at is not None else (yield from self._wait_ready(h))
        rec = self._read_state_file() or EngineRecord.empty()
        plan_file = rec.plan_path
        plan = self._read_json(Path(plan_file)) if plan_file else None   # for a restart: the plan it ran with
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
        rec = self._read_state_file()
        yield from self._pop_state_notes()
        if not rec or not rec.keeper_pid:
            if rec and rec.state == CRASHED and isinstance(rec.last_failure, dict):
                try:
                    crash = Crashed(**{k: v for k, v in rec.last_failure.items() if k != "kind"})
                except TypeError:
                    crash = None
                if crash is not None:               # what happened last time stays visible until the next start
                    crash = replace(crash, will_restart=False, restart_in_s=None)
                    self.last_failure = crash
                    yield from _emit(self._set_state(CRASHED, (rec.message or "")))
                    yield crash
            return None
        ok = rec.alive()
        try:
            eng = self.resolve_engine(rec.engine or "sim")
        except Exception:
            eng = None
        if not ok or eng is None:
            yield from self._cleanup_dead(rec, eng)
            return None
        spec = self._spec_from_record(rec)
        binding = Binding.from_dict(rec.binding) if rec.binding else None
        h = _Handle(eng, spec, binding, rec.keeper_pid, float(rec.keeper_start_time or 0.0),
                    rec.pgid or rec.keeper_pid, rec.pid, rec.pid_start_time,
                    rec.started_at or time.time(), attached=True,
                    argv_shown=list(rec.argv or []), env_shown=dict(rec.env or {}),
                    run_id=rec.run_id, started_by=rec.started_by)
        h.recent.extend(run_lines(read_log_tail(self.log_path, 64_000), h.run_id)[-200:])
        h.tail = LogTail(self.log_path, None)
        try:
            healthy = eng.readiness(self.http(), spec).state == "ready"
        except Exception:
            healthy = False
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
            yield Ready(spec.base_url, time.time() - h.started_at, spec.engine, h.engine_pid, spec.simulated,
                        attached=True)
        return h

    def _cleanup_dead(self, rec: EngineRecord, eng: Engine | None) -> Events:
        """The state file names an engine that is gone: kill stragglers of its group, say how it ended."""
        pgid, since = rec.pgid, rec.keeper_start_time
        if pgid and since:
            left = group_members(int(pgid), since)
            for p in left:
                try:
                    p.kill()
                except (psutil.Error, OSError):
                    pass
            if left:
                psutil.wait_procs(left, timeout=3)
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
            try:
                eng = self.resolve_engine(rec.engine or "sim")
            except Exception:  # an unknown engine name: the generic signatures still apply
                eng = None
        ex = self._read_exit_file(rec.keeper_pid) or ExitInfo(None, None, None, "unknown")
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
        h: _Handle | None = None
        with os.fdopen(os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600), "r+") as lockf:
            try:
                fcntl.flock(lockf, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield from self._fail("busy", "Another dsv41 is starting the engine right now.",
                                      "Wait for it to finish, then look at `dsv41 status`.")
                return "failed"
            try:                                # who starts it (a `dsv41 stop` meanwhile names it)
                lockf.seek(0)
                lockf.truncate()
                lockf.write(f"{os.getpid()}\n")
                lockf.flush()
            except OSError:
                pass
            rec = self._read_state_file()
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
            rec = self._read_state_file() or EngineRecord.empty()
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
        host, port = self.settings.host, self.settings.port
        if not port_free(host, port):
            owner = port_owner(host, port)
            alt = suggest_port(host, port)
            yield from self._fail(
                "port_in_use", f"Port {port} is in use by {describe_owner(owner)}.",
                "Stop that program, or choose another port: "
                + (f"`dsv41 settings set port {alt}` (or DSV41_PORT={alt}); {alt} is free now."
                   if alt else "`dsv41 settings set port <N>` (or DSV41_PORT)."), suggested_port=alt)
            return None
        binding = self.binding()
        if not restart:
            for line in binding.describe():
                yield Note(line)
        workdir = self.runs_dir / eng.name
        ensure_private_dir(workdir)
        if getattr(eng, "prepare", None) is not None:      # Strata: the model's pack, made once by the release's tool
            ok = yield from self._prepare(eng, plan)
            if not ok:
                return None
        try:
            spec = eng.build_launch(self.settings, plan, workdir)
        except Exception as exc:
            yield from self._fail("bad_setup", f"The {eng.name} engine cannot be started: {exc}",
                                  "Fix what the message names (settings, model folder, engine binary) and start "
                                  "again; `dsv41 doctor` checks this machine.")
            return None
        problems = _preflight(eng, spec)
        if problems:
            yield from self._fail("preflight", " ".join(problems),
                                  "Fix what the message names and start again; `dsv41 start --dry-run` shows the "
                                  "command, `dsv41 doctor` checks this machine.")
            return None
        return (yield from self._spawn(eng, spec, binding))

    def _prepare(self, eng: Engine, plan: dict[str, Any] | None) -> Events:
        """Run the engine's provisioning (``eng.prepare``: Strata's pack, :mod:`engine_manager.provision`) when
        it is needed, as Notes, Progress and LogLines. Returns False after a ``failed`` event."""
        from .errors import UserError

        prepare = getattr(eng, "prepare", None)     # only Strata's adapter has one (_launch asked)
        if prepare is None:
            return True
        gen = prepare(self.settings, plan)
        t0 = time.monotonic()
        try:
            for ev in gen:
                if self._stop_req.is_set() or self._stop_requested_elsewhere() is not None:
                    gen.close()
                    yield from self._fail("stopped", "Stopped while the model was being prepared; it is prepared "
                                          "again at the next start.", "Start again when you want the engine.")
                    return False
                if ev.phase == "progress":
                    yield Progress(time.monotonic() - t0, 0.0, f"preparing the model: {ev.done} of {ev.total}",
                                   ev.fraction, ev.eta_s, pid=ev.pid)
                elif ev.phase == "output":
                    yield LogLines([f"[dsv41 prepare] {ev.text}"])
                elif ev.phase == "done" and ev.skipped:
                    continue
                else:
                    yield Note(ev.text)
        except UserError as exc:
            # a known refusal (the release's tool cannot pack this model) carries its own cause and fix
            fix = getattr(exc, "fix", None)
            yield from self._fail(getattr(exc, "cause", None) or "prepare_failed",
                                  getattr(exc, "summary", str(exc)) if fix else str(exc),
                                  fix or "Fix what the message names, then start again (or run `dsv41 prepare`).")
            return False
        finally:
            gen.close()
        return True

    def _fail(self, cause: str, message: str, fix: str, tail: list[str] | None = None,
              suggested_port: int | None = None) -> Events:
        self._record_start_failure(cause, message, fix, tail or [])
        yield from _emit(self._set_state(STOPPED, message))
        yield StartFailed(cause, message, fix, tail or [], suggested_port=suggested_port)

    def _record_start_failure(self, cause: str, message: str, fix: str, tail: list[str]) -> None:
        """A start that failed before an engine ran (a refused pack, a missing release, a taken port) is what
        ``dsv41 status`` and ``dsv41 logs`` show next — never an earlier run's failure. Written only when no engine
        of this panel runs (its record must stay), as a stopped record carrying ``last_failure`` of kind
        ``start_failed``, and as two lines at the end of the engine log."""
        rec = self._read_state_file()
        if rec is not None and rec.keeper_pid and rec.alive():
            return
        failure = {"kind": "start_failed", "cause": cause, "title": message, "fix": fix, "returncode": None,
                   "signal": None, "log_tail": list(tail[-20:])}
        try:
            self._write_state_file(None, STOPPED, message=f"The last start failed: "
                                   f"{message}", last_failure=failure)
        except OSError:
            pass
        try:
            with os.fdopen(open_append_nofollow(self.log_path), "ab") as f:
                f.write((f"[dsv41 {time.strftime('%Y-%m-%d %H:%M:%S')}] start failed ({cause}): {message}\n"
                         f"[dsv41] what to do: {fix}\n").encode("utf-8", "replace"))
        except OSError:
            pass

    def _spawn(self, eng: Engine, spec: LaunchSpec, binding: Binding | None) -> Events:
        req = self._stop_requested_elsewhere()
        if req is not None:                  # a `dsv41 stop` came while this start prepared: nothing is started
            yield from self._stopped_by_request(None, req)
            return None
        prefix = binding.prefix if binding else []
        run_id = f"{int(time.time())}-{os.getpid()}-{secrets.token_hex(3)}"
        try:
            logfd = open_append_nofollow(self.log_path)
        except OSError as exc:
            yield from self._fail("log_refused", f"The engine log cannot be opened: {exc.strerror or exc}.",
                                  f"Make {self.log_path} a plain file the panel can write (remove a link or a "
                                  "wrong file there), then start again.")
            return None
        with os.fdopen(logfd, "ab") as f:
            offset = os.fstat(f.fileno()).st_size
            f.write((f"[dsv41 {time.strftime('%Y-%m-%d %H:%M:%S')}] run {run_id}: starting "
                     f"{spec.label or spec.engine}: {shlex.join(spec.masked_argv(prefix))}\n"
                     f"[dsv41] binding: {binding.summary() if binding else 'none'}\n").encode())
        try:
            self.exit_path.unlink()
        except FileNotFoundError:
            pass
        env = dict(os.environ)
        secret_values = set(spec.secrets())
        # a secret the engine reads from its environment ($STRATA_API_KEY) goes through the keeper's pipe too, so
        # it is in the engine's environment only, not the keeper's
        secret_env = {k: v for k, v in spec.env.items() if v in secret_values}
        env.update({k: v for k, v in spec.env.items() if k not in secret_env})
        env.pop("DSV41_KEEPER_MASK", None)
        env["DSV41_NUMA_BINDING"] = binding.strategy if binding else "none"   # an engine may report it
        # the secrets to mask reach the keeper through a pipe on its stdin (read to EOF, then closed), never its
        # environment: /proc/<pid>/environ stays readable for the keeper's whole life
        argv = module_argv("engine_manager.keeper", script=KEEPER) + ["--log", str(self.log_path), "--exit-file",
                str(self.exit_path), "--max-bytes", str(self.log_max_bytes), "--backups", str(self.log_backups),
                "--mask-stdin"]
        if spec.files.get("engine_log"):    # a log the engine writes itself (Strata's config "log"): followed
            argv += ["--follow", spec.files["engine_log"]]
        argv += ["--", *prefix, *spec.argv]
        try:
            errfd = open_append_nofollow(self.log_path)
        except OSError as exc:
            yield from self._fail("log_refused", f"The engine log cannot be opened: {exc.strerror or exc}.",
                                  f"Make {self.log_path} a plain file the panel can write, then start again.")
            return None
        try:
            popen = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=errfd,
                                     env=env, cwd=spec.cwd or None, start_new_session=True, close_fds=True)
        except OSError as exc:
            yield from self._fail("spawn_failed", f"Could not start the engine's keeper: {exc}",
                                  "Check that Python and the engine files are readable; see the log.")
            return None
        finally:
            os.close(errfd)
        try:
            assert popen.stdin is not None
            popen.stdin.write(("".join(f"MASK {s}\n" for s in secret_values)
                               + "".join(f"ENV {k}={v}\n" for k, v in secret_env.items())).encode())
            popen.stdin.close()
        except (BrokenPipeError, OSError):
            pass                    # the keeper died at once: the exit file and the log say why
        started = time.time()
        kctime = _ctime(popen.pid) or started
        epid, ectime = _find_child(popen)
        h = _Handle(eng, spec, binding, popen.pid, kctime, popen.pid, epid, ectime, started, popen, run_id=run_id,
                    started_by=self.started_by)
        h.tail = LogTail(self.log_path, offset)
        with self._lock:
            self._handle = h
        self._write_state_file(h, STARTING)
        yield Note(f"Started {spec.label or spec.engine} (pid {epid or '?'}, process group {popen.pid}); "
                   f"log: {self.log_path}")
        return h

    # -- readiness ---------------------------------------------------------------------------------------------
    def _drain(self, h: _Handle) -> LogLines | None:
        if h.tail is None:
            return None
        lines = h.tail.read()
        if not lines:
            return None
        events: list[LogEvent] = []
        for ln in lines:
            h.recent.append(ln)
            if ln.startswith("[dsv41") or h.engine is None:
                continue
            try:
                ev = h.engine.parse_log_line(ln)
            except Exception:   # an adapter bug must not stop the supervisor
                ev = None
            if ev is None:
                continue
            events.append(ev)
            if ev.kind == "phase":
                self._phase = ev.text
                data = ev.data if isinstance(ev.data, dict) else {}
                frac = data.get("fraction")
                if not isinstance(frac, (int, float)) and isinstance(data.get("pct"), (int, float)):
                    frac = data["pct"] / 100.0
                self._fraction = float(frac) if isinstance(frac, (int, float)) else None
        return LogLines(lines, events)

    def _final_lines(self, h: _Handle) -> Events:
        time.sleep(0.02)                       # the keeper's last line lands right before it exits
        batch = self._drain(h)
        if batch is not None:
            yield batch

    def _wait_ready(self, h: _Handle) -> Events:
        # an engine with a READY deadline of its own (Strata's server) is given the panel's timeout and waited for a
        # margin longer, so that its own words ("did not report READY within N s") arrive before the panel gives up
        timeout = self.ready_timeout_s + (h.engine.ready_margin_s if h.engine is not None else 0.0)
        self._phase, self._fraction = "starting", None
        last_out = time.time()
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
            batch = self._drain(h)
            if batch is not None:
                last_out = time.time()
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
                return self._exit_info(h)
            now = time.time()
            elapsed = now - h.started_at
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
                    h.ready_at = time.time()
                    self._write_state_file(h, READY)
                    yield from _emit(self._set_state(READY, f"ready after {h.ready_at - h.started_at:.1f} s "
                                                            f"at {h.spec.base_url}"))
                    yield Ready(h.spec.base_url, h.ready_at - h.started_at, h.spec.engine, h.engine_pid,
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
                    f"{self._phase or 'unknown'}); it was stopped.",
                    "If it was still loading (a first start downloads and loads the model), raise "
                    "ready_timeout_s (DSV41_READY_TIMEOUT) and start again; otherwise read the log lines.",
                    tail)
                return "failed"
            if now >= next_progress:
                next_progress = now + self.progress_every_s
                frac = self._fraction
                eta = elapsed * (1 - frac) / frac if frac and 0 < frac < 1 else None
                yield Progress(elapsed, timeout, self._phase or "starting", frac, eta, now - last_out,
                               h.engine_pid)
            time.sleep(self.poll_s)

    # -- watching a ready engine ------------------------------------------------------------------------------
    def _watch_loop(self) -> Events:
        with self._lock:
            h = self._handle
        if h is None:
            return "stopped"
        last_ok = time.time()
        next_health = time.time() + self.health_every_s
        client = self.http()
        while True:
            if self._detach_req.is_set():
                return "detached"
            batch = self._drain(h)
            if batch is not None:
                yield batch
            if h.exited():
                yield from self._final_lines(h)
                if self._stop_req.is_set():
                    return "stopped"        # our own stop() reports the rest
                if self._stopped_elsewhere() or self._stop_requested_elsewhere() is not None:
                    return (yield from self._stopped_by_other(h))
                return self._exit_info(h)
            if self._stop_req.is_set():
                return "stopped"
            now = time.time()
            if now >= next_health and h.engine is not None:
                next_health = now + self.health_every_s
                try:
                    ok = h.engine.readiness(client, h.spec).state == "ready"
                except Exception:
                    ok = False
                if ok:
                    last_ok = time.time()
                elif time.time() - last_ok >= self.silent_after_s and not h.exited() \
                        and not self._stop_req.is_set():
                    silent = time.time() - last_ok
                    yield Note(f"The engine has not answered its health check for {silent:.0f} s while its "
                               "process is alive; stopping it.", "warning")
                    yield from self._terminate(h, grace=min(self.grace_s, 5.0), quiet=True)
                    info = self._exit_info(h)
                    info.silent_s = silent
                    return info
            time.sleep(self.poll_s)

    def _stopped_elsewhere(self) -> bool:
        rec = self._read_state_file()
        return bool(rec and (rec.stop_requested or rec.state in (STOPPING, STOPPED)))

    def _stopped_by_other(self, h: _Handle) -> Events:
        rec = self._read_state_file() or EngineRecord.empty()
        req = rec.stop_requested
        who = req.get("by_pid") if isinstance(req, dict) else None
        if h.popen is not None:
            h.popen.wait()
        self._forget(h)
        msg = f"stopped by another dsv41 (pid {who})" if who else "stopped by another dsv41"
        yield from _emit(self._set_state(STOPPED, msg))
        yield Stopped(msg)
        return "stopped"

    def _forget(self, h: _Handle) -> None:
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
        now = time.time()
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

    def _reap_group(self, h: _Handle) -> Events:
        left = group_members(h.pgid, h.keeper_ctime)
        if left:
            for p in left:
                try:
                    p.kill()
                except (psutil.Error, OSError):
                    pass
            psutil.wait_procs([p for p in left if not (h.popen and p.pid == h.popen.pid)], timeout=3)
            yield Note(f"Killed {len(left)} leftover process(es) of the engine's group.", "warning")
        if h.popen is not None:
            try:
                h.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
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
        if force:
            self._force_req.set()
        self._write_stop_request()          # a start in flight in another process obeys it (stop beats start)
        with self._lock:
            h = self._handle
            was = self._state
        if h is None:
            rec = self._read_state_file()
            yield from self._pop_state_notes()
            if not (rec and rec.keeper_pid and rec.alive()):
                holder = self._start_in_flight()
                if holder is not None:
                    yield Note(f"A start is in progress ({holder}); it was asked to stop and stops by itself. "
                               "Waiting for it…")
                    end = time.monotonic() + self.grace_s + 15.0
                    while time.monotonic() < end and self._start_in_flight() is not None:
                        rec = self._read_state_file()
                        if rec and rec.keeper_pid and rec.alive():
                            break               # it has started the engine meanwhile: stop that here
                        time.sleep(self.poll_s)
                    rec = self._read_state_file()
                    yield from self._pop_state_notes()
                    still = self._start_in_flight()
                    if still is not None and not (rec and rec.keeper_pid and rec.alive()):
                        msg = (f"The start in progress ({still}) was asked to stop; it stops by itself before the "
                               "engine answers (it is still preparing). `dsv41 status` shows when it has.")
                        yield from _emit(self._set_state(STOPPED, msg))
                        yield Stopped(msg)
                        return self.status(check_health=False)
            if rec and rec.keeper_pid:
                if rec.alive():
                    try:
                        eng = self.resolve_engine(rec.engine or "sim")
                    except Exception:
                        eng = None
                    h = _Handle(eng, self._spec_from_record(rec), None, rec.keeper_pid,
                                float(rec.keeper_start_time or 0.0), rec.pgid or rec.keeper_pid, rec.pid,
                                rec.pid_start_time, rec.started_at or time.time(), attached=True,
                                started_by=rec.started_by)
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
        self._mark_state_file(state=STOPPING, stop_requested={"by_pid": os.getpid(), "at": time.time()})
        yield from _emit(self._set_state(STOPPING, "stopping" + (" (SIGKILL)" if force else "")))
        forced, leftovers = yield from self._terminate(h, grace=0.0 if force else self.grace_s, leader_first=True)
        if h.tail is not None:                  # the engine's last words (and the keeper's exit line)
            time.sleep(0.02)
            batch = self._drain(h)
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

    def _start_in_flight(self) -> str | None:
        """Who holds the start lock now ("pid N"), or None when no start is in progress."""
        try:
            fd = os.open(self.lock_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        with os.fdopen(fd, "r") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = f.read(32).strip()
                return f"pid {pid}" if pid.isdigit() else "another dsv41"
            except OSError:
                return None
            fcntl.flock(f, fcntl.LOCK_UN)
        return None

    def _terminate(self, h: _Handle, grace: float, quiet: bool = False, leader_first: bool = False) -> Events:
        """SIGTERM the group (SIGKILL at once when ``grace`` is 0), wait, then SIGKILL; every descendant too,
        also one that left the group. ``leader_first`` (a stop asked for): an engine that declares
        ``stop_leader_grace_s`` gets one SIGTERM to its top process alone first, and the group only after that
        budget. Returns ``(forced, leftover pids)``."""
        tracked: dict[int, psutil.Process] = {}

        def track(pid: int | None, ctime: float | None) -> None:
            if pid and _alive(pid, ctime):
                try:
                    tracked.setdefault(pid, psutil.Process(pid))
                except (psutil.Error, OSError):
                    pass

        def refresh() -> None:
            for p in group_members(h.pgid, h.keeper_ctime):
                tracked.setdefault(p.pid, p)
            for p in list(tracked.values()):
                try:
                    for c in p.children(recursive=True):
                        tracked.setdefault(c.pid, c)
                except (psutil.Error, OSError):
                    pass

        track(h.keeper_pid, h.keeper_ctime)
        track(h.engine_pid, h.engine_ctime)
        refresh()
        forced = grace <= 0 or self._force_req.is_set()
        leader_s = float(getattr(h.engine, "stop_leader_grace_s", 0.0) or 0.0)
        if leader_first and not forced and leader_s > 0 and h.engine_pid and _alive(h.engine_pid, h.engine_ctime):
            # the engine's top process stops its children in its own order (Strata's server: QUIT to the native
            # engine first); it gets ONE SIGTERM, the group only once its own budget has run out
            done = yield from self._leader_first(h, tracked, refresh, leader_s, quiet)
            if done:
                return False, []
            forced = self._force_req.is_set()
        self._signal_all(h, tracked, signal.SIGKILL if forced else signal.SIGTERM)
        t0 = time.monotonic()
        killed_at: float | None = t0 if forced else None
        next_ev = 0.0
        next_scan = time.monotonic() + 0.2
        while True:
            if h.popen is not None:
                h.popen.poll()                  # reap the keeper as soon as it exits
            if time.monotonic() >= next_scan:   # a full process scan costs ~25 ms: not every turn
                next_scan = time.monotonic() + 0.2
                refresh()
            alive = _live(list(tracked.values()))
            if not alive:
                refresh()                       # one last look for anything started meanwhile
                alive = _live(list(tracked.values()))
            if not alive:
                break
            el = time.monotonic() - t0
            if not forced and (el >= grace or self._force_req.is_set()):
                self._signal_all(h, tracked, signal.SIGKILL)
                forced, killed_at = True, time.monotonic()
            if killed_at is not None and time.monotonic() - killed_at > 10:
                break                           # unkillable (stuck in the kernel): reported as leftovers
            if not quiet and time.monotonic() >= next_ev:
                next_ev = time.monotonic() + 0.25
                yield Stopping(el, grace, "SIGKILL" if forced else "SIGTERM", len(alive))
            time.sleep(0.02)
        if h.popen is not None:
            try:
                h.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        return forced, [p.pid for p in _live(list(tracked.values()))]

    def _leader_first(self, h: _Handle, tracked: dict[int, psutil.Process], refresh: Callable[[], None],
                      budget_s: float, quiet: bool) -> Generator[Event, None, bool]:
        """SIGTERM (with SIGCONT) to the engine's top process only, then wait until every tracked process has
        ended (→ True) or ``budget_s`` passed or a Force stop was asked for (→ False)."""
        try:
            leader = psutil.Process(h.engine_pid)
            leader.send_signal(signal.SIGTERM)
            leader.send_signal(signal.SIGCONT)
        except (psutil.Error, OSError):
            return False
        t0 = time.monotonic()
        next_ev = next_scan = 0.0
        while time.monotonic() - t0 < budget_s and not self._force_req.is_set():
            if h.popen is not None:
                h.popen.poll()
            if not _alive(h.engine_pid, h.engine_ctime):
                # the top process is gone but children remain: it died of the SIGTERM instead of stopping them
                # (Strata's server installs its SIGTERM handler only once the engine said READY: server.py
                # @2291cb3 main()), so nothing else will stop them — the group is signalled now, not after the budget
                refresh()
                return not _live(list(tracked.values()))
            if time.monotonic() >= next_scan:
                next_scan = time.monotonic() + 0.2
                refresh()
            if not _live(list(tracked.values())):
                refresh()
                if not _live(list(tracked.values())):
                    if h.popen is not None:
                        try:
                            h.popen.wait(timeout=5)
                        except subprocess.TimeoutExpired:
                            pass
                    return True
            if not quiet and time.monotonic() >= next_ev:
                next_ev = time.monotonic() + 0.25
                yield Stopping(time.monotonic() - t0, budget_s, "SIGTERM to the engine's server",
                               len(_live(list(tracked.values()))))
            time.sleep(0.02)
        return False

    @staticmethod
    def _signal_all(h: _Handle, tracked: dict[int, psutil.Process], sig: int) -> None:
        sigs = [sig]
        if sig == signal.SIGTERM:
            # A stopped (SIGSTOP / Ctrl+Z) process must run to act on SIGTERM. Waking it first, then a moment,
            # matters: a SIGTERM that arrives while a multi-threaded Python engine is stopped can land on a
            # non-main thread and never wake the main one (measured with the scripted engine: no exit in 5 s).
            paused = []
            for p in tracked.values():
                try:
                    if p.status() == psutil.STATUS_STOPPED:
                        paused.append(p)
                except (psutil.Error, OSError):
                    pass
            if paused:
                Supervisor._signal_all(h, tracked, signal.SIGCONT)
                time.sleep(0.1)
            sigs = [sig, signal.SIGCONT]
        ours = bool(group_members(h.pgid, h.keeper_ctime))    # never signal a group id someone else now holds
        for s in sigs:
            if ours:
                try:
                    os.killpg(h.pgid, s)
                except (ProcessLookupError, PermissionError):
                    pass
            for p in tracked.values():          # descendants that left the group (setsid) get it too
                try:
                    if os.getpgid(p.pid) != h.pgid and p.is_running():
                        p.send_signal(s)
                except (ProcessLookupError, psutil.Error, OSError):
                    pass


def _preflight(eng: Engine, spec: LaunchSpec) -> list[str]:
    """The engine's own plain-words launch problems (missing binary, model), when it offers the check."""
    check = getattr(eng, "preflight", None)
    if check is None:
        return []
    try:
        return [str(p) for p in (check(spec) or [])]
    except Exception:  # a broken check must not block a launch: the engine's own errors will say what is wrong
        return []
