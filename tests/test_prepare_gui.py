"""The provisioning step in the GUI and the Placement tab's "Start with this plan" (item 3),
under a real X server, with the stand-in Strata release's own tool and a real small split GGUF."""

from __future__ import annotations

import pytest

from engine_manager import provision
from engine_manager.gguf_split import find_split
from engine_manager.settings import load_settings
from engine_manager.testing.tinymoe import write_tinymoe

pytestmark = pytest.mark.gui


@pytest.fixture
def setup(tmp_path, monkeypatch):
    from strata_support import make_strata_release

    release = make_strata_release(tmp_path / "release")
    model = tmp_path / "model"
    write_tinymoe(model, shards=2)
    monkeypatch.setenv("DSV41_ENGINE_DIR", str(release))
    monkeypatch.setenv("DSV41_MODEL_DIR", str(model))
    return release, model


@pytest.fixture
def panel(qtbot, qapp, setup):
    from app.context import AppContext
    from app.download_panel import DownloadPanel

    ctx = AppContext(load_settings())
    w = DownloadPanel(ctx)
    qtbot.addWidget(w)
    w.show()
    yield w
    w.shutdown()
    qtbot.waitUntil(lambda: w.prep_worker is None, timeout=30000)


def test_the_downloads_tab_prepares_the_model_with_the_releases_tool(panel, qtbot, setup):
    _, model = setup
    seen, done = [], []
    panel.prepareEvent.connect(seen.append)
    panel.prepareFinished.connect(done.append)
    panel.prep_btn.click()
    qtbot.waitUntil(lambda: bool(done), timeout=60000)
    pack = provision.pack_dir_for(find_split(model).first)
    assert done == [str(pack)] and provision.pack_state(pack, find_split(model))[0]
    assert any(e.phase == "start" for e in seen) and any(e.phase == "output" for e in seen)
    assert "pack is ready" in panel.prep_label.text() and panel.prep_btn.isEnabled()
    # a second time: nothing to do, the tool does not run
    seen.clear()
    done.clear()
    panel.start_prepare()
    qtbot.waitUntil(lambda: bool(done), timeout=60000)
    assert [e.phase for e in seen] == ["done"] and seen[0].skipped


def test_the_downloads_tab_says_why_preparing_failed(panel, qtbot, setup, monkeypatch):
    monkeypatch.setenv("STRATA_STANDIN_PACK_FAIL", "after-dense")
    failed = []
    panel.prepareFailed.connect(failed.append)
    panel.start_prepare()
    qtbot.waitUntil(lambda: bool(failed), timeout=60000)
    assert "stopped with exit code 1" in failed[0] and "dsv41 prepare" in failed[0]
    assert "✗" in panel.prep_label.text()


def test_the_first_run_flow_shows_the_preparing_step(qtbot, qapp, setup):
    from app.context import AppContext
    from app.download_panel import DownloadPanel
    from app.first_run import FirstRunDialog

    ctx = AppContext(load_settings())
    dp = DownloadPanel(ctx)
    qtbot.addWidget(dp)
    dlg = FirstRunDialog(ctx, dp)
    qtbot.addWidget(dlg)
    page = dlg.model_page
    page.start_prepare()
    qtbot.waitUntil(lambda: page.prep_state.text().startswith("✓"), timeout=60000)
    assert "prepared for the Strata engine" in page.prep_state.text()
    dp.shutdown()
    qtbot.waitUntil(lambda: dp.prep_worker is None, timeout=30000)


def test_start_with_this_plan_hands_that_plan_to_the_engine_panel(qtbot, qapp, setup):
    """The plan on screen, even one made for a hypothetical host, goes to the engine panel's start as it is
    (``dsv41 start --plan FILE`` in the GUI); a refused plan cannot be started."""
    from app.context import AppContext
    from app.placement_view import PlacementView
    from engine_manager import placement
    from engine_manager.tensor_layout import read_layout

    _, model = setup
    settings = load_settings().settings
    ctx = AppContext(load_settings())
    view = PlacementView(ctx)
    qtbot.addWidget(view)
    assert not view.start_with_plan.isEnabled()
    plan = placement.plan(read_layout(model), placement.reference_hardware(), None,
                          placement.PlanSettings.from_settings(settings)).to_dict()
    assert plan["hardware"]["hypothetical"] and not plan["refused"]
    requested = []
    ctx.startWithPlan.connect(requested.append)
    view.show_plan(plan)
    assert view.start_with_plan.isEnabled()
    view.start_with_plan.click()
    assert requested == [plan]
    view.show_plan({**plan, "refused": "RAM too small"})
    assert not view.start_with_plan.isEnabled()


def test_the_engine_panel_starts_with_the_chosen_plan_and_names_its_host(qtbot, qapp, setup, monkeypatch, free_port):
    """"Start with this plan" (ctx.startWithPlan): the supervisor gets exactly that plan — even one made for a
    hypothetical host, which the default start would not use — and the panel warns, naming the host."""
    import json
    from pathlib import Path

    from supervisor_helpers import hw

    from app.context import AppContext
    from app.engine_panel import EnginePanel
    from engine_manager import placement
    from engine_manager import supervisor as sv
    from engine_manager.tensor_layout import read_layout

    monkeypatch.setenv("DSV41_PORT", str(free_port))
    monkeypatch.setenv("DSV41_SIM_ARGS", "--load-time 0.2")
    monkeypatch.setenv("DSV41_SERVER_ENGINE", "sim")
    _, model = setup
    ctx = AppContext(load_settings(), hw())
    panel = EnginePanel(ctx)
    qtbot.addWidget(panel)
    panel.show()
    qtbot.waitUntil(lambda: not panel.tasks.running("run"), timeout=10_000)
    # a host of its own (50 GiB VRAM, 200 GiB RAM): not this machine, not the default plan's reference host
    host = placement.hypothetical_hardware(hw(), 50 * 2**30, 200 * 2**30)
    plan = placement.plan(read_layout(model), host, None,
                          placement.PlanSettings.from_settings(ctx.settings)).to_dict()
    assert "50" in plan["hardware"]["label"]
    try:
        with qtbot.waitSignal(ctx.ownEngineChanged, timeout=60_000, check_params_cb=lambda r: r is not None):
            ctx.startWithPlan.emit(plan)
        assert "This plan was made for hypothetical host" in panel.notes.text()
        assert panel._chosen_plan is None                                # taken once
        started = json.loads(Path(panel.sup.snapshot().spec.files["plan"]).read_text())
        assert started["hardware"]["label"] == plan["hardware"]["label"]
    finally:
        for _ in sv.Supervisor(load_settings().settings).stop(force=True):
            pass
        qtbot.waitUntil(lambda: not panel.tasks.running("run"), timeout=30_000)
