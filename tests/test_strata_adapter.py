"""The ``strata`` adapter on Strata's REAL fields: ``/metrics`` JSON and text, ``/health``, the key, the engine's
log lines. Driven by ``tests/data/strata/`` — Strata's answers as its code builds them, each field sourced in
``tests/data/strata/SOURCES.md`` (Niko1221/Strata ``serve/server.py`` @2291cb3, ``serve/prometheus.py`` @6c0f3ce,
``src/program/generate.cpp`` @0083bb7). HTTP is served by a real server on loopback.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from engine_manager.engines import get_engine
from engine_manager.engines.base import LaunchSpec
from engine_manager.engines.strata import (
    classify,
    parse_strata_log_line,
    recent_hit_rate,
    sample_from_metrics,
    sample_from_prometheus,
)

DATA = Path(__file__).parent / "data" / "strata"
STRATA = get_engine("strata")
KEY = "dsv41-adapter-test-key-0123456789"
MB = 1.024          # Strata's gpu_pcie_*_mb is NVML KB/s ÷ 1024; the Sample's MB/s is 10^6 B/s


def _doc(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def _lines(name: str) -> list[str]:
    return (DATA / name).read_text().splitlines()


# ------------------------------------------------------------------------------------------------ /metrics JSON
def test_idle_lists_every_slot_and_none_is_busy():
    """serve/server.py @2291cb3 ``StrataEngine.slots_view``: every batch slot is listed, idle ones as
    ``{"slot", "state": "idle", "held_tokens"}``; ``Service.metrics``: ``live.tok_s`` is null unless generating.
    So idle means 0 busy of 4, and no decode rate (missing — neither 0 nor the last value)."""
    doc = _doc("metrics_idle.json")
    s = sample_from_metrics(doc, "strata", None, t=100.0)
    assert s.state == "idle" and s.decode_tok_s is None
    assert (s.slots_busy, s.slots_total) == (0, 4)
    assert s.decode_tok_s_per_slot == {}            # listed, none decoding: a measured 0 per slot
    assert s.queued == 0 and s.requests_total == 3 and s.tokens_generated_total == 766


def test_a_lone_request_on_the_solo_path_is_one_busy():
    """serve/server.py @2291cb3 ``generate_batched``: a request alone goes the solo path (GEN), in no slot, so
    ``slots_view`` shows every slot idle while ``live.running`` is 1 and ``outside_slots`` 1 (``Service.metrics``)."""
    s = sample_from_metrics(_doc("metrics_generating_solo.json"), "strata", None, t=100.0)
    assert s.state == "generating" and s.decode_tok_s == 63.1
    assert (s.slots_busy, s.slots_total) == (1, 4)
    # no slot holds it, but one busy slot is a slot: drawn as slot 0 ("Decode per slot" was empty for one chat)
    assert s.decode_tok_s_per_slot == {0: 63.1}
    assert s.extra["solo"] is True and s.extra["decode_tok_s_source"] == "live.tok_s"


def test_batch_busy_slots_and_per_slot_rates_from_tok_s():
    """``slots_view``: a busy slot is ``state`` "reading" or "decoding" with ``tok_s`` (null while reading); busy =
    ``state != "idle"`` (the test ``/slots``' ``is_processing`` uses). Per-slot rates come from ``tok_s``."""
    doc = _doc("metrics_generating_batch.json")
    s = sample_from_metrics(doc, "strata", None, t=100.0)
    assert (s.slots_busy, s.slots_total) == (3, 4)
    assert s.decode_tok_s_per_slot == {0: 31.9, 1: 30.4}     # the reading slot and the idle one decode nothing
    assert s.decode_tok_s == 61.8 and s.queued == 1


def test_newest_request_reading_while_others_decode():
    """``Service.metrics`` takes the newest live request's status: while it reads its prompt ``live.state`` is
    "reading" and ``live.tok_s`` null although two slots decode. The decoding slots' ``tok_s`` stand in, labelled."""
    doc = _doc("metrics_batch_newest_reading.json")
    s = sample_from_metrics(doc, "strata", None, t=100.0)
    assert s.state == "reading" and s.slots_busy == 3
    assert s.decode_tok_s == pytest.approx(31.9 + 30.4) and s.extra["decode_tok_s_source"] == "slots.tok_s"
    assert s.prefill_tok_s == 1502.3                         # live.prefill_tok_s_mean (PP's mean) while reading


def test_one_request_at_a_time_reading_a_prompt():
    """Without ``--batch`` ``Service.metrics`` has no ``parallel``/``slots``: one request at a time
    (``/v1/status`` ``concurrency.serving`` 1). ``prompt_read``/``prompt_total`` come from the PP lines while
    reading."""
    doc = _doc("metrics_reading_single.json")
    first = sample_from_metrics(doc, "strata", None, t=10.0)
    assert first.state == "reading" and (first.slots_busy, first.slots_total) == (1, 1)
    assert first.prefill_tok_s == 1476.4 and first.decode_tok_s is None
    doc["live"]["prompt_read"] += 1500
    second = sample_from_metrics(doc, "strata", first, t=11.0)
    assert second.prefill_tok_s == pytest.approx(1500.0)
    idle = json.loads(json.dumps(doc))
    idle["live"].update(state="idle", prompt_read=None, prompt_total=None, prefill_tok_s_mean=None)
    s = sample_from_metrics(idle, "strata", second, t=12.0)
    assert (s.slots_busy, s.slots_total) == (0, 1)
    # between prompts: the newest finished request's own read rate (prompt_read over prompt_ms)
    assert s.prefill_tok_s == pytest.approx(276 / 0.2046)


def test_hit_rate_is_labelled_last_and_recent_never_live():
    """``Service.run`` records ``hit_rate`` = hits / lookups of a FINISHED request (engine DONE line,
    ``StrataEngine._parse_done``); nothing reports it while a request runs (generate.cpp @0083bb7 prints it once per
    request). So: missing while generating; the newest finished request's while idle; a token-weighted figure over
    the listed finished requests beside it."""
    reqs = _doc("metrics_idle.json")["requests"]
    want = sum(r["hit_rate"] * r["engine_generated"] for r in reqs) / sum(r["engine_generated"] for r in reqs)
    assert recent_hit_rate(reqs) == (pytest.approx(want), 3)
    idle = sample_from_metrics(_doc("metrics_idle.json"), "strata", None, t=1.0)
    assert idle.hit_rate == 0.9 and idle.extra["hit_rate_last"] == 0.9
    assert idle.extra["hit_rate_last_at"] == reqs[0]["time"]
    # this engine runs 4 slots: each request's figure is its admission's (serve/server.py @2291cb3
    # generate_batched), so each counts once, not by the tokens the whole request decoded
    each = sum(r["hit_rate"] for r in reqs) / len(reqs)
    assert idle.extra["hit_rate_recent"] == pytest.approx(each) and idle.extra["hit_rate_recent_requests"] == 3
    for name in ("metrics_generating_solo.json", "metrics_generating_batch.json", "metrics_reading_single.json"):
        s = sample_from_metrics(_doc(name), "strata", None, t=1.0)
        assert s.hit_rate is None, name                          # the previous request's is not shown as live
        assert s.extra["hit_rate_last"] == 0.9 and "not while it runs" in s.extra["hit_rate_live_missing"]
    # a request listed newest-first but an older one placed first still counts by its time
    doc = _doc("metrics_idle.json")
    doc["requests"] = doc["requests"][::-1]
    assert sample_from_metrics(doc, "strata", None, t=1.0).extra["hit_rate_last"] == 0.9


def test_pcie_and_memory_from_hardware_or_status():
    """serve/telemetry.py ``_Nvml.read``: ``gpu_pcie_rx_mb`` = NVML KB/s ÷ 1024; no NVML → no ``gpu_*`` keys, and
    ``Service.v1_status`` then has ``machine.gpu`` null."""
    doc = _doc("metrics_generating_batch.json")
    s = sample_from_metrics(doc, "strata", None, t=1.0)
    assert s.pcie_rx_mb_s == pytest.approx(9216.0 * MB) and s.pcie_tx_mb_s == pytest.approx(4.0 * MB)
    assert (s.vram_used_bytes, s.vram_total_bytes) == (101218435072, 102641958912)
    assert s.extra["gpu_pcie_gen"] == 5 and s.extra["gpu_pcie_width"] == 16
    for k in [k for k in doc["hardware"] if k.startswith("gpu_")]:
        del doc["hardware"][k]
    s = sample_from_metrics(doc, "strata", None, t=1.0, status=_doc("v1_status_no_nvml.json"))
    assert s.pcie_rx_mb_s is None and s.vram_used_bytes is None and s.vram_total_bytes is None
    s = sample_from_metrics(doc, "strata", None, t=1.0, status=_doc("v1_status.json"))
    assert (s.vram_used_bytes, s.vram_total_bytes) == (96530 << 20, 97887 << 20)


# ------------------------------------------------------------------------------------------------ Prometheus text
def test_prometheus_text():
    """serve/prometheus.py @6c0f3ce ``render``: ``strata:live_state{state}`` is 1 for the state, ``live_tok_s`` is
    ``live.tok_s or 0`` (0 while idle means no rate), ``last_hit_rate`` is ``requests[0].hit_rate`` (a finished
    request's), ``vllm:num_requests_waiting`` = queued + waiting."""
    text = (DATA / "prometheus.txt").read_text()
    s = sample_from_prometheus(text, "strata", t=1.0)
    assert s.state == "generating" and s.decode_tok_s == 61.8
    assert (s.slots_busy, s.queued, s.requests_total, s.tokens_generated_total) == (3, 2, 3, 766)
    assert s.hit_rate is None and s.extra["hit_rate_last"] == 0.9 and s.extra["last_decode_tok_s"] == 63.1
    assert s.vram_used_bytes == 101218435072 and s.ram_total_bytes == 302000000000
    idle = (text.replace('state="generating"} 1', 'state="generating"} 0').replace('state="idle"} 0', 'state="idle"} 1')
            .replace('strata:live_tok_s{model_name="DeepSeek-V4.1-Flash"} 61.8',
                     'strata:live_tok_s{model_name="DeepSeek-V4.1-Flash"} 0'))
    s = sample_from_prometheus(idle, "strata", t=1.0)
    assert s.state == "idle" and s.decode_tok_s is None and s.hit_rate == 0.9


# ------------------------------------------------------------------------------------------------ a real server
class _Strata:
    """A loopback server answering with the fixtures, with Strata's key rule (``Handler._authorized``: /health and
    /api/health open, everything else needs ``Authorization: Bearer KEY`` or ``x-api-key``; 401 body
    ``error_401.json``)."""

    def __init__(self, port: int, health: dict, metrics: str = "metrics_generating_batch.json"):
        self.health, self.metrics, self.seen = health, _doc(metrics), []
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, obj):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                path = self.path.split("?")[0].rstrip("/")
                outer.seen.append(path)
                if path in ("/health", "/api/health"):
                    return self._send(200, outer.health)
                auth = self.headers.get("Authorization", "")
                given = auth[7:].strip() if auth.lower().startswith("bearer ") else self.headers.get("x-api-key", "")
                if given != KEY:
                    return self._send(401, _doc("error_401.json"))
                if path == "/metrics":
                    return self._send(200, outer.metrics)
                if path == "/v1/status":
                    return self._send(200, _doc("v1_status.json"))
                return self._send(404, _doc("error_404.json"))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), H)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


