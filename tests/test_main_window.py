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
    assert [window.tabs.tabText(i) for i in range(window.tabs.count())] == ["Monitor", "Placement", "Downloads",
                                                                            "Log", "Benchmark"]
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


# -- start-up -----------------------------------------------------------------------------------
ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent
HEAVY = ("pyqtgraph", "numpy", "superqt", "httpx", "engine_manager.supervisor", "engine_manager.metrics")


def _run_panel(args, timeout=90):
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("DSV41_UNDER_XVFB", None)
    return subprocess.run([sys.executable, "-m", "app", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


# the end of every window script below: show the window, give up after a minute, run the loop
# what the staged-start scripts begin with: an application, the window's parts, the settings reader
WINDOW_SCRIPT_START = ("import sys\nfrom PySide6.QtCore import QTimer\nfrom PySide6.QtWidgets import QApplication\n"
                       "app = QApplication([sys.argv[0]])\nfrom app.context import AppContext\n"
                       "from app.main_window import MainWindow\nfrom engine_manager.settings import load_settings\n")
WINDOW_SCRIPT_END = "win.show()\nQTimer.singleShot(60000, app.quit)\napp.exec()\n"


def _run_window_script(script):
    """Run ``script`` (a file written by the test) in a fresh interpreter with this checkout on the path."""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=90)


@pytest.mark.parametrize("seconds", ["0", "0.05", "0.2"])
def test_quit_after_at_start_up_quits(seconds):
    """`dsv41-panel --quit-after 0` (or any quit in the first ~0.2 s, before the pages are built) used to hang
    forever; it must exit 0 promptly. (A fresh config: no model, so the first-run wizard would want to show.)"""
    import subprocess

    try:
        p = _run_panel(["--quit-after", seconds], timeout=60)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"dsv41-panel --quit-after {seconds} did not exit within 60 s: {exc.stdout!r} {exc.stderr!r}")
    assert p.returncode == 0, p.stdout + p.stderr
    # a quit while the page build's workers still ran let Python tear their signal objects down under them
    # ("Signal source has been deleted", then SIGSEGV in CI): every worker ends before the process does
    assert "Traceback" not in p.stderr and "Signal source has been deleted" not in p.stderr, p.stderr


def test_quit_after_is_not_blocked_by_the_first_run_wizard():
    """With no model the Getting-started wizard shows at start-up; `--quit-after` is for automation, so the wizard
    stays closed and the panel quits on time (the wizard used to keep it running)."""
    import subprocess

    try:
        p = _run_panel(["--quit-after", "2.5", "--report-startup"], timeout=60)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the panel did not quit: {exc.stdout!r} {exc.stderr!r}")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "startup shown_at=" in p.stdout and "startup built_at=" in p.stdout, p.stdout + p.stderr


def test_the_window_is_painted_before_the_heavy_pages_are_imported(tmp_path):
    """The window appears first: at its first paint none of the pages' heavy imports (pyqtgraph, numpy, superqt,
    httpx, the supervisor, the metrics) has been made; the pages are built right after, in place of their
    placeholders, and the menus get their actions."""

    script = tmp_path / "lazy.py"
    script.write_text(
        "import sys\n"
        "from PySide6.QtCore import QEvent, QObject, QTimer\n"
        "from PySide6.QtWidgets import QApplication, QWidget\n"
        "app = QApplication([sys.argv[0]])\n"
        "from app.context import AppContext\n"
        "from app.main_window import MainWindow\n"
        "from engine_manager.settings import load_settings\n"
        "win = MainWindow(AppContext(load_settings()), lazy=True, show_first_run=False)\n"
        f"HEAVY = {HEAVY!r}\n"
        "class F(QObject):\n"
        "    def eventFilter(self, obj, ev):\n"
        "        if ev.type() == QEvent.Type.Paint and isinstance(obj, QWidget) and obj.window() is win:\n"
        "            app.removeEventFilter(self)\n"
        "            print('at paint: built', win.built, 'heavy', [m for m in HEAVY if m in sys.modules], flush=True)\n"
        "        return False\n"
        "f = F(app); app.installEventFilter(f)\n"
        "def built():\n"
        "    names = [a.objectName() for a in win.menuBar().actions()[0].menu().actions()]\n"
        "    print('built: tabs', [type(win.tabs.widget(i)).__name__ for i in range(win.tabs.count())],\n"
        "          'export' , 'actionExportMetrics' in names, flush=True)\n"
        "    win.close(); app.quit()\n"
        "win.pagesBuilt.connect(lambda: QTimer.singleShot(0, built))\n"
        + WINDOW_SCRIPT_END)
    p = _run_window_script(script)
    out = p.stdout + p.stderr
    assert "at paint: built False heavy []" in p.stdout, out
    assert "built: tabs ['MonitorView', 'PlacementView', 'DownloadPanel', 'LogView', 'BenchView'] export True" \
        in p.stdout, out


