"""How long the panel's window takes to appear, against a bare PySide6 window, in one run.

Each trial starts a fresh Python process and measures, on the same wall clock, from just before the process is
started to the first paint of its window:

* **bare**: ``QApplication`` + an empty ``QMainWindow`` shown — the floor any PySide6 window pays (interpreter,
  PySide6's import, the X connection, the first paint);
* **panel**: ``python -m app --report-startup --quit-after S`` — the real ``dsv41-panel`` start. Four marks:
  *shown* (the frame's first paint), *usable* (the engine column and the page on screen built and painted — on
  the Monitor its bar and cards, the plots' place saying so — and the event loop free to take input), *done*
  (that page's plots drawn too) and *built* (every page built).

* **floor**: the bare window, then — after its first paint — the libraries a first page with the Monitor's
  plots cannot do without: its settings read and validated (``engine_manager.settings.load_settings``)
  and the plotting library (pyqtgraph, which imports numpy). No widget of the panel is built: this is the least
  the *done* mark can cost, whatever the panel's own code does.

Trials alternate bare / panel / floor so all see the same load on a shared machine; the medians are compared.
Goals: panel usable ≤ 2 × bare shown; frame shown ≤ 1.5 × bare. The project's sources are byte-compiled first
(``compileall``), as an installed panel's are (pip compiles at install), whatever ``PYTHONDONTWRITEBYTECODE`` says.

Run: ``xvfb-run -a -s "-screen 0 1600x1000x24" .venv/bin/python benchmarks/startup.py [--trials 7]``
(with a display already set, it uses that). Writes nothing but stdout; ``--out FILE`` also saves the report.
The panel runs with throw-away config/data folders, so the first-run wizard and your own state stay out of it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BARE = textwrap.dedent("""
    import sys, time
    from PySide6.QtCore import QEvent, QObject, QTimer
    from PySide6.QtWidgets import QApplication, QMainWindow, QWidget
    app = QApplication([sys.argv[0]])
    win = QMainWindow()
    win.setWindowTitle("bare")
    win.resize(1440, 900)
    class FirstPaint(QObject):
        def eventFilter(self, obj, ev):
            if ev.type() == QEvent.Type.Paint and isinstance(obj, QWidget) and obj.window() is win:
                app.removeEventFilter(self)
                print(f"startup shown_at={time.time():.6f}", flush=True)
            return False
    f = FirstPaint(app)
    app.installEventFilter(f)
    win.show()
    QTimer.singleShot(int(float(sys.argv[1]) * 1000), app.quit)
    app.exec()
""")


# the bare window, then the libraries the first page needs, imported right after its first paint (as the panel does)
FLOOR = BARE.replace(
    'print(f"startup shown_at={time.time():.6f}", flush=True)',
    'print(f"startup shown_at={time.time():.6f}", flush=True)\n            QTimer.singleShot(0, libraries)',
).replace("f = FirstPaint(app)", textwrap.dedent("""
    def libraries():
        from engine_manager.settings import load_settings
        load_settings()
        import pyqtgraph  # noqa: F401 - the import is what is measured
        print(f"startup usable_at={time.time():.6f}", flush=True)
    f = FirstPaint(app)"""))
assert "QTimer.singleShot(0, libraries)" in FLOOR and "def libraries" in FLOOR


def _parse(out: str) -> dict[str, float]:
    got = {}
    for line in out.splitlines():
        if line.startswith("startup "):
            k, _, v = line.split(" ", 1)[1].partition("=")
            got[k] = float(v)
    return got


def trial(argv: list[str], env: dict[str, str], timeout_s: float) -> dict[str, float]:
    t0 = time.time()
    p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    got = _parse(p.stdout)
    if "shown_at" not in got:
        raise SystemExit(f"no window reported by {argv[:3]} (exit {p.returncode}):\n{p.stdout}\n{p.stderr}")
    return {k: v - t0 for k, v in got.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--hold", type=float, default=1.5, help="seconds each window stays open after it is shown")
    ap.add_argument("--out", type=Path, help="also save the report here")
    ap.add_argument("--quick", action="store_true", help="3 trials, short holds (./scripts/bench-quick)")
    args = ap.parse_args(argv)
    if args.quick:
        args.trials, args.hold = 3, 0.5
    if not os.environ.get("DISPLAY") and not os.environ.get("WAYLAND_DISPLAY"):
        raise SystemExit('no display: run under xvfb-run -a -s "-screen 0 1600x1000x24"')
    tmp = Path(tempfile.mkdtemp(prefix="dsv41-startup-"))
    env = dict(os.environ, DSV41_CONFIG_DIR=str(tmp / "config"), DSV41_DATA_DIR=str(tmp / "data"),
               PYTHONPATH=str(ROOT))
    import compileall
    for pkg in ("app", "engine_manager"):
        compileall.compile_dir(ROOT / pkg, quiet=1)
    bare_cmd = [sys.executable, "-c", BARE, str(args.hold)]
    floor_cmd = [sys.executable, "-c", FLOOR, str(args.hold)]
    panel_cmd = [sys.executable, "-m", "app", "--report-startup", "--quit-after", str(args.hold + 2.0)]
    # one of each first, not counted: the disk cache warms for all three
    trial(bare_cmd, env, 60)
    trial(panel_cmd, env, 60)
    trial(floor_cmd, env, 60)
    bare, shown, usable, done, built, floor = [], [], [], [], [], []
    for _ in range(args.trials):
        bare.append(trial(bare_cmd, env, 60)["shown_at"])
        f = trial(floor_cmd, env, 60)
        if "usable_at" not in f:
            raise SystemExit("the floor trial did not report its libraries loaded")
        floor.append(f["usable_at"])
        r = trial(panel_cmd, env, 60)
        shown.append(r["shown_at"])
        if "usable_at" in r:
            usable.append(r["usable_at"])
        if "done_at" in r:
            done.append(r["done_at"])
        if "built_at" in r:
            built.append(r["built_at"])
    mb, ms = statistics.median(bare), statistics.median(shown)
    mu = statistics.median(usable) if usable else float("nan")
    lines = [
        f"startup benchmark, {args.trials} trials each, alternating ({time.strftime('%Y-%m-%d %H:%M')}, "
        f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f})",
        f"  bare PySide6 window shown: median {mb:.3f} s  (all: {', '.join(f'{x:.3f}' for x in bare)})",
        f"  dsv41-panel window shown:  median {ms:.3f} s  (all: {', '.join(f'{x:.3f}' for x in shown)})",
        f"  dsv41-panel usable:        median {mu:.3f} s  (all: {', '.join(f'{x:.3f}' for x in usable)})",
        f"  dsv41-panel first page done (its plots drawn too): median {statistics.median(done):.3f} s = "
        f"{statistics.median(done) / mb:.2f}x bare  (all: {', '.join(f'{x:.3f}' for x in done)})" if done else
        "  dsv41-panel first page done: not reported",
        f"  dsv41-panel pages built:   median {statistics.median(built):.3f} s" if built else
        "  dsv41-panel pages built:   not reported",
        f"  floor (bare window, then the settings and pyqtgraph with numpy): median "
        f"{statistics.median(floor):.3f} s = {statistics.median(floor) / mb:.2f}x bare  "
        f"(all: {', '.join(f'{x:.3f}' for x in floor)})",
        f"  ratio shown/bare: {ms / mb:.2f}x  (goal <= 1.5x: {'met' if ms / mb <= 1.5 else 'NOT met'})",
        f"  ratio usable/bare: {mu / mb:.2f}x  (goal <= 2x: {'met' if mu / mb <= 2 else 'NOT met'})",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
