"""The steady-state decode rate: the figure the guides' comparison judges, and the newest reply's own rate.

The engine's live ``decode_tok_s`` is a window average (Strata and the scripted engine: the last 2 s; llama.cpp's
adapter: each running request's tokens since its first, at most 120 s, ``engines/llamacpp.py`` says why), so while
users start or finish it holds idle time or a prompt read and reads low; judged against the guides, every short chat
would be "below the guides" (an example: benchmarks/results/design_figures.md). :class:`SteadyTracker` keeps only:
- **intervals**: two consecutive ticks with the same users decoding (same count, no request arrived or finished —
  ``requests_total`` and the queue unchanged, the same llama.cpp tasks in the same slots — every busy slot decoding):
  the token counter's difference over the interval, or without one the window rate once the same users have decoded
  for the whole window;
- **whole replies of a lone user**: a request finishing while at most one was active since the engine was last idle
  (or the previous reply finished) gives its own rate (``requests[].decode_tok_s``; llama.cpp's per-scrape
  ``predicted_tokens_seconds``): a clean 1-user figure, however short.
:meth:`SteadyTracker.snapshot` gives the figure at the current number of users once there is enough of it
(:attr:`min_s` seconds of steady intervals, or one whole reply), else how much has been measured so far. Qt-free.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping

from ..engines import find_engine
from .columns import SLOT_COLUMNS


@dataclass(frozen=True)
class Steady:
    """A steady decode figure at ``users`` concurrent users."""

    users: int
    total_tok_s: float                 # all users together
    each_tok_s: float                  # per user
    seconds: float                     # steady decoding it rests on (intervals; a reply counts its busy ticks)
    replies: int                       # whole lone replies among it
    t: float                           # time of the newest contribution

    def basis(self) -> str:
        parts = []
        if self.seconds > 0:
            parts.append(f"{self.seconds:.0f} s of steady decoding")
        if self.replies:
            parts.append(f"{self.replies} whole repl{'y' if self.replies == 1 else 'ies'}")
        who = f"{self.users} user{'s' if self.users != 1 else ''}"
        return f"{' and '.join(parts) or 'steady decoding'} at {who}"


@dataclass(frozen=True)
class SteadySnapshot:
    """What the tracker knows at one tick (immutable: it crosses threads inside ``Tick.notes``)."""

    users_now: int | None              # busy slots now (None: the engine did not say)
    current: Steady | None             # the figure at ``users_now``, when there is enough of it
    measured_s: float                  # steady seconds at ``users_now`` so far (for "measuring…")
    need_s: float                      # how many are enough
    latest: Steady | None              # the newest figure at any number of users (shown while idle)
    last_reply_tok_s: float | None     # the newest finished reply's own decode rate (engine timing)
    last_reply_t: float | None
    t: float = 0.0                     # the tick's time

    def recent(self, max_age_s: float = 60.0) -> Steady | None:
        """The figure to judge now: at the current users when there is one, else the newest figure at other
        users when it is at most ``max_age_s`` old (users come and go between ticks; the card must not flicker
        between a verdict and "measuring…")."""
        if self.current is not None:
            return self.current
        if self.latest is not None and self.t - self.latest.t <= max_age_s:
            return self.latest
        return None


@dataclass
class _Obs:
    t: float
    users: int | None
    state: str | None
    queued: float | None
    requests: float | None
    tokens: float | None
    decode: float | None
    slots_decoding: int | None         # busy slots with a positive per-slot rate (None: not listed)
    tasks: frozenset | None            # llama.cpp (slot, task) pairs


def _num(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def last_reply(sample: Any, engine: str) -> tuple[Any, float | None]:
    """(identity, decode tok/s) of the newest finished reply as the engine reports it; (None, None) unknown.

    Strata and the scripted engine list finished requests (``requests[]``): the adapter keeps the newest one's
    ``decode_tok_s``/``hit_rate``/``finish``, which identify it. llama.cpp resets ``predicted_tokens_seconds``
    on every scrape, so a positive value (under its ``Engine.reply_rate_extra``) means replies finished since the
    previous poll, at that rate."""
    if sample is None:
        return None, None
    extra = getattr(sample, "extra", None) or {}
    rate = _num(extra.get("last_decode_tok_s"))
    if rate is not None:
        return (rate, extra.get("last_hit_rate"), extra.get("last_finish"), extra.get("last_pcie_share")), rate
    key = find_engine(engine).reply_rate_extra
    if key is not None:
        avg = _num(extra.get(key))
        if avg is not None and avg > 0:
            return ("scrape", getattr(sample, "t", None)), avg
    return None, None


def slot_tasks(sample: Any) -> frozenset | None:
    """llama.cpp's (slot, task id) pairs of the busy slots, when the adapter kept them."""
    slots = (getattr(sample, "extra", None) or {}).get("slots")
    if not isinstance(slots, Mapping):
        return None
    try:
        return frozenset((int(k), int(v.get("task", -1))) for k, v in slots.items() if isinstance(v, Mapping))
    except (TypeError, ValueError):
        return None


