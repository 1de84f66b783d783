"""``dsv41 start --dry-run``: every command a start would run on this machine, without starting anything.

The binding probes, the port check, the keeper and engine command line (:mod:`engine_manager.launch`, as a start
builds it), the environment with the key masked, the readiness check, the stop — also under a refused plan, with
the refusal at the top; a port held by the panel's own engine is named as such. Never imports Qt.
"""

from __future__ import annotations

import os
import shlex
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .atomic import atomic_write_json, ensure_private_dir
from .engines.base import Engine
from .launch import keeper_argv, preflight
from .numa import Binding
from .procs import describe_owner, port_free, port_owner
from .supervisor_events import engine_words, running_conflict

if TYPE_CHECKING:
    from .engine_record import EngineRecord


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


def build_dry_run(eng: Engine, plan: dict[str, Any] | None, settings: Any, binding: Binding, workdir: Path, *,
                  own: EngineRecord | None, log_path: Path, exit_path: Path, log_max_bytes: int, log_backups: int,
                  ready_timeout_s: float, grace_s: float, notes: list[str]) -> DryRun:
    """What :meth:`Supervisor.dry_run <engine_manager.supervisor.Supervisor.dry_run>` returns: every command a
    start of ``eng`` with ``plan`` would run on this machine, without starting anything (``binding`` was probed:
    the probes are ``<prefix> true``). Generated files are written under ``workdir``, so the printed command works
    as is. ``own``: the state file's record of a live engine the panel started (None: none runs)."""
    notes = list(notes)
    refused = plan.get("refused") if plan else None
    b = binding
    ensure_private_dir(workdir)
    # A refused plan: the engines will not build a launch from it, but the dry run still shows every command
    # (built from the plan's terms as they are) under the refusal, which `dsv41 start` would stop at.
    spec = eng.build_launch(settings, {**(plan or {}), "refused": None} if refused else plan, workdir)
    if refused and spec.files.get("plan"):
        atomic_write_json(Path(spec.files["plan"]), plan)    # the file keeps the refusal: it never starts
    notes.extend(f"WARNING: {p}" for p in preflight(eng, spec))
    if own is not None:
        if own.engine == eng.name:
            notes.append(f"{engine_words(eng.name, True)} is already running (pid {own.pid}, port "
                         f"{own.port}): `dsv41 start` would re-attach to it instead of starting another.")
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
    elif own is not None and own.port == spec.port:
        port_note = (f"held now by the panel's own engine: {own.label or engine_words(own.engine)} "
                     f"(pid {own.pid}, started by this panel or `dsv41 start`) — not a conflict: "
                     + ("a start re-attaches to it" if own.engine == eng.name else
                        "stop it first (`dsv41 stop`) to start this engine"))
    else:
        port_note = f"IN USE now by {describe_owner(port_owner(spec.host, spec.port))}"
    steps.append((f"check that {spec.host}:{spec.port} is free", ["ss", "-ltnp", f"sport = :{spec.port}"],
                  port_note))
    keeper = keeper_argv(spec, log_path=log_path, exit_path=exit_path, max_bytes=log_max_bytes, backups=log_backups)
    steps.append((f"start the engine in a new session and process group — binding: {b.summary()}",
                  keeper + spec.masked_argv(b.prefix),
                  f"working directory: {spec.cwd or os.getcwd()}\nthe keeper (first part) copies the engine's "
                  "output to the size-rotated log and records how it ended; the engine command follows `--`"))
    steps.append((f"wait until ready (up to {ready_timeout_s:.0f} s)",
                  ["curl", "-s", f"{spec.base_url}{spec.health_path}"], "connection refused = still loading"))
    if eng.stop_leader_grace_s > 0:        # a server that ends its own engine first (Strata: QUIT, then signals)
        steps.append((f"stop: SIGTERM to the engine's top process alone, up to {eng.stop_leader_grace_s:.0f} s for "
                      f"it to end its children in its own order; then SIGTERM to the group, {grace_s:.0f} s grace, "
                      "then SIGKILL",
                      f"kill -TERM <pid>; sleep {eng.stop_leader_grace_s:.0f}; kill -TERM -<pgid>; "
                      f"sleep {grace_s:.0f}; kill -KILL -<pgid>", ""))
    else:
        steps.append((f"stop: SIGTERM to the group, {grace_s:.0f} s grace, then SIGKILL",
                      f"kill -TERM -<pgid>; sleep {grace_s:.0f}; kill -KILL -<pgid>", ""))
    return DryRun(eng.name, spec.label or eng.label, spec.simulated, steps, spec.masked_env(),
                  dict(spec.files), b, notes, refused)
