"""The deepseek-one-gpu / Strata engine behind the panel's interface (docs/ENGINE_CONTRACT.md §2).

Launch, as Strata's setup/launcher start it (Niko1221/Strata ``serve/server.py`` ``main()``, ``StrataEngine``,
``engine_args``, ``child_env``): ``<python> <release>/serve/server.py --engine strata --config <run
dir>/strata-config.json --host 127.0.0.1 --port N --gpu G`` (``--engine`` defaults to ``mock``: canned replies).
The config (``exe``, ``args``: ``--pack PACK --native SHARD1`` then the plan's flags, ``cwd``, ``tokenizer``,
``model_name``, ``log``, ``lib_dirs``, ``parallel``) is in docs/ARCHITECTURE.md "The strata engine"; the pack is made
by the release's ``tools/iq_pack.py`` (:mod:`engine_manager.provision`). The key is ``$STRATA_API_KEY`` (the default
of ``serve/server.py`` ``main()``'s ``--api-key``), never on a command line (``ps``) nor in the config file.
The release: ``settings.engine_dir``, else ``<cache_dir>/engine/<version>``. Readiness: the port opens only after
READY (refused = loading); ``/health`` 200 with ``loaded`` true = ready. Metrics (:func:`sample_from_metrics`) and
log lines (:func:`parse_strata_log_line`) follow Strata's real fields and stderr formats (each one's source:
``tests/data/strata/SOURCES.md``): no swaps on HTTP nor per swap in the log, so ``swaps_*`` stay missing, and no live
hit rate (only per finished request). No real Strata runs on the build machines: the adapter is tested against
fixtures transcribed from Strata's code (``tests/data/strata/``).
"""

from __future__ import annotations

import json
import re
import struct
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generator, Literal

from .. import release_check as _release
from ..atomic import atomic_write_bytes, atomic_write_json
from ..errors import PlacementRefused
from ..figures import measured
from ..fmt import MB
from . import prometheus_text as _prom
from ..lazyre import lazy_re
from ._http import (  # noqa: F401 - NOT_STRATA: re-exported
    METRICS_BODY_CAP, NOT_STRATA, SMALL_BODY_CAP, AnswerTooLarge, bearer_headers, deadline_of, get_capped, json_body,
    probe_health)
from .base import (
    Engine,
    Evidence,
    FailureHint,
    LaunchSpec,
    LogEvent,
    LogPattern,
    Readiness,
    Sample,
    vram_share,
)

if TYPE_CHECKING:
    from ..provision import ProvisionEvent

DEFAULT_RELEASE = "v0.1.0"                 # the guides' engine release (prebuilt for sm_120)
CONFIG_NAME = "strata-config.json"
KEY_ENV = "STRATA_API_KEY"        # what serve/server.py reads when --api-key is not given
PROFILE_NAME = "expert-profile.strp"
# engine/strata first (Strata's setup layout): engine_manager.release_check owns the list
ENGINE_BINARIES = _release.ENGINE_BINARIES
READY_ENV = "STRATA_ENGINE_READY_S"   # serve/server.py @2291cb3: the server's READY deadline (default 900 s)
# the engine's own stderr: Strata's server sends the native engine's stderr to the config's "log" file (serve/server.py
# StrataEngine.__init__: stderr=open(log, "a"), else DEVNULL); the keeper follows it into the panel's engine log
ENGINE_LOG_NAME = "strata-engine.log"
MODEL_NAME = "DeepSeek-V4.1-Flash"
# where a release keeps shared libraries (serve/server.py child_env(): "lib_dirs" are prepended to LD_LIBRARY_PATH)
LIB_DIRS = ("lib", "lib64", "bin/lib")

# Strata's hardware block reports NVML's PCIe KB/s divided by 1024; × 1.024 gives 10^6 bytes/s (Sample's MB/s).
STRATA_MB_TO_MB = 1.024


# ------------------------------------------------------------------------------------------------ failures
# Matched against the engine's REAL stderr (the config's ``log`` file) and the server's own output. Formats:
# tests/data/strata/SOURCES.md (Niko1221/Strata src/program/generate.cpp @0083bb7 ``main``'s option loop and
# serve loop; serve/server.py @2291cb3 ``listen_problem``, ``start_failure_hint``, ``StrataEngine.death_note``).
def _p(regex: str, cause: str, title: str, fix: str) -> LogPattern:
    return LogPattern(lazy_re(regex, re.I), FailureHint(cause, title, fix))


UPGRADE_RELEASE = _release.UPGRADE_RELEASE

