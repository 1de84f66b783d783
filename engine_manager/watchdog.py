"""Liveness: an engine that is alive but stuck, or that answers its health check and fails every request.

Answering ``/health`` is not serving: Strata has its own watchdog because a run hard-stalled mid-reply with the GPU
still busy (generate.cpp @2291cb3, the serve loop's "no progress for N s during a request" line), and a server can
answer health while every request ends in an error. :class:`Watchdog` is fed successive readings (the adapter's
:class:`~engine_manager.engines.base.Sample`, or a Monitor tick) and says:
- ``stalled`` — a request in flight, the process alive, and no progress (no token, no prompt token read, no request
  finished) for longer than :attr:`Watchdog.stall_after_s` (the setting, else ``max(min_stall_s, pace_factor × the
  slowest token gap measured recently)``, learnt only from readings whose counters moved), with the engine's CPU
  time and the GPU's utilisation and power beside it;
- ``unavailable`` — the engine answers but its last ``fail_streak`` finished requests all ended in an error;
- ``ok`` (serving), ``idle`` (nothing in flight), ``not answering`` (the process runs, its metrics do not answer),
  ``down`` (the process is gone: the supervisor's crash handling says why).
Qt-free, no I/O of its own: the readings are given to it.
"""

from __future__ import annotations

import collections
import math
from dataclasses import asdict, dataclass
from typing import Any

BUSY_STATES = ("reading", "generating")

OK, IDLE, STALLED, UNAVAILABLE, NOT_ANSWERING, DOWN = ("ok", "idle", "stalled", "unavailable", "not answering",
                                                       "down")


@dataclass(frozen=True)
class Liveness:
    state: str
    stall_after_s: float
    since_progress_s: float | None = None       # seconds without progress while a request is in flight
    token_gap_s: float | None = None            # the slowest token gap measured recently (what the limit comes from)
    cpu_time_delta_s: float | None = None       # the engine's CPU seconds since the last progress
    gpu_util_pct: float | None = None
    gpu_power_w: float | None = None
    failed_streak: int = 0
    detail: str = ""

    @property
    def alarming(self) -> bool:
        return self.state in (STALLED, UNAVAILABLE)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["alarming"] = self.alarming
        return d

    def line(self) -> str:
        return f"{self.state}: {self.detail}" if self.detail else self.state


