"""Helpers for the supervisor, engine CLI and engine panel tests: the scripted engine through its adapter, and
psutil measurements of what an engine left behind, and ``drain`` (a generator of events run to its end)."""

from __future__ import annotations

import os
import sys
import time

import psutil

from engine_manager.engines.base import Engine

def drain(gen) -> tuple[list, object]:
    """Run a generator of progress events to its end: (the events it yielded, the value it returned)."""
    evs = []
    while True:
        try:
            evs.append(next(gen))
        except StopIteration as stop:
            return evs, stop.value


TINY_SERVER = r"""
import http.server, signal, subprocess, sys, threading
port, mode = int(sys.argv[1]), sys.argv[2]
if "ignore-term" in mode:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if "escape" in mode:
    subprocess.Popen(["sleep", "120"], start_new_session=True)   # a helper that leaves the process group
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Type", "application/json"); self.end_headers()
        self.wfile.write(b'{"status": "ok", "loaded": true, "service": "tiny"}')
    def log_message(self, *a):
        pass
srv = http.server.HTTPServer(("127.0.0.1", port), H)
if mode.startswith("exit3-when:"):      # ready, then exit with code 3 once the named file appears
    import os, time
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    print("READY tiny engine", flush=True)
    while not os.path.exists(mode.split(":", 1)[1]):
        time.sleep(0.02)
    print("tiny engine: giving up on purpose", flush=True)
    os._exit(3)
print("READY tiny engine", flush=True)
srv.serve_forever(poll_interval=0.05)
"""


def tiny_engine(mode: str = "plain") -> Engine:
    """The scripted engine's adapter with a minimal stdlib HTTP server as the process (starts in ~30 ms; exits
    on SIGTERM at once): for behaviours the sim has no switch for (ignoring SIGTERM, a child that leaves the
    process group)."""
    base = sim_engine()

    class Tiny(type(base)):
        def build_launch(self, settings, plan, workdir):
            spec = super().build_launch(settings, None, workdir)
            spec.argv = [sys.executable, "-I", "-S", "-c", TINY_SERVER, str(settings.port), mode]
            spec.label = f"tiny test engine ({mode})"
            return spec

    return Tiny()


def sim_engine() -> Engine:
    from engine_manager.engines import get_engine
    return get_engine("sim")


_HW = None


def hw():
    """The hardware probe of this machine, taken once per test session."""
    global _HW
    if _HW is None:
        from pathlib import Path

        from engine_manager import hardware
        _HW = hardware.probe(Path("/tmp"))
    return _HW


def wait_until(pred, timeout: float = 10.0, every: float = 0.02):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(every)
    return pred()


def live_group(pgid: int) -> list[psutil.Process]:
    """Every process (zombies included) whose process group is ``pgid``."""
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid:
                out.append(p)
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    return out


def listening(port: int) -> bool:
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
               for c in psutil.net_connections("tcp"))
