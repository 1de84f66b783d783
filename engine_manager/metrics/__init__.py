"""Live metrics: collectors → ticks → bounded ring buffers → recordings on disk → CSV.

- :mod:`.columns` — the series kept, with units;
- :mod:`.sources` — the engine adapter, NVML, the host (psutil) and the engine's log (swaps);
- :mod:`.hub` — :class:`MetricsHub`: each source on its own thread and timeout, one :class:`Tick` per period;
- :mod:`.store` — :class:`RingStore`: 24 h at full rate, older data decimated, bounded;
- :mod:`.record` — every run recorded under ``runs_dir()/metrics``; CSV export;
- :mod:`.steady` — the steady decode rate (no ramp-up, no prompt reads; whole lone replies) the card judges;
- :mod:`.guides` — the guides' published figures and the comparison card's logic.

:func:`build_hub` wires a hub for one running engine (a :class:`~engine_manager.session.RunningEngine`);
:func:`hub_for_running_engine` is the Monitor's way in: the hub for the engine that is ready, with the plan it
runs with, and its store filled with the run recorded so far. The handle comes from
``RunningEngine.from_status(status, base_url, api_key, ...)`` (the supervisor's status reconciled with the engine
that is ready). Signatures::

    build_hub(running, *, hz=1.0, plan=None, record=True, store=None, use_nvml=True, recorder=None,
              extra_sources=None) -> MetricsHub
    hub_for_running_engine(running, hz, plan=None, *, old_store=None, recorder=None, use_nvml=True)
        -> (MetricsHub, RingStore, RunningEngine, rows_loaded)
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any, Mapping

from ..engines import get_engine
from ..engines.base import Engine, LaunchSpec
from ..hardware import parse_cpulist
from ..session import RunningEngine
from .columns import ALL_COLUMNS, BY_NAME, COLUMN_NAMES, MAX_SLOTS, SLOT_COLUMNS, Column
from .guides import Comparison, compare, guide_figures, is_guide_model, judge
from .hub import MetricsHub, Tick, derive, prefill_is_live
from .record import (
    Recorder,
    export_csv,
    list_runs,
    load_into,
    metrics_runs_dir,
    open_run,
    prune_runs,
    read_recording,
)
from .sources import (
    EngineSource,
    HostSource,
    LogSwapSource,
    NvmlSource,
    Reading,
    RoutingSource,
    Source,
    spec_for,
    trace_path_from_argv,
)
from .steady import Steady, SteadySnapshot, SteadyTracker
from .store import RingStore, peak_reduce

__all__ = [
    "ALL_COLUMNS", "BY_NAME", "COLUMN_NAMES", "MAX_SLOTS", "SLOT_COLUMNS", "Column", "Comparison", "compare",
    "guide_figures", "is_guide_model", "judge", "prefill_is_live", "Steady", "SteadySnapshot", "SteadyTracker",
    "MetricsHub", "Tick", "derive", "Recorder", "export_csv", "list_runs", "load_into",
    "metrics_runs_dir", "open_run", "read_recording", "prune_runs", "EngineSource", "HostSource",
    "LogSwapSource", "NvmlSource", "Reading", "RoutingSource", "trace_path_from_argv", "Source", "spec_for",
    "RingStore", "peak_reduce", "build_hub",
    "binding_cpus", "binding_bound", "predicted_hit_rate", "plan_expert_bytes", "clamp_hz",
    "hub_for_running_engine", "supervisor_status",
]


def clamp_hz(hz: float | None) -> float:
    """The polling rate within the setting's bounds (0.25–10 Hz; 1 Hz when unset)."""
    if hz is None:
        return 1.0
    return min(10.0, max(0.25, float(hz)))


def binding_cpus(binding: Any) -> list[int] | None:
    """The CPU list of a binding, however it is given: a ``numa.Binding`` (``.cpus``), its dict, a cpulist
    string ``"0-7,16"``, a list of ints; None when unknown or unbound."""
    if binding is None:
        return None
    if isinstance(binding, Mapping):
        cpus = binding.get("cpus")
        if binding.get("prefix") == []:
            return None
    elif isinstance(binding, str):
        # a cpulist ("0-7,16") or the supervisor's one-line summary ("numactl … (node 0, CPUs 0-7)")
        if binding.strip().lower().startswith("none"):
            return None
        m = re.search(r"CPUs ([\d,\-]+)", binding)
        text = m.group(1) if m else binding
        try:
            return parse_cpulist(text) or None
        except ValueError:
            return None
    elif isinstance(binding, (list, tuple)):
        cpus = list(binding)
    else:
        if getattr(binding, "prefix", None) == []:
            return None
        cpus = getattr(binding, "cpus", None)
    if isinstance(cpus, str):
        try:
            return parse_cpulist(cpus) or None
        except ValueError:
            return None
    try:
        return [int(c) for c in cpus] if cpus else None
    except (TypeError, ValueError):
        return None


