"""Shared by the chat tests: the scripted engine (``python -m engine_manager.sim``) as a real process on loopback,
started by the one launcher, :class:`engine_manager.sim.launch.SimProcess` (its own process group, a generated key
in a 0600 file, the ``/health`` readiness probe).

``start_sim(*flags, speed=…, slots=…)`` starts one for a test (on the conftest ``sim_process`` fixture: stopped at
the end of the test); ``shared_sim`` is one for a whole module; ``launch_sim`` is what both call.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from loopback_http import LoopbackServer, QuietHandler, chat_stream, word_deltas

from engine_manager.sim.launch import SimProcess

ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def sim_args(*flags: str, speed: float = 10.0, key: str | None = None, slots: int = 1) -> tuple[list[str], dict]:
    """The scripted engine's flags and ``SimProcess`` keywords for ``launch_sim``'s options."""
    return ([*("--speed", str(speed), "--slots", str(slots)), *flags],
            {"api_key": key or "test-" + secrets.token_urlsafe(18), "cwd": str(ROOT)})


def launch_sim(*flags: str, speed: float = 10.0, key: str | None = None, slots: int = 1,
               timeout_s: float = 30.0) -> SimProcess:
    """A ready scripted engine (the caller stops it); ``speed`` and ``slots`` are the sim's flags."""
    args, kw = sim_args(*flags, speed=speed, key=key, slots=slots)
    sim = SimProcess(args, **kw).start()
    try:
        return sim.wait_ready(timeout_s)
    except BaseException:
        sim.stop()
        raise


@pytest.fixture
def start_sim(sim_process):
    def start(*flags: str, timeout_s: float = 30.0, **opts) -> SimProcess:
        """``opts``: ``speed``, ``key``, ``slots`` as for :func:`launch_sim`."""
        args, kw = sim_args(*flags, **opts)
        return sim_process(*args, **kw).wait_ready(timeout_s)

    return start


@pytest.fixture(scope="module")
def shared_sim():
    """One fault-free scripted engine (8 slots) for a whole test module."""
    sim = launch_sim(speed=10.0, slots=8)
    yield sim
    sim.stop()


# ------------------------------------------------------------------------------------------------ other programs
@dataclass
class ForeignServer:
    """A program the panel did not start, holding a port: Python's own ``http.server`` as a real process (it
    answers GET with a directory listing and POST with an HTML 501 page, and logs every request it gets)."""

    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def requests(self) -> list[str]:
        """The request lines it logged (``"POST /v1/chat/completions HTTP/1.1" 501 -`` …)."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return [ln for ln in text.splitlines() if '"' in ln and ("GET " in ln or "POST " in ln)]

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)


def launch_foreign(port: int, log_dir: Path) -> ForeignServer:
    import socket
    log_path = log_dir / f"foreign-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-u", "-m", "http.server", "--bind", "127.0.0.1", str(port)],
                                stdout=log, stderr=subprocess.STDOUT, cwd=log_dir, env=_env(),
                                start_new_session=True)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return ForeignServer(proc, port, log_path)
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    raise RuntimeError("http.server did not start: " + log_path.read_text(errors="replace"))


@pytest.fixture
def foreign_server(tmp_path):
    started: list[ForeignServer] = []

    def start(port: int) -> ForeignServer:
        srv = launch_foreign(port, tmp_path)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.kill()


class RecordingEngine(LoopbackServer):
    """A small OpenAI-style engine on loopback (stdlib ``http.server`` on a thread) that keeps the JSON body of
    every chat request and answers it with a short valid event stream: one reasoning chunk, the ``answer``
    words as content chunks, a finish reason, usage and ``[DONE]``. ``GET /health`` says it is ready."""

    MODEL = "recording-engine"

    def __init__(self, answer: str = "Recorded and answered."):
        import json

        self.answer = answer
        self.bodies: list[dict] = []
        engine = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path == "/health":
                    self._send(200, "application/json",
                               json.dumps({"status": "ok", "model": engine.MODEL}).encode())
                else:
                    self._send(404, "application/json", b'{"error": {"message": "not here"}}')

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                if self.path != "/v1/chat/completions":
                    self._send(404, "application/json", b'{"error": {"message": "not here"}}')
                    return
                engine.bodies.append(body)
                deltas = [{"reasoning_content": "Thinking it over. "}, *word_deltas(engine.answer)]
                self._send(200, "text/event-stream", chat_stream(deltas, prompt_tokens=5))

        super().__init__(Handler)


@pytest.fixture
def recording_engine():
    srv = RecordingEngine()
    yield srv
    srv.stop()


@pytest.fixture
def panel_sim(monkeypatch, free_port):
    """The scripted engine started the way the panel starts it: by the supervisor (behind its keeper, state file in
    this test's data dir) on the settings' port, with the settings' generated key. Yields its EngineStatus; it is
    stopped at the end."""
    from engine_manager.engines import get_engine
    from engine_manager.settings import load_settings
    from engine_manager.supervisor import Supervisor

    monkeypatch.setenv("DSV41_PORT", str(free_port))
    monkeypatch.setenv("DSV41_SIM_ARGS", "--load-time 0 --speed 10")
    sup = Supervisor(load_settings().settings)
    st = None
    gen = sup.run(get_engine("sim"), watch=False)
    try:
        while True:
            next(gen)
    except StopIteration as stop:
        st = stop.value
    try:
        assert st is not None and st.state == "ready", st
        yield st
    finally:
        for _ in Supervisor(load_settings().settings).stop(force=True):
            pass