FAILURE_PATTERNS: list[LogPattern] = [
    # src/core/expert_cache.cpp @2249c24 ExpertCache::open, printed by generate.cpp as "strata generate: %s", exit 1
    _p(r"ExpertCache: \d+ slots x \d+ B = [\d.]+ GiB, but only [\d.]+ GiB of VRAM is free",
       "expert_cache_oom", "The planned hot set does not fit the VRAM that was free when the engine filled it",
       "Re-plan with the VRAM the engine found free (Placement tab or `dsv41 plan`), then start again."),
    # the dynamic loader's own words (ld.so), before main(): the prebuilt engine loads CUDA 13 from the release's
    # .venv (setup.py CUDA_WHEELS), which reaches it only through the config's lib_dirs (server.py child_env)
    _p(r"error while loading shared libraries: (libcublas|libcublasLt|libcudart)\S*",
       "cuda_libs_missing", "The engine could not load NVIDIA's CUDA libraries",
       "The prebuilt engine loads libcublas.so.13 from NVIDIA's CUDA 13 wheels in the release's .venv: install "
       "them there (`<release>/.venv/bin/python -m pip install nvidia-cublas==13.0.2.14 "
       "nvidia-cuda-runtime==13.0.96`, or run Strata's setup again), check with `dsv41 doctor`, then start again."),
    # serve/server.py @2291cb3 StrataEngine.__init__: EngineDied("the engine did not report READY within N s ...")
    _p(r"did not report READY within [\d.]+ s",
       "engine_ready_timeout", "Strata's server stopped the engine: it did not finish loading in the time allowed",
       "The panel gives Strata's server its own readiness timeout (STRATA_ENGINE_READY_S). A first load of the "
       "264 GB model from a slow disk can take longer: raise it (`dsv41 settings set ready_timeout_s 14400`, or "
       "DSV41_READY_TIMEOUT) and start again; if the load never moves, read the engine log (`dsv41 logs`)."),
    # src/program/generate.cpp @2291cb3: --native without a shard holding per_layer_token_embd.weight
    _p(r"--native requires --ple-gguf",
       "ple_gguf_missing", "This engine build cannot run this model (it needs a per-layer embedding table the "
       "model does not have)", UPGRADE_RELEASE),
    # tools/iq_pack.py @d4e6823 main(): print(f"unsupported architecture {arch!r}"), exit 1
    _p(r"unsupported architecture '[^']*'",
       "pack_arch_unsupported", "This release's iq_pack cannot prepare this model", UPGRADE_RELEASE),
    # the server run without its .venv (serve/frontend.py imports jinja2; tools/strata_tokenizer.py regex)
    _p(r"No module named '(jinja2|regex|numpy)'",
       "release_python_missing", "Strata's server ran without the Python packages of its release",
       "The server runs with the release's own .venv Python: " + _release.SETUP_HINT + "."),
    # generate.cpp main(): `unknown argument: <arg>` (then usage, exit 2); `<flag> needs a value` (exit 2)
    _p(r"^\s*unknown argument: \S+|^\s*--[\w-]+ needs a value\b|unrecognized arguments|error: argument --",
       "bad_engine_flag", "The engine refused a command-line argument",
       "The engine release does not accept an argument the panel passed (the log line names it): download the "
       "pinned engine release again, or remove that setting (e.g. CPU numerics) and start again."),
    # generate.cpp: per-site allocation failures ("session state allocation failed", ...), CUDA's own words,
    # server.py DRAFT_HEAD_FAIL ("the draft head does not fit")
    _p(r"CUDA (error: )?out of memory|\bout of memory: cuda|cudaMalloc\w* failed|cudaErrorMemoryAllocation|"
       r"CUBLAS_STATUS_ALLOC_FAILED|\ballocation failed\b|the draft head does not fit|"
       r"MiB of VRAM free with everything loaded - LOW",
       "cuda_oom", "The GPU ran out of memory (a VRAM allocation failed)",
       "Lower the expert cache (fewer hot experts), the context length or the slots on the Placement tab, or "
       "raise --vram-reserve-mib; close other programs using the GPU (nvidia-smi shows them)."),
    # generate.cpp serve loop watchdog: "no progress for N s during a request (...) ... (issue #29)"
    _p(r"no progress for \d+ s during a request|issue #29\)",
       "engine_stalled", "The engine stopped itself: it made no progress during a request",
       "Start again; if it repeats, save the engine log (Log tab) and report it with the engine version."),
    _p(r"driver version is insufficient|cudaErrorInsufficientDriver|driver (is )?too old|"
       r"needs? (NVIDIA )?driver|requires (NVIDIA )?driver",
       "driver_too_old", "The NVIDIA driver is too old for this engine",
       "Install NVIDIA driver 580.65 or newer (CUDA 13), reboot, and start again (`dsv41 doctor` checks it)."),
    # server.py listen_problem(): "port N is already in use - is Strata (or another server) already running?"
    _p(r"port \d+.*(already in use|in use)|Address already in use|EADDRINUSE",
       "port_in_use", "The engine's port is already in use",
       "Stop the other server on that port (`ss -ltnp` shows which) or choose another port in Settings."),
    _p(r"placement refused|expert profile refused|profile .*(differ|mismatch)|refus\w+ (the )?profile|"
       r"not a Strata profile|\d+x\d+, not \d+x\d+|read_expert_profile: ",
       "placement_refused", "The engine refused the placement (expert profile or plan)",
       "Make the plan again for this model (Placement tab or `dsv41 plan`) so the profile matches its layers "
       "and experts, then start again."),
    _p(r"vocab\.json",
       "tokenizer_missing", "The engine's tokenizer files are missing",
       "Prepare the model again (`dsv41 prepare --force`, or the Downloads tab's \"Prepare the model\" box): "
       "the pack's tokenizer folder is written by the release's tools/iq_pack.py."),
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


# The keeper copies the engine's own log (the config's ``log`` file) into the panel's log with this prefix
# (``engine_manager.keeper.FOLLOW_PREFIX``); the engine's words are matched without it.
ENGINE_LINE_PREFIX = "[engine] "


def _unprefixed(line: str) -> str:
    return line[len(ENGINE_LINE_PREFIX):] if line.startswith(ENGINE_LINE_PREFIX) else line


def classify(patterns: list[LogPattern], returncode: int | None, log_tail: list[str]) -> FailureHint | None:
    """The newest log line that names a known cause wins, and the hint's title carries that line — the engine's
    own words (e.g. ``unknown argument: --cpu-numerics``); a SIGKILL with none is the OOM killer."""
    for line in reversed(log_tail):
        line = _unprefixed(line)
        for pat in patterns:
            if pat.regex.search(line):
                said = line.strip()
                said = said if len(said) <= 200 else said[:197] + "..."
                fix = expert_cache_fix(line) or pat.hint.fix if pat.hint.cause == "expert_cache_oom" else pat.hint.fix
                return FailureHint(pat.hint.cause, f"{pat.hint.title} — the engine said: {said}", fix)
    if returncode in (-9, 137):
        return OOM_KILLED
    return None


_EXPERT_CACHE_OOM = lazy_re(r"ExpertCache: (?P<n>\d{1,9}) slots x (?P<b>\d{1,12}) B = (?P<want>[\d.]{1,12}) GiB, "
                               r"but only (?P<free>[\d.]{1,12}) GiB of VRAM is free \((?P<used>[\d.]{1,12}) GiB of "
                               r"(?P<total>[\d.]{1,12}) GiB total\)")


def expert_cache_fix(line: str) -> str | None:
    """The re-plan that fits, from the engine's own ExpertCache line (expert_cache.cpp @2249c24 ``ExpertCache::open``:
    N slots x B bytes = G GiB wanted, F GiB free, (U GiB used of T GiB total)): the slots that fit the free VRAM, and
    a VRAM budget for the planner lowered by what was missing (G - F) and half a GiB of margin."""
    m = _EXPERT_CACHE_OOM.search(line)
    if not m:
        return None
    try:
        n, blob = int(m["n"]), int(m["b"])
        want, free, total = float(m["want"]), float(m["free"]), float(m["total"])
    except ValueError:
        return None
    if blob <= 0 or n <= 0 or not 0 <= free < want or total <= 0:
        return None
    fits = int(free * 2**30 // blob)
    budget = max(0.0, total - (want - free) - 0.5)
    return (f"The engine asked for {n:,} expert slots ({want:.2f} GiB) but found only {free:.2f} GiB of VRAM free "
            f"after loading the rest: about {fits:,} slots fit. Re-plan with the VRAM the engine found: "
            f"`dsv41 plan --vram-gib {budget:.1f}` (or that VRAM budget on the Placement tab), then start again; "
            "close other programs using the GPU (nvidia-smi lists them) if the card should have had more free.")


# ------------------------------------------------------------------------------------------------ log lines
_READY = lazy_re(r"^\s*(\[[^\]]*\]\s*)?READY\b|\bserver (is )?ready\b|Uvicorn running on", re.I)
_PHASE = lazy_re(r"^\s*(?:\[[^\]]*\]\s*)?phase:\s*(?P<text>.+)$", re.I)
_LOADING = lazy_re(r"^\s*(loading|reading|mapping|filling|pinning|allocating|warming|downloading)\b", re.I)
# serve.py narrate_start() / Service._ensure_loaded_native() on the server's stdout; generate.cpp's load lines
_STRATA_PHASE = lazy_re(r"^\s*\[strata\] (?P<text>(starting the engine|filling the GPU's expert cache|"
                           r"experts loaded|almost ready|still starting|loading|the engine had stopped|"
                           r"the engine is running)"
                           r".*)$|^\s*strata generate: (?P<gen>(loaded [\d.]+ GiB at|expert arena:|profile .*ranked "
                           r"pairs|PCIe probe).*)$", re.I)
_PCT = lazy_re(r"\((\d{1,3})%\)|\b(\d{1,3})%")
# the scripted engine's swap report (Strata prints none per swap: SOURCES.md "Swaps")
_SWAP = lazy_re(r"\badapt\w*\b.*?\b(?:swapped (?P<a>\d+) experts?|(?P<b>\d+) (?:expert )?swaps?)\b", re.I)
_SIZE = lazy_re(r"\(?([\d.]+) ?(KiB|MiB|GiB|KB|MB|GB)\b")
_INFO = lazy_re(r"^\s*INFO\b(?P<rest>.*)$")
_KV = lazy_re(r"(\w+)=(\S+)")
# server.py Service.run's stdout: "[strata] done: N tokens ... expert cache X% hit (+Y% of the routed experts over
# PCIe)" — one finished request
_HIT = lazy_re(r"expert cache ([\d.]+)% hit(?: \(\+([\d.]+)% of the routed experts over PCIe\))?", re.I)
# generate.cpp @2291cb3 serve loop, after DONE (a solo request, or a batch admission: prompt + first token):
# "strata serve: decode expert cache hit rate: 90.0% (H hits / L lookups)[; O more read by the GPU over PCIe or from
# another GPU (P% of all R routed)]" — the experts read over PCIe are not in the lookups (#588)
_DECODE_HIT = lazy_re(r"decode expert cache hit rate: ([\d.]+)% \((\d+) hits / (\d+) lookups\)"
                         r"(?:; (\d+) more read by the GPU over PCIe or from another GPU \(([\d.]+)% of all (\d+) "
                         r"routed\))?")
# generate.cpp @2291cb3, the batch windows' report when the last slot is done (all slots' decode together):
# "strata batch: N windows, ...; routed entries per window: VRAM a (p%), PCIe b (q%), CPU c (r%)..."
_BATCH_HIT = lazy_re(r"strata batch: (\d+) windows,.*routed entries per window: VRAM [\d.]+ \(([\d.]+)%\), "
                        r"PCIe [\d.]+ \(([\d.]+)%\), CPU [\d.]+ \(([\d.]+)%\)")
# serve/server.py @2291cb3 StrataEngine.__init__: fewer batch slots than the config's "parallel" asked for
_PARALLEL = lazy_re(r"\[strata\] parallel requests: (\d+) asked, the engine runs (\d+|one at a time)")
# generate.cpp: "strata serve: prompt N tokens = R reused + F read in MS ms (X tok/s), G generated in MS ms (Y tok/s)"
_REQUEST = lazy_re(r"prompt (?P<prompt>\d+) tokens = (?P<reused>\d+) reused \+ \d+(?: of \d+)? read in "
                      r"(?P<pms>[\d.]+) ms \((?P<pp>[\d.]+) tok/s\), (?P<gen>\d+) generated in (?P<gms>[\d.]+) ms "
                      r"\((?P<tg>[\d.]+) tok/s\)")
# generate.cpp resident RAM mode, cumulative: "... N exchanged with the VRAM tier ..."
_EXCHANGED = lazy_re(r"resident RAM: [\d.]+ GiB of experts in RAM, (\d+) exchanged with the VRAM tier")
_UNKNOWN_ARG = lazy_re(r"^\s*unknown argument: (?P<arg>\S+)")
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
    """One line of the engine log (the engine's stderr, the server's output) → what the panel shows or counts.

    Strata's real lines (tests/data/strata/SOURCES.md): per-request summaries and hit rates (``info``; a finished
    request's, never a live figure), the resident mode's cumulative exchange count (``info``, ``swaps_cumulative``:
    not per-swap events, so never counted as swaps), start phases, refused arguments and failures (``error`` with
    the cause). The scripted engine's phase and swap lines are matched too."""
    text = _unprefixed(line.rstrip("\r\n"))
    if not text.strip():
        return None
    if _READY.search(text):
        return LogEvent("ready", text.strip())
    m = _INFO.match(text)
    if m:
        data = {k: _num(v) for k, v in _KV.findall(m.group("rest"))}
        kind: Literal["placement", "info"] = "placement" if any(k.startswith("expert") for k in data) else "info"
        return LogEvent(kind, text.strip(), data=data)
    m = _UNKNOWN_ARG.match(text)
    if m:
        return LogEvent("error", text.strip(), data={"cause": "bad_engine_flag", "argument": m.group("arg")})
    m = _DECODE_HIT.search(text)
    if m:
        hits, look = int(m.group(2)), int(m.group(3))
        off = int(m.group(4)) if m.group(4) is not None else 0
        return LogEvent("info", text.strip(), data={
            "hit_rate": float(m.group(1)) / 100, "hits": hits, "lookups": look, "offloaded": off,
            "pcie_share": off / (look + off) if look + off else None,
            "vram_share": hits / (look + off) if look + off else None, "decode_scope": "request",
            "finished_request": True})
    m = _BATCH_HIT.search(text)
    if m:
        vram, pcie, cpu = (float(m.group(i)) / 100 for i in (2, 3, 4))
        return LogEvent("info", text.strip(), data={
            "hit_rate": vram / (vram + cpu) if vram + cpu > 0 else None, "pcie_share": pcie, "vram_share": vram,
            "cpu_share": cpu, "batch_windows": int(m.group(1)), "decode_scope": "batch"})
    m = _PARALLEL.search(text)
    if m:
        runs = 1 if m.group(2) == "one at a time" else int(m.group(2))
        return LogEvent("info", text.strip(), data={
            "parallel_asked": int(m.group(1)), "parallel_runs": runs,
            "note": f"parallel requests: {m.group(1)} asked, the engine runs {m.group(2)} (its log says why)"})
    m = _REQUEST.search(text)
    if m:
        return LogEvent("info", text.strip(), data={
            "prompt_tokens": int(m["prompt"]), "reused": int(m["reused"]), "prompt_ms": float(m["pms"]),
            "prefill_tok_s": float(m["pp"]), "generated": int(m["gen"]), "decode_ms": float(m["gms"]),
            "decode_tok_s": float(m["tg"]), "finished_request": True})
    m = _EXCHANGED.search(text)
    if m:
        return LogEvent("info", text.strip(), data={"swaps_cumulative": int(m.group(1))})
    m = _SWAP.search(text)
    if m:
        n = int(m.group("a") or m.group("b"))
        size = _SIZE.search(text[m.end():]) or _SIZE.search(text)
        nbytes = int(float(size.group(1)) * _UNITS[size.group(2)]) if size else 0
        return LogEvent("swap", text.strip(), swaps=n, swap_bytes=nbytes)
    m = _HIT.search(text)
    if m:
        data = {"hit_rate": float(m.group(1)) / 100, "finished_request": True}
        if m.group(2) is not None:
            data["pcie_share"] = float(m.group(2)) / 100
            data["vram_share"] = vram_share(data["hit_rate"], data["pcie_share"])
        return LogEvent("info", text.strip(), data=data)
    for pat in patterns if patterns is not None else FAILURE_PATTERNS:
        if pat.regex.search(text):
            return LogEvent("error", text.strip(), data={"cause": pat.hint.cause})
    m = _PHASE.match(text) or _STRATA_PHASE.match(text)
    if m or _LOADING.match(text):
        groups = m.groupdict() if m else {}      # one of "text"/"gen" matched (non-empty); no match: the line
        body = (groups.get("text") or groups.get("gen") or text).strip()
        pct = _PCT.search(body)
        data = {"pct": int(pct.group(1) or pct.group(2))} if pct else {}
        return LogEvent("phase", body, data=data)
    return None


# ------------------------------------------------------------------------------------------------ metrics
def _obj(v: Any) -> dict[str, Any]:
    """``v`` when it is a JSON object, else an empty one (a field missing or of another type reads as absent)."""
    return v if isinstance(v, dict) else {}


def _f(v: Any) -> float | None:
    """A JSON number as a float; None when it is none or not finite (an integer past what a float holds too)."""
    return measured(v, lo=None)


def _i(v: Any) -> int | None:
    f = _f(v)
    return int(f) if f is not None else None


def _rate01(v: Any) -> float | None:
    f = _f(v)
    return f if f is not None and 0.0 <= f <= 1.0 else None


def newest_request(requests: Any) -> dict[str, Any] | None:
    """The finished request with the latest ``time`` wherever it sits (Strata lists them newest first:
    serve/server.py ``Service.metrics`` ``hist[::-1]``)."""
    rows = [r for r in (requests or []) if isinstance(r, dict)] if isinstance(requests, list) else []
    if not rows:
        return None
    timed = [r for r in rows if _f(r.get("time")) is not None]
    return max(timed, key=lambda r: float(r["time"])) if timed else rows[0]


def recent_hit_rate(requests: Any, *, admission_only: bool = False, vram: bool = False
                    ) -> tuple[float | None, int]:
    """The hit rate over the finished requests listed (Strata keeps the newest 12 in ``requests[]``), weighted by
    the tokens each decoded (hits and lookups are counted per decoded token). → (rate, requests used).

    ``admission_only``: with 2+ batch slots a request's ``hit_rate`` covers only its admission's DONE (prompt +
    first token): ``BDONE`` updates ``finish``, ``decode_ms`` and ``generated``, not ``hits``/``lookups``/
    ``offloaded`` (serve/server.py @2291cb3 ``StrataEngine.generate_batched``), so weighting it by the whole
    request's tokens would be wrong: each request counts once. ``vram``: the VRAM share of routed picks,
    ``hit_rate × (1 − pcie_share)``, instead of the engine's hit rate."""
    rows = [r for r in (requests or []) if isinstance(r, dict)] if isinstance(requests, list) else []
    num = den = 0.0
    used = 0
    for r in rows:
        h = _rate01(r.get("hit_rate"))
        if vram:
            h = vram_share(h, _rate01(r.get("pcie_share")))
        w = _f(r.get("engine_generated"))
        w = w if w is not None else _f(r.get("output_tokens"))
        if admission_only and w is not None:
            w = 1.0
        if h is None or not w or w <= 0:
            continue
        num, den, used = num + h * w, den + w, used + 1
    return (num / den if den > 0 else None), used


# Strata's slot states (serve/server.py StrataEngine.slots_view): "idle" (with held_tokens), "reading", "decoding"
BUSY_STATES = ("reading", "generating")


def slot_is_busy(slot: dict[str, Any]) -> bool:
    """What Strata itself counts as busy: ``state != "idle"`` (the test ``/slots``' ``is_processing`` and
    ``Service.metrics``' ``outside_slots`` use)."""
    return isinstance(slot, dict) and slot.get("state") != "idle"


def sample_from_metrics(doc: dict[str, Any], engine: str, previous: Sample | None = None,
                        t: float | None = None, simulated: bool = False,
                        status: dict[str, Any] | None = None) -> Sample:
    """Map Strata's ``/metrics`` JSON (serve/server.py ``Service.metrics`` @2291cb3; fields in
    tests/data/strata/SOURCES.md) to a Sample. Missing stays None, never 0.

    - decode rate: ``live.tok_s`` (a 2-s window, all requests together; null unless generating → missing). When the
      newest request is still reading while others decode (``live.state`` "reading"), the sum of the decoding slots'
      ``tok_s`` (means since each slot's first token) stands in; ``extra["decode_tok_s_source"]`` says which.
    - busy slots: the slots Strata marks busy (``state != "idle"``; idle slots are listed too). A lone request on
      the solo path sits in no slot (every slot idle, ``live.running`` 1): one busy. Without ``--batch`` (no
      ``slots``): one busy while ``live.state`` is reading/generating.
    - per-slot rates: each decoding slot's ``tok_s``; the lone request on the solo path (no slot holds it) and the
      one request of an engine without ``--batch`` are slot 0 (one busy slot is a slot).
    - prefill: while a prompt is read, that prompt's rate (``prompt_read`` growth, else the engine's PP mean) or
      missing — never the previous request's; ``extra`` keeps ``prompt_read`` of ``prompt_total``.
    - hit rate: Strata reports one only when a request finishes (``requests[].hit_rate`` from the engine's DONE line;
      no live source). ``hit_rate`` is therefore missing while a request runs and is the newest finished request's
      while idle (the Monitor labels it "last"); ``extra`` carries ``hit_rate_last`` (+ ``hit_rate_last_at``) and
      ``hit_rate_recent`` over the listed finished requests, token-weighted (+ ``hit_rate_recent_requests``), and
      ``hit_rate_live`` None with ``hit_rate_live_missing`` saying why. ``pcie_share`` (the newest finished
      request's share of routed picks read over PCIe, not in its lookups) and ``extra["vram_share_last"]`` /
      ``["vram_share_recent"]`` (``hit_rate × (1 − pcie_share)``: the share served from VRAM). With 2+ slots a
      request's figures cover its admission only (``extra["hit_rate_scope"]`` "admission"; the recent figure then
      counts each request once).
    - PCIe: ``hardware.gpu_pcie_rx_mb``/``tx_mb`` (NVML KB/s ÷ 1024).
    ``status`` (``/v1/status``) fills the VRAM figures when ``hardware`` has none."""
    t = time.time() if t is None else t
    live, eng = _obj(doc.get("live")), _obj(doc.get("engine"))
    hw, totals = _obj(doc.get("hardware")), _obj(doc.get("totals"))
    last = newest_request(doc.get("requests"))
    s = Sample(t=t, engine=engine, simulated=simulated)
    s.state = live.get("state") if isinstance(live.get("state"), str) else None
    busy_state = s.state in BUSY_STATES
    s.queued = _i(live.get("queued"))
    slots = live.get("slots") if isinstance(live.get("slots"), list) else None
    slot_rows = [x for x in (slots or []) if isinstance(x, dict) and _i(x.get("slot")) is not None]
    decoding = {int(x["slot"]): float(x["tok_s"]) for x in slot_rows
                if x.get("state") == "decoding" and _f(x.get("tok_s")) is not None}
    # decode rate
    s.decode_tok_s = _f(live.get("tok_s"))
    source = "live.tok_s" if s.decode_tok_s is not None else None
    if s.decode_tok_s is None and decoding:
        s.decode_tok_s, source = sum(decoding.values()), "slots.tok_s"
    # busy slots and per-slot rates
    running = _i(live.get("running"))
    solo = False
    if slots is not None:
        in_slots = sum(1 for x in slot_rows if slot_is_busy(x))
        solo = in_slots == 0 and busy_state and (running is None or running > 0)
        s.slots_busy = 1 if solo else in_slots
        # the lone request on the solo path sits in no slot: one busy slot is still a slot, drawn as slot 0
        s.decode_tok_s_per_slot = ({0: s.decode_tok_s} if s.decode_tok_s is not None else {}) if solo else decoding
    elif s.state is not None:
        s.slots_busy = 1 if busy_state else 0
        # no --batch: one request at a time, in the one slot there is
        s.decode_tok_s_per_slot = {0: s.decode_tok_s} if s.decode_tok_s is not None else {}
    s.slots_total = _i(live.get("parallel")) or _i(eng.get("batch_slots")) or (len(slot_rows) or None)
    if s.slots_total is None and s.state is not None:
        s.slots_total = 1                     # no --batch: one request at a time (/v1/status concurrency.serving)
    # prefill: live while a prompt is read (prompt_read delta, else the engine's PP mean), else the last request's
    pr, pt = _i(live.get("prompt_read")), _i(live.get("prompt_total"))
    prev_pr = previous.extra.get("prompt_read") if previous else None
    prev_pt = previous.extra.get("prompt_total") if previous else None
    if s.state == "reading" and pr is not None and prev_pr is not None and prev_pt == pt and previous \
            and t > previous.t and pr > prev_pr:
        s.prefill_tok_s = (pr - prev_pr) / (t - previous.t)
    elif s.state == "reading" and _f(live.get("prefill_tok_s_mean")) is not None:
        s.prefill_tok_s = _f(live.get("prefill_tok_s_mean"))
    elif s.state == "reading":
        s.prefill_tok_s = None          # this prompt's rate is not known yet: never the previous request's as live
    elif last and _f(last.get("prompt_ms")):
        read = _f(last.get("prompt_read"))
        if read is None and _f(last.get("prompt_tokens")) is not None:
            read = float(last["prompt_tokens"]) - float(_f(last.get("reused")) or 0)
        ms = float(last["prompt_ms"])
        s.prefill_tok_s = read / (ms / 1000) if read is not None and ms > 0 else None
    # hit rate: no live source in Strata (SOURCES.md "Swaps / Live hit rate")
    hit_last = _rate01(last.get("hit_rate")) if last else None
    pcie_last = _rate01(last.get("pcie_share")) if last and hit_last is not None else None
    batch = (_i(live.get("parallel")) or _i(eng.get("batch_slots")) or 0) >= 2
    hit_recent, recent_n = recent_hit_rate(doc.get("requests"), admission_only=batch)
    vram_recent, _ = recent_hit_rate(doc.get("requests"), admission_only=batch, vram=True)
    s.hit_rate = None if busy_state else hit_last
    s.pcie_share = pcie_last       # the newest finished request's, as extra["hit_rate_last"] (no live one either)
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
        "generated": _i(live.get("generated")), "running": running, "solo": solo if slots is not None else None,
        "decode_tok_s_source": source,
        "last_decode_tok_s": _f(last.get("decode_tok_s")) if last else None,
        "last_hit_rate": hit_last, "hit_rate_last": hit_last,
        "hit_rate_last_at": _f(last.get("time")) if last and hit_last is not None else None,
        "hit_rate_recent": hit_recent, "hit_rate_recent_requests": recent_n if hit_recent is not None else None,
        "hit_rate_live_missing": ("Strata reports the expert-cache hit rate when a request finishes, not while "
                                  "it runs") if busy_state else None,
        "last_pcie_share": pcie_last, "pcie_share_last": pcie_last,
        "vram_share_last": vram_share(hit_last, pcie_last), "vram_share_recent": vram_recent,
        # with 2+ slots a request's hit rate is its admission's (prompt + first token), not its decode's
        "hit_rate_scope": ("admission" if batch else "request") if hit_last is not None else None,
        "last_finish": last.get("finish") if last else None,
        "gpu_util_pct": _f(hw.get("gpu_util")), "cpu_pct": _f(hw.get("cpu")),
        "gpu_pcie_gen": _i(hw.get("gpu_pcie_gen")), "gpu_pcie_width": _i(hw.get("gpu_pcie_width")),
        "expert_slots": _i(eng.get("expert_slots")), "expert_cache_mib": _f(eng.get("expert_cache_mib")),
    }.items() if v is not None}
    return s


