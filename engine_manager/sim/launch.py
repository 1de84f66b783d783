"""Start the scripted engine as a real subprocess from Python (tests, benchmarks, demos).

``with SimProcess(["--slots", "4"]) as sim: sim.wait_ready(); httpx.get(sim.url("/metrics"), headers=sim.headers)``

The process runs in its own process group; :meth:`SimProcess.stop` sends SIGTERM to the group, waits, then
SIGKILLs it, so nothing is left behind. Its output (the engine log) is collected line by line in ``lines``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterable

from ..engines._http import bearer_headers
from ..engines.sim import sim_env, write_key_file
from ..procs import free_port
from ..settings import new_api_key


class SimProcess:
    def __init__(self, args: Iterable[str] = (), port: int | None = None, api_key: str | None = None,
                 host: str = "127.0.0.1", env: dict[str, str] | None = None, load_time: float | None = 0.0,
                 cwd: str | None = None):
        self.host = host
        self.port = port or free_port(host)
        self.api_key = new_api_key() if api_key is None else api_key
        self.args = list(args)
        self.extra_env = dict(env or {})
        self.load_time = load_time
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader: threading.Thread | None = None
        self._key_dir: tempfile.TemporaryDirectory | None = None
        self.key_file: Path | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------------
    @property
    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "engine_manager.sim", "--host", self.host, "--port", str(self.port)]
        if self.api_key:            # in a 0600 file, never on the command line (`ps` shows that to every user)
            if self.key_file is None:
                self._key_dir = tempfile.TemporaryDirectory(prefix="dsv41-sim-key-")
                self.key_file = write_key_file(Path(self._key_dir.name) / "api-key", self.api_key)
            argv += ["--api-key-file", str(self.key_file)]
        if self.load_time is not None and "--load-time" not in self.args:
            argv += ["--load-time", str(self.load_time)]
        return argv + self.args

    def start(self) -> "SimProcess":
        env = {k: v for k, v in os.environ.items() if k != "DSV41_SIM_ARGS"}
        env.update(sim_env(env))
        env.update(self.extra_env)
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, env=env, cwd=self.cwd)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self.proc and self.proc.stdout
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for_line(self, pattern: str, timeout: float = 20.0) -> str:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cond:
            seen = 0
            while True:
                for line in self.lines[seen:]:
                    if rx.search(line):
                        return line
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no log line matching {pattern!r} within {timeout} s; log:\n"
                                       + "\n".join(self.lines[-30:]))
                if self.proc is not None and self.proc.poll() is not None and \
                        (self._reader is None or not self._reader.is_alive()):
                    raise RuntimeError(f"the sim exited ({self.proc.returncode}) before {pattern!r}; log:\n"
                                       + "\n".join(self.lines[-30:]))
                self._cond.wait(min(left, 0.2))

    def wait_ready(self, timeout: float = 30.0) -> "SimProcess":
        """Until ``GET /health`` says ready — the one readiness probe (:func:`engine_manager.engines._http.
        probe_health`) with Strata's rule: ``loaded: true``. Raises ``RuntimeError`` (with the log) when the sim
        exits first or another program answers on its port, ``TimeoutError`` after ``timeout`` seconds."""
        import httpx

        from ..engines._http import probe_health

        deadline = time.monotonic() + timeout
        with httpx.Client(trust_env=False) as client:
            while True:
                left = deadline - time.monotonic()
                r = probe_health(client, self.base_url, port=self.port, needs_loaded=True, service_hint="strata",
                                 timeout_s=min(5.0, max(0.5, left)))
                if r.state == "ready":
                    return self
                if r.state == "failed":
                    raise RuntimeError(f"the sim on port {self.port} is not ready: {r.detail}; log:\n"
                                       + self._log_tail())
                with self._cond:
                    if self.proc is not None and self.proc.poll() is not None and \
                            (self._reader is None or not self._reader.is_alive()):
                        raise RuntimeError(f"the sim exited ({self.proc.returncode}) before it was ready; log:\n"
                                           + self._log_tail())
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"the sim was not ready within {timeout} s ({r.detail}); log:\n"
                                           + self._log_tail())
                    self._cond.wait(min(left, 0.1))     # a new log line (READY) wakes it at once

    def _log_tail(self) -> str:
        with self._cond:
            return "\n".join(self.lines[-30:])

    def wait_exit(self, timeout: float = 20.0) -> int:
        assert self.proc
        rc = self.proc.wait(timeout)
        if self._reader:
            self._reader.join(5)
        return rc

    def stop(self, grace: float = 5.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        try:                                   # whatever is left of the group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        rc = self.proc.wait(grace)
        if self.proc.stdout:
            if self._reader:
                self._reader.join(5)
            self.proc.stdout.close()
        if self._key_dir is not None:
            self._key_dir.cleanup()
            self._key_dir, self.key_file = None, None
        return rc

    def __enter__(self) -> "SimProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- HTTP --------------------------------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url(self, path: str) -> str:
        return self.base_url + path

    @property
    def headers(self) -> dict[str, str]:
        return bearer_headers(self.api_key)

    @property
    def log_text(self) -> str:
        with self._cond:
            return "\n".join(self.lines)
