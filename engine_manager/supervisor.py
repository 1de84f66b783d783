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
- **stop**: SIGTERM to the whole group, a grace period, then SIGKILL — and it checks that no process of the group
  (nor any descendant that left it) is left. A stop beats a start in flight in another process: it leaves a stop
  request (``engine-stop-request.json``) that the starting supervisor checks while it waits, at the engine's exit
  and before any restart, so that start ends "stopped by request" instead of reporting a crash and restarting.
- **crash causes** are read from *this run's* log lines only (each start writes ``[dsv41 …] run ID: starting …``;
  the state file names the run) and its exit status — never from an earlier run's lines in the same log.
- **files**: the state file is validated as a typed record (:class:`StateRecord`); a bad one (wrong types, not
  JSON, a symbolic link) is moved aside and the next status/start/stop says so. The log and the state file are
  opened without following symbolic links.
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

Everything long is a generator yielding typed events (dataclasses below): the CLI prints them, the GUI turns them
into signals through ``app.workers``, tests assert on them. Thread model: one generator (``run``/``watch``) owns
the engine; ``stop()`` may run from another thread and the owning generator then returns quietly.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator

import httpx
import psutil

from . import paths
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .atomic import LinkRefused, atomic_write_json, ensure_private_dir, move_aside, open_append_nofollow, read_bytes_nofollow
from .engines import get_engine
from .engines.base import Engine, FailureHint, LaunchSpec, LogEvent
from .numa import Binding, choose_binding

# -- states ------------------------------------------------------------------------------------------------

STOPPED, STARTING, READY, STOPPING, CRASHED, RESTARTING = (
    "stopped", "starting", "ready", "stopping", "crashed", "restarting")
STATES = (STOPPED, STARTING, READY, STOPPING, CRASHED, RESTARTING)
RUNNING_STATES = (STARTING, READY, STOPPING, RESTARTING)

STATE_FILE = "engine-state.json"
EXIT_FILE = "engine-exit.json"
LOCK_FILE = "engine.lock"
STOP_FILE = "engine-stop-request.json"   # `dsv41 stop` leaves it: a start in flight (another process) obeys it
LOG_NAME = "engine.log"
STATE_SCHEMA = 1
KEEPER = Path(__file__).with_name("keeper.py")
from .frozen import module_argv  # noqa: E402  the keeper's command line, also in the one-folder bundle

#: how the messages name each engine
ENGINE_WORDS = {"sim": "the scripted engine (simulated)", "strata": "Strata", "llamacpp": "llama.cpp"}


def engine_words(name: str | None, capital: bool = False) -> str:
    w = ENGINE_WORDS.get(name or "", name or "an engine")
    return w[:1].upper() + w[1:] if capital else w


#: causes that another try cannot fix by itself: no auto-restart for these
PERMANENT_CAUSES = {"port_in_use", "driver_too_old", "placement_refused", "bad_arguments", "bad_engine_flag",
                    "model_missing", "spawn_failed"}


# -- events --------------------------------------------------------------------------------------------------

@dataclass
class Event:
    kind: ClassVar[str] = "event"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["kind"] = self.kind
        return d


@dataclass
class StateChanged(Event):
    """The supervisor's state changed. ``message`` says why in plain words."""
    kind: ClassVar[str] = "state"
    state: str
    previous: str
    message: str = ""
    engine: str | None = None
    pid: int | None = None
    t: float = field(default_factory=time.time)


@dataclass
class Note(Event):
    """Something the user should read (the binding chosen, the default plan, a warning)."""
    kind: ClassVar[str] = "note"
    text: str
    level: str = "info"          # info | warning
    t: float = field(default_factory=time.time)


@dataclass
class Progress(Event):
    """Readiness wait: elapsed time and the phase the engine's log says it is in."""
    kind: ClassVar[str] = "progress"
    elapsed_s: float
    timeout_s: float
    phase: str = ""
    fraction: float | None = None        # 0..1 when the engine's log gives one
    eta_s: float | None = None
    last_output_age_s: float | None = None
    pid: int | None = None
    t: float = field(default_factory=time.time)


@dataclass
class LogLines(Event):
    """New lines of the engine log (batched), and what the engine adapter read in them."""
    kind: ClassVar[str] = "log"
    lines: list[str]
    events: list[LogEvent] = field(default_factory=list)
    t: float = field(default_factory=time.time)


@dataclass
class Ready(Event):
    kind: ClassVar[str] = "ready"
    base_url: str
    elapsed_s: float
    engine: str
    pid: int | None
    simulated: bool = False
    attached: bool = False
    t: float = field(default_factory=time.time)


@dataclass
class Crashed(Event):
    """The engine ended without being asked to: the cause in plain words, the fix, and what happens next."""
    kind: ClassVar[str] = "crashed"
    cause: str
    title: str
    fix: str
    returncode: int | None
    signal: int | None
    log_tail: list[str]
    while_starting: bool = False
    will_restart: bool = False
    restart_in_s: float | None = None
    crashes_in_window: int = 1
    t: float = field(default_factory=time.time)

    def hint(self) -> FailureHint:
        return FailureHint(self.cause, self.title, self.fix)


@dataclass
class Restarting(Event):
    kind: ClassVar[str] = "restarting"
    attempt: int
    delay_s: float
    remaining_s: float
    t: float = field(default_factory=time.time)


@dataclass
class GaveUp(Event):
    """Auto-restart stopped (crash loop, or a cause a restart cannot fix)."""
    kind: ClassVar[str] = "gave_up"
    message: str
    cause: str
    fix: str
    t: float = field(default_factory=time.time)


@dataclass
class StartFailed(Event):
    """Start refused or did not reach ready (port taken, placement refused, timeout, already running elsewhere)."""
    kind: ClassVar[str] = "failed"
    cause: str
    message: str
    fix: str
    log_tail: list[str] = field(default_factory=list)
    t: float = field(default_factory=time.time)


@dataclass
class Stopping(Event):
    kind: ClassVar[str] = "stopping"
    elapsed_s: float
    grace_s: float
    signal_name: str
    remaining: int                      # processes of the group still alive
    t: float = field(default_factory=time.time)


@dataclass
class Stopped(Event):
    kind: ClassVar[str] = "stopped"
    message: str
    forced: bool = False
    leftovers: list[int] = field(default_factory=list)
    t: float = field(default_factory=time.time)


@dataclass
class Attached(Event):
    """A new panel found the engine a previous one started, alive and matching."""
    kind: ClassVar[str] = "attached"
    pid: int
    engine: str
    state: str
    message: str
    t: float = field(default_factory=time.time)


# -- status --------------------------------------------------------------------------------------------------

