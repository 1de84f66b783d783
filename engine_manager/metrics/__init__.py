"""Live metrics: collectors → ticks → bounded ring buffers → recordings on disk → CSV.

- :mod:`.columns` — the series kept, with units;
- :mod:`.sources` — the engine adapter, NVML, the host (psutil) and the engine's log (swaps);
- :mod:`.hub` — :class:`MetricsHub`: each source on its own thread and timeout, one :class:`Tick` per period;
- :mod:`.store` — :class:`RingStore`: 24 h at full rate, older data decimated, bounded;
- :mod:`.record` — every run recorded under ``runs_dir()/metrics``; CSV export;
- :mod:`.steady` — the steady decode rate (no ramp-up, no prompt reads; whole lone replies) the card judges;
- :mod:`.guides` — the guides' published figures and the comparison card's logic.

:func:`build_hub` wires a hub for one running engine from what the supervisor knows about it;
:func:`hub_for_running_engine` is the Monitor's way in: it reconciles the supervisor's status with the engine
that is ready, picks the plan the engine runs with, and loads the run recorded so far.
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
    "hub_for_running_engine", "running_engine_info", "supervisor_status",
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
def _status_get(status: Any, key: str) -> Any:
    return status.get(key) if isinstance(status, Mapping) else getattr(status, key, None)


def supervisor_status(supervisor: Any) -> Any:
    """What the supervisor says runs now (its ``status()``: I/O, so off the GUI thread); None when it cannot say."""
    if supervisor is None:
        return None
    try:
        return supervisor.status()
    except Exception:  # the monitor then works from the URL and key alone
        return None


def running_engine_info(info: Mapping[str, Any], status: Any = None) -> dict[str, Any]:
    """``info`` (``base_url``, ``api_key``, and what the caller knows: ``engine``/``engine_default``, ``pid``,
    ``binding``, ``log_path``, ``spec``, ``argv``, ``gpu_index``) completed from the supervisor's ``status`` of the
    engine — only when that status is about the engine at ``base_url`` (the supervisor may know another one than
    the one that is ready). Adds ``engine`` (a name), ``numa_bound`` and, when known, ``plan``: the plan the engine
    runs with (its status's plan file, else the launch spec's), whose prediction is the reference line."""
    info = dict(info)
    info.pop("supervisor", None)
    base_url = str(info["base_url"]).rstrip("/")
    st_url = _status_get(status, "base_url") if status is not None else None
    if status is not None and st_url and str(st_url).rstrip("/") != base_url:
        status = None
    if status is not None:
        running_plan = status.plan() if callable(getattr(status, "plan", None)) else _status_get(status, "plan")
        if isinstance(running_plan, dict):
            info["plan"] = running_plan
        for key in ("engine", "pid", "binding", "log_path", "spec", "argv"):
            val = _status_get(status, key)
            if val is not None:
                info[key] = val
    engine = info.get("engine") or info.get("engine_default") or "sim"
    info["engine"] = getattr(engine, "name", engine)
    spec = info.get("spec")
    if spec is not None and str(getattr(spec, "base_url", "")).rstrip("/") != base_url:
        spec = None
    info["spec"] = spec
    info["numa_bound"] = binding_bound(info.get("binding"))
    if info.get("plan") is None:
        files = getattr(spec, "files", None) or (_status_get(status, "files") if status is not None else None) or {}
        plan_file = files.get("plan") if isinstance(files, Mapping) else None
        if plan_file:
            try:
                import json
                plan = json.loads(Path(plan_file).read_text(encoding="utf-8"))
                if isinstance(plan, dict):
                    info["plan"] = plan
            except (OSError, ValueError):
                pass
    return info


def hub_for_running_engine(info: Mapping[str, Any], hz: float, plan: Mapping[str, Any] | None = None, *,
                           supervisor: Any = None, status: Any = None, old_store: RingStore | None = None,
                           recorder: Recorder | None = None, use_nvml: bool = True
                           ) -> tuple[MetricsHub, RingStore, dict[str, Any], int]:
    """The Monitor's hub for the engine that just became ready: ask the ``supervisor`` (unless ``status`` is
    given), reconcile with :func:`running_engine_info`, build the hub (the plan the engine runs with, else
    ``plan``, the one shown), and fill its store with the run so far — the recording of the same engine process
    after a panel restart or a rate change, else ``old_store`` (the plots continue across a restart).

    Returns ``(hub, store, info, rows_loaded)``; ``info`` gains ``label``. Blocking (I/O): call it off the GUI
    thread."""
    import numpy as np

    if status is None:
        status = supervisor_status(supervisor)
    info = running_engine_info(info, status)
    if info.get("plan") is None and plan is not None:
        use_plan: Mapping[str, Any] | None = plan
    else:
        use_plan = info.get("plan")
    engine = info["engine"]
    hz = clamp_hz(hz)
    store = RingStore(COLUMN_NAMES, hz=hz)
    hub = build_hub(engine, info["base_url"], info["api_key"], spec=info.get("spec"), pid=info.get("pid"),
                    binding=info.get("binding"), log_path=info.get("log_path"),
                    gpu_index=int(info.get("gpu_index") or 0), hz=hz, plan=use_plan, store=store,
                    argv=info.get("argv"), recorder=recorder, use_nvml=use_nvml)
    info["label"] = get_engine(engine).label or engine
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
    return hub, store, info, loaded