def _spec(port: int, key: str | None = KEY) -> LaunchSpec:
    return LaunchSpec(engine="strata", argv=["python"], host="127.0.0.1", port=port, api_key=key)


@pytest.mark.parametrize("health,state,words", [
    (_doc("health.json"), "ready", "strata ready: DeepSeek-V4.1-Flash"),
    (_doc("api_health.json"), "ready", "strata ready"),
    (_doc("health_loading_lazy.json"), "loading", "not loaded"),
    ({**_doc("health.json"), "service": "llama.cpp"}, "failed", "not a Strata server"),
    ({"status": "ok"}, "failed", "names no service"),
])
def test_readiness_needs_loaded_and_a_strata_service(free_port, health, state, words):
    """``do_GET`` answers /health and /api/health with the same body, ``"service": "strata"``, and ``loaded`` =
    ``Service.loaded()`` (False until the engine's READY, after an unload, after a death): loaded:false is never
    ready; a server whose ``service`` is not ``strata`` is not Strata (Strata's manager identifies it by
    ``/api/health`` ``service``)."""
    with _Strata(free_port, health), httpx.Client() as c:
        r = STRATA.readiness(c, _spec(free_port))
    assert r.state == state and words in r.detail


def test_readiness_connection_refused_is_loading(free_port):
    """Eager mode: serve/server.py opens its port only after the engine's READY, so a refused connection is a
    server still loading (docs/ENGINE_CONTRACT.md §2)."""
    with httpx.Client() as c:
        r = STRATA.readiness(c, _spec(free_port))
    assert r.state == "loading" and "refused" in r.detail


