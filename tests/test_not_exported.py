"""A figure the engine does not export is said to be so — on the Monitor's plots and cards, never a 0 or an
empty plot — as distinct from a figure not measured yet or a source that did not answer.

- vLLM (its documented ``/metrics`` from ``tests/data/vllm``, served on loopback): no expert hit rate and no swaps
  (the adapter's ``exports``); a server that leaves ``vllm:num_requests_waiting`` out: "queued" is not exported,
  named by its metric; the same server with the metric: queued is a reading;
- an engine whose log cannot report swaps (llama.cpp): the log source's "0 swaps" is no reading;
- the real Monitor view fed the vLLM hub's ticks: the hit and swaps plots and cards say "not exported by this
  engine", the throughput plot and card show the figures.
"""

from __future__ import annotations

import time

import pytest
from attach_support import fixture_server  # noqa: F401  (fixture)

from engine_manager import metrics as M
from engine_manager.engines import get_engine
from engine_manager.metrics import presenter
from engine_manager.metrics.hub import MetricsHub
from engine_manager.metrics.sources import LogSwapSource
from engine_manager.session import RunningEngine

PLOTS = {"tok": ["decode_tok_s", "prefill_live_tok_s"], "hit": ["vram_share", "hit_rate_rolling", "hit_rate"],
         "swaps": ["swaps_per_s", "swap_mb_s", "pcie_rx_mb_s"]}


def two_ticks(srv) -> M.Tick:
    """The second tick of a hub on ``srv`` (rates need two scrapes)."""
    hub = M.build_hub(RunningEngine(srv.base_url, srv.key, engine="vllm"), record=False, use_nvml=False, hz=4)
    try:
        first = hub.tick_once()
        assert "engine" not in first.missing, first.missing
        srv.advance()
        time.sleep(0.3)
        tick = hub.tick_once()
        assert "engine" not in tick.missing, tick.missing
        return tick
    finally:
        hub.close()


def test_vllm_exports_no_expert_figures_and_a_left_out_metric_is_named(fixture_server):  # noqa: F811
    tick = two_ticks(fixture_server("vllm"))
    gone = tick.notes["not_exported"]
    for col in ("vram_share", "hit_rate_rolling", "hit_rate", "swaps_per_s", "swap_mb_s"):
        assert col in gone and "vLLM has no such figure" in gone[col], col
    assert "queued" not in gone and tick.values["queued"] is not None
    assert tick.values["decode_tok_s"] is not None and "decode_tok_s" not in gone
    notes = presenter.plot_notes(tick, PLOTS)
    # the swaps plot's PCIe line would come from the driver where there is one: not here (no NVML), so nothing
    # of that plot can be drawn either; the throughput plot has its figures
    assert set(notes) == {"hit", "swaps"}, notes
    assert notes["hit"].startswith("Not exported by this engine: vLLM has no such figure")
    with_pcie = M.Tick(seq=tick.seq, t=tick.t, values={**tick.values, "pcie_rx_mb_s": 12.0}, engine="vllm",
                       notes=tick.notes)
    assert set(presenter.plot_notes(with_pcie, PLOTS)) == {"hit"}      # a figure drawn: no note over it
    cards = presenter.cards(tick)
    assert cards["hit"].value == "—" and cards["hit"].detail == "not exported by this engine"
    assert cards["swaps"].detail == "not exported by this engine"
    assert cards["decode"].detail != "not exported by this engine" and cards["decode"].value != "—"
    line = presenter.text_line(tick)                     # `dsv41 monitor`
    assert "in VRAM not exported" in line and "swaps not exported" in line and "decode —" not in line

    dropped = two_ticks(fixture_server("vllm", drop=("vllm:num_requests_waiting",)))
    assert dropped.values["queued"] is None
    assert dropped.notes["not_exported"]["queued"] == "vllm:num_requests_waiting is not on its /metrics"
    assert dropped.values["slots_busy"] is not None and "slots_busy" not in dropped.notes["not_exported"]


def test_a_log_that_cannot_report_swaps_gives_no_zero(tmp_path):
    """llama.cpp's log says nothing of expert swaps: the log source's 0 swaps/s is no reading for it (missing,
    not exported), while for Strata, whose log counts them, the same 0 is a reading."""
    log = tmp_path / "engine.log"
    log.write_text("a line\n")
    for name, exported in (("llamacpp", False), ("strata", True)):
        src = LogSwapSource(get_engine(name), log, expected=True)
        hub = MetricsHub([src], hz=4, engine=name)
        try:
            hub.tick_once()
            tick = hub.tick_once()
        finally:
            hub.close()
        if exported:
            assert tick.values["swaps_per_s"] == 0.0 and "swaps_per_s" not in tick.notes["not_exported"]
        else:
            assert tick.values["swaps_per_s"] is None and tick.values["log_swaps_per_s"] is None
            assert "llama.cpp" in tick.notes["not_exported"]["swaps_per_s"]


@pytest.mark.gui
def test_the_monitor_says_not_exported_on_plots_and_cards(qtbot, fixture_server):  # noqa: F811
    from app.context import AppContext
    from app.monitor_view import MonitorView
    from engine_manager.settings import load_settings

    tick = two_ticks(fixture_server("vllm"))
    store = M.RingStore(M.COLUMN_NAMES)
    store.append(tick.t, tick.values)
    mon = MonitorView(AppContext(load_settings()))
    qtbot.addWidget(mon)
    mon.resize(1000, 700)
    mon.show()
    mon.feed(tick, store)
    qtbot.waitUntil(lambda: mon.cards["hit"].detail.text() == "not exported by this engine", timeout=10_000)
    assert mon.plots["hit"].note.toPlainText().startswith("Not exported by this engine: vLLM has no such figure")
    assert mon.cards["swaps"].detail.text() == "not exported by this engine"
    assert mon.cards["swaps"].value.text() == "—"
    assert mon.plots["tok"].note.toPlainText() == ""
    assert mon.cards["decode"].detail.text() != "not exported by this engine"
    mon.shutdown()
