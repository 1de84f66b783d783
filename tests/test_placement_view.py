"""The Placement tab under a real X server (pytest-qt): budget bars, heatmap with hover readout, coverage curve,
refusal in plain words, observed routing, and the Plan button running the planner on a worker."""

from __future__ import annotations

import numpy as np
import pytest

from engine_manager import placement as P
from engine_manager import plans
from engine_manager.tensor_layout import read_layout
from engine_manager.replica import ReplicaSpec, write_replica
from engine_manager.expert_routing import FrequencyTable
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
    # planned without routing data: which experts are hot is unknown (not "experts 0..N of every layer")
    assert "layer 3" in cell and "expert 0" in cell and "12.22 MiB" in cell and "unknown" in cell
    assert "RAM (cold)" not in view.describe_cell(39, 383) and "frequency unknown" in view.describe_cell(39, 383)
    assert "No routing data" in view.cov_text.text() and view.cov_text.isVisibleTo(view)
    assert view.cov_text.wordWrap()                          # a label that wraps, not text cut at the plot's edge
    assert "37.5%" in view.llama.text()


def test_refusal_in_plain_words(view, lay):
    d = P.plan(lay, P.reference_hardware(ram_bytes=192e9), None, None).to_dict()
    view.show_plan(d)
    t = view.summary.text()
    missing = d["shortfalls"][0]["missing_bytes"] / GB
    assert "cannot hold the model" in t and f"{missing:.1f} GB (" in t and "GiB) missing" in t
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


def test_observed_routing_before_a_plan_takes_the_plans_rows_later(view, lay):
    c = np.zeros((43, 384))
    c[3:, 5] = 7.0                                           # all blocks, as the monitor counts a trace
    view.update_observed(c)
    assert view.observed.shape == (43, 384)                  # no plan yet: as given
    view.show_plan(P.plan(lay, P.reference_hardware(), None, None).to_dict())
    assert view.observed.shape == (40, 384) and view.observed[:, 5].tolist() == [7.0] * 40
    view.mode.setCurrentIndex(view.mode.findData("observed"))
    assert view.image.image.shape == (384, 40) and "(7 picks)" in view.describe_cell(0, 5)
    view.update_observed(np.ones((10, 20)))                  # another model's counts: not put on this plan
    assert view.observed.shape == (40, 384)


def test_plan_button_runs_on_a_worker_and_sets_the_plan(view, qtbot):
    view.host.setCurrentIndex(view.host.findData("reference"))
    with qtbot.waitSignal(view.ctx.planChanged, timeout=60_000) as blocker:
        view.plan_button.click()
        assert not view.plan_button.isEnabled()              # the GUI thread is free while it plans
    d = blocker.args[0]
    assert d["hot_experts"] > 0 and view.ctx.plan is d
    qtbot.waitUntil(lambda: view.plan_button.isEnabled(), timeout=10_000)
    # the guides' workstation is hypothetical: shown again after a restart, never the plan `dsv41 start` uses
    assert plans.load_last_plan() is None and plans.load_shown_plan()["hot_experts"] == d["hot_experts"]
    assert "not as the plan `dsv41 start` uses" in view.saved_note.text() and view.saved_note.isVisibleTo(view)


def test_custom_host_refused_shows_missing(view, qtbot):
    view.host.setCurrentIndex(view.host.findData("custom"))
    assert view.vram.isVisibleTo(view)
    view.vram.setValue(95.59)
    view.ram.setValue(192)
    assert view.ram.suffix().strip() == "GiB RAM" and "206.2 GB" in view.ram_gb.text()
    with qtbot.waitSignal(view.ctx.planChanged, timeout=60_000) as blocker:
        view.plan_button.click()
    d = blocker.args[0]
    assert d["refused"] and d["hardware"]["ram_bytes"] == 192 * GiB
    qtbot.waitUntil(lambda: "GiB) missing" in view.summary.text(), timeout=5_000)


def test_empty_state_before_any_plan(view):
    """p1: before a plan the heatmap and coverage say so in words instead of black plots with axes -500..500."""
    assert view.plan is None
    assert view.heat_stack.currentWidget() is view.heat_empty and "No plan yet" in view.heat_empty.text()
    assert view.cov_stack.currentWidget() is view.cov_empty and "No plan yet" in view.cov_empty.text()
    assert not view.heat.isVisibleTo(view) and not view.cov.isVisibleTo(view)


def test_gui_and_cli_give_the_same_shortfall_for_the_same_number(view, qtbot, capsys):
    """p9: 192 in the spin box and `dsv41 plan --ram-gib 192` are the same size, so the same shortfall."""
    import json
    from engine_manager.cli import main
    view.host.setCurrentIndex(view.host.findData("custom"))
    view.vram.setValue(95.59)
    view.ram.setValue(192)
    with qtbot.waitSignal(view.ctx.planChanged, timeout=60_000) as blocker:
        view.plan_button.click()
    gui = blocker.args[0]["shortfalls"][0]
    rc = main(["plan", "--replica", "--vram-gib", "95.59", "--ram-gib", "192", "--json", "--no-save"])
    cli = json.loads(capsys.readouterr().out)["shortfalls"][0]
    assert rc == 3 and gui["resource"] == cli["resource"] == "ram"
    assert gui["available_bytes"] == cli["available_bytes"] == 192 * GiB
    assert gui["missing_bytes"] == cli["missing_bytes"]


def test_old_ram_in_gb_state_is_converted(qtbot):
    from engine_manager import uistate
    from app.context import AppContext
    from app.placement_view import PlacementView
    uistate.save({"placement_view": {"host": "custom", "vram_gib": 48.0, "ram_gb": 192}})
    v = PlacementView(AppContext(load_settings()))
    qtbot.addWidget(v)
    assert v.ram.value() == pytest.approx(192 * GB / GiB, abs=0.05) and v.vram.value() == pytest.approx(48.0)


