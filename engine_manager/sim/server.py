"""The scripted engine's server: one engine thread stepping up to 8 slots together, and a stdlib
``ThreadingHTTPServer`` on 127.0.0.1 speaking Strata's endpoints (ENGINE_CONTRACT.md §2).

Why the stdlib server: a stream costs one thread that sleeps on its request's queue between tokens; 8 streams at
the modelled ~19 tok/s each are ~150 small writes a second, which a threaded server does at a few percent of
one core (measured by ``benchmarks/sim_cpu.py``). An idle sim sleeps on a condition variable (no polling loop
besides ``serve_forever``'s 0.1 s select timeout, which bounds how long a stop waits).

Time: every duration the sim reports (tok/s, prompt_ms, decode_ms, ...) is *modelled* time from the cost model.
``speed`` > 1 makes the process run that many times faster in wall time than modelled (for tests); it never
changes a reported figure.
"""

from __future__ import annotations

import collections
import hmac
import json
import os
import queue
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np

from . import corpus
from .offload import Layout, OffloadModel

SERVICE = "strata-sim"
MODEL_ID = "deepseek-v4.1-flash-simulated"
VERSION = "sim-1"
WINDOW_S = 2.0               # the live tok/s window, as Strata's /metrics (modelled seconds)
KEEPALIVE_EVERY_S = 1.0      # a `: keep-alive` comment per modelled second of prompt reading
HISTORY = 64                 # finished requests kept for /metrics


def log(msg: str) -> None:
    """One engine log line (stdout, flushed: the supervisor tails it)."""
    try:
        sys.stdout.write(msg + "\n")
        sys.stdout.flush()
    except (OSError, ValueError):
        pass


# ------------------------------------------------------------------------------------------------ options
@dataclass
class Faults:
    never_ready: bool = False
    die_after_tokens: int | None = None
    die_code: int = 1
    die_message: str = "fatal: simulated engine failure"
    sigkill_after_tokens: int | None = None
    sigkill_at_load: bool = False
    stall_after_tokens: int | None = None
    stall_s: float = 0.0
    error_after_tokens: int | None = None     # per request: a mid-stream error frame after N tokens
    fail_at_load: str | None = None           # cuda-oom | driver | profile | crash


@dataclass
class Options:
    host: str = "127.0.0.1"
    port: int = 8090
    api_key: str = ""
    slots: int = 1
    queue_limit: int = 8
    max_context: int = 32768
    default_max_tokens: int = 4096
    load_time_s: float = 1.0
    speed: float = 1.0
    reply_tokens: int | None = None
    dump_routing: str | None = None
    dump_routing_max_bytes: int = 0           # > 0: the trace moves to FILE.1 at start and at this size
    vram_reserve_mib: int = 700
    kv: str = "int8"
    cpu_numerics: str = "fork"
    adapt_every: int = 4
    adapt_swaps: int = 96
    adapt_decay: float = 0.7
    skew: str = "reference"
    seed: int = 41
    verbose: bool = False
    faults: Faults = field(default_factory=Faults)


# ------------------------------------------------------------------------------------------------ requests
class ClientGone(Exception):
    pass


@dataclass
class Request:
    rid: str
    number: int
    prompt_tokens: int
    max_tokens: int
    reasoning: list[str]
    answer: list[str]
    stream: bool
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))
    events: "queue.SimpleQueue[tuple]" = field(default_factory=queue.SimpleQueue)
    state: str = "queued"                 # queued, reading, generating, done
    slot: int | None = None
    generated: int = 0
    hits: int = 0
    lookups: int = 0
    misses: int = 0
    prompt_s: float = 0.0                 # modelled
    decode_start_m: float | None = None
    decode_end_m: float | None = None
    prompt_read: int = 0
    finish: str | None = None
    cancelled: bool = False
    error: str | None = None
    submitted_m: float = 0.0

    @property
    def budget(self) -> int:
        return min(self.max_tokens, len(self.reasoning) + len(self.answer))

    def piece(self, i: int) -> tuple[str, str]:
        if i < len(self.reasoning):
            return "reasoning_content", self.reasoning[i]
        return "content", self.answer[i - len(self.reasoning)]

    @property
    def decode_s(self) -> float:
        if self.decode_start_m is None or self.decode_end_m is None:
            return 0.0
        return max(0.0, self.decode_end_m - self.decode_start_m)

    def timings(self) -> dict[str, Any]:
        pms = self.prompt_s * 1000
        dms = self.decode_s * 1000
        return {
            "prompt_n": self.prompt_tokens, "prompt_ms": round(pms, 3),
            "prompt_per_second": round(self.prompt_tokens / self.prompt_s, 3) if self.prompt_s > 0 else None,
            "predicted_n": self.generated, "predicted_ms": round(dms, 3),
            "predicted_per_second": round(self.generated / self.decode_s, 3) if self.decode_s > 0 else None,
        }

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.generated,
                "total_tokens": self.prompt_tokens + self.generated}


