"""SGLang, attached to (never started by the panel; its ``/metrics`` needs ``--enable-metrics``): its Prometheus
names mapped onto the common sample.

Where each name comes from: SGLang's "Production Metrics" page (``docs/references/production_metrics.md``,
github.com/sgl-project/sglang, as published at docs.sglang.io/references/production_metrics.html, 2025–2026):

- ``sglang:num_running_reqs`` (gauge, "The number of running requests"), ``sglang:num_queue_reqs`` (gauge, "The
  number of requests in the waiting queue"), ``sglang:token_usage`` (gauge, "The token usage": the KV-cache pool's
  used fraction, 0..1), ``sglang:gen_throughput`` (gauge, "The generate throughput (token/s)"),
- ``sglang:prompt_tokens_total`` / ``sglang:generation_tokens_total`` (counters, "Number of prefill / generation
  tokens processed"),
- ``sglang:time_to_first_token_seconds`` and ``sglang:e2e_request_latency_seconds`` (histograms, seconds).
- ``sglang:num_requests_total`` (counter, total requests processed) and the ``tp_rank`` label that splits the
  scheduler's figures per tensor-parallel rank (one GPU each): the metric list of SGLang's observability page
  (mintlify.com/sgl-project/sglang/observability/metrics, 2026). Per-GPU figures are shown only where the server
  labels them so.
"""

from __future__ import annotations

from .openai_compat import MetricNames, OpenAICompatEngine


class SglangEngine(OpenAICompatEngine):
    name = "sglang"
    label = "SGLang (attached)"
    health_paths = ("/health", "/v1/models")
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


ENGINE = SglangEngine()
