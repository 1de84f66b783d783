"""The whole panel's own CPU while it monitors: ``python -m app`` (every page, the engine column, the chat pane, the
status bar, the overview strip with N saved connections) watching the scripted engine at the default 1 Hz while N
users stream chats, measured from outside with psutil after a settle.

    xvfb-run -a -s "-screen 0 1600x1000x24" .venv/bin/python benchmarks/panel_cpu.py [--seconds 30] [--settle 25]
        [--users 4] [--connections 3] [--profile FILE] [--off PART[,PART]]

``benchmarks/gui_load.py`` part 2 measures the Monitor page and the overview strip alone, in its own process; this
is the window a user runs. ``--profile FILE`` also records a py-spy profile (raw, per thread) over the measured
seconds. ``--off`` runs the window with parts of its per-tick work switched off (``benchmarks/panel_parts.py``):
run it beside a plain run to weigh a part. Besides the whole process, the GUI thread's own share (from the
kernel's run-time count, in ns), the other threads' and how often the threads switch are printed.
Its own config/data folders are temporary; the engine is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--settle", type=float, default=25.0)
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--connections", type=int, default=3)
    ap.add_argument("--port", type=int, default=18791)
    ap.add_argument("--profile")
    ap.add_argument("--off", default="", help="parts switched off, comma-separated (benchmarks/panel_parts.py)")
    a = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="panel-cpu-"))
    env = {**os.environ, "DSV41_CONFIG_DIR": str(home / "config"), "DSV41_DATA_DIR": str(home / "data"),
           "DSV41_CACHE_DIR": str(home / "cache"), "DSV41_PORT": str(a.port),
           "DSV41_SIM_ARGS": f"--slots {max(1, a.users)}", "DSV41_SLOTS": str(max(1, a.users))}
    py = sys.executable

    def dsv41(*args: str, **kw) -> subprocess.CompletedProcess:
        return subprocess.run([py, "-m", "engine_manager", *args], env=env, cwd=ROOT, capture_output=True,
                              text=True, **kw)

    cp = dsv41("start")
    if cp.returncode != 0:
        print(cp.stdout + cp.stderr)
        return 1
    stop = threading.Event()
    app = None
    try:
        key = json.loads((home / "config" / "settings.json").read_text())["api_key"]
        url = f"http://127.0.0.1:{a.port}"
        for i in range(a.connections):
            dsv41("connections", "add", f"box{i}", url, input=key + "\n")

        def chat(i: int) -> None:
            with httpx.Client(timeout=60, trust_env=False) as c:
                while not stop.is_set():
                    try:
                        with c.stream("POST", url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                      json={"messages": [{"role": "user", "content": f"topic {i}"}], "stream": True,
                                            "max_tokens": 400}) as r:
                            for _ in r.iter_lines():
                                pass
                    except httpx.HTTPError:
                        time.sleep(0.2)

        for i in range(a.users):
            threading.Thread(target=chat, args=(i,), daemon=True).start()
        argv = [py, "-m", "app"] if not a.off else [py, str(ROOT / "benchmarks" / "panel_parts.py")]
        app = subprocess.Popen(argv, env={**env, "PYTHONPATH": str(ROOT), "DSV41_BENCH_OFF": a.off}, cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(a.settle)
        p = psutil.Process(app.pid)
        spy = None
        if a.profile:
            spy = subprocess.Popen(["py-spy", "record", "--pid", str(app.pid), "--threads", "--nonblocking", "-r",
                                    "100", "-d", str(int(a.seconds)), "-f", "raw", "-o", a.profile],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        gui0, sw0 = _main_thread(app.pid), _switches(app.pid)
        before, t0 = p.cpu_times(), time.monotonic()
        time.sleep(a.seconds)
        after, dt = p.cpu_times(), time.monotonic() - t0
        gui1, sw1 = _main_thread(app.pid), _switches(app.pid)
        gui = 100.0 * (gui1 - gui0) / dt
        if spy is not None:
            spy.wait(60)
        pct = 100.0 * ((after.user - before.user) + (after.system - before.system)) / dt
        print(f"whole panel (python -m app) at 1 Hz, {a.users} users streaming, {a.connections} saved connection(s) "
              f"in the overview{', with ' + a.off + ' off' if a.off else ''}: {pct:.2f}% of one core over {dt:.0f} s "
              f"(goal ≤ 2%; GUI thread {gui:.2f}%, the other threads {pct - gui:.2f}%); {p.num_threads()} threads "
              f"switching {(sw1 - sw0) / dt:.0f} times a second; load average {os.getloadavg()[0]:.2f}")
    finally:
        stop.set()
        if app is not None:
            app.terminate()
            try:
                app.wait(30)
            except subprocess.TimeoutExpired:
                app.kill()
        dsv41("stop")
    return 0


def _main_thread(pid: int) -> float:
    """The GUI thread's CPU seconds from the kernel's run-time count (``/proc/PID/task/PID/schedstat``, in ns):
    psutil's per-thread times come in 10 ms clock ticks, too coarse for ~0.4 s in 30 s."""
    with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def _switches(pid: int) -> int:
    """The process's thread switches so far (voluntary and not, every thread), from ``/proc/PID/task/*/status``."""
    n = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")):
                        n += int(line.split()[1])
        except OSError:                      # a thread that ended meanwhile
            pass
    return n


if __name__ == "__main__":
    sys.exit(main())
