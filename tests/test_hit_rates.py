"""Hit rates that mean what they say: the engine's own hit rate (its lookups leave out the experts read over PCIe),
the PCIe share, and the share of routed picks served from VRAM — the figure a planner predicts — each under its own
name; batched requests' figures labelled as their admission's; a prompt being read shown as that prompt's progress;
one busy slot drawn as a slot. Lines and fields are Strata's own (serve/server.py and src/program/generate.cpp
@2291cb3abaadf067f2f60e6ad3d2d3822a2a9932); the scripted engine is a real process speaking the same fields."""

from __future__ import annotations

import copy
import json
import time

import httpx
import pytest

from engine_manager import metrics as M
from engine_manager.engines import get_engine
from engine_manager.engines.base import Sample, vram_share
from engine_manager.engines.strata import parse_strata_log_line, recent_hit_rate, sample_from_metrics
from engine_manager.metrics import presenter as P
from engine_manager.metrics.sources import LogSwapSource, sample_values
from engine_manager.engine_state import RunningEngine

# generate.cpp @2291cb3, the serve loop after DONE (printf formats filled in)
DECODE_LINE = ("strata serve: decode expert cache hit rate: 92.0% (8280 hits / 9000 lookups); 1000 more read by the "
               "GPU over PCIe or from another GPU (10.0% of all 10000 routed)")
DECODE_LINE_NO_PCIE = "strata serve: decode expert cache hit rate: 90.0% (900 hits / 1000 lookups)"
# generate.cpp @2291cb3, the batch windows' report when the last slot is done
BATCH_LINE = ("strata batch: 120 windows, avg 3.00 rows, 45.10 ms/window = run 40.00 (CUDA0 GPU-reach wait 10.00 + CPU "
              "experts 20.00) + commit 2.00 + emit 1.00 + adapt wait 2.10; per stage (ms/window): CUDA0 wait 10.00 + "
              "pool 20.00; per layer-window: CPU experts 1.20, VRAM hits 14.00, PCIe 0.80; routed entries per "
              "window: VRAM 700.0 (80.0%), PCIe 87.5 (10.0%), CPU 87.5 (10.0%); adaptive tier: 3 rounds, 40 experts "
              "swapped in; 66.5 rows/s over 5412 ms of wall time (admissions included)")
# serve/server.py @2291cb3 StrataEngine.__init__
PARALLEL_LINE = "[strata] parallel requests: 4 asked, the engine runs 2 (its log says why)"
REQUEST_LINE = ("strata serve: prompt 300 tokens = 0 reused + 300 read in 200 ms (1500.0 tok/s), 1 generated in 0 ms "
                "(0.0 tok/s), drafts accepted 0 of 0, 0 checkpoints")


def fixture(data_dir, name: str) -> dict:
    return json.loads((data_dir / "strata" / name).read_text())


def test_the_engines_decode_lines_give_the_vram_share_beside_its_hit_rate():
    ev = parse_strata_log_line("[engine] " + DECODE_LINE)
    assert ev is not None and ev.kind == "info"
    d = ev.data
    assert d["hit_rate"] == pytest.approx(0.92) and d["offloaded"] == 1000
    assert d["pcie_share"] == pytest.approx(0.10)
    assert d["vram_share"] == pytest.approx(8280 / 10000)                    # hits over ALL routed picks
    assert d["vram_share"] == pytest.approx(vram_share(d["hit_rate"], d["pcie_share"]))
    assert d["decode_scope"] == "request"
    plain = parse_strata_log_line(DECODE_LINE_NO_PCIE).data
    assert plain["pcie_share"] == 0 and plain["vram_share"] == pytest.approx(0.9)
    batch = parse_strata_log_line("[engine] " + BATCH_LINE)
    assert batch is not None and batch.data["decode_scope"] == "batch" and batch.kind == "info"
    assert batch.data["vram_share"] == pytest.approx(0.80) and batch.data["pcie_share"] == pytest.approx(0.10)
    assert batch.data["hit_rate"] == pytest.approx(0.80 / 0.90)             # the engine's: VRAM / (VRAM + CPU)
    note = parse_strata_log_line(PARALLEL_LINE)
    assert note is not None and note.data["parallel_asked"] == 4 and note.data["parallel_runs"] == 2
    assert note.data["note"] == "parallel requests: 4 asked, the engine runs 2 (its log says why)"
    one = parse_strata_log_line("[strata] parallel requests: 4 asked, the engine runs one at a time (its log says "
                                "why)")
    assert one is not None and one.data["parallel_runs"] == 1


