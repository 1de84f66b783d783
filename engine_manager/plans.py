"""The plan store and what feeds the planner: where the model is, the replica the scripted engine plans with, and
the saved plans — ``plans/last-plan.json`` (+ ``.strp``), the plan ``dsv41 start`` uses, and ``plans/other-plan.json``,
the last refused or hypothetical one the Placement tab shows again. Written atomically, owner-only.
:func:`make_plan` is the whole round: find the model, pick the host, plan (:mod:`engine_manager.placement`), store.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import paths
from .atomic import atomic_write_json
from .gguf_split import first_shard_files
from .hardware import HardwareReport
from .layout import LayoutError, ModelLayout, read_layout
from .placement import SCHEMA, Plan, hypothetical_hardware, plan, reference_hardware


def find_model(settings: Any) -> Path | None:
    """The first shard of the model the settings point at (``model_dir``, else the download cache), or None."""
    cands: list[Path] = []
    md = getattr(settings, "model_dir", None)
    if md:
        cands.append(Path(md).expanduser())
    cache = getattr(settings, "cache_path", None)
    if cache:
        cands.append(Path(cache))
    for base in cands:
        if not base.is_dir():
            continue
        hits = first_shard_files(base, max_depth=3)
        if hits:
            return hits[0]
    return None


def sim_replica_dir() -> Path:
    return paths.data_dir() / "replica"


def default_sim_layout(directory: os.PathLike | str | None = None) -> ModelLayout:
    """The replica's layout, generated on first use into ``<data dir>/replica`` (sparse: kilobytes on disk); what the
    scripted engine and demos plan with when no real model exists."""
    from .replica import ReplicaSpec, write_replica
    d = Path(directory) if directory else sim_replica_dir()
    try:
        lay = read_layout(d)
        if lay.n_routed_experts == 15_360 and len(lay.shards) == 7:
            return lay
    except LayoutError:
        pass
    tmp = d.with_name(f".{d.name}.tmp-{os.getpid()}")
    if tmp.exists():
        for f in tmp.iterdir():
            f.unlink()
    write_replica(tmp, ReplicaSpec())
    if d.exists():
        for f in d.glob("*.gguf"):
            f.unlink()
        for f in tmp.iterdir():
            os.replace(f, d / f.name)
        tmp.rmdir()
    else:
        d.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(tmp, d)
        except OSError:                      # another process won the race: use its replica
            for f in tmp.iterdir():
                f.unlink()
            tmp.rmdir()
    return read_layout(d)


def plans_dir() -> Path:
    return paths.data_dir() / "plans"


LAST_PLAN_NAME = "last-plan"        # the plan `dsv41 start` (supervisor.default_plan) uses: this machine, not refused
OTHER_PLAN_NAME = "other-plan"      # the last refused or hypothetical plan: shown again by the Placement tab only


def last_plan_path() -> Path:
    return plans_dir() / f"{LAST_PLAN_NAME}.json"


def other_plan_path() -> Path:
    return plans_dir() / f"{OTHER_PLAN_NAME}.json"


def why_not_startable(plan: "Plan | dict[str, Any]") -> str | None:
    """Why a plan must not become the last plan that ``dsv41 start`` uses, or None when it may. The same rule as
    ``supervisor.default_plan``: a refused plan, or one made for a hypothetical host (``--vram-gib``/``--ram-gib``,
    the guides' workstation), never starts an engine on this machine."""
    refused: Any
    hyp: Any
    if isinstance(plan, Plan):
        refused, hyp = plan.refused, plan.hypothetical
    else:
        refused, hyp = plan.get("refused"), (plan.get("hardware") or {}).get("hypothetical")
    if refused:
        return "it was refused"
    if hyp:
        return "it is for a hypothetical host, not this machine"
    return None


def save_plan(plan_dict: dict[str, Any], path: os.PathLike | str | None = None) -> Path:
    """Write a plan's JSON atomically (default: ``<data dir>/plans/last-plan.json``)."""
    p = Path(path) if path else last_plan_path()
    atomic_write_json(p, plan_dict)
    return p


def _load_plan_file(p: Path) -> dict[str, Any] | None:
    import json
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) and d.get("schema") == SCHEMA else None


def load_last_plan() -> dict[str, Any] | None:
    return _load_plan_file(last_plan_path())


def load_shown_plan() -> dict[str, Any] | None:
    """The newest of the last plan and the last refused / hypothetical one: what the Placement tab shows again
    after a restart (``dsv41 start`` only ever uses :func:`load_last_plan`)."""
    cands = [d for d in (_load_plan_file(last_plan_path()), _load_plan_file(other_plan_path())) if d]
    if not cands:
        return None
    return max(cands, key=lambda d: d.get("created_at") or 0)


