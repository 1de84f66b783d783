"""The engine's state as values, below the supervisor: what every front end and the supervisor share.

- the states (``STOPPED`` … ``RESTARTING``) and the supervisor's file names in the data dir;
- :class:`RunningEngine` — the one handle for the engine that is ready: where it answers, its key, which engine,
  its process, launch spec, binding, log and plan; built with :meth:`RunningEngine.from_status` or from a URL
  and key alone (an engine reached with ``--url``), and handed around instead of loose ``(base_url, api_key)``;
- the state file (``engine-state.json``) typed is :class:`engine_manager.engine_record.EngineRecord` (pydantic:
  kept apart so that importing this module stays cheap);
- :class:`EngineStatus` — what :meth:`engine_manager.supervisor.Supervisor.status` says runs now;
- :class:`ExitInfo` — how the engine's process ended (the keeper's exit file, else the keeper's own status).

Only values: the supervisor (:mod:`engine_manager.supervisor`) imports this module, never the other way round.
This module never imports Qt.
"""

from __future__ import annotations

import json
import signal
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

# -- states ------------------------------------------------------------------------------------------------

STOPPED, STARTING, READY, STOPPING, CRASHED, RESTARTING = (
    "stopped", "starting", "ready", "stopping", "crashed", "restarting")
STATES = (STOPPED, STARTING, READY, STOPPING, CRASHED, RESTARTING)
RUNNING_STATES = (STARTING, READY, STOPPING, RESTARTING)

# -- the supervisor's files in the data dir (engine_manager.state_files) --------------------------------------

STATE_FILE = "engine-state.json"
EXIT_FILE = "engine-exit.json"
LOCK_FILE = "engine.lock"
STOP_FILE = "engine-stop-request.json"   # `dsv41 stop` leaves it: a start in flight (another process) obeys it
STATE_SCHEMA = 1

# -- the supervisor's crash-loop rule, by default: it gives up after this many crashes within this window ---------

CRASH_LIMIT = 5
CRASH_WINDOW_S = 600.0


