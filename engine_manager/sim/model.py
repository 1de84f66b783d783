"""The scripted engine's model: one engine thread stepping up to 8 slots together, with Strata's queueing, slots,
rate windows and finished-request records, and the offload model (``offload.py``) deciding every modelled figure.
No HTTP here: :mod:`.server` answers for it (Strata's endpoints), :mod:`.exposition` writes its Prometheus pages.

What is Strata's here (Niko1221/Strata ``serve/server.py`` at commit 2291cb3): chat requests queue FIFO, never 409;
a request alone runs on the solo path, outside the slots (``generate_batched``); ``requests[]`` holds finished
requests only, newest first (``Service.run``); the live tok/s window is ``RATE_WINDOW_S`` (2 modelled seconds).
Expert swaps are logged (``adapt: ... swapped N experts ...``), never on HTTP, as in Strata. An idle engine sleeps
on a condition variable.

Time: every duration the sim reports (tok/s, prompt_ms, decode_ms, ...) is *modelled* time from the cost model.
``speed`` > 1 makes the process run that many times faster in wall time than modelled (for tests); it never
changes a reported figure.
"""

from __future__ import annotations

import collections
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any

import numpy as np

from . import corpus
from .offload import Layout, OffloadModel, StepResult

SERVICE = "strata-sim"
MODEL_ID = "deepseek-v4.1-flash-simulated"
VERSION = "sim-2"
WINDOW_S = 2.0               # the live tok/s window, as Strata's RATE_WINDOW_S (modelled seconds)
MIN_SPAN_S = 0.25            # Strata's RATE_MIN_SPAN_S: a younger window gives the mean so far
KEEPALIVE_EVERY_S = 1.0      # a `: keep-alive` comment per modelled second of prompt reading
HISTORY = 500                # finished requests kept (Strata's Service.history)
SHOWN = 12                   # ... of which /metrics shows the newest (Service.metrics)
DIVERGE_AT = 0.75           # where a batched --cpu-numerics fork answer turns (a share of its length; simulated)
CTX_SLACK = 8                # Strata's CTX_SLACK: prompt + max tokens + 8 must fit the context


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
    admit_experts: int | None = None          # the expert cache admits at most N experts (fewer than asked for)
    file_reads: bool = False                  # no pinned arena: every cold expert is a blob read from the file


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
    # Strata's --pcie-frac: the share of missed experts the GPU reads over PCIe (generate.cpp: "offloaded", not in
    # the lookups). The step's cost stands for the CPU and PCIe paths together (Strata's probe balances them):
    # only the accounting is split, as the engine reports it
    pcie_frac: float = 0.1
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
    # the numerics promise, modelled (simulated): with --cpu-numerics fork a request that shared a decode step with
    # another one ("batched") is not bit-identical to itself served alone: its text turns at DIVERGE_AT of its
    # length (another token there); --cpu-numerics gpu, or strata_reproducible, never turns
    reproducible: bool = False
    batched: bool = False
    turned: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    events: "queue.SimpleQueue[tuple]" = field(default_factory=queue.SimpleQueue)
    state: str = "queued"                 # queued, reading, generating, done
    slot: int | None = None
    generated: int = 0
    hits: int = 0
    lookups: int = 0                      # hits + the misses the CPU computed (the PCIe reads are not in them)
    misses: int = 0
    offloaded: int = 0                    # missed experts the GPU read over PCIe
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
@dataclass
class _PendingSwaps:
    """Expert swaps not logged yet (``adapt:`` lines are coalesced, at most one a second)."""
    swaps: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    first_round: int | None = None


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
        self.file_blobs_total = 0                     # the resident tier's cumulative "blob reads from the file"
        # (ttft_s, decode_s, e2e_s, tokens), modelled; ttft_s None: the request produced no token
        self.latency: list[tuple[float | None, float, float, int]] = []
        self.last_timings: dict[str, Any] | None = None
        self.last_request_at: float | None = None
        self.prefill_rate: float | None = None        # the last prompt read's mean rate (the engine's PP figure)
        self.trace_lock = threading.Lock()
        self.trace: IO[bytes] | None = None
        if opts.dump_routing:
            if opts.dump_routing_max_bytes > 0:
                self._rotate_trace(opts.dump_routing)   # a capped trace is this run's alone: the last run's is FILE.1
            self.trace = open(opts.dump_routing, "ab")
        self._pending_swaps = _PendingSwaps()     # for coalesced log lines
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
        if b > 1 and self.opts.cpu_numerics == "fork":
            for r in reqs:
                r.batched = r.batched or not r.reproducible
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
            if req.batched and not req.turned and req.generated >= max(1, int(DIVERGE_AT * req.budget)):
                self._diverge(req)
            kind, text = req.piece(req.generated)
            req.phase = "thinking" if kind == "reasoning_content" else "answering"
            req.generated += 1
            missed = res.lookups - int(res.hits[i])
            off = int(round(self.opts.pcie_frac * missed))
            req.hits += int(res.hits[i])
            req.offloaded += off
            req.lookups += res.lookups - off
            req.misses += missed - off
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

    @staticmethod
    def _diverge(req: Request) -> None:
        """A batched answer's late turn (simulated): from this position on, two whole sentences of the answer
        change places (the words, their count and every sentence stay those of the answer served alone, so
        max_tokens, usage and the curated sentences hold; the text differs from the turn on). An answer with fewer
        than two whole sentences left does not turn (a canned answer never holds a sentence the corpus lacks)."""
        req.turned = True
        i = max(0, req.generated - len(req.reasoning))
        words = req.answer
        ends = [k for k in range(i, len(words)) if words[k].rstrip().endswith((".", "!", "?"))]
        if len(ends) >= 3:
            a, b, c = ends[0] + 1, ends[1] + 1, ends[2] + 1      # sentences words[a:b] and words[b:c]
            if words[a:b] != words[b:c]:
                words[a:c] = words[b:c] + words[a:b]

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
        file_reads = self.opts.faults.file_reads
        routed = req.lookups + req.offloaded
        pcie_share = round(req.offloaded / routed, 3) if routed else None
        rec: dict[str, Any] = {
            "projection": None, "time": req.started_wall, "duration_s": round(duration, 1), "finish": finish,
            "prompt_tokens": req.prompt_tokens if req.prompt_s > 0 or finish != "cancel" else req.prompt_read,
            "reused": 0, "output_tokens": req.generated, "prompt_total": req.prompt_tokens,
            "prompt_read": req.prompt_read, "reasoning_recoveries": 0, "reasoning_repeat_coverage": 0.0,
            "engine_generated": req.generated,
            "prompt_ms": round(req.prompt_s * 1000, 1), "decode_ms": round(dec * 1000, 1),
            "decode_tok_s": round(req.generated / dec, 1) if req.generated and dec > 0 else None,
            "hit_rate": hit_rate, "pcie_share": pcie_share,
            # Strata's tiers (DONE's ram_blobs/file_blobs/file_mb): without the pinned arena (fault --file-reads)
            # every expert the CPU computes is read from the file instead of RAM
            "ram_blobs": 0 if file_reads else req.misses, "file_blobs": req.misses if file_reads else 0,
            "file_mb": round(req.misses * self.layout.expert_bytes / 1e6, 1) if file_reads else 0.0,
            "drafts_offered": 0, "drafts_accepted": 0,
        }
        with self.cond:
            self.history.append(rec)
            self.file_blobs_total += rec["file_blobs"]
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
            # generate.cpp @2291cb3's words, the PCIe reads said beside the hit rate (#588)
            off = (f"; {req.offloaded} more read by the GPU over PCIe or from another GPU "
                   f"({100 * req.offloaded / routed:.1f}% of all {routed} routed)" if req.offloaded else "")
            log(f"strata serve: decode expert cache hit rate: {100 * req.hits / req.lookups:.1f}% ({req.hits} hits "
                f"/ {req.lookups} lookups){off} [simulated]")
        cold_gib = int((~self.model.hot).sum()) * self.layout.expert_bytes / 2**30
        log(f"strata serve: resident RAM: {cold_gib:.2f} GiB of experts in RAM, {self.model.swaps_total} exchanged "
            f"with the VRAM tier, {self.file_blobs_total} blob reads from the file [simulated]")
        hit = f", expert cache {100 * hit_rate:.1f}% hit" if hit_rate is not None else ""
        if hit and pcie_share:
            hit += f" (+{100 * pcie_share:.1f}% of the routed experts over PCIe)"
        # serve/server.py Service.run's line ("[strata] done: ..."), tagged as simulated
        log(f"[strata] done: {req.generated} tokens in {duration:.0f} s ({rate:.1f} tok/s) "
            f"({finish}, cancel={req.cancelled}){hit} [simulated]")

    def _note_swaps(self, res: StepResult) -> None:
        p = self._pending_swaps
        p.swaps += res.swaps
        p.nbytes += res.swap_bytes
        p.seconds += res.swap_bytes / self.model.cost.pcie_Bps
        p.first_round = p.first_round or res.adapt_round
        self._flush_swap_log()

    def _flush_swap_log(self, force: bool = False) -> None:
        p = self._pending_swaps
        if not p.swaps:
            return
        now = time.monotonic()
        if not force and now - self._last_swap_log < 1.0:
            return
        self._last_swap_log = now
        first, last = p.first_round, self.model.rounds
        rounds = f"round {last}" if first == last else f"rounds {first}-{last}"
        log(f"adapt: {rounds}: swapped {p.swaps} experts into VRAM ({p.nbytes / (1 << 20):.1f} MiB over PCIe, "
            f"{p.seconds * 1000:.1f} ms); {int(self.model.hot.sum())} resident, "
            f"observed hit {100 * self.model.hits_total / max(1, self.model.lookups_total):.1f}% [simulated]")
        self._pending_swaps = _PendingSwaps()

    def _write_trace(self, experts: np.ndarray, topics: list[int | None] | None = None) -> None:
        b, n_l, k = experts.shape
        weights = self.model.dist.gate_weights(experts, topics)
        rec = np.zeros(b * n_l, dtype=[("layer", "<i4"), ("k", "<i4"), ("ids", "<i4", (k,)), ("w", "<f4", (k,))])
        rec["layer"] = np.tile(np.asarray(self.layout.moe_layers, dtype=np.int32), b)
        rec["k"] = k
        rec["ids"] = experts.reshape(-1, k)
        rec["w"] = weights.reshape(-1, k)
        path = self.opts.dump_routing
        with self.trace_lock:
            if self.trace and path:          # (a trace is open only with dump_routing set)
                self.trace.write(rec.tobytes())
                # whole steps on disk at once: the monitor counts the trace as it grows
                self.trace.flush()
                cap = self.opts.dump_routing_max_bytes
                if cap > 0 and self.trace.tell() >= cap:
                    self.trace.close()
                    self._rotate_trace(path)
                    self.trace = open(path, "ab")

    @staticmethod
    def _rotate_trace(path: str) -> None:
        """FILE → FILE.1 (replacing it), so a capped trace holds at most twice the cap on disk."""
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