def _f(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    f = float(v)
    return f if math.isfinite(f) and f >= 0 else None


class Watchdog:
    """Feed it readings in time order (:meth:`feed_sample`, :meth:`feed_tick`); each returns the :class:`Liveness`
    now."""

    def __init__(self, stall_after_s: float | None = None, *, min_stall_s: float = 10.0, pace_factor: float = 20.0,
                 fail_streak: int = 3, pace_window: int = 60):
        self.setting_s = stall_after_s if stall_after_s and stall_after_s > 0 else None
        self.min_stall_s = min_stall_s
        self.pace_factor = pace_factor
        self.fail_streak = max(1, fail_streak)
        self._gaps: collections.deque[float] = collections.deque(maxlen=max(1, pace_window))
        self._progress: tuple | None = None
        self._progress_t: float | None = None
        self._progress_cpu: float | None = None
        self._requests: int | None = None
        self._streak = 0
        self._cpu_s: float | None = None            # integrated from CPU % when no CPU time is given
        self._last_t: float | None = None
        self.last: Liveness | None = None

    @property
    def token_gap_s(self) -> float | None:
        return max(self._gaps) if self._gaps else None

    @property
    def stall_after_s(self) -> float:
        if self.setting_s is not None:
            return self.setting_s
        gap = self.token_gap_s
        return max(self.min_stall_s, self.pace_factor * gap) if gap is not None else self.min_stall_s

    def feed_sample(self, sample: Any, *, t: float | None = None, alive: bool | None = None,
                    cpu_time_s: float | None = None, cpu_pct: float | None = None, gpu_util_pct: float | None = None,
                    gpu_power_w: float | None = None, missing: str = "", mono: float | None = None) -> Liveness:
        """One reading: ``sample`` the engine adapter's Sample (None when the engine did not answer: ``missing``
        says why), ``alive`` whether its process runs (None: unknown), the engine's CPU time (or CPU %, integrated
        here) and the GPU's utilisation and power (None when not read). ``mono``: the reading's time on the
        monotonic clock (a Monitor tick's); the intervals are measured on it when given, since a step of the wall
        clock (``t``, the sample's) would read as an hour without progress and restart a working engine."""
        t = float(mono if mono is not None else t if t is not None else getattr(sample, "t", 0.0) or 0.0)
        if cpu_time_s is None and cpu_pct is not None and self._last_t is not None and t > self._last_t:
            self._cpu_s = (self._cpu_s or 0.0) + cpu_pct / 100.0 * (t - self._last_t)
        elif cpu_time_s is None and cpu_pct is not None and self._cpu_s is None:
            self._cpu_s = 0.0
        cpu = cpu_time_s if cpu_time_s is not None else self._cpu_s
        self._last_t = t
        extra = getattr(sample, "extra", None) or {} if sample is not None else {}
        if gpu_util_pct is None:
            gpu_util_pct = _f(extra.get("gpu_util_pct"))
        base: dict[str, Any] = dict(stall_after_s=self.stall_after_s, token_gap_s=self.token_gap_s,
                                    gpu_util_pct=gpu_util_pct, gpu_power_w=gpu_power_w)
        if alive is False:
            self._reset_progress()
            return self._out(Liveness(DOWN, detail="the engine's process is not running", **base))
        if sample is None:
            self._reset_progress()
            return self._out(Liveness(NOT_ANSWERING, detail=missing or "the engine's metrics did not answer",
                                      **base))
        self._count_failures(sample)
        state = getattr(sample, "state", None)
        in_flight = state in BUSY_STATES or (_f(getattr(sample, "queued", None)) or 0) > 0
        progress = (getattr(sample, "tokens_generated_total", None), getattr(sample, "requests_total", None),
                    extra.get("generated"), extra.get("prompt_read"), extra.get("prompt_total"))
        moved = progress != self._progress            # also True for the first reading (no progress known yet)
        rate = _f(getattr(sample, "decode_tok_s", None))
        # The pace is learnt only from a reading that moved: a rate measured over time (Strata's live.tok_s over
        # 2 s, llama.cpp's request mean since its first token) falls while the engine is stuck, and learning from
        # it would push the limit away as the stall goes on.
        if rate is not None and rate > 0 and moved:
            self._gaps.append(1.0 / rate)
            base.update(stall_after_s=self.stall_after_s, token_gap_s=self.token_gap_s)
        if not in_flight or moved or self._progress_t is None:
            self._progress, self._progress_t, self._progress_cpu = progress, t, cpu
        since = t - self._progress_t if in_flight else None
        dcpu = cpu - self._progress_cpu if cpu is not None and self._progress_cpu is not None and in_flight else None
        base.update(since_progress_s=since, cpu_time_delta_s=dcpu, failed_streak=self._streak)
        if self._streak >= self.fail_streak:
            return self._out(Liveness(UNAVAILABLE, detail=(
                f"the engine answers, but its last {self._streak} requests all ended in an error; restart it "
                "(the log says why they failed)"), **base))
        if in_flight and since is not None and since > base["stall_after_s"]:
            return self._out(Liveness(STALLED, detail=self._stall_words(since, dcpu, gpu_util_pct, gpu_power_w),
                                      **base))
        return self._out(Liveness(OK if in_flight else IDLE, **base))

    def feed_tick(self, tick: Any, *, alive: bool | None = None) -> Liveness:
        """One Monitor tick (:class:`engine_manager.metrics.hub.Tick`): its engine sample, the engine's CPU % and
        the GPU's utilisation and power (NVML columns, where present)."""
        v = getattr(tick, "values", {}) or {}
        return self.feed_sample(getattr(tick, "sample", None), t=getattr(tick, "t", None),
                                mono=getattr(tick, "mono", None), alive=alive,
                                cpu_pct=_f(v.get("engine_cpu_pct")), gpu_util_pct=_f(v.get("gpu_util_pct")),
                                gpu_power_w=_f(v.get("gpu_power_w")),
                                missing=(getattr(tick, "missing", {}) or {}).get("engine", ""))

    def _count_failures(self, sample: Any) -> None:
        total = getattr(sample, "requests_total", None)
        finish = (getattr(sample, "extra", None) or {}).get("last_finish")
        if isinstance(total, int) and self._requests is not None and total > self._requests:
            self._streak = self._streak + (total - self._requests) if finish == "error" else 0
        if isinstance(total, int):
            self._requests = total

    def _reset_progress(self) -> None:
        self._progress = self._progress_t = self._progress_cpu = None

    def _stall_words(self, since: float, dcpu: float | None, util: float | None, power: float | None) -> str:
        parts = [f"a request is in flight and nothing moved for {since:.0f} s (the limit is "
                 f"{self.stall_after_s:.0f} s at this engine's pace)"]
        beside = []
        if dcpu is not None:
            beside.append(f"engine CPU time +{dcpu:.1f} s")
        if util is not None:
            beside.append(f"GPU {util:.0f} %")
        if power is not None:
            beside.append(f"{power:.0f} W")
        if beside:
            parts.append(", ".join(beside))
        parts.append("restart the engine if it does not recover")
        return "; ".join(parts)

    def _out(self, live: Liveness) -> Liveness:
        self.last = live
        return live


__all__ = ["BUSY_STATES", "DOWN", "IDLE", "Liveness", "NOT_ANSWERING", "OK", "STALLED", "UNAVAILABLE", "Watchdog"]
