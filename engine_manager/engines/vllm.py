"""vLLM, attached to (never started by the panel): its Prometheus ``/metrics`` mapped onto the common sample.

Where each name comes from (vLLM's own documentation):

- ``vllm:num_requests_running`` (gauge), ``vllm:num_requests_waiting`` (gauge), ``vllm:kv_cache_usage_perc``
  (gauge, fraction 0..1), ``vllm:prompt_tokens_total`` / ``vllm:generation_tokens_total`` (counters),
  ``vllm:request_success_total`` (counter, by finish reason), ``vllm:time_to_first_token_seconds`` and
  ``vllm:e2e_request_latency_seconds`` (histograms): the V1 engine's list in ``docs/design/metrics.md``
  ("v1 Metrics"), vLLM main as of 2026 (github.com/vllm-project/vllm), and the "Production Metrics" page
  (docs.vllm.ai/en/stable/usage/metrics/).
- ``vllm:gpu_cache_usage_perc``: the older name of the KV-cache gauge ("GPU KV-cache usage. 1 means 100 percent
  usage."), Production Metrics page of vLLM v0.4.0 – v0.9.1 (docs.vllm.ai/en/v0.5.0/serving/metrics.html); read
  when the new name is absent.
- every series carries ``model_name``; a data-parallel V1 server also labels each series with ``engine`` (the
  engine-core index, one per DP rank): the figures per ``engine`` are the per-GPU-group figures.
"""

from __future__ import annotations

from .base import Evidence
from .openai_compat import PROM_FIGURES, MetricNames, OpenAICompatEngine


class VllmEngine(OpenAICompatEngine):
    name = "vllm"
    label = "vLLM (attached)"
    words = kind_label = "vLLM"
    health_paths = ("/health", "/v1/models")
    exports = PROM_FIGURES
    METRICS = MetricNames(
        running="vllm:num_requests_running",
        waiting="vllm:num_requests_waiting",
        kv_usage="vllm:kv_cache_usage_perc",
        kv_usage_old="vllm:gpu_cache_usage_perc",
        prompt_tokens="vllm:prompt_tokens_total",
        generation_tokens="vllm:generation_tokens_total",
        requests="vllm:request_success_total",
        ttft="vllm:time_to_first_token_seconds",
        e2e="vllm:e2e_request_latency_seconds",
        per_gpu_labels=("engine",),
    )

    def recognise(self, ev: Evidence) -> tuple[list[str], list[str]] | None:
        if ev.has_prefix("vllm:"):
            return ["vLLM metrics (vllm:*) on /metrics"], []
        if "vllm" in ev.owned_by:
            return (["vLLM's model list (owned_by vllm)"],
                    ["vLLM's /metrics: load, token rates and latencies are missing"])
        return None


ENGINE = VllmEngine()