def test_the_engine_column_imports_no_http_client_numpy_or_metrics_parser():
    """The engine column is part of the staged start's first step: its imports (the engine panel, the supervisor,
    the engines, the context) leave httpx (~70 ms), numpy (~60 ms, the GGUF header reader's) and prometheus_client
    (~40 ms) to the first use that needs them."""
    import subprocess
    import sys

    code = ("import sys\n"
            "import app.engine_panel, app.context, engine_manager.supervisor, engine_manager.session\n"
            "print('loaded', sorted(m for m in ('httpx', 'numpy', 'prometheus_client') if m in sys.modules))\n"
            "from engine_manager import gguf_header\n"
            "from engine_manager.engines import prometheus_text\n"
            "print('parsed', prometheus_text.by_series('a_b 1\\n'), len(gguf_header._shifts()))\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "loaded []" in p.stdout, p.stdout
    # imported on first use, and then they work
    assert "parsed {'a_b': 1.0} 65" in p.stdout, p.stdout


def test_the_staged_start_builds_what_is_on_screen_first(tmp_path):
    """The panel's own start: the engine column and the page on screen (here the Log tab, remembered from the
    last session) are built and painted first, while the chat pane and the other pages still wait; choosing a
    waiting tab builds it at once; the rest follow one per pass of the event loop, and every built panel is shut
    down on close."""

    script = tmp_path / "staged.py"
    script.write_text(
        "import sys\n"
        "from PySide6.QtCore import QTimer\n"
        "from PySide6.QtWidgets import QApplication\n"
        "app = QApplication([sys.argv[0]])\n"
        "from engine_manager import uistate\n"
        "uistate.save({'main_tab': 'Log'})\n"
        "from app.context import AppContext\n"
        "from app.main_window import MainWindow\n"
        "from engine_manager.settings import load_settings\n"
        "win = MainWindow(lambda: AppContext(load_settings()), lazy=True, show_first_run=False)\n"
        "def first():\n"
        "    print('first:', sorted(win.pages), win._engine_panel is not None, win._chat_pane is None,\n"
        "          win.built, flush=True)\n"
        "    win.show_tab('Placement')\n"
        "    print('chosen:', sorted(win.pages), type(win.tabs.currentWidget()).__name__, flush=True)\n"
        "win.firstPageShown.connect(first)\n"
        "def built():\n"
        "    print('built:', sorted(win.pages), win._chat_pane is not None, flush=True)\n"
        "    names = [type(p).__name__ for p in win.panels()]\n"
        "    print('panels:', names, flush=True)\n"
        "    win.close(); app.quit()\n"
        "win.pagesBuilt.connect(lambda: QTimer.singleShot(0, built))\n"
        + WINDOW_SCRIPT_END)
    p = _run_window_script(script)
    out = p.stdout + p.stderr
    assert "first: ['Log'] True True False" in p.stdout, out
    assert "chosen: ['Log', 'Placement'] PlacementView" in p.stdout, out
    assert "built: ['Benchmark', 'Downloads', 'Log', 'Monitor', 'Placement'] True" in p.stdout, out
    assert "panels: ['ChatPane', 'LogView', 'PlacementView'" in p.stdout and "'EnginePanel']" in p.stdout, out


def test_the_monitor_on_screen_takes_input_before_its_plots_and_pyqtgraph(tmp_path):
    """The staged start with the Monitor on screen (a first start): the engine column and the Monitor's bar and
    cards are built and painted, and take a click, before pyqtgraph or numpy is imported (~0.5 s of the first step
    with the six plots, benchmarks/results/startup.md); the plots replace their placeholder in the next step
    (``firstPageDone``)."""

    script = tmp_path / "monitor_first.py"
    script.write_text(
        WINDOW_SCRIPT_START +
        "win = MainWindow(lambda: AppContext(load_settings()), lazy=True, show_first_run=False)\n"
        "def first():\n"
        "    page = win.pages['Monitor']\n"
        "    print('first:', win.tabs.currentWidget() is page, page.plots_built,\n"
        "          [m for m in ('pyqtgraph', 'numpy') if m in sys.modules], flush=True)\n"
        "    print('column:', win._engine_panel.isVisible(), win._engine_placeholder.isVisible(), flush=True)\n"
        "    page.pause_btn.click()\n"
        "    print('clicked:', page.paused, page.plots_placeholder.isVisible(), flush=True)\n"
        "    page.pause_btn.click()\n"
        "win.firstPageShown.connect(first)\n"
        "def done():\n"
        "    page = win.pages['Monitor']\n"
        "    print('done:', page.plots_built, page.glw.isVisible(), len(page.plots), 'pyqtgraph' in sys.modules,\n"
        "          flush=True)\n"
        "    win.close(); app.quit()\n"
        "win.firstPageDone.connect(done)\n"
        + WINDOW_SCRIPT_END)
    p = _run_window_script(script)
    out = p.stdout + p.stderr
    assert "first: True False []" in p.stdout, out
    assert "column: True False" in p.stdout, out        # the engine column is in that first paint, not "Loading…"
    assert "clicked: True True" in p.stdout, out
    assert "done: True True 6 True" in p.stdout, out


def test_the_first_step_needs_no_pydantic_even_with_saved_connections(tmp_path):
    """The staged start's first step — the settings read, the engine column, the Monitor's bar and cards — imports
    no pydantic (its import with the models' build was ~0.25 s of that step, benchmarks/results/startup.md): the
    settings are checked by ``engine_manager.settings`` itself, a saved connections' list is read in a later step,
    and the supervisor (the state file's model) is made by the first task that needs it, on its own thread. The
    picker offers this panel's engine meanwhile; the list is there once the pages are built. Nor does it import
    what only a running engine needs (the supervisor's events, the hardware probe and NUMA, the checks, the GGUF
    readers, subprocess: 40–60 ms of that step, ``python -X importtime``)."""
    from engine_manager import connections as C

    C.add_connection("lab", "http://127.0.0.1:9")
    script = tmp_path / "no_pydantic.py"
    script.write_text(
        WINDOW_SCRIPT_START +
        "from engine_manager.session import EngineSession\n"
        "def ctx():\n"
        "    loaded = load_settings()\n"
        "    return AppContext(loaded, session=EngineSession(loaded.settings))\n"
        "win = MainWindow(ctx, lazy=True, show_first_run=False)\n"
        "def first():\n"
        "    view = win._engine_panel.connections\n"
        "    print('first:', 'pydantic' in sys.modules, view.list_read, view.names(), view.picker.count(),\n"
        "          view.remove_button.isEnabled(), win.ctx.session._supervisor is None, flush=True)\n"
        "    later = ('engine_manager.supervisor_events', 'engine_manager.hardware', 'engine_manager.numa',\n"
        "             'engine_manager.checks', 'engine_manager.gguf_split', 'subprocess')\n"
        "    print('loaded early:', [m for m in later if m in sys.modules], flush=True)\n"
        "win.firstPageShown.connect(first)\n"
        "def built():\n"
        "    view = win._engine_panel.connections\n"
        "    print('built:', view.list_read, view.names(), view.picker.count(), flush=True)\n"
        "    win.close(); app.quit()\n"
        "win.pagesBuilt.connect(built)\n"
        + WINDOW_SCRIPT_END)
    p = _run_window_script(script)
    out = p.stdout + p.stderr
    assert "first: False False [] 1 False True" in p.stdout, out     # this panel's engine alone, meanwhile
    assert "loaded early: []" in p.stdout, out
    assert "built: True ['lab'] 2" in p.stdout, out


def test_the_start_button_stays_where_it_was_first_painted_when_the_report_and_the_list_come(tmp_path):
    """The hardware probe's report and the saved connections' list come after the first paint; the heights they
    took at the last start are kept until then, so the engine column's Start is not moved down under a click
    (it moved ~75 px at 1280×800: the banner grew from one line to four, the overview by a line a connection)."""
    from engine_manager import connections as C

    C.add_connection("lab", "http://127.0.0.1:9")
    script = tmp_path / "start_stays.py"
    script.write_text(
        WINDOW_SCRIPT_START +
        "from PySide6.QtCore import QPoint\n"
        "from engine_manager.session import EngineSession\n"
        "def ctx():\n"
        "    loaded = load_settings()\n"
        "    return AppContext(loaded, session=EngineSession(loaded.settings))\n"
        "win = MainWindow(ctx, lazy=True, show_first_run=False)\n"
        "win.resize(1280, 800)\n"
        "def start_y():\n"
        "    return win._engine_panel.start_button.mapTo(win, QPoint(0, 0)).y()\n"
        "win.firstPageShown.connect(lambda: print('first:', start_y(), flush=True))\n"
        "def settled():\n"
        "    for _ in range(3):\n"
        "        app.sendPostedEvents()\n"
        "    names = win._engine_panel.connections.names()\n"
        "    print('settled:', start_y(), win.ctx.hardware is not None, names, flush=True)\n"
        "    win.close(); app.quit()\n"
        "def report(_r=None):\n"
        "    QTimer.singleShot(0, settled)\n"
        "def built():\n"
        "    if win.ctx.hardware is not None:\n"
        "        report()\n"
        "    else:\n"
        "        win.ctx.hardwareChanged.connect(report)\n"
        "win.pagesBuilt.connect(built)\n"
        + WINDOW_SCRIPT_END)
    first = _run_window_script(script)                       # no heights kept yet: this start keeps them
    assert "settled:" in first.stdout, first.stdout + first.stderr
    p = _run_window_script(script)
    out = p.stdout + p.stderr
    ys = {line.split()[0]: line.split()[1] for line in p.stdout.splitlines() if line.startswith(("first:", "settled:"))}
    assert "True ['lab']" in p.stdout, out                   # the report and the list did come
    assert ys["first:"] == ys["settled:"], out


@pytest.mark.parametrize("kept, banner", [({"banner": 84, "watching": 146}, 84), ({"banner": 10**9}, 0)])
def test_kept_column_heights_reserve_the_banner_only_when_sane(qtbot, kept, banner):
    """The banner keeps its last start's height until the probe's report comes; a height no window has
    (``uistate.column_heights`` leaves it out) reserves nothing."""
    from app.main_window import MainWindow
    from engine_manager import uistate

    uistate.save({"column_heights": kept})
    win = MainWindow(lambda: None, lazy=True, show_first_run=False)
    qtbot.addWidget(win)
    assert win.banner.minimumHeight() == banner


def test_cheaper_pyside_check_gives_pyside6s_own_answers():
    """app.pyside_hook answers "does this module use PySide6?" as PySide6's own check does, for every module
    loaded (the window's modules included)."""
    import sys

    import PySide6.QtCore  # noqa: F401

    import app.main_window  # noqa: F401
    from app import pyside_hook

    feature = sys.modules.get("shibokensupport.feature") or sys.modules.get("PySide6.support.feature")
    if feature is None:
        pytest.skip("this PySide6 has no feature module")
    before = feature._mod_uses_pyside
    original = getattr(before, "__wrapped__", before)
    pyside_hook.install()
    cheap = feature._mod_uses_pyside
    assert getattr(cheap, "dsv41_cheap", False)
    assert pyside_hook.install() is False                   # once only
    checked = [(name, m) for name, m in list(sys.modules.items()) if m is not None]
    assert len(checked) > 100
    differ = [name for name, m in checked if bool(original(m)) != cheap(m)]
    assert differ == []
    assert cheap(sys.modules["app.main_window"]) is True and cheap(sys.modules["json"]) is False


def test_page_attributes_build_a_lazy_window_on_first_use(qtbot):
    from app.context import AppContext
    from app.main_window import MainWindow
    from engine_manager.settings import load_settings

    win = MainWindow(AppContext(load_settings()), lazy=True, show_first_run=False)
    qtbot.addWidget(win)
    assert not win.built
    assert type(win.monitor_view).__name__ == "MonitorView" and win.built
    assert win.tabs.widget(0) is win.monitor_view and win.splitter.widget(2) is win.chat_pane
    win.close()


# -- text that is not cut off ------------------------------------------------------------------
def test_log_view_opens_at_the_start_of_its_lines_and_wraps(qtbot):
    """The Log tab used to open scrolled to the right (the cursor at the end of the last, long line), every line's
    start cut off, with no wrapping. Now: wrapped, the view at the left edge and at the newest line; Wrap off
    gives one row per line, still starting at the left."""
    from app.context import AppContext
    from app.log_view import LogView
    from engine_manager.settings import load_settings
    from engine_manager.logtail import log_path

    path = log_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"[{i:04d}] phase: loading expert shard {i} " + "x" * 300 + f" end-of-line-{i}" for i in range(200)]
    path.write_text("\n".join(lines) + "\n")
    view = LogView(AppContext(load_settings()))
    qtbot.addWidget(view)
    view.resize(700, 400)
    view.show()
    qtbot.waitExposed(view)
    qtbot.waitUntil(lambda: view.line_count() >= 200, timeout=10_000)
    qtbot.wait(50)
    text = view.text
    assert text.lineWrapMode() == text.LineWrapMode.WidgetWidth and view.wrap.isChecked()
    assert text.horizontalScrollBar().value() == 0
    vbar = text.verticalScrollBar()
    assert vbar.value() == vbar.maximum() and vbar.maximum() > 0           # following: the newest line in view
    view.wrap.setChecked(False)
    qtbot.wait(50)
    assert text.lineWrapMode() == text.LineWrapMode.NoWrap
    hbar = text.horizontalScrollBar()
    assert hbar.maximum() > 0 and hbar.value() == 0                         # long lines, shown from their start
    view.append_lines(["another " + "y" * 400])
    assert hbar.value() == 0 and vbar.value() == vbar.maximum()


