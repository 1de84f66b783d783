"""The first window on a small screen (1280×800): it fits the screen's available area with the chat's input and
Send/Stop in view, and its size, position and splitter are remembered per screen.

The 1280×800 screen is a real one: an X server of that size started for the test (``Xvfb -screen 0 1280x800x24``),
with the panel's window made in a process of its own on it; the in-process tests use the X server pytest-xvfb
starts (1600×1000) and a fixed available geometry where they are about fitting."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gui
ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys
from PySide6.QtWidgets import QApplication
app = QApplication(sys.argv)
from engine_manager.settings import load_settings
from app.context import AppContext
from app.main_window import MainWindow
win = MainWindow(AppContext(load_settings()), show_first_run=False)
win.ask_on_close = False
win.show()
for _ in range(50):
    app.processEvents()
avail = win.screen().availableGeometry()
def rect(w):
    p = w.mapTo(win, w.rect().topLeft())
    return {"x": p.x(), "y": p.y(), "w": w.width(), "h": w.height(), "visible": w.isVisible()}
cp = win.chat_pane
# a crash banner as long as the real ones (the words of a CUDA out-of-memory at load, with its fix)
b = win.engine_panel.banner
b.show_problem("The GPU ran out of memory (a VRAM allocation failed) — the engine said: CUDA error: out of memory: "
               "cudaMalloc failed while allocating the expert cache (71162 MiB)",
               "Lower the expert cache (fewer hot experts), the context length or the slots on the Placement tab, "
               "or raise --vram-reserve-mib; close other programs using the GPU (nvidia-smi shows them).",
               "The panel restarts it automatically (crash 3; it gives up after 5 within 10 min).")
for _ in range(50):
    app.processEvents()
labels = {n: (w.height(), w.heightForWidth(w.width())) for n, w in
          (("title", b.title), ("fix", b.fix), ("extra", b.extra))}
print(json.dumps({"avail": [avail.x(), avail.y(), avail.width(), avail.height()],
                  "window": [win.x(), win.y(), win.width(), win.height()],
                  "banner": labels,
                  "parts": {"composer": rect(cp.composer), "send": rect(cp.send_button), "stop": rect(cp.stop_button),
                            "start": rect(win.engine_panel.start_button)}}))
win.close()
"""


class SmallScreen:
    """An X server with one 1280×800 screen, for one test."""

    def __init__(self, size: str = "1280x800"):
        xvfb = shutil.which("Xvfb")
        if not xvfb:
            pytest.skip("Xvfb is not installed")
        r, w = os.pipe()
        self.proc = subprocess.Popen([xvfb, "-displayfd", str(w), "-screen", "0", f"{size}x24", "-nolisten", "tcp"],
                                     pass_fds=(w,), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(w)
        with os.fdopen(r) as f:
            self.display = ":" + f.readline().strip()

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def small_screen():
    scr = SmallScreen()
    yield scr
    scr.close()


def test_first_window_fits_a_1280x800_screen_with_send_and_stop_in_view_and_a_whole_crash_banner(small_screen):
    env = dict(os.environ, DISPLAY=small_screen.display, QT_QPA_PLATFORM="xcb",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("WAYLAND_DISPLAY", None)
    r = subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    ax, ay, aw, ah = got["avail"]
    assert (aw, ah) == (1280, 800)
    x, y, w, h = got["window"]
    assert ax <= x and ay <= y and x + w <= ax + aw and y + h <= ay + ah, got
    for name, (height, needed) in got["banner"].items():     # the crash banner's words whole, never squeezed
        assert height >= needed, (name, height, needed)
    for name, p in got["parts"].items():
        assert p["visible"], name
        # inside the window (so on the screen), whole
        assert 0 <= p["x"] and 0 <= p["y"] and p["x"] + p["w"] <= w and p["y"] + p["h"] <= h, (name, p, got)


def _window(qtbot):
    from app.context import AppContext
    from app.main_window import MainWindow
    from engine_manager.settings import load_settings

    win = MainWindow(AppContext(load_settings()), show_first_run=False)
    win.ask_on_close = False
    qtbot.addWidget(win)
    return win


def test_a_remembered_window_too_big_for_the_screen_is_fitted_again(qtbot):
    from PySide6.QtCore import QRect

    win = _window(qtbot)
    win.resize(1440, 900)
    win.move(0, 0)
    small = QRect(0, 0, 1280, 800)
    assert win.keep_on_screen(small)
    frame_w, frame_h = win._frame_extra()
    assert win.width() + frame_w <= 1280 and win.height() + frame_h <= 800
    assert small.contains(QRect(win.x(), win.y(), win.width() + frame_w, win.height() + frame_h))
    assert not win.keep_on_screen(small)            # fitted: left as it is


def test_window_size_and_splitter_are_remembered_per_screen(qtbot):
    from engine_manager import uistate

    win = _window(qtbot)
    win.show()
    qtbot.waitExposed(win)
    win.resize(1210, 700)
    win.splitter.setSizes([280, 500, 400])
    sizes = win.splitter.sizes()
    win.close()
    key = win.screen_key()
    assert uistate.window_state(key)["splitter"] == sizes

    win2 = _window(qtbot)                           # the same screen: as it was left
    win2.show()
    qtbot.waitExposed(win2)
    assert (win2.width(), win2.height()) == (1210, 700) and win2.splitter.sizes() == sizes
    win2.close()

    # what was saved belongs to another screen now (another monitor, or this one at another resolution): this
    # screen's window is fitted afresh, the other screen's state is kept for it
    st = uistate.load()
    st[uistate.WINDOWS_KEY] = {"HDMI-9:3840x2160": st[uistate.WINDOWS_KEY][key]}
    st["main_screen"] = "HDMI-9:3840x2160"
    uistate.atomic_write_json(uistate.state_file(), st)
    win3 = _window(qtbot)
    assert (win3.width(), win3.height()) != (1210, 700)
    avail = win3.screen().availableGeometry()
    assert win3.width() <= avail.width() and win3.height() <= avail.height()


def test_fit_rect_centres_a_window_within_the_available_area():
    from engine_manager.uistate import fit_rect

    assert fit_rect((1440, 900), (0, 0, 1280, 800), (0, 32)) == (0, 0, 1280, 768)
    assert fit_rect((1000, 600), (0, 0, 1600, 1000), (0, 0)) == (300, 200, 1000, 600)
    assert fit_rect((1440, 900), (1920, 24, 1280, 776), (2, 30)) == (1920, 24, 1278, 746)   # a second screen, a panel
