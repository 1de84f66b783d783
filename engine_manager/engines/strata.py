"""The deepseek-one-gpu / Strata engine behind the panel's interface (ENGINE_CONTRACT.md §2).

Launch: ``<python> <engine>/serve/server.py --config <workdir>/strata-config.json --host 127.0.0.1 --port N
--gpu G`` with the key in the environment as ``STRATA_API_KEY``. The config JSON is Strata's setup config (``exe`` =
the native engine binary, ``args`` = its arguments: the model's first shard, then the engine flags the plan
decides: ``--expert-cache``, ``--expert-profile`` (the planner's STRP file), ``--vram-reserve-mib``, ``--batch``,
``--max-context``, ``--kv``, ``--cpu-numerics``).

The key: the contract names ``--api-key KEY``, but a command line is readable by every local user (``ps``), and the
keeper's command line repeats the engine's. Strata's ``serve/server.py`` takes the same key from the environment:
its ``--api-key`` defaults to ``$STRATA_API_KEY`` (Niko1221/Strata, ``serve/server.py`` ``main()``; an empty value
there is refused, so it is only set when there is a key). The environment of a process is readable only by its
owner and root. The key never goes into the config file either. The engine lives in ``settings.engine_dir`` (an unpacked release), else ``<cache_dir>/engine/<version>``.

Readiness: in normal (eager) mode the server opens its port only after the engine printed READY, so *connection
refused = still loading*; ``/health`` 200 with ``loaded`` true = ready.

Metrics: ``/metrics`` JSON (``live``, ``requests[]``, ``engine``, ``hardware``, ``totals``) or Prometheus text
(``strata:*``, ``vllm:*``) map onto :class:`~engine_manager.engines.base.Sample` with the contract's field names.
Expert swaps are not on HTTP in Strata: they come from the adaptive tier's log lines (:meth:`parse_log_line`),
so :meth:`poll` leaves ``swaps_*`` missing for a real Strata.

Log formats beyond what the contract states (phase lines, the adaptive tier's swap report) are matched
tolerantly; the scripted engine (``engine_manager.sim``) prints the forms matched here. There is no real Strata on
the build machines: the adapter is tested against the contract's field names and against the scripted engine.
"""

from __future__ import annotations

import json
import re
import struct
import sys
import time
from pathlib import Path
from typing import Any

from ..atomic import atomic_write_bytes, atomic_write_json
from ..errors import PlacementRefused
from .base import (
    Engine,
    FailureHint,
    LaunchSpec,
    LogEvent,
    LogPattern,
    Readiness,
    Sample,
)

DEFAULT_RELEASE = "v0.1.0"                 # the guides' engine release (prebuilt for sm_120)
CONFIG_NAME = "strata-config.json"
KEY_ENV = "STRATA_API_KEY"        # what serve/server.py reads when --api-key is not given
PROFILE_NAME = "expert-profile.strp"
FIRST_SHARD = "DeepSeek-V4.1-Flash-Q2_K-00001-of-00007.gguf"
ENGINE_BINARIES = ("bin/strata", "build/bin/strata", "build/strata", "strata", "bin/strata-engine")

# Strata's hardware block reports NVML's PCIe KB/s divided by 1024; × 1.024 gives 10^6 bytes/s (Sample's MB/s).
STRATA_MB_TO_MB = 1.024


# ------------------------------------------------------------------------------------------------ failures
def _p(regex: str, cause: str, title: str, fix: str) -> LogPattern:
    return LogPattern(re.compile(regex, re.I), FailureHint(cause, title, fix))


