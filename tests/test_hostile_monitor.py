"""The Monitor and the overview against hostile engines: the panel's own engines'
adapters (Strata, the scripted engine, llama.cpp) read every answer with a size cap and an overall deadline, and a
server past either is a missing reading with the words shown — never a crash, never a hang, never a panel growing
without end; impossible numbers (non-finite, negative counts, integers past what a float holds) are missing, never
shown as measured, and never cost the other figures. Real loopback servers (:mod:`hostile_servers`).
"""

from __future__ import annotations

import math

import httpx
import numpy as np
import pytest
from hostile_servers import HostileServer

from engine_manager.connections import OverviewPoller
from engine_manager.engines import get_engine
from engine_manager.engines._http import METRICS_BODY_CAP, AnswerTooLarge, get_capped
from engine_manager.metrics.hub import MetricsHub
from engine_manager.metrics.sources import EngineSource, Reading, Source, SourceMissing, spec_for
from engine_manager.metrics.store import RingStore
from engine_manager.engine_state import RunningEngine

KEY = "sk-hostile-monitor-0123456789"
OWN_ENGINES = ("strata", "sim", "llamacpp")

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def hostile():
    started: list[HostileServer] = []

    def start(routes: dict[str, str] | None = None, default: str = "not_found") -> HostileServer:
        s = HostileServer(routes, default)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


def source(engine: str, srv: HostileServer, timeout_s: float = 1.5) -> EngineSource:
    eng = get_engine(engine)
    return EngineSource(eng, spec_for(eng, srv.base_url, KEY), timeout_s=timeout_s)


def missing_words(src: EngineSource) -> str:
    with pytest.raises(SourceMissing) as ei:
        src.read()
    return str(ei.value)


# -- caps and deadlines on the monitor's reads ------------------------------------------------------------------------
@pytest.mark.parametrize("engine", OWN_ENGINES)
@pytest.mark.parametrize("behaviour,words", [("endless", "larger than 16 MB"), ("huge_length", "larger than 16 MB"),
                                             ("drip", "did not arrive within 1.5 s"),
                                             ("stall", "did not arrive within 1.5 s")])
def test_a_hostile_metrics_answer_is_a_missing_reading_in_words(hostile, engine, behaviour, words):
    srv = hostile({"/metrics": behaviour, "/slots": "not_found"})
    src = source(engine, srv)
    try:
        said = missing_words(src)
    finally:
        src.close()
    assert words in said and srv.base_url + "/metrics" in said, said
    assert "Error" not in said and "Traceback" not in said


def test_an_endless_slots_answer_is_capped_at_1_mb(hostile):
    srv = hostile({"/metrics": "llamacpp_bad_metrics", "/slots": "endless"})
    src = source("llamacpp", srv)
    try:
        said = missing_words(src)
    finally:
        src.close()
    assert "larger than 1 MB" in said and srv.base_url + "/slots" in said, said


def test_an_endless_status_answer_costs_only_the_optional_status(hostile):
    """Strata's adapter asks ``/v1/status`` when ``/metrics`` has no GPU figures: an endless answer there is
    dropped (it is optional), the reading stands."""
    srv = hostile({"/metrics": "strata_metrics", "/v1/status": "endless"})
    src = source("strata", srv)
    try:
        got = src.read()
    finally:
        src.close()
    assert got.values["decode_tok_s"] == 12.5 and got.values["requests_total"] == 3
    assert ("GET", "/v1/status") in [(m, p) for m, p, _h in srv.requests]


def test_the_monitor_shows_why_a_late_engine_is_missing(hostile):
    """The hub composes a tick before a stalled read reaches its deadline; the next ticks say what the read ended
    with, not only "no answer"."""
    srv = hostile({"/metrics": "stall"})
    hub = MetricsHub([source("strata", srv, timeout_s=1.5)], hz=1.0, engine="strata")
    said = []
    for tick in hub.iter_ticks(max_ticks=8):            # paced at 1 Hz; closes the hub on its way out
        said.append(tick.missing.get("engine", ""))
        if "did not arrive within 1.5 s" in said[-1]:
            break
    assert "did not arrive within 1.5 s" in said[-1], said
    assert tick.values["decode_tok_s"] is None


def test_an_endless_metrics_answer_is_a_line_of_the_overview_in_words(hostile):
    srv = hostile({"/metrics": "endless"})
    st = OverviewPoller(timeout_s=1.5, record=False).poll_running(
        "own", RunningEngine(base_url=srv.base_url, api_key=KEY, engine="strata", label="Strata"))
    assert st.state != "ok" and "larger than 16 MB" in st.message, st
    assert st.users is None and st.decode_tok_s is None


# -- readiness -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", OWN_ENGINES)
def test_an_endless_health_answer_fails_readiness_in_words(hostile, engine):
    srv = hostile({"/health": "endless"})
    eng = get_engine(engine)
    with httpx.Client(trust_env=False, timeout=30) as client:
        r = eng.readiness(client, spec_for(eng, srv.base_url, KEY))
    assert r.state == "failed" and "larger than 1 MB" in r.detail, r


def test_a_dripping_health_answer_is_loading_within_the_probe_deadline(hostile):
    srv = hostile({"/health": "drip"})
    eng = get_engine("strata")
    with httpx.Client(trust_env=False, timeout=30) as client:     # a per-read timeout far past the deadline
        r = eng.readiness(client, spec_for(eng, srv.base_url, KEY))
    assert r.state == "loading" and "did not answer within" in r.detail, r


def test_a_sane_strata_health_is_still_ready(hostile):
    srv = hostile({"/health": "strata_health"})
    eng = get_engine("strata")
    with httpx.Client(trust_env=False, timeout=5) as client:
        r = eng.readiness(client, spec_for(eng, srv.base_url, KEY))
    assert r.state == "ready", r


