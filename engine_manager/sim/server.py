"""The scripted engine's HTTP layer: a stdlib ``ThreadingHTTPServer`` on 127.0.0.1 that answers exactly as Strata's
``serve/server.py``@2291cb3 does (the fixtures in ``tests/data/strata``; ``tests/test_sim_conformance.py`` diffs
the two), for the model in :mod:`.model`; the Prometheus pages are written by :mod:`.exposition`.

Strata's, by function: HTTP/1.0 closing after every answer (``make_handler``); ``/health`` open, everything else
behind ``Authorization: Bearer KEY`` or ``x-api-key`` (``_authorized``); ``/metrics`` JSON (``Service.metrics``,
``StrataEngine.slots_view``) or Prometheus text (``serve/prometheus.py`` ``render``, ``Service.prometheus``); chat
requests queue FIFO, the last SSE chunk carries ``usage`` and ``timings``, a failure mid-stream is a
``server_error`` frame then ``[DONE]``.

The sim's own: ``service`` ``strata-sim``, every JSON document ``"simulated": true``, every figure *modelled*
(:mod:`.offload`; ``speed`` > 1 runs faster in wall time, never changes a figure), GPU temperature and power null,
expert swaps only in the log (as Strata), canned labelled answers (``corpus.py``). A stream is one sleeping thread;
8 streams cost a few percent of one core (``benchmarks/sim_cpu.py``). Strata's behaviour in full:
benchmarks/results/sim_engine.md.
"""

from __future__ import annotations

import collections
import hmac
import json
import os
import queue
import re
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from . import corpus
from .exposition import llamacpp_text, vllm_text
from .model import (
    CTX_SLACK,
    MODEL_ID,
    SERVICE,
    SHOWN,
    VERSION,
    WINDOW_S,
    ClientGone,
    Engine,
    Options,
    Request,
    log,
)
from .offload import Layout, OffloadModel

TELEMETRY_KEEP = 60          # samples of hardware history (serve/telemetry.py HISTORY)
HISTORY_KEYS = ("gpu_util", "gpu_mem_used", "gpu_temp", "gpu_power", "gpu_pcie_rx_mb", "cpu", "ram_used",
                "disk_read_mb", "tok_s", "prefill_tok_s_mean")    # serve/telemetry.py Telemetry._loop
GPU_NAME = "simulated GPU (no device)"


# A length asked for in words: "3000 words", "a 2,000-word essay", "about 1.5k tokens", "500 word summary".
_ASKED = re.compile(r"(\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?)\s*(k)?\s*-?\s*(words?|tokens?)\b", re.I)
MAX_ASKED = 1_000_000        # (the context, and max_tokens, cap it further)


def asked_length(text: str) -> int | None:
    """The reply length a question asks for, in tokens (a token of the scripted engine is a word), or None. The
    largest figure wins ("between 300 and 3000 words": 3000)."""
    best = None
    for m in _ASKED.finditer(text or ""):
        n = float(m.group(1).replace(",", "")) * (1000 if m.group(2) else 1)
        if n >= 1:
            best = max(best or 0, min(int(n), MAX_ASKED))
    return best


