"""Day-one actions that used to do nothing and say nothing, against the real scripted engine (pytest-xvfb):
"Start with this plan" while an engine runs offers "Restart with this plan"; a setting that needs a restart asks
whether to restart now; a relaunch says it is re-attaching instead of "Stopped"; the Getting-started wizard stays
away once finished or closed, and says its whole step 2."""

from __future__ import annotations

import pytest
from supervisor_helpers import hw

from engine_manager.settings import load_settings

pytestmark = pytest.mark.gui


@pytest.fixture
def port(panel_engine_port):
    return panel_engine_port


def make_panel(qtbot, ctx=None):
    from app.context import AppContext
    from app.engine_panel import EnginePanel

    ctx = ctx or AppContext(load_settings(), hw())
    panel = EnginePanel(ctx)
    qtbot.addWidget(panel)
    panel.sup.grace_s = 5.0
    panel.show()
    return ctx, panel


def started(qtbot, ctx, panel) -> int:
    with qtbot.waitSignal(ctx.ownEngineChanged, timeout=60_000, check_params_cb=lambda r: r is not None):
        panel.start()
    return panel.sup.snapshot().pid


def test_start_with_this_plan_while_an_engine_runs_offers_a_restart_with_it(qtbot, port):
    from engine_manager.start_plan import default_plan

    ctx, panel = make_panel(qtbot)
    qtbot.waitUntil(lambda: not panel.tasks.running("run"), timeout=10_000)
    pid = started(qtbot, ctx, panel)
    plan, _ = default_plan("sim", ctx.settings)
    asked = []
    # "Not now": nothing changes, and it says so
    panel.ask_restart = lambda text, action: asked.append((text, action)) or False
    messages = []
    ctx.statusMessage.connect(lambda text, _ms: messages.append(text))
    ctx.startWithPlan.emit(plan)
    assert asked and asked[0][1] == "Restart with this plan" and "already running" in asked[0][0]
    assert panel._chosen_plan is None and any("Not restarted" in m for m in messages)
    assert panel.sup.snapshot().pid == pid
    # "Restart with this plan": stopped, then started again, with that plan taken
    panel.ask_restart = lambda text, action: asked.append((text, action)) or True
    ctx.startWithPlan.emit(plan)
    qtbot.waitUntil(lambda: panel.badge.text() == "Ready" and panel.sup.snapshot() is not None
                    and panel.sup.snapshot().pid != pid, timeout=90_000)
    assert len(asked) == 2 and panel._chosen_plan is None


def test_a_setting_that_needs_a_restart_asks_to_restart_while_the_engine_runs(qtbot, port):
    from app.settings_dialog import SettingsDialog

    ctx, panel = make_panel(qtbot)
    qtbot.waitUntil(lambda: not panel.tasks.running("run"), timeout=10_000)
    # engine stopped: saved, no question
    dlg = SettingsDialog(ctx)
    qtbot.addWidget(dlg)
    dlg.ask_restart = lambda text: pytest.fail("asked with no engine running")
    dlg.set_value("slots", 2)
    dlg.save()
    assert ctx.settings.slots == 2
    pid = started(qtbot, ctx, panel)
    # a setting that acts at once: no question either
    dlg = SettingsDialog(ctx)
    qtbot.addWidget(dlg)
    dlg.ask_restart = lambda text: pytest.fail("asked for a setting that needs no restart")
    dlg.set_value("metrics_hz", 2.0)
    dlg.save()
    # Slots 2 → 4 while it runs: "takes effect at the next start — restart now?"; yes restarts it with 4 slots
    dlg = SettingsDialog(ctx)
    qtbot.addWidget(dlg)
    asked = []
    dlg.ask_restart = lambda text: asked.append(text) or True
    dlg.set_value("slots", 4)
    dlg.save()
    assert asked and "Slots" in asked[0] and "next start" in asked[0] and "Restart it now?" in asked[0]
    qtbot.waitUntil(lambda: panel.badge.text() == "Ready" and panel.sup.snapshot() is not None
                    and panel.sup.snapshot().pid != pid, timeout=90_000)
    assert ctx.settings.slots == 4


