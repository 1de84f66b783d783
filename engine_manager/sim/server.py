"""The scripted engine's server: one engine thread stepping up to 8 slots together, and a stdlib
``ThreadingHTTPServer`` on 127.0.0.1 that answers exactly as Strata's ``serve/server.py`` does (ENGINE_CONTRACT.md
§2; the fixtures in ``tests/data/strata`` with their sources; ``tests/test_sim_conformance.py`` diffs the two).

What is Strata's here (Niko1221/Strata ``serve/server.py`` at commit 2291cb3, function names below):

* HTTP/1.0, the connection closed by the server after every answer (``make_handler``: ``protocol_version``);
  SSE streams end by closing too.
* ``/health`` and ``/api/health`` open, the same document (``do_GET``); everything else needs
  ``Authorization: Bearer KEY`` or ``x-api-key`` (``_authorized``), else 401 ``authentication_error``.
* ``/metrics`` JSON (``Service.metrics``): ``live.tok_s`` is null unless generating; with ``--batch`` (2+ slots)
  ``live.slots`` lists every slot, idle ones with ``held_tokens``, busy ones ``reading``/``decoding`` with their own
  ``tok_s`` and no hit rate (``StrataEngine.slots_view``); a request alone runs on the solo path, outside the slots
  (``generate_batched``: all slots idle, ``outside_slots`` 1). ``requests[]`` holds finished requests only, newest
  first, 12 of them, with ``decode_tok_s`` (1 decimal) and ``hit_rate`` (3 decimals) (``Service.run``).
  ``/metrics`` with ``Accept: text/plain`` (or openmetrics, or ``?format=prometheus``): vLLM's names plus
  ``strata:*`` (``serve/prometheus.py`` ``render``); ``/metrics/prometheus``: ``llamacpp:*`` (``Service.prometheus``).
* Chat requests queue FIFO, never 409 (409 ``model_busy`` is only for ``/v1/load`` / ``/v1/unload`` while a request
  runs or waits); the final SSE chunk always carries ``usage`` (``include_usage`` is ignored) and ``timings``
  (``openai_chunks``, ``request_timings``); a failure mid-stream is a ``server_error`` frame, then ``[DONE]``.

What is the sim's own (documented): ``service`` is ``strata-sim`` and the model id
``deepseek-v4.1-flash-simulated``, and every JSON document carries ``"simulated": true`` (the panel's label) — the
only extra key. Every figure is *modelled* (the offload model, ``offload.py``); host readings the model does not
cover (GPU temperature and power) are null. Expert swaps are not on HTTP, as in Strata: they are in the engine log
(``adapt: ... swapped N experts ...`` lines, see ``engine_manager.engines.strata``). The answer text is canned and
labelled (``corpus.py``); each topic of the corpus routes through its own distribution, so a change of topic makes
the adaptive tier swap experts.

Why the stdlib server: a stream costs one thread that sleeps on its request's queue between tokens; 8 streams at
the modelled ~19 tok/s each are ~150 small writes a second, which a threaded server does at a few percent of
one core (measured by ``benchmarks/sim_cpu.py``). An idle sim sleeps on a condition variable (no polling loop
besides ``serve_forever``'s 0.1 s select timeout and a once-a-second telemetry sample).

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
from urllib.parse import urlsplit

import numpy as np

from . import corpus
from .offload import Layout, OffloadModel

SERVICE = "strata-sim"
MODEL_ID = "deepseek-v4.1-flash-simulated"
VERSION = "sim-2"
WINDOW_S = 2.0               # the live tok/s window, as Strata's RATE_WINDOW_S (modelled seconds)
MIN_SPAN_S = 0.25            # Strata's RATE_MIN_SPAN_S: a younger window gives the mean so far
KEEPALIVE_EVERY_S = 1.0      # a `: keep-alive` comment per modelled second of prompt reading
HISTORY = 500                # finished requests kept (Strata's Service.history)
SHOWN = 12                   # ... of which /metrics shows the newest (Service.metrics)
CTX_SLACK = 8                # Strata's CTX_SLACK: prompt + max tokens + 8 must fit the context
TELEMETRY_KEEP = 60          # samples of hardware history (serve/telemetry.py HISTORY)
HISTORY_KEYS = ("gpu_util", "gpu_mem_used", "gpu_temp", "gpu_power", "gpu_pcie_rx_mb", "cpu", "ram_used",
                "disk_read_mb", "tok_s", "prefill_tok_s_mean")    # serve/telemetry.py Telemetry._loop
GPU_NAME = "simulated GPU (no device)"


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
    error_after_tokens: int | None = None     # per request: a mid-stream server_error frame after N tokens
    fail_at_load: str | None = None           # cuda-oom | driver | profile | crash


@dataclass
class Options:
    host: str = "127.0.0.1"
    port: int = 8090
    api_key: str = ""
    slots: int = 1
    queue_limit: int = 8                      # accepted for compatibility; chat requests always queue (Strata)
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

    @property
    def batch(self) -> int:
        """Strata's engine runs batch slots only with ``--batch N`` (config ``parallel`` 2..8); 0 = one request
        at a time."""
        return self.slots if self.slots > 1 else 0


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
    topic: corpus.Topic = corpus.GENERAL
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
    admitted_m: float | None = None
    prompt_read: int = 0
    finish: str | None = None
    cancelled: bool = False
    disconnected: bool = False
    error: str | None = None
    submitted_m: float = 0.0
    started_wall: float = field(default_factory=time.time)
    phase: str = "reading the prompt"

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
        """The request's ``timings`` in llama.cpp's names, as Strata's ``request_timings`` builds them (nothing of
        the prompt is cached here: ``cache_n`` 0; no drafts are modelled: ``draft_n`` 0)."""
        pms, dms = self.prompt_s * 1000, self.decode_s * 1000
        n, gen = self.prompt_tokens, self.generated
        return {"cache_n": 0, "prompt_n": n, "prompt_ms": round(pms, 1),
                "prompt_per_token_ms": round(pms / n, 3) if n else None,
                "prompt_per_second": round(n / (pms / 1000), 1) if n and pms > 0 else None,
                "predicted_n": gen, "predicted_ms": round(dms, 1),
                "predicted_per_token_ms": round(dms / gen, 3) if gen else None,
                "predicted_per_second": round(gen / (dms / 1000), 1) if gen and dms > 0 else None,
                "draft_n": 0, "draft_n_accepted": 0}

    def usage(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.generated,
                "total_tokens": self.prompt_tokens + self.generated, "prompt_tokens_details": {"cached_tokens": 0}}


# ------------------------------------------------------------------------------------------------ engine
class Engine:
    """The engine thread: admits requests into slots (FIFO), reads prompts, decodes all generating slots in one
    shared step, keeps the statistics /metrics reports."""

    def __init__(self, opts: Options, model: OffloadModel, layout: Layout):
        self.opts, self.model, self.layout = opts, model, layout
        self.cond = threading.Condition()
        self.slots: list[Request | None] = [None] * opts.slots
        self.slot_held = [0] * opts.slots             # tokens a slot holds for its conversation's next turn
        self.waiting: collections.deque[Request] = collections.deque()
        self.stopping = False
        self.loaded = False
        self.unloaded = False
        self.started_wall = time.time()
        self._m_base = 0.0
        self._w_base = time.monotonic()
        self.step_log: collections.deque[tuple[float, float, int, float, float, int]] = collections.deque()
        # (m_end, duration_s, tokens, gpu_busy_s, cpu_busy_s, pcie_bytes)
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=HISTORY)
        self.n_requests = 0
        self.totals = {"since": self.started_wall, "requests": 0, "prompt_tokens": 0, "reused": 0,
                       "output_tokens": 0, "prompt_ms": 0.0, "decode_ms": 0.0, "drafts_offered": 0,
                       "drafts_accepted": 0}
        self.tokens_total = 0
        self.latency: list[tuple[float, float, float, int]] = []   # (ttft_s, decode_s, e2e_s, tokens), modelled
        self.last_timings: dict[str, Any] | None = None
        self.last_request_at: float | None = None
        self.prefill_rate: float | None = None        # the last prompt read's mean rate (the engine's PP figure)
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
        """Queue a request (FIFO, no limit: Strata's chat requests wait their turn); None if accepted, else
        ``unavailable`` while the sim stops."""
        with self.cond:
            if self.stopping or not self.loaded:
                return "unavailable"
            if self.unloaded:                       # Strata loads an unloaded model for the next request
                self.unloaded = False
                log("[strata] loading the model again for a request [simulated]")
            self.n_requests += 1
            req.number = self.n_requests
            req.submitted_m = self.mnow()
            self.last_request_at = time.time()
            self.waiting.append(req)
            self.cond.notify_all()
        return None

    def busy(self) -> bool:
        with self.cond:
            return bool(self.waiting) or any(s is not None and s.state in ("reading", "generating")
                                             for s in self.slots)

    def unload(self) -> str:
        """``/v1/unload``: "busy" while a request runs or waits (409), else "unloaded" / "not loaded"."""
        with self.cond:
            if self.waiting or any(s is not None and s.state in ("reading", "generating") for s in self.slots):
                return "busy"
            if self.unloaded:
                return "not loaded"
            self.unloaded = True
        log("[strata] model unloaded; the next request loads it again [simulated]")
        return "unloaded"

    def load(self) -> str:
        """``/v1/load``: "busy" while a request runs or waits, else "loaded"."""
        with self.cond:
            if self.waiting or any(s is not None and s.state in ("reading", "generating") for s in self.slots):
                return "busy"
            if self.unloaded:
                self.unloaded = False
                log("[strata] model loaded [simulated]")
        return "loaded"

    def cancel(self, req: Request, disconnected: bool = True) -> None:
        with self.cond:
            req.cancelled = True
            req.disconnected = req.disconnected or disconnected
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
                if s.state != "done":
                    self._finish(s, "disconnect" if s.disconnected else "cancel")
                self.slots[i] = None
        for i in range(len(self.slots)):
            if self.slots[i] is None and self.waiting:
                req = self.waiting.popleft()
                req.slot, req.state = i, "reading"
                req.admitted_m = self.mnow()
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
            self.prefill_rate = round(req.prompt_read / done, 1) if done > 0 else None
            if done < total:
                req.events.put(("keepalive",))
        n_cold = int((~self.model.hot).sum())
        stream_s = n_cold * self.layout.expert_bytes / self.model.cost.pcie_Bps
        # the long-prompt path streams every cold expert over PCIe once
        pcie_bytes = n_cold * self.layout.expert_bytes if total >= stream_s * 0.999 else 0
        with self.cond:
            self.step_log.append((self._m_base, total, 0, total, 0.0, pcie_bytes))
            req.prompt_s = total
            req.prompt_read = req.prompt_tokens
            if total > 0:
                self.prefill_rate = round(req.prompt_tokens / total, 1)
            if req.cancelled:
                return                       # _admit records it (cancel / disconnect)
            req.state = "generating"
            req.phase = "thinking" if req.reasoning else "answering"

    def _step(self, reqs: list[Request]) -> None:
        f = self.opts.faults
        b = len(reqs)
        res = self.model.decode_step(b, want_experts=self.trace is not None,
                                     topics=[r.topic.routing for r in reqs])
        m_start = self._m_base
        self._advance(res.duration_s)
        if res.experts is not None:
            self._write_trace(res.experts, [r.topic.routing for r in reqs])
        cpu_part = max(0.0, res.duration_s - res.gpu_s - res.swap_bytes / self.model.cost.pcie_Bps)
        with self.cond:
            self.step_log.append((self._m_base, res.duration_s, b, res.gpu_s, cpu_part, res.swap_bytes))
            self._trim_window()
        if res.swaps:
            self._note_swaps(res)
        for i, req in enumerate(reqs):
            if req.cancelled:
                continue                         # _admit records it
            if req.decode_start_m is None:
                req.decode_start_m = m_start
            kind, text = req.piece(req.generated)
            req.phase = "thinking" if kind == "reasoning_content" else "answering"
            req.generated += 1
            req.hits += int(res.hits[i])
            req.lookups += res.lookups
            req.misses += res.lookups - int(res.hits[i])
            req.decode_end_m = self._m_base
            self.tokens_total += 1
            req.events.put(("token", kind, text))
            if f.error_after_tokens is not None and req.generated >= f.error_after_tokens:
                self._finish(req, "error", error="simulated engine error in the middle of the reply (fault switch "
                                                 "--error-after-tokens); the next request restarts it")
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
        """Record a finished request as Strata's ``Service.run`` does (history, totals, last timings), then wake
        its HTTP thread."""
        req.finish = finish
        req.error = error
        dec = req.decode_s
        end_m = req.decode_end_m if req.decode_end_m is not None else self._m_base
        duration = max(0.0, end_m - (req.admitted_m if req.admitted_m is not None else req.submitted_m))
        hit_rate = round(req.hits / req.lookups, 3) if req.lookups else None
        rec = {
            "projection": None, "time": req.started_wall, "duration_s": round(duration, 1), "finish": finish,
            "prompt_tokens": req.prompt_tokens if req.prompt_s > 0 or finish != "cancel" else req.prompt_read,
            "reused": 0, "output_tokens": req.generated, "prompt_total": req.prompt_tokens,
            "prompt_read": req.prompt_read, "reasoning_recoveries": 0, "reasoning_repeat_coverage": 0.0,
            "engine_generated": req.generated,
            "prompt_ms": round(req.prompt_s * 1000, 1), "decode_ms": round(dec * 1000, 1),
            "decode_tok_s": round(req.generated / dec, 1) if req.generated and dec > 0 else None,
            "hit_rate": hit_rate, "pcie_share": 0.0 if req.lookups else None,
            "ram_blobs": req.misses, "file_blobs": 0, "file_mb": 0.0,
            "drafts_offered": 0, "drafts_accepted": 0,
        }
        with self.cond:
            self.history.append(rec)
            t = self.totals
            t["requests"] += 1
            t["prompt_tokens"] += rec["prompt_tokens"]
            t["output_tokens"] += req.generated
            t["prompt_ms"] = round(t["prompt_ms"] + rec["prompt_ms"], 1)
            t["decode_ms"] = round(t["decode_ms"] + rec["decode_ms"], 1)
            ttft = (req.decode_start_m - req.submitted_m) if req.decode_start_m is not None else None
            self.latency.append((ttft, dec, max(0.0, end_m - req.submitted_m), req.generated))
            if len(self.latency) > HISTORY:
                del self.latency[:len(self.latency) - HISTORY]
            if req.prompt_s > 0:
                self.last_timings = dict(req.timings(), at=int(time.time()))
            self.last_request_at = time.time()
            if req.slot is not None and self.opts.batch:
                self.slot_held[req.slot] = max(0, req.prompt_tokens + req.generated - 1)
            req.state = "done"
            self.cond.notify_all()
        if error:
            req.events.put(("error", error))
        else:
            req.events.put(("done", finish))
        rate = req.generated / dec if dec > 0 else 0.0
        # the engine's stderr lines after DONE, in generate.cpp's words (tests/data/strata/SOURCES.md "stderr
        # lines"): the request's summary, its decode hit rate, the resident tier's *cumulative* exchange count
        pms, gms = req.prompt_s * 1000, dec * 1000
        log(f"strata serve: prompt {req.prompt_tokens} tokens = 0 reused + {req.prompt_read} read in {pms:.0f} ms "
            f"({req.prompt_tokens / req.prompt_s if req.prompt_s > 0 else 0:.1f} tok/s), {req.generated} generated "
            f"in {gms:.0f} ms ({rate:.1f} tok/s), drafts accepted 0 of 0, 0 checkpoints"
            f"{' (cancelled)' if req.cancelled else ''} [simulated]")
        if req.lookups:
            log(f"strata serve: decode expert cache hit rate: {100 * req.hits / req.lookups:.1f}% ({req.hits} hits "
                f"/ {req.lookups} lookups) [simulated]")
        cold_gib = int((~self.model.hot).sum()) * self.layout.expert_bytes / 2**30
        log(f"strata serve: resident RAM: {cold_gib:.2f} GiB of experts in RAM, {self.model.swaps_total} exchanged "
            f"with the VRAM tier, 0 blob reads from the file [simulated]")
        hit = f", expert cache {100 * hit_rate:.1f}% hit" if hit_rate is not None else ""
        # serve/server.py Service.run's line ("[strata] done: ..."), tagged as simulated
        log(f"[strata] done: {req.generated} tokens in {duration:.0f} s ({rate:.1f} tok/s) "
            f"({finish}, cancel={req.cancelled}){hit} [simulated]")

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

    def _write_trace(self, experts: np.ndarray, topics: list[int] | None = None) -> None:
        b, n_l, k = experts.shape
        weights = self.model.dist.gate_weights(experts, topics)
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

    def window(self, span_floor_m: float | None = None) -> dict[str, float]:
        """Rates over the last WINDOW_S modelled seconds (or since ``span_floor_m`` when that is later, at least
        MIN_SPAN_S: Strata's rate of a young request)."""
        now = max(self.mnow(), self._m_base)
        span = WINDOW_S
        if span_floor_m is not None:
            span = max(MIN_SPAN_S, min(WINDOW_S, now - span_floor_m))
        lo = now - span
        toks = gpu = cpu = pcie = 0.0
        with self.cond:
            for m_end, dur, n, g, c, pb in self.step_log:
                if m_end <= lo:
                    continue
                frac = min(1.0, (m_end - lo) / dur) if dur > 0 else 1.0
                toks += n * frac
                gpu += g * frac
                cpu += c * frac
                pcie += pb * frac
        return {"tok_s": toks / span, "gpu_busy": min(1.0, gpu / span), "cpu_busy": min(1.0, cpu / span),
                "pcie_Bps": pcie / span}

    def snapshot(self) -> dict[str, Any]:
        with self.cond:
            active = [s for s in self.slots if s is not None and s.state in ("reading", "generating")]
            return {"active": sorted(active, key=lambda r: r.number), "queued": len(self.waiting),
                    "history": list(self.history), "slots": list(self.slots), "held": list(self.slot_held),
                    "totals": dict(self.totals), "last_timings": dict(self.last_timings) if self.last_timings
                    else None, "last_request_at": self.last_request_at, "unloaded": self.unloaded}


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
            "phase": newest.phase if busy else None,
            "prompt_tokens": newest.prompt_tokens if busy else None,
            "prompt_read": None, "prompt_total": None,
            "generated": newest.generated if busy else None,
            "max_tokens": newest.max_tokens if busy else None,
            "elapsed_s": round(now - (newest.admitted_m or now), 1) if busy else None,
            "tok_s": tok_s, "tok_s_mean": tok_s_mean,
            "prefill_tok_s_mean": prefill,
            "tok_s_window_s": WINDOW_S if state == "generating" else None,
        }
        if state == "reading":
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
                  "arena_mib": int((~model.hot).sum() * lay.expert_bytes) >> 20, "pool_workers": os.cpu_count() or 1,
                  "pcie_frac": "0.00", "spec_min_p": "0.50", "conversation_cache_mib": 0,
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
        reasoning, answer = corpus.script(question, reasoning=think,
                                          reply_tokens=o.reply_tokens if o.reply_tokens else None)
        req = Request(rid=("msg_" if anthropic else "chatcmpl-") + uuid.uuid4().hex[:24], number=0,
                      prompt_tokens=prompt, max_tokens=mt, reasoning=reasoning, answer=answer,
                      stream=bool(body.get("stream")), topic=corpus.topic_of(question))
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


# ------------------------------------------------------------------------------------------------ Prometheus
BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
           80.0, 160.0, 640.0, 2560.0)        # vLLM's, as serve/prometheus.py