def test_batched_requests_hit_rates_are_their_admissions_and_never_weighted_by_the_whole_request(data_dir):
    """With 2+ slots ``requests[].hit_rate`` covers only the admission's DONE (prompt + first token); BDONE updates
    finish, decode_ms and generated only (serve/server.py @2291cb3 ``generate_batched``)."""
    doc = fixture(data_dir, "metrics_idle.json")                      # parallel 4
    reqs = doc["requests"]
    s = sample_from_metrics(doc, "strata", None, t=1.0)
    assert s.extra["hit_rate_scope"] == "admission"
    each_once = sum(r["hit_rate"] for r in reqs) / len(reqs)
    assert s.extra["hit_rate_recent"] == pytest.approx(each_once)     # not weighted by engine_generated
    assert recent_hit_rate(reqs, admission_only=True) == (pytest.approx(each_once), 3)
    # the PCIe share of the newest one, and the share served from VRAM
    assert s.pcie_share == pytest.approx(0.035)
    assert s.extra["vram_share_last"] == pytest.approx(0.9 * (1 - 0.035))
    one = copy.deepcopy(doc)
    for k in ("parallel", "running", "slots", "outside_slots", "waiting", "admitting"):
        one["live"].pop(k)
    one["engine"].pop("batch_slots", None)
    single = sample_from_metrics(one, "strata", None, t=1.0)
    assert single.extra["hit_rate_scope"] == "request"                # one slot: its DONE is the whole request
    assert single.extra["hit_rate_recent"] == pytest.approx(recent_hit_rate(reqs)[0])


def test_the_observed_figure_is_the_vram_share_and_the_engine_log_line_comes_first():
    v = {c: None for c in M.COLUMN_NAMES}
    v.update(hit_rate=0.92, engine_pcie_share=0.10)
    origin = M.derive(v, simulated=False)
    assert v["vram_share"] == pytest.approx(0.828) and v["pcie_share"] == pytest.approx(0.10)
    assert origin["vram_share"] == "engine"
    # the engine log's newest decode line (all slots' batch windows) wins over a request's admission figure
    v2 = {c: None for c in M.COLUMN_NAMES}
    v2.update(hit_rate=0.95, engine_pcie_share=0.02, log_hit_rate=0.8 / 0.9, log_pcie_share=0.1, log_vram_share=0.8)
    origin2 = M.derive(v2, simulated=False)
    assert v2["vram_share"] == pytest.approx(0.8) and origin2["vram_share"] == "log"
    assert v2["pcie_share"] == pytest.approx(0.1)
    # no PCIe share reported: the hit rate, said so
    v3 = {c: None for c in M.COLUMN_NAMES}
    v3.update(hit_rate=0.9)
    assert M.derive(v3, simulated=False)["vram_share"].startswith("engine: hit rate")
    # the planner is compared with the VRAM share over the last minute
    hub = M.MetricsHub([], hz=1.0, store=M.RingStore(M.COLUMN_NAMES, hz=1.0))
    assert hub._rolling(1000.0, {**v, "decode_tok_s": 10.0}) == pytest.approx(0.828)


