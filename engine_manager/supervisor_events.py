"""The supervisor's events (typed, frozen), and how its messages name the engines.

Every long supervisor operation is a generator yielding these: the CLI prints them, the GUI re-emits them as
signals, tests assert on them. Structured fields (``StartFailed.suggested_port``, ``Note.cause``) carry what a
front end acts on, so no front end parses prose. The states they name are :mod:`engine_manager.engine_state`'s.
This module never imports Qt.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from .engines import TraitTable, find_engine
from .engines.base import FailureHint, LogEvent
from .eventbase import Event

#: how the messages name each engine (``Engine.words``)
ENGINE_WORDS = TraitTable("words")


def engine_words(name: str | None, capital: bool = False) -> str:
    w = find_engine(name).words or name or "an engine"
    return w[:1].upper() + w[1:] if capital else w


def running_conflict(rec: Any, wanted: str) -> tuple[str, str]:
    """(message, fix) for a start of ``wanted`` while the engine in the state file ``rec`` (an
    :class:`engine_manager.engine_state.EngineRecord` of another engine) runs."""
    running = engine_words(rec.engine, True)
    where = f"on port {rec.port}" + (f" ({rec.base_url})" if rec.base_url else "")
    msg = (f"{running} is already running {where}, pid {rec.pid} (started by this panel or `dsv41 start`), "
           f"so {engine_words(wanted)} was not started.")
    fix = (f"Stop it first — `dsv41 stop` (or Stop in the panel) — then start {engine_words(wanted)}. Only one "
           f"engine runs at a time; starting {engine_words(rec.engine)} again re-attaches to the running one.")
    return msg, fix


# -- events --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StateChanged(Event):
    """The supervisor's state changed. ``message`` says why in plain words."""
    kind: ClassVar[str] = "state"
    state: str
    previous: str
    message: str = ""
    engine: str | None = None
    pid: int | None = None


@dataclass(frozen=True)
class Note(Event):
    """Something the user should read (the binding chosen, the default plan, a warning)."""
    kind: ClassVar[str] = "note"
    text: str
    level: str = "info"          # info | warning
    cause: str | None = None     # what it is about, for front ends (e.g. "external_engine": not the panel's)


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class LogLines(Event):
    """New lines of the engine log (batched), and what the engine adapter read in them."""
    kind: ClassVar[str] = "log"
    lines: list[str]
    events: list[LogEvent] = field(default_factory=list)


@dataclass(frozen=True)
class Ready(Event):
    kind: ClassVar[str] = "ready"
    base_url: str
    elapsed_s: float
    engine: str
    pid: int | None
    simulated: bool = False
    attached: bool = False


@dataclass(frozen=True)
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

    def hint(self) -> FailureHint:
        return FailureHint(self.cause, self.title, self.fix)

    @classmethod
    def recorded(cls, d: dict[str, Any]) -> "Crashed | None":
        """The crash a state file recorded (its ``to_dict()``), shown again with no restart pending; None when the
        record does not fit."""
        try:
            crash = cls(**{k: v for k, v in d.items() if k != "kind"})
        except TypeError:
            return None
        return replace(crash, will_restart=False, restart_in_s=None)


@dataclass(frozen=True)
class Restarting(Event):
    kind: ClassVar[str] = "restarting"
    attempt: int
    delay_s: float
    remaining_s: float


@dataclass(frozen=True)
class GaveUp(Event):
    """Auto-restart stopped (crash loop, or a cause a restart cannot fix)."""
    kind: ClassVar[str] = "gave_up"
    message: str
    cause: str
    fix: str


@dataclass(frozen=True)
class StartFailed(Event):
    """Start refused or did not reach ready (port taken, placement refused, timeout, already running elsewhere)."""
    kind: ClassVar[str] = "failed"
    cause: str
    message: str
    fix: str
    log_tail: list[str] = field(default_factory=list)
    suggested_port: int | None = None    # cause "port_in_use": a port that is free now (None: none found)


@dataclass(frozen=True)
class Stopping(Event):
    kind: ClassVar[str] = "stopping"
    elapsed_s: float
    grace_s: float
    signal_name: str
    remaining: int                      # processes of the group still alive


@dataclass(frozen=True)
class Stopped(Event):
    kind: ClassVar[str] = "stopped"
    message: str
    forced: bool = False
    leftovers: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Attached(Event):
    """A new panel found the engine a previous one started, alive and matching."""
    kind: ClassVar[str] = "attached"
    pid: int
    engine: str
    state: str
    message: str