class SteadyTracker:
    """Feed one tick at a time (:meth:`update`); ask :meth:`snapshot`. Not thread-safe: one hub thread feeds it.

    ``engine_window_s``: the span of the engine's own ``decode_tok_s`` window (Strata: 2 s; 0 for a rate over
    the poll interval, as llama.cpp's adapter computes it). ``min_s``: steady seconds that are enough for a
    verdict. ``recent_s``: the figure is the mean of the newest steady data up to this many seconds.
    ``horizon_s``: older data is not used (the hot set changes as traffic does); the newest figure is kept for
    :attr:`SteadySnapshot.latest` however old."""

    def __init__(self, engine_window_s: float = 2.0, min_s: float = 2.0, recent_s: float = 10.0,
                 horizon_s: float = 120.0):
        self.engine_window_s = engine_window_s
        self.min_s = min_s
        self.recent_s = recent_s
        self.horizon_s = horizon_s
        self._prev: _Obs | None = None
        self._run_start: float | None = None       # first tick of the current run of steady intervals
        self._counter_live: bool | None = None     # does the token counter move while decoding?
        self._counter_stalls = 0
        # (t, users, rate, weight_s, is_reply)
        self._pieces: deque[tuple[float, int, float, float, bool]] = deque()
        self._solo = False                          # since an idle tick / a reply's end, never > 1 user
        self._solo_ticks = 0                        # busy ticks since then
        self._last_key: Any = None
        self._have_key = False
        self.last_reply_tok_s: float | None = None
        self.last_reply_t: float | None = None
        self._latest: Steady | None = None

    # -- feeding --------------------------------------------------------------------------------------------------
    def reset(self) -> None:
        self._prev = None
        self._run_start = None
        self._solo = False
        self._solo_ticks = 0

    def update(self, t: float, values: Mapping[str, float | None], *, answered: bool, state: str | None = None,
               period_s: float = 1.0, reply: tuple[Any, float | None] = (None, None),
               tasks: frozenset | None = None) -> None:
        """One tick. ``answered``: the engine answered this tick (else everything steady is broken off)."""
        if not answered:
            self.reset()
            return
        busy = _num(values.get("slots_busy"))
        rates = [_num(values.get(c)) for c in SLOT_COLUMNS]
        listed = [r for r in rates if r is not None]
        cur = _Obs(t=t, users=None if busy is None else int(round(busy)), state=state,
                   queued=_num(values.get("queued")), requests=_num(values.get("requests_total")),
                   tokens=_num(values.get("tokens_generated_total")), decode=_num(values.get("decode_tok_s")),
                   slots_decoding=sum(1 for r in listed if r > 0) if listed else None, tasks=tasks)
        prev, self._prev = self._prev, cur
        self._interval(prev, cur, period_s)
        self._reply(prev, cur, reply, period_s, _num(values.get("slots_total")))
        while self._pieces and self._pieces[0][0] < t - self.horizon_s:
            self._pieces.popleft()

    def _steady_pair(self, a: _Obs, b: _Obs, period_s: float) -> bool:
        n = b.users
        if n is None or n < 1 or a.users != n:
            return False
        if b.t <= a.t or b.t - a.t > 2.5 * period_s:                 # a gap: ticks were missed
            return False
        if a.state not in (None, "generating") or b.state not in (None, "generating"):
            return False                                               # a prompt being read pauses decoding
        if a.queued != b.queued or a.requests != b.requests:
            return False                                               # a request arrived, finished or moved up
        if a.tasks is not None and b.tasks is not None and a.tasks != b.tasks:
            return False
        if b.slots_decoding is not None and b.slots_decoding != n:
            return False                                               # a busy slot is not decoding
        return True

    def _interval(self, a: _Obs | None, b: _Obs, period_s: float) -> None:
        if a is None or b.users is None or not self._steady_pair(a, b, period_s):
            self._run_start = None
            return
        if self._run_start is None:
            self._run_start = a.t
        dt = b.t - a.t
        rate = None
        if a.tokens is not None and b.tokens is not None and self._counter_live is not False:
            d = b.tokens - a.tokens
            if d > 0:
                rate = d / dt
                self._counter_live, self._counter_stalls = True, 0
            elif (b.decode or 0) > 0 and (a.decode or 0) > 0:
                # decoding, yet the counter stands: it counts at the end of a request only (three times in a
                # row, so that one slow step between two close ticks does not decide it)
                self._counter_stalls += 1
                if self._counter_stalls >= 3 and not self._counter_live:
                    self._counter_live = False
        if rate is None and b.decode is not None and b.decode > 0 \
                and b.t - self._run_start >= self.engine_window_s - 1e-6:
            rate = b.decode                                            # the whole window was steady
        if rate is not None:
            self._pieces.append((b.t, int(b.users), float(rate), float(dt), False))

    def _reply(self, a: _Obs | None, b: _Obs, reply: tuple[Any, float | None], period_s: float,
               slots_total: float | None) -> None:
        key, rate = reply
        changed = self._have_key and key is not None and key != self._last_key
        if key is not None:
            self._last_key = key
        self._have_key = True                    # the first tick's reply (or None: none yet) is the reference
        one_slot = slots_total is not None and int(round(slots_total)) == 1     # nothing can ever overlap
        gap = a is not None and b.t - a.t > 2.5 * period_s       # (the first tick may anchor: idle is idle)
        arrivals = (b.requests - a.requests) if a is not None and a.requests is not None \
            and b.requests is not None else 0
        breaks = gap or b.users is None or b.users > 1 or arrivals > 1
        if changed and rate is not None and rate > 0:
            self.last_reply_tok_s, self.last_reply_t = float(rate), b.t
            if one_slot or (self._solo and not breaks):
                weight = max(1, self._solo_ticks) * period_s
                self._pieces.append((b.t, 1, float(rate), float(weight), True))
            self._solo_ticks = 0
        # the lone-user span starts at an idle tick (no request active: the next reply starts after it) and
        # breaks as soon as two users, a burst of arrivals or a gap in the ticks are seen; a reply's end keeps it
        if breaks and not one_slot:
            self._solo, self._solo_ticks = False, 0
        elif b.users == 0:
            self._solo, self._solo_ticks = True, 0
        elif b.users == 1 and (self._solo or one_slot):
            self._solo_ticks += 1

    # -- reading --------------------------------------------------------------------------------------------------
    def _figure(self, users: int, now: float) -> tuple[Steady | None, float]:
        """(figure at ``users`` if enough, steady seconds measured) over the newest data within the horizon."""
        secs, replies, wsum, acc, newest = 0.0, 0, 0.0, 0.0, None
        for t, n, rate, w, is_reply in reversed(self._pieces):
            if t < now - self.horizon_s:
                break
            if n != users:
                continue
            if newest is None:
                newest = t
            acc += rate * w
            wsum += w
            if is_reply:
                replies += 1
            else:
                secs += w
            if wsum >= self.recent_s:
                break
        if newest is None or wsum <= 0 or (secs < self.min_s - 1e-6 and replies == 0):
            return None, secs
        total = acc / wsum
        return Steady(users=users, total_tok_s=total, each_tok_s=total / users, seconds=secs, replies=replies,
                      t=float(newest)), secs

    def snapshot(self, now: float, users_now: float | None) -> SteadySnapshot:
        n = None if users_now is None or not math.isfinite(users_now) else int(round(users_now))
        current, measured = (self._figure(n, now) if n is not None and n >= 1 else (None, 0.0))
        if current is not None:
            self._latest = current
        elif self._pieces and (self._latest is None or self._pieces[-1][0] > self._latest.t):
            fig, _s = self._figure(self._pieces[-1][1], now)     # e.g. the lone reply that just ended
            if fig is not None:
                self._latest = fig
        return SteadySnapshot(users_now=n, current=current, measured_s=measured, need_s=self.min_s,
                              latest=self._latest, last_reply_tok_s=self.last_reply_tok_s,
                              last_reply_t=self.last_reply_t, t=now)
