"""Planned vs measured: does the running engine hold what its plan says it holds, where the binding says?

Each :class:`Check` puts the plan's figure beside the measured one: ``experts_in_vram`` (Strata's expert slots,
``/metrics`` ``engine.expert_slots`` / ``expert_cache_mib``: serve/server.py @2291cb3 ``Service.metrics``; for
llama.cpp the MoE layers its log shows on the GPU, :class:`engine_manager.engines.llamacpp.PlacementSummary`),
``host_arena`` (the pinned ``engine.arena_mib`` vs the cold experts), ``no_file_reads`` (the finished requests'
``file_blobs`` must be 0: experts read from the model file are an order of magnitude slower), ``numa_memory``
(``/proc/PID/numa_maps``, capped, vs a binding that steers memory), ``cpu_affinity`` (psutil vs the node's CPUs),
``vram_available`` and ``gpu_other_processes`` (NVML, :mod:`engine_manager.nvml`; the other processes named).
``ok`` is True (as planned), False (the figures and a fix in words) or None: *unknown*, the engine or the machine
does not say (no NVML, no finished request yet, an engine on another machine); unknown is never shown as ok nor as
failed. :func:`run_checks` is pure (readings in, checks out); :func:`collect_checks` takes the readings for a
:class:`~engine_manager.engine_state.RunningEngine` (one ``/metrics`` read, /proc, psutil, NVML) — blocking, so off
a GUI thread.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from .fmt import GIB, MIB
from .tls import verify as tls_verify

#: a binding must hold at least this share of the engine's resident memory on its node to count as applied
NUMA_MIN_SHARE = 0.9
NUMA_MAPS_CAP = 16 * 2**20          # bytes of /proc/PID/numa_maps read per process
MAX_PROCESSES = 32                  # the engine and at most this many descendants are measured


@dataclass(frozen=True)
class Check:
    """One planned-vs-measured comparison. ``ok`` None = unknown (the engine or the machine does not say)."""

    name: str
    title: str
    planned: str | None
    measured: str | None
    ok: bool | None
    fix: str = ""

    @property
    def state(self) -> str:
        return "unknown" if self.ok is None else ("ok" if self.ok else "failed")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "title": self.title, "planned": self.planned, "measured": self.measured,
                "ok": self.ok, "state": self.state, "fix": self.fix or None}

    def line(self) -> str:
        """``FAILED  Experts held in VRAM: planned 5,825, measured 4,000 — fix …`` for a terminal."""
        mark = {"ok": "ok", "failed": "FAILED", "unknown": "unknown"}[self.state]
        text = f"{mark:<8}{self.title}: planned {self.planned or '—'}, measured {self.measured or '—'}"
        return f"{text}. {self.fix}" if self.fix and self.ok is not True else text


def failed(checks: Iterable[Check]) -> list[Check]:
    return [c for c in checks if c.ok is False]


def summary(checks: Sequence[Check]) -> str:
    """``2 of 7 checks failed: Experts held in VRAM, No expert reads from the file`` or ``all 5 known checks ok
    (2 unknown)``."""
    bad = failed(checks)
    unknown = sum(1 for c in checks if c.ok is None)
    if bad:
        return f"{len(bad)} of {len(checks)} checks failed: {', '.join(c.title for c in bad)}"
    known = len(checks) - unknown
    tail = f" ({unknown} unknown)" if unknown else ""
    return f"all {known} known checks ok{tail}" if known else f"no check could be measured ({unknown} unknown)"


# -- readings ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GpuProcess:
    pid: int
    name: str
    used_bytes: int | None


@dataclass(frozen=True)
class GpuReading:
    """The GPU as NVML reads it now; ``missing`` says why there is none."""

    total_bytes: int | None = None
    used_bytes: int | None = None
    processes: tuple[GpuProcess, ...] = ()
    util_pct: float | None = None
    power_w: float | None = None
    missing: str | None = None


@dataclass(frozen=True)
class ProcReading:
    """The engine's processes as /proc and psutil read them; ``missing`` says why there is none."""

    pids: tuple[int, ...] = ()
    node_bytes: Mapping[int, int] | None = None       # resident bytes per NUMA node (numa_maps), all processes
    affinity: tuple[int, ...] | None = None           # the engine process's CPU affinity
    cpu_time_s: float | None = None                   # user + system, all processes
    missing: str | None = None
    numa_missing: str | None = None