def test_hot_set_without_routing_data_is_drawn_as_unknown(view, lay, tmp_path):
    """a plan without routing data lists experts 0..N of every layer as its hot set; the heatmap
    drew that as two flat blocks, a pattern that does not exist. It is one flat field, said to be unknown; with
    frequencies the placement is drawn (and told) as it is."""
    view.show_plan(P.plan(lay, P.reference_hardware(), None, None).to_dict())
    assert view.mode.currentData() == "placement"
    img = np.asarray(view.image.image)
    assert np.unique(img).size == 1, "a hot set without routing data drawn as a pattern"
    assert "Hot set unknown" in view.hover.text()
    # the same plan saved with its Strata profile (the Placement tab and `dsv41 plan` always write one): a profile
    # file says nothing about which experts are hot — still unknown (it was drawn as the two blocks)
    saved = P.plan(lay, P.reference_hardware(), None, None, strp_path=tmp_path / "p.strp").to_dict()
    assert saved["strp_path"]
    view.show_plan(saved)
    assert np.unique(np.asarray(view.image.image)).size == 1 and "Hot set unknown" in view.hover.text()
    rng = np.random.default_rng(3)
    c = np.zeros((43, 384))
    c[3:] = rng.zipf(1.5, (40, 384))
    view.show_plan(P.plan(lay, P.reference_hardware(), FrequencyTable(c), None).to_dict())
    img = np.asarray(view.image.image)
    assert np.unique(img).size > 2
    assert "VRAM (hot, rank 1)" in "".join(view.describe_cell(r, e) for r in range(40) for e in range(384)
                                           if view._grid["hot_rank"][r, e] == 0)


def test_running_engine_plan_and_trace_are_the_tabs_data_without_a_click(view, lay, qtbot, tmp_path):
    """The running engine's plan is shown (not "No plan yet" beside a Monitor that shows its prediction), its
    routing trace is the routing data, the first observed counts switch the heatmap to them, and "Re-plan from
    observed routing" plans with the trace."""
    from engine_manager import expert_routing

    running = P.plan(lay, P.reference_hardware(), None, None).to_dict()
    trace = tmp_path / "routing.trace"
    rng = np.random.default_rng(5)
    with open(trace, "wb") as f:                    # a real --dump-routing trace (format 1 records)
        for _ in range(400):
            for layer in range(3, 43):
                experts = rng.choice(64, size=6, replace=False).astype("<i4")
                f.write(np.array([layer, 6], "<i4").tobytes() + experts.tobytes()
                        + np.full(6, 1 / 6, "<f4").tobytes())
    view.show_running(running, str(trace))
    assert view.plan is running and "No plan yet" not in view.summary.text()
    assert str(trace) in view.usage_label.text() and "running engine" in view.usage_label.text()
    assert view.replan_observed.isVisibleTo(view)
    counts, _stats = expert_routing.count_trace(trace.read_bytes(), 43, 384)
    assert counts.sum() > 0
    view.update_observed(counts)
    assert view.mode.currentData() == "observed"               # no click
    assert np.unique(np.asarray(view.image.image)).size > 2
    assert f"{counts.sum():,.0f} expert picks observed" in view.usage_label.text()
    view.host.setCurrentIndex(view.host.findData("reference"))
    with qtbot.waitSignal(view.ctx.planChanged, timeout=60_000) as blocker:
        view.replan_observed.click()
    d = blocker.args[0]
    assert str(trace) in " ".join(d["usage"]["sources"]) and d["predicted_hit_rate"] is not None
    assert np.unique(np.asarray(view.image.image)).size > 2


def test_observed_picks_never_sit_under_no_routing_data_and_each_figure_says_what_it_measures(view, lay, tmp_path):
    """A plan made before any traffic has no coverage curve; once the engine's picks are observed the tab says so
    and how to draw it — never "No routing data" under "N expert picks observed". The observed share is named as
    the share of all observed picks in the planned set, against the planner's and the Monitor's figures; the
    heatmap has a colour scale that names what a colour means in each mode."""
    from engine_manager.metrics import presenter

    running = P.plan(lay, P.reference_hardware(), None, None).to_dict()
    view.show_running(running, str(tmp_path / "routing.trace"))
    assert "No routing data" in view.cov_text.text()
    assert view.colorbar.axis.labelText == "hot set unknown"
    counts = np.zeros((43, 384))
    counts[3:, :32] = 100.0
    view.update_observed(counts)
    picks = f"{counts.sum():,.0f} expert picks observed"
    assert picks in view.usage_label.text()
    assert "No routing data" not in view.cov_text.text() and "re-plan from observed routing" in view.cov_text.text()
    assert presenter.PLACEMENT_MEANS in view.hover.text()
    assert "observed VRAM share over the last minute" in view.hover.text()
    assert view.mode.currentData() == "observed" and "observed picks" in view.colorbar.axis.labelText
    lo, hi = view.colorbar.levels()
    assert lo == 0 and hi > 0
    view.mode.setCurrentIndex(view.mode.findData("placement"))
    assert view.colorbar.axis.labelText == "hot set unknown"          # planned without routing data
    d = P.plan(lay, P.reference_hardware(), FrequencyTable(counts[3:], ["observed"]), None).to_dict()
    view.show_plan(d)
    assert view.colorbar.axis.labelText.startswith("RAM (cold)")
    assert "Predicted share of expert picks in VRAM" in view.summary.text()
    assert "predicted on the planning traffic" in view.summary.text()
