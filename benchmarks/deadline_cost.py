"""What the overall deadline of a capped request costs (``engine_manager.engines._http.get_capped``): the process's
CPU per ``GET`` with one shared deadline thread (``_Deadlines``, what the panel uses) beside a ``threading.Timer``
started per request (what it used before), measured side by side in one run, in alternating rounds.

The server is a separate process (``python -m http.server`` on 127.0.0.1 serving a 30-kB file, about the size of a
metrics answer), so its work is not counted; the client makes its requests one after the other on one
``httpx.Client``, as the engine poll does.

    .venv/bin/python benchmarks/deadline_cost.py [--requests 400] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from engine_manager.engines import _http  # noqa: E402
from engine_manager.procs import free_port  # noqa: E402


class TimerPerRequest:
    """The earlier way, for comparison: a ``threading.Timer`` per request, cancelled when it is over."""

    def add(self, delay_s: float, sock, fired) -> threading.Timer:
        t = threading.Timer(delay_s, _http._cut, (sock, fired))
        t.daemon = True
        t.start()
        return t

    def cancel(self, handle: threading.Timer) -> None:
        handle.cancel()


def cpu_per_request(client: httpx.Client, url: str, n: int) -> float:
    """Milliseconds of this process's CPU per request, over ``n`` requests."""
    t0 = time.process_time()
    for _ in range(n):
        r = _http.get_capped(client, url)
        if r.status_code != 200 or len(r.content) != 30_000:
            raise SystemExit(f"unexpected answer: {r.status_code}, {len(r.content)} bytes")
    return (time.process_time() - t0) * 1000 / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as root:
        Path(root, "metrics").write_bytes(b"x" * 30_000)
        port = free_port()
        srv = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], cwd=root,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = f"http://127.0.0.1:{port}/metrics"
            with httpx.Client(trust_env=False) as client:
                for _ in range(100):                 # the server is up
                    try:
                        client.get(url)
                        break
                    except httpx.TransportError:
                        time.sleep(0.05)
                shared, timers = _http._DEADLINES, TimerPerRequest()
                cpu_per_request(client, url, 50)     # warm both paths up
                got: dict[str, list[float]] = {"shared": [], "timer": []}
                for _ in range(a.rounds):
                    for name, way in (("timer", timers), ("shared", shared)):
                        _http._DEADLINES = way
                        try:
                            got[name].append(cpu_per_request(client, url, a.requests))
                        finally:
                            _http._DEADLINES = shared
                if shared.pending():
                    raise SystemExit(f"{shared.pending()} deadline(s) left behind after the requests")
        finally:
            srv.terminate()
            srv.wait()
    t, s = statistics.median(got["timer"]), statistics.median(got["shared"])
    load = os.getloadavg()[0]
    print(f"capped GET of 30 kB on loopback, {a.rounds} alternating rounds of {a.requests} requests "
          f"({time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, load {load:.2f}):")
    print(f"  a Timer thread per request: {t:.3f} ms CPU a request (rounds: "
          f"{', '.join(f'{x:.3f}' for x in got['timer'])})")
    print(f"  one shared deadline thread: {s:.3f} ms CPU a request (rounds: "
          f"{', '.join(f'{x:.3f}' for x in got['shared'])})")
    print(f"  saved {t - s:.3f} ms a request ({(t - s) / t:.0%}); at ~2 requests a second that is "
          f"{2 * (t - s) / 10:.3f} % of a core")
    return 0


if __name__ == "__main__":
    sys.exit(main())