_NODE = re.compile(rb"\bN(\d+)=(\d+)")
_PAGE = re.compile(rb"\bkernelpagesize_kB=(\d+)")


def parse_numa_maps(data: bytes) -> dict[int, int]:
    """Bytes per NUMA node from ``/proc/PID/numa_maps`` text: each mapping's ``N<node>=<pages>`` times its
    ``kernelpagesize_kB`` (4 kB when a line does not say)."""
    out: dict[int, int] = {}
    for line in data.splitlines():
        m = _PAGE.search(line)
        page = int(m.group(1)) * 1024 if m else 4096
        for node, pages in _NODE.findall(line):
            n = int(node)
            out[n] = out.get(n, 0) + int(pages) * page
    return out


def read_numa_maps(pid: int, cap: int = NUMA_MAPS_CAP) -> dict[int, int]:
    """Bytes per node of one process (at most ``cap`` bytes of the file are read; a torn last line is dropped).
    Raises ``OSError`` when the file cannot be read."""
    with open(f"/proc/{int(pid)}/numa_maps", "rb") as f:
        data = f.read(cap)
    if len(data) >= cap:
        data = data[:data.rfind(b"\n") + 1]
    return parse_numa_maps(data)


def engine_pids(pid: int) -> tuple[int, ...]:
    """The engine process and its descendants (at most :data:`MAX_PROCESSES`); empty when it is gone."""
    import psutil

    try:
        p = psutil.Process(int(pid))
        kids = p.children(recursive=True)[:MAX_PROCESSES]
    except (psutil.Error, ValueError):
        return ()
    return (p.pid, *(k.pid for k in kids))


def read_process(pid: int | None) -> ProcReading:
    """NUMA placement, CPU affinity and CPU time of the engine ``pid`` and its children."""
    import psutil

    if not pid:
        return ProcReading(missing="the engine's process is not known here (an engine on another machine, or one "
                                   "this panel did not start)")
    pids = engine_pids(pid)
    if not pids:
        return ProcReading(missing=f"the engine's process (pid {pid}) is not running")
    nodes: dict[int, int] = {}
    numa_missing = None
    for p in pids:
        try:
            for n, b in read_numa_maps(p).items():
                nodes[n] = nodes.get(n, 0) + b
        except OSError as exc:
            if p == pids[0]:
                numa_missing = f"/proc/{p}/numa_maps cannot be read ({exc.strerror or exc})"
    affinity = cpu = None
    try:
        affinity = tuple(sorted(psutil.Process(pids[0]).cpu_affinity()))
    except (psutil.Error, AttributeError, OSError):
        pass
    for p in pids:
        try:
            t = psutil.Process(p).cpu_times()
            cpu = (cpu or 0.0) + t.user + t.system
        except psutil.Error:
            pass
    if not nodes and numa_missing is None:
        numa_missing = "the kernel reports no NUMA placement (numa_maps is empty or absent)"
    return ProcReading(pids=pids, node_bytes=nodes or None, affinity=affinity, cpu_time_s=cpu,
                       numa_missing=numa_missing)