@dataclass
class StoredPlan:
    """Where :func:`store_plan` put a plan. ``startable``: it is now the last plan ``dsv41 start`` uses;
    otherwise ``reason`` says why not (and the last plan, if any, is unchanged)."""
    plan_dict: dict[str, Any]
    path: Path | None
    strp_path: Path | None
    startable: bool
    reason: str | None

    def describe(self) -> str:
        """One line for the user: where it went and whether ``dsv41 start`` will use it."""
        prof = f" (+ Strata profile {self.strp_path})" if self.strp_path else ""
        if self.path is None:
            last = last_plan_path()
            return ("Not saved (--no-save): " + (f"`dsv41 start` keeps using {last}." if last.exists() else
                                                 "`dsv41 start` plans for this machine itself."))
        if self.startable:
            return f"Saved as the plan `dsv41 start` uses: {self.path}{prof}"
        last = last_plan_path()
        keep = f"the last plan ({last}) is unchanged" if last.exists() else \
            "`dsv41 start` plans for this machine itself"
        return (f"Saved to {self.path}{prof} for the Placement tab, not as the plan `dsv41 start` uses: "
                f"{self.reason}; {keep}.")


def store_plan(p: "Plan", *, save: bool = True, strp_path: os.PathLike | str | None = None,
               source: str | None = None) -> StoredPlan:
    """Write the Strata profile and the plan's JSON where they belong and return the plan dict.

    A plan this machine can start (not refused, not hypothetical) becomes the last plan
    (``plans/last-plan.json`` + ``last-plan.strp``) that ``dsv41 start`` uses; a refused or hypothetical one goes to
    ``plans/other-plan.json`` (+ ``.strp``) so it never replaces the plan an engine would start with. ``strp_path``
    writes the profile there instead of beside the JSON; ``save=False`` writes no JSON (and no profile unless
    ``strp_path`` is given). ``source`` is recorded as ``model.source``."""
    reason = why_not_startable(p)
    base = LAST_PLAN_NAME if reason is None else OTHER_PLAN_NAME
    strp = Path(strp_path) if strp_path is not None else (plans_dir() / f"{base}.strp" if save else None)
    if strp is not None and p.refused is None and p.moe_layers:
        p.write_strp(strp)
    d = p.to_dict()
    if source:
        d["model"]["source"] = source
    path = save_plan(d, plans_dir() / f"{base}.json") if save else None
    return StoredPlan(d, path, p.strp_path, reason is None and path is not None, reason)


@dataclass
class PlanRequest:
    """What the GUI (or any caller) asks for: which host, which routing data. ``host``: ``"this"`` (probe),
    ``"reference"`` (the guides' workstation) or ``"custom"`` (``vram_bytes``/``ram_bytes``)."""
    host: str = "this"
    vram_bytes: int | None = None
    ram_bytes: int | None = None
    usage_paths: tuple[str, ...] = ()
    model_path: str | None = None
    save: bool = True


@dataclass
class PlanOutcome:
    plan: Plan
    plan_dict: dict[str, Any]
    model_source: str
    saved_to: Path | None = None
    startable: bool = False          # saved as the last plan, the one `dsv41 start` uses
    saved_note: str = ""             # where it was saved, in words (StoredPlan.describe)


def make_plan(settings: Any, request: PlanRequest, hardware: HardwareReport | None = None) -> PlanOutcome:
    """Find the model (``model_path``, the settings' model folder or download cache, else the replica), pick the
    host, read the routing data, plan, and (``request.save``) store it with :func:`store_plan`: the last plan when
    this machine can start it, else the Placement tab's other plan. Blocking: the GUI runs it on a worker thread."""
    from . import hardware as hwmod
    from .routing import load_usage
    if request.model_path:
        layout = read_layout(request.model_path)
        source = str(layout.first_shard)
    else:
        first = find_model(settings)
        if first is not None:
            layout = read_layout(first)
            source = str(layout.first_shard)
        else:
            layout = default_sim_layout()
            source = "replica"
    if request.host == "reference":
        hw = reference_hardware()
    elif request.host == "custom":
        base = hardware or hwmod.probe(getattr(settings, "cache_path", None))
        hw = hypothetical_hardware(base, request.vram_bytes, request.ram_bytes)
    else:
        hw = hardware or hwmod.probe(getattr(settings, "cache_path", None))
    usage = load_usage(list(request.usage_paths), layout.n_layers, layout.n_experts) if request.usage_paths else None
    p = plan(layout, hw, usage, settings)
    stored = store_plan(p, save=request.save,
                        source=("the header-faithful replica (no model found; sizes from the replica)"
                                if source == "replica" else source))
    return PlanOutcome(p, stored.plan_dict, source, stored.path, stored.startable,
                       stored.describe() if request.save else "")
