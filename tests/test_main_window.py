"""The main window under a real X server (pytest-xvfb): it opens in its final arrangement, the settings dialog
refuses a bad value and saves a good one, and geometry/splitter sizes survive a restart."""

from __future__ import annotations

import json
import os
import stat

import pytest

pytestmark = pytest.mark.gui


@pytest.fixture
def window(qtbot):
    from app.context import AppContext
    from app.main_window import MainWindow
    from engine_manager.settings import load_settings

    ctx = AppContext(load_settings())
    win = MainWindow(ctx)
    qtbot.addWidget(win)
    win.show()
    qtbot.waitExposed(win)
    yield win
    win.close()


def test_window_opens_with_its_parts(window, qtbot):
    assert os.environ.get("DISPLAY"), "pytest-xvfb should provide a real X display"
    assert window.tabs.count() == 4
    assert [window.tabs.tabText(i) for i in range(4)] == ["Monitor", "Placement", "Downloads", "Log"]
    assert window.splitter.count() == 3
    # the probe runs off the GUI thread and fills the banner
    qtbot.waitUntil(lambda: window.ctx.hardware is not None, timeout=15000)
    if not window.ctx.hardware.has_gpu:
        assert "No NVIDIA GPU found" in window.banner.text()
    menus = [a.text().replace("&", "") for a in window.menuBar().actions()]
    assert menus[:4] == ["File", "Engine", "View", "Help"]


def test_settings_dialog_refuses_bad_and_saves_good(window, qtbot):
    from app.settings_dialog import SettingsDialog

    dlg = SettingsDialog(window.ctx, window)
    qtbot.addWidget(dlg)
    dlg.set_value("default_max_tokens", -5)
    dlg.save()
    assert "default_max_tokens" in dlg.error_label.text() and "1 to 1048576" in dlg.error_label.text()
    assert window.ctx.settings.default_max_tokens == 4096
    dlg.set_value("default_max_tokens", 2048)
    dlg.set_value("slots", 4)
    got = []
    window.ctx.settingsChanged.connect(got.append)
    dlg.save()
    assert dlg.result() == dlg.DialogCode.Accepted
    assert window.ctx.settings.default_max_tokens == 2048 and window.ctx.settings.slots == 4
    assert got, "settingsChanged was emitted"
    path = window.ctx.loaded.path
    saved = json.loads(path.read_text())
    assert saved["default_max_tokens"] == 2048 and saved["slots"] == 4
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_env_locked_setting_is_disabled(qtbot, monkeypatch):
    monkeypatch.setenv("DSV41_SLOTS", "3")
    from app.context import AppContext
    from app.settings_dialog import SettingsDialog
    from engine_manager.settings import load_settings

    ctx = AppContext(load_settings())
    dlg = SettingsDialog(ctx)
    qtbot.addWidget(dlg)
    assert not dlg.editors["slots"].isEnabled()
    assert "DSV41_SLOTS" in dlg.editors["slots"].toolTip()


def test_geometry_and_splitter_survive_restart(qtbot):
    from app.context import AppContext
    from app.main_window import MainWindow
    from engine_manager.settings import load_settings

    win = MainWindow(AppContext(load_settings()))
    qtbot.addWidget(win)
    win.show()
    qtbot.waitExposed(win)
    win.resize(1200, 760)
    win.splitter.setSizes([300, 500, 300])
    sizes = win.splitter.sizes()
    win.close()
    win2 = MainWindow(AppContext(load_settings()))
    qtbot.addWidget(win2)
    win2.show()
    qtbot.waitExposed(win2)
    assert (win2.width(), win2.height()) == (1200, 760)
    assert win2.splitter.sizes() == sizes
    win2.close()
