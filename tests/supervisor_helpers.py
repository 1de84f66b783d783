"""Helpers for the supervisor, engine CLI and engine panel tests: the scripted engine through its adapter, and
psutil measurements of what an engine left behind."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import httpx
import psutil

from engine_manager.engines.base import Engine, LaunchSpec, LogEvent, Readiness, Sample


class _MiniSim(Engine):
    """Stand-in adapter for the scripted engine until engines/sim.py exists (same server, same flags)."""

    name = "sim"
    label = "scripted engine (simulated)"
    simulated = True

    def build_launch(self, settings, plan, workdir: Path) -> LaunchSpec:
        argv = [sys.executable, "-m", "engine_manager.sim", "--host", settings.host, "--port", str(settings.port),
                "--api-key", settings.api_key, "--load-time", "0.2"]
        return LaunchSpec("sim", argv, settings.host, settings.port, settings.api_key, simulated=True,
                          label=self.label)

    def readiness(self, client, spec) -> Readiness:
        try:
            r = client.get(spec.base_url + spec.health_path)
        except httpx.HTTPError as exc:
            return Readiness("loading", str(exc))
        return Readiness("ready" if r.status_code == 200 else "loading", r.text[:100])

    def poll(self, client, spec, previous):
        return Sample(time.time(), "sim", True)

    def parse_log_line(self, line: str):
        if line.startswith("phase: "):
            return LogEvent("phase", line[7:])
        if line.startswith("READY"):
            return LogEvent("ready", line)
        return None


def sim_engine() -> Engine:
    try:
        from engine_manager.engines import get_engine
        return get_engine("sim")
    except (ImportError, ModuleNotFoundError, AttributeError):
        return _MiniSim()


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