FAILURE_PATTERNS: list[LogPattern] = [
    _p(r"CUDA (error: )?out of memory|cudaMalloc\w* failed|cudaErrorMemoryAllocation|CUBLAS_STATUS_ALLOC_FAILED",
       "cuda_oom", "The GPU ran out of memory (CUDA out of memory / cudaMalloc failed)",
       "Lower the expert cache (fewer hot experts), the context length or the slots on the Placement tab, or "
       "raise --vram-reserve-mib; close other programs using the GPU (nvidia-smi shows them)."),
    _p(r"driver version is insufficient|cudaErrorInsufficientDriver|driver (is )?too old|"
       r"needs? (NVIDIA )?driver|requires (NVIDIA )?driver",
       "driver_too_old", "The NVIDIA driver is too old for this engine",
       "Install NVIDIA driver 580.65 or newer (CUDA 13), reboot, and start again (`dsv41 doctor` checks it)."),
    _p(r"port \d+.*(already in use|in use)|Address already in use|EADDRINUSE",
       "port_in_use", "The engine's port is already in use",
       "Stop the other server on that port (`ss -ltnp` shows which) or choose another port in Settings."),
    _p(r"placement refused|expert profile refused|profile .*(differ|mismatch)|refus\w+ (the )?profile",
       "placement_refused", "The engine refused the placement (expert profile or plan)",
       "Make the plan again for this model (Placement tab or `dsv41 plan`) so the profile matches its layers "
       "and experts, then start again."),
    _p(r"unrecognized arguments|error: argument --|unknown (engine )?(flag|option|argument)",
       "bad_engine_flag", "The engine refused a command-line flag",
       "The engine release may be older than the panel expects: download the pinned release again, or remove "
       "the flag named in the log."),
    _p(r"No such file or directory.*\.gguf|failed to (open|read|load) .*\.gguf|model file .*not found",
       "model_missing", "The model files were not found",
       "Download the model (Downloads tab / `dsv41 download`) or point DSV41_MODEL_DIR at the folder that holds "
       "all seven shards."),
    _p(r"illegal memory access|Segmentation fault|SIGSEGV|core dumped|Aborted",
       "engine_crash", "The engine crashed",
       "Start again; if it repeats, save the log (Log tab) and report it with the engine version."),
]

OOM_KILLED = FailureHint(
    "oom_killed", "The engine was killed by SIGKILL — most likely the kernel's out-of-memory killer",
    "Check with `journalctl -k | grep -i oom` (or `dmesg`). Free RAM, or lower the RAM the plan needs "
    "(fewer slots, shorter context), then start again.")


def classify(patterns: list[LogPattern], returncode: int | None, log_tail: list[str]) -> FailureHint | None:
    for line in reversed(log_tail):
        for pat in patterns:
            if pat.regex.search(line):
                return pat.hint
    if returncode in (-9, 137):
        return OOM_KILLED
    return None


# ------------------------------------------------------------------------------------------------ log lines
_READY = re.compile(r"^\s*(\[[^\]]*\]\s*)?READY\b|\bserver (is )?ready\b|Uvicorn running on", re.I)
_PHASE = re.compile(r"^\s*(?:\[[^\]]*\]\s*)?phase:\s*(?P<text>.+)$", re.I)
_LOADING = re.compile(r"^\s*(loading|reading|mapping|filling|pinning|allocating|warming|downloading)\b", re.I)
_PCT = re.compile(r"\((\d{1,3})%\)|\b(\d{1,3})%")
_SWAP = re.compile(r"\badapt\w*\b.*?\b(?:swapped (?P<a>\d+) experts?|(?P<b>\d+) (?:expert )?swaps?)\b", re.I)
_SIZE = re.compile(r"\(?([\d.]+) ?(KiB|MiB|GiB|KB|MB|GB)\b")
_INFO = re.compile(r"^\s*INFO\b(?P<rest>.*)$")
_KV = re.compile(r"(\w+)=(\S+)")
_HIT = re.compile(r"expert cache ([\d.]+)% hit(?: \(\+([\d.]+)% of the routed experts over PCIe\))?", re.I)
_UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "KB": 10**3, "MB": 10**6, "GB": 10**9}


def _num(v: str) -> Any:
    try:
        return int(v)
    except ValueError:
        try:
            return float(v)
        except ValueError:
            return v


