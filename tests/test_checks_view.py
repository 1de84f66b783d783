"""The engine column's planned-vs-measured line (app/checks_view.py) against the scripted engine that admits fewer
experts than its plan: amber, with the figures and the fix."""

from __future__ import annotations

import os
from pathlib import Path

from engine_manager import placement, plans
from engine_manager.engine_state import RunningEngine


def test_a_short_expert_cache_turns_the_line_amber_with_figures(app_ctx, shown, qtbot, sim_process, tmp_path):
    from app.checks_view import AMBER, ChecksView

    plan = placement.plan(plans.default_sim_layout(tmp_path / "replica"), placement.reference_hardware(),
                          None, None).to_dict()
    sp = sim_process("--admit-experts", "3000").wait_ready()
    running = RunningEngine(sp.base_url, sp.api_key, engine="sim", simulated=True, pid=sp.proc.pid, plan=plan,
                            binding="numactl --cpunodebind=0 --preferred=0 (node 0, CPUs 0)")
    view = shown(ChecksView(app_ctx), 420, 220)
    app_ctx.ownEngineChanged.emit(running)
    qtbot.waitUntil(lambda: view.report is not None and view.isVisible(), timeout=60_000)
    text = view.text()
    assert "Not as planned" in text and "Experts held in VRAM" in text
    assert f"planned {plan['hot_experts']:,} experts" in text and "measured 3,000 experts" in text
    assert AMBER in view.styleSheet() and "dsv41 plan" in text
    if os.environ.get("PANEL_SCREENSHOTS"):
        view.grab().save(str(Path(os.environ["PANEL_SCREENSHOTS"]) / "checks_amber.png"))
    app_ctx.ownEngineChanged.emit(None)                 # the engine stopped: the line goes away
    assert not view.isVisible()