def read_gpu(gpu_index: int = 0) -> GpuReading:
    """Memory, processes, utilisation and power of GPU ``gpu_index`` through NVML; ``missing`` says why not."""
    import psutil

    from . import nvml

    try:
        with nvml.session() as n:
            try:
                h = nvml.handle(n, gpu_index)
            except Exception as exc:  # noqa: BLE001 - an index past the GPUs, a lost GPU: a missing reading
                return GpuReading(missing=nvml.nvml_reason(exc, f"GPU {gpu_index}"))
            mem = nvml.attempt(n.nvmlDeviceGetMemoryInfo, h)
            procs: dict[int, int | None] = {}
            for fn in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
                for p in nvml.attempt(getattr(n, fn), h) or []:
                    used = getattr(p, "usedGpuMemory", None)
                    used = int(used) if isinstance(used, int) and 0 <= used < 2**50 else None
                    pid = int(getattr(p, "pid", 0) or 0)
                    if pid > 0:
                        procs[pid] = max(procs.get(pid) or 0, used or 0) if pid in procs else used
            live = nvml.live_readings(n, h, ("util_pct", "power_w"))
    except nvml.NvmlUnavailable as exc:
        return GpuReading(missing=str(exc))
    named = []
    for pid, used in sorted(procs.items()):
        try:
            name = psutil.Process(pid).name()
        except psutil.Error:
            name = f"pid {pid}"          # another container's process: NVML sees it, /proc does not
        named.append(GpuProcess(pid, name, used))
    return GpuReading(total_bytes=int(mem.total) if mem is not None else None,
                      used_bytes=int(mem.used) if mem is not None else None, processes=tuple(named),
                      util_pct=live.get("util_pct"), power_w=live.get("power_w"))


# -- the binding ---------------------------------------------------------------------------------------------

def binding_node(binding: Any) -> int | None:
    """The NUMA node of a binding (a ``numa.Binding``, its dict, or the supervisor's one-line summary ``numactl
    --cpunodebind=0 --preferred=0 (node 0, CPUs 0-7)``); None when unbound or unknown."""
    if binding is None:
        return None
    if isinstance(binding, str):
        m = re.search(r"\(node (\d+)", binding)
        return int(m.group(1)) if m and not binding.strip().lower().startswith("none") else None
    node = binding.get("node") if isinstance(binding, Mapping) else getattr(binding, "node", None)
    prefix = binding.get("prefix") if isinstance(binding, Mapping) else getattr(binding, "prefix", None)
    if prefix == []:
        return None
    return int(node) if isinstance(node, int) else None


def binding_steers_memory(binding: Any) -> bool | None:
    """True when the binding puts memory on its node (``numactl --preferred``/``--membind``), False when it binds
    CPUs only, None when unknown."""
    if binding is None:
        return None
    if isinstance(binding, str):
        text = binding
    elif isinstance(binding, Mapping):
        text = " ".join(str(x) for x in binding.get("prefix") or []) or str(binding.get("summary") or "")
    else:
        text = " ".join(str(x) for x in getattr(binding, "prefix", None) or [])
    if not text:
        return None
    return "--preferred" in text or "--membind" in text


# -- the checks ----------------------------------------------------------------------------------------------

def _n(v: float | int) -> str:
    return f"{int(round(v)):,}"


def _mib(b: float) -> str:
    return f"{b / GIB:.1f} GiB" if b >= GIB else f"{b / MIB:.0f} MiB"


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    f = float(v)
    return f if f == f and abs(f) != float("inf") and f >= 0 else None


def _plan_model(plan: Mapping[str, Any] | None) -> Mapping[str, Any]:
    m = (plan or {}).get("model")
    return m if isinstance(m, Mapping) else {}