# ------------------------------------------------------------------------------------------------ telemetry
class Telemetry:
    """The sim's ``hardware`` block, sampled once a second like Strata's ``serve/telemetry.py`` (60 samples of
    history). Every figure is modelled from the offload model's window (GPU busy, CPU busy, PCIe traffic) and the
    plan (VRAM and RAM in use); GPU temperature and power are not modelled (null)."""

    def __init__(self, server: "SimHTTPServer"):
        self.server = server
        self.lock = threading.Lock()
        self.now: dict[str, Any] = {}
        self.hist: dict[str, collections.deque] = {k: collections.deque(maxlen=TELEMETRY_KEEP) for k in HISTORY_KEYS}
        self.stop = threading.Event()
        self.static = {"gpu_name": GPU_NAME, "gpu_count": 1, "cpu_name": _cpu_name(),
                       "cores": os.cpu_count(), "threads": os.cpu_count(), "psutil": _has_psutil()}
        self.sample()
        threading.Thread(target=self._loop, name="sim-telemetry", daemon=True).start()

    def sample(self) -> dict[str, Any]:
        srv = self.server
        lay, model, eng, o = srv.layout, srv.model, srv.engine, srv.opts
        win = eng.window()
        vram_total = lay.vram_total_bytes or 97_887 * (1 << 20)
        vram_used = lay.vram_used_bytes or (vram_total - (o.vram_reserve_mib << 20) - (1 << 30))
        ram_total = lay.ram_total_bytes or 280 * 10**9
        ram_used = lay.ram_used_bytes or int((~model.hot).sum() * lay.expert_bytes + 8 * (1 << 30))
        generating = bool(eng.snapshot()["active"])
        s = {"gpu_util": int(round(100 * win["gpu_busy"])), "gpu_mem_used": int(vram_used),
             "gpu_mem_total": int(vram_total), "gpu_temp": None, "gpu_power": None, "gpu_power_limit": None,
             "gpu_pcie_gen": 5, "gpu_pcie_gen_max": 5, "gpu_pcie_width": 16,
             # Strata: NVML's KB/s divided by 1024 (serve/telemetry.py _Nvml.read)
             "gpu_pcie_rx_mb": round(win["pcie_Bps"] / 1000 / 1024, 1), "gpu_pcie_tx_mb": 0.0,
             "cpu": round(100 * win["cpu_busy"], 1), "ram_used": int(min(ram_used, ram_total)),
             "ram_total": int(ram_total), "disk_read_mb": 0.0, "disk_write_mb": 0.0,
             # Service._tok_s: 0.0 while nothing is generating (this block, unlike live.tok_s, is never null)
             "tok_s": round(win["tok_s"], 1) if generating else 0.0,
             "tok_s_mean": round(win["tok_s"], 1) if generating else 0,
             "prefill_tok_s_mean": 0.0}
        with self.lock:
            self.now = s
        return s

    def _loop(self) -> None:
        while not self.stop.wait(1.0):
            try:
                s = self.sample()
            except Exception:  # noqa: BLE001 - telemetry never takes the server down (as Strata's)
                continue
            with self.lock:
                for k in HISTORY_KEYS:
                    self.hist[k].append(s.get(k))

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {"now": dict(self.now), "history": {k: list(v) for k, v in self.hist.items()},
                    "static": dict(self.static)}


def _cpu_name() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _has_psutil() -> bool:
    try:
        import psutil  # noqa: F401
    except ImportError:
        return False
    return True


