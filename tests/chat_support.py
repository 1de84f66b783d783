"""Shared by the chat tests: the scripted engine (``python -m engine_manager.sim``) as a real process on loopback.

``start_sim(*flags, speed=…)`` starts one on a free port (``--port 0``; the port is read from its ``READY`` line)
with a generated key, in its own process group; every process started is stopped at the end of the test.
"""

from __future__ import annotations

import os
import queue
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class SimEngine:
    proc: subprocess.Popen
    base_url: str
    key: str
    lines: list[str] = field(default_factory=list)

    @property
    def port(self) -> int:
        return int(self.base_url.rsplit(":", 1)[1])

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def launch_sim(*flags: str, speed: float = 10.0, key: str | None = None, slots: int = 1,
               timeout_s: float = 30.0) -> SimEngine:
    key = key or "test-" + secrets.token_urlsafe(18)
    argv = [sys.executable, "-m", "engine_manager.sim", "--host", "127.0.0.1", "--port", "0", "--api-key", key,
            "--load-time", "0", "--speed", str(speed), "--slots", str(slots), *flags]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env=_env(), start_new_session=True)
    lines: list[str] = []
    q: queue.Queue = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            q.put(line)
        q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            line = q.get(timeout=max(0.05, deadline - time.monotonic()))
        except queue.Empty:
            line = ""
        if line is None or time.monotonic() > deadline:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            raise RuntimeError("the scripted engine did not become ready:\n" + "\n".join(lines[-20:]))
        m = re.search(r"READY (http://\S+)", line or "")
        if m:
            return SimEngine(proc, m.group(1), key, lines)


@pytest.fixture
def start_sim():
    started: list[SimEngine] = []

    def start(*flags: str, **kw) -> SimEngine:
        sim = launch_sim(*flags, **kw)
        started.append(sim)
        return sim

    yield start
    for sim in started:             # nothing of the sim's needs a graceful stop: its whole group goes at once
        sim.kill()


@pytest.fixture(scope="module")
def shared_sim():
    """One fault-free scripted engine (8 slots) for a whole test module."""
    sim = launch_sim(speed=10.0, slots=8)
    yield sim
    if sim.proc.poll() is None:
        os.killpg(sim.proc.pid, signal.SIGTERM)
        try:
            sim.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            sim.kill()


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


class RecordingEngine:
    """A small OpenAI-style engine on loopback (stdlib ``http.server`` on a thread) that keeps the JSON body of
    every chat request and answers it with a short valid event stream: one reasoning chunk, the ``answer``
    words as content chunks, a finish reason, usage and ``[DONE]``. ``GET /health`` says it is ready."""

    MODEL = "recording-engine"

    def __init__(self, answer: str = "Recorded and answered."):
        import http.server
        import json

        self.answer = answer
        self.bodies: list[dict] = []
        engine = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_a) -> None:
                pass

            def _send(self, status: int, ctype: str, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

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
                words = engine.answer.split(" ")
                deltas = [{"reasoning_content": "Thinking it over. "}]
                deltas += [{"content": w + (" " if i < len(words) - 1 else "")} for i, w in enumerate(words)]
                frames = [{"choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
                frames.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                               "usage": {"prompt_tokens": 5, "completion_tokens": len(deltas),
                                         "total_tokens": 5 + len(deltas)}})
                data = b"".join(b"data: " + json.dumps(f).encode() + b"\n\n" for f in frames) + b"data: [DONE]\n\n"
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


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