def check_experts(plan: Mapping[str, Any] | None, extra: Mapping[str, Any] | None, placement: Any = None,
                  why_unknown: str = "") -> Check:
    title = "Experts held in VRAM"
    plan = plan or {}
    if placement is not None:                      # llama.cpp: whole layers' expert tensors, from its log
        moe = [int(x) for x in _plan_model(plan).get("moe_layers") or [] if isinstance(x, int)]
        cpu = {int(x) for x in plan.get("llamacpp_cpu_layers") or [] if isinstance(x, int)}
        want = [x for x in moe if x not in cpu]
        on_gpu = placement.expert_layers_on_gpu(moe) if moe else None
        planned = f"{len(want)} of {len(moe)} MoE layers' experts on the GPU" if moe else None
        if not moe or on_gpu is None:
            return Check("experts_in_vram", title, planned, None, None,
                         why_unknown or "llama-server's log does not show its buffers yet")
        missing = [x for x in want if x not in set(on_gpu)]
        measured: str | None = f"{len(on_gpu)} of {len(moe)} MoE layers' experts on the GPU"
        if not missing:
            return Check("experts_in_vram", title, planned, measured, True)
        return Check("experts_in_vram", title, planned, measured, False,
                     f"layers {', '.join(map(str, missing[:8]))}{' …' if len(missing) > 8 else ''} planned on the "
                     "GPU are in RAM: llama-server fell back (a CPU-only build, or the GPU was short of memory). "
                     "Use a CUDA build, close other programs on the GPU, or re-plan with the VRAM free now "
                     "(`dsv41 plan`), then restart the engine.")
    hot = _num(plan.get("hot_experts"))
    eb = _num(_plan_model(plan).get("expert_bytes"))
    planned = None if hot is None else f"{_n(hot)} experts" + (f" ({_mib(hot * eb)})" if eb else "")
    slots = _num((extra or {}).get("expert_slots"))
    cache_mib = _num((extra or {}).get("expert_cache_mib"))
    measured = None if slots is None else f"{_n(slots)} experts" + (
        f" ({_mib(cache_mib * MIB)})" if cache_mib is not None else "")
    if hot is None or slots is None:
        why = why_unknown or ("the plan has no hot set" if hot is None else
                              "the engine does not report its expert slots")
        return Check("experts_in_vram", title, planned, measured, None, why)
    if slots >= hot:
        return Check("experts_in_vram", title, planned, measured, True)
    short = hot - slots
    fix = (f"The engine holds {_n(short)} experts fewer than planned"
           + (f" ({_mib(short * eb)} of VRAM it could not get)" if eb else "")
           + ": its expert cache came up short, so more experts are computed on the CPU and decode is slower. "
             "Close other programs on the GPU, or re-plan with the VRAM free now (`dsv41 plan`), then restart "
             "the engine.")
    return Check("experts_in_vram", title, planned, measured, False, fix)


def check_arena(plan: Mapping[str, Any] | None, extra: Mapping[str, Any] | None, why_unknown: str = "") -> Check:
    title = "Pinned host arena"
    plan = plan or {}
    cold_b = _num(plan.get("cold_expert_bytes"))
    if cold_b is None:
        cold, eb = _num(plan.get("cold_experts")), _num(_plan_model(plan).get("expert_bytes"))
        cold_b = cold * eb if cold is not None and eb is not None else None
    arena = _num((extra or {}).get("arena_mib"))
    planned = None if cold_b is None else f"≥ {_mib(cold_b)} (the cold experts)"
    measured = None if arena is None else _mib(arena * MIB)
    if cold_b is None or arena is None:
        return Check("host_arena", title, planned, measured, None,
                     why_unknown or ("the plan has no cold experts" if cold_b is None
                                     else "the engine does not report its host arena"))
    if arena * MIB >= 0.99 * cold_b:
        return Check("host_arena", title, planned, measured, True)
    return Check("host_arena", title, planned, measured, False,
                 f"The engine pinned {_mib(arena * MIB)} of host memory for experts, the plan needs "
                 f"{_mib(cold_b)}: the rest is read from the model file, far slower. Free RAM (close other "
                 "programs; check `ulimit -l` and the RAM the plan assumed), or re-plan with the RAM free now "
                 "(`dsv41 plan`), then restart the engine.")


def check_file_reads(extra: Mapping[str, Any] | None, why_unknown: str = "") -> Check:
    title = "No expert reads from the file"
    extra = extra or {}
    blobs, mb, n = (_num(extra.get(k)) for k in ("file_blobs_recent", "file_mb_recent", "file_reads_requests"))
    planned = "0 (every expert from VRAM or pinned RAM)"
    if blobs is None:
        return Check("no_file_reads", title, planned, None, None,
                     why_unknown or "no finished request reports its expert reads yet (send one)")
    measured = f"{_n(blobs)} expert reads from the file" + (f" ({mb:,.1f} MB)" if mb else "") + (
        (f" in the last {_n(n)} finished requests" if n > 1 else " in the last finished request") if n else "")
    if blobs == 0:
        return Check("no_file_reads", title, planned, measured, True)
    return Check("no_file_reads", title, planned, measured, False,
                 "The engine fell back to reading experts from the model file (its pinned RAM arena was not "
                 "allocated or is too small): decode runs at a fraction of its speed. Free RAM or lower the plan's "
                 "RAM use (`dsv41 plan`), check that page-locked memory is allowed (`ulimit -l`), then restart the "
                 "engine.")