def poll_metrics(client: Any, spec: LaunchSpec, previous: Sample | None, *, engine: str,
                 simulated: bool) -> Sample:
    """The poll of the Strata adapter and of the scripted engine (``engine``: the name the sample carries).

    GET /metrics (JSON; key needed); GET /v1/status too only when ``hardware`` has no GPU memory figures (no NVML
    on the server: ``/v1/status`` has ``machine.gpu`` null then too, but a server with its own telemetry off may
    still say). Raises ``httpx.HTTPError`` when the engine does not answer or answers an error,
    :class:`._http.AnswerTooLarge`/:class:`._http.AnswerTooSlow` (plain words) past the size cap or the overall
    deadline (the client's timeout, for both requests together), ``ValueError`` for what is not its JSON."""
    t = time.time()
    end = time.monotonic() + deadline_of(client)
    r = get_capped(client, spec.base_url + "/metrics", headers={**auth_headers(spec), "Accept": "application/json"},
                   cap=METRICS_BODY_CAP, deadline_s=deadline_of(client))
    r.raise_for_status()
    if "json" not in r.headers.get("content-type", "json"):
        return sample_from_prometheus(r.text, engine, t, simulated=simulated)
    if len(r.content) > STRATA_JSON_CAP:        # parsed, JSON takes ~5 times its size (16 MB: ~80 MB of objects)
        raise AnswerTooLarge(f"the answer at {spec.base_url}/metrics is larger than {STRATA_JSON_CAP // MB} MB, "
                             "far past what Strata sends: is another server on that port?")
    doc = json_body(r)
    doc = doc if isinstance(doc, dict) else {}
    status = None
    hw = _obj(doc.get("hardware"))
    if hw.get("gpu_mem_used") is None and end - time.monotonic() > 0.05:
        try:
            rs = get_capped(client, spec.base_url + "/v1/status", headers=auth_headers(spec), cap=SMALL_BODY_CAP,
                            deadline_s=end - time.monotonic())
            status = json_body(rs) if rs.status_code == 200 else None
        except Exception:  # noqa: BLE001 - /v1/status is optional
            status = None
    return sample_from_metrics(doc, engine, previous, t, simulated=simulated,
                               status=status if isinstance(status, dict) else None)