def _num(v: Any, default: float = 0) -> Any:
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else default


def vllm_text(doc: dict[str, Any], eng: Engine) -> str:
    """``/metrics`` in Prometheus' text format with vLLM's names and ``strata:*`` for the JSON's own facts, as
    Strata's ``serve/prometheus.py`` ``render`` writes it (from the same document the JSON answer has)."""
    lab = f'model_name="{MODEL_ID}"'
    live, totals, hw, eng_doc = doc["live"], doc["totals"], doc["hardware"], doc["engine"]
    out: list[str] = []

    def metric(name: str, kind: str, help_: str, value: Any) -> None:
        out.append(f"# HELP {name} {help_}\n# TYPE {name} {kind}\n{name}{{{lab}}} {value}")

    busy = live.get("state") in ("reading", "generating")
    ctx = _num(eng_doc.get("max_context"))
    used = _num(live.get("prompt_tokens")) + _num(live.get("generated")) if busy else 0
    metric("vllm:num_requests_running", "gauge", "Requests reading their prompt or generating.",
           _num(live.get("running"), int(busy)))
    metric("vllm:num_requests_waiting", "gauge", "Requests waiting for their turn.",
           _num(live.get("queued")) + _num(live.get("waiting")))
    metric("vllm:kv_cache_usage_perc", "gauge", "The running request's share of the context (1 = full).",
           round(min(1.0, used / ctx), 4) if ctx else 0)
    metric("vllm:prompt_tokens_total", "counter", "Prompt tokens of the finished requests.",
           _num(totals.get("prompt_tokens")))
    metric("vllm:generation_tokens_total", "counter", "Generated tokens.", _num(totals.get("output_tokens")))
    metric("vllm:request_success_total", "counter", "Finished requests.", _num(totals.get("requests")))
    metric("vllm:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prompt cache.",
           _num(totals.get("prompt_tokens")))
    metric("vllm:prefix_cache_hits_total", "counter", "Prompt tokens the prompt cache already held.",
           _num(totals.get("reused")))
    metric("vllm:spec_decode_num_draft_tokens_total", "counter", "MTP draft tokens offered.",
           _num(totals.get("drafts_offered")))
    metric("vllm:spec_decode_num_accepted_tokens_total", "counter", "MTP draft tokens accepted.",
           _num(totals.get("drafts_accepted")))
    metric("vllm:num_preemptions_total", "counter", "Preempted requests (Strata does not preempt).", 0)
    with eng.cond:
        lat = list(eng.latency)
    for name, idx, help_ in (("vllm:time_to_first_token_seconds", 0, "Time to the first token."),
                             ("vllm:inter_token_latency_seconds", 1, "Time between two tokens."),
                             ("vllm:e2e_request_latency_seconds", 2, "A request from start to end.")):
        counts, total, n = [0] * len(BUCKETS), 0.0, 0
        for row in lat:
            v, times = row[idx], 1
            if idx == 1:                       # the mean gap, once per gap
                v, times = (row[1] / (row[3] - 1), row[3] - 1) if row[3] > 1 and row[1] else (None, 0)
            if v is None or times <= 0:
                continue
            for i, b in enumerate(BUCKETS):
                if v <= b:
                    counts[i] += times
            total += v * times
            n += times
        out.append(f"# HELP {name} {help_}\n# TYPE {name} histogram")
        out.extend(f'{name}_bucket{{{lab},le="{b}"}} {c}' for b, c in zip(BUCKETS, counts))
        out.append(f'{name}_bucket{{{lab},le="+Inf"}} {n}')
        out.append(f"{name}_sum{{{lab}}} {round(total, 6)}\n{name}_count{{{lab}}} {n}")

    typed: set[str] = set()

    def strata(name: str, kind: str, help_: str, value: Any, labels: str = "") -> None:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return                              # unknown here: no sample
        if name not in typed:
            typed.add(name)
            out.append(f"# HELP strata:{name} {help_}\n# TYPE strata:{name} {kind}")
        out.append(f"strata:{name}{{{lab}{labels}}} {value}")

    for state in ("unloaded", "idle", "reading", "generating"):
        strata("live_state", "gauge", "1 for what the engine is doing (live.state).", int(live.get("state") == state),
               f',state="{state}"')
    strata("live_tok_s", "gauge", "Decode rate over the last seconds (live.tok_s).", live.get("tok_s") or 0)
    strata("live_prefill_tok_s_mean", "gauge", "Prompt reading rate of the running request "
           "(live.prefill_tok_s_mean).", live.get("prefill_tok_s_mean") or 0)
    strata("live_prompt_read", "gauge", "Prompt tokens read so far by the running request (live.prompt_read).",
           live.get("prompt_read") or 0)
    slots = live.get("slots")
    if isinstance(slots, list) and slots:
        for state in ("idle", "reading", "generating"):
            strata("live_slots", "gauge", "The batch slots in each state (live.slots).",
                   sum(1 for x in slots if x.get("state") == state), f',state="{state}"')
    strata("engine_max_context", "gauge", "The engine's context (engine.max_context).", eng_doc.get("max_context"))
    strata("totals_prompt_seconds_total", "counter", "Time spent reading prompts (totals.prompt_ms).",
           round((totals.get("prompt_ms") or 0) / 1000, 3))
    strata("totals_decode_seconds_total", "counter", "Time spent generating (totals.decode_ms).",
           round((totals.get("decode_ms") or 0) / 1000, 3))
    strata("totals_ended_inside_thinking_total", "counter",
           "Replies that ended inside the thinking with no answer (totals.ended_inside_thinking).", 0)
    last = (doc.get("requests") or [{}])[0]
    strata("last_hit_rate", "gauge", "The last request's expert cache hit rate (requests[0].hit_rate).",
           last.get("hit_rate"))
    strata("last_decode_tok_s", "gauge", "The last request's decode rate (requests[0].decode_tok_s).",
           last.get("decode_tok_s"))
    for name, key, help_ in (("gpu_util", "gpu_util", "GPU busy, percent (hardware.gpu_util)."),
                             ("gpu_mem_used_bytes", "gpu_mem_used", "GPU memory in use (hardware.gpu_mem_used)."),
                             ("gpu_mem_total_bytes", "gpu_mem_total", "GPU memory (hardware.gpu_mem_total)."),
                             ("gpu_temp_celsius", "gpu_temp", "GPU temperature (hardware.gpu_temp)."),
                             ("gpu_power_watts", "gpu_power", "GPU power draw (hardware.gpu_power).")):
        strata(name, "gauge", help_, hw.get(key), ',gpu="0"')
    strata("cpu", "gauge", "CPU busy, percent (hardware.cpu).", hw.get("cpu"))
    strata("ram_used_bytes", "gauge", "RAM in use (hardware.ram_used).", hw.get("ram_used"))
    strata("ram_total_bytes", "gauge", "RAM (hardware.ram_total).", hw.get("ram_total"))
    out.append("# HELP strata:simulated 1: every figure here is modelled by the scripted engine\n"
               "# TYPE strata:simulated gauge\n"
               f"strata:simulated{{{lab}}} 1")
    return "\n".join(out) + "\n"