@dataclass
class EngineStatus:
    state: str
    engine: str | None = None
    label: str = ""
    simulated: bool = False
    pid: int | None = None               # the engine process (the binding prefix execs into it)
    pgid: int | None = None              # its process group (the keeper leads it)
    keeper_pid: int | None = None
    port: int | None = None
    base_url: str | None = None
    binding: str | None = None           # one-line summary of the binding
    log_path: str = ""
    started_at: float | None = None
    ready_at: float | None = None
    argv: list[str] = field(default_factory=list)   # masked
    owner: str | None = None             # "panel" (started by dsv41) or None
    message: str = ""
    last_failure: dict[str, Any] | None = None
    external: dict[str, Any] | None = None   # something the panel did not start, on the port
    key_matches: bool | None = None
    binding_note: str | None = None      # e.g. one NUMA node: binding cannot change speed
    plan_path: str | None = None         # the plan the engine was started with (JSON), when it had one
    spec: LaunchSpec | None = None

    def plan(self) -> dict[str, Any] | None:
        """The plan the engine runs with, read from ``plan_path`` (None when there is none or it is unreadable)."""
        if not self.plan_path:
            return None
        try:
            d = json.loads(Path(self.plan_path).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return d if isinstance(d, dict) else None

    @property
    def running(self) -> bool:
        return self.state in RUNNING_STATES

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("spec", None)
        d["running"] = self.running
        d["uptime_s"] = round(time.time() - self.started_at, 1) if self.started_at and self.running else None
        return d


@dataclass
class ExitInfo:
    returncode: int | None               # the engine's: negative = killed by that signal
    signal: int | None
    signal_name: str | None = None
    source: str = "unknown"              # exit-file | keeper | unknown
    silent_s: float | None = None        # set when the panel stopped it for not answering
    keeper_killed: bool = False

    def words(self) -> str:
        if self.signal:
            return f"killed by signal {self.signal} ({self.signal_name or signal.Signals(self.signal).name})"
        if self.returncode is None:
            return "exit status unknown"
        return f"exit code {self.returncode}"


# -- crash classification -----------------------------------------------------------------------------------

def _oom_hint() -> FailureHint:
    return FailureHint(
        "oom_killed",
        "The engine was killed by SIGKILL — most likely by the kernel's out-of-memory killer (the host ran out of "
        "RAM).",
        "Check with `journalctl -k --since '15 min ago' | grep -i -E 'out of memory|killed process'` (or "
        "`sudo dmesg -T | grep -i -E 'oom|killed process'`). If it was the OOM killer: close other programs, lower "
        "slots or context_length, or re-plan so fewer experts are held in RAM; `dsv41 doctor` shows the RAM the "
        "model needs.")


GENERIC_PATTERNS: list[tuple[re.Pattern[str], FailureHint]] = [
    (re.compile(r"address already in use|EADDRINUSE|errno 98\b|port \d+ (?:is )?(?:already )?in use", re.I),
     FailureHint("port_in_use", "The engine could not open its port: another program is using it.",
                 "Stop the other program (`ss -ltnp` shows who holds the port), or choose another port with "
                 "`dsv41 settings set port <N>` (DSV41_PORT).")),
    (re.compile(r"driver version is insufficient|insufficient ?driver|cudaErrorInsufficientDriver|"
                r"driver (?:is )?too old|requires (?:an )?(?:nvidia )?driver", re.I),
     FailureHint("driver_too_old", "The NVIDIA driver is too old for this engine (it needs 580.65 or newer, "
                 "CUDA 13).",
                 "Update the NVIDIA driver to 580.65 or newer and reboot; `nvidia-smi` shows the installed "
                 "version.")),
    (re.compile(r"CUDA out of memory|cudaMalloc\w* failed|cudaErrorMemoryAllocation|CUDA error: out of memory|"
                r"out of (?:device|GPU|VRAM) memory|failed to allocate .*(?:CUDA|VRAM|device)", re.I),
     FailureHint("cuda_oom", "The GPU ran out of memory (CUDA out of memory / cudaMalloc failed).",
                 "Keep fewer experts in VRAM: raise vram_reserve_mib, lower slots or context_length, or re-plan "
                 "(Placement tab / `dsv41 plan`); close other programs using the GPU (`nvidia-smi` lists them).")),
    (re.compile(r"placement (?:was )?refused|plan (?:was )?refused|refus\w* (?:the )?(?:plan|placement|expert "
                r"profile)|profile .*(?:does not match|mismatch)", re.I),
     FailureHint("placement_refused", "The engine refused the placement: the plan or expert profile does not fit "
                 "this model or GPU.",
                 "Re-plan on the Placement tab (or `dsv41 plan`) and start again; check that the expert profile was "
                 "made for this model.")),
    (re.compile(r"unrecognized arguments|error: argument|usage: .*\n?.*error:", re.I),
     FailureHint("bad_arguments", "The engine refused its command line (an option it does not know).",
                 "The engine release may not match this panel: update it (`dsv41 download engine`) or choose "
                 "another engine.")),
    (re.compile(r"std::bad_alloc|MemoryError|Cannot allocate memory|ENOMEM", re.I),
     FailureHint("ram_oom", "The engine could not allocate host memory (RAM).",
                 "Free RAM (close other programs), lower slots or context_length, or re-plan so fewer experts are "
                 "held in RAM.")),
]


def classify_exit(engine: Engine | None, exit: ExitInfo, log_tail: list[str]) -> FailureHint:
    """The cause of an exit in plain words with a fix. The engine's own signatures are consulted first."""
    tail = list(log_tail)[-200:]
    if exit.silent_s is not None:
        return FailureHint(
            "engine_silent",
            f"The engine stopped answering: no reply to its health check for {exit.silent_s:.0f} s while its "
            "process was still alive (hung), so the panel stopped it.",
            "Look at the last log lines; if it hangs again, lower the load (slots) or report the log. "
            "Auto-restart (when on) starts it again.")
    if exit.keeper_killed:
        return FailureHint(
            "keeper_killed",
            "The engine's keeper process (which writes its log) was killed, so the engine was stopped with it.",
            "Start it again; if this repeats, check what kills processes on this machine "
            "(`journalctl -k | grep -i killed`).")
    engine_lines = [ln for ln in tail if not ln.startswith("[dsv41")]
    if engine is not None:
        try:
            hint = engine.classify_failure(exit.returncode, engine_lines)
        except Exception:  # an adapter bug must not hide the crash itself
            hint = None
        if hint is not None:
            return hint
    if exit.signal == signal.SIGKILL:
        return _oom_hint()
    for line in reversed(engine_lines):
        for pat, hint in GENERIC_PATTERNS:
            if pat.search(line):
                return hint
    last = "\n".join(engine_lines[-20:]) or "(the log is empty)"
    what = exit.words()
    if exit.signal == signal.SIGSEGV:
        title = "The engine crashed (segmentation fault)."
    elif exit.signal == signal.SIGABRT:
        title = "The engine aborted (SIGABRT: an internal check failed)."
    elif exit.returncode == 0:
        title = "The engine exited on its own (exit code 0) without being asked to stop."
    else:
        title = f"The engine exited unexpectedly ({what})."
    return FailureHint("unknown", title,
                       f"The last lines of its log say:\n{last}\n\nThe whole log: `dsv41 logs` or the Log tab.")


# -- the state file as a typed record ------------------------------------------------------------------------

class StateRecord(BaseModel):
    """The state file (``engine-state.json``) as the supervisor writes it: every field it reads, with its type.
    A file that does not fit (``{"keeper_pid": "1x"}``, a list, half a record) is moved aside, never half-used."""

    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)

    schema_version: int | None = Field(None, alias="schema")
    owner: str | None = None
    state: str | None = None
    updated_at: float | int | None = None
    engine: str | None = None
    label: str | None = None
    simulated: bool | None = None
    pid: int | None = Field(None, gt=0)
    pid_start_time: float | int | None = None
    keeper_pid: int | None = Field(None, gt=0)
    keeper_start_time: float | int | None = None
    pgid: int | None = Field(None, gt=0)
    host: str | None = None
    port: int | None = Field(None, ge=0, le=65535)
    base_url: str | None = None
    health_path: str | None = None
    argv: list[str] | None = None
    env: dict[str, str] | None = None
    files: dict[str, str] | None = None
    cwd: str | None = None
    binding: dict[str, Any] | None = None
    log_path: str | None = None
    exit_file: str | None = None
    started_at: float | int | None = None
    ready_at: float | int | None = None
    supervisor_pid: int | None = None
    key_fingerprint: str | None = None
    message: str | None = None
    last_failure: dict[str, Any] | None = None
    stop_requested: dict[str, Any] | bool | None = None
    run_id: str | None = None

    @model_validator(mode="after")
    def _keeper_needs_its_start_time(self) -> "StateRecord":
        if self.keeper_pid is not None and self.keeper_start_time is None:
            raise ValueError("keeper_pid without keeper_start_time")
        return self