# Strata's JSON /metrics keeps its 500 newest requests (serve/server.py@2291cb3 Service.metrics): well under 1 MB
STRATA_JSON_CAP = 4 * MB


def parse_prometheus(text: str) -> dict[str, float]:
    """``{name: value}`` of a Prometheus text page (labels dropped, values summed over label sets; the one parser:
    :mod:`.prometheus_text`). A family whose samples are one-per-state (``strata:live_state``, ``strata:live_slots``)
    is better read with :func:`parse_prometheus_labelled`."""
    return _prom.summed(text)


def parse_prometheus_labelled(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """``name`` → [(labels, value), ...] for every sample."""
    return _prom.labelled(text)


def sample_from_prometheus(text: str, engine: str, t: float | None = None, simulated: bool = False) -> Sample:
    """Strata's ``/metrics`` text (serve/prometheus.py ``render`` @6c0f3ce): vLLM names plus ``strata:*``.
    ``strata:last_hit_rate`` is the newest *finished* request's (``requests[0].hit_rate``): it goes to
    ``extra["hit_rate_last"]`` and to ``hit_rate`` only while nothing runs, as in :func:`sample_from_metrics`."""
    m = parse_prometheus(text)
    rows = parse_prometheus_labelled(text)
    s = Sample(t=time.time() if t is None else t, engine=engine, simulated=simulated)
    state = [lab.get("state") for lab, v in rows.get("strata:live_state", []) if v == 1]
    s.state = state[0] if len(state) == 1 else None
    busy_state = s.state in BUSY_STATES
    tok = m.get("strata:live_tok_s")
    # render() writes `live.tok_s or 0`: a 0 while nothing is generating is "no rate", not a measured 0
    s.decode_tok_s = tok if tok is not None and (tok > 0 or s.state == "generating") else None
    last_hit = m.get("strata:last_hit_rate")
    last_hit = last_hit if last_hit is not None and 0 <= last_hit <= 1 else None
    s.hit_rate = None if busy_state else last_hit
    used = m.get("strata:gpu_mem_used_bytes")
    s.vram_used_bytes = int(used) if used is not None else None
    total = m.get("strata:gpu_mem_total_bytes")
    s.vram_total_bytes = int(total) if total is not None else None
    ram, ram_total = m.get("strata:ram_used_bytes"), m.get("strata:ram_total_bytes")
    s.ram_used_bytes = int(ram) if ram is not None else None
    s.ram_total_bytes = int(ram_total) if ram_total is not None else None
    run = m.get("vllm:num_requests_running")
    s.slots_busy = int(run) if run is not None else None
    wait = m.get("vllm:num_requests_waiting")
    s.queued = int(wait) if wait is not None else None
    gen = m.get("vllm:generation_tokens_total")
    s.tokens_generated_total = int(gen) if gen is not None else None
    done = m.get("vllm:request_success_total")
    s.requests_total = int(done) if done is not None else None
    if "strata:last_decode_tok_s" in m:
        s.extra["last_decode_tok_s"] = m["strata:last_decode_tok_s"]
    if last_hit is not None:
        s.extra["hit_rate_last"] = s.extra["last_hit_rate"] = last_hit
    return s


def auth_headers(spec: LaunchSpec) -> dict[str, str]:
    """serve/server.py ``Handler._authorized`` accepts ``Authorization: Bearer KEY`` (or ``x-api-key``)."""
    return bearer_headers(spec.api_key)


def check_readiness(client: Any, spec: LaunchSpec, service_hint: str | None = None,
                    expect_service: str | None = None) -> Readiness:
    """GET /health once (open, no key: serve/server.py ``do_GET``) through the one probe
    (:func:`._http.probe_health`). Connection refused → loading (eager mode opens the port only after the engine's
    READY); 200 with ``loaded: true`` → ready; ``loaded: false`` → loading or unloaded, **never ready** (a lazy
    server, or one whose engine died). ``expect_service``: the body's ``service`` must be that (Strata answers
    ``"strata"``; the same body as ``/api/health``, by which Strata's own manager identifies a Strata server) —
    anything else is "not a Strata server" on that port. ``service_hint`` only notes a different service."""
    return probe_health(client, spec.base_url, path=spec.health_path, port=spec.port, needs_loaded=True,
                        expect_service=expect_service, service_hint=service_hint)


# ------------------------------------------------------------------------------------------------ profile
def write_strp(path: Path, n_layers: int, n_experts: int, pairs: list[tuple[int, int]], slots: int) -> None:
    """A Strata expert profile (docs/ENGINE_CONTRACT.md §2), written atomically."""
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
# how Strata finds a split model's shards: BY NAME beside shard 1 (tools/iq_pack.py @d4e6823 Model.__init__;
# src/program/generate.cpp @2291cb3 gguf_split_paths): <name>-0000N-of-0000M.gguf
STRATA_SHARD_RE = lazy_re(r"-(\d{5})-of-(\d{5})\.gguf$")


def shard_name_problem(native: str) -> str | None:
    """Plain words when the model's shards are not named the way Strata finds them (the panel finds them by their
    split metadata, Strata by name), with the names to give them; None when they are (or the model is one file)."""
    from ..gguf_split import SplitError, find_split, shard_name

    try:
        split = find_split(native)
    except SplitError:
        return None                               # the pack check says what is wrong with the split
    if split.count <= 1:
        return None
    first = split.first.name
    m = STRATA_SHARD_RE.search(first)
    stem = first[:m.start()] if m else (first[:-5] if first.endswith(".gguf") else first)
    want = [shard_name(stem, i + 1, split.count) for i in range(split.count)]
    wrong = [(p.name, w) for p, w in zip(split.shards, want) if p.name != w]
    if not wrong:
        return None
    shown = "; ".join(f"{a} → {b}" for a, b in wrong[:3]) + (f"; … ({len(wrong)} in all)" if len(wrong) > 3 else "")
    return (f"The model's {split.count} shards are not named the way the Strata engine finds them: it opens shard 1 "
            "and looks for the others BY NAME beside it (<name>-00001-of-0000N.gguf, …), so it would refuse this "
            f"model however the panel found shard 1. Rename them ({shown}) in {split.first.parent}, then start "
            "again.")


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
    # Stop goes through the server (serve/server.py @2291cb3 main(): SIGTERM → KeyboardInterrupt → engine.close():
    # QUIT, then terminate, then kill — the engine's QUIT path saves its learned profile and unpins in order). The
    # supervisor signals the server alone, once (a second SIGTERM there kills the engine at once), and the process
    # group only after the server's own budget (3 × 20 s) and a margin have run out.
    stop_leader_grace_s = 70.0
    # the server gets the panel's ready timeout as STRATA_ENGINE_READY_S; the panel waits this much longer, so that
    # the server's "did not report READY within N s" (server.py @2291cb3 StrataEngine.__init__) is what the user reads
    ready_margin_s = 60.0
    words = "Strata"
    kind_label = "Strata"
    choice_label = label
    needs_recent_driver = True               # a CUDA build for sm_120 (doctor.verdicts' "driver")
    downloads = ("model", "engine")          # the GGUF shards and the engine release (download.download_*)
    bench_presets = ("numerics", "numa", "hotset")
    default_bench_presets = ("numerics",)
    cpu_numerics = True
    # its /metrics has no swap counter (serve/server.py @2291cb3 Service.metrics): swaps come from its log's
    # cumulative "exchanged with the VRAM tier" count, the decode hit rate from its log's per-request line
    exports = frozenset({"state", "decode_tok_s", "decode_tok_s_per_slot", "hit_rate", "pcie_share", "pcie_rx_mb_s",
                         "pcie_tx_mb_s", "prefill_tok_s", "queued", "ram_total_bytes", "ram_used_bytes",
                         "requests_total", "slots_busy", "slots_total", "tokens_generated_total", "vram_total_bytes",
                         "vram_used_bytes", "log_swaps", "log_hits"})

    def recognise(self, ev: Evidence) -> tuple[list[str], list[str]] | None:
        s = ev.service
        if not s or "strata" not in s.lower():
            return None
        return [f"Strata's /api/health (service {s if len(s) <= 80 else s[:79] + '…'})"], []

    # -- where things are --------------------------------------------------------------------------------------
    def engine_dir(self, settings: Any) -> Path:
        if getattr(settings, "engine_dir", None):
            return Path(settings.engine_dir).expanduser()
        cache = Path(getattr(settings, "cache_path", None) or Path(settings.cache_dir).expanduser())
        return cache / "engine" / _release_version()

    def engine_binary(self, engine_dir: Path) -> Path:
        """``engine/strata`` first (Strata's setup), then older layouts (:func:`release_check.engine_binary`)."""
        return _release.engine_binary(engine_dir)

    def python(self, engine_dir: Path) -> str:
        """The release's own ``.venv`` Python, which runs ``serve/server.py`` and ``tools/iq_pack.py`` — never the
        panel's interpreter (inside the one-folder bundle ``sys.executable`` is the panel itself). Without a
        ``.venv`` its would-be path (preflight then refuses the start and says what to run)."""
        py = _release.release_python(engine_dir)
        return str(py) if py is not None else str(Path(engine_dir) / _release.VENV_PYTHONS[0])

    def release_summary(self, settings: Any) -> str | None:
        """What the release this adapter starts says about its engine build (``engine/BUILD.json``: version, CUDA,
        architectures; :mod:`engine_manager.release_check`), or why it is unknown; None without a release."""
        edir = self.engine_dir(settings)
        if not edir.is_dir():
            return None
        build, why = _release.build_info(edir)
        if build is not None:
            return build.summary()
        return f"unknown ({why})" if why else f"unknown (no BUILD.json beside {self.engine_binary(edir)})"

    def model_file(self, settings: Any, plan: dict[str, Any] | None) -> str | None:
        """Shard 1 of the model's split (``--native SHARD1``), found from the split metadata
        (:func:`engine_manager.gguf_split.first_shard`: the file whose ``split.no`` is 0), never from a file name:
        the model folder setting first, else the plan's model file's folder. A folder that cannot be read gives
        the plan's file as it is (preflight then says what is missing)."""
        from ..gguf_split import SplitError, first_shard

        model = (plan or {}).get("model") or {}
        planned = model.get("file") or None
        if getattr(settings, "model_dir", None):
            where: str | Path | None = Path(settings.model_dir).expanduser()
        elif planned:
            where = planned
        else:                                   # the download cache (plans.find_model)
            try:
                from ..plans import find_model

                where = find_model(settings)
            except Exception:  # noqa: BLE001 - no model found is said by preflight
                where = None
        if where is None:
            return None
        try:
            return str(first_shard(where))
        except SplitError:
            return str(planned) if planned else None

    def pack_dir(self, model: str | None) -> Path | None:
        """``<data dir>/packs/<model>``: the pack ``tools/iq_pack.py`` makes from the model (``--pack``)."""
        if not model:
            return None
        from ..provision import pack_dir_for

        return pack_dir_for(Path(model))

    def prepare(self, settings: Any, plan: dict[str, Any] | None, force: bool = False
                ) -> Generator[ProvisionEvent, None, Path]:
        """Provision the model's pack with the release's own tool when the panel's sentinel says it is needed
        (:func:`engine_manager.provision.provision`). Yields its events; returns the pack folder. Raises a
        ``UserError`` in plain words when it cannot be done."""
        from ..provision import ProvisionError, provision

        model = self.model_file(settings, plan)
        if not model:
            raise ProvisionError("There is no model to prepare: set DSV41_MODEL_DIR to the folder with the model's "
                                 "shards, or download the model (`dsv41 download`).")
        edir = self.engine_dir(settings)
        if not edir.is_dir():
            raise ProvisionError(f"The Strata engine release is not installed: {edir} does not exist. Get it "
                                 "(`dsv41 download engine --from DIR` or `--url URL`) or set DSV41_ENGINE_DIR to the "
                                 "unpacked release.")
        py = _release.release_python(edir)
        if py is None:
            raise ProvisionError(f"The engine release in {edir} has no .venv: its tools/iq_pack.py runs with the "
                                 f"release's own Python. To make it, {_release.SETUP_HINT}; then start again.")
        return (yield from provision(edir, model, python=str(py), pack=self.pack_dir(model), force=force))

    def preflight(self, spec: LaunchSpec) -> list[str]:
        """Plain-words problems that would stop this launch: release, server, binary, model, pack."""
        problems = []
        edir = Path(spec.cwd) if spec.cwd else None
        server = Path(spec.argv[1]) if len(spec.argv) > 1 else None
        if edir is not None and not edir.is_dir():
            problems.append(f"The Strata engine release is not installed: {edir} does not exist. Get the engine "
                            "release (Downloads tab, or `dsv41 download engine --from DIR` or `--url URL`) or set "
                            "DSV41_ENGINE_DIR to the unpacked release.")
            return problems
        if server is None or not server.is_file():
            problems.append(f"The Strata engine is not installed: {server} does not exist. Get the engine "
                            "release (Downloads tab, or `dsv41 download engine --from DIR` or `--url URL`) or set "
                            "DSV41_ENGINE_DIR to the unpacked release.")
        if edir is not None and _release.release_python(edir) is None:
            problems.append(f"The engine release in {edir} has no .venv: Strata's server and tools run with the "
                            f"release's own Python (never the panel's). To make it, {_release.SETUP_HINT}; then "
                            "start again.")
        cfg = spec.files.get("config")
        if not cfg:
            return problems
        try:
            data = json.loads(Path(cfg).read_text())
        except (OSError, ValueError) as exc:
            problems.append(f"The generated config {cfg} cannot be read: {exc}")
            return problems
        if not Path(data.get("exe", "")).is_file():
            problems.append(f"The engine binary {data.get('exe')} is missing from the release folder: download "
                            "the engine release again.")
        else:
            problems += refused_arguments(data, edir)
        args = [str(a) for a in data.get("args") or []]
        native = args[args.index("--native") + 1] if "--native" in args[:-1] else None
        pack = args[args.index("--pack") + 1] if "--pack" in args[:-1] else None
        if not native:
            problems.append("No model file: set DSV41_MODEL_DIR or download the model.")
        elif not Path(native).is_file():
            problems.append(f"The model file {native} does not exist: download the model or set DSV41_MODEL_DIR.")
        elif (named := shard_name_problem(native)) is not None:
            problems.append(named)
        elif pack:
            from ..gguf_split import SplitError, find_split
            from ..provision import TOOL, pack_state

            try:
                ready, why = pack_state(Path(pack), find_split(native))
            except SplitError as exc:
                ready, why = False, str(exc)
            if not ready:
                can = edir is not None and (edir / TOOL).is_file()
                problems.append(f"The model is not prepared for the Strata engine ({why})"
                                + (": `dsv41 prepare` (or `dsv41 start`) prepares it." if can else
                                   f", and it cannot be: the release has no {TOOL}. Download the engine release "
                                   "again or set DSV41_ENGINE_DIR to a complete one."))
        return problems

    # -- launch ------------------------------------------------------------------------------------------------
    def engine_args(self, settings: Any, plan: dict[str, Any] | None, workdir: Path) -> tuple[list[str], dict]:
        """The engine's own arguments after ``--pack``/``--native`` (the rest of the config's ``args``) and the
        generated files. Flags as Strata's ``src/program/generate.cpp`` option loop knows them (every unknown
        argument is fatal there). ``--batch`` is never put here: the server appends it from the config's
        ``parallel`` (docs/ENGINE_CONTRACT.md §2)."""
        files: dict[str, str] = {}
        plan = plan or {}
        # only the planner's own flags reach the engine: a hand-made plan's --dump-routing / --expert-profile-save
        # would make the engine overwrite the file it names (plans.check_strata_args says which, in words)
        from ..plans import check_strata_args   # plans reads GGUF headers (numpy): imported when a launch needs it

        args: list[str] = check_strata_args(plan.get("strata_args"))
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
        for flag in ("--pack", "--native", "--batch", "--slots"):   # placed by build_launch / the server
            args = _set_flag(args, flag, None)
        args = _set_flag(args, "--expert-profile", profile)
        hot = plan.get("hot_experts")
        args = _set_flag(args, "--expert-cache", hot if hot is not None else "auto")
        args = _set_flag(args, "--vram-reserve-mib", int(settings.vram_reserve_mib))
        args = _set_flag(args, "--max-context", int(settings.context_length))
        args = _set_flag(args, "--kv", settings.kv_type)
        # the fork's default is "fork"; plain Strata refuses the flag: pass it only when it changes something
        args = _set_flag(args, "--cpu-numerics", "gpu" if settings.cpu_numerics == "gpu" else None)
        # generate.cpp's default prefill_chunk = 0 reads a prompt token by token; Strata's setup writes
        # "--prefill auto" (chunks up to 32768 tokens: serve/server.py @2291cb3 PP_CHUNK_MAX)
        if getattr(settings, "strata_prefill_auto", True) and "--prefill" not in args:
            args += ["--prefill", "auto"]
        return args, files

    def build_launch(self, settings: Any, plan: dict[str, Any] | None, workdir: Path) -> LaunchSpec:
        """``<python> <release>/serve/server.py --engine strata --config CFG --host H --port N --gpu G`` with the
        key in ``$STRATA_API_KEY`` only (serve/server.py ``main()``: ``--engine`` defaults to ``mock``;
        ``--api-key`` defaults to ``$STRATA_API_KEY``)."""
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
        pack = self.pack_dir(model)
        head = (["--pack", str(pack)] if pack else []) + (["--native", model] if model else [])
        engine_log = workdir / ENGINE_LOG_NAME
        name = ((plan or {}).get("model") or {}).get("name") or MODEL_NAME
        config: dict[str, Any] = {
            "exe": str(self.engine_binary(edir)),
            "args": head + args,
            "cwd": str(edir),
            "tokenizer": str(pack / "tokenizer") if pack else None,
            "model_name": str(name),
            "log": str(engine_log),
            "parallel": int(settings.slots),
        }
        # the release's CUDA libraries (setup.py: BUILD.json's cuda_dirs, else cuda_lib_dirs() in the .venv), which
        # serve/server.py child_env puts first on LD_LIBRARY_PATH; then a release's own lib folders
        build, _why = _release.build_info(edir)
        libs = _release.cuda_lib_dirs(edir, build) + [str(edir / d) for d in LIB_DIRS if (edir / d).is_dir()]
        if libs:
            config["lib_dirs"] = list(dict.fromkeys(libs))
        cfg_path = workdir / CONFIG_NAME
        atomic_write_json(cfg_path, config)
        files["config"] = str(cfg_path)
        files["engine_log"] = str(engine_log)
        if plan:
            plan_path = workdir / "plan.json"
            atomic_write_json(plan_path, plan)
            files["plan"] = str(plan_path)
        argv = [self.python(edir), str(edir / "serve" / "server.py"), "--engine", "strata", "--config", str(cfg_path),
                "--host", settings.host, "--port", str(settings.port), "--gpu", str(settings.gpu_index)]
        # the server's own READY deadline (server.py @2291cb3 ENGINE_READY_S, 900 s by default) is the panel's: a
        # first load of the whole model from a slow disk must not be cut at 15 minutes with "cause unknown"
        env = {"PYTHONUNBUFFERED": "1", READY_ENV: str(int(settings.ready_timeout_s))}
        if settings.api_key:        # Strata's --api-key defaults to $STRATA_API_KEY: off the command line (ps)
            env[KEY_ENV] = settings.api_key
        return LaunchSpec(engine=self.name, argv=argv, host=settings.host, port=int(settings.port),
                          api_key=settings.api_key, env=env, cwd=str(edir),
                          files=files, simulated=False, label=self.label)

    # -- running -----------------------------------------------------------------------------------------------
    def readiness(self, client: Any, spec: LaunchSpec) -> Readiness:
        """/health: ready only with ``loaded: true`` from a server whose ``service`` is ``"strata"``."""
        return check_readiness(client, spec, expect_service="strata")

    def poll(self, client: Any, spec: LaunchSpec, previous: Sample | None) -> Sample:
        """:func:`poll_metrics` under this engine's name."""
        return poll_metrics(client, spec, previous, engine=self.name, simulated=self.simulated)

    def parse_log_line(self, line: str) -> LogEvent | None:
        return parse_strata_log_line(line, self.failure_patterns)

    def classify_failure(self, returncode: int | None, log_tail: list[str]) -> FailureHint | None:
        return classify(self.failure_patterns, returncode, log_tail)


ENGINE = StrataEngine()

HELP_TIMEOUT_S = 15.0
HELP_CAP = 1 << 20                   # bytes of its answer read (the usage text of generate.cpp @2291cb3: ~25 KB)
_UNKNOWN = lazy_re(r"^unknown argument: (.{1,200})$", re.M)
_USAGE_OPTION = lazy_re(r"(?:^|\s)(--[a-z][a-z0-9-]*)", re.M)


def engine_argv(config: dict[str, Any]) -> list[str]:
    """What Strata's server runs for ``config`` (serve/server.py @2291cb3: ``StrataEngine.__init__`` runs
    ``[exe, "--serve", *args]``; ``engine_args`` adds ``--batch N`` for ``"parallel": N`` unless the args set it)."""
    args = [str(a) for a in config.get("args") or []]
    par = config.get("parallel")
    if isinstance(par, int) and not isinstance(par, bool) and par >= 2 and not {"--batch", "--slots"} & set(args):
        args += ["--batch", str(par)]
    return [str(config.get("exe")), "--serve", *args]


def refused_arguments(config: dict[str, Any], release: Path | None) -> list[str]:
    """The engine binary's own verdict on the arguments the server will give it, before anything starts: the same
    arguments then ``--help`` run only its option loop (generate.cpp @2291cb3 ``main()``: an argument it does not
    know is "unknown argument: X" and exit 2; ``--help`` prints the usage and exits 0 once every argument before it
    was taken; a second ``--help`` covers a last flag that would take the first as its value). The refusal quotes
    the engine and counts the options of its usage text. An answer that is neither (a missing CUDA library, no
    answer in time) gives no verdict here: the start says what it is."""
    import os
    import subprocess

    from ..procs import run_capped

    argv = engine_argv(config) + ["--help", "--help"]
    libs = [str(d) for d in config.get("lib_dirs") or [] if isinstance(d, str)]
    env = dict(os.environ)
    if libs:                              # as serve/server.py child_env puts them, first
        env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [p for p in [env.get("LD_LIBRARY_PATH")] if p])
    try:
        p = run_capped(argv, timeout=HELP_TIMEOUT_S, cap=HELP_CAP, env=env,
                       cwd=str(release) if release is not None and release.is_dir() else None)
    except (OSError, subprocess.SubprocessError):
        return []
    said = (p.stderr + b"\n" + p.stdout).decode("utf-8", "replace")
    m = _UNKNOWN.search(said)
    if p.returncode != 2 or m is None:
        return []
    arg = m.group(1).strip()
    n = len(set(_USAGE_OPTION.findall(said)))
    build, _why = _release.build_info(release) if release is not None else (None, None)
    version = f", version {build.version}" if build is not None and build.version else ""
    if arg == "--cpu-numerics":
        fix = ("--cpu-numerics is the deepseek-one-gpu fork's setting: set CPU numerics back to fork (`dsv41 "
               "settings set cpu_numerics fork`, or Settings) or install the deepseek-one-gpu release.")
    else:
        fix = ("The plan or a setting asks for it: re-plan (Placement tab, `dsv41 plan`), or install a release that "
               "has it (`dsv41 download engine --from DIR` or `--url URL`).")
    return [f"This Strata engine ({config.get('exe')}{version}) does not accept {arg}: asked before the start, it "
            f"answered \"unknown argument: {arg}\" (its own usage lists {n} options). {fix}"]
