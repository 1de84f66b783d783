"""The supervisor's files in the data dir: the state file, the exit file, the stop request and the start lock.

- **state file** (``engine-state.json``, atomic, 0600): pid and start time of the engine and of its keeper, pgid,
  port, engine, the masked command line, the binding, a fingerprint of the key (never the key). It is read only as
  a typed :class:`~engine_manager.engine_state.EngineRecord`; a bad one (wrong types, not JSON, a symbolic link) is
  moved aside and the next status/start/stop says so (:meth:`StateFiles.pop_notes`).
- **exit file**: how the keeper's child ended (written by :mod:`engine_manager.keeper`).
- **stop request** (``engine-stop-request.json``): a stop beats a start in flight in another process — the
  starting supervisor checks it while it waits, at the engine's exit and before any restart.
- **start lock** (``engine.lock``): one start at a time; it holds the starting process's pid.

Files are read without following symbolic links. This module never imports Qt.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from .atomic import (
    LinkRefused,
    atomic_write_json,
    ensure_private_dir,
    move_aside,
    open_append_nofollow,
    read_bytes_nofollow,
)
from .engine_state import (
    EXIT_FILE,
    LOCK_FILE,
    STATE_FILE,
    STATE_SCHEMA,
    STOP_FILE,
    STOPPED,
    ExitInfo,
)
from .engine_record import EngineRecord, why_invalid
from .procs import BOOT_ID, boot_clock


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from ``path`` (never through a symbolic link; at most 16 MiB); None when there is none."""
    try:
        d = json.loads(read_bytes_nofollow(path, 16 * 2**20).decode("utf-8"))
        return d if isinstance(d, dict) else None
    except (OSError, ValueError, RecursionError):
        return None


def signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


