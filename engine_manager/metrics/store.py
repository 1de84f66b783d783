"""Bounded, thread-safe ring buffers for the monitor's series (numpy).

Two tiers, both bounded:

- **full rate**: the newest ``full_span_s`` (24 h by default) at the polling rate, one row per tick;
- **decimated**: what falls out of the full-rate tier is averaged into buckets of ``coarse_bucket_s`` (60 s) and
  kept for ``coarse_span_s`` (30 days), so the "all" window can still show the whole run at a coarser grain.

Storage is allocated as it fills (doubling) up to the bound, so a short run costs little. Values are float32
(plots need no more; recordings on disk keep the sources' full precision), times float64 epoch seconds.
Memory at the bound: ``rows × (8 + 4 × columns)`` bytes — at 1 Hz with the monitor's 50 columns ≈ 18 MB,
at 10 Hz ≈ 180 MB.

``NaN`` is missing. Decimation averages the finite values of a bucket per column; a bucket where a column was
missing throughout stays missing.
"""

from __future__ import annotations

import math
import threading
from typing import Iterable, Mapping, Sequence

import numpy as np

DAY_S = 86_400.0
_F32_MAX = float(np.finfo(np.float32).max)


class _Ring:
    """A circular buffer of (t, row) that grows by doubling up to ``capacity`` rows."""

    def __init__(self, ncols: int, capacity: int, initial: int = 4096):
        self.ncols = ncols
        self.capacity = int(capacity)
        alloc = max(1, min(self.capacity, int(initial)))
        self.t = np.empty(alloc, dtype=np.float64)
        self.v = np.empty((alloc, ncols), dtype=np.float32)
        self.start = 0
        self.size = 0

    @property
    def alloc(self) -> int:
        return self.t.shape[0]

    def _grow(self, need: int) -> None:
        new = self.alloc
        while new < need and new < self.capacity:
            new = min(self.capacity, new * 2)
        if new == self.alloc:
            return
        t, v = self.ordered()
        self.t = np.empty(new, dtype=np.float64)
        self.v = np.empty((new, self.ncols), dtype=np.float32)
        self.t[: self.size] = t
        self.v[: self.size] = v
        self.start = 0

    def segments(self) -> list[tuple[int, int]]:
        end = self.start + self.size
        if end <= self.alloc:
            return [(self.start, end)]
        return [(self.start, self.alloc), (0, end - self.alloc)]

    def ordered(self) -> tuple[np.ndarray, np.ndarray]:
        segs = self.segments()
        if len(segs) == 1:
            a, b = segs[0]
            return self.t[a:b].copy(), self.v[a:b].copy()
        return (np.concatenate([self.t[a:b] for a, b in segs]),
                np.concatenate([self.v[a:b] for a, b in segs]))

    def first_t(self) -> float | None:
        return float(self.t[self.start]) if self.size else None

    def last_t(self) -> float | None:
        return float(self.t[(self.start + self.size - 1) % self.alloc]) if self.size else None

    def evict(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Remove the ``k`` oldest rows and return them (oldest first)."""
        k = min(k, self.size)
        idx = (self.start + np.arange(k)) % self.alloc
        t, v = self.t[idx].copy(), self.v[idx].copy()
        self.start = (self.start + k) % self.alloc
        self.size -= k
        return t, v

    def extend(self, t: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Append rows (len ≤ capacity); return the rows evicted to make room (oldest first)."""
        n = t.shape[0]
        if n == 0:
            return t[:0], v[:0]
        if self.size + n > self.alloc:
            self._grow(self.size + n)
        over = self.size + n - self.capacity
        evicted = self.evict(over) if over > 0 else (t[:0], v[:0])
        pos = (self.start + self.size + np.arange(n)) % self.alloc
        self.t[pos] = t
        self.v[pos] = v
        self.size += n
        return evicted

    def push(self, t: float, row: np.ndarray) -> tuple[float, np.ndarray] | None:
        """Append one row; return the row evicted, if any (the fast path of :meth:`extend`)."""
        evicted = None
        if self.size == self.alloc and self.alloc < self.capacity:
            self._grow(self.size + 1)
        if self.size == self.capacity:
            i = self.start
            evicted = (float(self.t[i]), self.v[i].copy())
            self.start = (self.start + 1) % self.alloc
            self.size -= 1
        i = (self.start + self.size) % self.alloc
        self.t[i] = t
        self.v[i] = row
        self.size += 1
        return evicted

    def count(self, t0: float, t1: float) -> int:
        n = 0
        for a, b in self.segments():
            seg = self.t[a:b]
            n += max(0, int(np.searchsorted(seg, t1, side="right")) - int(np.searchsorted(seg, t0, side="left")))
        return n

    def window(self, t0: float, t1: float, idx: list[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Rows with t0 <= t <= t1, oldest first (copies), only the columns ``idx`` when given."""
        ts, vs = [], []
        for a, b in self.segments():
            seg = self.t[a:b]
            i = a + int(np.searchsorted(seg, t0, side="left"))
            j = a + int(np.searchsorted(seg, t1, side="right"))
            if j > i:
                ts.append(self.t[i:j])
                vs.append(self.v[i:j] if idx is None else self.v[i:j][:, idx])
        ncols = self.ncols if idx is None else len(idx)
        if not ts:
            return np.empty(0), np.empty((0, ncols), dtype=np.float32)
        if len(ts) == 1:
            return ts[0].copy(), (vs[0].copy() if idx is None else vs[0])
        return np.concatenate(ts), np.concatenate(vs)

    def last_index(self) -> int:
        return (self.start + self.size - 1) % self.alloc

    @property
    def nbytes(self) -> int:
        return self.t.nbytes + self.v.nbytes


class RingStore:
    """Named series in bounded tiers (see the module doc). All methods are thread-safe."""

    def __init__(self, columns: Sequence[str], hz: float = 1.0, full_span_s: float = DAY_S,
                 coarse_bucket_s: float = 60.0, coarse_span_s: float = 30 * DAY_S, initial_rows: int = 4096,
                 overview_bucket_s: float | None = None):
        if hz <= 0:
            raise ValueError("hz must be positive")
        self.columns = tuple(columns)
        self.index = {c: i for i, c in enumerate(self.columns)}
        self.hz = float(hz)
        self.full_span_s = float(full_span_s)
        self.coarse_bucket_s = float(coarse_bucket_s)
        n = len(self.columns)
        self.full_capacity = max(2, int(math.ceil(full_span_s * hz)))
        self.coarse_capacity = max(2, int(math.ceil(coarse_span_s / coarse_bucket_s)))
        self._full = _Ring(n, self.full_capacity, initial_rows)
        self._coarse = _Ring(n, self.coarse_capacity, 256)
        # overview of the full-rate tier: min and max per bucket, kept as rows arrive, so a whole day can be
        # drawn without touching every row (2,048 buckets span the full tier)
        self.overview_bucket_s = float(overview_bucket_s or max(1.0, full_span_s / 2048))
        self._over = _Ring(2 * n, int(math.ceil(full_span_s / self.overview_bucket_s)) + 2, 256)
        self._over_bucket: float | None = None
        self._acc_bucket: float | None = None
        self._acc_sum = np.zeros(n, dtype=np.float64)
        self._acc_n = np.zeros(n, dtype=np.int64)
        self._acc_tsum = 0.0
        self._acc_rows = 0
        self._lock = threading.RLock()
        self.appended = 0
        self.t_shift = 0.0          # added to each appended time since the wall clock stepped back (see append)

    # -- writing ----------------------------------------------------------------------------------------------
    def row_from(self, values: Mapping[str, float | None]) -> np.ndarray:
        row = np.full(len(self.columns), np.nan, dtype=np.float32)
        for k, v in values.items():
            i = self.index.get(k)
            # the rows are float32: a figure past what one holds (a server's 1e300) would be stored as inf — missing
            if i is not None and v is not None and abs(v) <= _F32_MAX:
                row[i] = v
        return row

    def append(self, t: float, values: Mapping[str, float | None] | np.ndarray) -> None:
        """One row at time ``t`` (epoch s). Missing keys and ``None`` are stored as missing (NaN).

        The series stays ordered when the wall clock steps back (NTP, a person setting the time): the row goes one
        period after the last, and every later row keeps that shift (:attr:`t_shift`), so the plots go on at
        their pace instead of piling every row on one instant until the clock has caught up (an hour, for a
        step of an hour). The times then read ahead of the clock by the step. A step forward leaves a gap."""
        row = values if isinstance(values, np.ndarray) else self.row_from(values)
        with self._lock:
            last = self._full.last_t()
            t = float(t) + self.t_shift
            if last is not None and t <= last:
                gap = last + 1.0 / self.hz - t
                self.t_shift += gap
                t += gap
            ev = self._full.push(float(t), row)
            if ev is not None:
                self._decimate(np.array([ev[0]]), ev[1][None, :])
            self._overview_add(np.array([t]), row[None, :])
            self.appended += 1

    def extend(self, t: Iterable[float] | np.ndarray, values: np.ndarray) -> None:
        """Many rows at once (loading a recording): ``values`` is (rows × columns) in column order."""
        t = np.asarray(t, dtype=np.float64)
        values = np.asarray(values, dtype=np.float32)
        if values.ndim != 2 or values.shape != (t.shape[0], len(self.columns)):
            raise ValueError(f"values must be {t.shape[0]} × {len(self.columns)}")
        if t.size == 0:
            return
        if np.any(np.diff(t) < 0):
            order = np.argsort(t, kind="stable")
            t, values = t[order], values[order]
        with self._lock:
            last = self._full.last_t()
            if last is not None:
                keep = t > last
                t, values = t[keep], values[keep]
            for a in range(0, t.shape[0], self.full_capacity):
                b = a + self.full_capacity
                ev_t, ev_v = self._full.extend(t[a:b], values[a:b])
                if ev_t.size:
                    self._decimate(ev_t, ev_v)
            keep_from = max(0, t.shape[0] - self.full_capacity)
            self._overview_add(t[keep_from:], values[keep_from:])
            self.appended += int(t.shape[0])

    def _overview_add(self, t: np.ndarray, v: np.ndarray) -> None:
        if t.size == 0:
            return
        n = len(self.columns)
        bucket = np.floor(t / self.overview_bucket_s) * self.overview_bucket_s
        cuts = np.flatnonzero(np.diff(bucket)) + 1
        starts = np.concatenate([[0], cuts]).astype(np.int64)
        with np.errstate(invalid="ignore"):
            mins = np.fmin.reduceat(v, starts, axis=0)
            maxs = np.fmax.reduceat(v, starts, axis=0)
        for k, s in enumerate(starts):
            b = float(bucket[s])
            if self._over_bucket is not None and b == self._over_bucket and self._over.size:
                i = self._over.last_index()
                row = self._over.v[i]
                with np.errstate(invalid="ignore"):
                    row[:n] = np.fmin(row[:n], mins[k])
                    row[n:] = np.fmax(row[n:], maxs[k])
            else:
                self._over.push(b, np.concatenate([mins[k], maxs[k]]))
                self._over_bucket = b

    def _decimate(self, t: np.ndarray, v: np.ndarray) -> None:
        """Fold rows leaving the full-rate tier into ``coarse_bucket_s`` buckets (mean of finite values)."""
        bucket = np.floor(t / self.coarse_bucket_s) * self.coarse_bucket_s
        cuts = np.flatnonzero(np.diff(bucket)) + 1
        starts = np.concatenate([[0], cuts]).astype(np.int64)
        finite = np.isfinite(v)
        vz = np.where(finite, v, 0).astype(np.float64)
        sums = np.add.reduceat(vz, starts, axis=0)
        counts = np.add.reduceat(finite.astype(np.int64), starts, axis=0)
        tsums = np.add.reduceat(t, starts)
        rows = np.diff(np.concatenate([starts, [t.shape[0]]]))
        for k, s in enumerate(starts):
            b = float(bucket[s])
            if self._acc_bucket is not None and b != self._acc_bucket:
                self._flush_acc()
            self._acc_bucket = b
            self._acc_sum += sums[k]
            self._acc_n += counts[k]
            self._acc_tsum += float(tsums[k])
            self._acc_rows += int(rows[k])

    def _acc_row(self) -> tuple[float, np.ndarray] | None:
        if self._acc_rows == 0:
            return None
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = np.where(self._acc_n > 0, self._acc_sum / np.maximum(self._acc_n, 1), np.nan)
        return self._acc_tsum / self._acc_rows, mean.astype(np.float32)

    def _flush_acc(self) -> None:
        r = self._acc_row()
        if r is not None:
            self._coarse.push(r[0], r[1])
        self._acc_sum[:] = 0
        self._acc_n[:] = 0
        self._acc_tsum = 0.0
        self._acc_rows = 0
        self._acc_bucket = None

    # -- reading ----------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        with self._lock:
            return self._full.size + self._coarse.size + (1 if self._acc_rows else 0)

    @property
    def full_len(self) -> int:
        return self._full.size

    @property
    def coarse_len(self) -> int:
        return self._coarse.size

    @property
    def nbytes(self) -> int:
        return self._full.nbytes + self._coarse.nbytes + self._over.nbytes

    def span(self) -> tuple[float, float] | None:
        """(oldest, newest) time held in either tier."""
        with self._lock:
            first = self._coarse.first_t() if self._coarse.size else None
            if first is None and self._acc_rows:
                first = self._acc_tsum / self._acc_rows
            if first is None:
                first = self._full.first_t()
            last = self._full.last_t()
            if first is None or last is None:
                return None
            return first, last

    def last(self) -> tuple[float, dict[str, float | None]] | None:
        with self._lock:
            if not self._full.size:
                return None
            i = self._full.last_index()
            t, row = float(self._full.t[i]), self._full.v[i]
            return t, {c: (None if not np.isfinite(row[j]) else float(row[j])) for j, c in enumerate(self.columns)}

    def window(self, t0: float | None = None, t1: float | None = None, columns: Sequence[str] | None = None,
               max_points: int | None = None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Rows with ``t0 <= t <= t1`` from all tiers (decimated rows first, then full rate), as
        ``(t, {column: values})``. With ``max_points``, longer results are reduced to about that many points by
        min/max per bucket (each bucket gives its min and its max, so peaks survive — pyqtgraph's 'peak'
        idea); a range long enough is drawn from the overview kept while rows arrive, without touching every
        row."""
        lo = -math.inf if t0 is None else float(t0)
        hi = math.inf if t1 is None else float(t1)
        cols = self.columns if columns is None else tuple(columns)
        idx = [self.index[c] for c in cols]
        with self._lock:
            parts_t, parts_v = [], []
            full_first = self._full.first_t()
            older = full_first is None or lo < full_first
            if older and self._coarse.size:
                ct, cv = self._coarse.window(lo, hi if full_first is None else min(hi, full_first), idx)
                parts_t.append(ct)
                parts_v.append(cv)
            acc = self._acc_row() if older else None
            if acc is not None and lo <= acc[0] <= hi:
                parts_t.append(np.array([acc[0]]))
                parts_v.append(acc[1][None, idx])
            use_overview = False
            full_last = self._full.last_t()
            if max_points is not None and full_first is not None and full_last is not None:     # rows at full rate
                f_lo = max(lo, full_first)
                f_hi = min(hi, full_last)
                if f_hi > f_lo and (f_hi - f_lo) / self.overview_bucket_s * 2 >= max_points \
                        and self._full.count(f_lo, f_hi) > max_points:
                    use_overview = True
            if use_overview and full_first is not None:
                # completed overview buckets (min at the bucket's start, max at its middle), then the rows of
                # the bucket still filling at full rate, so the newest seconds are exact
                n = len(self.columns)
                cur = self._over_bucket if self._over_bucket is not None else math.inf
                ot, ov = self._over.window(lo - self.overview_bucket_s, min(hi, cur - 1e-3))
                keep = ot + self.overview_bucket_s > max(lo, full_first)
                ot, ov = ot[keep], ov[keep]
                tt = np.empty(2 * ot.shape[0])
                tt[0::2] = np.maximum(ot, full_first)
                tt[1::2] = np.maximum(tt[0::2], ot + 0.5 * self.overview_bucket_s)
                vv = np.empty((2 * ot.shape[0], len(idx)), dtype=np.float32)
                vv[0::2] = ov[:, idx]
                vv[1::2] = ov[:, [n + i for i in idx]]
                parts_t.append(tt)
                parts_v.append(vv)
                ft, fv = self._full.window(max(lo, cur), hi, idx)
                parts_t.append(ft)
                parts_v.append(fv)
            else:
                ft, fv = self._full.window(lo, hi, idx)
                parts_t.append(ft)
                parts_v.append(fv)
        t = np.concatenate(parts_t) if len(parts_t) > 1 else parts_t[0]
        v = np.concatenate(parts_v) if len(parts_v) > 1 else parts_v[0]
        if max_points is not None and t.shape[0] > (1.5 if use_overview else 1.0) * max_points >= 4:
            t, v = peak_reduce(t, v, max_points)
        return t, {c: v[:, k] for k, c in enumerate(cols)}

    def column(self, name: str, t0: float | None = None, t1: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        t, d = self.window(t0, t1, [name])
        return t, d[name]


def peak_reduce(t: np.ndarray, v: np.ndarray, max_points: int) -> tuple[np.ndarray, np.ndarray]:
    """Reduce (t, v[rows × cols]) to about ``max_points`` rows keeping each bucket's min and max per column
    (NaN-aware: a bucket is missing only where every value in it is)."""
    n = t.shape[0]
    nb = max(1, max_points // 2)
    edges = np.linspace(0, n, nb + 1).astype(np.int64)
    # with two rows a bucket or more the starts rise already (np.unique's sort was a third of the time)
    starts = edges[:-1] if n >= 2 * nb else np.unique(edges[:-1])
    with np.errstate(invalid="ignore"):
        vmin = np.fmin.reduceat(v, starts, axis=0)
        vmax = np.fmax.reduceat(v, starts, axis=0)
    ends = np.concatenate([starts[1:], [n]]) - 1
    tt = np.empty(2 * starts.shape[0])
    tt[0::2] = t[starts]
    tt[1::2] = t[ends]
    vv = np.empty((2 * starts.shape[0], v.shape[1]), dtype=v.dtype)
    vv[0::2] = vmin
    vv[1::2] = vmax
    return tt, vv