def _why_invalid(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        parts = []
        for e in exc.errors()[:3]:
            where = ".".join(str(x) for x in e.get("loc", ())) or "the record"
            parts.append(f"{where}: {e.get('msg')}" + (f" (got {e['input']!r:.40})" if "input" in e and
                                                      not isinstance(e["input"], dict) else ""))
        return "; ".join(parts)
    return str(exc)


RUN_MARK = re.compile(r"^\[dsv41 [^\]]*\] (?:run (?P<run>\S+): )?starting ")


def run_lines(lines: list[str], run_id: str | None) -> list[str]:
    """The lines of one run of the engine in the log: after its start line (``[dsv41 …] run ID: starting …``)
    and before the next run's. Without its start line in view (rotated away, or an older record without a run
    id): everything after the last start line that is not some other run's. Crash causes are read from these
    only, never from an earlier run's lines."""
    marks = [(i, m.group("run")) for i, ln in enumerate(lines) if (m := RUN_MARK.match(ln))]
    mine = [i for i, r in marks if run_id is not None and r == run_id]
    if mine:
        start = mine[-1] + 1
        later = [i for i, _ in marks if i >= start]
        return lines[start:later[0] if later else len(lines)]
    if run_id is not None and marks:             # ours rotated away: what comes before the next run is ours
        return lines[:marks[0][0]]
    return lines[marks[-1][0] + 1:] if marks else list(lines)


# -- small process helpers ------------------------------------------------------------------------------------

def _ctime(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None


def _alive(pid: int | None, ctime: float | None = None) -> bool:
    """True when ``pid`` runs (not a zombie) and, if given, started at ``ctime`` (not a reused pid)."""
    if not pid:
        return False
    try:
        p = psutil.Process(pid)
        if ctime is not None and abs(p.create_time() - ctime) > 0.05:
            return False
        return p.status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, OSError):
        return False


def group_members(pgid: int, since: float | None = None) -> list[psutil.Process]:
    """Live (non-zombie) processes whose process group is ``pgid`` (started at/after ``since``, the group
    leader's start time).

    Safe against a reused number: Linux never hands out a pid that is still some group's id, so while any member of
    our old group lives, ``pgid`` cannot be a newer group. A *live* process with pid ``pgid`` that started at
    another time than ``since`` therefore leads a different group: nothing is returned for it."""
    if since is not None:
        try:
            leader = psutil.Process(pgid)
            if abs(leader.create_time() - since) > 0.05:
                return []
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            pass
        except (psutil.Error, OSError):
            return []
    out: list[psutil.Process] = []
    for p in psutil.process_iter(["create_time", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if since is not None and p.info["create_time"] < since - 0.05:
                continue
            if os.getpgid(p.pid) == pgid:
                out.append(p)
        except (ProcessLookupError, PermissionError, psutil.Error, OSError):
            continue
    return out


def record_alive(rec: dict[str, Any] | None) -> bool:
    """The state file's engine runs: keeper and engine both alive with their recorded start times."""
    if not rec or not rec.get("keeper_pid"):
        return False
    if not _alive(rec.get("keeper_pid"), rec.get("keeper_start_time")):
        return False
    return rec.get("pid") is None or _alive(rec.get("pid"), rec.get("pid_start_time"))


def _live(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (psutil.Error, OSError):
            continue
    return out


def _mask_cmdline(cmd: list[str]) -> list[str]:
    out: list[str] = []
    hide = False
    for a in cmd:
        if hide:
            out.append(a[:4] + "…(masked)")
            hide = False
            continue
        if a in ("--api-key", "--api_key", "-k", "--token", "--hf-token"):
            hide = True
        elif re.match(r"--(api[-_]key|token|hf[-_]token)=", a):
            k, _, v = a.partition("=")
            a = f"{k}={v[:4]}…(masked)"
        out.append(a)
    return out


def port_owner(host: str, port: int) -> dict[str, Any] | None:
    """Who listens on ``port`` (TCP): pid, name, masked command line, user; ``pid`` None when the OS hides it."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        conns = []
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port:
            info: dict[str, Any] = {"pid": c.pid, "address": f"{c.laddr.ip}:{c.laddr.port}"}
            if c.pid:
                try:
                    p = psutil.Process(c.pid)
                    info.update(name=p.name(), cmdline=_mask_cmdline(p.cmdline()), user=p.username(),
                                create_time=p.create_time())
                except (psutil.Error, OSError):
                    pass
            return info
    return None


def describe_owner(info: dict[str, Any] | None) -> str:
    if not info:
        return "another program (the system does not say which)"
    if not info.get("pid"):
        return ("a process of another user (run `sudo ss -ltnp` to see which)")
    cmd = " ".join(info.get("cmdline") or [])
    if len(cmd) > 160:                  # cut between words (never inside a masked key), and say it was cut
        cmd = cmd[:160].rsplit(" ", 1)[0] + " …"
    return f"pid {info['pid']} ({info.get('name', '?')}{': ' + cmd if cmd else ''})"


def port_free(host: str, port: int) -> bool:
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def suggest_port(host: str, port: int) -> int | None:
    for p in range(port + 1, min(port + 50, 65535)):
        if port_free(host, p):
            return p
    return None


def key_fingerprint(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:12] if key else ""


# -- the log -----------------------------------------------------------------------------------------------------

class LogTail:
    """Follow the engine log across the keeper's rotations (``engine.log`` → ``engine.log.1``)."""

    def __init__(self, path: Path, offset: int | None = None):
        self.path = Path(path)
        self._lock = threading.Lock()      # the owning generator and a stop() on another thread may both read
        self._f = None
        self._ino: int | None = None
        self._buf = b""
        self._open(offset)

    def _open(self, offset: int | None) -> None:
        try:
            f = os.fdopen(os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb")
        except OSError:             # missing, or a symbolic link (never followed)
            self._f, self._ino = None, None
            return
        st = os.fstat(f.fileno())
        if offset is None:
            offset = st.st_size
        f.seek(min(offset, st.st_size))
        self._f, self._ino = f, st.st_ino

    def read(self) -> list[str]:
        with self._lock:
            return self._read()

    def _read(self) -> list[str]:
        data = b""
        if self._f is None:
            self._open(0)
            if self._f is None:
                return []
        data += self._f.read()
        try:
            ino = os.stat(self.path).st_ino
        except FileNotFoundError:
            ino = None
        if ino is not None and ino != self._ino:       # rotated: finish the old file, continue in the new one
            data += self._f.read()
            self._f.close()
            # the file we read became engine.log.K; engine.log.K-1 … .1 were written after it, in that order
            newer: list[Path] = []
            for k in range(1, 1000):
                rotated = self.path.with_name(f"{self.path.name}.{k}")
                try:
                    if os.stat(rotated).st_ino == self._ino:
                        break
                except FileNotFoundError:
                    newer = []                          # ours was deleted already: the gap cannot be read
                    break
                newer.insert(0, rotated)
            for rotated in newer:
                try:
                    data += read_bytes_nofollow(rotated)
                except OSError:
                    pass
            self._open(0)
            if self._f is not None:
                data += self._f.read()
        if not data:
            return []
        self._buf += data
        if b"\n" not in self._buf:
            return []
        *lines, self._buf = self._buf.split(b"\n")
        return [ln.decode("utf-8", "replace").rstrip("\r") for ln in lines]

    def close(self) -> None:
        with self._lock:
            if self._f is not None:
                self._f.close()
                self._f = None


def log_path() -> Path:
    """The engine log (the keeper rotates it to ``engine.log.1`` … beside it)."""
    return paths.logs_dir() / LOG_NAME


def read_log_tail(path: Path | None = None, max_bytes: int = 2_000_000) -> list[str]:
    """The last ``max_bytes`` of the log (the newest rotated file first if the current one is short)."""
    path = Path(path) if path else log_path()
    chunks: list[bytes] = []
    need = max_bytes
    for p in (path, path.with_name(path.name + ".1")):
        try:
            with os.fdopen(os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                f.seek(max(0, size - need))
                data = f.read()
        except OSError:             # missing, or a symbolic link (never followed)
            continue
        chunks.insert(0, data)
        need -= len(data)
        if need <= 0:
            break
    text = b"".join(chunks).decode("utf-8", "replace")
    lines = text.splitlines()
    if chunks and len(b"".join(chunks)) >= max_bytes and lines:
        lines = lines[1:]        # first line was cut
    return lines


def running_conflict(rec: dict[str, Any], wanted: str) -> tuple[str, str]:
    """(message, fix) for a start of ``wanted`` while the engine in the state file ``rec`` (another one) runs."""
    running = engine_words(rec.get("engine"), True)
    where = f"on port {rec.get('port')}" + (f" ({rec['base_url']})" if rec.get("base_url") else "")
    msg = (f"{running} is already running {where}, pid {rec.get('pid')} (started by this panel or `dsv41 start`), "
           f"so {engine_words(wanted)} was not started.")
    fix = (f"Stop it first — `dsv41 stop` (or Stop in the panel) — then start {engine_words(wanted)}. Only one "
           f"engine runs at a time; starting {engine_words(rec.get('engine'))} again re-attaches to the running one.")
    return msg, fix


# -- plans ----------------------------------------------------------------------------------------------------------

def usable_plan(engine_name: str, plan: dict[str, Any] | None) -> dict[str, Any] | None:
    """The plan on screen (the Placement tab's), if ``engine_name`` should start with it; else None, and the start
    falls back to :func:`default_plan`. Never a refused plan; a real engine only one made for this machine (not
    for a hypothetical host); the scripted engine may model any host, that is what it is for."""
    if not plan or plan.get("refused"):
        return None
    if engine_name != "sim" and (plan.get("hardware") or {}).get("hypothetical"):
        return None
    return plan


def plan_host_warning(plan: dict[str, Any] | None, hardware: Any = None) -> str | None:
    """For a plan the user chose to start with (``dsv41 start --plan FILE``, the Placement tab's "Start with this
    plan"): a warning naming the host it was made for when that is not this machine (a hypothetical host, or
    another host name); None when it was made here."""
    if not plan:
        return None
    hwd = plan.get("hardware") or {}
    label = str(hwd.get("label") or "an unknown host")
    here = getattr(getattr(hardware, "host", None), "hostname", None)
    if not hwd.get("hypothetical") and here and f"({here})" in label:
        return None
    return (f"this plan was made for {label}, not for this machine" + (f" ({here})" if here else "")
            + "; starting with it as asked — the engine may not fit here.")


def default_plan(engine_name: str, settings: Any, hardware: Any = None) -> tuple[dict[str, Any] | None, list[str]]:
    """The plan to start ``engine_name`` with when the caller has none, and notes saying what was chosen.

    - the scripted engine: the reference placement (the guides' RTX PRO 6000, 280 GB RAM) on the replica layout of
      the model — what it models without a GPU;
    - strata / llama.cpp: the plan saved by the Placement tab or ``dsv41 plan`` for this machine, else a fresh plan
      for this machine from the model's headers (the planner refuses a host that cannot hold the model)."""
    notes: list[str] = []
    try:
        from . import placement
    except ImportError:
        notes.append("The placement planner is not available; the engine sizes its expert cache itself.")
        return None, notes
    try:
        if engine_name == "sim":
            from .sim.offload import expected_frequencies

            layout = placement.default_sim_layout()
            # The scripted engine's routing distribution is the truth of its simulated world, so the plan ranks
            # by it and its predicted hit rate is the expected one for that distribution (labelled simulated).
            pi = expected_frequencies(len(layout.moe_layers), layout.n_experts, layout.n_experts_used)
            p = placement.plan(layout, placement.reference_hardware(), pi, settings)
            d = p.to_dict()
            d["usage_note"] = "the scripted engine's own routing distribution (simulated)"
            rate = d.get("predicted_hit_rate")
            notes.append(f"The scripted engine (simulated) runs the reference placement — {d.get('hot_experts'):,} "
                         "hot experts in VRAM of the guides' 96 GB RTX PRO 6000 — on the replica layout of "
                         "DeepSeek-V4.1-Flash Q2_K" + (f"; predicted hit rate {rate:.1%} from its routing "
                                                       "distribution." if rate is not None else "."))
            return d, notes
        has_gpu = bool(hardware is not None and getattr(hardware, "has_gpu", False))
        if engine_name == "llamacpp" and not has_gpu:
            notes.append("No GPU here: llama.cpp runs every layer on the CPU, so there is no placement to plan.")
            return None, notes
        last = placement.load_last_plan()
        if last and not last.get("refused") and not (last.get("hardware") or {}).get("hypothetical"):
            made = last.get("created_at")
            when = time.strftime(" (made %Y-%m-%d %H:%M)", time.localtime(made)) if isinstance(made, (int, float)) \
                else ""
            notes.append(f"Using the plan saved by the Placement tab / `dsv41 plan`{when}.")
            return last, notes
        model = getattr(settings, "llamacpp_model", None) if engine_name == "llamacpp" else None
        req = placement.PlanRequest(host="this", save=False, model_path=str(model) if model else None)
        out = placement.make_plan(settings, req, hardware)
        notes.append(f"Planned for this machine from {out.model_source}.")
        return out.plan_dict, notes
    except Exception as exc:  # an unreadable model folder must not hide the engine's own, clearer error
        notes.append(f"Could not make a plan ({exc}); the engine sizes its expert cache itself.")
        return None, notes


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


@dataclass
class DryRun:
    engine: str
    label: str
    simulated: bool
    steps: list[tuple[str, list[str] | str, str]]   # (title, command or text, note)
    env: dict[str, str]
    files: dict[str, str]
    binding: Binding | None
    notes: list[str]
    refused: str | None = None      # the plan's refusal: a start would stop there (exit 3) and run nothing

    def render(self) -> str:
        name = self.label or self.engine
        if self.simulated and "simulated" not in name.lower():
            name += " (simulated)"
        out = [f"# dsv41 start --dry-run: {name}"]
        if self.refused:
            out.append("# REFUSED: the placement was refused, so a start would stop here (exit 3) and run none of "
                       "the commands below.")
            out.extend(f"#   {ln}" for ln in textwrap.wrap(self.refused, 110))
            out.extend(f"# {ln}" for ln in textwrap.wrap(
                "What to do: re-plan with settings this machine can hold (`dsv41 plan`, or the Placement tab), or "
                "use a machine that passes `dsv41 doctor`. Below: the commands a start would run with this plan.",
                112))
        for n in self.notes:
            out.append(f"# {n}")
        for i, (title, cmd, note) in enumerate(self.steps, 1):
            out.append("")
            out.append(f"# {i}. {title}")
            for ln in (note or "").splitlines():
                out.append(f"#    {ln}")
            if isinstance(cmd, list):
                out.append(shlex.join(cmd))
            elif cmd:
                out.append(cmd)
        if self.env:
            out.append("")
            out.append("# environment added to the engine's (secrets masked)")
            out.extend(f"export {k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        if self.files:
            out.append("")
            out.append("# generated files")
            out.extend(f"#   {role}: {p}" for role, p in sorted(self.files.items()))
        return "\n".join(out) + "\n"

    def to_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, "label": self.label, "simulated": self.simulated,
                "steps": [{"title": t, "command": c, "note": n} for t, c, n in self.steps],
                "env": self.env, "files": self.files, "notes": self.notes, "refused": self.refused,
                "binding": self.binding.to_dict() if self.binding else None}


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
                 ready_timeout_s: float | None = None):
        self.settings = settings
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
        except (OSError, ValueError):
            return None

    def _read_state_file(self) -> dict[str, Any] | None:
        """The state file's record, validated (:class:`StateRecord`); None when there is none. A bad one (not
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
                d = json.loads(raw.decode("utf-8"))
                if not isinstance(d, dict):
                    raise ValueError(f"it holds a JSON {type(d).__name__}, not a record")
                StateRecord.model_validate(d)
                return d
            except (ValueError, ValidationError) as exc:
                why = _why_invalid(exc)
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

    def _pop_state_notes(self) -> Iterator[Event]:
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

    def _stopped_by_request(self, h: _Handle | None, req: dict[str, Any]) -> Iterator[Event]:
        """Another `dsv41 stop` asked for the engine to stop while this supervisor starts (or restarts) it: it
        stops here too (the engine goes either way), says so, and nothing is restarted."""
        self._stop_req.set()
        who = req.get("by_pid")
        msg = f"stopped by request (`dsv41 stop`{f', pid {who}' if who else ''}); not restarted"
        if h is not None:
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
                "run_id": h.run_id,
            }
        rec.update(extra)
        atomic_write_json(self.state_path, rec)

    def _mark_state_file(self, **updates: Any) -> None:
        rec = self._read_state_file()
        if rec is None:
            return
        rec.update(updates, updated_at=time.time())
        atomic_write_json(self.state_path, rec)

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
        if rec and rec.get("keeper_pid"):
            alive = record_alive(rec)
            st = self._status_from_record(rec, alive)
            if alive:
                if check_health:
                    if self._health_ok_record(rec):
                        st.state, st.message = READY, "answering its health check"
                    elif rec.get("state") == READY:
                        st.message = "running, but not answering its health check right now"
                return st
        elif rec:
            st.state = rec.get("state") if rec.get("state") in (STOPPED, CRASHED) else STOPPED
            st.engine = rec.get("engine")
            st.last_failure = rec.get("last_failure")
            st.message = rec.get("message", "")
        if state in (STARTING, RESTARTING, CRASHED) and st.state != CRASHED:
            st.state, st.message = state, message
        if self.last_failure is not None and st.state in (CRASHED, RESTARTING):
            st.last_failure = self.last_failure.to_dict()
        if st.state == STOPPED:
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

    def _status_from_record(self, rec: dict[str, Any], alive: bool) -> EngineStatus:
        stopping = rec.get("state") == STOPPING or bool(rec.get("stop_requested"))
        st = EngineStatus(
            state=(rec.get("state") if rec.get("state") in RUNNING_STATES else STARTING) if alive
            else (STOPPED if stopping else CRASHED),
            engine=rec.get("engine"), label=rec.get("label", ""), simulated=bool(rec.get("simulated")),
            pid=rec.get("pid"), pgid=rec.get("pgid"), keeper_pid=rec.get("keeper_pid"), port=rec.get("port"),
            base_url=rec.get("base_url"),
            binding=(rec.get("binding") or {}).get("summary") if rec.get("binding") else None,
            log_path=rec.get("log_path", str(self.log_path)), started_at=rec.get("started_at"),
            ready_at=rec.get("ready_at"), argv=list(rec.get("argv") or []), owner="panel",
            key_matches=(rec.get("key_fingerprint") == key_fingerprint(self.settings.api_key))
            if rec.get("key_fingerprint") else None,
            plan_path=(rec.get("files") or {}).get("plan"),
            # the launch as recorded: its files (plan, routing trace) let a monitor started after a panel restart,
            # or `dsv41 monitor`, find what the command line does not show (Strata's trace flag sits in its config)
            spec=self._spec_from_record(rec) if alive else None,
        )
        if not alive and not stopping:
            ex, crash = self.explain_dead(rec)
            st.message = (f"The engine started earlier (pid {rec.get('pid')}) ended while no panel was watching "
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
            binding_note=h.binding.note if h.binding else None, plan_path=h.spec.files.get("plan"), spec=h.spec)

    def _health_ok_record(self, rec: dict[str, Any]) -> bool:
        try:
            eng = self.resolve_engine(rec.get("engine") or "sim")
            return eng.readiness(self.http(), self._spec_from_record(rec)).state == "ready"
        except Exception:
            return False

    def _spec_from_record(self, rec: dict[str, Any]) -> LaunchSpec:
        return LaunchSpec(engine=rec.get("engine") or "sim", argv=list(rec.get("argv") or []),
                          host=rec.get("host") or self.settings.host, port=int(rec.get("port") or 0),
                          api_key=self.settings.api_key, env={}, cwd=rec.get("cwd"),
                          health_path=rec.get("health_path") or "/health", files=dict(rec.get("files") or {}),
                          simulated=bool(rec.get("simulated")), label=rec.get("label") or "")

    # -- dry run -------------------------------------------------------------------------------------------------
    def dry_run(self, engine: str | Engine | None = None, plan: dict[str, Any] | None = None) -> DryRun:
        """Every command start would run on this machine, without starting anything (the binding probes do run:
        they are ``<prefix> true``). Generated files are written, so the printed command works as is."""
        eng = self._engine(engine)
        notes: list[str] = []
        if plan is None:
            plan, pnotes = self._default_plan(eng.name)
            notes.extend(pnotes)
        refused = plan.get("refused") if plan else None
        b = self.binding(refresh=True)
        workdir = self.runs_dir / eng.name
        ensure_private_dir(workdir)
        # A refused plan: the engines will not build a launch from it, but the dry run still shows every command
        # (built from the plan's terms as they are) under the refusal, which `dsv41 start` would stop at.
        spec = eng.build_launch(self.settings, {**plan, "refused": None} if refused else plan, workdir)
        if refused and spec.files.get("plan"):
            atomic_write_json(Path(spec.files["plan"]), plan)    # the file keeps the refusal: it never starts
        notes.extend(f"WARNING: {p}" for p in _preflight(eng, spec))
        own = self._own_running_record()
        if own is not None:
            if own.get("engine") == eng.name:
                notes.append(f"{engine_words(eng.name, True)} is already running (pid {own.get('pid')}, port "
                             f"{own.get('port')}): `dsv41 start` would re-attach to it instead of starting another.")
            else:
                msg, fix = running_conflict(own, eng.name)
                notes.insert(0, f"`dsv41 start` would refuse now: {msg} {fix}")
        steps: list[tuple[str, list[str] | str, str]] = []
        for a in b.attempts:
            steps.append((f"probe binding {a.strategy}", a.command,
                          "works here" if a.ok else f"refused here: {a.reason}"))
        if not b.attempts:
            steps.append(("binding", "", b.reason))
        if b.note:
            notes.append(b.note)
        free = port_free(spec.host, spec.port)
        if free:
            port_note = "free now"
        elif own is not None and own.get("port") == spec.port:
            port_note = (f"held now by the panel's own engine: {own.get('label') or engine_words(own.get('engine'))} "
                         f"(pid {own.get('pid')}, started by this panel or `dsv41 start`) — not a conflict: "
                         + ("a start re-attaches to it" if own.get("engine") == eng.name else
                            "stop it first (`dsv41 stop`) to start this engine"))
        else:
            port_note = f"IN USE now by {describe_owner(port_owner(spec.host, spec.port))}"
        steps.append((f"check that {spec.host}:{spec.port} is free", ["ss", "-ltnp", f"sport = :{spec.port}"],
                      port_note))
        keeper = module_argv("engine_manager.keeper", script=KEEPER) + ["--log", str(self.log_path), "--exit-file",
                  str(self.exit_path), "--max-bytes", str(self.log_max_bytes), "--backups", str(self.log_backups),
                  "--mask-stdin"] + (["--follow", spec.files["engine_log"]] if spec.files.get("engine_log") else []) \
            + ["--"]
        steps.append((f"start the engine in a new session and process group — binding: {b.summary()}",
                      keeper + spec.masked_argv(b.prefix),
                      f"working directory: {spec.cwd or os.getcwd()}\nthe keeper (first part) copies the engine's "
                      "output to the size-rotated log and records how it ended; the engine command follows `--`"))
        steps.append((f"wait until ready (up to {self.ready_timeout_s:.0f} s)",
                      ["curl", "-s", f"{spec.base_url}{spec.health_path}"], "connection refused = still loading"))
        steps.append((f"stop: SIGTERM to the group, {self.grace_s:.0f} s grace, then SIGKILL",
                      f"kill -TERM -<pgid>; sleep {self.grace_s:.0f}; kill -KILL -<pgid>", ""))
        return DryRun(eng.name, spec.label or eng.label, spec.simulated, steps, spec.masked_env(),
                      dict(spec.files), b, notes, refused)

    def _own_running_record(self) -> dict[str, Any] | None:
        """The state file's record when it names a live engine this panel (or `dsv41 start`) started."""
        with self._lock:
            h = self._handle
        rec = self._read_state_file()
        if rec and rec.get("keeper_pid") and (h is not None and h.keeper_pid == rec.get("keeper_pid")
                                              or record_alive(rec)):
            return rec
        return None

    # -- run / watch -----------------------------------------------------------------------------------------
    def run(self, engine: str | Engine | None = None, plan: dict[str, Any] | None = None, *,
            watch: bool = True) -> Iterator[Event]:
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

    def watch(self) -> Iterator[Event]:
        """Re-attach to the engine a previous panel (or ``dsv41 start``) started — when its pid and start time
        match; health decides ready or still starting — and supervise it like :meth:`run`. With the engine
        dead, clean up (kill stragglers of its group) and report how it ended."""
        self._reset_requests()
        self._since = time.time()
        h = yield from self._attach()
        if h is None:
            return self.status(check_health=False)
        outcome = "ready" if h.ready_at is not None else (yield from self._wait_ready(h))
        rec = self._read_state_file() or {}
        plan_file = (rec.get("files") or {}).get("plan")
        plan = self._read_json(Path(plan_file)) if plan_file else None   # for a restart: the plan it ran with
        return (yield from self._supervise(h.engine, plan, outcome))

    def _supervise(self, eng: Engine | None, plan: dict[str, Any] | None, outcome: Any,
                   watch: bool = True) -> Iterator[Event]:
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

    def _await_stop(self) -> Iterator[Event]:
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
    def _attach(self) -> Iterator[Event]:
        rec = self._read_state_file()
        yield from self._pop_state_notes()
        if not rec or not rec.get("keeper_pid"):
            if rec and rec.get("state") == CRASHED and isinstance(rec.get("last_failure"), dict):
                try:
                    crash = Crashed(**{k: v for k, v in rec["last_failure"].items() if k != "kind"})
                except TypeError:
                    crash = None
                if crash is not None:               # what happened last time stays visible until the next start
                    crash.will_restart, crash.restart_in_s = False, None
                    self.last_failure = crash
                    yield from _emit(self._set_state(CRASHED, rec.get("message", "")))
                    yield crash
            return None
        ok = record_alive(rec)
        try:
            eng = self.resolve_engine(rec.get("engine") or "sim")
        except Exception:
            eng = None
        if not ok or eng is None:
            yield from self._cleanup_dead(rec, eng)
            return None
        spec = self._spec_from_record(rec)
        binding = Binding.from_dict(rec["binding"]) if rec.get("binding") else None
        h = _Handle(eng, spec, binding, rec["keeper_pid"], rec["keeper_start_time"],
                    rec.get("pgid") or rec["keeper_pid"], rec.get("pid"), rec.get("pid_start_time"),
                    rec.get("started_at") or time.time(), attached=True,
                    argv_shown=list(rec.get("argv") or []), env_shown=dict(rec.get("env") or {}),
                    run_id=rec.get("run_id"))
        h.recent.extend(run_lines(read_log_tail(self.log_path, 64_000), h.run_id)[-200:])
        h.tail = LogTail(self.log_path, None)
        try:
            healthy = eng.readiness(self.http(), spec).state == "ready"
        except Exception:
            healthy = False
        with self._lock:
            self._handle = h
        if healthy:
            h.ready_at = rec.get("ready_at") or time.time()
            self._write_state_file(h, READY)
        msg = (f"Re-attached to the {spec.label or spec.engine} engine started earlier (pid {h.engine_pid}, "
               f"{'ready' if healthy else 'still starting'}).")
        yield Attached(h.engine_pid or h.keeper_pid, spec.engine, READY if healthy else STARTING, msg)
        if rec.get("key_fingerprint") and rec["key_fingerprint"] != key_fingerprint(self.settings.api_key):
            yield Note("The running engine was started with a different API key than the one in the settings now; "
                       "chat requests will be refused (401). Stop and start it to use the current key.", "warning")
        yield from _emit(self._set_state(READY if healthy else STARTING, msg))
        if healthy:
            yield Ready(spec.base_url, time.time() - h.started_at, spec.engine, h.engine_pid, spec.simulated,
                        attached=True)
        return h

    def _cleanup_dead(self, rec: dict[str, Any], eng: Engine | None) -> Iterator[Event]:
        """The state file names an engine that is gone: kill stragglers of its group, say how it ended."""
        pgid, since = rec.get("pgid"), rec.get("keeper_start_time")
        if pgid and since:
            left = group_members(int(pgid), since)
            for p in left:
                try:
                    p.kill()
                except (psutil.Error, OSError):
                    pass
            if left:
                psutil.wait_procs(left, timeout=3)
        if rec.get("state") == STOPPING or rec.get("stop_requested"):
            self._write_state_file(None, STOPPED, engine=rec.get("engine"), message="stopped")
            return
        ex, crash = self.explain_dead(rec, eng)
        self.last_failure = crash
        msg = (f"The engine started earlier (pid {rec.get('pid')}) ended while no panel was watching "
               f"({ex.words()}); cleaned up.")
        self._write_state_file(None, CRASHED, engine=rec.get("engine"), message=msg, last_failure=crash.to_dict())
        yield Note(msg, "warning")
        yield from _emit(self._set_state(CRASHED, msg))
        yield crash

    def explain_dead(self, rec: dict[str, Any], eng: Engine | None = None) -> tuple[ExitInfo, Crashed]:
        """How the engine a state file names ended, classified like a crash the panel watched (cause in plain words
        and the fix): the one code path behind a panel's clean-up, ``dsv41 stop`` and ``dsv41 status``."""
        if eng is None or eng.name != rec.get("engine"):
            try:
                eng = self.resolve_engine(rec.get("engine") or "sim")
            except Exception:  # an unknown engine name: the generic signatures still apply
                eng = None
        ex = self._read_exit_file(rec.get("keeper_pid")) or ExitInfo(None, None, None, "unknown")
        tail = run_lines(read_log_tail(self.log_path, 64_000), rec.get("run_id"))[-200:]
        hint = classify_exit(eng, ex, tail)
        return ex, Crashed(hint.cause, hint.title, hint.fix, ex.returncode, ex.signal,
                           [ln for ln in tail if not ln.startswith("[dsv41")][-20:])

    # -- start -------------------------------------------------------------------------------------------------
    def _start_once(self, eng: Engine, plan: dict[str, Any] | None, restart: bool = False) -> Iterator[Event]:
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
            if rec and rec.get("keeper_pid"):
                if record_alive(rec):
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
            rec = self._read_state_file() or {}
            if rec.get("engine") and rec.get("engine") != eng.name:
                # another engine: never attach to it as if it were the one asked for, never start a second one
                msg, fix = running_conflict(rec, eng.name)
                yield from self._fail("engine_running", msg, fix)
                return "failed"
            yield Note(f"{engine_words(eng.name, True)} is already running (pid {rec.get('pid')}, port "
                       f"{rec.get('port')}); attaching to it instead of starting another — starting the same "
                       "engine again re-attaches; `dsv41 stop` stops it.")
            h = yield from self._attach()
            if h is None:
                return "failed"
            if h.ready_at is not None:
                return "ready"
        return (yield from self._wait_ready(h))

    def _launch(self, eng: Engine, plan: dict[str, Any] | None, restart: bool) -> Iterator[Event]:
        host, port = self.settings.host, self.settings.port
        if not port_free(host, port):
            owner = port_owner(host, port)
            alt = suggest_port(host, port)
            yield from self._fail(
                "port_in_use", f"Port {port} is in use by {describe_owner(owner)}.",
                "Stop that program, or choose another port: "
                + (f"`dsv41 settings set port {alt}` (or DSV41_PORT={alt}); {alt} is free now."
                   if alt else "`dsv41 settings set port <N>` (or DSV41_PORT)."))
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

    def _prepare(self, eng: Engine, plan: dict[str, Any] | None) -> Iterator[Event]:
        """Run the engine's provisioning (``eng.prepare``: Strata's pack, :mod:`engine_manager.provision`) when
        it is needed, as Notes, Progress and LogLines. Returns False after a ``failed`` event."""
        from .errors import UserError

        gen = eng.prepare(self.settings, plan)
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
            yield from self._fail("prepare_failed", str(exc),
                                  "Fix what the message names, then start again (or run `dsv41 prepare`).")
            return False
        finally:
            gen.close()
        return True

    def _fail(self, cause: str, message: str, fix: str, tail: list[str] | None = None) -> Iterator[Event]:
        yield from _emit(self._set_state(STOPPED, message))
        yield StartFailed(cause, message, fix, tail or [])

    def _spawn(self, eng: Engine, spec: LaunchSpec, binding: Binding | None) -> Iterator[Event]:
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
        # environment: /proc/<pid>/environ stays readable for the keeper's whole life (issue 15 item 2)
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
        h = _Handle(eng, spec, binding, popen.pid, kctime, popen.pid, epid, ectime, started, popen, run_id=run_id)
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

    def _final_lines(self, h: _Handle) -> Iterator[Event]:
        time.sleep(0.02)                       # the keeper's last line lands right before it exits
        batch = self._drain(h)
        if batch is not None:
            yield batch

    def _wait_ready(self, h: _Handle) -> Iterator[Event]:
        timeout = self.ready_timeout_s
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
    def _watch_loop(self) -> Iterator[Event]:
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
        return bool(rec and (rec.get("stop_requested") or rec.get("state") in (STOPPING, STOPPED)))

    def _stopped_by_other(self, h: _Handle) -> Iterator[Event]:
        rec = self._read_state_file() or {}
        req = rec.get("stop_requested")
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
    def _after_crash(self, info: ExitInfo, eng: Engine | None) -> Iterator[Event]:
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

    def _reap_group(self, h: _Handle) -> Iterator[Event]:
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
    def stop(self, force: bool = False) -> Iterator[Event]:
        """SIGTERM to the engine's group, the grace period, then SIGKILL; checks that nothing of the group is
        left. ``force``: SIGKILL at once. Never touches a process the panel did not start."""
        self._stop_active.set()
        try:
            return (yield from self._stop(force))
        finally:
            self._stop_active.clear()

    def _stop(self, force: bool) -> Iterator[Event]:
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
            if not (rec and rec.get("keeper_pid") and record_alive(rec)):
                holder = self._start_in_flight()
                if holder is not None:
                    yield Note(f"A start is in progress ({holder}); it was asked to stop and stops by itself. "
                               "Waiting for it…")
                    end = time.monotonic() + self.grace_s + 15.0
                    while time.monotonic() < end and self._start_in_flight() is not None:
                        rec = self._read_state_file()
                        if rec and rec.get("keeper_pid") and record_alive(rec):
                            break               # it has started the engine meanwhile: stop that here
                        time.sleep(self.poll_s)
                    rec = self._read_state_file()
                    yield from self._pop_state_notes()
                    still = self._start_in_flight()
                    if still is not None and not (rec and rec.get("keeper_pid") and record_alive(rec)):
                        msg = (f"The start in progress ({still}) was asked to stop; it stops by itself before the "
                               "engine answers (it is still preparing). `dsv41 status` shows when it has.")
                        yield from _emit(self._set_state(STOPPED, msg))
                        yield Stopped(msg)
                        return self.status(check_health=False)
            if rec and rec.get("keeper_pid"):
                if record_alive(rec):
                    try:
                        eng = self.resolve_engine(rec.get("engine") or "sim")
                    except Exception:
                        eng = None
                    h = _Handle(eng, self._spec_from_record(rec), None, rec["keeper_pid"],
                                rec["keeper_start_time"], rec.get("pgid") or rec["keeper_pid"], rec.get("pid"),
                                rec.get("pid_start_time"), rec.get("started_at") or time.time(), attached=True)
                else:
                    yield from self._cleanup_dead(rec, None)
        if h is None:
            st = self.status(check_health=False)
            if st.external:
                yield Note(st.message + " Stop it where it was started.", "warning")
            msg = "Auto-restart cancelled; the engine is stopped." if was == RESTARTING else \
                "The engine is not running."
            yield from _emit(self._set_state(STOPPED, msg))
            yield Stopped(msg)
            return self.status(check_health=False)
        self._mark_state_file(state=STOPPING, stop_requested={"by_pid": os.getpid(), "at": time.time()})
        yield from _emit(self._set_state(STOPPING, "stopping" + (" (SIGKILL)" if force else "")))
        forced, leftovers = yield from self._terminate(h, grace=0.0 if force else self.grace_s)
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

    def _terminate(self, h: _Handle, grace: float, quiet: bool = False) -> Iterator[Event]:
        """SIGTERM the group (SIGKILL at once when ``grace`` is 0), wait, then SIGKILL; every descendant too,
        also one that left the group. Returns ``(forced, leftover pids)``."""
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


def _find_child(popen: subprocess.Popen, wait_s: float = 2.0) -> tuple[int | None, float | None]:
    """The keeper's child (the engine, after the binding prefix exec'd into it)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            kids = psutil.Process(popen.pid).children()
        except (psutil.Error, OSError):
            return None, None
        if kids:
            try:
                return kids[0].pid, kids[0].create_time()
            except (psutil.Error, OSError):
                return None, None
        if popen.poll() is not None:
            return None, None
        time.sleep(0.003)
    return None, None


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"