class StateFiles:
    """One supervisor's view of the files in ``data_dir``. ``token`` names that supervisor in the stop requests it
    writes, so that its own request is never taken for one from elsewhere."""

    def __init__(self, data_dir: Path, token: str) -> None:
        self.data_dir = data_dir
        self.token = token
        self._notes: list[str] = []         # a bad state file moved aside: said once, by whoever asks next
        self._stop_file_seen: tuple | None = None
        self._stop_file_req: dict[str, Any] | None = None

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

    # -- the state file ----------------------------------------------------------------------------------------
    def read_state(self) -> EngineRecord | None:
        """The state file's record, validated (:class:`EngineRecord`); None when there is none. A bad one (not
        JSON, wrong types, a symbolic link) is moved aside and a note says so (:meth:`pop_notes`)."""
        path = self.state_path
        try:
            raw = read_bytes_nofollow(path, 16 * 2**20)
        except FileNotFoundError:
            return None
        except LinkRefused:
            why = "it is a symbolic link, which the panel never follows"
        except OSError as exc:
            self.note(f"The engine state file {path} cannot be read ({exc.strerror or exc}); the panel goes "
                      f"on as if no engine were recorded. Fix its permissions or remove it.")
            return None
        else:
            try:
                return EngineRecord.from_json(raw)
            except ValueError as exc:     # pydantic's ValidationError is one
                why = why_invalid(exc)
        try:
            where = f"moved aside to {move_aside(path, 'bad')}"
        except OSError as exc:
            where = f"and could not be moved aside ({exc.strerror or exc}); remove it"
        self.note(f"The engine state file {path} was not valid ({why}); it was {where}. The panel went on "
                  f"as if no engine were recorded: if one still runs, `dsv41 status` shows what holds "
                  f"the port.")
        return None

    def note(self, text: str) -> None:
        if text not in self._notes:
            self._notes.append(text)

    def pop_notes(self) -> list[str]:
        """What went wrong with the state file since the last call (each said once)."""
        notes, self._notes = self._notes, []
        return notes

    def write_state(self, rec: dict[str, Any]) -> None:
        atomic_write_json(self.state_path, rec)

    def write_bare(self, state: str, **extra: Any) -> None:
        """A record of no process (the engine stopped, crashed, or never started), with ``extra`` fields."""
        self.write_state({"schema": STATE_SCHEMA, "state": state, "updated_at": time.time(), **extra})

    def mark_state(self, **updates: Any) -> None:
        """Update fields of the record on disk (when there is a valid one)."""
        rec = self.read_state()
        if rec is None:
            return
        d = rec.to_json_dict()
        d.update(updates, updated_at=time.time())
        atomic_write_json(self.state_path, d)

    def record_start_failure(self, cause: str, message: str, fix: str, tail: list[str], log_path: Path) -> None:
        """A start that failed before an engine ran (a refused pack, a missing release, a taken port) is what
        ``dsv41 status`` and ``dsv41 logs`` show next — never an earlier run's failure. Written only when no engine
        of this panel runs (its record must stay), as a stopped record carrying ``last_failure`` of kind
        ``start_failed``, and as two lines at the end of the engine log."""
        rec = self.read_state()
        if rec is not None and rec.keeper_pid and rec.alive():
            return
        failure = {"kind": "start_failed", "cause": cause, "title": message, "fix": fix, "returncode": None,
                   "signal": None, "log_tail": list(tail[-20:])}
        try:
            self.write_bare(STOPPED, message=f"The last start failed: {message}", last_failure=failure)
        except OSError:
            pass
        try:
            with os.fdopen(open_append_nofollow(log_path), "ab") as f:
                f.write((f"[dsv41 {time.strftime('%Y-%m-%d %H:%M:%S')}] start failed ({cause}): {message}\n"
                         f"[dsv41] what to do: {fix}\n").encode("utf-8", "replace"))
        except OSError:
            pass

    # -- the exit file ---------------------------------------------------------------------------------------
    def read_exit(self, keeper_pid: int | None) -> ExitInfo | None:
        """How the engine the keeper ``keeper_pid`` ran ended, from the keeper's exit file (None: not recorded)."""
        d = read_json(self.exit_path)
        if d is None or (keeper_pid is not None and d.get("keeper_pid") != keeper_pid):
            return None
        if not all(d.get(k) is None or type(d.get(k)) is int for k in ("returncode", "signal")):
            return None
        return ExitInfo(d.get("returncode"), d.get("signal"), d.get("signal_name"), "exit-file")

    def exit_info(self, keeper_pid: int, keeper_returncode: int | None) -> ExitInfo:
        """The exit file's record, else what the keeper's own exit status says."""
        info = self.read_exit(keeper_pid)
        if info is not None:
            return info
        rc = keeper_returncode
        if rc is None:
            return ExitInfo(None, None, None, "unknown")
        if rc == -signal.SIGKILL:      # keeper and engine killed together (e.g. a cgroup OOM kill of the group)
            return ExitInfo(-9, 9, "SIGKILL", "keeper")
        if rc < 0:
            return ExitInfo(None, None, None, "keeper", keeper_killed=True)
        if rc > 128:
            return ExitInfo(-(rc - 128), rc - 128, signame(rc - 128), "keeper")
        return ExitInfo(rc, None, None, "keeper")

    def clear_exit(self) -> None:
        try:
            self.exit_path.unlink()
        except FileNotFoundError:
            pass

    # -- stop requests from another process (a `dsv41 stop` while another one starts the engine) -------------
    def write_stop_request(self) -> None:
        try:
            ensure_private_dir(self.data_dir)
            atomic_write_json(self.stop_request_path, {"by_pid": os.getpid(), "by": self.token, "at": time.time(),
                                                       "boot_id": BOOT_ID, "at_boot": boot_clock()})
        except OSError:
            pass        # the stop itself goes on; only a start in flight elsewhere would miss it

    def stop_requested(self, since: float, since_boot: float | None = None) -> dict[str, Any] | None:
        """A stop request written (by another supervisor, usually another process) at or after ``since`` (when
        this one's run/watch began; ``since_boot``: the same moment on the boot clock, ``procs.boot_clock``): a
        start in flight must obey it rather than report the engine's end as a crash and restart it. Both moments
        of a request written during this boot are compared on the boot clock, which no clock step moves."""
        try:
            st = os.stat(self.stop_request_path, follow_symlinks=False)
        except OSError:
            return None
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key != self._stop_file_seen:
            self._stop_file_seen = key
            self._stop_file_req = read_json(self.stop_request_path)
        req = self._stop_file_req
        if not req or req.get("by") == self.token:
            return None
        at, at_boot = req.get("at"), req.get("at_boot")
        if (since_boot is not None and BOOT_ID is not None and req.get("boot_id") == BOOT_ID
                and isinstance(at_boot, (int, float)) and not isinstance(at_boot, bool)):
            return req if at_boot >= since_boot else None
        return req if isinstance(at, (int, float)) and at >= since else None

    # -- the start lock ----------------------------------------------------------------------------------------
    @contextmanager
    def start_lock(self) -> Iterator[bool]:
        """Hold the start lock while the block runs (True), or say another dsv41 holds it (False). The holder's
        pid is written into it, so that a `dsv41 stop` meanwhile names it."""
        with os.fdopen(os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600), "r+") as lockf:
            try:
                fcntl.flock(lockf, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            try:
                lockf.seek(0)
                lockf.truncate()
                lockf.write(f"{os.getpid()}\n")
                lockf.flush()
            except OSError:
                pass
            yield True

    def await_start(self, timeout_s: float, poll_s: float) -> tuple[str | None, EngineRecord | None]:
        """Wait up to ``timeout_s`` for the start in progress elsewhere to end (or to have started its engine:
        that one is stopped here). Returns who still holds the start lock (None: nobody) and the record then."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end and self.start_in_flight() is not None:
            rec = self.read_state()
            if rec and rec.keeper_pid and rec.alive():
                break               # it has started the engine meanwhile
            time.sleep(poll_s)
        rec = self.read_state()
        return self.start_in_flight(), rec

    def start_in_flight(self) -> str | None:
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