def binding_bound(binding: Any) -> bool | None:
    """True when the engine runs behind a binding prefix, False when explicitly unbound, None when unknown."""
    if binding is None:
        return None
    if isinstance(binding, str):
        return not binding.strip().lower().startswith("none")
    if isinstance(binding, Mapping):
        if "prefix" in binding:
            return bool(binding["prefix"])
        return None
    prefix = getattr(binding, "prefix", None)
    if prefix is not None:
        return bool(prefix)
    return None


def predicted_hit_rate(plan: Mapping[str, Any] | None, engine: str, spec: LaunchSpec | None = None) -> float | None:
    """The planner's predicted hit rate for this engine (llama.cpp places whole layers, so it has its own);
    None = unknown (the plan says so until the engine has seen traffic). A llama.cpp build without a GPU backend
    (its launch ``spec`` records what the build can do) keeps every layer in RAM whatever the plan asked: 0."""
    if engine == "llamacpp" and spec is not None:
        from ..engines.llamacpp import load_placement
        placed = load_placement(spec)
        if placed is not None and placed.gpu_backend is False:
            return 0.0
    if not plan:
        return None
    key = "llamacpp_predicted_hit_rate" if engine == "llamacpp" else "predicted_hit_rate"
    v = plan.get(key)
    try:
        return None if v is None else float(v)
    except (TypeError, ValueError):
        return None


def plan_expert_bytes(plan: Mapping[str, Any] | None) -> int | None:
    try:
        v = (plan or {}).get("model", {}).get("expert_bytes")
        return int(v) if v else None
    except (AttributeError, TypeError, ValueError):
        return None


def plan_shape(plan: Mapping[str, Any] | None) -> tuple[int, int]:
    """(layers, experts per layer) for routing counts: the plan's model, else the guides' reference model
    (43 layers, the first 3 dense; 384 experts)."""
    model = (plan or {}).get("model") or {}
    try:
        return int(model.get("n_layers") or 43), int(model.get("n_experts") or 384)
    except (TypeError, ValueError):
        return 43, 384


def build_hub(running: RunningEngine | str | Engine, base_url: str | None = None, api_key: str | None = None, *,
              spec: LaunchSpec | None = None, pid: int | None = None, binding: Any = None,
              log_path: str | Path | None = None, gpu_index: int = 0, hz: float = 1.0,
              plan: Mapping[str, Any] | None = None, record: bool = True, store: RingStore | None = None,
              use_nvml: bool = True, argv: list[str] | None = None, recorder: Recorder | None = None,
              extra_sources: list[Source] | None = None) -> MetricsHub:
    """A hub for one running engine: the engine's adapter, NVML (when there is a GPU), the host and the engine
    process tree (its pid; CPU split by its binding), and swaps from its log. With ``record``, a recording
    starts (or, for the same pid after a panel restart, continues) under ``runs_dir()/metrics``; ``recorder``
    hands over an open one (the previous hub's, after a rate change).

    ``running`` is the :class:`RunningEngine` (its spec, pid, binding, log, argv, gpu and plan are used; ``plan``
    overrides its plan when given). An engine reached by URL alone may also be given as
    ``build_hub(engine_name, base_url, api_key, spec=, pid=, binding=, log_path=, argv=, gpu_index=)``."""
    given = running if isinstance(running, Engine) else None
    if not isinstance(running, RunningEngine):
        if base_url is None or api_key is None:
            raise TypeError("build_hub: give a RunningEngine, or an engine with its base_url and api_key")
        name = str(getattr(running, "name", running))
        running = RunningEngine(base_url, api_key, engine=name, pid=pid, spec=spec, binding=binding,
                                log_path=str(log_path) if log_path else None,
                                argv=tuple(argv) if argv is not None else None, gpu_index=gpu_index)
    if plan is None:
        plan = running.plan
    eng = given or get_engine(running.engine)
    hz = clamp_hz(hz)
    period = 1.0 / hz
    base_url, api_key, pid, binding = running.base_url, running.api_key, running.pid, running.binding
    log_path, gpu_index = running.log_path, running.gpu_index
    spec = running.spec or spec_for(eng, base_url, api_key)
    sources: list[Source] = [EngineSource(eng, spec, timeout_s=min(2.0, max(0.2, 0.9 * period)))]
    # an engine on another machine: this box's GPU, RAM and CPU say nothing about it (missing, never this box's)
    if use_nvml and running.on_this_machine:
        sources.append(NvmlSource(gpu_index, timeout_s=min(1.0, 0.9 * period)))
    if running.on_this_machine:
        sources.append(HostSource(pid, binding_cpus(binding), timeout_s=min(1.0, 0.9 * period)))
    # always: without a log file of its own the source takes lines pushed to it (MetricsHub.push_log_line); for an
    # attached engine (no log of ours) its figures are None without being called missing
    sources.append(LogSwapSource(eng, log_path, timeout_s=min(1.0, 0.9 * period),
                                 expected=bool(log_path) or running.started_by_panel))
    trace = spec.files.get("routing_trace") or trace_path_from_argv(list(running.argv or spec.argv))
    if trace:
        n_layers, n_experts = plan_shape(plan)
        sources.append(RoutingSource(trace, n_layers, n_experts, timeout_s=min(1.0, 0.9 * period)))
    sources.extend(extra_sources or [])
    simulated = bool(eng.simulated or spec.simulated)
    record_error = None
    if recorder is not None:
        recorder.write_meta(hz=hz)
    elif record:
        create_time = None
        if pid:
            try:
                import psutil
                create_time = psutil.Process(pid).create_time()
            except Exception:
                create_time = None
        meta = {"engine": eng.name, "label": eng.label, "simulated": simulated, "pid": pid,
                "pid_create_time": create_time, "base_url": base_url, "hz": hz, "gpu_index": gpu_index,
                "binding_cpus": binding_cpus(binding), "numa_bound": binding_bound(binding),
                "predicted_hit_rate": predicted_hit_rate(plan, eng.name, spec), "log_path": str(log_path or ""),
                "started_at": time.time()}
        try:
            recorder = open_run(eng.name, meta, resume_pid=pid)
        except OSError as exc:
            recorder = None
            record_error = (f"not recording: cannot write under {metrics_runs_dir()} ({exc}); "
                            "the plots still work")
    hub = MetricsHub(sources, hz, store=store, recorder=recorder, engine=eng.name, simulated=simulated,
                     predicted_hit_rate=predicted_hit_rate(plan, eng.name, spec), expert_bytes=plan_expert_bytes(plan))
    hub.record_error = record_error
    return hub