def test_poll_sends_the_key_and_maps_the_answer(free_port):
    """``Handler._authorized``: ``/metrics`` needs the key (Bearer); a wrong key is 401 ``authentication_error``.
    With NVML figures in ``hardware`` the adapter does not also ask ``/v1/status``."""
    with _Strata(free_port, _doc("health.json")) as srv, httpx.Client() as c:
        s = STRATA.poll(c, _spec(free_port), None)
        assert (s.slots_busy, s.decode_tok_s_per_slot) == (3, {0: 31.9, 1: 30.4}) and not s.simulated
        assert srv.seen == ["/metrics"]
        with pytest.raises(httpx.HTTPStatusError) as err:
            STRATA.poll(c, _spec(free_port, key="wrong"), None)
        assert err.value.response.json()["error"]["type"] == "authentication_error"


def test_poll_asks_v1_status_when_hardware_has_no_gpu(free_port):
    """No NVML on the server: ``hardware`` has no ``gpu_*``; ``/v1/status`` is asked for the GPU memory."""
    doc = _doc("metrics_idle.json")
    doc["hardware"] = {k: v for k, v in doc["hardware"].items() if not k.startswith("gpu_")}
    with _Strata(free_port, _doc("health.json"), "metrics_idle.json") as srv, httpx.Client() as c:
        srv.metrics = doc
        s = STRATA.poll(c, _spec(free_port), None)
    assert srv.seen == ["/metrics", "/v1/status"] and s.vram_total_bytes == 97887 << 20


