"""Concurrent streamed requests with a timestamp for every token, and the figures taken from them.

One thread per stream, each with its own connection (``ChatClient.stream``), all released together by a barrier.
Every token's arrival time is the client's ``time.perf_counter()`` when its chunk was parsed; the client's own CPU
cost is each stream thread's ``time.thread_time()`` (what the bench spent reading and parsing), so the report can
show that the client is not what limits the figures.

Decode rates are taken over the *common window*: from the moment every stream has its first token to the moment
the first stream ends. Outside it fewer streams decode (prompts still being read, streams already done), so rates
there are not rates at N users. Inside it each stream's rate is (tokens − 1) / (last − first token time).
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from ..cancel import CancelToken
from ..chat import (
    ChatClient,
    ChatError,
    ChatOptions,
    ContentDelta,
    ReasoningDelta,
    StreamDone,
    TimingsInfo,
    UsageInfo,
)
from .stats import measured, measured_int


@dataclass
class StreamRecord:
    index: int
    sent_at: float = 0.0                      # perf_counter when the request was sent
    token_times: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None          # the engine's usage
    completion_tokens: int | None = None
    engine_tok_s: float | None = None         # timings.predicted_per_second
    engine_prompt_tok_s: float | None = None  # timings.prompt_per_second
    engine_prompt_ms: float | None = None
    client_cpu_s: float = 0.0
    ended_at: float = 0.0
    cancelled: bool = False
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.sent_at if self.token_times else None

    def rate(self, start: float | None = None, end: float | None = None) -> float | None:
        ts = [t for t in self.token_times if (start is None or t >= start) and (end is None or t <= end)]
        if len(ts) < 2 or ts[-1] <= ts[0]:
            return None
        return (len(ts) - 1) / (ts[-1] - ts[0])

    def max_gap(self, after: float | None = None, before: float | None = None) -> float | None:
        """The longest time between two consecutive tokens (both inside [after − one gap, before])."""
        ts = self.token_times
        gaps = [b - a for a, b in zip(ts, ts[1:]) if (after is None or b >= after) and (before is None or a <= before)]
        return max(gaps) if gaps else None

    def to_dict(self, t0: float) -> dict[str, Any]:
        d = asdict(self)
        d["token_times"] = [round(t - t0, 5) for t in self.token_times]
        d["sent_at"] = round(self.sent_at - t0, 5)
        d["ended_at"] = round(self.ended_at - t0, 5)
        d["ttft_s"] = self.ttft_s
        return d


class Streams:
    """``n`` streamed requests started together; :meth:`wait` joins them. ``cancel`` stops them all."""

    def __init__(self, client: ChatClient, prompts: Sequence[list[dict]], options: Sequence[ChatOptions],
                 on_token: Callable[[int, float], None] | None = None):
        self.client = client
        self.prompts, self.options = list(prompts), list(options)
        self.records = [StreamRecord(i) for i in range(len(self.prompts))]
        self.tokens = [CancelToken() for _ in self.prompts]
        self.on_token = on_token
        self.stalled_s: float | None = None       # set by wait() when the engine sent nothing for too long
        self._barrier = threading.Barrier(len(self.prompts) + 1)
        self._threads = [threading.Thread(target=self._one, args=(i,), name=f"bench-stream-{i}", daemon=True)
                         for i in range(len(self.prompts))]

    def start(self) -> "Streams":
        for t in self._threads:
            t.start()
        self._barrier.wait()
        return self

    def _one(self, i: int) -> None:
        rec = self.records[i]
        self._barrier.wait()
        cpu0 = time.thread_time()
        rec.sent_at = time.perf_counter()
        try:
            for ev in self.client.stream(self.prompts[i], self.options[i], self.tokens[i]):
                if isinstance(ev, (ContentDelta, ReasoningDelta)):
                    rec.token_times.append(ev.t)
                    if self.on_token is not None:
                        self.on_token(i, ev.t)
                elif isinstance(ev, UsageInfo):      # an impossible count (negative, 1e999, NaN) is missing
                    rec.prompt_tokens = measured_int(ev.prompt_tokens)
                    rec.completion_tokens = measured_int(ev.completion_tokens)
                elif isinstance(ev, TimingsInfo):
                    rec.engine_tok_s = measured(ev.predicted_per_second)
                    rec.engine_prompt_tok_s = measured(ev.prompt_per_second)
                    rec.engine_prompt_ms = measured(ev.prompt_ms)
                elif isinstance(ev, StreamDone):
                    rec.cancelled = ev.stats.cancelled
        except ChatError as exc:
            rec.error = str(exc)
        except Exception as exc:  # noqa: BLE001 - a stream's failure is reported, not raised in a thread
            rec.error = f"{type(exc).__name__}: {exc}"
        finally:
            rec.ended_at = time.perf_counter()
            rec.client_cpu_s = time.thread_time() - cpu0

    def cancel(self, i: int | None = None) -> None:
        for j, tok in enumerate(self.tokens):
            if i is None or i == j:
                tok.cancel("benchmark")

    def alive(self) -> int:
        return sum(t.is_alive() for t in self._threads)

    def wait(self, timeout: float | None = None, stop: CancelToken | None = None, *,
             stall_s: float | None = None, first_token_s: float | None = None) -> bool:
        """Join every stream (True), or give up (False: cancelled) at ``timeout``, when ``stop`` is cancelled, or when
        the engine stalls: no token on any stream for ``stall_s`` seconds (``first_token_s`` before the first token,
        while the prompts are read). After a stall ``stalled_s`` says how long nothing came."""
        start = time.monotonic()
        end = None if timeout is None else start + timeout
        seen, last = 0, start
        for t in self._threads:
            while t.is_alive():
                now = time.monotonic()
                if stop is not None and stop.cancelled:
                    self.cancel()
                    self._join_all(5.0)
                    return False
                if end is not None and now > end:
                    self.cancel()
                    self._join_all(5.0)
                    return False
                if stall_s is not None:
                    n = sum(len(r.token_times) for r in self.records)
                    if n != seen:
                        seen, last = n, now
                    limit = stall_s if n else (first_token_s if first_token_s is not None else stall_s)
                    if now - last > limit:
                        self.stalled_s = now - last
                        self.cancel()
                        self._join_all(5.0)
                        return False
                t.join(0.05)
        return True

    def _join_all(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))


def common_window(records: Sequence[StreamRecord]) -> tuple[float, float] | None:
    """(start, end) while every stream was decoding; None when there is no such time."""
    firsts = [r.token_times[0] for r in records if r.token_times]
    lasts = [r.token_times[-1] for r in records if r.token_times]
    if len(firsts) != len(records) or not records:
        return None
    start, end = max(firsts), min(lasts)
    return (start, end) if end > start else None


def decode_figures(records: Sequence[StreamRecord]) -> dict[str, Any]:
    """Total, per-stream and slowest decode tok/s in the common window; TTFT; engine's own figures; client CPU."""
    win = common_window(records)
    rates = [r.rate(*win) if win else None for r in records]
    if len(records) == 1 and rates[0] is None:
        rates = [records[0].rate()]
    ok = [x for x in rates if x is not None]
    wall = (max(r.ended_at for r in records) - min(r.sent_at for r in records)) if records else 0.0
    cpu = sum(r.client_cpu_s for r in records)
    return {
        "users": len(records),
        "total_tok_s": sum(ok) if len(ok) == len(records) else None,
        "per_stream_tok_s": rates,
        "slowest_tok_s": min(ok) if len(ok) == len(records) else None,
        "window_s": (win[1] - win[0]) if win else None,
        "ttft_s": [r.ttft_s for r in records],
        "engine_tok_s": [r.engine_tok_s for r in records],
        "engine_total_tok_s": (sum(x for x in (r.engine_tok_s for r in records) if x)
                               if all(r.engine_tok_s for r in records) else None),
        "prompt_tokens": [r.prompt_tokens for r in records],
        "tokens": [len(r.token_times) for r in records],
        "errors": [r.error for r in records if r.error],
        "wall_s": wall,
        "client_cpu_s": cpu,
        "client_cpu_per_stream_s": cpu / len(records) if records else None,
        "client_cpu_share": cpu / wall if wall > 0 else None,
    }