def llamacpp_text(eng: Engine) -> str:
    """``/metrics/prometheus``: Strata's ``Service.prometheus`` (llama-server's names, ``strata:*`` for the rest)."""
    snap = eng.snapshot()
    t = snap["totals"]
    running = len(snap["active"])
    prompt_n = t["prompt_tokens"] - t["reused"]
    prompt_s, decode_s = t["prompt_ms"] / 1000, t["decode_ms"] / 1000
    rows = [
        ("llamacpp:prompt_tokens_total", "counter", "Prompt tokens read", prompt_n),
        ("llamacpp:prompt_tokens_cached_total", "counter", "Prompt tokens the conversation cache already held",
         t["reused"]),
        ("llamacpp:prompt_seconds_total", "counter", "Prompt read time", prompt_s),
        ("llamacpp:tokens_predicted_total", "counter", "Tokens generated", t["output_tokens"]),
        ("llamacpp:tokens_predicted_seconds_total", "counter", "Generation time", decode_s),
        ("llamacpp:prompt_tokens_seconds", "gauge", "Average prompt read throughput in tokens/s",
         prompt_n / prompt_s if prompt_s else 0),
        ("llamacpp:predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s",
         t["output_tokens"] / decode_s if decode_s else 0),
        ("llamacpp:requests_processing", "gauge", "Requests running", running),
        ("llamacpp:requests_deferred", "gauge", "Requests waiting their turn", snap["queued"]),
        ("strata:requests_total", "counter", "Requests finished", t["requests"]),
        ("strata:drafts_offered_total", "counter", "Speculative draft tokens offered", t["drafts_offered"]),
        ("strata:drafts_accepted_total", "counter", "Speculative draft tokens accepted", t["drafts_accepted"]),
        ("strata:model_loaded", "gauge", "1 while the model is loaded", int(not snap["unloaded"])),
        ("strata:simulated", "gauge", "1: every figure here is modelled by the scripted engine", 1),
    ]
    return "".join(f"# HELP {name} {help_}\n# TYPE {name} {kind}\n{name} {value}\n"
                   for name, kind, help_, value in rows)


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
    host, port = srv.server_address[:2]
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