# -- the one handle ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RunningEngine:
    base_url: str
    api_key: str = field(repr=False)          # never in a repr, a log or --json output
    engine: str = "sim"                       # engine name: "strata" | "llamacpp" | "sim" | ...
    label: str = ""                           # the engine's label for people
    simulated: bool = False                   # the scripted engine: its figures are labelled simulated
    pid: int | None = None
    spec: Any = field(default=None, repr=False)   # its LaunchSpec, when known (holds the key: never in a repr)
    binding: Any = None                       # the binding record (dict) or its one-line summary
    numa_bound: bool | None = None
    log_path: str | None = None
    argv: tuple[str, ...] | None = None       # masked
    gpu_index: int = 0
    plan: Mapping[str, Any] | None = None     # the plan the engine runs with, when known
    plan_path: str | None = None
    started_by_panel: bool = True             # False: attached to an engine the panel did not start (no Stop)
    on_this_machine: bool = True              # False: another box (SSH or a remote URL): no local GPU/RAM/CPU figures

    def __post_init__(self) -> None:
        object.__setattr__(self, "base_url", str(self.base_url).rstrip("/"))

    @classmethod
    def from_status(cls, status: Any, base_url: str, api_key: str, *, engine: Any = None, spec: Any = None,
                    gpu_index: int = 0, pid: int | None = None, binding: Any = None, log_path: str | None = None,
                    argv: list[str] | tuple[str, ...] | None = None, read_plan: bool = True) -> "RunningEngine":
        """The engine at ``base_url`` (reached with ``api_key``), completed from the supervisor's ``status``
        (:class:`EngineStatus`, or None) — only when that status is about the engine at ``base_url``: the
        supervisor may know another one than the one that is ready. What the caller knows (``engine`` — a name or
        an Engine, the default when the status does not say —, ``spec``, ``pid``, ``binding``, ``log_path``,
        ``argv``) is kept where the status says nothing. A launch ``spec`` of another address is dropped. The plan
        is the status's plan file, else the spec's (``read_plan=False``: no file is read — safe on a GUI thread;
        ``plan_path`` still names it). ``started_by_panel`` is True only when the status says the panel (or
        ``dsv41 start``) started it."""
        url = str(base_url).rstrip("/")
        st = status
        if st is not None and str(getattr(st, "base_url", None) or "").rstrip("/") != url:
            st = None
        plan_path = None
        if st is not None:                   # what the status says about this engine wins over the caller's guess
            engine = st.engine or engine
            pid = st.pid if st.pid is not None else pid
            binding = st.binding if st.binding is not None else binding
            log_path = st.log_path or log_path
            spec = st.spec if st.spec is not None else spec
            argv = st.argv or argv
            plan_path = st.plan_path
        name = getattr(engine, "name", engine) or "sim"
        if spec is not None and str(getattr(spec, "base_url", "")).rstrip("/") != url:
            spec = None
        if plan_path is None and spec is not None:
            plan_path = (getattr(spec, "files", None) or {}).get("plan")
        plan = read_plan_file(plan_path) if read_plan else None
        label, simulated = "", False
        try:
            from .engines import get_engine

            eng = get_engine(name)
            label, simulated = eng.label or "", bool(eng.simulated)
        except Exception:  # an unknown engine name: the name is its label
            pass
        if st is not None and st.label:
            label = st.label
        simulated = bool(simulated or (st is not None and st.simulated) or getattr(spec, "simulated", False))
        from .numa import binding_bound

        return cls(url, api_key, engine=name, label=label or name, simulated=simulated, pid=pid, spec=spec,
                   binding=binding, numa_bound=binding_bound(binding), log_path=str(log_path) if log_path else None,
                   argv=tuple(argv) if argv is not None else None, gpu_index=int(gpu_index or 0), plan=plan,
                   plan_path=plan_path, started_by_panel=bool(st is not None and st.owner == "panel"))

    def with_plan(self) -> "RunningEngine":
        """This handle with its plan read from ``plan_path`` when it has none yet (file I/O: off the GUI
        thread)."""
        if self.plan is not None or not self.plan_path:
            return self
        plan = read_plan_file(self.plan_path)
        return self if plan is None else replace(self, plan=plan)

    def with_(self, **changes: Any) -> "RunningEngine":
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """For ``--json`` and logs: everything but the key and the launch spec (which holds the key)."""
        return {"base_url": self.base_url, "engine": self.engine, "label": self.label, "simulated": self.simulated,
                "pid": self.pid, "binding": self.binding, "numa_bound": self.numa_bound, "log_path": self.log_path,
                "argv": list(self.argv) if self.argv is not None else None, "gpu_index": self.gpu_index,
                "plan_path": self.plan_path, "started_by_panel": self.started_by_panel,
                "on_this_machine": self.on_this_machine}


# -- the state file, typed -------------------------------------------------------------------------------------

#: who started an engine, in words, where it was not the panel itself (the state file's ``started_by``)
STARTED_BY_WORDS = {"inferencekey": "started by the InferenceKey backend", "cli": "started with dsv41 start"}


# -- the supervisor's status ------------------------------------------------------------------------------------

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
    spec: Any = None                     # engine_manager.engines.base.LaunchSpec, when known
    started_by: str | None = None        # "panel", "cli", "inferencekey" (STARTED_BY_WORDS); None: not recorded
    keeper_start: float | None = None    # the keeper's start as recorded (procs.ctime_of: seconds since boot)

    def uptime_s(self) -> float | None:
        """How long the running engine has been up (None: not running), on the boot clock where the keeper's
        start since boot is known (a step of the wall clock does not change it), else on the wall clock."""
        if not self.started_at or not self.running:
            return None
        from .procs import seconds_since

        return seconds_since(self.keeper_start, self.started_at)

    @property
    def started_by_words(self) -> str | None:
        """``started by the InferenceKey backend`` and the like, for an engine another front end started."""
        return STARTED_BY_WORDS.get(self.started_by or "")

    def plan(self) -> dict[str, Any] | None:
        """The plan the engine runs with, read from ``plan_path`` (None when there is none or it is unreadable)."""
        return read_plan_file(self.plan_path)

    @property
    def running(self) -> bool:
        return self.state in RUNNING_STATES

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("spec", None)
        d["running"] = self.running
        up = self.uptime_s()
        d["uptime_s"] = round(up, 1) if up is not None else None
        return d


def read_plan_file(path: str | Path | None) -> dict[str, Any] | None:
    """A plan JSON file as a dict; None when there is none or it is unreadable."""
    if not path:
        return None
    try:
        d = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return d if isinstance(d, dict) else None


# -- how the engine ended ----------------------------------------------------------------------------------

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
