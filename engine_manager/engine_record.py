"""The supervisor's state file (``engine-state.json``) typed: :class:`EngineRecord`, and :func:`why_invalid` for a
file that does not fit.

A module of its own, apart from :mod:`engine_manager.engine_state`: the record is a pydantic model, and the
window's first step (the engine column, the session) imports the engine's states and handles but never reads the
state file — the first task that does (the re-attach check, on its own thread) imports this. pydantic's import
alone is 0.11–0.16 s on the project's 2-core machine (benchmarks/results/startup.md, eleventh pass).
This module never imports Qt.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class EngineRecord(BaseModel):
    """The state file (``engine-state.json``) as the supervisor writes it: every field it reads, with its type.
    A file that does not fit (``{"keeper_pid": "1x"}``, a list, half a record) is moved aside, never half-used.
    The supervisor reads the record only through these attributes (None = not recorded)."""

    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True, frozen=True)

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
    boot_id: str | None = Field(None, max_length=64)    # the boot the start times count from (procs.BOOT_ID)
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
    started_by: str | None = Field(None, max_length=40)    # who started it (STARTED_BY_WORDS); None: not recorded

    @model_validator(mode="after")
    def _keeper_needs_its_start_time(self) -> "EngineRecord":
        if self.keeper_pid is not None and self.keeper_start_time is None:
            raise ValueError("keeper_pid without keeper_start_time")
        return self

    @classmethod
    def empty(cls) -> "EngineRecord":
        """A record of nothing (every field None): what "no state file" reads as where a record is needed."""
        return cls.model_validate({})

    @classmethod
    def from_json(cls, raw: bytes) -> "EngineRecord":
        """Parse and validate; ``ValueError`` (or pydantic's ``ValidationError``) when it is not a record."""
        try:
            d = json.loads(raw.decode("utf-8"))
        except RecursionError:              # 100,000 nested brackets: not a ValueError by itself
            raise ValueError("it nests too deeply to be read") from None
        if not isinstance(d, dict):
            raise ValueError(f"it holds a JSON {type(d).__name__}, not a record")
        return cls.model_validate(d)

    def to_json_dict(self) -> dict[str, Any]:
        """The record as written: the keys it had (``schema`` by its name), nothing added."""
        return self.model_dump(by_alias=True, exclude_unset=True)

    @property
    def names_process(self) -> bool:
        """It names a keeper (an engine was started): only then is there a process to re-attach to or clean up."""
        return bool(self.keeper_pid)

    @property
    def plan_path(self) -> str | None:
        return (self.files or {}).get("plan")

    def alive(self) -> bool:
        """The engine it names runs: keeper and engine both alive with their recorded start times."""
        from .procs import alive

        if not self.keeper_pid:
            return False
        if not alive(self.keeper_pid, self.keeper_start_time, self.boot_id):
            return False
        return self.pid is None or alive(self.pid, self.pid_start_time, self.boot_id)


def why_invalid(exc: Exception) -> str:
    """A validation error of the state file in a few plain words (at most three fields)."""
    if isinstance(exc, ValidationError):
        parts = []
        for e in exc.errors()[:3]:
            where = ".".join(str(x) for x in e.get("loc", ())) or "the record"
            parts.append(f"{where}: {e.get('msg')}" + (f" (got {e['input']!r:.40})" if "input" in e and
                                                      not isinstance(e["input"], dict) else ""))
        return "; ".join(parts)
    return str(exc)
