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
from .errors import UserError
from .gguf_split import first_shard_files
from .hardware import HardwareReport
from .tensor_layout import LayoutError, ModelLayout, read_layout
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
        hw = plan.get("hardware")
        refused, hyp = plan.get("refused"), hw.get("hypothetical") if isinstance(hw, dict) else None
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
    """A saved plan of the store, or None when it is missing or is not a plan this panel would start (a damaged or
    hand-edited file is never half-used: ``dsv41 start`` then plans afresh)."""
    try:
        return read_plan_file(p)
    except PlanError:
        return None


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
    from .expert_routing import load_usage
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


# -- what a plan file may hold ----------------------------------------------------------------------------------------
#
# A plan file is input like any other: ``dsv41 start --plan FILE``, ``dsv41 bench --plan FILE``, ``dsv41 sim --plan
# FILE`` and the saved plans are checked here before anything starts, field by field, against what the planner
# writes (``Plan.to_dict()``) and ranges no real model exceeds. Above all a plan may carry only the planner's own
# engine flags: Strata's ``--dump-routing FILE`` and ``--expert-profile-save FILE`` write to the file they name
# (src/program/generate.cpp@2291cb3abaadf067f2f60e6ad3d2d3822a2a9932, the option loop), so a plan that named one
# would make the engine overwrite any file the user can write.

PLAN_MAX_BYTES = 32 * 2**20          # the planner's plans are ~1 MB (the usage counts); far more is not a plan
MAX_LAYERS = 1024                    # DeepSeek-V4.1-Flash has 43 blocks; no released model has 1,000
MAX_EXPERTS = 65_536                 # 384 per layer here; no released model has 10,000
MAX_PAIRS = 1 << 20                  # layers × experts (15,360 here): what a profile or a hot set may span
MAX_BYTES = 1 << 50                  # 1 PiB: larger than any model, GPU or RAM
MAX_SLOTS = 64
MAX_CONTEXT = 1 << 24
KV_TYPES = ("int8", "q4_0", "k8v4", "f16", "fp16")
STRATA_PLAN_FLAGS = ("--expert-cache", "--vram-reserve-mib", "--expert-profile")   # what Plan.strata_args() writes
LLAMACPP_PLAN_FLAGS = ("--override-tensor",)                                      # what Plan.llamacpp_args() writes


class PlanError(UserError):
    """A plan file that is missing, unreadable or holds what no plan of this panel holds: said in plain words
    (the CLI exits 2)."""


def _remake(where: str) -> str:
    return f"Make the plan again with `dsv41 plan --out {where}`" if where != "the plan" else \
        "Make the plan again with `dsv41 plan`"