def test_log_follow_survives_lines_on_another_tab_and_into_an_empty_log_and_only_the_user_turns_it_off(qtbot):
    """Follow keeps the newest line in view until the user scrolls. Before, every move of the scroll bar that the
    view had not made itself counted as the user's: the first lines into an empty log, and lines arriving while
    another page was on screen, turned Follow off. Lines that arrive on another tab are not followed there (going
    to the end laid the text out for nobody: two thirds of an append's cost); shown, the page is at the newest line,
    from its start."""
    from PySide6.QtCore import Qt
    from PySide6.QtWidgets import QAbstractSlider, QLabel, QTabWidget

    from app.context import AppContext
    from app.log_view import LogView
    from engine_manager.settings import load_settings

    tabs = QTabWidget()
    qtbot.addWidget(tabs)
    tabs.resize(700, 400)
    tabs.addTab(QLabel("the Monitor"), "Monitor")
    view = LogView(AppContext(load_settings()))           # no log file yet: an empty log
    tabs.addTab(view, "Log")
    tabs.setCurrentIndex(1)
    tabs.show()
    qtbot.waitExposed(tabs)
    qtbot.waitUntil(lambda: bool(view.path_label.text()) and not view._loading, timeout=10_000)   # file read
    vbar = view.text.verticalScrollBar()
    view.append_lines([f"first line {i} " + "x" * 200 for i in range(60)])
    qtbot.waitUntil(lambda: vbar.value() == vbar.maximum() > 0, timeout=5_000)
    assert view.follow.isChecked()
    tabs.setCurrentIndex(0)
    qtbot.waitUntil(lambda: not view.isVisible(), timeout=5_000)
    value = vbar.value()
    for i in range(40):
        view.append_lines([f"line {i} " + "y" * 300, "READY"])
    assert view.line_count() >= 140 and view.follow.isChecked()
    tabs.setCurrentIndex(1)
    qtbot.waitUntil(lambda: vbar.value() == vbar.maximum() and vbar.value() > value, timeout=5_000)
    assert view.text.horizontalScrollBar().value() == 0 and view.follow.isChecked()
    vbar.triggerAction(QAbstractSlider.SliderAction.SliderPageStepSub)     # the user clicks above the handle
    assert not view.follow.isChecked()
    up = vbar.value()
    view.append_lines(["after the user looked back"])
    assert vbar.value() == up                              # the view stays where the user is ...
    qtbot.wait(50)
    assert not view.follow.isChecked()                     # ... and Qt laying the text out does not follow again
    vbar.triggerAction(QAbstractSlider.SliderAction.SliderToMaximum)
    assert view.follow.isChecked()
    view.text.setFocus()                                   # the keys start from the newest line
    qtbot.waitUntil(lambda: view.text.textCursor().blockNumber() == view.text.blockCount() - 1, timeout=5_000)
    qtbot.keyClick(view.text, Qt.Key.Key_PageUp)
    qtbot.waitUntil(lambda: not view.follow.isChecked(), timeout=5_000)
    assert vbar.value() < vbar.maximum()
    qtbot.keyClick(view.text, Qt.Key.Key_End, Qt.KeyboardModifier.ControlModifier)
    qtbot.waitUntil(view.follow.isChecked, timeout=5_000)


