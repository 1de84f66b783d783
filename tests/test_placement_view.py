"""The Placement tab under a real X server (pytest-qt): budget bars, heatmap with hover readout, coverage curve,
refusal in plain words, observed routing, and the Plan button running the planner on a worker."""

from __future__ import annotations

import numpy as np
import pytest

from engine_manager import placement as P
from engine_manager.layout import read_layout
from engine_manager.replica import ReplicaSpec, write_replica
from engine_manager.routing import FrequencyTable
from engine_manager.settings import load_settings

pytest.importorskip("pytestqt")

GiB, GB = 1 << 30, 10**9


@pytest.fixture(scope="module")
def lay(tmp_path_factory):
    d = tmp_path_factory.mktemp("replica")
    write_replica(d, ReplicaSpec())
    return read_layout(d)


@pytest.fixture
def view(qtbot):
    from app.context import AppContext
    from app.placement_view import PlacementView
    ctx = AppContext(load_settings())
    v = PlacementView(ctx)
    qtbot.addWidget(v)
    v.resize(1300, 850)
    v.show()
    yield v
    v.shutdown()


def test_renders_a_plan(view, lay):
    d = P.plan(lay, P.reference_hardware(), None, None).to_dict()
    view.ctx.set_plan(d)                                   # via the context's signal, as other panels would
    assert view.plan is d
    text = view.summary.text()
    assert f"{d['hot_experts']:,}" in text and "unknown until the engine has seen traffic" in text
    assert [t["name"] for t in view.vram_bar.terms][-1] == "hot experts"
    assert view.vram_bar.budget == d["vram"]["budget_bytes"]
    assert "cold experts (pinned)" in view.ram_legend.text()
    assert view.image.image.shape == (384, 40)             # experts across, MoE layers down
    cell = view.describe_cell(0, 0)
    assert "layer 3" in cell and "expert 0" in cell and "12.22 MiB" in cell and "VRAM" in cell
    assert "RAM (cold)" in view.describe_cell(39, 383) and "frequency unknown" in view.describe_cell(39, 383)
    assert "No routing data" in view.cov_text.toPlainText()
    assert "37.5%" in view.llama.text()


def test_refusal_in_plain_words(view, lay):
    d = P.plan(lay, P.reference_hardware(ram_bytes=192e9), None, None).to_dict()
    view.show_plan(d)
    t = view.summary.text()
    missing = d["shortfalls"][0]["missing_bytes"] / GB
    assert "cannot hold the model" in t and f"{missing:.1f} GB missing" in t
    assert "short" in view.ram_title.text()


def test_frequencies_coverage_and_observed(view, lay):
    rng = np.random.default_rng(2)
    c = np.zeros((43, 384))
    c[3:] = rng.zipf(1.5, (40, 384))
    d = P.plan(lay, P.reference_hardware(), FrequencyTable(c), None).to_dict()
    view.show_plan(d)
    x, y = view.cov_curve.getData()
    assert len(x) > 10 and y[-1] == pytest.approx(100.0)
    assert view.cov_line.value() == d["hot_experts"]
    assert "of planned picks" in view.describe_cell(5, 7)
    view.mode.setCurrentIndex(view.mode.findData("frequency"))
    obs = c[3:] * 2
    view.update_observed(obs)
    assert "Observed routing" in view.hover.text() and "planned hot set" in view.hover.text()
    view.mode.setCurrentIndex(view.mode.findData("observed"))
    assert "observed" in view.describe_cell(5, 7)
    view.update_observed(c)                                  # all blocks: the MoE rows are taken
    assert view.observed.shape == (40, 384)


def test_plan_button_runs_on_a_worker_and_sets_the_plan(view, qtbot):
    view.host.setCurrentIndex(view.host.findData("reference"))
    with qtbot.waitSignal(view.ctx.planChanged, timeout=60_000) as blocker:
        view.plan_button.click()
        assert not view.plan_button.isEnabled()              # the GUI thread is free while it plans
    d = blocker.args[0]
    assert d["hot_experts"] > 0 and view.ctx.plan is d
    qtbot.waitUntil(lambda: view.plan_button.isEnabled(), timeout=10_000)
    assert P.load_last_plan()["hot_experts"] == d["hot_experts"]


def test_custom_host_refused_shows_missing(view, qtbot):
    view.host.setCurrentIndex(view.host.findData("custom"))
    assert view.vram.isVisibleTo(view)
    view.vram.setValue(96)
    view.ram.setValue(192)
    with qtbot.waitSignal(view.ctx.planChanged, timeout=60_000) as blocker:
        view.plan_button.click()
    assert blocker.args[0]["refused"]
    qtbot.waitUntil(lambda: "GB missing" in view.summary.text(), timeout=5_000)
