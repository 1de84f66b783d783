"""The Benchmark tab's screenshot: a quick run on the scripted engine in the tab, then the screen.

Run under a virtual X server: ``xvfb-run -s "-screen 0 1600x1000x24" .venv/bin/python
benchmarks/bench_screenshot.py OUT.png``. Uses throw-away config/data dirs and a free port."""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine_manager.sim.launch import free_port  # noqa: E402

home = tempfile.mkdtemp(prefix="dsv41-bench-shot-")
port = free_port()
os.environ.update(DSV41_CONFIG_DIR=f"{home}/c", DSV41_DATA_DIR=f"{home}/d", DSV41_CACHE_DIR=f"{home}/k",
                  DSV41_PORT=str(port))

from PySide6.QtCore import QTimer  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

from app.bench_view import BenchView  # noqa: E402
from app.context import AppContext  # noqa: E402
from engine_manager.settings import load_settings  # noqa: E402

out = sys.argv[1] if len(sys.argv) > 1 else "bench_tab.png"
app = QApplication(sys.argv)
view = BenchView(AppContext(load_settings()))
view.setWindowTitle("dsv41 panel — Benchmark")
view.resize(1600, 1000)
view.move(0, 0)
view.show()


def shoot(_r) -> None:
    QTimer.singleShot(1500, lambda: (subprocess.run(["import", "-window", "root", out], check=False),
                                     print(view.result.get("verdict")), app.quit()))


view.finished.connect(shoot)
QTimer.singleShot(500, view.run_bench)
app.exec()