def parse_strata_log_line(line: str, patterns: list[LogPattern] | None = None) -> LogEvent | None:
    """Phases, READY, adaptive-tier swaps, INFO key=value lines, per-request hit lines, known failures."""
    text = line.rstrip("\r\n")
    if not text.strip():
        return None
    if _READY.search(text):
        return LogEvent("ready", text.strip())
    m = _INFO.match(text)
    if m:
        data = {k: _num(v) for k, v in _KV.findall(m.group("rest"))}
        kind = "placement" if any(k.startswith("expert") for k in data) else "info"
        return LogEvent(kind, text.strip(), data=data)
    m = _SWAP.search(text)
    if m:
        n = int(m.group("a") or m.group("b"))
        size = _SIZE.search(text[m.end():]) or _SIZE.search(text)
        nbytes = int(float(size.group(1)) * _UNITS[size.group(2)]) if size else 0
        return LogEvent("swap", text.strip(), swaps=n, swap_bytes=nbytes)
    m = _PHASE.match(text)
    if m or _LOADING.match(text):
        body = m.group("text").strip() if m else text.strip()
        pct = _PCT.search(body)
        data = {"pct": int(pct.group(1) or pct.group(2))} if pct else {}
        return LogEvent("phase", body, data=data)
    m = _HIT.search(text)
    if m:
        data = {"hit_rate": float(m.group(1)) / 100}
        if m.group(2) is not None:
            data["pcie_share"] = float(m.group(2)) / 100
        return LogEvent("info", text.strip(), data=data)
    for pat in patterns if patterns is not None else FAILURE_PATTERNS:
        if pat.regex.search(text):
            return LogEvent("error", text.strip(), data={"cause": pat.hint.cause})
    return None


# ------------------------------------------------------------------------------------------------ metrics
def _f(v: Any) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return float(v) if v == v and abs(v) != float("inf") else None
    return None


def _i(v: Any) -> int | None:
    f = _f(v)
    return int(f) if f is not None else None


def _rate01(v: Any) -> float | None:
    f = _f(v)
    return f if f is not None and 0.0 <= f <= 1.0 else None


def newest_request(requests: Any) -> dict[str, Any] | None:
    """The request with the latest ``time`` wherever it sits (else the first entry)."""
    rows = [r for r in (requests or []) if isinstance(r, dict)] if isinstance(requests, list) else []
    if not rows:
        return None
    timed = [r for r in rows if _f(r.get("time")) is not None]
    return max(timed, key=lambda r: float(r["time"])) if timed else rows[0]