def _plan_models() -> Any:
    """The plan's shape as pydantic models (built on first use: importing this module stays cheap)."""
    global _PLAN_MODEL
    if _PLAN_MODEL is not None:
        return _PLAN_MODEL
    from typing import Annotated, Literal

    from pydantic import BaseModel, ConfigDict, Field

    Int = Annotated[int, Field(strict=True)]
    Bytes = Annotated[int, Field(strict=True, ge=0, le=MAX_BYTES)]
    Rate = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
    Layer = Annotated[int, Field(strict=True, ge=0, lt=MAX_LAYERS)]
    Text = Annotated[str, Field(strict=True, max_length=4096)]
    Long = Annotated[str, Field(strict=True, max_length=100_000)]
    Count = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]

    class _M(BaseModel):
        model_config = ConfigDict(extra="allow", strict=True)

    class ModelInfo(_M):
        name: Text | None = None
        file: Text | None = None
        source: Text | None = None
        n_layers: Annotated[int, Field(strict=True, ge=1, le=MAX_LAYERS)] | None = None
        moe_layers: Annotated[list[Layer], Field(max_length=MAX_LAYERS)] | None = None
        n_moe_layers: Annotated[int, Field(strict=True, ge=0, le=MAX_LAYERS)] | None = None
        n_experts: Annotated[int, Field(strict=True, ge=1, le=MAX_EXPERTS)] | None = None
        n_experts_used: Annotated[int, Field(strict=True, ge=1, le=MAX_EXPERTS)] | None = None
        expert_bytes: Bytes | None = None
        total_bytes: Bytes | None = None
        routed_expert_bytes: Bytes | None = None
        shards: Annotated[int, Field(strict=True, ge=0, le=10_000)] | None = None
        expert_bytes_by_layer: Annotated[list[Bytes], Field(max_length=MAX_LAYERS)] | None = None
        bytes_by_kind: Annotated[dict[Annotated[str, Field(max_length=200)], Bytes], Field(max_length=64)] | None \
            = None

    class Hardware(_M):
        label: Text | None = None
        hypothetical: bool | None = None
        gpu: Text | None = None
        vram_bytes: Bytes | None = None
        ram_bytes: Bytes | None = None

    class Term(_M):
        name: Text = ""
        bytes: Bytes = 0
        note: Text = ""

    class Budget(_M):
        budget_bytes: Bytes | None = None
        total_bytes: Bytes | None = None
        free_bytes: Annotated[int, Field(strict=True, ge=-MAX_BYTES, le=MAX_BYTES)] | None = None
        terms: Annotated[list[Term], Field(max_length=64)] = []

    class Shortfall(_M):
        resource: Text = ""
        needed_bytes: Bytes | None = None
        available_bytes: Bytes | None = None
        missing_bytes: Bytes | None = None
        terms: Annotated[list[Term], Field(max_length=64)] = []

    class PlanSettings(_M):
        slots: Annotated[int, Field(strict=True, ge=1, le=MAX_SLOTS)] | None = None
        context_length: Annotated[int, Field(strict=True, ge=1, le=MAX_CONTEXT)] | None = None
        kv_type: Literal[KV_TYPES] | None = None  # type: ignore[valid-type]
        vram_reserve_mib: Annotated[int, Field(strict=True, ge=0, le=1 << 20)] | None = None

    class Usage(_M):
        sources: Annotated[list[Text], Field(max_length=256)] = []
        total_picks: Count | None = None
        counts: Annotated[list[Annotated[list[Count], Field(max_length=MAX_EXPERTS)]],
                          Field(max_length=MAX_LAYERS)] | None = None

    Pair = Annotated[list[Int], Field(min_length=2, max_length=2)]

    class PlanDoc(_M):
        schema_: Literal[SCHEMA] = Field(alias="schema")  # type: ignore[valid-type]
        created_at: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
        refused: Long | None = None
        shortfalls: Annotated[list[Shortfall], Field(max_length=8)] = []
        model: ModelInfo | None = None
        hardware: Hardware | None = None
        hot_experts: Annotated[int, Field(strict=True, ge=0, le=MAX_PAIRS)] | None = None
        cold_experts: Annotated[int, Field(strict=True, ge=0, le=MAX_PAIRS)] | None = None
        total_experts: Annotated[int, Field(strict=True, ge=0, le=MAX_PAIRS)] | None = None
        hot_expert_bytes: Bytes | None = None
        cold_expert_bytes: Bytes | None = None
        predicted_hit_rate: Rate | None = None
        predicted_hit_rate_note: Long | None = None
        vram: Budget | None = None
        ram: Budget | None = None
        hot_set: Annotated[list[Pair], Field(max_length=MAX_PAIRS)] | None = None
        strata_args: Annotated[list[Text], Field(max_length=2 * len(STRATA_PLAN_FLAGS))] | None = None
        strp_path: Text | None = None
        llamacpp_cpu_layers: Annotated[list[Layer], Field(max_length=MAX_LAYERS)] | None = None
        llamacpp_gpu_layers: Annotated[list[Layer], Field(max_length=MAX_LAYERS)] | None = None
        llamacpp_predicted_hit_rate: Rate | None = None
        llamacpp_note: Long | None = None
        llamacpp_args: Annotated[list[Long], Field(max_length=2)] | None = None
        coverage: Annotated[dict[Annotated[str, Field(max_length=64)], Any], Field(max_length=16)] | None = None
        usage: Usage | None = None
        usage_note: Long | None = None
        settings: PlanSettings | None = None
        notes: Annotated[list[Long], Field(max_length=256)] = []

    _PLAN_MODEL = PlanDoc
    return PlanDoc


_PLAN_MODEL: Any = None


def _pydantic_words(exc: Any, limit: int = 3) -> str:
    """A pydantic ``ValidationError`` as words: which field, what was wrong, what it held."""
    import reprlib

    short = reprlib.Repr()
    short.maxstring, short.maxother, short.maxlist, short.maxdict, short.maxlevel = 40, 40, 4, 4, 2
    parts = []
    for err in exc.errors()[:limit]:
        loc = ".".join(str(x) for x in err.get("loc") or ()) or "the plan"
        loc = loc.replace("schema_", "schema")
        msg = str(err.get("msg") or "is not valid")
        msg = msg[:1].lower() + msg[1:]
        if err.get("type") == "missing":
            parts.append(f"{loc} is missing")
        else:
            parts.append(f"{loc}: {msg} (it holds {short.repr(err.get('input'))})")
    more = exc.error_count() - len(parts)
    return "; ".join(parts) + (f"; and {more} more problem(s)" if more > 0 else "")


