"""Engines the panel only attaches to: a plain OpenAI-compatible server, and the base of the vLLM and SGLang
adapters (:mod:`.vllm`, :mod:`.sglang`).

The panel never starts these (``build_launch`` refuses in plain words); it reaches them through a saved
connection (:mod:`engine_manager.connections`). A plain OpenAI server says nothing about its load: every figure
is missing (``None``), and the monitor shows it so. The Prometheus-speaking subclasses map their documented
``/metrics`` names (:attr:`METRICS`) onto the common :class:`~.base.Sample`: requests running / waiting, KV-cache
usage, prompt / generation token counters → rates between two scrapes, TTFT and end-to-end latency histograms →
p50/p90/p99 over the requests that finished between two scrapes (:mod:`.prometheus_text`), per-GPU figures where the
server labels them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import EngineSetupError
from . import prometheus_text as prom
from ._http import METRICS_BODY_CAP, SMALL_BODY_CAP, bearer_headers, deadline_of, get_capped
from .base import Engine, Evidence, LaunchSpec, Readiness, Sample

#: latency percentiles are taken over the requests that finished since a baseline scrape at most this old
PERCENTILE_WINDOW_S = 60.0


@dataclass(frozen=True)
class MetricNames:
    """The Prometheus names one engine documents (None: it has none for that figure)."""

    running: str | None = None           # gauge: requests being generated now
    waiting: str | None = None           # gauge: requests queued
    kv_usage: str | None = None          # gauge 0..1: KV-cache usage
    kv_usage_old: str | None = None      # an older name of the same gauge
    prompt_tokens: str | None = None     # counter (sample name, with _total)
    generation_tokens: str | None = None
    requests: str | None = None          # counter of finished requests
    ttft: str | None = None              # histogram base name, seconds
    e2e: str | None = None               # histogram base name, seconds
    gen_throughput: str | None = None    # gauge tok/s, when the engine computes one itself
    per_gpu_labels: tuple[str, ...] = ()  # labels that split figures per GPU / rank


class _PromState:
    """What one poll hands the next (through ``Sample.extra['prom_state']``): the last scrape and the baseline
    the latency percentiles are taken from."""

    __slots__ = ("last", "base")

    def __init__(self, last: prom.Scrape, base: prom.Scrape | None):
        self.last, self.base = last, base

    def __deepcopy__(self, memo):          # Sample.to_dict() copies extras: this one is shared, never edited
        return self

    def __repr__(self) -> str:
        return "<prom state>"


#: what a server with documented Prometheus metrics (vLLM, SGLang) fills: load and token rates, no expert figures
PROM_FIGURES = frozenset({"state", "decode_tok_s", "prefill_tok_s", "slots_busy", "queued", "requests_total",
                          "tokens_generated_total"})


class OpenAICompatEngine(Engine):
    """A server that speaks the OpenAI API and nothing else the panel knows. Attach only."""

    name = "openai_compat"
    label = "OpenAI-compatible server (attached)"
    simulated = False
    attach_only = True
    words = "an OpenAI-compatible server"
    kind_label = "OpenAI-compatible server"
    METRICS: MetricNames | None = None
    health_paths: tuple[str, ...] = ("/v1/models",)
    exports: frozenset[str] | None = frozenset()      # a plain OpenAI server: no load figures at all

    def recognise(self, ev: Evidence) -> tuple[list[str], list[str]] | None:
        if not ev.models:
            return None
        return [], ["load figures: a plain OpenAI-compatible server reports none (users, tok/s, KV cache show as "
                    "missing)"]

    def build_launch(self, settings: Any, plan: dict[str, Any] | None, workdir: Path) -> LaunchSpec:
        raise EngineSetupError(
            f"The panel cannot start {self.label.replace(' (attached)', '')}: it only attaches to one that runs. "
            "Start it yourself, then add it with `dsv41 connections add NAME URL` and use --connection NAME.")

    def _headers(self, spec: LaunchSpec) -> dict[str, str]:
        return bearer_headers(spec.api_key)

    def readiness(self, client: Any, spec: LaunchSpec) -> Readiness:
        import httpx

        for path in self.health_paths:
            try:
                r = get_capped(client, spec.base_url + path, headers=self._headers(spec), cap=SMALL_BODY_CAP,
                               deadline_s=5.0)
            except httpx.ConnectError:
                return Readiness("loading", f"connection refused at {spec.base_url}")
            if r.status_code == 200:
                return Readiness("ready", f"{path} answered 200")
            if r.status_code in (401, 403):
                return Readiness("failed", f"{path} refused the API key (HTTP {r.status_code})")
        return Readiness("loading", f"HTTP {r.status_code} from {self.health_paths[-1]}")

    def poll(self, client: Any, spec: LaunchSpec, previous: Sample | None) -> Sample:
        """One reading: ``/metrics`` (``/v1/models`` for a plain OpenAI server, which has no figures), read with
        a size cap and an overall deadline (the client's timeout; :func:`._http.get_capped`)."""
        deadline = deadline_of(client)
        if self.METRICS is None:
            r = get_capped(client, spec.base_url + "/v1/models", headers=self._headers(spec), cap=SMALL_BODY_CAP,
                           deadline_s=deadline)
            r.raise_for_status()
            return Sample(t=time.time(), engine=self.name,
                          extra={"attach_only": True, "note": "a plain OpenAI server reports no load figures"})
        r = get_capped(client, spec.base_url + "/metrics", headers=self._headers(spec), cap=METRICS_BODY_CAP,
                       deadline_s=deadline)
        r.raise_for_status()
        t = time.time()
        return self.sample_from_text(r.text, t, previous)

    # -- Prometheus → Sample ------------------------------------------------------------------------------------
    def sample_from_text(self, text: str, t: float, previous: Sample | None) -> Sample:
        m = self.METRICS
        assert m is not None
        cur = prom.parse(text, t)
        st = previous.extra.get("prom_state") if previous is not None else None
        last = st.last if isinstance(st, _PromState) else None
        base = st.base if isinstance(st, _PromState) else None
        if base is None or last is None:
            base = last
        elif cur.t - base.t > PERCENTILE_WINDOW_S:
            base = last                   # the window moves on: percentiles over the requests since the last scrape

        def total(name: str | None) -> float | None:
            # requests, tokens and rates cannot be negative: a server that says so says nothing (missing)
            return _not_negative(cur.total(name)) if name else None

        running, waiting = total(m.running), total(m.waiting)
        # a 0..1 gauge exported once per rank: the mean over ranks is the figure (a sum of fractions is not one)
        kv = _fraction(_mean_gauge(cur, m.kv_usage))
        if kv is None:
            kv = _fraction(_mean_gauge(cur, m.kv_usage_old))
        gen_total = total(m.generation_tokens)
        req_total = total(m.requests)
        extra: dict[str, Any] = {"attach_only": True, "kv_cache_usage": kv}
        if m.gen_throughput:
            extra["engine_gen_tok_s"] = total(m.gen_throughput)
        next_base = base
        for key, hist in (("ttft", m.ttft), ("e2e", m.e2e)):
            if hist:
                extra.update(prom.percentiles(cur, base, hist).as_dict(key))
                if (base is not None and cur.buckets(hist) is not None and base.buckets(hist) is not None
                        and prom.delta_buckets(cur.buckets(hist), base.buckets(hist)) is None):
                    next_base = cur       # the server restarted (counts went down): measure from this scrape on
        extra["prom_state"] = _PromState(cur, next_base)
        # the figures whose metric this server leaves out of its /metrics: "not exported", not "not yet"
        absent = {f: name for f, name in (("slots_busy", m.running), ("queued", m.waiting),
                                          ("decode_tok_s", m.generation_tokens),
                                          ("tokens_generated_total", m.generation_tokens),
                                          ("prefill_tok_s", m.prompt_tokens), ("requests_total", m.requests))
                  if name and name not in cur.samples}
        if absent:
            extra["absent"] = absent
        extra["per_gpu"] = self._per_gpu(cur) or None
        state = None if running is None else ("generating" if running > 0 else "idle")
        return Sample(
            t=t, engine=self.name, state=state,
            decode_tok_s=prom.rate(cur, last, m.generation_tokens) if m.generation_tokens else None,
            prefill_tok_s=prom.rate(cur, last, m.prompt_tokens) if m.prompt_tokens else None,
            slots_busy=None if running is None else int(running),
            queued=None if waiting is None else int(waiting),
            requests_total=None if req_total is None else int(req_total),
            tokens_generated_total=None if gen_total is None else int(gen_total),
            extra=extra,
        )

    def _per_gpu(self, cur: prom.Scrape) -> dict[str, dict[str, float | None]]:
        m = self.METRICS
        assert m is not None
        out: dict[str, dict[str, float | None]] = {}
        for label in m.per_gpu_labels:
            for key, name in (("running", m.running), ("waiting", m.waiting),
                              ("kv_cache_usage", m.kv_usage or m.kv_usage_old)):
                if not name:
                    continue
                for rank, v in cur.by_label(name, label).items():
                    out.setdefault(f"{label}={rank}", {})[key] = (_fraction(v) if key == "kv_cache_usage"
                                                                  else _not_negative(v))
        return out


def _mean_gauge(cur: prom.Scrape, name: str | None) -> float | None:
    """The mean of a gauge over its label sets (one label set: its value); None when it is not exported."""
    if not name:
        return None
    rows = [v for _, v in cur.samples.get(name, ()) if math.isfinite(v)]
    mean = sum(rows) / len(rows) if rows else None
    return mean if mean is not None and math.isfinite(mean) else None


def _not_negative(v: float | None) -> float | None:
    """A count, a total or a rate as measured: None (missing) when it is not a finite number ≥ 0."""
    return v if v is not None and math.isfinite(v) and v >= 0 else None


def _fraction(v: float | None) -> float | None:
    """A 0..1 usage as measured: None (missing) outside it (a rounding hair above 1 is 1)."""
    if v is None or not math.isfinite(v) or v < 0 or v > 1.0 + 1e-6:
        return None
    return min(v, 1.0)


ENGINE = OpenAICompatEngine()