# ------------------------------------------------------------------------------------------------ log lines
def test_engine_log_lines_in_stratas_real_formats():
    """generate.cpp @0083bb7 serve loop (stderr → the config's ``log``): the per-request summary, the per-request
    ``decode expert cache hit rate``, the resident mode's CUMULATIVE ``exchanged with the VRAM tier`` (not a swap
    event: counting it as swaps would add the total again at every request), load lines as phases; serve/server.py
    ``StrataEngine.__init__`` writes ``[strata] <time> engine started: …`` first. Strata prints no per-swap line."""
    events = [parse_strata_log_line(x) for x in _lines("engine_log.txt")]
    assert all(e is None or e.kind != "swap" for e in events)
    by_text = {e.text: e for e in events if e}
    hit = next(e for t, e in by_text.items() if "decode expert cache hit rate" in t)
    # generate.cpp @2291cb3 adds "; N more read by the GPU over PCIe …" only when N > 0: none here
    assert hit.kind == "info" and hit.data == {"hit_rate": 0.9, "hits": 2764800, "lookups": 3072000,
                                               "finished_request": True, "offloaded": 0, "pcie_share": 0.0,
                                               "vram_share": 0.9, "decode_scope": "request"}
    req = next(e for t, e in by_text.items() if t.startswith("strata serve: prompt 1812"))
    assert req.data["decode_tok_s"] == 63.1 and req.data["reused"] == 1536 and req.data["generated"] == 512
    ex = next(e for t, e in by_text.items() if "exchanged with the VRAM tier" in t)
    assert ex.kind == "info" and ex.data == {"swaps_cumulative": 1184}
    assert any(e and e.kind == "phase" and e.text.startswith("loaded 183.00 GiB") for e in events)
    done = parse_strata_log_line(_lines("server_stdout.txt")[3])
    assert done.kind == "info" and done.data["hit_rate"] == 0.9 and done.data["pcie_share"] == pytest.approx(0.035)
    assert parse_strata_log_line(_lines("server_stdout.txt")[0]).kind == "phase"
    assert parse_strata_log_line("") is None and parse_strata_log_line("some chatter") is None


