"""Pictures of attaching to your own engine and of the Monitor on a 1280×800 screen, taken as a user's desktop
shows them (Xvfb + openbox, the screen grabbed with ImageMagick's ``import -window root``), the way
``benchmarks/dayone_screenshots.py`` takes its pictures.

In temporary config/data folders: the scripted engine started (``dsv41 start``), the panel opened on it (it
re-attaches) with a chat streaming, then

- ``monitor_1280x800.png``: the Monitor with the engine answering (header, cards, the hit-rate plot's note);
- ``attach_dialog_1280x800.png``: Attach to… filled in with the panel's own engine's address and no key, after
  "Test connection": the engine asks for a key, said in the window's words (where the key is: Copy API key);
- ``copy_key_confirm_1280x800.png``: the question "Copy API key…" asks first;
- ``monitor_unreachable_1280x800.png``: a saved connection that does not answer, watched: the Monitor says
  "unreachable" with the reason, and shows nothing of the engine watched before.

Run: ``.venv/bin/python benchmarks/dayone_attach_screenshots.py [--out benchmarks/results/gui]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.dayone_screenshots import SIZE, run_cli, start_display  # noqa: E402
from engine_manager.sim.launch import free_port  # noqa: E402


def gui(out: Path) -> int:
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication, QMessageBox

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
    said: list[str] = []
    state: dict = {}

    def shot(name: str) -> None:
        app.processEvents()
        subprocess.run(["import", "-window", "root", str(out / name)], check=False, env=os.environ)
        said.append(name)
        print(name, flush=True)

    def chat() -> None:
        if win.ctx is None or win.ctx.own is None:          # not re-attached yet
            QTimer.singleShot(500, chat)
            return
        win.show_tab("Monitor")
        win.chat_pane.send("Write 3000 words about how the experts are offloaded between the GPU and RAM.")

    def attach() -> None:
        view = win.engine_panel.connections
        dlg = view.add_dialog()
        state["dlg"] = dlg
        dlg.name.setText("my-engine")
        dlg.url.setText(win.ctx.own.base_url)
        dlg.test()

    def close_dialog() -> None:
        state["dlg"].reject()

    def confirm() -> None:
        def answer() -> None:
            box = app.activeModalWidget()
            if not isinstance(box, QMessageBox):
                QTimer.singleShot(200, answer)
                return
            QTimer.singleShot(1500, lambda: shot("copy_key_confirm_1280x800.png"))
            QTimer.singleShot(2500, box.reject)
        QTimer.singleShot(200, answer)
        win.engine_panel.copy_api_key()

    def unreachable() -> None:
        from engine_manager import connections as C

        C.add_connection("gpu-box", f"http://127.0.0.1:{free_port('127.0.0.1')}")
        win.engine_panel.connections.refresh()
        win.engine_panel.connections.select("gpu-box")

    steps = [(3, chat), (25, lambda: shot("monitor_1280x800.png")), (26, attach),
             (32, lambda: shot("attach_dialog_1280x800.png")), (33, close_dialog), (34, confirm),
             (40, unreachable), (46, lambda: shot("monitor_unreachable_1280x800.png")),
             (47, lambda: (win.close(), app.quit()))]
    for t, fn in steps:
        QTimer.singleShot(int(t * 1000), fn)
    app.exec()
    return 0 if len(said) == 4 else 1


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
    tmp = Path(tempfile.mkdtemp(prefix="dsv41-attach-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_")}
    env.update(DSV41_CONFIG_DIR=str(tmp / "config"), DSV41_DATA_DIR=str(tmp / "data"),
               DSV41_CACHE_DIR=str(tmp / "cache"), DSV41_SERVER_ENGINE="sim", DSV41_PORT=str(free_port("127.0.0.1")),
               PYTHONPATH=str(ROOT))
    run_cli("settings", "set", "sim_args", "--load-time 0.5", env=env)
    print("start:", run_cli("start", env=env).returncode, flush=True)
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
