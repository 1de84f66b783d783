"""SGLang, attached to (never started by the panel; its ``/metrics`` needs ``--enable-metrics``): its Prometheus
names mapped onto the common sample.

Where each name comes from: SGLang's "Production Metrics" page (``docs/references/production_metrics.md``,
github.com/sgl-project/sglang, published at docs.sglang.io/references/production_metrics.html, 2025–2026) and the
metric list of its observability page (mintlify.com/sgl-project/sglang/observability/metrics, 2026):
- gauges ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, ``sglang:token_usage`` (the KV-cache pool's used
  fraction, 0..1), ``sglang:gen_throughput`` (token/s);
- counters ``sglang:prompt_tokens_total``, ``sglang:generation_tokens_total``, ``sglang:num_requests_total``;
- histograms ``sglang:time_to_first_token_seconds``, ``sglang:e2e_request_latency_seconds`` (seconds);
- the ``tp_rank`` label splits the scheduler's figures per tensor-parallel rank (one GPU each); per-GPU figures are
  shown only where the server labels them so.
"""

from __future__ import annotations

from .base import Evidence
from .openai_compat import PROM_FIGURES, MetricNames, OpenAICompatEngine


class SglangEngine(OpenAICompatEngine):
    name = "sglang"
    label = "SGLang (attached)"
    words = kind_label = "SGLang"
    health_paths = ("/health", "/v1/models")
    exports = PROM_FIGURES
    METRICS = MetricNames(
        running="sglang:num_running_reqs",
        waiting="sglang:num_queue_reqs",
        kv_usage="sglang:token_usage",
        prompt_tokens="sglang:prompt_tokens_total",
        generation_tokens="sglang:generation_tokens_total",
        requests="sglang:num_requests_total",
        ttft="sglang:time_to_first_token_seconds",
        e2e="sglang:e2e_request_latency_seconds",
        gen_throughput="sglang:gen_throughput",
        per_gpu_labels=("tp_rank",),
    )

    def recognise(self, ev: Evidence) -> tuple[list[str], list[str]] | None:
        if ev.has_prefix("sglang:"):
            return ["SGLang metrics (sglang:*) on /metrics"], []
        if "sglang" in ev.owned_by:
            return ["SGLang's model list"], ["SGLang's /metrics (start it with --enable-metrics): load and latencies "
                                             "are missing"]
        return None


ENGINE = SglangEngine()