def check_numa_memory(binding: Any, proc: ProcReading | None) -> Check:
    title = "Memory on the bound NUMA node"
    node = binding_node(binding)
    steers = binding_steers_memory(binding)
    if node is None:
        return Check("numa_memory", title, "not bound", _node_words(proc), None,
                     "the engine runs without a NUMA binding (see `dsv41 binding`)" if binding else
                     "the binding is not known here")
    planned = f"≥ {NUMA_MIN_SHARE:.0%} on node {node}"
    if proc is None or proc.missing or not proc.node_bytes:
        why = (proc.missing or proc.numa_missing) if proc is not None else None
        return Check("numa_memory", title, planned, None, None, why or "the engine's memory was not measured")
    total = sum(proc.node_bytes.values())
    share = proc.node_bytes.get(node, 0) / total if total else 0.0
    measured = _node_words(proc)
    if steers is False:
        return Check("numa_memory", title, f"node {node} by first touch (the binding steers CPUs only)", measured,
                     None, "the binding does not steer memory (numactl's memory policy was refused here)")
    if share >= NUMA_MIN_SHARE:
        return Check("numa_memory", title, planned, measured, True)
    return Check("numa_memory", title, planned, measured, False,
                 f"Only {share:.0%} of the engine's memory is on node {node}, the GPU's node: experts computed on "
                 "the CPU cross the socket link. Free memory on that node (`numastat -m`), stop other programs "
                 "bound there, then restart the engine; `dsv41 binding` shows what the binding can do here.")


def _node_words(proc: ProcReading | None) -> str | None:
    if proc is None or not proc.node_bytes:
        return None
    total = sum(proc.node_bytes.values()) or 1
    return ", ".join(f"node {n}: {_mib(b)} ({b / total:.0%})" for n, b in sorted(proc.node_bytes.items()))


def check_affinity(binding: Any, proc: ProcReading | None) -> Check:
    from .hardware import format_cpulist
    from .numa import binding_cpus

    title = "CPU affinity as bound"
    cpus = binding_cpus(binding)
    measured = None
    if proc is not None and proc.affinity:
        measured = f"CPUs {format_cpulist(list(proc.affinity))}"
    if not cpus:
        return Check("cpu_affinity", title, "not bound", measured, None,
                     "the engine runs without a CPU binding (see `dsv41 binding`)" if binding else
                     "the binding is not known here")
    planned = f"CPUs {format_cpulist(cpus)}"
    if proc is None or proc.missing or not proc.affinity:
        return Check("cpu_affinity", title, planned, measured, None,
                     (proc.missing if proc is not None else None) or "the engine's CPU affinity cannot be read")
    extra = sorted(set(proc.affinity) - set(cpus))
    if not extra:
        return Check("cpu_affinity", title, planned, measured, True)
    return Check("cpu_affinity", title, planned, measured, False,
                 f"The engine may run on CPUs {format_cpulist(extra)} outside the bound node: the binding prefix "
                 "did not apply (or something changed its affinity). Restart the engine from the panel; "
                 "`dsv41 binding` shows which binding works here.")


def check_vram(plan: Mapping[str, Any] | None, gpu: GpuReading | None, pids: Iterable[int] = ()) -> Check:
    title = "VRAM for the plan"
    vram = (plan or {}).get("vram")
    need = _num(vram.get("total_bytes")) if isinstance(vram, Mapping) else None
    planned = None if need is None else f"{_mib(need)} on the GPU"
    if gpu is None or gpu.missing or gpu.total_bytes is None:
        return Check("vram_available", title, planned, None, None,
                     (gpu.missing if gpu is not None else None) or "the GPU was not read")
    mine = set(pids)
    others = sum(p.used_bytes or 0 for p in gpu.processes if p.pid not in mine)
    avail = gpu.total_bytes - others
    measured = f"{_mib(avail)} of {_mib(gpu.total_bytes)} not held by other processes"
    if need is None:
        return Check("vram_available", title, planned, measured, None, "the plan has no VRAM layout")
    if avail >= need:
        return Check("vram_available", title, planned, measured, True)
    return Check("vram_available", title, planned, measured, False,
                 f"The plan puts {_mib(need)} on the GPU but only {_mib(avail)} is left beside other processes: "
                 "close them, or re-plan with the VRAM free now (`dsv41 plan`), then restart the engine.")