# ------------------------------------------------------------------------------------------------ engine
class Engine:
    """The engine thread: admits requests into slots, reads prompts, decodes all generating slots in one
    shared step, keeps the statistics /metrics reports."""

    def __init__(self, opts: Options, model: OffloadModel, layout: Layout):
        self.opts, self.model, self.layout = opts, model, layout
        self.cond = threading.Condition()
        self.slots: list[Request | None] = [None] * opts.slots
        self.waiting: collections.deque[Request] = collections.deque()
        self.stopping = False
        self.loaded = False
        self.started_wall = time.time()
        self._m_base = 0.0
        self._w_base = time.monotonic()
        self.step_log: collections.deque[tuple[float, float, int, float, int]] = collections.deque()
        # (m_end, duration_s, tokens, gpu_busy_s, pcie_bytes)
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=HISTORY)
        self.n_requests = 0
        self.prompt_tokens_total = 0
        self.tokens_total = 0
        self.last_timings: dict[str, Any] | None = None
        self.trace_lock = threading.Lock()
        self.trace = None
        if opts.dump_routing:
            if opts.dump_routing_max_bytes > 0:
                self._rotate_trace()         # a capped trace is this run's alone: the last run's becomes FILE.1
            self.trace = open(opts.dump_routing, "ab")
        self._pending_swaps = [0, 0, 0.0, None]   # swaps, bytes, seconds, first round (for coalesced log lines)
        self._last_swap_log = time.monotonic()
        self._stalled = False
        self.thread = threading.Thread(target=self._run, name="sim-engine", daemon=True)

    # -- clock -------------------------------------------------------------------------------------------------
    def mnow(self) -> float:
        """Modelled seconds since start."""
        return self._m_base + (time.monotonic() - self._w_base) * self.opts.speed

    def _advance(self, modelled_s: float) -> None:
        """Let ``modelled_s`` pass: sleep its wall equivalent, then set the modelled clock exactly."""
        start_m = self._m_base
        deadline = self._w_base + (start_m + modelled_s - self._m_base) / self.opts.speed
        delay = deadline - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        self._m_base = start_m + modelled_s
        self._w_base = time.monotonic() if time.monotonic() > deadline + 0.05 else deadline

    def _resync(self) -> None:
        """After idling: the modelled clock follows wall time (× speed)."""
        now = time.monotonic()
        self._m_base += (now - self._w_base) * self.opts.speed
        self._w_base = now

    # -- admission ---------------------------------------------------------------------------------------------
    def submit(self, req: Request) -> str | None:
        """Queue a request; None if accepted, else the reason it was refused (model_busy / unavailable)."""
        with self.cond:
            if self.stopping or not self.loaded:
                return "unavailable"
            busy = sum(1 for s in self.slots if s is not None)
            if busy >= len(self.slots) and len(self.waiting) >= self.opts.queue_limit:
                return "model_busy"
            self.n_requests += 1
            req.number = self.n_requests
            req.submitted_m = self.mnow()
            self.waiting.append(req)
            self.cond.notify_all()
        return None

    def cancel(self, req: Request) -> None:
        with self.cond:
            req.cancelled = True
            if req in self.waiting:
                self.waiting.remove(req)
                req.state = "done"
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self.thread.join(timeout=2)
        self.close_trace()

    def close_trace(self) -> None:
        with self.trace_lock:
            if self.trace:
                try:
                    self.trace.flush()
                    self.trace.close()
                except OSError:
                    pass
                self.trace = None

    # -- the loop ----------------------------------------------------------------------------------------------
    def _admit(self) -> None:
        for i, s in enumerate(self.slots):
            if s is not None and (s.state == "done" or s.cancelled):
                self.slots[i] = None
        for i in range(len(self.slots)):
            if self.slots[i] is None and self.waiting:
                req = self.waiting.popleft()
                req.slot, req.state = i, "reading"
                self.slots[i] = req

    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    self._admit()
                    while not self.stopping and not any(s is not None for s in self.slots):
                        self._flush_swap_log(force=True)
                        self.cond.wait()
                        self._resync()
                        self._admit()
                    if self.stopping:
                        return
                    reading = [s for s in self.slots if s is not None and s.state == "reading"]
                    generating = [s for s in self.slots if s is not None and s.state == "generating"]
                if reading:
                    self._prefill(reading[0])
                elif generating:
                    self._step(generating)
        except Exception as exc:  # noqa: BLE001 - a crash of the engine thread is a crash of the engine
            log(f"fatal: engine thread crashed: {exc.__class__.__name__}: {exc}")
            os._exit(70)

    def _prefill(self, req: Request) -> None:
        total = self.model.prefill_s(req.prompt_tokens)
        done = 0.0
        while done < total and not req.cancelled:
            piece = min(KEEPALIVE_EVERY_S, total - done)
            self._advance(piece)
            done += piece
            req.prompt_read = int(req.prompt_tokens * done / total)
            if done < total:
                req.events.put(("keepalive",))
        n_cold = int((~self.model.hot).sum())
        stream_s = n_cold * self.layout.expert_bytes / self.model.cost.pcie_Bps
        # the long-prompt path streams every cold expert over PCIe once
        pcie_bytes = n_cold * self.layout.expert_bytes if total >= stream_s * 0.999 else 0
        with self.cond:
            self.step_log.append((self._m_base, total, 0, total, pcie_bytes))
            req.prompt_s = total
            req.prompt_read = req.prompt_tokens
            self.prompt_tokens_total += req.prompt_tokens
            if req.cancelled:
                req.state = "done"
                return
            req.state = "generating"

    def _step(self, reqs: list[Request]) -> None:
        f = self.opts.faults
        b = len(reqs)
        res = self.model.decode_step(b, want_experts=self.trace is not None)
        m_start = self._m_base
        self._advance(res.duration_s)
        if res.experts is not None:
            self._write_trace(res.experts)
        gpu_part = res.gpu_s       # the GPU waits while CPU threads compute the missed experts
        with self.cond:
            self.step_log.append((self._m_base, res.duration_s, b, gpu_part, res.swap_bytes))
            self._trim_window()
        if res.swaps:
            self._note_swaps(res)
        for i, req in enumerate(reqs):
            if req.cancelled:
                req.state = "done"
                continue
            if req.decode_start_m is None:
                req.decode_start_m = m_start
            kind, text = req.piece(req.generated)
            req.generated += 1
            req.hits += int(res.hits[i])
            req.lookups += res.lookups
            req.misses += res.lookups - int(res.hits[i])
            req.decode_end_m = self._m_base
            self.tokens_total += 1
            req.events.put(("token", kind, text))
            if f.error_after_tokens is not None and req.generated >= f.error_after_tokens:
                self._finish(req, "error", error="simulated engine error in the middle of the reply "
                                                 "(fault switch --error-after-tokens)")
            elif req.generated >= req.budget:
                self._finish(req, "length" if req.generated >= req.max_tokens and
                             req.budget < len(req.reasoning) + len(req.answer) else "stop")
            self._faults_after_token()

    def _drain(self, timeout: float = 1.0) -> None:
        """Let the HTTP threads write the tokens already produced (so "die after N tokens" means the clients
        saw N tokens), at most ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.cond:
                pending = any(s is not None and not s.events.empty() for s in self.slots)
            if not pending:
                break
            time.sleep(0.005)
        time.sleep(0.05)

    def _faults_after_token(self) -> None:
        f = self.opts.faults
        n = self.tokens_total
        if f.sigkill_after_tokens is not None and n >= f.sigkill_after_tokens:
            self._drain()
            self.close_trace()
            os.kill(os.getpid(), signal.SIGKILL)
        if f.die_after_tokens is not None and n >= f.die_after_tokens:
            self._drain()
            log(f"{f.die_message} (after {n} tokens)")
            self.close_trace()
            os._exit(f.die_code)
        if f.stall_after_tokens is not None and n >= f.stall_after_tokens and not self._stalled:
            self._stalled = True
            time.sleep(f.stall_s)       # wall seconds: the engine is stuck, HTTP still answers
            self._resync()

    def _finish(self, req: Request, finish: str, error: str | None = None) -> None:
        req.finish = finish
        req.error = error
        dec = req.decode_s
        rec = {
            "time": time.time(), "id": req.rid, "slot": req.slot, "finish": finish,
            "prompt_tokens": req.prompt_tokens, "reused": 0, "output_tokens": req.generated,
            "engine_generated": req.generated,
            "prompt_ms": round(req.prompt_s * 1000, 3), "decode_ms": round(dec * 1000, 3),
            "decode_tok_s": round(req.generated / dec, 3) if dec > 0 else None,
            "hit_rate": round(req.hits / req.lookups, 4) if req.lookups else None,
            "pcie_share": 0.0, "ram_blobs": req.misses, "file_blobs": 0, "file_mb": 0.0,
            "duration_s": round(req.prompt_s + dec, 3),
        }
        with self.cond:
            self.history.appendleft(rec)
            self.last_timings = req.timings()
            req.state = "done"
            self.cond.notify_all()
        if error:
            req.events.put(("error", error))
        else:
            req.events.put(("done", finish))
        hit = f"{100 * req.hits / req.lookups:.1f}% hit" if req.lookups else "no lookups"
        log(f"request {req.number} done: {req.generated} tokens, "
            f"{rec['decode_tok_s'] or 0:.2f} tok/s decode, prompt {req.prompt_tokens} tokens in "
            f"{rec['prompt_ms']:.0f} ms; expert cache {hit} (+0.0% of the routed experts over PCIe) [simulated]")

    def _note_swaps(self, res) -> None:
        p = self._pending_swaps
        p[0] += res.swaps
        p[1] += res.swap_bytes
        p[2] += res.swap_bytes / self.model.cost.pcie_Bps
        p[3] = p[3] or res.adapt_round
        self._flush_swap_log()

    def _flush_swap_log(self, force: bool = False) -> None:
        p = self._pending_swaps
        if not p[0]:
            return
        now = time.monotonic()
        if not force and now - self._last_swap_log < 1.0:
            return
        self._last_swap_log = now
        first, last = p[3], self.model.rounds
        rounds = f"round {last}" if first == last else f"rounds {first}-{last}"
        log(f"adapt: {rounds}: swapped {p[0]} experts into VRAM ({p[1] / (1 << 20):.1f} MiB over PCIe, "
            f"{p[2] * 1000:.1f} ms); {int(self.model.hot.sum())} resident, "
            f"observed hit {100 * self.model.hits_total / max(1, self.model.lookups_total):.1f}% [simulated]")
        self._pending_swaps = [0, 0, 0.0, None]

    def _write_trace(self, experts: np.ndarray) -> None:
        b, n_l, k = experts.shape
        weights = self.model.dist.gate_weights(experts)
        rec = np.zeros(b * n_l, dtype=[("layer", "<i4"), ("k", "<i4"), ("ids", "<i4", (k,)), ("w", "<f4", (k,))])
        rec["layer"] = np.tile(np.asarray(self.layout.moe_layers, dtype=np.int32), b)
        rec["k"] = k
        rec["ids"] = experts.reshape(-1, k)
        rec["w"] = weights.reshape(-1, k)
        with self.trace_lock:
            if self.trace:
                self.trace.write(rec.tobytes())
                # whole steps on disk at once: the monitor counts the trace as it grows
                self.trace.flush()
                cap = self.opts.dump_routing_max_bytes
                if cap > 0 and self.trace.tell() >= cap:
                    self.trace.close()
                    self._rotate_trace()
                    self.trace = open(self.opts.dump_routing, "ab")

    def _rotate_trace(self) -> None:
        """FILE → FILE.1 (replacing it), so a capped trace holds at most twice the cap on disk."""
        path = self.opts.dump_routing
        try:
            if os.path.getsize(path) > 0:
                os.replace(path, path + ".1")
        except OSError:
            pass

    # -- statistics --------------------------------------------------------------------------------------------
    def _trim_window(self) -> None:
        horizon = self._m_base - 10 * WINDOW_S
        while self.step_log and self.step_log[0][0] < horizon:
            self.step_log.popleft()

    def window(self) -> dict[str, float]:
        """Rates over the last WINDOW_S modelled seconds."""
        now = max(self.mnow(), self._m_base)
        lo = now - WINDOW_S
        toks = busy = pcie = 0.0
        with self.cond:
            for m_end, dur, n, gpu, pb in self.step_log:
                if m_end <= lo:
                    continue
                frac = min(1.0, (m_end - lo) / dur) if dur > 0 else 1.0
                toks += n * frac
                busy += gpu * frac
                pcie += pb * frac
        return {"tok_s": toks / WINDOW_S, "busy": min(1.0, busy / WINDOW_S), "pcie_Bps": pcie / WINDOW_S}

    def snapshot(self) -> dict[str, Any]:
        with self.cond:
            active = [s for s in self.slots if s is not None and s.state in ("reading", "generating")]
            reading = [s for s in active if s.state == "reading"]
            generating = [s for s in active if s.state == "generating"]
            return {
                "active": active, "reading": reading, "generating": generating,
                "queued": len(self.waiting), "history": list(self.history),
                "slots": list(self.slots),
            }


# ------------------------------------------------------------------------------------------------ HTTP
class SimHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64
    engine: Engine
    opts: Options
    layout: Layout
    model: OffloadModel


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: SimHTTPServer
    server_version = "strata-sim/1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        if self.server.opts.verbose:
            log("http: " + format % args)

    # -- plumbing ----------------------------------------------------------------------------------------------
    def _json(self, code: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def _text(self, code: int, text: str, ctype: str) -> None:
        body = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, code: int, etype: str, message: str, **extra: Any) -> None:
        self._json(code, {"error": {"type": etype, "message": message, "code": code, **extra}})

    def _authorized(self) -> bool:
        key = self.server.opts.api_key
        if not key:
            return True
        got = self.headers.get("x-api-key") or ""
        auth = self.headers.get("Authorization") or ""
        if auth.lower().startswith("bearer "):
            got = got or auth[7:].strip()
        if got and hmac.compare_digest(got.encode(), key.encode()):
            return True
        self._error(401, "authentication_error", "invalid or missing API key: send Authorization: Bearer <key> "
                                                 "or x-api-key: <key>")
        return False

    def _body(self) -> Any:
        return json.loads(getattr(self, "_raw", b"") or b"null")

    # -- routes ------------------------------------------------------------------------------------------------
    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        try:
            if path == "/health":
                return self._health()
            if not self._authorized():
                return
            routes = {"/v1/status": self._status, "/metrics": self._metrics, "/v1/models": self._models,
                      "/slots": self._slots, "/props": self._props}
            fn = routes.get(path)
            if fn is None:
                return self._error(404, "not_found", f"no route GET {path}")
            fn()
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as exc:  # noqa: BLE001 - answer 500 and say why, never drop the connection silently
            self._internal(exc)

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.split("?", 1)[0].rstrip("/")
        try:
            try:                                 # always consume the body: the connection stays usable
                n = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                n = -1
            if n < 0 or n > 64 << 20:
                self.close_connection = True
                return self._error(413 if n > 0 else 400, "invalid_request_error",
                                   "the request body is missing a valid Content-Length or is over 64 MiB")
            self._raw = self.rfile.read(n) if n else b""
            if not self._authorized():
                return
            if path in ("/v1/chat/completions", "/chat/completions"):
                return self._chat()
            if path == "/v1/messages":
                return self._chat(anthropic=True)
            self._error(404, "not_found", f"no route POST {path}")
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as exc:  # noqa: BLE001
            self._internal(exc)

    def _internal(self, exc: Exception) -> None:
        log(f"error: {self.command} {self.path}: {exc.__class__.__name__}: {exc}")
        try:
            self._error(500, "internal_error", f"{exc.__class__.__name__}: {exc}")
        except OSError:
            pass
        self.close_connection = True

    def _health(self) -> None:
        o = self.server.opts
        self._json(200, {"status": "ok", "loaded": True, "model": MODEL_ID, "max_context": o.max_context,
                         "service": SERVICE, "simulated": True})

    def _machine(self) -> dict[str, Any]:
        lay, model, eng = self.server.layout, self.server.model, self.server.engine
        win = eng.window()
        vram_total = lay.vram_total_bytes or 97_887 * (1 << 20)
        vram_used = lay.vram_used_bytes or (vram_total - (self.server.opts.vram_reserve_mib << 20) - (1 << 30))
        ram_total = lay.ram_total_bytes or 280 * 10**9
        ram_used = lay.ram_used_bytes or int((~model.hot).sum() * lay.expert_bytes + 8 * (1 << 30))
        return {"vram_total": int(vram_total), "vram_used": int(vram_used), "ram_total": int(ram_total),
                "ram_used": int(min(ram_used, ram_total)), "util": round(100 * win["busy"], 1),
                "pcie_Bps": win["pcie_Bps"], "tok_s": win["tok_s"]}

    def _status(self) -> None:
        eng, o = self.server.engine, self.server.opts
        snap = eng.snapshot()
        m = self._machine()
        self._json(200, {
            "loaded": True, "simulated": True, "service": SERVICE, "model": MODEL_ID,
            "uptime_s": round(time.time() - eng.started_wall, 3),
            "concurrency": {"serving": o.slots, "requested": o.slots},
            "activity": {"requests": eng.n_requests, "in_flight": len(snap["active"]), "queued": snap["queued"]},
            "last_timings": eng.last_timings,
            "machine": {
                "gpu": {"name": "simulated GPU (no device)", "used_mib": m["vram_used"] >> 20,
                        "total_mib": m["vram_total"] >> 20, "util_pct": m["util"]},
                "ram": {"used_gib": round(m["ram_used"] / 2**30, 2), "total_gib": round(m["ram_total"] / 2**30, 2)},
            },
        })

    def _metrics_doc(self) -> dict[str, Any]:
        eng, o, lay, model = self.server.engine, self.server.opts, self.server.layout, self.server.model
        snap = eng.snapshot()
        m = self._machine()
        hist = snap["history"]
        state = "reading" if snap["reading"] else "generating" if snap["generating"] else "idle"
        reading = snap["reading"][0] if snap["reading"] else None
        dec = [r["decode_tok_s"] for r in hist[:16] if r.get("decode_tok_s")]
        pre = [r["prompt_tokens"] / (r["prompt_ms"] / 1000) for r in hist[:16] if r.get("prompt_ms")]
        live_slots = [{"slot": s.slot, "state": s.state, "generated": s.generated,
                       "decode_tok_s": round(s.generated / s.decode_s, 3) if s.decode_s > 0 else None,
                       "hit_rate": round(s.hits / s.lookups, 4) if s.lookups else None}
                      for s in snap["active"]]
        pcie_mb = m["pcie_Bps"] / 1_024_000   # Strata reports NVML's KB/s divided by 1024
        return {
            "live": {
                "state": state, "queued": snap["queued"], "tok_s": round(m["tok_s"], 3),
                "tok_s_mean": round(sum(dec) / len(dec), 3) if dec else None,
                "prefill_tok_s_mean": round(sum(pre) / len(pre), 3) if pre else None,
                "prompt_read": reading.prompt_read if reading else None,
                "prompt_total": reading.prompt_tokens if reading else None,
                "generated": sum(s.generated for s in snap["active"]),
                "slots": live_slots,
            },
            "requests": hist,
            "engine": {
                "expert_slots": int(model.hot.sum()),
                "expert_cache_mib": round(int(model.hot.sum()) * lay.expert_bytes / (1 << 20), 1),
                "batch_slots": o.slots, "max_context": o.max_context, "kv": o.kv,
                "vram_reserve_mib": o.vram_reserve_mib, "cpu_numerics": o.cpu_numerics,
                "adapt_every": o.adapt_every, "adapt_swaps": o.adapt_swaps, "adapt_decay": o.adapt_decay,
                "n_layers": lay.n_layers_total, "moe_layers": lay.n_moe, "n_experts": lay.n_experts,
                "n_experts_used": lay.k, "expert_bytes": lay.expert_bytes,
                "version": VERSION, "simulated": True,
            },
            "hardware": {
                "gpu_name": "simulated GPU (no device)", "gpu_util": m["util"],
                "gpu_mem_used": m["vram_used"], "gpu_mem_total": m["vram_total"],
                "gpu_pcie_rx_mb": round(pcie_mb, 3), "gpu_pcie_tx_mb": 0.0,
                "cpu": None, "ram_used": m["ram_used"], "ram_total": m["ram_total"],
            },
            "totals": {"requests": eng.n_requests, "prompt_tokens": eng.prompt_tokens_total,
                       "output_tokens": eng.tokens_total},
            "sim": {
                "simulated": True, "speed": o.speed, "skew": model.dist.skew.name,
                "exponent": round(model.dist.exponent, 4), "modelled_time_s": round(eng.mnow(), 3),
                "steps": model.steps, "adapt_rounds": model.rounds,
                "swaps_total": model.swaps_total, "swap_bytes_total": model.swap_bytes_total,
                "lookups_total": model.lookups_total, "hits_total": model.hits_total,
                "hit_rate_total": round(model.hits_total / model.lookups_total, 5) if model.lookups_total else None,
                "expected_hit_rate": round(model.expected_hit_rate(), 5),
                "hot_experts": int(model.hot.sum()),
            },
        }

    def _metrics(self) -> None:
        accept = (self.headers.get("Accept") or "").lower()
        doc = self._metrics_doc()
        if "text/plain" in accept and "application/json" not in accept:
            return self._text(200, prometheus(doc, self.server.engine), "text/plain; version=0.0.4")
        self._json(200, doc)

    def _models(self) -> None:
        o = self.server.opts
        self._json(200, {"object": "list", "data": [{
            "id": MODEL_ID, "object": "model", "created": int(self.server.engine.started_wall),
            "owned_by": SERVICE, "meta": {"simulated": True, "n_ctx": o.max_context,
                                          "name": f"{self.server.layout.model_name} (simulated)"}}]})

    def _slots(self) -> None:
        snap = self.server.engine.snapshot()
        o = self.server.opts
        out = []
        for i, s in enumerate(snap["slots"]):
            busy = s is not None and s.state in ("reading", "generating")
            entry: dict[str, Any] = {"id": i, "n_ctx": o.max_context, "is_processing": busy}
            if s is not None:
                entry.update({"id_task": s.number, "n_prompt_tokens": s.prompt_tokens, "state": s.state,
                              "next_token": [{"has_next_token": busy, "n_decoded": s.generated,
                                              "n_remain": max(0, s.budget - s.generated)}],
                              "params": {"n_predict": s.max_tokens, "stream": s.stream}})
            out.append(entry)
        self._json(200, out)

    def _props(self) -> None:
        o = self.server.opts
        self._json(200, {"default_generation_settings": {"n_ctx": o.max_context,
                                                         "params": {"n_predict": o.default_max_tokens}},
                         "total_slots": o.slots, "model_path": f"{self.server.layout.model_name} (simulated)",
                         "chat_template": "", "build_info": f"{SERVICE} {VERSION}", "simulated": True})

    # -- chat --------------------------------------------------------------------------------------------------
    def _chat(self, anthropic: bool = False) -> None:
        """OpenAI chat completions, or (``anthropic``) Anthropic messages: thinking then text blocks."""
        o, eng = self.server.opts, self.server.engine
        try:
            body = self._body()
        except (ValueError, UnicodeDecodeError) as exc:
            return self._error(400, "invalid_request_error", f"the request body is not valid JSON ({exc})")
        if not isinstance(body, dict):
            return self._error(400, "invalid_request_error", "the request body must be a JSON object")
        if body.get("tools") or body.get("functions") or body.get("tool_choice") not in (None, "none"):
            return self._error(400, "invalid_request_error",
                               "tool calls are not supported by this engine (remove 'tools')", param="tools")
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
            mt = o.default_max_tokens
        if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
            return self._error(400, "invalid_request_error", "'max_tokens' must be a positive integer")
        prompt = sum(corpus.count_tokens(t) + 4 for _, t in texts) + 2
        if prompt >= o.max_context:
            return self._error(400, "invalid_request_error",
                               f"the prompt ({prompt} tokens) does not fit the context ({o.max_context} tokens)",
                               code_name="context_length_exceeded")
        mt = min(mt, o.max_context - prompt)
        question = next((t for r, t in reversed(texts) if r == "user"), texts[-1][1])
        if anthropic:
            thinking = body.get("thinking")
            think = isinstance(thinking, dict) and thinking.get("type") in ("enabled", "adaptive")
        else:
            think = str(body.get("reasoning_effort") or "medium").lower() not in ("none", "off")
        reasoning, answer = corpus.script(question, reasoning=think,
                                          reply_tokens=o.reply_tokens if o.reply_tokens else None)
        stream = bool(body.get("stream"))
        so = body.get("stream_options") or {}
        req = Request(rid=("msg_" if anthropic else "chatcmpl-") + uuid.uuid4().hex[:24], number=0,
                      prompt_tokens=prompt, max_tokens=mt, reasoning=reasoning, answer=answer, stream=stream,
                      include_usage=bool(isinstance(so, dict) and so.get("include_usage")))
        refused = eng.submit(req)
        if refused == "model_busy":
            return self._error(409, "model_busy", f"all {o.slots} slots are busy and {o.queue_limit} requests "
                                                  "are waiting; try again shortly")
        if refused:
            return self._error(503, "unavailable", "the engine is starting or stopping")
        try:
            if anthropic:
                (self._stream_messages if stream else self._complete_messages)(req)
            elif stream:
                self._stream(req)
            else:
                self._complete(req)
        except (BrokenPipeError, ConnectionResetError, ClientGone):
            eng.cancel(req)
            self.close_connection = True

    # -- Anthropic messages ------------------------------------------------------------------------------------
    def _event(self, name: str, obj: Any) -> None:
        self._chunk(b"event: " + name.encode() + b"\ndata: " + json.dumps(obj).encode() + b"\n\n")

    def _message(self, req: Request, content: list, stop: str | None) -> dict[str, Any]:
        return {"id": req.rid, "type": "message", "role": "assistant", "model": MODEL_ID, "content": content,
                "stop_reason": stop, "stop_sequence": None,
                "usage": {"input_tokens": req.prompt_tokens, "output_tokens": req.generated}}

    @staticmethod
    def _stop_reason(finish: str | None) -> str:
        return "max_tokens" if finish == "length" else "end_turn"

    def _stream_messages(self, req: Request) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("X-Simulated", "1")
        self.end_headers()
        self._event("message_start", {"type": "message_start", "message": self._message(req, [], None)})
        index, open_kind = -1, None
        while True:
            try:
                ev = req.events.get(timeout=15)
            except queue.Empty:
                continue
            if ev[0] == "keepalive":
                self._event("ping", {"type": "ping"})
            elif ev[0] == "token":
                kind = "thinking" if ev[1] == "reasoning_content" else "text"
                if kind != open_kind:
                    if open_kind is not None:
                        self._event("content_block_stop", {"type": "content_block_stop", "index": index})
                    index += 1
                    open_kind = kind
                    self._event("content_block_start", {"type": "content_block_start", "index": index,
                                                        "content_block": {"type": kind, kind: ""}})
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
                                              "usage": {"output_tokens": req.generated},
                                              "timings": req.timings()})
                self._event("message_stop", {"type": "message_stop"})
                break
        self._chunk(b"")

    def _collect(self, req: Request) -> tuple[list[str], list[str], str | None]:
        """(reasoning pieces, content pieces, error) of a whole non-streamed answer."""
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            ev = req.events.get()
            if ev[0] == "token":
                (reasoning if ev[1] == "reasoning_content" else content).append(ev[2])
            elif ev[0] == "error":
                return reasoning, content, ev[1]
            elif ev[0] == "done":
                return reasoning, content, None

    def _complete_messages(self, req: Request) -> None:
        reasoning, content, err = self._collect(req)
        if err is not None:
            return self._error(500, "api_error", err)
        blocks: list[dict[str, Any]] = []
        if reasoning:
            blocks.append({"type": "thinking", "thinking": "".join(reasoning).rstrip(), "signature": ""})
        blocks.append({"type": "text", "text": "".join(content)})
        self._json(200, self._message(req, blocks, self._stop_reason(req.finish)))

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _frame(self, obj: Any) -> None:
        self._chunk(b"data: " + json.dumps(obj).encode() + b"\n\n")

    def _base(self, req: Request) -> dict[str, Any]:
        return {"id": req.rid, "object": "chat.completion.chunk", "created": req.created, "model": MODEL_ID}

    def _stream(self, req: Request) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("X-Simulated", "1")
        self.end_headers()
        self._frame({**self._base(req), "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                     "finish_reason": None}]})
        while True:
            try:
                ev = req.events.get(timeout=15)
            except queue.Empty:
                continue
            if ev[0] == "keepalive":
                self._chunk(b": keep-alive\n\n")
            elif ev[0] == "token":
                self._frame({**self._base(req), "choices": [{"index": 0, "delta": {ev[1]: ev[2]},
                                                             "finish_reason": None}]})
            elif ev[0] == "error":
                self._frame({"error": {"type": "engine_error", "message": ev[1], "code": 500}})
                break
            elif ev[0] == "done":
                self._frame({**self._base(req), "choices": [{"index": 0, "delta": {}, "finish_reason": ev[1]}],
                             "usage": req.usage(), "timings": req.timings()})
                if req.include_usage:
                    self._frame({**self._base(req), "choices": [], "usage": req.usage(),
                                 "timings": req.timings()})
                break
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")

    def _complete(self, req: Request) -> None:
        reasoning, content, err = self._collect(req)
        if err is not None:
            return self._error(500, "engine_error", err)
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning).rstrip()
        self._json(200, {"id": req.rid, "object": "chat.completion", "created": req.created, "model": MODEL_ID,
                         "choices": [{"index": 0, "message": msg, "finish_reason": req.finish}],
                         "usage": req.usage(), "timings": req.timings()})


def prometheus(doc: dict[str, Any], eng: Engine) -> str:
    live, hw, last = doc["live"], doc["hardware"], (doc["requests"] or [{}])[0]
    sim = doc["sim"]
    rows = [
        ("strata:live_tok_s", "gauge", "decode tokens per second, all slots, 2 s window", live["tok_s"]),
        ("strata:last_hit_rate", "gauge", "GPU hits / expert lookups of the last request", last.get("hit_rate")),
        ("strata:last_decode_tok_s", "gauge", "decode tok/s of the last request", last.get("decode_tok_s")),
        ("strata:gpu_mem_used_bytes", "gauge", "VRAM in use", hw["gpu_mem_used"]),
        ("strata:gpu_mem_total_bytes", "gauge", "VRAM size", hw["gpu_mem_total"]),
        ("vllm:num_requests_running", "gauge", "requests in a slot", len(eng.snapshot()["active"])),
        ("vllm:num_requests_waiting", "gauge", "requests waiting for a slot", live["queued"]),
        ("vllm:generation_tokens_total", "counter", "tokens generated", doc["totals"]["output_tokens"]),
        ("vllm:prompt_tokens_total", "counter", "prompt tokens read", doc["totals"]["prompt_tokens"]),
        ("strata_sim:expert_swaps_total", "counter", "adaptive-tier swaps (simulated)", sim["swaps_total"]),
        ("strata_sim:hit_rate_total", "gauge", "GPU hits / lookups since start (simulated)", sim["hit_rate_total"]),
    ]
    out = []
    for name, kind, help_, value in rows:
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")
        out.append(f"{name} {'NaN' if value is None else value}")
    return "\n".join(out) + "\n"


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
    srv.server_activate()                      # listen(): from now on /health answers
    with engine.cond:
        engine.loaded = True
    engine._resync()
    engine.thread.start()
    host, port = srv.server_address[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    log(f"READY {url} (simulated engine; model {MODEL_ID}; {opts.slots} slot(s))")
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.1}, name="sim-http", daemon=True)
    t.start()
    stop.wait()
    log("shutting down (signal received)")
    srv.shutdown()
    engine.stop()
    srv.server_close()
    log("stopped")
    return 0
