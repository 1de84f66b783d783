"""Live metrics: collectors → ticks → bounded ring buffers → recordings on disk → CSV.

- :mod:`.columns` — the series kept, with units;
- :mod:`.sources` — the engine adapter, NVML, the host (psutil) and the engine's log (swaps);
- :mod:`.hub` — :class:`MetricsHub`: each source on its own thread and timeout, one :class:`Tick` per period;
- :mod:`.store` — :class:`RingStore`: 24 h at full rate, older data decimated, bounded;
- :mod:`.record` — every run recorded under ``runs_dir()/metrics``; CSV export;
- :mod:`.steady` — the steady decode rate (no ramp-up, no prompt reads; whole lone replies) the card judges;
- :mod:`.guides` — the guides' published figures and the comparison card's logic.

:func:`build_hub` wires a hub for one running engine from what the supervisor knows about it.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any, Mapping

from ..engines import get_engine
from ..engines.base import Engine, LaunchSpec
from ..hardware import parse_cpulist
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
    "guide_figures", "is_guide_model", "judge", "prefill_is_live", "Steady", "SteadySnapshot", "SteadyTracker", "MetricsHub", "Tick", "derive", "Recorder", "export_csv", "list_runs", "load_into",
    "metrics_runs_dir", "open_run", "read_recording", "prune_runs", "EngineSource", "HostSource",
    "LogSwapSource", "NvmlSource", "Reading", "RoutingSource", "trace_path_from_argv", "Source", "spec_for", "RingStore", "peak_reduce", "build_hub",
    "binding_cpus", "binding_bound", "predicted_hit_rate", "plan_expert_bytes", "clamp_hz",
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


def predicted_hit_rate(plan: Mapping[str, Any] | None, engine: str) -> float | None:
    """The planner's predicted hit rate for this engine (llama.cpp places whole layers, so it has its own);
    None = unknown (the plan says so until the engine has seen traffic)."""
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


def build_hub(engine: str | Engine, base_url: str, api_key: str, *, spec: LaunchSpec | None = None,
              pid: int | None = None, binding: Any = None, log_path: str | Path | None = None,
              gpu_index: int = 0, hz: float = 1.0, plan: Mapping[str, Any] | None = None, record: bool = True,
              store: RingStore | None = None, use_nvml: bool = True, argv: list[str] | None = None,
              recorder: Recorder | None = None, extra_sources: list[Source] | None = None) -> MetricsHub:
    """A hub for one running engine: the engine's adapter, NVML (when there is a GPU), the host and the engine
    process tree (``pid``; CPU split by ``binding``), and swaps from ``log_path``. With ``record``, a recording
    starts (or, for the same pid after a panel restart, continues) under ``runs_dir()/metrics``; ``recorder``
    hands over an open one (the previous hub's, after a rate change)."""
    eng = engine if isinstance(engine, Engine) else get_engine(engine)
    hz = clamp_hz(hz)
    period = 1.0 / hz
    spec = spec or spec_for(eng, base_url, api_key)
    sources: list[Source] = [EngineSource(eng, spec, timeout_s=min(2.0, max(0.2, 0.9 * period)))]
    if use_nvml:
        sources.append(NvmlSource(gpu_index, timeout_s=min(1.0, 0.9 * period)))
    sources.append(HostSource(pid, binding_cpus(binding), timeout_s=min(1.0, 0.9 * period)))
    sources.append(LogSwapSource(eng, log_path, timeout_s=min(1.0, 0.9 * period)))
    trace = spec.files.get("routing_trace") or trace_path_from_argv(argv or spec.argv)
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
                "predicted_hit_rate": predicted_hit_rate(plan, eng.name), "log_path": str(log_path or ""),
                "started_at": time.time()}
        try:
            recorder = open_run(eng.name, meta, resume_pid=pid)
        except OSError as exc:
            recorder = None
            record_error = (f"not recording: cannot write under {metrics_runs_dir()} ({exc}); "
                            "the plots still work")
    hub = MetricsHub(sources, hz, store=store, recorder=recorder, engine=eng.name, simulated=simulated,
                     predicted_hit_rate=predicted_hit_rate(plan, eng.name), expert_bytes=plan_expert_bytes(plan))
    hub.record_error = record_error
    return hub