def test_refused_argument_out_of_memory_and_stall_are_named():
    """generate.cpp @0083bb7 ``main``: ``unknown argument: <arg>`` then exit 2 (a bare model path and Strata's
    missing ``--cpu-numerics`` end here); ``<flag> needs a value``; allocation failures worded per site
    (``session state allocation failed``); the watchdog's ``no progress for N s … (issue #29)``."""
    ev = parse_strata_log_line(_lines("engine_log_unknown_argument.txt")[1])
    assert ev.kind == "error" and ev.data == {"cause": "bad_engine_flag", "argument": "--cpu-numerics"}
    hint = classify(STRATA.failure_patterns, 2, _lines("engine_log_unknown_argument.txt"))
    assert hint.cause == "bad_engine_flag" and hint.title.endswith("the engine said: unknown argument: --cpu-numerics")
    assert STRATA.classify_failure(2, ["--kv needs a value"]).cause == "bad_engine_flag"
    assert STRATA.classify_failure(1, _lines("engine_log_oom.txt")).cause == "cuda_oom"
    assert STRATA.classify_failure(-6, _lines("engine_log_watchdog.txt")).cause == "engine_stalled"
    assert STRATA.classify_failure(-9, ["strata serve: 1210 MiB of VRAM free with everything loaded"]).cause \
        == "oom_killed"
    assert STRATA.classify_failure(0, _lines("engine_log.txt")) is None


# ------------------------------------------------------------------------------------------------ the Monitor's card
@pytest.mark.parametrize("name,busy", [("metrics_generating_solo.json", 1), ("metrics_idle.json", 0)])
def test_the_hit_rate_card_says_last_request_and_recent(app_ctx, shown, name, busy):
    """The Monitor's hit-rate card on a Strata sample: no live figure exists (Strata reports it per finished request,
    ``Service.run``), so the card shows the newest finished request's share of routed picks served from VRAM
    (hit rate × (1 − PCIe share)), greyed — while generating too. These fixtures run 4 slots: a request's own
    figures are its admission's (serve/server.py @2291cb3 ``generate_batched``), said so, beside the engine's own
    hit rate under its name."""
    import time

    from app.monitor_view import MonitorView
    from engine_manager import metrics as M
    from engine_manager.metrics.sources import sample_values

    sample = sample_from_metrics(_doc(name), "strata", None, t=time.time())
    values = {c: None for c in M.COLUMN_NAMES}
    values.update({k: v for k, v in sample_values(sample).items() if k in values})
    assert values["hit_rate"] == (None if busy else 0.9) and values["slots_busy"] == busy
    origin = M.derive(values, simulated=False)              # as the hub does
    view = shown(MonitorView(app_ctx), 1100, 800)       # marked gui by tests/gui_conftest.py (it uses qtbot)
    try:
        view.feed(M.Tick(seq=1, t=sample.t, values=values, engine="strata", sample=sample, origin=origin),
                  M.RingStore(M.COLUMN_NAMES, hz=1.0))
        card = view.cards["hit"]
        assert card.value.text() == f"last admission {90 * (1 - 0.035):.1f} %" and card.is_stale()
        assert card.detail.text().endswith("\nhit rate 90.0% (admission)")
        assert "PCIe 3.5 %: " in card.toolTip() and "its prompt and first token" in card.toolTip()
    finally:
        view.shutdown()


