"""The scripted engine's Prometheus pages, as Strata writes them: ``/metrics`` as text (vLLM's names plus
``strata:*``, ``serve/prometheus.py`` ``render``) and ``/metrics/prometheus`` (llama-server's names,
``Service.prometheus``). Both are written from the same figures as the JSON answers (:mod:`.server`).
"""

from __future__ import annotations

from typing import Any

from .model import MODEL_ID, Engine

# ------------------------------------------------------------------------------------------------ Prometheus
BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
           80.0, 160.0, 640.0, 2560.0)        # vLLM's, as serve/prometheus.py


def _num(v: Any, default: float = 0) -> Any:
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else default


def vllm_text(doc: dict[str, Any], eng: Engine) -> str:
    """``/metrics`` in Prometheus' text format with vLLM's names and ``strata:*`` for the JSON's own facts, as
    Strata's ``serve/prometheus.py`` ``render`` writes it (from the same document the JSON answer has)."""
    lab = f'model_name="{MODEL_ID}"'
    live, totals, hw, eng_doc = doc["live"], doc["totals"], doc["hardware"], doc["engine"]
    out: list[str] = []

    def metric(name: str, kind: str, help_: str, value: Any) -> None:
        out.append(f"# HELP {name} {help_}\n# TYPE {name} {kind}\n{name}{{{lab}}} {value}")

    busy = live.get("state") in ("reading", "generating")
    ctx = _num(eng_doc.get("max_context"))
    used = _num(live.get("prompt_tokens")) + _num(live.get("generated")) if busy else 0
    metric("vllm:num_requests_running", "gauge", "Requests reading their prompt or generating.",
           _num(live.get("running"), int(busy)))
    metric("vllm:num_requests_waiting", "gauge", "Requests waiting for their turn.",
           _num(live.get("queued")) + _num(live.get("waiting")))
    metric("vllm:kv_cache_usage_perc", "gauge", "The running request's share of the context (1 = full).",
           round(min(1.0, used / ctx), 4) if ctx else 0)
    metric("vllm:prompt_tokens_total", "counter", "Prompt tokens of the finished requests.",
           _num(totals.get("prompt_tokens")))
    metric("vllm:generation_tokens_total", "counter", "Generated tokens.", _num(totals.get("output_tokens")))
    metric("vllm:request_success_total", "counter", "Finished requests.", _num(totals.get("requests")))
    metric("vllm:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prompt cache.",
           _num(totals.get("prompt_tokens")))
    metric("vllm:prefix_cache_hits_total", "counter", "Prompt tokens the prompt cache already held.",
           _num(totals.get("reused")))
    metric("vllm:spec_decode_num_draft_tokens_total", "counter", "MTP draft tokens offered.",
           _num(totals.get("drafts_offered")))
    metric("vllm:spec_decode_num_accepted_tokens_total", "counter", "MTP draft tokens accepted.",
           _num(totals.get("drafts_accepted")))
    metric("vllm:num_preemptions_total", "counter", "Preempted requests (Strata does not preempt).", 0)
    with eng.cond:
        lat = list(eng.latency)
    for name, idx, help_ in (("vllm:time_to_first_token_seconds", 0, "Time to the first token."),
                             ("vllm:inter_token_latency_seconds", 1, "Time between two tokens."),
                             ("vllm:e2e_request_latency_seconds", 2, "A request from start to end.")):
        counts, total, n = [0] * len(BUCKETS), 0.0, 0
        for row in lat:
            v, times = row[idx], 1
            if idx == 1:                       # the mean gap, once per gap
                v, times = (row[1] / (row[3] - 1), row[3] - 1) if row[3] > 1 and row[1] else (None, 0)
            if v is None or times <= 0:
                continue
            for i, b in enumerate(BUCKETS):
                if v <= b:
                    counts[i] += times
            total += v * times
            n += times
        out.append(f"# HELP {name} {help_}\n# TYPE {name} histogram")
        out.extend(f'{name}_bucket{{{lab},le="{b}"}} {c}' for b, c in zip(BUCKETS, counts))
        out.append(f'{name}_bucket{{{lab},le="+Inf"}} {n}')
        out.append(f"{name}_sum{{{lab}}} {round(total, 6)}\n{name}_count{{{lab}}} {n}")

    typed: set[str] = set()

    def strata(name: str, kind: str, help_: str, value: Any, labels: str = "") -> None:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return                              # unknown here: no sample
        if name not in typed:
            typed.add(name)
            out.append(f"# HELP strata:{name} {help_}\n# TYPE strata:{name} {kind}")
        out.append(f"strata:{name}{{{lab}{labels}}} {value}")

    for state in ("unloaded", "idle", "reading", "generating"):
        strata("live_state", "gauge", "1 for what the engine is doing (live.state).", int(live.get("state") == state),
               f',state="{state}"')
    strata("live_tok_s", "gauge", "Decode rate over the last seconds (live.tok_s).", live.get("tok_s") or 0)
    strata("live_prefill_tok_s_mean", "gauge", "Prompt reading rate of the running request "
           "(live.prefill_tok_s_mean).", live.get("prefill_tok_s_mean") or 0)
    strata("live_prompt_read", "gauge", "Prompt tokens read so far by the running request (live.prompt_read).",
           live.get("prompt_read") or 0)
    slots = live.get("slots")
    if isinstance(slots, list) and slots:
        for state in ("idle", "reading", "generating"):
            strata("live_slots", "gauge", "The batch slots in each state (live.slots).",
                   sum(1 for x in slots if x.get("state") == state), f',state="{state}"')
    strata("engine_max_context", "gauge", "The engine's context (engine.max_context).", eng_doc.get("max_context"))
    strata("totals_prompt_seconds_total", "counter", "Time spent reading prompts (totals.prompt_ms).",
           round((totals.get("prompt_ms") or 0) / 1000, 3))
    strata("totals_decode_seconds_total", "counter", "Time spent generating (totals.decode_ms).",
           round((totals.get("decode_ms") or 0) / 1000, 3))
    strata("totals_ended_inside_thinking_total", "counter",
           "Replies that ended inside the thinking with no answer (totals.ended_inside_thinking).", 0)
    last = (doc.get("requests") or [{}])[0]
    strata("last_hit_rate", "gauge", "The last request's expert cache hit rate (requests[0].hit_rate).",
           last.get("hit_rate"))
    strata("last_decode_tok_s", "gauge", "The last request's decode rate (requests[0].decode_tok_s).",
           last.get("decode_tok_s"))
    for name, key, help_ in (("gpu_util", "gpu_util", "GPU busy, percent (hardware.gpu_util)."),
                             ("gpu_mem_used_bytes", "gpu_mem_used", "GPU memory in use (hardware.gpu_mem_used)."),
                             ("gpu_mem_total_bytes", "gpu_mem_total", "GPU memory (hardware.gpu_mem_total)."),
                             ("gpu_temp_celsius", "gpu_temp", "GPU temperature (hardware.gpu_temp)."),
                             ("gpu_power_watts", "gpu_power", "GPU power draw (hardware.gpu_power).")):
        strata(name, "gauge", help_, hw.get(key), ',gpu="0"')
    strata("cpu", "gauge", "CPU busy, percent (hardware.cpu).", hw.get("cpu"))
    strata("ram_used_bytes", "gauge", "RAM in use (hardware.ram_used).", hw.get("ram_used"))
    strata("ram_total_bytes", "gauge", "RAM (hardware.ram_total).", hw.get("ram_total"))
    out.append("# HELP strata:simulated 1: every figure here is modelled by the scripted engine\n"
               "# TYPE strata:simulated gauge\n"
               f"strata:simulated{{{lab}}} 1")
    return "\n".join(out) + "\n"