def sample_from_metrics(doc: dict[str, Any], engine: str, previous: Sample | None = None,
                        t: float | None = None, simulated: bool = False,
                        status: dict[str, Any] | None = None) -> Sample:
    """Map Strata's ``/metrics`` JSON (and optionally ``/v1/status``) to a Sample. Missing stays None."""
    t = time.time() if t is None else t
    live = doc.get("live") if isinstance(doc.get("live"), dict) else {}
    eng = doc.get("engine") if isinstance(doc.get("engine"), dict) else {}
    hw = doc.get("hardware") if isinstance(doc.get("hardware"), dict) else {}
    totals = doc.get("totals") if isinstance(doc.get("totals"), dict) else {}
    last = newest_request(doc.get("requests"))
    s = Sample(t=t, engine=engine, simulated=simulated)
    s.state = live.get("state") if isinstance(live.get("state"), str) else None
    s.decode_tok_s = _f(live.get("tok_s"))
    s.queued = _i(live.get("queued"))
    # prefill: live rate while a prompt is being read (prompt_read delta), else the last request's
    pr, pt = _i(live.get("prompt_read")), _i(live.get("prompt_total"))
    prev_pr = previous.extra.get("prompt_read") if previous else None
    prev_pt = previous.extra.get("prompt_total") if previous else None
    if s.state == "reading" and pr is not None and prev_pr is not None and prev_pt == pt and previous \
            and t > previous.t and pr >= prev_pr:
        s.prefill_tok_s = (pr - prev_pr) / (t - previous.t)
    elif last and _f(last.get("prompt_ms")) and _f(last.get("prompt_tokens")) is not None:
        read = float(last["prompt_tokens"]) - float(_f(last.get("reused")) or 0)
        s.prefill_tok_s = read / (float(last["prompt_ms"]) / 1000) if float(last["prompt_ms"]) > 0 else None
    else:
        s.prefill_tok_s = _f(live.get("prefill_tok_s_mean"))
    # hit rate: in-flight slots when the engine lists them (the scripted engine does), else the newest request
    slots = live.get("slots") if isinstance(live.get("slots"), list) else None
    if slots:
        per = {int(x["slot"]): float(x["decode_tok_s"]) for x in slots
               if isinstance(x, dict) and _i(x.get("slot")) is not None and _f(x.get("decode_tok_s")) is not None}
        s.decode_tok_s_per_slot = per or None
        weighted = [(float(x["hit_rate"]), float(_f(x.get("generated")) or 0)) for x in slots
                    if isinstance(x, dict) and _rate01(x.get("hit_rate")) is not None]
        wsum = sum(w for _, w in weighted)
        if weighted and wsum > 0:
            s.hit_rate = sum(h * w for h, w in weighted) / wsum
    if s.hit_rate is None and last:
        s.hit_rate = _rate01(last.get("hit_rate"))
    s.slots_total = _i(eng.get("batch_slots")) or _i(eng.get("slots"))
    if slots is not None:
        s.slots_busy = len(slots)
    elif status and isinstance(status.get("activity"), dict):
        s.slots_busy = _i(status["activity"].get("in_flight"))
    elif s.state in ("idle", "unloaded"):
        s.slots_busy = 0
    rx, tx = _f(hw.get("gpu_pcie_rx_mb")), _f(hw.get("gpu_pcie_tx_mb"))
    s.pcie_rx_mb_s = rx * STRATA_MB_TO_MB if rx is not None else None
    s.pcie_tx_mb_s = tx * STRATA_MB_TO_MB if tx is not None else None
    s.vram_used_bytes, s.vram_total_bytes = _i(hw.get("gpu_mem_used")), _i(hw.get("gpu_mem_total"))
    s.ram_used_bytes, s.ram_total_bytes = _i(hw.get("ram_used")), _i(hw.get("ram_total"))
    if status and isinstance(status.get("machine"), dict):
        gpu = status["machine"].get("gpu") or {}
        if s.vram_used_bytes is None and _f(gpu.get("used_mib")) is not None:
            s.vram_used_bytes = int(float(gpu["used_mib"]) * (1 << 20))
        if s.vram_total_bytes is None and _f(gpu.get("total_mib")) is not None:
            s.vram_total_bytes = int(float(gpu["total_mib"]) * (1 << 20))
    s.requests_total = _i(totals.get("requests"))
    s.tokens_generated_total = _i(totals.get("output_tokens"))
    s.extra = {k: v for k, v in {
        "prompt_read": pr, "prompt_total": pt,
        "tok_s_mean": _f(live.get("tok_s_mean")), "prefill_tok_s_mean": _f(live.get("prefill_tok_s_mean")),
        "generated": _i(live.get("generated")),
        "last_decode_tok_s": _f(last.get("decode_tok_s")) if last else None,
        "last_hit_rate": _rate01(last.get("hit_rate")) if last else None,
        "last_pcie_share": _rate01(last.get("pcie_share")) if last else None,
        "last_finish": last.get("finish") if last else None,
        "gpu_util_pct": _f(hw.get("gpu_util")), "cpu_pct": _f(hw.get("cpu")),
        "expert_slots": _i(eng.get("expert_slots")), "expert_cache_mib": _f(eng.get("expert_cache_mib")),
    }.items() if v is not None}
    return s