def check_gpu_others(gpu: GpuReading | None, pids: Iterable[int] = ()) -> Check:
    title = "Other processes on the GPU"
    if gpu is None or gpu.missing:
        return Check("gpu_other_processes", title, "none", None, None,
                     (gpu.missing if gpu is not None else None) or "the GPU was not read")
    mine = set(pids)
    others = [p for p in gpu.processes if p.pid not in mine]
    if not others:
        return Check("gpu_other_processes", title, "none", "none", True)
    words = ", ".join(f"{p.name} (pid {p.pid}" + (f", {_mib(p.used_bytes)})" if p.used_bytes else ")")
                      for p in others[:6]) + (" …" if len(others) > 6 else "")
    return Check("gpu_other_processes", title, "none", words, False,
                 f"{words} also use the GPU: they take VRAM the plan counted on and compete for the GPU. Close them "
                 "(or let them finish), or re-plan with the VRAM left (`dsv41 plan`).")


def run_checks(*, plan: Mapping[str, Any] | None, extra: Mapping[str, Any] | None = None, binding: Any = None,
               proc: ProcReading | None = None, gpu: GpuReading | None = None, placement: Any = None,
               engine_missing: str = "", local: bool = True) -> list[Check]:
    """The checks from the readings: ``extra`` is :func:`facts_from_metrics` of the engine's ``/metrics``
    (``expert_slots``, ``arena_mib``, ``file_blobs_recent`` …; None when the engine did not answer:
    ``engine_missing`` says why), ``placement`` llama.cpp's placement from its log (else None), ``proc``/``gpu``
    the readings of this machine
    (``local`` False: the engine runs elsewhere and this machine's figures are not its)."""
    why = engine_missing if extra is None else ""
    pids = proc.pids if proc is not None else ()
    out = [check_experts(plan, extra, placement, why)]
    if placement is None:                      # llama.cpp reports neither a host arena nor file reads
        out += [check_arena(plan, extra, why), check_file_reads(extra, why)]
    if not local:
        there = "the engine runs on another machine: this machine's figures are not its"
        out += [Check(n, t, None, None, None, there) for n, t in (
            ("numa_memory", "Memory on the bound NUMA node"), ("cpu_affinity", "CPU affinity as bound"),
            ("vram_available", "VRAM for the plan"), ("gpu_other_processes", "Other processes on the GPU"))]
        return out
    return out + [check_numa_memory(binding, proc), check_affinity(binding, proc), check_vram(plan, gpu, pids),
                  check_gpu_others(gpu, pids)]


@dataclass
class CheckReport:
    """The checks and the readings they came from (the watchdog and the diagnostic bundle reuse them)."""

    checks: list[Check]
    gpu: GpuReading | None = None
    proc: ProcReading | None = None
    t: float = 0.0
    extras: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"t": self.t, "summary": summary(self.checks), "checks": [c.to_dict() for c in self.checks]}


def facts_from_metrics(doc: Any) -> dict[str, Any]:
    """What the checks read from a Strata-shaped ``/metrics`` JSON document (serve/server.py @2291cb3
    ``Service.metrics``; the scripted engine answers the same): the INFO line's ``engine.expert_slots``,
    ``expert_cache_mib``, ``arena_mib``, ``vram_free_mib`` and the listed finished requests' expert reads from the
    model file (``requests[].file_blobs`` / ``file_mb``, from the engine's DONE line): ``file_blobs_recent``
    (None when no listed request says), ``file_mb_recent``, ``file_reads_requests``. Anything not a
    non-negative finite number is left out."""
    doc = doc if isinstance(doc, Mapping) else {}
    eng = doc.get("engine") if isinstance(doc.get("engine"), Mapping) else {}
    out: dict[str, Any] = {k: _num(eng.get(k)) for k in ("expert_slots", "expert_cache_mib", "arena_mib",
                                                         "vram_free_mib")}
    blobs, mb, n = 0.0, 0.0, 0
    reqs = doc.get("requests")
    for r in (reqs if isinstance(reqs, list) else [])[:64]:
        b = _num(r.get("file_blobs")) if isinstance(r, Mapping) else None
        if b is None:
            continue
        n += 1
        blobs += b
        mb += _num(r.get("file_mb")) or 0.0
    out.update(file_blobs_recent=blobs if n else None, file_mb_recent=round(mb, 1) if n else None,
               file_reads_requests=n or None)
    return {k: v for k, v in out.items() if v is not None}