def test_restart_needing_settings_are_declared_once_in_the_core():
    from engine_manager.settings import RESTART_FIELDS, Settings, restart_needed

    assert RESTART_FIELDS <= set(Settings.model_fields)
    assert {"slots", "context_length", "port", "kv_type"} <= RESTART_FIELDS
    assert not {"metrics_hz", "auto_restart", "hf_token"} & RESTART_FIELDS
    assert restart_needed(["metrics_hz", "slots"]) == [Settings.model_fields["slots"].title]


def test_a_relaunch_says_re_attaching_instead_of_stopped(qtbot, port):
    from app.context import AppContext
    from app.statusbar import LiveStatusBar

    ctx, panel = make_panel(qtbot)
    qtbot.waitUntil(lambda: not panel.tasks.running("run"), timeout=10_000)
    assert panel.badge.text() == "Stopped"          # nothing to re-attach to: no "Re-attaching…"
    pid = started(qtbot, ctx, panel)
    panel.ask_close_choice = lambda win: "leave"
    assert panel.confirm_close(None) is True
    panel.shutdown()
    qtbot.waitUntil(lambda: not panel.tasks.running("run"), timeout=10_000)
    # the next panel: its first words are "re-attaching", then Ready — never "Stopped" in between
    ctx2 = AppContext(load_settings(), hw())
    bar = LiveStatusBar(ctx2)
    qtbot.addWidget(bar)
    states, badges = [], []
    ctx2.engineStateChanged.connect(lambda ev: states.append(ev.state))
    with qtbot.waitSignal(ctx2.ownEngineChanged, timeout=60_000, check_params_cb=lambda r: r is not None):
        _, panel2 = make_panel(qtbot, ctx2)
        badges.append(panel2.badge.text())
    assert states[0] == "reattaching" and "stopped" not in states[:states.index("ready")]
    assert panel2.badge.text() == "Ready" and panel2.sup.snapshot().pid == pid
    assert LiveStatusBar.engine_text("reattaching") == "engine: re-attaching…"
    # a status bar built after the re-attach (the window's staged start builds it after the engine column) says
    # what the badge says, not the "stopped" it starts with
    late = LiveStatusBar(ctx2)
    qtbot.addWidget(late)
    assert late.engine_label.text() == LiveStatusBar.engine_text("ready") == bar.engine_label.text()


# -- the Getting-started wizard ---------------------------------------------------------------------------------
def _wizard(qtbot):
    from app.context import AppContext
    from app.first_run import FirstRunDialog

    dlg = FirstRunDialog(AppContext(load_settings()))
    qtbot.addWidget(dlg)
    return dlg


@pytest.mark.parametrize("how", ["finish", "close"])
def test_the_wizard_stays_away_once_finished_or_closed(qtbot, how):
    from app.context import AppContext
    from app.first_run import should_show

    ctx = AppContext(load_settings())
    assert should_show(ctx)                         # a fresh install: shown at the first start
    dlg = _wizard(qtbot)
    dlg.show()
    (dlg.accept if how == "finish" else dlg.reject)()
    assert not should_show(ctx)                     # … and not at the next ones


def test_the_wizard_comes_back_when_asked_to(qtbot):
    from app.context import AppContext
    from app.first_run import should_show

    dlg = _wizard(qtbot)
    dlg.show()
    dlg.dont_show.setChecked(False)                 # "show it at every start"
    dlg.reject()
    assert should_show(AppContext(load_settings()))
    assert not _wizard(qtbot).dont_show.isChecked()  # the choice is remembered


def test_every_wizard_page_says_its_whole_subtitle(qtbot):
    from PySide6.QtWidgets import QLabel

    dlg = _wizard(qtbot)
    dlg.resize(880, 560)
    dlg.show()
    qtbot.waitExposed(dlg)
    for i in dlg.pageIds():
        while dlg.currentId() != i:
            dlg.next()
        qtbot.wait(10)
        sub = dlg.page(i).subTitle()
        shown = [lab for lab in dlg.findChildren(QLabel) if lab.isVisible() and lab.text() == sub]
        assert shown, f"page {i}: its subtitle is not shown"
        for lab in shown:
            assert lab.heightForWidth(lab.width()) <= lab.height(), f"page {i}: the subtitle is cut: {sub!r}"
