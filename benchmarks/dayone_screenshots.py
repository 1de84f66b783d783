"""Pictures of what a new user sees on a 1280×800 screen, taken the way a user's desktop shows them: a 1280×800
X server with a window manager (Xvfb + openbox), the screen grabbed with ImageMagick's
``import -window root`` (window frame and all).

In temporary config/data folders: two quick benchmark runs of the scripted engine (for the Compare table), then
the scripted engine started (``dsv41 start``) and the panel opened on it (it re-attaches), a long chat streaming
("600 words"), and pictures of the Monitor, the Benchmark tab's Compare table, the Getting-started wizard's model
step, the dark theme, the crash banner (the engine restarted with a simulated CUDA out-of-memory at load), and the
Log tab (the times of the lines that arrived meanwhile). ``dsv41 settings show`` is saved beside them as text.
The engine is stopped at the end.

Run: ``.venv/bin/python benchmarks/dayone_screenshots.py [--out benchmarks/results/gui]``
(needs Xvfb and ImageMagick's ``import``; openbox, when present, frames the window as a desktop would).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine_manager.sim.launch import free_port  # noqa: E402

SIZE = "1280x800"


def run_cli(*args: str, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine_manager", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def start_display(size: str) -> tuple[str, list[subprocess.Popen]]:
    r, w = os.pipe()
    xvfb = subprocess.Popen(["Xvfb", "-displayfd", str(w), "-screen", "0", f"{size}x24", "-nolisten", "tcp"],
                            pass_fds=(w,), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(w)
    with os.fdopen(r) as f:
        display = ":" + f.readline().strip()
    procs = [xvfb]
    if shutil.which("openbox"):
        procs.append(subprocess.Popen(["openbox"], env=dict(os.environ, DISPLAY=display),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(1.0)
    return display, procs


def gui(out: Path) -> int:
    """In the X server's process environment (DISPLAY set): the panel as ``dsv41-panel`` builds it, driven by
    timers, the screen grabbed at each step."""
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication

    app = QApplication([sys.argv[0]])
    app.setApplicationName("dsv41 panel")
    from app.context import AppContext
    from app.main_window import MainWindow
    from engine_manager.session import EngineSession
    from engine_manager.settings import load_settings

    loaded = load_settings()
    win = MainWindow(lambda: AppContext(loaded, session=EngineSession(loaded.settings)), lazy=True,
                     show_first_run=False)
    win.ask_on_close = False
    win.show()
    steps: list[tuple[float, object]] = []
    said: list[str] = []

    def shot(name: str) -> None:
        app.processEvents()
        path = out / name
        subprocess.run(["import", "-window", "root", str(path)], check=False, env=os.environ)
        g, fg = win.geometry(), win.frameGeometry()
        said.append(f"{name}: window {g.width()}×{g.height()} at {g.x()},{g.y()}, frame {fg.width()}×{fg.height()}")
        print(said[-1], flush=True)

    def chat() -> None:
        if win.ctx is None or win.ctx.own is None:          # not re-attached yet
            QTimer.singleShot(500, chat)
            return
        win.chat_pane.send("Write 600 words about how the experts are offloaded between the GPU and RAM.")

    def bench() -> None:
        win.show_tab("Benchmark")
        view = win.pages["Benchmark"]
        view.pages.setCurrentIndex(1)
        view.refresh_history()

    def compare() -> None:
        win.pages["Benchmark"].compare()

    def wizard() -> None:
        from app import first_run
        dlg = first_run.open_dialog(win)
        dlg.next()

    def close_wizard() -> None:
        if win.first_run_dialog is not None:
            win.first_run_dialog.close()

    def crash() -> None:
        win.ctx.update_settings({"sim_args": "--load-time 0.5 --fail-at-load cuda-oom"})
        win.engine_panel.ask_restart = lambda text, action: True
        win.ctx.requestRestart.emit()

    steps = [
        (3, chat), (30, lambda: shot("dayone_1280x800.png")),
        (31, bench), (35, compare), (37, lambda: shot("dayone_bench_compare.png")),
        (38, wizard), (41, lambda: shot("dayone_wizard_step2.png")), (42, close_wizard),
        (43, lambda: (win.show_tab("Monitor"), win.set_theme("dark"))), (46, lambda: shot("dayone_dark.png")),
        (47, lambda: win.set_theme("auto")),
        (48, crash), (66, lambda: shot("dayone_crash_banner.png")),
        (67, lambda: win.show_tab("Log")), (69, lambda: shot("dayone_log_times.png")),
        (70, lambda: (win.close(), app.quit())),
    ]
    for t, fn in steps:
        QTimer.singleShot(int(t * 1000), fn)
    app.exec()
    (out / "dayone_screenshots.txt").write_text("\n".join(said) + "\n")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gui"))
    p.add_argument("--gui", action="store_true", help=argparse.SUPPRESS)    # the inner run, on the X server
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.gui:
        return gui(out)
    for tool in ("Xvfb", "import"):
        if not shutil.which(tool):
            print(f"{tool} is missing (apt-get install xvfb imagemagick openbox)", file=sys.stderr)
            return 2
    tmp = Path(tempfile.mkdtemp(prefix="dsv41-dayone-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_")}
    env.update(DSV41_CONFIG_DIR=str(tmp / "config"), DSV41_DATA_DIR=str(tmp / "data"),
               DSV41_CACHE_DIR=str(tmp / "cache"), DSV41_SERVER_ENGINE="sim", DSV41_PORT=str(free_port("127.0.0.1")),
               PYTHONPATH=str(ROOT))
    # two quick benchmark runs (the Compare table), then the engine the panel re-attaches to
    for i in (1, 2):
        r = run_cli("bench", "--quick", "--users", "1,2", "--repeats", "1", "--tokens", "32", "--long-prompt", "0",
                    "--no-ab", env=dict(env, DSV41_SIM_ARGS="--load-time 0.3 --speed 4"))
        print(f"bench {i}: rc {r.returncode}", r.stderr.strip().splitlines()[-1:] if r.returncode else "", flush=True)
    run_cli("settings", "set", "sim_args", "--load-time 0.5", env=env)     # in the file: the GUI changes it later
    (out / "dayone_settings_show.txt").write_text(run_cli("settings", "show", env=env).stdout)
    r = run_cli("start", env=env)
    print("start:", r.returncode, flush=True)
    display, procs = start_display(SIZE)
    try:
        genv = dict(env, DISPLAY=display, QT_QPA_PLATFORM="xcb")
        genv.pop("WAYLAND_DISPLAY", None)
        rc = subprocess.run([sys.executable, __file__, "--gui", "--out", str(out)], env=genv, cwd=ROOT,
                            timeout=300).returncode
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(10)
        run_cli("stop", env=env)
        shutil.rmtree(tmp, ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
