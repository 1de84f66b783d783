"""Prometheus text pages (Strata's ``/metrics`` as text, llama-server's, vLLM's and SGLang's ``/metrics``): the one
reader, on prometheus_client's own parser (``prometheus_client.parser.text_string_to_metric_families``), and the
arithmetic the attach-only adapters (vLLM, SGLang) need between two scrapes.

:func:`read_samples` gives every sample as ``(name, labels, value)`` under the name the page wrote (llama-server's
``llamacpp:n_tokens_max`` counter keeps its name without ``_total``); NaN and ±Inf are dropped (missing, never a
value). A page the parser refuses is read line by line, so one bad line costs that line, not the page.

:class:`Scrape` holds one reading: sums over label sets, per-label breakdowns, counter rates (:func:`rate`: none
across a counter that went down, i.e. a restart) and histogram percentiles (:func:`percentiles`, Prometheus'
``histogram_quantile`` on the later scrape's buckets minus the earlier one's, linear inside the bucket; a rank in
``+Inf`` gives the highest finite bound; no request finished in between → ``None``, never 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Iterator


def _parse(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    # imported on first use: prometheus_client brings http.server and ssl (~40 ms of a panel start that reads no
    # metrics page yet)
    from prometheus_client.parser import text_string_to_metric_families
    written: set[str] | None = None
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name
            # the parser renames a counter's sample that lacks "_total" to "<name>_total" (the OpenMetrics form);
            # llama-server writes such counters (llamacpp:n_tokens_max): keep the name the page wrote
            if family.type == "counter" and name == family.name + "_total":
                if written is None:
                    written = {ln.split("{", 1)[0].split()[0] for ln in text.splitlines()
                               if ln.strip() and not ln.lstrip().startswith("#")}
                if name not in written and family.name in written:
                    name = family.name
            yield name, dict(s.labels), float(s.value)


LINE_CAP = 64 * 1024     # no sample line is this long (names and label values are short): one that is, is no sample


def read_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of the page as ``(name, labels, value)``, NaN and ±Inf dropped. A line past ``LINE_CAP`` is
    left out before parsing (the parser takes ~8 times a line's size in memory: a 14 MB one-line answer cost the
    panel 110 MB)."""
    if any(len(line) > LINE_CAP for line in text.split("\n")):
        text = "\n".join(line for line in text.split("\n") if len(line) <= LINE_CAP)
    try:
        rows = list(_parse(text))
    except ValueError:                # a malformed line: read the page line by line, keep what parses
        rows = []
        for line in text.splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            try:
                rows += list(_parse(line + "\n"))
            except ValueError:
                continue
    return [(n, lab, v) for n, lab, v in rows if math.isfinite(v)]


def summed(text: str) -> dict[str, float]:
    """``{name: value}``, labels dropped and values summed over label sets; a name whose sum is past what a float
    holds (1e308 + 1e308) is left out (missing), so one absurd series costs that figure, not the page."""
    out: dict[str, float] = {}
    for name, _labels, v in read_samples(text):
        out[name] = out.get(name, 0.0) + v
    return {k: v for k, v in out.items() if math.isfinite(v)}


def labelled(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """``{name: [(labels, value), ...]}`` for every sample."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for name, labels, v in read_samples(text):
        out.setdefault(name, []).append((labels, v))
    return out


def series_key(name: str, labels: dict[str, str]) -> str:
    """``name{a="x",b="y"}`` (labels sorted), or ``name`` without labels: one key per series."""
    if not labels:
        return name
    inner = ",".join('{}="{}"'.format(k, v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n"))
                     for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def by_series(text: str) -> dict[str, float]:
    """``{series_key: value}``: each labelled series on its own (the last one wins if a page repeats it)."""
    return {series_key(n, lab): v for n, lab, v in read_samples(text)}


# -- two scrapes: rates and percentiles --------------------------------------------------------------------------------

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
    """A ``/metrics`` page as a :class:`Scrape`, read by :func:`read_samples` (a bad line costs that line only)."""
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


__all__ = ["LINE_CAP", "Labels", "Percentiles", "Scrape", "by_series", "delta_buckets", "labelled", "parse",
           "percentiles", "quantile", "rate", "read_samples", "series_key", "summed"]