def llamacpp_text(eng: Engine) -> str:
    """``/metrics/prometheus``: Strata's ``Service.prometheus`` (llama-server's names, ``strata:*`` for the rest)."""
    snap = eng.snapshot()
    t = snap["totals"]
    running = len(snap["active"])
    prompt_n = t["prompt_tokens"] - t["reused"]
    prompt_s, decode_s = t["prompt_ms"] / 1000, t["decode_ms"] / 1000
    rows = [
        ("llamacpp:prompt_tokens_total", "counter", "Prompt tokens read", prompt_n),
        ("llamacpp:prompt_tokens_cached_total", "counter", "Prompt tokens the conversation cache already held",
         t["reused"]),
        ("llamacpp:prompt_seconds_total", "counter", "Prompt read time", prompt_s),
        ("llamacpp:tokens_predicted_total", "counter", "Tokens generated", t["output_tokens"]),
        ("llamacpp:tokens_predicted_seconds_total", "counter", "Generation time", decode_s),
        ("llamacpp:prompt_tokens_seconds", "gauge", "Average prompt read throughput in tokens/s",
         prompt_n / prompt_s if prompt_s else 0),
        ("llamacpp:predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s",
         t["output_tokens"] / decode_s if decode_s else 0),
        ("llamacpp:requests_processing", "gauge", "Requests running", running),
        ("llamacpp:requests_deferred", "gauge", "Requests waiting their turn", snap["queued"]),
        ("strata:requests_total", "counter", "Requests finished", t["requests"]),
        ("strata:drafts_offered_total", "counter", "Speculative draft tokens offered", t["drafts_offered"]),
        ("strata:drafts_accepted_total", "counter", "Speculative draft tokens accepted", t["drafts_accepted"]),
        ("strata:model_loaded", "gauge", "1 while the model is loaded", int(not snap["unloaded"])),
        ("strata:simulated", "gauge", "1: every figure here is modelled by the scripted engine", 1),
    ]
    return "".join(f"# HELP {name} {help_}\n# TYPE {name} {kind}\n{name} {value}\n"
                   for name, kind, help_, value in rows)