def _within(path: Path, roots: list[Path]) -> bool:
    try:
        real = path.expanduser().resolve()
    except (OSError, RuntimeError, ValueError):
        return False
    for root in roots:
        try:
            real.relative_to(root.resolve())
            return True
        except (OSError, RuntimeError, ValueError):
            continue
    return False


def plan_file_roots() -> list[Path]:
    """Where a plan's Strata profile may live: the plans folder (``dsv41 plan`` writes it there) and the runs
    folder (the engine's own run folder, where a profile is written from the plan's hot set)."""
    return [plans_dir(), paths.runs_dir()]


def check_strata_args(args: Any, strp_path: Any = None, *, where: str = "the plan",
                      roots: list[Path] | None = None) -> list[str]:
    """A plan's ``strata_args`` as the engine may get them, or :class:`PlanError` in words. Only the planner's own
    flags pass (``--expert-cache auto|N``, ``--vram-reserve-mib N``, ``--expert-profile PATH`` with PATH in the plans
    or runs folder, each once, as ``--flag value``): anything else — ``--dump-routing FILE`` and
    ``--expert-profile-save FILE`` write to the file they name — is refused. ``strp_path`` is checked likewise."""
    fix = f"{_remake(where)}; a plan carries only the planner's own flags ({', '.join(STRATA_PLAN_FLAGS)})."
    roots = plan_file_roots() if roots is None else roots

    def bad(text: str) -> PlanError:
        return PlanError(f"{where} cannot be started: {text}. {fix}")

    if strp_path is not None:
        if not isinstance(strp_path, str) or not strp_path or "\0" in strp_path:
            raise bad(f"strp_path is not a file name (it holds {str(strp_path)[:60]!r})")
        if not _within(Path(strp_path), roots):
            raise bad(f"strp_path {paths.shown(strp_path)} is outside the panel's plans folder ({roots[0]}); the "
                      "engine would read (and save its learned profile to) a file the plan names")
    if args is None:
        return []
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise bad("strata_args is not a list of words")
    out: list[str] = []
    seen: set[str] = set()
    i = 0
    while i < len(args):
        flag = args[i]
        name = flag.split("=", 1)[0]
        if name not in STRATA_PLAN_FLAGS or "=" in flag:
            what = " (it makes the engine write to the file it names)" if name in (
                "--dump-routing", "--expert-profile-save") else ""
            raise bad(f"strata_args carries {paths.shown(flag, 60)!r}{what}, which the planner never writes")
        if name in seen:
            raise bad(f"strata_args gives {name} twice")
        seen.add(name)
        if i + 1 >= len(args):
            raise bad(f"strata_args ends with {name} and no value")
        value = args[i + 1]
        if name == "--expert-cache":
            if value != "auto" and not (value.isascii() and value.isdigit() and int(value) <= MAX_PAIRS):
                raise bad(f"--expert-cache {paths.shown(value, 40)!r} is not auto or a number of experts "
                          f"(0 to {MAX_PAIRS:,})")
        elif name == "--vram-reserve-mib":
            if not (value.isascii() and value.isdigit() and int(value) <= 1 << 20):
                raise bad(f"--vram-reserve-mib {paths.shown(value, 40)!r} is not a number of MiB (0 to 1,048,576)")
        elif not value or not _within(Path(value), roots):
            raise bad(f"--expert-profile {paths.shown(value, 80)} is outside the panel's plans folder "
                      f"({roots[0]}); the engine would read (and save its learned profile to) a file the plan names")
        out += [name, value]
        i += 2
    return out


