"""The Benchmark tab's Quality page under a real X server (pytest-qt): Run drives the quick quality check
(engine_manager.bench.quality) on the scripted engine started through the supervisor, with its smallest subset —
the scores beside the guides' and DeepSeek API's figures, IFEval said not run and why, the determinism table, a
failed item opened whole, the result saved and shown again by a freshly built tab; Cancel mid-run puts back the
engine that ran before and leaves the tab usable."""

from __future__ import annotations

import json

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QPlainTextEdit

from engine_manager import supervisor as sv
from engine_manager.bench import quality as Q
from engine_manager.engine_state import READY, STOPPED
from engine_manager.settings import load_settings

pytest.importorskip("pytestqt")


@pytest.fixture
def make_view(qtbot, monkeypatch, free_port):
    monkeypatch.setenv("DSV41_PORT", str(free_port))
    monkeypatch.setenv("DSV41_SIM_ARGS", "--speed 10")
    from app.bench_view import BenchView
    from app.context import AppContext
    made = []

    def make():
        v = BenchView(AppContext(load_settings()))
        qtbot.addWidget(v)
        v.resize(1280, 800)
        v.show()
        v.pages.setCurrentWidget(v.quality)
        made.append(v)
        return v
    yield make
    for v in made:
        v.shutdown(20000)
    for _ in sv.Supervisor(load_settings().settings).stop(force=True):
        pass


def _cells(table, row):
    return [table.item(row, j).text() for j in range(table.columnCount())]


def test_quick_quality_check_shows_scores_determinism_and_failed_items(make_view, qtbot, tmp_path):
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text(json.dumps({"question": "Tom has 3 apples and buys 4. How many?", "answer": "#### 7"}) + "\n")
    view = make_view()
    q = view.quality
    assert q.verdict.text() == "No quality check run yet."
    q.mode.setCurrentIndex(0)                       # quick
    q.subset.setValue(1)                            # one HumanEval task, one GSM8K item
    q.gsm8k.setText(str(gsm))
    with qtbot.waitSignal(q.finished, timeout=300_000) as blocker:
        qtbot.mouseClick(q.run_button, Qt.MouseButton.LeftButton)
        assert not q.run_button.isEnabled() and q.cancel_button.isEnabled()
        assert not view.run_button.isEnabled()     # the speed benchmark waits: one run takes the engine over
        assert view.ctx.engine_lock and "quality check is running" in view.ctx.engine_lock
    doc = blocker.args[0]
    qtbot.waitUntil(lambda: q.run_button.isEnabled(), timeout=20_000)
    assert doc["error"] is None and not doc["cancelled"] and doc["simulated"]
    assert doc["spec"]["quick"] and doc["tasks"]["gsm8k"] == ["gsm8k/1"] and len(doc["tasks"]["humaneval"]) == 1
    assert view.ctx.engine_lock is None and view.run_button.isEnabled()
    assert q.progress.format() == "done" and any("s left" in f for f in q.formats_seen)
    assert any(f.startswith("determinism") for f in q.formats_seen)
    # the scores beside the guides' and DeepSeek API's figures; IFEval not run, and why
    he, gs, ife = (_cells(q.scores, i) for i in range(3))
    assert he[0] == "HumanEval pass@1" and he[3:5] == ["0.890", "0.982"] and he[5] == "0.878"
    assert gs[1] == "1" and gs[2] == "0.000 (0/1)" and gs[3:5] == ["0.927", "0.960"]   # canned answers score 0
    assert ife[2] == "not run: no checker installed" and ife[3:5] == ["0.800", "0.853"]
    assert "if-verifiable" in q.scores.item(2, 2).toolTip() and "IFEval" in q.notes.text()
    assert "SIMULATED" in q.verdict.text()
    # the determinism table: batched fork answers diverge, gpu numerics and strata_reproducible never
    rows = {_cells(q.determinism, i)[0]: _cells(q.determinism, i) for i in range(q.determinism.rowCount())}
    assert len(rows) == 3
    fork = rows["--cpu-numerics fork (simulated)"]
    assert fork[4].startswith("token ") and fork[3] != "4 of 4"
    assert rows["--cpu-numerics gpu (simulated)"][3:] == ["4 of 4", "none"]
    # the failed items, one double-click from their whole text
    ids = [q.items.item(i, 0).text() for i in range(q.items.rowCount())]
    assert "gsm8k/1" in ids
    row = ids.index("gsm8k/1")
    assert _cells(q.items, row)[1:3] == ["wrong number", "7"]
    rect = q.items.visualItemRect(q.items.item(row, 0))
    qtbot.mouseClick(q.items.viewport(), Qt.MouseButton.LeftButton, pos=rect.center())   # a press first, as a user's
    qtbot.mouseDClick(q.items.viewport(), Qt.MouseButton.LeftButton, pos=rect.center())
    qtbot.waitUntil(lambda: q.item_dialog is not None and q.item_dialog.isVisible(), timeout=5_000)
    text = q.item_dialog.findChild(QPlainTextEdit, "qualityItemText")
    item = next(x for x in doc["items"] if x["id"] == "gsm8k/1")
    assert "Tom has 3 apples" in text.toPlainText() and "Expected: 7" in text.toPlainText()
    assert item["answer"] and item["answer"][:200] in text.toPlainText()
    # saved; a tab built now shows it again
    assert q.saved_path and q.saved_path.endswith(f"{doc['id']}.json")
    again = make_view().quality
    qtbot.waitUntil(lambda: again.result is not None, timeout=10_000)
    assert again.result["id"] == doc["id"] and _cells(again.scores, 1)[2] == "0.000 (0/1)"
    assert again.determinism.rowCount() == 3 and again.items.rowCount() == q.items.rowCount()
    assert sv.Supervisor(load_settings().settings).status(check_health=False).state == STOPPED


def test_cancel_mid_run_puts_the_engine_back_and_the_tab_stays_usable(make_view, qtbot):
    view = make_view()
    for _ in sv.Supervisor(load_settings().settings).run("sim", None, watch=False):
        pass
    before = sv.Supervisor(load_settings().settings).status()
    assert before.state == READY
    q = view.quality
    q.subset.setValue(1)
    with qtbot.waitSignal(q.finished, timeout=300_000) as blocker:
        q.run()
        qtbot.waitUntil(lambda: any(f.startswith("determinism") for f in q.formats_seen), timeout=240_000)
        qtbot.mouseClick(q.cancel_button, Qt.MouseButton.LeftButton)
        assert q.progress.format().startswith("cancelling")
    doc = blocker.args[0]
    assert doc["cancelled"] is True and len(doc["determinism"]) < 3
    qtbot.waitUntil(lambda: q.run_button.isEnabled(), timeout=20_000)
    assert q.progress.format() == "cancelled" and "Cancelled" in q.verdict.text()
    assert view.ctx.engine_lock is None and view.run_button.isEnabled() and not q.cancel_button.isEnabled()
    after = sv.Supervisor(load_settings().settings).status()
    assert after.state == READY and after.engine == "sim" and "--slots 1 " in " ".join(after.argv) + " "
    # the tab answers: the page switches and the options change
    view.pages.setCurrentIndex(0)
    q.mode.setCurrentIndex(1)
    q.subset.setValue(0)
    assert q.spec().humaneval_n == Q.QualitySpec().humaneval_n and not q.spec().quick