def test_the_hit_card_names_each_figure_and_labels_batched_requests():
    v = {c: None for c in M.COLUMN_NAMES}
    v.update(hit_rate=0.92, engine_pcie_share=0.10, slots_busy=0.0, slots_total=4.0, hit_rate_rolling=0.81)
    t = M.Tick(seq=1, t=time.time(), values=v, engine="strata")
    t.origin = M.derive(t.values, simulated=False)
    t.sample = Sample(t=t.t, engine="strata", state="idle")
    t.sample.extra.update(hit_rate_last=0.92, hit_rate_scope="admission")
    t.predicted_hit_rate = 0.90
    card = P.cards(t)["hit"]
    assert card.value == "last admission 82.8 %" and card.stale
    line1, line2 = card.detail.split("\n")
    assert line1 == "plan 90.0% · 1 min 81.0%"
    assert line2 == "hit rate 92.0% (admission)"                      # the engine's own figure, its admission's
    assert P.PLANNER_MEANS in card.tip and P.OBSERVED_MEANS in card.tip and "PCIe" in card.tip
    # where the planner and the observed figure differ, one line says why
    assert P.hit_difference_line(t).startswith("Planner 90.0 % vs observed 81.0 %: ")
    t.predicted_hit_rate = 0.82
    assert P.hit_difference_line(t) == ""
    line = P.text_line(t)
    assert "in VRAM 82.8%" in line and "PCIe 10.0%" in line and "engine hit 92.0%" in line


def test_a_prompt_being_read_shows_its_own_progress_never_the_previous_requests_rate(data_dir):
    doc = fixture(data_dir, "metrics_reading_single.json")
    doc["live"]["prefill_tok_s_mean"] = None                 # before this prompt's first PP line
    s = sample_from_metrics(doc, "strata", None, t=1.0)
    assert s.state == "reading" and s.prefill_tok_s is None  # the previous request's 1349 tok/s is not "live"
    v = {c: None for c in M.COLUMN_NAMES}
    v.update(sample_values(s))
    t = M.Tick(seq=1, t=1.0, values=v, engine="strata", sample=s)
    t.notes["prefill_live"] = M.prefill_is_live("strata", s.state)
    card = P.cards(t)["prefill"]
    assert card.value == "—" and card.detail == "reading: 26,624 of 65,000 tokens (41%)"
    assert "(reading: 26,624 of 65,000 tokens (41%))" in P.text_line(t)
    # the next poll: the rate of this prompt, from its own progress
    doc2 = copy.deepcopy(doc)
    doc2["live"]["prompt_read"] = 28672
    s2 = sample_from_metrics(doc2, "strata", s, t=3.0)
    assert s2.prefill_tok_s == pytest.approx((28672 - 26624) / 2.0)


def test_one_busy_slot_is_a_slot_on_the_solo_path_and_without_batch(data_dir):
    solo = sample_from_metrics(fixture(data_dir, "metrics_generating_solo.json"), "strata", None, t=1.0)
    assert solo.slots_busy == 1 and solo.decode_tok_s_per_slot == {0: 63.1}
    vals = sample_values(solo)
    assert vals["slot0_tok_s"] == 63.1 and vals["slot1_tok_s"] == 0.0       # the CSV's slot columns filled
    doc = fixture(data_dir, "metrics_reading_single.json")                  # no --batch
    doc["live"].update(state="generating", tok_s=55.5, prompt_read=None, prompt_total=None)
    single = sample_from_metrics(doc, "strata", None, t=1.0)
    assert single.slots_total == 1 and single.decode_tok_s_per_slot == {0: 55.5}
    assert sample_values(single)["slot0_tok_s"] == 55.5


