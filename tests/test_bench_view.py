"""The Benchmark tab under a real X server (pytest-qt): Run drives a real benchmark of the scripted engine started
through the supervisor — progress with phase and ETA, the table beside the guides' figures, per-user bars and the
per-stream token timelines showing the long-prompt pause, the run saved and listed; Cancel leaves the engine as
it was."""

from __future__ import annotations

import pyqtgraph as pg
import pytest

from engine_manager import supervisor as sv
from engine_manager.engine_state import STOPPED
from engine_manager.settings import load_settings

pytest.importorskip("pytestqt")

SMALL = {"users": (1, 2), "tokens": 24, "repeats": 2, "long_prompt_tokens": 3000, "long_users": 2}


@pytest.fixture
def view(qtbot, monkeypatch, free_port):
    monkeypatch.setenv("DSV41_PORT", str(free_port))
    from app.bench_view import BenchView
    from app.context import AppContext
    ctx = AppContext(load_settings())
    v = BenchView(ctx)
    qtbot.addWidget(v)
    v.resize(1400, 900)
    v.show()
    yield v
    v.shutdown(10000)
    for _ in sv.Supervisor(load_settings().settings).stop(force=True):
        pass


def test_run_shows_progress_table_and_plots(view, qtbot):
    assert view.engine_name() == "sim" and "SIMULATED" in view.engine_label.text()
    assert view.preset_boxes["numerics"].isChecked() and not view.preset_boxes["placement"].isEnabled()
    view.preset_boxes["numerics"].setChecked(False)
    view.spec_overrides = dict(SMALL)
    running = []
    view.ctx.engineRunning.connect(running.append)          # the bench's engine reaches the panel's session
    locks = []
    view.ctx.engineLockChanged.connect(locks.append)        # the engine panel's Start/Stop are held meanwhile
    with qtbot.waitSignal(view.finished, timeout=180_000) as blocker:
        qtbot.mouseClick(view.run_button, pg.QtCore.Qt.MouseButton.LeftButton)
        assert not view.run_button.isEnabled() and view.cancel_button.isEnabled()
        assert view.ctx.engine_lock and "benchmark is running" in view.ctx.engine_lock
    r = blocker.args[0]
    qtbot.waitUntil(lambda: view.run_button.isEnabled(), timeout=10_000)
    assert view.ctx.engine_lock is None and locks[0] and locks[-1] is None
    assert any("1 user:" in f for f in view.formats_seen) and any("s left" in f for f in view.formats_seen)
    assert view.progress.value() == 1000 and view.progress.format() == "done"
    # the table beside the guides'
    assert view.table.rowCount() == 2
    cells = [view.table.item(0, j).text() for j in range(view.table.columnCount())]
    assert cells[0] == "1" and cells[7] == "63.11" and cells[-1].endswith("(simulated)")
    assert float(cells[1]) == pytest.approx(r["table"][0]["total_tok_s"], abs=0.05)
    assert "SIMULATED" in view.verdict.text() and "Long prompt" in view.details.text()
    # per-user bars: one bar per stream of the last repeat of 1 and 2 users
    bars = [i for i in view.bars.getPlotItem().items if isinstance(i, pg.BarGraphItem)]
    assert [len(b.opts["height"]) for b in bars] == [1, 2]
    # the timelines: one curve per decoding stream, and the long prompt's read marked
    curves = view.timeline.getPlotItem().listDataItems()
    assert len(curves) == 2
    region = [i for i in view.timeline.getPlotItem().items if isinstance(i, pg.LinearRegionItem)]
    lp = r["configs"][0]["phases"]["long_prompt"]
    assert len(region) == 1 and region[0].getRegion() == pytest.approx((lp["sent_at_s"], lp["first_token_s"]))
    xs, ys = curves[0].getData()
    assert ys[0] == 1 and curves[1].getData()[1][0] == 4           # stream n drawn 3·n higher
    gaps = [b - a for a, b in zip(xs, xs[1:])]
    assert max(gaps) == pytest.approx(lp["max_gap_s"][0], abs=0.01)        # the pause is in the plot
    # saved and listed; the engine the bench started reached the panel, then stopped again
    assert view.saved_path
    qtbot.waitUntil(lambda: view.history_a.count() == 1, timeout=10_000)
    assert running and running[-1] is None and any(x is not None for x in running)
    assert sv.Supervisor(load_settings().settings).status(check_health=False).state == STOPPED


def test_cancel_stops_the_run_and_says_so(view, qtbot):
    view.preset_boxes["numerics"].setChecked(False)
    view.spec_overrides = {"users": (1,), "tokens": 400, "repeats": 3, "long_prompt_tokens": 0}
    with qtbot.waitSignal(view.finished, timeout=120_000) as blocker:
        view.run_bench()
        qtbot.waitUntil(lambda: any("1 user:" in f for f in view.formats_seen), timeout=60_000)
        view.cancel()
    assert blocker.args[0]["cancelled"] is True
    qtbot.waitUntil(lambda: view.run_button.isEnabled(), timeout=10_000)
    assert view.progress.format() == "cancelled" and "Cancelled" in view.verdict.text()


def test_history_skips_a_bad_file_with_a_note_and_a_damaged_one_is_said(view, qtbot):
    import json

    from test_hostile_bench import fake_result

    from engine_manager.bench import results
    good = fake_result()
    jp, _ = results.save(good)
    (results.bench_dir() / "bench_20990101T000000Z.json").write_text(json.dumps({"schema": "dsv41-bench",
                                                                                  "table": "x"}))
    messages = []
    view.ctx.statusMessage.connect(lambda text, *_: messages.append(text))
    view.refresh_history()
    qtbot.waitUntil(lambda: view.history_notes != [], timeout=10_000)
    assert view.history_a.count() == 1 and view.history_a.currentData() == str(jp)
    assert "bench_20990101T000000Z.json" in view.history_notes[0] and any("Skipped" in m for m in messages)
    jp.write_text(json.dumps({"schema": "dsv41-bench", "engine": 5}))     # damaged after it was listed
    view.show_saved()
    assert "not a benchmark result this panel can read" in view.verdict.text()
    view.compare()
