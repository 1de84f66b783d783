"""The collector: runs every source on its own thread at ``hz``, composes one :class:`Tick` per period, keeps
it in the ring buffers, records it to disk, and hands it to whoever listens (a generator for
``app.workers.run_generator``, or callbacks).

Timing: at each tick every idle source is asked for a reading; the hub waits for each until
``min(source.timeout_s, 0.9 × period)`` and then composes the tick from what arrived. A source still busy
with an earlier reading, late, or failing is *missing* for that tick (``Tick.missing`` says why); the others
are never held up. Qt-free.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence, TypeGuard

from ..engines import find_engine
from ..engines.base import Sample, vram_share
from ..figures import measured
from .columns import COLUMN_NAMES
from .record import Recorder
from .sources import LogSwapSource, Reading, Source, SourceMissing, unexported_columns
from .steady import SteadyTracker, last_reply, slot_tasks
from .store import RingStore

Listener = Callable[["Tick"], None]


@dataclass
class Tick:
    """One composed reading of everything. ``values[c] is None`` ⇔ missing."""

    seq: int
    t: float
    values: dict[str, float | None]
    engine: str = ""
    simulated: bool = False
    sample: Sample | None = None                      # the engine adapter's own sample, when it answered
    missing: dict[str, str] = field(default_factory=dict)   # source name → why it is missing this tick
    origin: dict[str, str] = field(default_factory=dict)    # effective column → where its value came from
    notes: dict[str, Any] = field(default_factory=dict)
    predicted_hit_rate: float | None = None
    hz: float = 1.0
    mono: float | None = None       # time.monotonic() of the tick: the clock intervals are measured on (``t`` is the
                                    # wall clock, which a step of the clock moves)

    def get(self, name: str) -> float | None:
        return self.values.get(name)

    def to_sample(self) -> Sample:
        """The engine's :class:`Sample` (an empty one when the engine did not answer) with the host and
        driver figures under ``extra['panel']`` — what ``AppContext.sampleArrived`` carries."""
        s = self.sample
        if s is None:
            s = Sample(t=self.t, engine=self.engine, simulated=self.simulated)
            s.extra["missing"] = self.missing.get("engine", "engine did not answer")
        else:
            s.extra = dict(s.extra)
        s.extra["panel"] = dict(self.values)
        if self.mono is not None:
            s.extra["mono"] = self.mono
        return s


def _finite(x: float | None) -> TypeGuard[float]:
    return x is not None and math.isfinite(x)


def derive(values: dict[str, float | None], simulated: bool, expert_bytes: int | None = None
           ) -> dict[str, str]:
    """Fill the effective columns from the raw ones (in place); return each one's origin.

    - VRAM and PCIe: a real engine prefers the driver's figures (NVML), falling back to what the engine
      reports; a simulated engine its own modelled figures (the real GPU, if any, is not what it models).
    - swaps/s: the engine's figure, else the log's. swap MB/s: the engine's, else the log's, else
      swaps/s × one expert's bytes from the plan (a stated estimate).
    """
    origin: dict[str, str] = {}

    def pick(dst: str, first: tuple[str, str], second: tuple[str, str]) -> None:
        for col, where in (first, second):
            if _finite(values.get(col)):
                values[dst] = values[col]
                origin[dst] = where
                return
        values[dst] = None

    eng, drv = ("engine", "simulated"), ("nvml", "driver")
    for dst, ecol, ncol in (("vram_used_bytes", "engine_vram_used_bytes", "nvml_vram_used_bytes"),
                            ("vram_total_bytes", "engine_vram_total_bytes", "nvml_vram_total_bytes"),
                            ("pcie_rx_mb_s", "engine_pcie_rx_mb_s", "nvml_pcie_rx_mb_s"),
                            ("pcie_tx_mb_s", "engine_pcie_tx_mb_s", "nvml_pcie_tx_mb_s")):
        e = (ecol, "simulated" if simulated else "engine")
        n = (ncol, drv[1])
        pick(dst, e, n) if simulated else pick(dst, n, e)
    del eng
    sim = "simulated" if simulated else "engine"
    pick("swaps_per_s", ("engine_swaps_per_s", sim), ("log_swaps_per_s", "log"))
    pick("swap_mb_s", ("engine_swap_mb_s", sim), ("log_swap_mb_s", "log"))
    swaps_per_s = values.get("swaps_per_s")
    if values.get("swap_mb_s") is None and _finite(swaps_per_s) and expert_bytes:
        values["swap_mb_s"] = swaps_per_s * expert_bytes / 1e6
        origin["swap_mb_s"] = "estimate: swaps/s × expert size"
    for c in ("decode_tok_s", "prefill_tok_s", "hit_rate", "slots_busy"):
        if _finite(values.get(c)):
            origin[c] = sim
    # the share of routed expert picks served from VRAM — what a planner predicts. Strata's hit rate leaves the
    # experts read over PCIe out of its lookups (engines.base.vram_share); the engine log's newest decode line
    # (one request's, or the batch windows' of all slots) comes first: with 2+ slots a finished request's own
    # figures cover only its admission
    pick("pcie_share", ("log_pcie_share", "log"), ("engine_pcie_share", sim))
    if _finite(values.get("log_vram_share")):
        values["vram_share"], origin["vram_share"] = values["log_vram_share"], "log"
    else:
        hr, ps = values.get("hit_rate"), values.get("engine_pcie_share")
        if not _finite(hr):
            hr = values.get("hit_rate_last")      # Strata: no live figure, the newest finished request's
        values["vram_share"] = vram_share(hr, ps if _finite(ps) else None) if _finite(hr) else None
        if values["vram_share"] is not None:
            origin["vram_share"] = sim if _finite(ps) else f"{sim}: hit rate (no PCIe share reported)"
    return origin


#: the raw columns each effective one is made of (derive)
EFFECTIVE_INPUTS: dict[str, tuple[str, ...]] = {
    "vram_used_bytes": ("engine_vram_used_bytes", "nvml_vram_used_bytes"),
    "vram_total_bytes": ("engine_vram_total_bytes", "nvml_vram_total_bytes"),
    "pcie_rx_mb_s": ("engine_pcie_rx_mb_s", "nvml_pcie_rx_mb_s"),
    "pcie_tx_mb_s": ("engine_pcie_tx_mb_s", "nvml_pcie_tx_mb_s"),
    "swaps_per_s": ("engine_swaps_per_s", "log_swaps_per_s"),
    "swap_mb_s": ("engine_swap_mb_s", "log_swap_mb_s"),
    "pcie_share": ("log_pcie_share", "engine_pcie_share"),
    "vram_share": ("log_vram_share", "hit_rate", "hit_rate_last"),
    "hit_rate_rolling": ("log_vram_share", "hit_rate", "hit_rate_last"),
    "prefill_live_tok_s": ("prefill_tok_s",),
}


def not_exported(values: dict[str, float | None], unexported: dict[str, str]) -> dict[str, str]:
    """Column → why it is missing because the engine does not export it (not "not yet", not "did not answer"):
    missing now, and every column it is made of is one the engine has no way to report."""
    out: dict[str, str] = {}
    for col, v in values.items():
        if v is not None:
            continue
        inputs = EFFECTIVE_INPUTS.get(col, (col,))
        if all(i in unexported for i in inputs):
            out[col] = unexported[inputs[0]]
    return out


def prefill_is_live(engine: str, state: str | None) -> bool:
    """Whether ``prefill_tok_s`` is a live rate: always for an adapter that counts prompt tokens over the poll
    interval (``Engine.prefill_rate_live``: llama.cpp's, 0 when idle); else only while a prompt is being read
    (Strata and the scripted engine report the last request's otherwise)."""
    return find_engine(engine).prefill_rate_live or state == "reading"


def _last_error(r: "_Runner", name: str) -> str:
    """The words of a late source's last finished reading when it failed (a server past its size cap or its
    deadline ends after the tick is composed: without this, the tick would only ever say "no answer")."""
    err = r.results.get(name, (None, None))[1]
    return f"; the last reading: {err}" if err and r.answered > 0 else ""


class _Runner(threading.Thread):
    """Reads its sources, one after the other, whenever the hub asks, on its own thread: a source that waits on
    another program (the engine's HTTP, NVML) alone; the local ones (``Source.local``: /proc, the log, the trace)
    together — one thread each cost ~0.1 % of a core more at 1 Hz in all (their wakes and the GIL passed among four
    threads woken at once; ``benchmarks/panel_cpu.py``, per-thread run time).

    It waits on a condition of its own (``wake``, on the hub's lock), and a reading it finished wakes only the hub
    (``done``). With one condition for all, every notify woke every runner and the hub, and each woke twice a
    second more to look: ~20 thread switches a second per runner at 1 Hz, where a tick needs 2 (a count from
    ``/proc/PID/task/*/status`` in the running window)."""

    def __init__(self, sources: Sequence[Source], lock: threading.Lock, done: threading.Condition,
                 stop: threading.Event):
        super().__init__(name="metrics-" + "+".join(s.name for s in sources), daemon=True)
        self.sources = list(sources)
        self.timeout_s = max(s.timeout_s for s in self.sources)
        self.cond = done
        self.wake = threading.Condition(lock)           # ``done``'s lock, the hub's: one lock to hold for both
        self.stop_event = stop
        self.requested = 0          # tick asked for
        self.answered = 0           # tick the result belongs to
        self.busy = False
        self.results: dict[str, tuple[Reading | None, str | None]] = {}     # by source name: (reading, error)
        self.elapsed_s = 0.0

    def run(self) -> None:
        while True:
            with self.wake:
                while self.requested <= self.answered and not self.stop_event.is_set():
                    self.wake.wait(30.0)         # the hub's request or its stop wakes it; the timeout is a guard
                if self.stop_event.is_set():
                    return
                k = self.requested
                self.busy = True
            t0 = time.monotonic()
            results: dict[str, tuple[Reading | None, str | None]] = {}
            for source in self.sources:
                result, error = None, None
                try:
                    result = source.read()
                except SourceMissing as exc:
                    error = str(exc)
                except Exception as exc:  # any failure of a source is "missing", with its reason
                    error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                results[source.name] = (result, error)
            with self.cond:
                self.results = results
                self.answered = k
                self.busy = False
                self.elapsed_s = time.monotonic() - t0
                self.cond.notify_all()


class MetricsHub:
    """Collect from ``sources`` at ``hz`` into ``store`` (and ``recorder``), emitting :class:`Tick` objects.

    Use either ``for tick in hub.iter_ticks(): ...`` (in a worker thread; returns when :meth:`stop` is called)
    or ``hub.add_listener(cb); hub.start()`` (the hub runs its own thread). :meth:`tick_once` takes one
    reading synchronously (``dsv41 monitor --once``)."""

    def __init__(self, sources: Sequence[Source], hz: float = 1.0, *, store: RingStore | None = None,
                 recorder: Recorder | None = None, engine: str = "", simulated: bool = False,
                 predicted_hit_rate: float | None = None, expert_bytes: int | None = None,
                 rolling_s: float = 60.0, columns: Sequence[str] = COLUMN_NAMES):
        if not (0.25 <= hz <= 10.0):
            raise ValueError(f"metrics rate {hz} Hz is outside 0.25–10 Hz")
        self.sources = list(sources)
        self.hz = float(hz)
        self.columns = tuple(columns)
        self.store = store if store is not None else RingStore(self.columns, hz=self.hz)
        self.recorder = recorder
        self.record_error: str | None = None
        self.engine = engine
        self.simulated = simulated
        self.predicted_hit_rate = predicted_hit_rate
        self.expert_bytes = expert_bytes
        self.rolling_s = rolling_s
        self._roll: deque[tuple[float, float, float]] = deque()   # (t, hit_rate, weight)
        # the steady decode rate the guides card judges, over the engine's own window (Engine.live_rate_window_s:
        # 0 = the adapter rates tokens over the poll interval, llama.cpp's)
        self.steady = SteadyTracker(engine_window_s=find_engine(engine).live_rate_window_s)
        # what the engine cannot report, from its class until its first answer says more (metrics absent)
        self._unexported: dict[str, str] = unexported_columns(find_engine(engine), None)
        self._listeners: list[Listener] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)   # the runners' "done" (the hub waits on it)
        self._runners: list[_Runner] | None = None
        self._thread: threading.Thread | None = None
        self._seq = 0
        self.last_tick: Tick | None = None
        self._closed = False
        self._close_lock = threading.Lock()
        self._loop_thread: threading.Thread | None = None
        self._loop_exited = threading.Event()

    # -- configuration ----------------------------------------------------------------------------------------
    @property
    def period_s(self) -> float:
        return 1.0 / self.hz

    def add_listener(self, cb: Listener) -> None:
        self._listeners.append(cb)

    def remove_listener(self, cb: Listener) -> None:
        if cb in self._listeners:
            self._listeners.remove(cb)

    def set_predicted(self, value: float | None) -> None:
        self.predicted_hit_rate = value

    def log_source(self) -> LogSwapSource | None:
        for s in self.sources:
            if isinstance(s, LogSwapSource):
                return s
        return None

    def push_log_line(self, line: str) -> None:
        """Hand one engine log line to the swap counter (when the hub does not tail the log itself)."""
        src = self.log_source()
        if src is not None:
            src.push_line(line)

    # -- running ----------------------------------------------------------------------------------------------
    def _ensure_runners(self) -> list[_Runner]:
        if self._runners is None:
            usable = [s for s in self.sources if not s.unavailable]
            local = [s for s in usable if getattr(s, "local", False)]   # a source of another shape: its own thread
            groups = [[s] for s in usable if s not in local] + ([local] if local else [])
            self._runners = [_Runner(g, self._lock, self._cond, self._stop) for g in groups]
            for r in self._runners:
                r.start()
        return self._runners

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def tick_once(self) -> Tick:
        """Ask every source once, compose, store, record and return the tick (blocks ≤ one period)."""
        runners = self._ensure_runners()
        self._seq += 1
        k = self._seq
        t = time.time()
        t0 = time.monotonic()
        asked: list[_Runner] = []
        missing: dict[str, str] = {s.name: s.unavailable for s in self.sources if s.unavailable}
        def limit(r: _Runner) -> float:
            return min(r.timeout_s, 0.9 * self.period_s)

        with self._cond:
            for r in runners:
                if r.busy:
                    for s in r.sources:
                        missing[s.name] = (f"still busy with an earlier reading (> {limit(r):.2g} s)"
                                           + _last_error(r, s.name))
                else:
                    r.requested = k
                    asked.append(r)
                    r.wake.notify()
            while True:
                now = time.monotonic()
                waiting = [r for r in asked if r.answered < k and now < t0 + limit(r)]
                if not waiting or self._stop.is_set():
                    break
                nearest = min(t0 + limit(r) for r in waiting)
                self._cond.wait(max(0.001, nearest - now))
            results = {s.name: (r.results.get(s.name, (None, None)) if r.answered == k else (None, None), r)
                       for r in asked for s in r.sources}
        values: dict[str, float | None] = {c: None for c in self.columns}
        notes: dict[str, Any] = {}
        sample: Sample | None = None
        simulated = self.simulated
        for src in self.sources:                 # in the sources' order (a later one's notes win, as always)
            if src.name not in results:
                continue
            (res, err), r = results[src.name]
            if res is None:
                missing[src.name] = err or f"no answer within {limit(r):.2g} s" + _last_error(r, src.name)
                continue
            for c in src.columns:
                if c in values:
                    x = res.values.get(c)
                    values[c] = measured(x, lo=None)     # not finite, or past what a float holds: missing
            notes.update(res.notes)
            if isinstance(res.payload, Sample):
                sample = res.payload
                simulated = simulated or bool(res.notes.get("simulated"))
        if "unexported" in notes:
            self._unexported = notes.pop("unexported") or {}
        for c in self._unexported:               # a figure the engine has no way to report is no reading ("0 swaps")
            if c in values:
                values[c] = None
        origin = derive(values, simulated, self.expert_bytes)
        values["hit_rate_rolling"] = self._rolling(t, values)
        state = sample.state if sample is not None else None
        self.steady.update(t, values, answered=sample is not None, state=state, period_s=self.period_s,
                           reply=last_reply(sample, self.engine), tasks=slot_tasks(sample))
        notes["steady"] = self.steady.snapshot(t, values.get("slots_busy"))
        notes["prefill_live"] = prefill_is_live(self.engine, state) if values.get("prefill_tok_s") is not None \
            else None
        # what the prefill plot draws: the rate only while it is live — the last request's rate between prompts
        # is not a reading of now (the card says "last …" for it), so it is a gap here, not a flat line
        values["prefill_live_tok_s"] = values.get("prefill_tok_s") if notes["prefill_live"] else None
        notes["not_exported"] = not_exported(values, self._unexported)
        if values["prefill_live_tok_s"] is not None and "prefill_tok_s" in origin:
            origin["prefill_live_tok_s"] = origin["prefill_tok_s"]
        tick = Tick(seq=k, t=t, mono=t0, values=values, engine=self.engine, simulated=simulated, sample=sample,
                    missing=missing, origin=origin, notes=notes, predicted_hit_rate=self.predicted_hit_rate,
                    hz=self.hz)
        self.store.append(t, values)
        self._record(tick)
        self.last_tick = tick
        return tick

    def _rolling(self, t: float, values: dict[str, float | None]) -> float | None:
        """The observed VRAM share of routed picks (``vram_share``) over the last ``rolling_s`` seconds, weighted
        by the decode rate (picks are per token, so busy seconds count more); idle seconds (decode 0) do not move
        it."""
        hr, dec = values.get("vram_share"), values.get("decode_tok_s")
        if _finite(hr):
            w = dec if _finite(dec) else 1.0
            if w > 0:
                self._roll.append((t, float(hr), float(w)))
        while self._roll and self._roll[0][0] < t - self.rolling_s:
            self._roll.popleft()
        if not self._roll:
            return None
        sw = sum(w for _, _, w in self._roll)
        return sum(h * w for _, h, w in self._roll) / sw if sw > 0 else None

    def detach_recorder(self) -> Recorder | None:
        """Take the recording away from this hub (left open) to hand it to the next one, e.g. when the rate
        changes for the same engine: one run, one file."""
        rec, self.recorder = self.recorder, None
        return rec

    def _record(self, tick: Tick) -> None:
        rec = self.recorder
        if rec is None or self.record_error:
            return
        try:
            rec.write(tick.t, tick.values)
        except ValueError:                      # closed under us while stopping
            return
        except OSError as exc:
            self.record_error = (f"recording stopped: {exc} — free some disk space in "
                                 f"{rec.dir.parent}; the plots keep running")
            tick.notes["record_error"] = self.record_error

    def iter_ticks(self, max_ticks: int | None = None) -> Iterator[Tick]:
        """Tick at ``hz`` until :meth:`stop` (or ``max_ticks``); yields each tick. Cleans up on exit."""
        n = 0
        next_at = time.monotonic()
        self._loop_thread = threading.current_thread()
        self._loop_exited.clear()
        try:
            while not self._stop.is_set():
                delay = next_at - time.monotonic()
                if delay > 0 and self._stop.wait(delay):
                    break
                tick = self.tick_once()
                for cb in list(self._listeners):
                    try:
                        cb(tick)
                    except Exception:  # a listener's bug must not stop collection
                        pass
                yield tick
                n += 1
                if max_ticks is not None and n >= max_ticks:
                    break
                next_at += self.period_s
                now = time.monotonic()
                if next_at < now:                 # fell behind (suspend, slow machine): skip, keep the phase
                    next_at += math.ceil((now - next_at) / self.period_s) * self.period_s
        finally:
            self.close()
            self._loop_exited.set()

    def start(self) -> None:
        """Run :meth:`iter_ticks` on the hub's own thread, calling listeners."""
        if self._thread is not None:
            return

        def loop() -> None:
            for _ in self.iter_ticks():
                pass

        self._thread = threading.Thread(target=loop, name="metrics-hub", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop ticking, end the source threads, close sources and the recording."""
        self._stop.set()
        self._wake_all()
        loop = self._loop_thread
        if loop is not None and loop is not threading.current_thread() and loop.is_alive():
            self._loop_exited.wait(timeout)       # the loop closes everything on its way out
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self.close()

    def _wake_all(self) -> None:
        """The hub's waits and every runner's, to see the stop."""
        with self._cond:
            self._cond.notify_all()
            for r in self._runners or []:
                r.wake.notify_all()

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        self._wake_all()
        for r in self._runners or []:
            r.join(0.2)
        for s in self.sources:
            try:
                s.close()
            except Exception:
                pass
        if self.recorder is not None:
            try:
                self.recorder.close()
            except OSError:
                pass
