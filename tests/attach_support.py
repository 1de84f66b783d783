"""Shared by the attach tests (``test_connections``, ``test_attach_gui``): engines the panel did not start.

- :class:`FixtureServer` (and the ``fixture_server`` fixture): a loopback server speaking vLLM's / SGLang's
  documented ``/metrics`` (``tests/data/vllm``, ``tests/data/sglang``) and the OpenAI API;
- ``tiny_gguf``: the tiny real GGUF model (``engine_manager.testing.tinymoe``), once a module;
- ``foreign_llama``: a llama-server on that model started by the test as a plain process the panel knows nothing
  about, ready; killed (its whole group) at the end. Skipped (failed under CI) where llama-server is not installed.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from loopback_http import LoopbackServer, QuietHandler, chat_stream, word_deltas

DATA = Path(__file__).parent / "data"
MODEL = "deepseek-ai/DeepSeek-V4.1-Flash"


# -- a loopback server speaking vLLM's / SGLang's documented /metrics and the OpenAI API -------------------------
class FixtureServer(LoopbackServer):
    """``flavour`` vllm | sglang | openai. ``/metrics`` answers the fixture's first scrape until :meth:`advance`,
    then the second, without the metrics named in ``drop`` (a server that does not export them); everything but
    ``/health`` needs ``Authorization: Bearer KEY``; chat streams ``answer``."""

    def __init__(self, flavour: str, key: str, answer: str = "Attached and answering.", drop: tuple[str, ...] = ()):
        self.flavour, self.key, self.answer = flavour, key, answer
        self.drop = drop
        self.phase = 1
        self.paths: list[str] = []
        srv = self

        class Handler(QuietHandler):
            def _authorised(self) -> bool:
                if self.headers.get("Authorization") == f"Bearer {srv.key}":
                    return True
                self._send(401, "application/json", b'{"error": {"message": "invalid api key"}}')
                return False

            def do_GET(self) -> None:  # noqa: N802
                srv.paths.append(self.path)
                if self.path == "/health":
                    self._send(200, "text/plain", b"")
                    return
                if not self._authorised():
                    return
                if self.path == "/v1/models":
                    owner = {"vllm": "vllm", "sglang": "sglang", "openai": "someone"}[srv.flavour]
                    self._send(200, "application/json", json.dumps(
                        {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": owner}]}).encode())
                elif self.path == "/metrics" and srv.flavour != "openai":
                    text = (DATA / srv.flavour / f"metrics-{srv.phase}.txt").read_bytes()
                    text = b"\n".join(ln for ln in text.split(b"\n")
                                      if not any(name.encode() in ln.split(b"{")[0].split() for name in srv.drop))
                    self._send(200, "text/plain; version=0.0.4", text)
                else:
                    self._send(404, "application/json", b'{"detail": "Not Found"}')

            def do_POST(self) -> None:  # noqa: N802
                srv.paths.append(self.path)
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if not self._authorised():
                    return
                if self.path != "/v1/chat/completions":
                    self._send(404, "application/json", b'{"detail": "Not Found"}')
                    return
                self._send(200, "text/event-stream", chat_stream(word_deltas(srv.answer), prompt_tokens=4))

        super().__init__(Handler)

    def advance(self) -> None:
        self.phase = 2


@pytest.fixture
def fixture_server():
    """``fixture_server(flavour, key=None)`` starts a :class:`FixtureServer` (a generated key unless one is
    given); every one is stopped at the end of the test."""
    started: list[FixtureServer] = []

    def start(flavour: str, key: str | None = None, drop: tuple[str, ...] = ()) -> FixtureServer:
        s = FixtureServer(flavour, key or "fx-" + secrets.token_urlsafe(16), drop=drop)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


# -- a llama-server started by the test --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    from engine_manager.testing.tinymoe import write_tinymoe

    return write_tinymoe(tmp_path_factory.mktemp("tinymoe"))


@pytest.fixture
def foreign_llama(tiny_gguf, tmp_path):
    """A llama-server on ``tiny_gguf`` started by the test (a plain process the supervisor knows nothing about),
    ready (``GET /health`` answers 200): ``(process, spec)``."""
    from conftest import require_or_skip
    from engine_manager import llamacpp_bin
    from engine_manager.engines import get_engine
    from engine_manager.settings import load_settings
    from engine_manager.sim.launch import free_port

    try:
        llamacpp_bin.find_llama_server()
    except llamacpp_bin.LlamaServerNotFound as exc:
        require_or_skip(f"llama-server is not installed: {exc}")
    settings = load_settings(env={"DSV41_LLAMACPP_MODEL": str(tiny_gguf), "DSV41_PORT": str(free_port()),
                                  "DSV41_SLOTS": "1", "DSV41_CONTEXT_LENGTH": "2048", "DSV41_NUMA": "off"}).settings
    spec = get_engine("llamacpp").build_launch(settings, None, tmp_path / "llama")
    proc = subprocess.Popen(spec.argv, env={**os.environ, **spec.env}, cwd=spec.cwd, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, "llama-server exited while loading"
            try:
                if httpx.get(spec.base_url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "llama-server did not become ready"
            time.sleep(0.2)
        yield proc, spec
    finally:
        os.killpg(proc.pid, 9)
        proc.wait(timeout=10)