def test_the_engines_own_lines_are_read_through_the_keepers_prefix():
    """The keeper copies the config's ``log`` file (Strata's ``StrataEngine.__init__`` appends the engine's stderr
    there) into the panel's log prefixed ``[engine] `` (``keeper.FOLLOW_PREFIX``). The engine's refusal
    (generate.cpp option loop: ``unknown argument: X``) must still be recognised and be the crash cause."""
    from engine_manager import keeper
    from engine_manager.engines.strata import ENGINE_LINE_PREFIX, parse_strata_log_line

    assert ENGINE_LINE_PREFIX == keeper.FOLLOW_PREFIX
    eng = get_engine("strata")
    line = keeper.FOLLOW_PREFIX + "unknown argument: --cpu-numerics"
    ev = parse_strata_log_line(line)
    assert ev is not None and ev.kind == "error"
    hint = eng.classify_failure(2, ["[strata] starting the engine", line])
    assert hint is not None and "unknown argument: --cpu-numerics" in hint.title


def test_strata_cumulative_exchange_lines_become_swaps_on_the_monitor():
    """Strata prints no line per swap; its resident mode repeats a cumulative "N exchanged with the VRAM tier" after
    each request (generate.cpp, per-request summary; tests/data/strata/engine_log.txt). The swaps series counts the
    growth between two such lines — never the repeated total — and a per-swap log (the scripted engine's
    ``adapt:`` lines) is counted from those lines only."""
    from engine_manager.metrics.sources import LogSwapSource

    def exch(n: int) -> str:
        return (f"[engine] strata serve: resident RAM: 112.40 GiB of experts in RAM, {n} exchanged with the VRAM "
                "tier, 0 blob reads from the file")

    src = LogSwapSource(get_engine("strata"))
    for n in (1184, 1184, 1200, 1250):
        src.push_line(exch(n))
    assert src.swaps_total == 66          # 1184 is the baseline; +16, +50
    src.push_line(exch(10))               # the engine started again: its count starts from 0
    assert src.swaps_total == 76


def test_the_newest_finished_requests_hit_rate_is_a_series_while_requests_run():
    """While requests run back to back Strata has no hit rate to give (it reports one per finished request,
    ``Service.run`` → ``requests[].hit_rate``), so the observed series is missing; the Monitor's hit-rate plot
    draws the newest finished request's figure as its own series instead of staying empty."""
    import time

    from engine_manager.metrics.sources import sample_values

    sample = sample_from_metrics(_doc("metrics_generating_solo.json"), "strata", None, t=time.time())
    values = sample_values(sample)
    assert values["hit_rate"] is None
    from engine_manager.engines.strata import newest_request

    newest = newest_request(_doc("metrics_generating_solo.json")["requests"])
    assert values["hit_rate_last"] == pytest.approx(newest["hit_rate"])


def test_a_profile_the_engine_refuses_is_a_placement_refusal_not_retried():
    """Strata's ``read_expert_profile`` (src/core/expert_cache.cpp @2249c24) ends the start with
    ``strata generate: read_expert_profile: <why>``; another try cannot fix the profile, so it is the placement's
    cause (permanent: the supervisor does not restart) — seen with a saved plan's profile that ranked more pairs
    than slots, which the engine refused at every one of five automatic restarts."""
    from engine_manager.crash import PERMANENT_CAUSES

    eng = get_engine("strata")
    line = "[engine] strata generate: read_expert_profile: the header claims more ranked pairs than slots"
    hint = eng.classify_failure(1, ["[strata] engine started: …", line])
    assert hint is not None and hint.cause == "placement_refused" and hint.cause in PERMANENT_CAUSES
    assert "more ranked pairs than slots" in hint.title