# -- the monitor's hub for the engine that is ready -------------------------------------------------------------
def supervisor_status(supervisor: Any) -> Any:
    """What the supervisor says runs now (its ``status()``: I/O, so off the GUI thread); None when it cannot say."""
    if supervisor is None:
        return None
    try:
        return supervisor.status()
    except Exception:  # the monitor then works from the URL and key alone
        return None


def _running_from_info(info: Mapping[str, Any], status: Any) -> RunningEngine:
    """A loose dict (``base_url``, ``api_key``, ``engine``/``engine_default``, ``pid``, ``binding``, ``log_path``,
    ``spec``, ``argv``, ``gpu_index``), as front ends passed before :class:`RunningEngine`, made into one."""
    return RunningEngine.from_status(status, info["base_url"], info["api_key"],
                                     engine=info.get("engine") or info.get("engine_default"), spec=info.get("spec"),
                                     gpu_index=int(info.get("gpu_index") or 0), pid=info.get("pid"),
                                     binding=info.get("binding"), log_path=info.get("log_path"),
                                     argv=info.get("argv"))


def hub_for_running_engine(running: RunningEngine | Mapping[str, Any], hz: float,
                           plan: Mapping[str, Any] | None = None, *, supervisor: Any = None, status: Any = None,
                           old_store: RingStore | None = None, recorder: Recorder | None = None,
                           use_nvml: bool = True) -> tuple[MetricsHub, RingStore, Any, int]:
    """The Monitor's hub for the engine that just became ready (``running``, from
    ``RunningEngine.from_status``): the plan it runs with (read from its ``plan_path`` when the handle has none
    yet), else ``plan`` (the one shown); its store filled with the run so far — the recording of the same engine
    process after a panel restart or a rate change, else ``old_store`` (the plots continue across a restart:
    :meth:`engine_manager.session.EngineSession.carries_plots` decides when to hand one over).

    Returns ``(hub, store, running, rows_loaded)``; ``running`` with its plan read. Blocking (I/O): call it off
    the GUI thread. A dict ``running`` (the loose form before issue 17) is reconciled with ``status`` (else the
    ``supervisor``'s) first, and a dict comes back (its keys plus ``engine``, ``pid``, ``binding``, ``log_path``,
    ``spec``, ``argv``, ``numa_bound``, ``label`` and, when known, ``plan``)."""
    import numpy as np

    legacy = None
    if not isinstance(running, RunningEngine):
        legacy = dict(running)
        legacy.pop("supervisor", None)
        running = _running_from_info(legacy, status if status is not None else supervisor_status(supervisor))
    running = running.with_plan()
    use_plan = running.plan if running.plan is not None else plan
    hz = clamp_hz(hz)
    store = RingStore(COLUMN_NAMES, hz=hz)
    hub = build_hub(running, hz=hz, plan=use_plan, store=store, recorder=recorder, use_nvml=use_nvml)
    loaded = 0
    rec = hub.recorder
    if rec is not None and rec.meta.get("resumed_at") and rec.csv_path.exists():
        try:
            loaded = load_into(store, rec.csv_path)
        except (OSError, ValueError):
            loaded = 0
    if not loaded and old_store is not None and old_store.span() is not None:
        t, d = old_store.window()
        store.extend(t, np.column_stack([d[c] for c in COLUMN_NAMES]))
        loaded = int(t.shape[0])
    if legacy is not None:
        legacy.update(engine=running.engine, pid=running.pid, binding=running.binding, log_path=running.log_path,
                      spec=running.spec, argv=list(running.argv) if running.argv is not None else None,
                      numa_bound=running.numa_bound, label=running.label)
        if running.plan is not None:
            legacy["plan"] = running.plan
        return hub, store, legacy, loaded
    return hub, store, running, loaded