def parse_prometheus(text: str) -> dict[str, float]:
    """``name{labels} value`` lines → {name: value} (labels dropped, values summed over label sets)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if not m:
            continue
        try:
            v = float(m.group(3))
        except ValueError:
            continue
        if v != v:        # NaN: the exporter had no value
            continue
        out[m.group(1)] = out.get(m.group(1), 0.0) + v
    return out


def sample_from_prometheus(text: str, engine: str, t: float | None = None, simulated: bool = False) -> Sample:
    m = parse_prometheus(text)
    s = Sample(t=time.time() if t is None else t, engine=engine, simulated=simulated)
    s.decode_tok_s = m.get("strata:live_tok_s")
    s.hit_rate = m.get("strata:last_hit_rate") if 0 <= m.get("strata:last_hit_rate", -1) <= 1 else None
    used = m.get("strata:gpu_mem_used_bytes")
    s.vram_used_bytes = int(used) if used is not None else None
    total = m.get("strata:gpu_mem_total_bytes")
    s.vram_total_bytes = int(total) if total is not None else None
    run = m.get("vllm:num_requests_running")
    s.slots_busy = int(run) if run is not None else None
    wait = m.get("vllm:num_requests_waiting")
    s.queued = int(wait) if wait is not None else None
    gen = m.get("vllm:generation_tokens_total")
    s.tokens_generated_total = int(gen) if gen is not None else None
    if "strata:last_decode_tok_s" in m:
        s.extra["last_decode_tok_s"] = m["strata:last_decode_tok_s"]
    return s


def auth_headers(spec: LaunchSpec) -> dict[str, str]:
    return {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}


def check_readiness(client: Any, spec: LaunchSpec, service_hint: str | None = None) -> Readiness:
    """GET /health once: connection refused → loading; 200 with loaded → ready."""
    import httpx

    try:
        r = client.get(spec.base_url + spec.health_path, timeout=5.0)
    except httpx.ConnectError:
        return Readiness("loading", "connection refused: still loading")
    except httpx.TimeoutException:
        return Readiness("loading", "/health did not answer within 5 s (busy loading?)")
    except httpx.HTTPError as exc:
        return Readiness("loading", f"/health: {exc.__class__.__name__}: {exc}")
    if r.status_code == 503:
        return Readiness("loading", "HTTP 503: engine starting")
    if r.status_code != 200:
        return Readiness("failed", f"/health answered HTTP {r.status_code}: is another server on port {spec.port}?")
    try:
        body = r.json()
    except ValueError:
        return Readiness("failed", f"/health did not answer JSON: is another server on port {spec.port}?")
    if not isinstance(body, dict):
        return Readiness("failed", "/health answered an unexpected document")
    if body.get("loaded") is False or str(body.get("status", "ok")).lower() in ("loading", "starting"):
        return Readiness("loading", f"engine says {body.get('status') or 'not loaded'}")
    svc = body.get("service")
    detail = f"{svc or 'engine'} ready: {body.get('model') or '?'}"
    if service_hint and svc and not str(svc).startswith(service_hint):
        detail += f" (note: service is {svc!r}, expected {service_hint!r})"
    return Readiness("ready", detail)


# ------------------------------------------------------------------------------------------------ profile
def write_strp(path: Path, n_layers: int, n_experts: int, pairs: list[tuple[int, int]], slots: int) -> None:
    """A Strata expert profile (ENGINE_CONTRACT.md §2), written atomically."""
    ranks = [-1] * (n_layers * n_experts)
    ranked: list[tuple[int, int]] = []
    for layer, expert in pairs:
        if 0 <= layer < n_layers and 0 <= expert < n_experts and ranks[layer * n_experts + expert] < 0:
            ranks[layer * n_experts + expert] = len(ranked)
            ranked.append((layer, expert))
    data = b"STRP" + struct.pack("<5I", 1, n_layers, n_experts, slots, len(ranked))
    data += b"".join(struct.pack("<HH", a, b) for a, b in ranked)
    data += struct.pack(f"<{len(ranks)}i", *ranks)
    atomic_write_bytes(path, data)


# ------------------------------------------------------------------------------------------------ the engine
def _release_version() -> str:
    try:
        from .. import paths

        data = json.loads((paths.resources_dir() / "manifests" / "engine.json").read_text())
        return str(data.get("version") or data.get("tag") or DEFAULT_RELEASE)
    except (OSError, ValueError, ImportError, AttributeError):
        return DEFAULT_RELEASE


def _set_flag(args: list[str], flag: str, value: Any) -> list[str]:
    """Replace every occurrence of ``flag`` (``--f v`` or ``--f=v``) by one ``flag value`` at the end."""
    out, i = [], 0
    while i < len(args):
        if args[i] == flag:
            i += 2
        elif args[i].startswith(flag + "="):
            i += 1
        else:
            out.append(args[i])
            i += 1
    if value is not None:
        out += [flag, str(value)]
    return out


class StrataEngine(Engine):
    name = "strata"
    label = "deepseek-one-gpu (Strata)"
    simulated = False
    failure_patterns = FAILURE_PATTERNS

    # -- where things are --------------------------------------------------------------------------------------
    def engine_dir(self, settings: Any) -> Path:
        if getattr(settings, "engine_dir", None):
            return Path(settings.engine_dir).expanduser()
        cache = Path(getattr(settings, "cache_path", None) or Path(settings.cache_dir).expanduser())
        return cache / "engine" / _release_version()

    def engine_binary(self, engine_dir: Path) -> Path:
        for rel in ENGINE_BINARIES:
            p = engine_dir / rel
            if p.is_file():
                return p
        return engine_dir / ENGINE_BINARIES[0]

    def python(self, engine_dir: Path) -> str:
        for rel in (".venv/bin/python", "venv/bin/python", ".venv/bin/python3"):
            p = engine_dir / rel
            if p.exists():
                return str(p)
        return sys.executable

    def model_file(self, settings: Any, plan: dict[str, Any] | None) -> str | None:
        if getattr(settings, "model_dir", None):
            d = Path(settings.model_dir).expanduser()
            first = d / FIRST_SHARD
            if first.exists():
                return str(first)
            found = sorted(d.glob("*-00001-of-*.gguf")) or sorted(d.glob("*.gguf"))
            return str(found[0]) if found else str(first)
        model = (plan or {}).get("model") or {}
        return model.get("file") or None

    def preflight(self, spec: LaunchSpec) -> list[str]:
        """Plain-words problems that would stop this launch (missing engine, binary, model, profile)."""
        problems = []
        server = Path(spec.argv[1]) if len(spec.argv) > 1 else None
        if server is None or not server.is_file():
            problems.append(f"The Strata engine is not installed: {server} does not exist. Download the engine "
                            "release (Downloads tab or `dsv41 download --engine`) or set DSV41_ENGINE_DIR to "
                            "the unpacked release.")
        cfg = spec.files.get("config")
        if cfg:
            try:
                data = json.loads(Path(cfg).read_text())
                if not Path(data.get("exe", "")).is_file():
                    problems.append(f"The engine binary {data.get('exe')} is missing from the release folder.")
                if data.get("model") and not Path(data["model"]).exists():
                    problems.append(f"The model file {data['model']} does not exist: download the model or set "
                                    "DSV41_MODEL_DIR.")
                elif not data.get("model"):
                    problems.append("No model file: set DSV41_MODEL_DIR or download the model.")
            except (OSError, ValueError) as exc:
                problems.append(f"The generated config {cfg} cannot be read: {exc}")
        return problems

    # -- launch ------------------------------------------------------------------------------------------------
    def engine_args(self, settings: Any, plan: dict[str, Any] | None, workdir: Path) -> tuple[list[str], dict]:
        """The engine's own arguments (the ``args`` of the config) and the generated files."""
        files: dict[str, str] = {}
        plan = plan or {}
        args: list[str] = list(plan.get("strata_args") or [])
        profile = plan.get("strp_path")
        if profile and Path(profile).exists():
            files["profile"] = str(profile)
        elif plan.get("hot_set"):
            model = plan.get("model") or {}
            n_layers = int(model.get("n_layers") or (max(p[0] for p in plan["hot_set"]) + 1))
            n_experts = int(model.get("n_experts") or 384)
            path = workdir / PROFILE_NAME
            pairs = [(int(a), int(b)) for a, b in plan["hot_set"]]
            write_strp(path, n_layers, n_experts, pairs, int(plan.get("hot_experts") or len(pairs)))
            profile = str(path)
            files["profile"] = profile
        else:
            profile = None
        args = _set_flag(args, "--expert-profile", profile)
        hot = plan.get("hot_experts")
        args = _set_flag(args, "--expert-cache", hot if hot is not None else "auto")
        args = _set_flag(args, "--vram-reserve-mib", int(settings.vram_reserve_mib))
        args = _set_flag(args, "--batch", int(settings.slots))
        args = _set_flag(args, "--max-context", int(settings.context_length))
        args = _set_flag(args, "--kv", settings.kv_type)
        args = _set_flag(args, "--cpu-numerics", settings.cpu_numerics)
        return args, files

    def build_launch(self, settings: Any, plan: dict[str, Any] | None, workdir: Path) -> LaunchSpec:
        if plan and plan.get("refused"):
            raise PlacementRefused(f"The placement was refused: {plan['refused']}")
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        edir = self.engine_dir(settings)
        args, files = self.engine_args(settings, plan, workdir)
        # a routing trace costs ~2 KB per token, so Strata writes one only when the plan's strata_args ask for it;
        # the flag sits in the config, not on the command line, so the monitor is told here where it is
        for i, a in enumerate(args[:-1]):
            if a == "--dump-routing":
                files["routing_trace"] = str(edir / args[i + 1])
        model = self.model_file(settings, plan)
        config = {
            "exe": str(self.engine_binary(edir)),
            "args": ([model] if model else []) + args,
            "cwd": str(edir),
            "model": model,
            "backend": "cuda",
            "max_context": int(settings.context_length),
            "port": int(settings.port),
        }
        cfg_path = workdir / CONFIG_NAME
        atomic_write_json(cfg_path, config)
        files["config"] = str(cfg_path)
        if plan:
            plan_path = workdir / "plan.json"
            atomic_write_json(plan_path, plan)
            files["plan"] = str(plan_path)
        argv = [self.python(edir), str(edir / "serve" / "server.py"), "--config", str(cfg_path),
                "--host", settings.host, "--port", str(settings.port), "--gpu", str(settings.gpu_index)]
        env = {"PYTHONUNBUFFERED": "1"}
        if settings.api_key:        # Strata's --api-key defaults to $STRATA_API_KEY: off the command line (ps)
            env[KEY_ENV] = settings.api_key
        return LaunchSpec(engine=self.name, argv=argv, host=settings.host, port=int(settings.port),
                          api_key=settings.api_key, env=env, cwd=str(edir),
                          files=files, simulated=False, label=self.label)

    # -- running -----------------------------------------------------------------------------------------------
    def readiness(self, client: Any, spec: LaunchSpec) -> Readiness:
        return check_readiness(client, spec)

    def poll(self, client: Any, spec: LaunchSpec, previous: Sample | None) -> Sample:
        """GET /metrics (JSON); GET /v1/status too when /metrics does not list the busy slots. Raises
        ``httpx.HTTPError`` when the engine does not answer or answers an error."""
        t = time.time()
        r = client.get(spec.base_url + "/metrics", headers={**auth_headers(spec), "Accept": "application/json"},
                       timeout=5.0)
        r.raise_for_status()
        if "json" not in r.headers.get("content-type", "json"):
            return sample_from_prometheus(r.text, self.name, t, simulated=self.simulated)
        doc = r.json()
        status = None
        live = doc.get("live") if isinstance(doc, dict) else None
        if not (isinstance(live, dict) and isinstance(live.get("slots"), list)):
            try:
                rs = client.get(spec.base_url + "/v1/status", headers=auth_headers(spec), timeout=5.0)
                status = rs.json() if rs.status_code == 200 else None
            except Exception:  # noqa: BLE001 - /v1/status is optional
                status = None
        return sample_from_metrics(doc if isinstance(doc, dict) else {}, self.name, previous, t,
                                   simulated=self.simulated, status=status)

    def parse_log_line(self, line: str) -> LogEvent | None:
        return parse_strata_log_line(line, self.failure_patterns)

    def classify_failure(self, returncode: int | None, log_tail: list[str]) -> FailureHint | None:
        return classify(self.failure_patterns, returncode, log_tail)


ENGINE = StrataEngine()
