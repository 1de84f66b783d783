"""Live metrics: collectors → ticks → bounded ring buffers → recordings on disk → CSV.

- :mod:`.columns` — the series kept, with units;
- :mod:`.sources` — the engine adapter, NVML, the host (psutil) and the engine's log (swaps);
- :mod:`.hub` — :class:`MetricsHub`: each source with its own timeout (one that waits on another program on its own
  thread, the local ones together on one), one :class:`Tick` per period;
- :mod:`.store` — :class:`RingStore`: 24 h at full rate, older data decimated, bounded;
- :mod:`.record` — every run recorded under ``runs_dir()/metrics``; CSV export;
- :mod:`.steady` — the steady decode rate (no ramp-up, no prompt reads; whole lone replies) the card judges;
- :mod:`.guides` — the guides' published figures and the comparison card's logic.

:func:`build_hub` wires a hub for one running engine (a :class:`~engine_manager.engine_state.RunningEngine`, from
``RunningEngine.from_status(status, base_url, api_key, ...)``); :func:`hub_for_running_engine` is the Monitor's way
in: the hub for the engine that is ready, with the plan it runs with, and its store filled with the run recorded so
far, returned as ``(MetricsHub, RingStore, RunningEngine, rows_loaded)``.
"""

from __future__ import annotations

import importlib
import time
from typing import TYPE_CHECKING, Any, Mapping

from ..engines import find_engine, get_engine
from ..engine_state import RunningEngine
from ..engines.base import LaunchSpec
from .columns import ALL_COLUMNS, BY_NAME, COLUMN_NAMES, MAX_SLOTS, SLOT_COLUMNS, Column
from .guides import Comparison, compare, guide_figures, is_guide_model, judge
from .steady import Steady, SteadySnapshot, SteadyTracker

if TYPE_CHECKING:
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
    from .store import RingStore, peak_reduce

# The hub, the store, the recordings and the sources bring numpy (and psutil, httpx): imported on first use of one
# of their names, so a page that only words figures (the Monitor's cards, the Placement tab, `dsv41 monitor`'s
# presenter) does not pay for them — numpy's import was ~0.12 s of the panel's first step (2-core machine,
# `python -X importtime`, benchmarks/results/startup.md).
_LAZY = {
    **dict.fromkeys(("MetricsHub", "Tick", "derive", "prefill_is_live"), "hub"),
    **dict.fromkeys(("Recorder", "export_csv", "list_runs", "load_into", "metrics_runs_dir", "open_run",
                     "prune_runs", "read_recording"), "record"),
    **dict.fromkeys(("EngineSource", "HostSource", "LogSwapSource", "NvmlSource", "Reading", "RoutingSource",
                     "Source", "spec_for", "trace_path_from_argv"), "sources"),
    **dict.fromkeys(("RingStore", "peak_reduce"), "store"),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "ALL_COLUMNS", "BY_NAME", "COLUMN_NAMES", "MAX_SLOTS", "SLOT_COLUMNS", "Column", "Comparison", "compare",
    "guide_figures", "is_guide_model", "judge", "prefill_is_live", "Steady", "SteadySnapshot", "SteadyTracker",
    "MetricsHub", "Tick", "derive", "Recorder", "export_csv", "list_runs", "load_into",
    "metrics_runs_dir", "open_run", "read_recording", "prune_runs", "EngineSource", "HostSource",
    "LogSwapSource", "NvmlSource", "Reading", "RoutingSource", "trace_path_from_argv", "Source", "spec_for",
    "RingStore", "peak_reduce", "build_hub",
    "predicted_hit_rate", "plan_expert_bytes", "clamp_hz",
    "hub_for_running_engine",
]


def clamp_hz(hz: float | None) -> float:
    """The polling rate within the setting's bounds (0.25–10 Hz; 1 Hz when unset)."""
    if hz is None:
        return 1.0
    return min(10.0, max(0.25, float(hz)))


def predicted_hit_rate(plan: Mapping[str, Any] | None, engine: str, spec: LaunchSpec | None = None) -> float | None:
    """The planner's predicted hit rate for this engine (under its ``Engine.plan_hit_rate_key``: llama.cpp places
    whole layers, so it has its own); None = unknown (the plan says so until the engine has seen traffic). A launch
    that fixes the rate whatever the plan asked (``Engine.launch_hit_rate``: a llama.cpp build without a GPU backend
    keeps every layer in RAM) gives that."""
    eng = find_engine(engine)
    fixed = eng.launch_hit_rate(spec) if spec is not None else None
    if fixed is not None:
        return fixed
    if not plan:
        return None
    v = plan.get(eng.plan_hit_rate_key)
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


def build_hub(running: RunningEngine, *, hz: float = 1.0, plan: Mapping[str, Any] | None = None,
              record: bool = True, store: RingStore | None = None, use_nvml: bool = True,
              recorder: Recorder | None = None, extra_sources: list[Source] | None = None) -> MetricsHub:
    """A hub for one running engine: the engine's adapter, NVML (when there is a GPU), the host and the engine
    process tree (its pid; CPU split by its binding), and swaps from its log. With ``record``, a recording
    starts (or, for the same pid after a panel restart, continues) under ``runs_dir()/metrics``; ``recorder``
    hands over an open one (the previous hub's, after a rate change).

    ``running`` is the :class:`RunningEngine` (its spec, pid, binding, log, argv, gpu and plan are used; ``plan``
    overrides its plan when given); an engine reached by URL alone is ``RunningEngine(base_url, api_key, ...)``."""
    from .hub import MetricsHub
    from .record import metrics_runs_dir, open_run
    from ..numa import binding_bound, binding_cpus    # with the hardware probe's module: a hub's, not a page's
    from .sources import EngineSource, HostSource, LogSwapSource, NvmlSource, RoutingSource, spec_for
    from .sources import trace_path_from_argv

    if plan is None:
        plan = running.plan
    eng = get_engine(running.engine)
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
        from ..procs import BOOT_ID, ctime_of

        meta = {"engine": eng.name, "label": eng.label, "simulated": simulated, "pid": pid,
                "pid_create_time": ctime_of(pid) if pid else None, "boot_id": BOOT_ID, "base_url": base_url,
                "hz": hz, "gpu_index": gpu_index,
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
def hub_for_running_engine(running: RunningEngine, hz: float, plan: Mapping[str, Any] | None = None, *,
                           old_store: RingStore | None = None, recorder: Recorder | None = None,
                           use_nvml: bool = True) -> tuple[MetricsHub, RingStore, RunningEngine, int]:
    """The Monitor's hub for the engine that just became ready (``running``, from
    ``RunningEngine.from_status``): the plan it runs with (read from its ``plan_path`` when the handle has none
    yet), else ``plan`` (the one shown); its store filled with the run so far — the recording of the same engine
    process after a panel restart or a rate change, else ``old_store`` (the plots continue across a restart:
    :meth:`engine_manager.session.EngineSession.carries_plots` decides when to hand one over).

    Returns ``(hub, store, running, rows_loaded)``; ``running`` with its plan read. Blocking (I/O): call it off
    the GUI thread."""
    import numpy as np

    from .record import load_into
    from .store import RingStore

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
    return hub, store, running, loaded
