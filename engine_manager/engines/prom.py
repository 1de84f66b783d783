"""Prometheus text (read by :mod:`._prometheus`, on ``prometheus_client``'s own parser) and the arithmetic the
attach-only adapters (vLLM, SGLang) need on it: sums over label sets, per-label breakdowns, counter rates and
histogram percentiles between two scrapes.

Percentiles follow Prometheus' ``histogram_quantile``: the cumulative bucket counts of the *later* scrape minus
those of the *earlier* one (only the requests that finished in between), then linear interpolation inside the
bucket the rank falls in; a rank in the ``+Inf`` bucket gives the highest finite bound. No request finished in
between → ``None`` (missing), never 0. A counter that went down (the server restarted) gives no rate for that
interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable

Labels = tuple[tuple[str, str], ...]


@dataclass
class Scrape:
    """One ``/metrics`` reading: every sample by its sample name (``…_total``, ``…_bucket``, ``…_sum``, …), as a
    list of (labels, value)."""

    t: float
    samples: dict[str, list[tuple[Labels, float]]] = field(default_factory=dict)

    def names(self) -> set[str]:
        return set(self.samples)

    def has_prefix(self, prefix: str) -> bool:
        return any(n.startswith(prefix) for n in self.samples)

    def total(self, name: str) -> float | None:
        """The sum over every label set of ``name``; None when the server does not export it."""
        rows = self.samples.get(name)
        if not rows:
            return None
        vals = [v for _, v in rows if math.isfinite(v)]
        total = float(sum(vals)) if vals else None
        return total if total is not None and math.isfinite(total) else None     # a sum past 1.8e308: missing

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """``name`` summed per value of ``label`` (e.g. per engine / data-parallel rank / tensor-parallel rank);
        empty when the server does not label it so."""
        out: dict[str, float] = {}
        for labels, v in self.samples.get(name, ()):
            d = dict(labels)
            if label in d and math.isfinite(v):
                out[d[label]] = out.get(d[label], 0.0) + v
        return {k: v for k, v in out.items() if math.isfinite(v)}

    def buckets(self, base: str) -> list[tuple[float, float]] | None:
        """The cumulative buckets ``(le, count)`` of histogram ``base`` summed over every other label, in ``le``
        order; None when the server does not export it."""
        rows = self.samples.get(base + "_bucket")
        if not rows:
            return None
        acc: dict[float, float] = {}
        for labels, v in rows:
            le = dict(labels).get("le")
            if le is None:
                continue
            try:
                bound = float(le)
            except ValueError:
                continue
            if math.isnan(bound) or not math.isfinite(v) or v < 0:
                continue
            acc[bound] = acc.get(bound, 0.0) + v
        return sorted((b, c) for b, c in acc.items() if math.isfinite(c)) or None


def parse(text: str, t: float) -> Scrape:
    """A ``/metrics`` page as a :class:`Scrape`, read by the project's one Prometheus reader
    (:func:`._prometheus.read_samples`, on prometheus_client's parser; a bad line costs that line only)."""
    from ._prometheus import read_samples

    out: dict[str, list[tuple[Labels, float]]] = {}
    for name, labels, value in read_samples(text):
        out.setdefault(name, []).append((tuple(sorted(labels.items())), float(value)))
    return Scrape(t=t, samples=out)


def rate(cur: Scrape, prev: Scrape | None, name: str) -> float | None:
    """Per-second increase of counter ``name`` between two scrapes; None without two readings, on a reset, or
    when time did not advance."""
    if prev is None:
        return None
    a, b = prev.total(name), cur.total(name)
    dt = cur.t - prev.t
    if a is None or b is None or dt <= 0 or a < 0 or b < a:      # a counter is never negative
        return None
    r = (b - a) / dt
    return r if math.isfinite(r) else None


def delta_buckets(cur: list[tuple[float, float]] | None,
                  prev: list[tuple[float, float]] | None) -> list[tuple[float, float]] | None:
    """``cur - prev`` bucket by bucket (same bounds); None when either is missing, the bounds differ, or a count
    went down (a restart: the interval cannot be told apart)."""
    if cur is None or prev is None:
        return None
    if [b for b, _ in cur] != [b for b, _ in prev]:
        return None
    out = [(b, c - p) for (b, c), (_, p) in zip(cur, prev)]
    if any(n < 0 for _, n in out):
        return None
    return out


def quantile(q: float, buckets: Iterable[tuple[float, float]] | None) -> float | None:
    """Prometheus' ``histogram_quantile(q, …)`` on cumulative buckets; None when they hold no observation."""
    if buckets is None:
        return None
    bs = sorted(buckets)
    if not bs or not math.isinf(bs[-1][0]):
        return None
    total = bs[-1][1]
    if total <= 0:
        return None
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in bs:
        if count >= rank:
            if math.isinf(bound):
                # the rank is above every finite bound: the highest finite bound is all that is known
                finite = [b for b, _ in bs if not math.isinf(b)]
                return finite[-1] if finite else None
            in_bucket = count - prev_count
            if in_bucket <= 0:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / in_bucket
        prev_bound, prev_count = bound, count
    return None


@dataclass
class Percentiles:
    p50_s: float | None
    p90_s: float | None
    p99_s: float | None
    count: float | None          # observations in the interval

    def as_dict(self, prefix: str) -> dict[str, float | None]:
        return {f"{prefix}_p50_s": self.p50_s, f"{prefix}_p90_s": self.p90_s, f"{prefix}_p99_s": self.p99_s,
                f"{prefix}_count": self.count}


def percentiles(cur: Scrape, base: Scrape | None, name: str) -> Percentiles:
    """p50 / p90 / p99 of histogram ``name`` over the requests that finished between ``base`` and ``cur``."""
    d = delta_buckets(cur.buckets(name), base.buckets(name) if base is not None else None)
    n = d[-1][1] if d else None
    return Percentiles(quantile(0.5, d), quantile(0.9, d), quantile(0.99, d), n)