def read_metrics_facts(base_url: str, api_key: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """GET ``/metrics`` as JSON (the key as a bearer header; the answer capped at the metrics cap and read within
    ``timeout_s``) and :func:`facts_from_metrics` of it. An engine whose ``/metrics`` is not that JSON (llama.cpp's
    Prometheus text) gives ``{}``. Raises ``httpx.HTTPError`` / ``ValueError`` when it does not answer."""
    import httpx

    from .engines._http import METRICS_BODY_CAP, bearer_headers, get_capped, json_body

    with httpx.Client(timeout=timeout_s, verify=tls_verify()) as client:
        r = get_capped(client, base_url.rstrip("/") + "/metrics",
                       headers={**bearer_headers(api_key), "Accept": "application/json"}, cap=METRICS_BODY_CAP,
                       deadline_s=timeout_s)
        r.raise_for_status()
        if "json" not in r.headers.get("content-type", ""):
            return {}
        return facts_from_metrics(json_body(r))


def collect_checks(running: Any, *, plan: Mapping[str, Any] | None = None, placement: Any = None,
                   binding: Any = None, timeout_s: float = 5.0) -> CheckReport:
    """Read everything for ``running`` (a :class:`~engine_manager.engine_state.RunningEngine`) and run the checks.
    Blocking (one HTTP request, /proc, NVML): call it off a GUI thread."""
    import time

    t = time.time()
    plan = plan if plan is not None else (running.with_plan().plan if hasattr(running, "with_plan") else None)
    extra: dict[str, Any] | None = None
    missing = ""
    try:
        extra = read_metrics_facts(running.base_url, running.api_key, timeout_s)
    except Exception as exc:  # noqa: BLE001 - an engine that does not answer: its checks are unknown, said why
        missing = f"the engine did not answer ({type(exc).__name__}: {str(exc)[:160]})"
    local = bool(getattr(running, "on_this_machine", True))
    proc = read_process(running.pid) if local else None
    gpu = read_gpu(int(getattr(running, "gpu_index", 0) or 0)) if local else None
    checks = run_checks(plan=plan, extra=extra, binding=binding if binding is not None else running.binding,
                        proc=proc, gpu=gpu, placement=placement, engine_missing=missing, local=local)
    return CheckReport(checks, gpu=gpu, proc=proc, t=t, extras=extra or {})


def checks_for_status(status: Any, settings: Any, placement: Any = None) -> CheckReport | None:
    """The checks of the engine the supervisor's ``status`` describes, when it is ready (else None): what
    ``dsv41 status`` prints and ``--json`` carries."""
    from .engine_state import RunningEngine

    if getattr(status, "state", None) != "ready" or not getattr(status, "base_url", None):
        return None
    running = RunningEngine.from_status(status, status.base_url, getattr(settings, "api_key", "") or "",
                                        gpu_index=getattr(settings, "gpu_index", 0))
    return collect_checks(running, placement=placement, binding=status.binding)


def pid_alive(pid: int | None) -> bool | None:
    if not pid:
        return None
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


__all__ = ["Check", "CheckReport", "GpuProcess", "GpuReading", "ProcReading", "binding_node",
           "binding_steers_memory", "checks_for_status", "collect_checks", "engine_pids", "facts_from_metrics",
           "failed", "parse_numa_maps", "pid_alive", "read_gpu", "read_metrics_facts", "read_numa_maps",
           "read_process", "run_checks", "summary"]