# ------------------------------------------------------------------------------------------------ HTTP
class SimHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64
    engine: Engine
    opts: Options
    layout: Layout
    model: OffloadModel
    telemetry: Telemetry


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"          # Strata: "SSE ends by closing the connection"
    server: SimHTTPServer
    server_version = "strata-sim/2"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        if self.server.opts.verbose:
            log("http: " + format % args)

    # -- plumbing ----------------------------------------------------------------------------------------------
    def _json(self, code: int, obj: Any) -> None:
        body = json.dumps(obj, ensure_ascii=False).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _text(self, code: int, text: str, ctype: str) -> None:
        body = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, code: int, etype: str | None, message: str) -> None:
        """Strata's error shape: ``{"error": {"type": ..., "message": ...}}`` (404s carry only a message)."""
        err: dict[str, Any] = {"type": etype, "message": message} if etype else {"message": message}
        self._json(code, {"error": err})

    def _authorized(self) -> bool:
        """Strata's ``_authorized``: ``Authorization: Bearer KEY`` (else ``x-api-key``), compared in constant
        time; 401 ``authentication_error`` otherwise."""
        key = self.server.opts.api_key
        if not key:
            return True
        auth = self.headers.get("Authorization") or ""
        given = auth[7:].strip() if auth.lower().startswith("bearer ") else (self.headers.get("x-api-key") or "")
        if given and hmac.compare_digest(given.encode(), key.encode()):
            return True
        self._error(401, "authentication_error", "missing or wrong API key")
        return False

    def _body(self) -> Any:
        return json.loads(getattr(self, "_raw", b"") or b"{}")

    # -- routes ------------------------------------------------------------------------------------------------
    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        path = self.path.split("?", 1)[0].rstrip("/")
        try:
            if path in ("/health", "/api/health"):
                return self._health()
            routes = {"/v1/status": self._status, "/metrics": self._metrics, "/metrics/prometheus": self._llamacpp,
                      "/v1/models": self._models, "/models": self._models, "/slots": self._slots,
                      "/props": self._props, "/status": self._busy_status}
            fn = routes.get(path)
            if fn is None:
                return self._error(404, None, "not found")
            if not self._authorized():
                return
            fn()
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as exc:  # noqa: BLE001 - answer 500 and say why, never drop the connection silently
            self._internal(exc)

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0].rstrip("/")
        try:
            try:                                 # always consume the body
                n = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                n = -1
            if n < 0 or n > 64 << 20:
                return self._error(413 if n > 0 else 400, "invalid_request_error",
                                   "the request body is missing a valid Content-Length or is over 64 MiB")
            self._raw = self.rfile.read(n) if n else b""
            if not self._authorized():
                return
            if path in ("/v1/chat/completions", "/chat/completions"):
                return self._chat()
            if path == "/v1/messages":
                return self._chat(anthropic=True)
            if path in ("/v1/load", "/v1/unload"):
                return self._load_unload(path)
            self._error(404, None, "not found")
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as exc:  # noqa: BLE001
            self._internal(exc)

    def _internal(self, exc: Exception) -> None:
        log(f"error: {self.command} {self.path}: {exc.__class__.__name__}: {exc}")
        try:
            self._error(500, "server_error", f"{exc.__class__.__name__}: {exc}")
        except OSError:
            pass

    def _health(self) -> None:
        o, eng = self.server.opts, self.server.engine
        self._json(200, {"status": "ok", "max_context": o.max_context, "model": MODEL_ID, "images": False,
                         "api_key": bool(o.api_key), "loaded": not eng.unloaded, "service": SERVICE,
                         "simulated": True})

    def _load_unload(self, path: str) -> None:
        """``/v1/load`` and ``/v1/unload``: 409 ``model_busy`` while a request runs or waits (Strata's
        ``_post``); JSON only, as Strata's own-page check asks."""
        if not (self.headers.get("Content-Type") or "").startswith("application/json"):
            return self._error(415, None, "send application/json")
        try:
            req = self._body()
        except ValueError as exc:
            return self._error(400, "invalid_request_error", str(exc))
        if isinstance(req, dict) and req.get("model") not in (None, MODEL_ID):
            return self._error(404, None, "model not found")
        eng = self.server.engine
        result = eng.unload() if path == "/v1/unload" else eng.load()
        if result == "busy":
            return self._error(409, "model_busy", "a request is running or queued")
        self._json(200, {"status": result, **self._status_doc()})

    def _status_doc(self) -> dict[str, Any]:
        """Strata's ``Service.v1_status``."""
        eng, o = self.server.engine, self.server.opts
        snap = eng.snapshot()
        hw = self.server.telemetry.snapshot()["now"]
        busy = len(snap["active"])
        last_at = snap["last_request_at"]
        return {
            "service": SERVICE, "model": MODEL_ID, "memory_policy": {"enabled": False},
            "resources": {"enabled": False, "available": False, "memory": {"enabled": False}},
            "loaded": not snap["unloaded"], "auto_load": True,
            "structured_output": {"formats": ["json_object", "json_schema"], "method": "prompt_and_validate",
                                  "constrained_decoding": False, "stream_buffered": True},
            "engine": VERSION, "started": int(eng.started_wall), "uptime_s": int(time.time() - eng.started_wall),
            "cache_max_tokens": o.max_context, "context": {"native": o.max_context, "max_positions": o.max_context},
            "concurrency": {"serving": max(1, o.batch), "requested": max(1, o.batch)},
            "dialects": ["/v1/chat/completions", "/v1/messages"],
            "vision": {"enabled": False, "available": False, "error": None},
            "activity": {"requests": snap["totals"]["requests"] + busy, "in_flight": busy + snap["queued"],
                         "last_request_at": int(last_at) if last_at else None},
            "last_timings": snap["last_timings"],
            "vram": {"elastic": False},
            "machine": {
                "at": int(time.time()),
                "gpu": {"name": GPU_NAME, "used_mib": round(hw["gpu_mem_used"] / 2**20),
                        "total_mib": round(hw["gpu_mem_total"] / 2**20), "util_pct": hw["gpu_util"],
                        "temp_c": None, "power_w": None},
                "ram": {"used_gib": round(hw["ram_used"] / 2**30, 1), "total_gib": round(hw["ram_total"] / 2**30, 1)},
            },
            "simulated": True,
        }

    def _status(self) -> None:
        self._json(200, self._status_doc())

    def _busy_status(self) -> None:
        """``/status``: what the model is doing (the newest request's status, Strata's ``self.status``)."""
        snap = self.server.engine.snapshot()
        newest = snap["active"][-1] if snap["active"] else None
        s: dict[str, Any] = {"busy": newest is not None, "queued": snap["queued"]}
        if newest is not None:
            eng = self.server.engine
            s.update(phase=newest.phase, prompt_tokens=newest.prompt_tokens, generated=newest.generated,
                     max_tokens=newest.max_tokens, elapsed_s=round(eng.mnow() - (newest.admitted_m or 0), 1))
            if newest.decode_start_m is not None:
                rate = self._request_rate(newest)
                s["tokens_per_s"] = rate
                s["tokens_per_s_mean"] = rate
        s["simulated"] = True
        self._json(200, s)

    def _request_rate(self, r: Request) -> float | None:
        """A request's mean decode rate since its first token (modelled), 1 decimal (``slots_view``'s ``tok_s``)."""
        if r.decode_start_m is None:
            return None
        now = max(self.server.engine.mnow(), r.decode_end_m or 0)
        return round(r.generated / max(1e-6, now - r.decode_start_m), 1)

    def _live(self, snap: dict[str, Any]) -> dict[str, Any]:
        """Strata's ``Service.metrics`` ``live`` block (and ``StrataEngine.slots_view`` with ``--batch``)."""
        eng, o = self.server.engine, self.server.opts
        active, queued = snap["active"], snap["queued"]
        newest = active[-1] if active else None
        if newest is not None and newest.state == "reading":
            state = "reading"
        elif newest is not None:
            state = "generating"
        else:
            state = "unloaded" if snap["unloaded"] else "idle"
        now = eng.mnow()
        busy = newest is not None
        generating = [r for r in active if r.decode_start_m is not None]
        tok_s = tok_s_mean = None
        if state == "generating":
            first = min(r.decode_start_m for r in generating) if generating else now
            tok_s = round(eng.window(span_floor_m=first)["tok_s"], 1)
            tok_s_mean = round(sum(self._request_rate(r) or 0.0 for r in generating), 1)
        solo = bool(o.batch) and len(active) == 1 and queued == 0    # a request alone runs on the solo path
        # the engine's prompt-reading rate (its PP lines): the solo path's own, or a batch's while one reads
        prefill = eng.prefill_rate if busy and (not o.batch or solo or state == "reading") else None
        live: dict[str, Any] = {
            "state": state, "queued": queued,
            "phase": newest.phase if newest is not None else None,
            "prompt_tokens": newest.prompt_tokens if newest is not None else None,
            "prompt_read": None, "prompt_total": None,
            "generated": newest.generated if newest is not None else None,
            "max_tokens": newest.max_tokens if newest is not None else None,
            "elapsed_s": round(now - (newest.admitted_m or now), 1) if newest is not None else None,
            "tok_s": tok_s, "tok_s_mean": tok_s_mean,
            "prefill_tok_s_mean": prefill,
            "tok_s_window_s": WINDOW_S if state == "generating" else None,
        }
        if state == "reading" and newest is not None:      # (reading: newest is the request reading)
            live["prompt_read"], live["prompt_total"] = newest.prompt_read, newest.prompt_tokens
        if o.batch:
            slots = []
            for i, r in enumerate(snap["slots"]):
                if r is None or r.state not in ("reading", "generating") or solo:
                    slots.append({"slot": i, "state": "idle", "held_tokens": snap["held"][i]})
                    continue
                slots.append({"slot": i, "state": "reading" if r.state == "reading" else "decoding",
                              "prompt_tokens": r.prompt_tokens, "generated": r.generated,
                              "elapsed_s": round(now - (r.admitted_m or now), 1), "tok_s": self._request_rate(r)})
            in_slots = sum(1 for x in slots if x["state"] != "idle")
            live.update(parallel=o.batch, running=len(active), slots=slots,
                        outside_slots=max(0, len(active) - in_slots), waiting=0, admitting=queued)
        return live

    def _metrics_doc(self) -> dict[str, Any]:
        """Strata's ``Service.metrics``: the engine's INFO facts, live, the newest 12 finished requests, the
        conversation cache card, totals, resources and hardware (with a minute of history)."""
        eng, o, lay, model = self.server.engine, self.server.opts, self.server.layout, self.server.model
        snap = eng.snapshot()
        tel = self.server.telemetry.snapshot()
        hist = snap["history"]
        totals = snap["totals"]
        hot = int(model.hot.sum())
        cache_mib = int(round(hot * lay.expert_bytes / (1 << 20)))
        hw = tel["now"]
        engine = {"model": MODEL_ID, "max_context": o.max_context, "images": False, "version": VERSION,
                  # the engine's INFO line (generate.cpp), as the modelled engine would print it
                  "context": o.max_context, "kv": o.kv, "kv_resident": 0, "expert_slots": hot,
                  "expert_cache_mib": cache_mib, "expert_slots_primary": hot, "expert_cache_primary_mib": cache_mib,
                  "spec": 0, "mtp_max": 0, "lookup": 0,
                  "vram_free_mib": max(0, (hw["gpu_mem_total"] - hw["gpu_mem_used"]) >> 20), "cvec": "",
                  # fault --file-reads: no pinned arena was allocated
                  "arena_mib": 0 if o.faults.file_reads else int((~model.hot).sum() * lay.expert_bytes) >> 20,
                  "pool_workers": os.cpu_count() or 1,
                  "pcie_frac": f"{o.pcie_frac:.2f}", "spec_min_p": "0.50", "conversation_cache_mib": 0,
                  "conversation_cache_slots": 0, "conversation_cache_min_free_mib": 0, "engine": VERSION}
        if o.batch:
            engine["batch_slots"] = o.batch
        engine["simulated"] = True
        last = hist[-1] if hist else None
        conv = {"enabled": False, "budget_mib": 0, "slots": 0, "parked": 0, "bytes": 0, "evictions": 0, "parks": 0,
                "restores": 0, "last_event": None, "last_tokens": None, "last_at": None,
                "requests": totals["requests"], "requests_reused": 0, "reused_tokens": 0,
                "prompt_tokens": totals["prompt_tokens"], "last_reused": 0 if last else None,
                "last_prompt": last["prompt_tokens"] if last else None}
        return {"engine": engine, "live": self._live(snap), "requests": hist[::-1][:SHOWN],
                "conversation_cache": conv, "requests_kept": len(hist), "totals": totals,
                "resources": {"enabled": False, "available": False, "memory": {"enabled": False}},
                "hardware": hw, "hardware_static": tel["static"], "history": tel["history"], "time": time.time(),
                "simulated": True}

    def _metrics(self) -> None:
        accept = (self.headers.get("Accept") or "").lower()
        query = urlsplit(self.path).query
        doc = self._metrics_doc()
        # serve/prometheus.py wants_prometheus: Accept text/plain or openmetrics, or ?format=prometheus
        if "format=prometheus" in query or "openmetrics" in accept or "text/plain" in accept:
            return self._text(200, vllm_text(doc, self.server.engine), "text/plain; version=0.0.4; charset=utf-8")
        if "requests=all" in query:
            doc["requests"] = doc["requests"] if len(doc["requests"]) == doc["requests_kept"] else \
                self.server.engine.snapshot()["history"][::-1]
        self._json(200, doc)

    def _llamacpp(self) -> None:
        self._text(200, llamacpp_text(self.server.engine), "text/plain; version=0.0.4; charset=utf-8")

    def _models(self) -> None:
        o, eng = self.server.opts, self.server.engine
        self._json(200, {"object": "list", "data": [{
            "id": MODEL_ID, "object": "model", "status": {"value": "unloaded" if eng.unloaded else "loaded"},
            "meta": {"n_ctx": o.max_context},
            "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
            "simulated": True}]})

    def _slots(self) -> None:
        """Strata's ``/slots``: with ``--batch`` one entry per slot, else one for the engine."""
        snap = self.server.engine.snapshot()
        o = self.server.opts
        if o.batch:
            live = self._live(snap)
            out = [{"id": s["slot"], "n_ctx": o.max_context, "is_processing": s["state"] != "idle",
                    "n_prompt_tokens": int(s.get("prompt_tokens") or s.get("held_tokens") or 0)}
                   for s in live["slots"]]
        else:
            r = snap["active"][-1] if snap["active"] else None
            out = [{"id": 0, "n_ctx": o.max_context, "is_processing": r is not None,
                    "n_prompt_tokens": r.prompt_tokens if r is not None else 0}]
        self._json(200, out)

    def _props(self) -> None:
        o, eng = self.server.opts, self.server.engine
        self._json(200, {"default_generation_settings": {"n_ctx": o.max_context, "params": {"n_predict": -1}},
                         "total_slots": max(1, o.batch), "model_alias": MODEL_ID, "chat_template": "",
                         "chat_template_caps": {}, "modalities": {"vision": False}, "models_autoload": True,
                         "is_sleeping": eng.unloaded, "model_path": f"{self.server.layout.model_name} (simulated)",
                         "build_info": f"Strata {VERSION} (simulated)", "simulated": True})

    # -- chat --------------------------------------------------------------------------------------------------
    def _chat(self, anthropic: bool = False) -> None:
        """OpenAI chat completions, or (``anthropic``) Anthropic messages: thinking then text blocks."""
        o, eng = self.server.opts, self.server.engine
        try:
            body = self._body()
        except (ValueError, UnicodeDecodeError) as exc:
            return self._error(400, "invalid_request_error", f"the request body is not valid JSON ({exc})")
        if not isinstance(body, dict):
            return self._error(400, "invalid_request_error", "send a JSON object")
        if body.get("tools") or body.get("functions") or body.get("tool_choice") not in (None, "none"):
            return self._error(400, "invalid_request_error",
                               "tool calls are not supported by this engine (remove 'tools')")
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            return self._error(400, "invalid_request_error", "'messages' must be a non-empty list")
        texts = []
        system = body.get("system") if anthropic else None
        if isinstance(system, list):
            system = " ".join(p.get("text", "") for p in system if isinstance(p, dict))
        if isinstance(system, str):
            texts.append(("system", system))
        roles = ("user", "assistant") if anthropic else ("system", "user", "assistant", "developer")
        for m in msgs:
            if not isinstance(m, dict) or m.get("role") not in roles:
                return self._error(400, "invalid_request_error",
                                   f"each message needs a role ({', '.join(roles)}) and content")
            c = m.get("content")
            if isinstance(c, list):
                c = " ".join(p.get("text", "") for p in c if isinstance(p, dict))
            if c is not None and not isinstance(c, str):
                return self._error(400, "invalid_request_error", "message content must be a string")
            texts.append((m["role"], c or ""))
        mt = body.get("max_tokens", body.get("max_completion_tokens"))
        if mt is None and not anthropic:
            mt = o.default_max_tokens          # the fork's DSV41_DEFAULT_MAX_TOKENS (Strata: the rest of the context)
        if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
            return self._error(400, "invalid_request_error", "'max_tokens' must be a positive integer")
        prompt = sum(corpus.count_tokens(t) + 4 for _, t in texts) + 2
        room = o.max_context - CTX_SLACK - prompt
        if mt > room:                          # Service._prepare: never truncated, a 400 that says so
            return self._error(400, "invalid_request_error",
                               f"request exceeds the context window: prompt ({prompt} tokens) + max tokens ({mt}) "
                               f"exceeds the context ({o.max_context}); requests are never truncated. Send a "
                               f"smaller max_tokens (at most {max(0, room)} here)")
        question = next((t for r, t in reversed(texts) if r == "user"), texts[-1][1])
        if anthropic:
            thinking = body.get("thinking")
            think = isinstance(thinking, dict) and thinking.get("type") in ("enabled", "adaptive")
        else:
            think = str(body.get("reasoning_effort") or "medium").lower() not in ("none", "off")
        # --reply-tokens (benchmarks) wins; else a length the question asks for ("a 3000-word essay"), cut by
        # max_tokens as a model's reply is (finish "length"; the script need not run further than that); else the
        # topic's own few sentences
        asked = asked_length(question)
        reply = o.reply_tokens or (min(asked, mt + 1) if asked else None)
        reasoning, answer = corpus.script(question, reasoning=think, reply_tokens=reply)
        req = Request(rid=("msg_" if anthropic else "chatcmpl-") + uuid.uuid4().hex[:24], number=0,
                      prompt_tokens=prompt, max_tokens=mt, reasoning=reasoning, answer=answer,
                      stream=bool(body.get("stream")), topic=corpus.topic_of(question),
                      reproducible=body.get("strata_reproducible") not in (None, False, "", "off", "no", "false"))
        if eng.submit(req):
            return self._error(503, "server_error", "the engine is starting or stopping; try again shortly")
        try:
            if anthropic:
                (self._stream_messages if req.stream else self._complete_messages)(req)
            elif req.stream:
                self._stream(req)
            else:
                self._complete(req)
        except (BrokenPipeError, ConnectionResetError, ClientGone):
            eng.cancel(req)

    def _sse_head(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()

    def _write(self, data: bytes) -> None:
        self.wfile.write(data)
        self.wfile.flush()

    def _next_event(self, req: Request) -> tuple:
        while True:
            try:
                return req.events.get(timeout=15)
            except queue.Empty:
                continue

    # -- Anthropic messages ------------------------------------------------------------------------------------
    def _event(self, name: str, obj: Any) -> None:
        self._write(b"event: " + name.encode() + b"\ndata: " + json.dumps(obj, ensure_ascii=False).encode()
                    + b"\n\n")

    def _message(self, req: Request, content: list, stop: str | None) -> dict[str, Any]:
        return {"id": req.rid, "type": "message", "role": "assistant", "model": MODEL_ID, "content": content,
                "stop_reason": stop, "stop_sequence": None,
                "usage": {"input_tokens": req.prompt_tokens, "output_tokens": req.generated}}

    @staticmethod
    def _stop_reason(finish: str | None) -> str:
        return "max_tokens" if finish == "length" else "end_turn"

    def _stream_messages(self, req: Request) -> None:
        self._sse_head()
        self._event("message_start", {"type": "message_start", "message": self._message(req, [], None)})
        index, open_kind = -1, None
        while True:
            ev = self._next_event(req)
            if ev[0] == "keepalive":
                self._write(b": keep-alive\n\n")
            elif ev[0] == "token":
                kind = "thinking" if ev[1] == "reasoning_content" else "text"
                if kind != open_kind:
                    if open_kind is not None:
                        self._event("content_block_stop", {"type": "content_block_stop", "index": index})
                    index += 1
                    open_kind = kind
                    block = {"type": kind, kind: ""}
                    if kind == "thinking":
                        block["signature"] = ""
                    self._event("content_block_start", {"type": "content_block_start", "index": index,
                                                        "content_block": block})
                self._event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                    "delta": {"type": f"{kind}_delta", kind: ev[2]}})
            elif ev[0] == "error":
                self._event("error", {"type": "error", "error": {"type": "api_error", "message": ev[1]}})
                break
            elif ev[0] == "done":
                if open_kind is not None:
                    self._event("content_block_stop", {"type": "content_block_stop", "index": index})
                self._event("message_delta", {"type": "message_delta",
                                              "delta": {"stop_reason": self._stop_reason(ev[1]),
                                                        "stop_sequence": None},
                                              "usage": {"input_tokens": req.prompt_tokens,
                                                        "cache_read_input_tokens": 0,
                                                        "output_tokens": req.generated}})
                self._event("message_stop", {"type": "message_stop"})
                break

    def _collect(self, req: Request) -> tuple[list[str], list[str], str | None]:
        """(reasoning pieces, content pieces, error) of a whole non-streamed answer."""
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            ev = self._next_event(req)
            if ev[0] == "token":
                (reasoning if ev[1] == "reasoning_content" else content).append(ev[2])
            elif ev[0] == "error":
                return reasoning, content, ev[1]
            elif ev[0] == "done":
                return reasoning, content, None

    def _complete_messages(self, req: Request) -> None:
        reasoning, content, err = self._collect(req)
        if err is not None:
            return self._error(503, "server_error", err)
        blocks: list[dict[str, Any]] = []
        if reasoning:
            blocks.append({"type": "thinking", "thinking": "".join(reasoning).rstrip(), "signature": ""})
        blocks.append({"type": "text", "text": "".join(content)})
        msg = self._message(req, blocks, self._stop_reason(req.finish))
        msg["usage"].update(cache_read_input_tokens=0)
        self._json(200, msg)

    # -- OpenAI ------------------------------------------------------------------------------------------------
    def _chunk(self, req: Request, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"id": req.rid, "object": "chat.completion.chunk", "created": req.created, "model": MODEL_ID,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    def _frame(self, obj: Any) -> None:
        self._write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")

    def _stream(self, req: Request) -> None:
        """``openai_chunks`` over SSE: the role chunk, one chunk per piece, the finish chunk with ``usage`` and
        ``timings`` (always), ``data: [DONE]``; a failure mid-stream is a ``server_error`` frame then
        ``[DONE]``; then the connection closes (HTTP/1.0)."""
        self._sse_head()
        self._frame(self._chunk(req, {"role": "assistant", "content": ""}))
        while True:
            ev = self._next_event(req)
            if ev[0] == "keepalive":
                self._write(b": keep-alive\n\n")
            elif ev[0] == "token":
                self._frame(self._chunk(req, {ev[1]: ev[2]}))
            elif ev[0] == "error":
                self._frame({"error": {"type": "server_error", "message": ev[1]}})
                break
            elif ev[0] == "done":
                last = self._chunk(req, {}, {"cancel": "stop"}.get(ev[1], ev[1]))
                last["usage"] = req.usage()
                last["timings"] = req.timings()
                self._frame(last)
                break
        self._write(b"data: [DONE]\n\n")

    def _complete(self, req: Request) -> None:
        """``openai_collect``: the whole answer in one document; an engine failure before the answer is sent is
        503 ``server_error``."""
        reasoning, content, err = self._collect(req)
        if err is not None:
            return self._error(503, "server_error", err)
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(content) or None}
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning)
        self._json(200, {"id": req.rid, "object": "chat.completion", "created": req.created, "model": MODEL_ID,
                         "choices": [{"index": 0, "message": msg, "finish_reason": req.finish}],
                         "usage": req.usage(), "timings": req.timings()})


