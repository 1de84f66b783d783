"""A picture of the Downloads tab at 1280×800 after "Use an engine release I already have…" checked a folder that
fails one check (its .venv lacks NVIDIA's CUDA wheels), with that check's fix shown.

The folder is the stand-in Strata release (tests/strata_support.py ``make_strata_release``) with
``site-packages/nvidia`` removed; the check is the one ``dsv41 doctor`` runs
(:func:`engine_manager.release_check.check_release`). Taken the way benchmarks/dayone_screenshots.py takes its
pictures: a 1280×800 Xvfb with openbox, the screen grabbed with ImageMagick's ``import -window root``, in
temporary config/data/cache folders.

Run: ``.venv/bin/python benchmarks/release_folder_screenshot.py [--out benchmarks/results/gui]``
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
sys.path.insert(0, str(ROOT / "benchmarks"))

from dayone_screenshots import SIZE, start_display  # noqa: E402

NAME = "engine_release_from_folder.png"


def gui(out: Path, release: Path) -> int:
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication

    app = QApplication([sys.argv[0]])
    app.setApplicationName("dsv41 panel")
    from app.context import AppContext
    from app.main_window import MainWindow
    from engine_manager.settings import load_settings

    loaded = load_settings()
    win = MainWindow(lambda: AppContext(loaded), lazy=True, show_first_run=False)
    win.ask_on_close = False
    win.show()
    said: list[str] = []

    def check() -> None:
        win.show_tab("Downloads")
        panel = win.download_panel
        panel.releaseChecked.connect(lambda folder, checks: said.append(
            f"{folder}: " + ", ".join(f"{c.id}={c.status}" for c in checks)))
        panel.use_release_folder(release)

    def shot() -> None:
        app.processEvents()
        subprocess.run(["import", "-window", "root", str(out / NAME)], check=False, env=os.environ)
        g = win.geometry()
        said.append(f"{NAME}: window {g.width()}×{g.height()} at {g.x()},{g.y()}")
        print("\n".join(said), flush=True)
        win.close()
        app.quit()

    QTimer.singleShot(2000, check)
    QTimer.singleShot(12000, shot)
    app.exec()
    return 0 if any(NAME in s for s in said) and len(said) >= 2 else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gui"))
    p.add_argument("--gui", metavar="RELEASE", help=argparse.SUPPRESS)    # the inner run, on the X server
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.gui:
        return gui(out, Path(args.gui))
    for tool in ("Xvfb", "import"):
        if not shutil.which(tool):
            print(f"{tool} is missing (apt-get install xvfb imagemagick openbox)", file=sys.stderr)
            return 2
    sys.path.insert(0, str(ROOT / "tests"))
    from strata_support import make_strata_release

    tmp = Path(tempfile.mkdtemp(prefix="dsv41-release-"))
    release = make_strata_release(tmp / "strata-v0.1.0")
    shutil.rmtree(next((release / ".venv" / "lib").glob("python3*/site-packages")) / "nvidia")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_")}
    env.update(DSV41_CONFIG_DIR=str(tmp / "config"), DSV41_DATA_DIR=str(tmp / "data"),
               DSV41_CACHE_DIR=str(tmp / "cache"), DSV41_SERVER_ENGINE="sim", PYTHONPATH=str(ROOT))
    display, procs = start_display(SIZE)
    try:
        genv = dict(env, DISPLAY=display, QT_QPA_PLATFORM="xcb")
        genv.pop("WAYLAND_DISPLAY", None)
        rc = subprocess.run([sys.executable, __file__, "--gui", str(release), "--out", str(out)], env=genv,
                            cwd=ROOT, timeout=300).returncode
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