@pytest.mark.parametrize("engine", ("strata", "vllm"))
def test_a_body_that_is_not_the_compression_it_claims_is_said_in_words(hostile, engine):
    srv = hostile({"/metrics": "bad_gzip"})
    src = source(engine, srv)
    try:
        said = missing_words(src)
    finally:
        src.close()
    assert said == (f"the answer at {srv.base_url}/metrics says it is gzip-compressed but is not; it cannot be "
                    "read"), said


def test_a_compressed_answer_expands_only_up_to_the_cap(hostile):
    """256 MB of zeros sent gzipped in 250 kB: the cap is on what the answer expands to, not what was sent."""
    srv = hostile({"/metrics": "gzip_bomb"})
    with httpx.Client(trust_env=False, timeout=30) as client:
        with pytest.raises(AnswerTooLarge) as ei:
            get_capped(client, srv.base_url + "/metrics", cap=METRICS_BODY_CAP)
    assert "expands past 16 MB" in str(ei.value)


# -- impossible numbers ----------------------------------------------------------------------------------------------
def one_tick(engine: str, srv: HostileServer):
    hub = MetricsHub([source(engine, srv, timeout_s=3.0)], hz=0.25, engine=engine)
    try:
        return hub.tick_once()
    finally:
        hub.close()


def test_a_negative_gauge_is_missing_and_an_overflowing_sum_costs_only_its_figure(hostile):
    """Strata's Prometheus page: ``vllm:num_requests_running -7`` is not "-7 users"; two counters of 1e308 sum
    past a float (that figure is missing); the other figures stand."""
    srv = hostile({"/metrics": "bad_metrics"})
    tick = one_tick("strata", srv)
    assert "engine" not in tick.missing, tick.missing
    assert tick.values["slots_busy"] is None
    assert tick.values["queued"] is None and tick.values["tokens_generated_total"] is None
    assert tick.values["requests_total"] == 12


def test_impossible_numbers_in_strata_json_are_missing_and_the_rest_is_read(hostile):
    srv = hostile({"/metrics": "strata_bad_json"})
    tick = one_tick("strata", srv)
    assert "engine" not in tick.missing, tick.missing
    assert tick.values["decode_tok_s"] == 12.5 and tick.values["engine_ram_used_bytes"] == 2**30
    for col in ("queued", "requests_total", "tokens_generated_total", "engine_vram_used_bytes",
                "engine_vram_total_bytes"):
        assert tick.values[col] is None, (col, tick.values[col])


def test_an_infinite_slot_count_costs_llamacpp_no_figure_but_its_own(hostile):
    srv = hostile({"/metrics": "llamacpp_bad_metrics", "/slots": "llamacpp_bad_slots"})
    tick = one_tick("llamacpp", srv)
    assert "engine" not in tick.missing, tick.missing
    assert tick.values["slots_busy"] == 1 and tick.values["slots_total"] == 1
    assert tick.values["tokens_generated_total"] == 120
    assert tick.values["queued"] is None                       # llamacpp:requests_deferred -2


class _NumberSource(Source):
    """A source whose reading holds an integer past what a float holds and a NaN."""

    name = "numbers"
    columns = ("gpu_util_pct", "gpu_temp_c")

    def read(self) -> Reading:
        return Reading({"gpu_util_pct": 10**400, "gpu_temp_c": math.nan})


def test_a_number_past_a_float_is_missing_not_a_crash_of_the_hub():
    hub = MetricsHub([_NumberSource()], hz=1.0)
    try:
        tick = hub.tick_once()
    finally:
        hub.close()
    assert tick.values["gpu_util_pct"] is None and tick.values["gpu_temp_c"] is None


def test_a_figure_past_float32_is_stored_missing_not_infinite():
    store = RingStore(("x",), hz=1.0)
    store.append(1.0, {"x": 1e300})
    store.append(2.0, {"x": 5.0})
    _t, v = store.column("x")
    assert not np.isinf(v).any() and np.isnan(v[0]) and v[1] == 5.0


def test_the_key_goes_only_in_the_authorization_header(hostile):
    srv = hostile({"/metrics": "bad_metrics", "/health": "strata_health"})
    one_tick("strata", srv)
    for _m, _p, headers in srv.requests:
        assert [k for k, v in headers.items() if KEY in v] in ([], ["Authorization"]), headers


# -- memory: what a capped answer costs once parsed -----------------------------------------------------------------
def test_a_one_line_page_of_megabytes_is_not_handed_to_the_prometheus_parser():
    """prometheus_client's parser takes ~8 times a line's size: a 14 MB line cost the panel 110 MB. A line no
    sample could be is left out first; the page's real samples are still read."""
    import tracemalloc

    from engine_manager.engines import prometheus_text

    size = 14 * 1024 * 1024
    page = "x" * size + "\nvllm:num_requests_running 3\n"
    tracemalloc.start()
    try:
        rows = prometheus_text.read_samples(page)
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del page                                         # (never in an assertion's message)
    assert rows == [("vllm:num_requests_running", {}, 3.0)]
    assert peak < 3 * size, f"{peak / size:.1f} times the page"    # a copy or two, not the parser's eightfold


def test_a_json_metrics_answer_far_past_stratas_is_refused_before_parsing(hostile):
    srv = hostile({"/metrics": "huge_models"})           # 13.6 MB of JSON: under the 16 MB cap as sent
    src = source("strata", srv)
    try:
        said = missing_words(src)
    finally:
        src.close()
    assert "larger than 4 MB" in said and "far past what Strata sends" in said, said