# ------------------------------------------------------------------------------------------------ lifecycle
class PortInUse(Exception):
    pass


def bind(host: str, port: int) -> SimHTTPServer:
    """Bind (without listening: connections are refused until :func:`serve` calls listen)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    SimHTTPServer.address_family = family
    srv = SimHTTPServer((host, port), Handler, bind_and_activate=False)
    try:
        srv.server_bind()
    except OSError as exc:
        srv.server_close()
        raise PortInUse(str(exc)) from exc
    return srv


def serve(srv: SimHTTPServer, engine: Engine, opts: Options, stop: threading.Event) -> int:
    srv.engine, srv.opts, srv.layout, srv.model = engine, opts, engine.layout, engine.model
    srv.telemetry = Telemetry(srv)
    srv.server_activate()                      # listen(): from now on /health answers
    with engine.cond:
        engine.loaded = True
    engine._resync()
    engine.thread.start()
    # the bound address, as server_bind stored it in server_address (whose type is what bind() accepts, where
    # the host may be bytes; the socket names an AF_INET/AF_INET6 host as a str)
    host, port = srv.socket.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    log(f"READY {url} (simulated engine; model {MODEL_ID}; {opts.slots} slot(s))")
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.1}, name="sim-http", daemon=True)
    t.start()
    stop.wait()
    log("shutting down (signal received)")
    srv.shutdown()
    srv.telemetry.stop.set()
    engine.stop()
    srv.server_close()
    log("stopped")
    return 0