def check_plan(doc: Any, *, where: str = "the plan", check_paths: bool = True,
               require_model: bool = True) -> dict[str, Any]:
    """``doc`` when it is a plan this panel may start an engine with, else :class:`PlanError` in plain words:
    every field an engine, the scripted engine or the panel reads, with its type and a range no real model
    exceeds (at most 1,024 layers, 65,536 experts per layer, 2^20 layer × expert pairs), the hot set's pairs
    inside the model, and only the planner's own engine flags (:func:`check_strata_args`; ``check_paths=False``
    skips the folder rule for a reader that never hands the paths on, the scripted engine, which also takes a plan
    without a ``model``: ``require_model=False``). Checks, never allocates by what the plan says."""
    from pydantic import ValidationError

    if not isinstance(doc, dict):
        raise PlanError(f"{where} is not a plan saved by this panel (not a JSON object). {_remake(where)}.")
    if doc.get("schema") != SCHEMA or (require_model and not isinstance(doc.get("model"), dict)):
        raise PlanError(f"{where} is not a plan saved by this panel (no schema {SCHEMA} / model). {_remake(where)}.")
    try:
        m = _plan_models().model_validate(doc)
    except ValidationError as exc:
        raise PlanError(f"{where} cannot be used: {_pydantic_words(exc)}. {_remake(where)}.") from None
    except RecursionError:
        raise PlanError(f"{where} is nested too deeply to be a plan. {_remake(where)}.") from None
    model = m.model
    problems: list[str] = []
    n_layers = model.n_layers if model is not None else None
    n_experts = model.n_experts if model is not None else None
    if n_layers is not None and n_experts is not None and n_layers * n_experts > MAX_PAIRS:
        problems.append(f"model has {n_layers:,} layers × {n_experts:,} experts, more than any real model "
                        f"({MAX_PAIRS:,} pairs at most)")
    layer_cap = n_layers if n_layers is not None else MAX_LAYERS
    expert_cap = n_experts if n_experts is not None else MAX_EXPERTS
    used = model.n_experts_used if model is not None else None
    if used is not None and n_experts is not None and used > n_experts:
        problems.append(f"model.n_experts_used ({used}) is more than model.n_experts ({n_experts})")
    moe_layers = model.moe_layers if model is not None else None
    for name, layers in (("model.moe_layers", moe_layers), ("llamacpp_cpu_layers", m.llamacpp_cpu_layers),
                         ("llamacpp_gpu_layers", m.llamacpp_gpu_layers)):
        bad = next((x for x in layers or () if x >= layer_cap), None)
        if bad is not None:
            problems.append(f"{name} names layer {bad}; the model has {layer_cap} (0 to {layer_cap - 1})")
    for k, (layer, expert) in enumerate(m.hot_set or ()):
        if not (0 <= layer < layer_cap and 0 <= expert < expert_cap):
            problems.append(f"hot_set[{k}] is ({layer}, {expert}); the model has layers 0 to {layer_cap - 1} and "
                            f"experts 0 to {expert_cap - 1}")
            break
    cap = (n_layers or MAX_LAYERS) * (n_experts or MAX_EXPERTS)
    if m.hot_set is not None and len(m.hot_set) > cap:
        problems.append(f"hot_set lists {len(m.hot_set):,} pairs; the model has {cap:,}")
    if m.hot_experts is not None and n_layers is not None and n_experts is not None and m.hot_experts > cap:
        problems.append(f"hot_experts is {m.hot_experts:,}; the model has {cap:,} experts")
    counts = m.usage.counts if m.usage is not None else None
    if counts is not None and sum(len(r) for r in counts) > MAX_PAIRS:
        problems.append(f"usage.counts holds more than {MAX_PAIRS:,} figures")
    for a in m.llamacpp_args or ():
        if a.startswith("-") and a not in LLAMACPP_PLAN_FLAGS:
            problems.append(f"llamacpp_args carries {paths.shown(a, 60)!r}, which the planner never writes")
            break
    if problems:
        raise PlanError(f"{where} cannot be used: {'; '.join(problems[:3])}. {_remake(where)}.")
    if check_paths:
        check_strata_args(doc.get("strata_args"), doc.get("strp_path"), where=where)
    return doc


def read_plan_file(path: os.PathLike | str, *, check_paths: bool = True,
                   require_model: bool = True) -> dict[str, Any]:
    """A saved plan (``dsv41 plan --out FILE``, the Placement tab's save) read with a size cap and checked by
    :func:`check_plan`; :class:`PlanError` in plain words when it is missing, unreadable or not a plan."""
    import json
    import stat

    p = Path(path).expanduser()
    try:
        # O_NONBLOCK: a FIFO or a device named as the plan must not block the start; only a regular file is read
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise PlanError(f"The plan file {p} is not a regular file. Give the file `dsv41 plan --out FILE` "
                                "wrote.")
            raw = f.read(PLAN_MAX_BYTES + 1)
    except FileNotFoundError:
        raise PlanError(f"The plan file {p} does not exist. Make one with `dsv41 plan --out {p}`.") from None
    except OSError as exc:
        raise PlanError(f"The plan file {p} cannot be read ({exc.strerror or exc}). Make it again with "
                        f"`dsv41 plan --out {p}`.") from None
    if len(raw) > PLAN_MAX_BYTES:
        raise PlanError(f"The plan file {p} is larger than {PLAN_MAX_BYTES // 2**20} MB: it is not a plan saved by "
                        f"this panel. Make one with `dsv41 plan --out {p}`.")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        why = "it is nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:200]
        raise PlanError(f"The plan file {p} cannot be read as JSON ({why}). Make it again with "
                        f"`dsv41 plan --out {p}`.") from None
    return check_plan(doc, where=str(p), check_paths=check_paths, require_model=require_model)