def test_settings_dialog_shows_every_setting_without_scrolling(qtbot):
    """It showed ~12 rows in a small scroll area; on a 1600×1000 screen every setting is in view."""
    from app.context import AppContext
    from app.settings_dialog import SettingsDialog
    from engine_manager.settings import load_settings

    dlg = SettingsDialog(AppContext(load_settings()))
    qtbot.addWidget(dlg)
    dlg.show()
    qtbot.waitExposed(dlg)
    assert dlg.scroll.verticalScrollBar().maximum() == 0, "the form scrolls"
    assert dlg.scroll.horizontalScrollBar().maximum() == 0, "the form scrolls sideways"
    for name, editor in dlg.editors.items():
        top_left = editor.mapTo(dlg, editor.rect().topLeft())
        assert dlg.rect().contains(top_left), name


def test_locked_setting_says_why_on_screen(qtbot, monkeypatch):
    """A setting fixed by the environment was only greyed: it now says which variable fixes it, under the field and
    in its tooltip, and how to change it."""
    monkeypatch.setenv("DSV41_SLOTS", "3")
    from app.context import AppContext
    from app.settings_dialog import SettingsDialog
    from engine_manager.settings import load_settings

    dlg = SettingsDialog(AppContext(load_settings()))
    qtbot.addWidget(dlg)
    dlg.show()
    qtbot.waitExposed(dlg)
    note = dlg.locked_notes["slots"]
    assert note.isVisible() and "DSV41_SLOTS" in note.text()
    tip = dlg.editors["slots"].toolTip()
    assert tip.startswith("Locked: set by DSV41_SLOTS") and "Unset DSV41_SLOTS" in tip
    assert "default_max_tokens" not in dlg.locked_notes


def test_downloads_progress_header_is_whole_in_a_narrow_tab(qtbot):
    """At 1280×800 the fixed columns took the stretching Progress column's room: its header read "ogre". The tab
    as narrow as it can be made still shows the whole header."""
    from app.context import AppContext
    from app.download_panel import DownloadPanel
    from engine_manager.settings import load_settings

    panel = DownloadPanel(AppContext(load_settings()))
    qtbot.addWidget(panel)
    panel.resize(560, 700)                     # what the Downloads tab got in a 1280-px window
    panel.show()
    qtbot.waitExposed(panel)
    qtbot.wait(50)
    hh = panel.table.horizontalHeader()
    assert hh.sectionSize(2) >= hh.fontMetrics().horizontalAdvance("Progress") + 8, hh.sectionSize(2)
    panel.shutdown()
