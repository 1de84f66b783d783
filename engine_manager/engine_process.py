"""One engine process as the supervisor holds it: :class:`EngineProcess`.

The keeper and the engine the supervisor started (``popen`` set) or re-attached to (``attached``, from the state
file's :class:`~engine_manager.engine_state.EngineRecord`): their pids and start times, the launch spec and
binding, the engine log followed from this run's first line (:meth:`EngineProcess.drain`: new lines, what the
adapter read in them, the loading phase), and what the state file and the status say about it
(:meth:`EngineProcess.record`, :meth:`EngineProcess.status`). The lifecycle that moves it is
:class:`engine_manager.supervisor.Supervisor`'s; this module never imports it, nor Qt.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .engine_state import (
    CRASHED,
    RUNNING_STATES,
    STARTING,
    STATE_SCHEMA,
    STOPPED,
    STOPPING,
    EngineStatus,
    ExitInfo,
)
from .engine_record import EngineRecord
from .engines.base import Engine, LaunchSpec, LogEvent
from .logtail import LogTail, read_log_tail, run_lines
from .numa import Binding
from .procs import BOOT_ID, EngineGroup, alive, ctime_of, find_child, key_fingerprint, seconds_since
from .state_files import StateFiles
from .supervisor_events import LogLines


def spec_from_record(rec: EngineRecord, host: str, api_key: str) -> LaunchSpec:
    """The launch spec of the engine a state file names, as far as it was recorded (``host`` and the key: the
    settings' now — the key is never recorded)."""
    return LaunchSpec(engine=rec.engine or "sim", argv=list(rec.argv or []), host=rec.host or host,
                      port=int(rec.port or 0), api_key=api_key, env={}, cwd=rec.cwd,
                      health_path=rec.health_path or "/health", files=dict(rec.files or {}),
                      simulated=bool(rec.simulated), label=rec.label or "")


def status_from_record(rec: EngineRecord, alive_now: bool, *, log_path: Path, api_key: str,
                       spec: LaunchSpec | None) -> EngineStatus:
    """The status of the engine a state file names (``alive_now``: it still runs): running states as recorded
    (else starting), a dead one stopped when a stop was asked for, else crashed (the caller says why)."""
    stopping = rec.state == STOPPING or bool(rec.stop_requested)
    return EngineStatus(
        state=(rec.state if rec.state in RUNNING_STATES else STARTING) if alive_now
        else (STOPPED if stopping else CRASHED),
        engine=rec.engine, label=(rec.label or ""), simulated=bool(rec.simulated),
        pid=rec.pid, pgid=rec.pgid, keeper_pid=rec.keeper_pid, port=rec.port,
        base_url=rec.base_url,
        binding=(rec.binding or {}).get("summary") if rec.binding else None,
        log_path=(rec.log_path or str(log_path)), started_at=rec.started_at,
        ready_at=rec.ready_at, argv=list(rec.argv or []), owner="panel",
        key_matches=(rec.key_fingerprint == key_fingerprint(api_key)) if rec.key_fingerprint else None,
        plan_path=rec.plan_path,
        # the launch as recorded: its files (plan, routing trace) let a monitor started after a panel restart,
        # or `dsv41 monitor`, find what the command line does not show (Strata's trace flag sits in its config)
        spec=spec, started_by=rec.started_by, keeper_start=rec.keeper_start_time,
    )


@dataclass
class EngineProcess:
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
    run_id: str | None = None                # marks this run's first line in the log (see logtail.run_lines)
    started_by: str | None = None            # who started it (engine_state.STARTED_BY_WORDS), in the state file
    phase: str = ""                          # the loading phase the engine's log says it is in
    fraction: float | None = None            # 0..1 of that phase, when the log gives one

    @classmethod
    def started(cls, eng: Engine, spec: LaunchSpec, binding: Binding | None, popen: subprocess.Popen, *,
                run_id: str, started_by: str, log_path: Path, log_offset: int) -> "EngineProcess":
        """The keeper ``popen`` just started (it leads its own process group) and the engine under it, its log
        followed from ``log_offset`` (this run's first line)."""
        started = time.time()
        kctime = ctime_of(popen.pid) or started
        epid, ectime = find_child(popen)
        h = cls(eng, spec, binding, popen.pid, kctime, popen.pid, epid, ectime, started, popen, run_id=run_id,
                started_by=started_by)
        h.tail = LogTail(log_path, log_offset)
        return h

    @classmethod
    def attached_to(cls, rec: EngineRecord, eng: Engine | None, spec: LaunchSpec, binding: Binding | None = None,
                    log_path: Path | None = None) -> "EngineProcess":
        """The live engine a state file names (``rec.keeper_pid`` set), as recorded; with ``log_path``, its log is
        followed from now on, this run's last lines kept in ``recent``."""
        h = cls(eng, spec, binding, int(rec.keeper_pid or 0), float(rec.keeper_start_time or 0.0),
                rec.pgid or int(rec.keeper_pid or 0), rec.pid, rec.pid_start_time, rec.started_at or time.time(),
                attached=True, argv_shown=list(rec.argv or []), env_shown=dict(rec.env or {}),
                run_id=rec.run_id, started_by=rec.started_by)
        if log_path is not None:
            h.recent.extend(run_lines(read_log_tail(log_path, 64_000), h.run_id)[-200:])
            h.tail = LogTail(log_path, None)
        return h

    def shown_argv(self) -> list[str]:
        if self.argv_shown is not None:
            return list(self.argv_shown)
        return self.spec.masked_argv(self.binding.prefix if self.binding else [])

    def shown_env(self) -> dict[str, str]:
        return dict(self.env_shown) if self.env_shown is not None else self.spec.masked_env()

    def age(self) -> float:
        """Seconds since the keeper started, on a clock no step of the wall clock moves (``procs.seconds_since``):
        what the READY limit and the load's duration are measured with."""
        return seconds_since(self.keeper_ctime, self.started_at)

    def exit_fd(self) -> int | None:
        """A descriptor that becomes readable when the keeper ends (a Linux pidfd), for :func:`select.poll`; None
        where the kernel has none (or the keeper is already gone): the caller then looks at :meth:`exited` on a
        clock. The caller closes it."""
        if not self.keeper_pid or not hasattr(os, "pidfd_open") or (self.popen and self.popen.returncode is not None):
            return None
        try:
            fd = os.pidfd_open(self.keeper_pid)
        except OSError:
            return None
        # opened by number: it is the keeper only if the keeper still runs now (not a process that took the number)
        if self.popen is None and not alive(self.keeper_pid, self.keeper_ctime):
            os.close(fd)
            return None
        return fd

    def exited(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is not None
        return not alive(self.keeper_pid, self.keeper_ctime)

    @property
    def group(self) -> EngineGroup:
        return EngineGroup(self.pgid, self.keeper_pid, self.keeper_ctime, self.engine_pid, self.engine_ctime,
                           self.popen)

    def exit_info(self, files: StateFiles) -> ExitInfo:
        """How it ended: the keeper's exit file, else the keeper's own exit status."""
        return files.exit_info(self.keeper_pid, self.popen.returncode if self.popen is not None else None)

    @property
    def leader_grace_s(self) -> float:
        """How long its top process may take to stop its own children (``Engine.stop_leader_grace_s``; 0: none)."""
        return float(getattr(self.engine, "stop_leader_grace_s", 0.0) or 0.0)

    def wait_exit(self, timeout_s: float, poll_s: float) -> bool:
        """Wait up to ``timeout_s`` for the keeper to end; True when it has."""
        end = time.monotonic() + timeout_s
        while not self.exited() and time.monotonic() < end:
            time.sleep(poll_s)
        return self.exited()

    def healthy(self, client: Any) -> bool:
        """Its engine answers its readiness check as ready now (False on any error)."""
        try:
            return self.engine is not None and self.engine.readiness(client, self.spec).state == "ready"
        except Exception:  # adapters map "refused" to loading; anything else: not ready
            return False

    def close(self) -> None:
        if self.tail is not None:
            self.tail.close()
            self.tail = None

    def drain(self) -> LogLines | None:
        """The log lines written since the last call (kept in ``recent``) and what the engine's adapter read in
        them; a ``phase`` event sets :attr:`phase` and :attr:`fraction`. None when there is nothing new."""
        if self.tail is None:
            return None
        lines = self.tail.read()
        if not lines:
            return None
        events: list[LogEvent] = []
        for ln in lines:
            self.recent.append(ln)
            if ln.startswith("[dsv41") or self.engine is None:
                continue
            try:
                ev = self.engine.parse_log_line(ln)
            except Exception:   # an adapter bug must not stop the supervisor
                ev = None
            if ev is None:
                continue
            events.append(ev)
            if ev.kind == "phase":
                self.phase = ev.text
                data = ev.data if isinstance(ev.data, dict) else {}
                frac = data.get("fraction")
                if not isinstance(frac, (int, float)) and isinstance(data.get("pct"), (int, float)):
                    frac = data["pct"] / 100.0
                self.fraction = float(frac) if isinstance(frac, (int, float)) else None
        return LogLines(lines, events)

    def record(self, state: str, *, log_path: Path, exit_path: Path, started_by: str) -> dict[str, Any]:
        """The state file's record of this engine in ``state`` (``started_by``: the supervisor's, when the
        process does not say)."""
        spec = self.spec
        return {
            "schema": STATE_SCHEMA, "owner": "dsv41", "state": state, "updated_at": time.time(),
            "engine": spec.engine, "label": spec.label, "simulated": spec.simulated,
            "pid": self.engine_pid, "pid_start_time": self.engine_ctime,
            "keeper_pid": self.keeper_pid, "keeper_start_time": self.keeper_ctime, "pgid": self.pgid,
            "boot_id": BOOT_ID, "host": spec.host, "port": spec.port, "base_url": spec.base_url,
            "health_path": spec.health_path,
            "argv": self.shown_argv(), "env": self.shown_env(), "files": dict(spec.files), "cwd": spec.cwd,
            "binding": self.binding.to_dict() if self.binding else None,
            "log_path": str(log_path), "exit_file": str(exit_path),
            "started_at": self.started_at, "ready_at": self.ready_at,
            "supervisor_pid": os.getpid(), "key_fingerprint": key_fingerprint(spec.api_key),
            "run_id": self.run_id, "started_by": self.started_by or started_by,
        }

    def status(self, state: str, message: str, *, log_path: Path, last_failure: dict[str, Any] | None,
               api_key: str, started_by: str) -> EngineStatus:
        """What :meth:`Supervisor.status` says of this engine in ``state`` (``api_key``: the settings' now)."""
        spec, b = self.spec, self.binding
        return EngineStatus(
            state=state, engine=spec.engine, label=spec.label, simulated=spec.simulated,
            pid=self.engine_pid, pgid=self.pgid, keeper_pid=self.keeper_pid, port=spec.port, base_url=spec.base_url,
            binding=b.summary() if b else None, log_path=str(log_path),
            started_at=self.started_at, ready_at=self.ready_at,
            argv=self.shown_argv(), owner="panel", message=message, last_failure=last_failure,
            key_matches=(spec.api_key == api_key) if api_key else None,
            binding_note=b.note if b else None, plan_path=spec.files.get("plan"), spec=spec,
            started_by=self.started_by or started_by, keeper_start=self.keeper_ctime)