def test_the_log_source_reads_the_runs_notes_and_decode_lines(tmp_path):
    log = tmp_path / "engine.log"
    log.write_text("[dsv41 2026-01-01] run old: starting strata\n"
                   "[strata] parallel requests: 8 asked, the engine runs 1 (its log says why)\n"
                   "[dsv41 2026-01-02] run new: starting strata\n"
                   f"{PARALLEL_LINE}\n[engine] {DECODE_LINE}\n")
    src = LogSwapSource(get_engine("strata"), log)
    try:
        r = src.read()
        # this run's note only (the earlier run's 8 asked is not this engine's), and its newest decode line
        assert r.notes["engine_notes"] == ["parallel requests: 4 asked, the engine runs 2 (its log says why)"]
        assert r.values["log_vram_share"] == pytest.approx(0.828) and r.values["log_pcie_share"] == pytest.approx(0.1)
        assert r.notes["log_hit"]["scope"] == "request"
        with log.open("a") as f:                       # a batch run ends, then a new request is admitted
            f.write(f"[engine] {BATCH_LINE}\n[engine] {REQUEST_LINE}\n[engine] {DECODE_LINE_NO_PCIE}\n")
        r2 = src.read()
        assert r2.notes["log_hit"]["scope"] == "batch" and r2.values["log_vram_share"] == pytest.approx(0.8)
        assert r2.values["log_swaps_per_s"] == 0.0
    finally:
        src.close()
    # the Monitor's status line and `dsv41 monitor` say the engine's note
    hub = M.MetricsHub([LogSwapSource(get_engine("strata"), log)], hz=1.0, engine="strata")
    try:
        tick = hub.tick_once()
        text, _tip = P.status_text(hub, tick)
        assert "engine: parallel requests: 4 asked, the engine runs 2 (its log says why)" in text
        assert tick.values["vram_share"] == pytest.approx(0.8) and tick.origin["vram_share"] == "log"
    finally:
        hub.stop()


def test_the_scripted_engine_reports_pcie_share_through_strata_fields(sim_process, tmp_path):
    sp = sim_process("--slots", "1", "--pcie-frac", "0.5", "--reply-tokens", "40").wait_ready()
    r = httpx.post(sp.url("/v1/chat/completions"), headers=sp.headers, timeout=60,
                   json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 40})
    assert r.status_code == 200
    doc = httpx.get(sp.url("/metrics"), headers=sp.headers, timeout=10).json()
    req = doc["requests"][0]
    assert 0 < req["pcie_share"] < 1 and req["hit_rate"] is not None
    assert doc["engine"]["pcie_frac"] == "0.50"
    line = sp.wait_for_line(r"decode expert cache hit rate: .* more read by the GPU over PCIe")
    ev = parse_strata_log_line(line)
    assert ev is not None and ev.data["pcie_share"] == pytest.approx(req["pcie_share"], abs=0.001)
    assert ev.data["vram_share"] == pytest.approx(req["hit_rate"] * (1 - req["pcie_share"]), abs=0.002)
    running = RunningEngine.from_status(None, sp.base_url, sp.api_key, engine="sim")
    hub = M.build_hub(running, hz=2.0, record=False)
    try:
        hub.push_log_line(line)
        tick = hub.tick_once()
        assert tick.values["pcie_share"] == pytest.approx(ev.data["pcie_share"])
        assert tick.values["vram_share"] == pytest.approx(ev.data["vram_share"])
        assert tick.values["hit_rate"] == pytest.approx(req["hit_rate"])      # the engine's own, under its name
        assert tick.values["vram_share"] < tick.values["hit_rate"]
    finally:
        hub.stop()


def test_one_request_fills_the_recordings_slot_column(sim1):
    """A single chat on the default one slot: the recording's slot0 column holds its decode rate (it was empty)."""
    import csv

    running = RunningEngine.from_status(None, sim1.base_url, sim1.api_key, engine="sim")
    hub = M.build_hub(running, hz=4.0, record=True)
    seen: list[float] = []
    try:
        hub.tick_once()
        with httpx.Client(timeout=60) as c, c.stream(
                "POST", sim1.url("/v1/chat/completions"), headers=sim1.headers,
                json={"messages": [{"role": "user", "content": "hello"}], "stream": True, "max_tokens": 200}) as r:
            for _ in r.iter_lines():
                t = hub.tick_once()
                if t.values["slot0_tok_s"]:
                    seen.append(t.values["slot0_tok_s"])
                if len(seen) >= 2:
                    break
        csv_path = hub.recorder.csv_path
    finally:
        hub.stop()
    assert seen and all(x > 0 for x in seen)
    rows = list(csv.DictReader(csv_path.open()))
    assert any(r["slot0_tok_s"] not in ("", "0", "0.0") for r in rows)
