"""An InferenceKey endpoint as a saved connection, against a loopback server that answers as an endpoint does, and
the marker on the engine the InferenceKey backend started on this machine.

The stand-in serves the data plane's documented route (``POST /endpoint/<project>/<workload>/v1/chat/completions``
with ``Authorization: Bearer ik_live_…``; inferencekey-sdk docs/…/reference/wire-format.mdx) and answers a chat
completion whose ``message.content`` is the custom backend's result as JSON — made by the real
:class:`~engine_manager.inferencekey.backend.DeepSeekOneGpuBackend` ``_output``, so a change of the backend's shape
shows here. ``GET …/v1/models`` is a 404 for a good key (the data plane has no such route) and 401 / 403 for a bad
one. Tests: the URL's shape, ``dsv41 connections add``, ``dsv41 chat --connection``, the chat pane, hostile content
(not JSON, JSON of the wrong shape, too large) in plain words, and ``started_by`` in the state file, ``dsv41 status``
and the engine's status.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from loopback_http import LoopbackServer, QuietHandler

from engine_manager import connections as C
from engine_manager.chat import ChatClient, ChatError, ContentDelta, ReasoningDelta, StreamDone
from engine_manager.chat_events import ChatOptions, StreamStats
from engine_manager.inferencekey.endpoint import CONTENT_CAP, NO_STREAMING, endpoint_ref, unwrap

ROOT = Path(__file__).resolve().parents[1]
PROJECT, WORKLOAD = "acme", "dsv41-flash"
ANSWER = "Offload keeps the hot experts in VRAM and reads the rest from RAM."
THOUGHT = "The user asks how one GPU holds a 763B MoE."


def backend_content(**over) -> str:
    """What the real backend returns for one job (``DeepSeekOneGpuBackend._output``), as JSON text."""
    pytest.importorskip("inferencekey")
    import time

    from engine_manager.inferencekey.backend import DeepSeekOneGpuBackend
    from engine_manager.engine_state import RunningEngine

    stats = StreamStats(ttft_s=0.41, duration_s=3.1, tok_s=17.5, completion_tokens=42, prompt_tokens=12,
                        engine_tok_s=18.25, engine_prompt_tok_s=250.0, finish_reason="stop",
                        timings={"prompt_n": 12, "predicted_n": 42, "predicted_per_second": 18.25,
                                 "prompt_per_second": 250.0})
    running = RunningEngine("http://127.0.0.1:1", "k" * 24, engine="sim", label="Scripted engine", simulated=True)
    out = DeepSeekOneGpuBackend()._output(ANSWER, THOUGHT, "stop", stats, time.monotonic() - 3.2, running)
    out.update(over)
    return json.dumps(out)


class Endpoint(LoopbackServer):
    """A loopback stand-in for one workload's endpoint: ``content`` is the answer's ``message.content``."""

    def __init__(self, key: str, content: str | None = None):
        self.key, self.content = key, content
        self.bodies: list[dict] = []
        self.auth: list[str | None] = []
        self.paths: list[str] = []
        srv = self
        prefix = f"/endpoint/{PROJECT}/{WORKLOAD}/v1"

        class Handler(QuietHandler):
            def _authorised(self) -> bool:
                got = self.headers.get("Authorization")
                srv.auth.append(got)
                if got == f"Bearer {srv.key}":
                    return True
                if (got or "").startswith("Bearer ik_sdk_"):
                    self._send(403, "application/json", json.dumps({"error": {
                        "code": "wrong_credential_type",
                        "message": "This route requires an ik_live_ data-plane token."}}).encode())
                else:
                    self._send(401, "application/json", b'{"error": {"code": "invalid_api_key", '
                                                         b'"message": "unknown key"}}')
                return False

            def do_GET(self) -> None:  # noqa: N802
                srv.paths.append(self.path)
                if self._authorised():
                    self._send(404, "application/json", b'{"error": {"message": "Not Found"}}')

            def do_POST(self) -> None:  # noqa: N802
                srv.paths.append(self.path)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if not self._authorised():
                    return
                if self.path != prefix + "/chat/completions":
                    self._send(404, "application/json", b'{"error": {"message": "Not Found"}}')
                    return
                srv.bodies.append(json.loads(body))
                content = srv.content if srv.content is not None else backend_content()
                answer = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1750000000,
                          "model": WORKLOAD,
                          "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                       "finish_reason": "stop"}],
                          # the platform's own count (of the JSON text): not the answer's tokens
                          "usage": {"prompt_tokens": 900, "completion_tokens": 700, "total_tokens": 1600}}
                self._send(200, "application/json", json.dumps(answer).encode())

        super().__init__(Handler)
        self.server.handle_error = lambda *_a: None        # a client that hung up (the too-large test): no noise

    @property
    def url(self) -> str:
        return f"{self.base_url}/endpoint/{PROJECT}/{WORKLOAD}/v1"


@pytest.fixture
def endpoint():
    made: list[Endpoint] = []

    def make(content: str | None = None) -> Endpoint:
        srv = Endpoint("ik_live_" + secrets.token_hex(16), content)
        made.append(srv)
        return srv

    yield make
    for s in made:
        s.stop()


def dsv41(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine_manager", *args], input=stdin, capture_output=True,
                          text=True, timeout=90, cwd=str(ROOT), env=dict(os.environ))


def add(srv: Endpoint, name: str = "ik", key: str | None = None) -> subprocess.CompletedProcess:
    return dsv41("connections", "add", name, srv.url, "--api-key-stdin", stdin=(key or srv.key) + "\n")


# -- the address ------------------------------------------------------------------------------------------------
def test_the_endpoints_address_is_known_by_its_shape():
    ref = endpoint_ref("https://api.inferencekey.com/endpoint/acme/support-bot/v1")
    assert ref is not None and (ref.project, ref.workload) == ("acme", "support-bot")
    assert ref.chat_base == "https://api.inferencekey.com/endpoint/acme/support-bot"
    assert ref.v1 == ref.chat_base + "/v1"
    assert endpoint_ref("http://127.0.0.1:9/endpoint/acme/w/").chat_base == "http://127.0.0.1:9/endpoint/acme/w"
    for other in ("http://127.0.0.1:8000", "http://127.0.0.1:8000/v1", "https://x/endpoint/acme",
                  "https://x/endpoint/acme/w/v1/chat/completions", "ftp://x/endpoint/a/b/v1",
                  "https://x/endpoint/a/b/v1?x=1", None):
        assert endpoint_ref(other) is None, other


# -- the chat client -------------------------------------------------------------------------------------------
def test_the_backends_json_becomes_answer_reasoning_and_its_own_figures(endpoint):
    srv = endpoint()
    ref = endpoint_ref(srv.url)
    events = []
    with ChatClient(ref.chat_base, srv.key) as client:
        events = list(client.stream([{"role": "user", "content": "How does one GPU hold it?"}],
                                    ChatOptions(max_tokens=300, reasoning_effort="high")))
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    assert (reasoning, content) == (THOUGHT, ANSWER)
    stats = next(e for e in events if isinstance(e, StreamDone)).stats
    # the figures from inside the backend's result, not the platform's count of the JSON text
    assert (stats.prompt_tokens, stats.completion_tokens) == (12, 42)
    assert stats.engine_tok_s == pytest.approx(18.25) and stats.tok_s == pytest.approx(17.5)
    assert stats.ttft_s == pytest.approx(0.41) and stats.finish_reason == "stop"
    assert stats.timings["predicted_n"] == 42 and stats.timings["backend_total_s"] >= 3.2
    # asked without streaming, for the workload (as the SDK's own client asks), with the key as a Bearer
    body = srv.bodies[-1]
    assert body["stream"] is False and "stream_options" not in body
    assert body["model"] == WORKLOAD and body["max_tokens"] == 300 and body["reasoning_effort"] == "high"
    assert srv.auth[-1] == f"Bearer {srv.key}"


HOSTILE = [
    ("plain text", "Just an answer, not JSON.", "plain text, not JSON"),
    ("a list", "[1, 2, 3]", "JSON without the answer's text (a list)"),
    ("another shape", '{"label": "positive", "score": 0.98}', "JSON without the answer's text (an object)"),
    ("text not text", '{"text": 5, "reasoning": "r"}', "whose text is a number"),
    ("deep", "[" * 100_000, "JSON nested too deeply"),
]


@pytest.mark.parametrize("what,content,words", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_content_that_is_not_the_backends_result_is_shown_as_it_came_with_plain_words(endpoint, what, content,
                                                                                     words):
    srv = endpoint(content)
    got: list[str] = []
    with ChatClient(endpoint_ref(srv.url).chat_base, srv.key) as client, pytest.raises(ChatError) as ei:
        for ev in client.stream([{"role": "user", "content": "hi"}], ChatOptions(max_tokens=100_000)):
            if isinstance(ev, ContentDelta):
                got.append(ev.text)
    assert "".join(got) == content                                # nothing lost: shown as it came
    msg = str(ei.value)
    assert ei.value.kind == "protocol" and words in msg and "not with the DeepSeek backend's result" in msg
    assert "Traceback" not in msg and "Error(" not in msg


def test_huge_content_is_refused_in_plain_words(endpoint):
    srv = endpoint(json.dumps({"text": "x" * 3_000_000}))
    with ChatClient(endpoint_ref(srv.url).chat_base, srv.key) as client, pytest.raises(ChatError) as ei:
        list(client.stream([{"role": "user", "content": "hi"}], ChatOptions(max_tokens=100)))
    assert ei.value.kind == "too_large" and "larger than 1 MB" in str(ei.value)
    # and content past the unwrap's own cap is never parsed, whatever the request allowed
    big = unwrap('{"text": "' + "y" * CONTENT_CAP + '"}')
    assert big.problem and "more than the backend's result ever is" in big.problem and big.text.startswith('{"text')


# -- the CLI ---------------------------------------------------------------------------------------------------
def test_cli_adds_the_endpoint_and_chats_with_it(endpoint):
    srv = endpoint()
    # a control-plane token, or no ik_live_ key, is refused before anything is sent or saved
    sdk = add(srv, key="ik_sdk_" + "a" * 32)
    assert sdk.returncode != 0 and "control-plane token (ik_sdk_" in sdk.stderr + sdk.stdout
    other = add(srv, key="sk-" + "b" * 32)
    assert other.returncode != 0 and "start with ik_live_" in other.stderr + other.stdout
    assert srv.paths == [] and C.load_connections() == []
    # a key the endpoint refuses: nothing saved, in plain words
    bad = add(srv, key="ik_live_" + "c" * 32)
    assert bad.returncode != 0 and "refused the key (HTTP 401" in bad.stderr + bad.stdout
    assert C.load_connections() == []
    ok = add(srv)
    assert ok.returncode == 0, ok.stderr + ok.stdout
    assert "InferenceKey endpoint" in ok.stdout and f"workload {WORKLOAD}" in ok.stdout
    (conn,) = C.load_connections()
    assert conn.kind == "inferencekey" and conn.base_url == srv.url and conn.key_store in ("keyring", "file")
    assert srv.key not in C.connections_file().read_text() and srv.key not in ok.stdout + ok.stderr

    r = dsv41("chat", "--connection", "ik", "--max-tokens", "300", "How does one GPU hold it?")
    assert r.returncode == 0, r.stderr
    assert f"note: {NO_STREAMING}" in r.stderr
    out = r.stdout
    assert out.index("[reasoning]") < out.index(THOUGHT) < out.index("[answer]") < out.index(ANSWER)
    assert '"text"' not in out and "{" not in out                        # unwrapped, not the JSON
    assert "42 tokens" in r.stderr and "17.5 tok/s" in r.stderr and "engine 18.2 tok/s" in r.stderr
    assert srv.bodies[-1]["stream"] is False and srv.bodies[-1]["max_tokens"] == 300
    assert srv.key not in r.stdout + r.stderr
    # the saved answer is the text; its reasoning apart
    j = dsv41("chat", "--connection", "ik", "--json", "And again?")
    msg = json.loads(j.stdout)["message"]
    assert (msg["content"], msg["reasoning"], msg["stats"]["completion_tokens"]) == (ANSWER, THOUGHT, 42)


def test_cli_chat_says_in_plain_words_when_the_content_is_not_the_backends(endpoint):
    srv = endpoint()
    assert add(srv).returncode == 0
    srv.content = "Plain words from some other backend."
    r = dsv41("chat", "--connection", "ik", "hello")
    assert r.returncode == 1
    assert "Plain words from some other backend." in r.stdout                  # shown as it came
    assert "plain text, not JSON" in r.stderr and "dsv41 backend" in r.stderr and "Traceback" not in r.stderr


# -- the chat pane ---------------------------------------------------------------------------------------------
@pytest.mark.gui
def test_the_pane_unwraps_the_endpoints_answer(qtbot, endpoint):
    from app.chat_pane import ChatPane
    from app.context import AppContext
    from engine_manager import history as hist
    from engine_manager.settings import load_settings

    srv = endpoint()
    C.add_connection("ik", srv.url, srv.key, tested=C.check_unsaved(srv.url, srv.key))
    ctx = AppContext(load_settings())
    pane = ChatPane(ctx)
    qtbot.addWidget(pane)
    pane.resize(520, 900)
    pane.show()
    try:
        qtbot.waitUntil(lambda: pane.store is not None, timeout=10000)
        ctx.watch(C.resolve_connection("ik"), "ik")
        assert pane.engine_ready() and NO_STREAMING in pane.engine_label.text()
        assert "InferenceKey endpoint" in pane.engine_label.text()
        assert pane.send("How does one GPU hold it?")
        qtbot.waitUntil(lambda: pane.streaming_count() == 0, timeout=30000)
        text = pane.document_text()
        assert ANSWER in text and '"text"' not in text and "42 tokens" in text
        m = pane.store.messages(pane.current_conversation_id())[-1]
        assert (m.content, m.reasoning, m.status) == (ANSWER, THOUGHT, hist.STATUS_COMPLETE)
        assert m.stats["completion_tokens"] == 42 and m.stats["engine_tok_s"] == pytest.approx(18.25)
        # content of the wrong shape: shown as it came, and why, in plain words
        srv.content = '{"label": "positive"}'
        pane.new_conversation()
        assert pane.send("Again?")
        qtbot.waitUntil(lambda: pane.streaming_count() == 0, timeout=30000)
        text = pane.document_text()
        assert '{"label": "positive"}' in text and "not with the DeepSeek backend's result" in text
    finally:
        pane.shutdown()
        C.close_all_tunnels()


# -- started_by ------------------------------------------------------------------------------------------------
def test_the_engine_the_backend_started_is_labelled_so(monkeypatch, free_port):
    from supervisor_helpers import drain, hw, tiny_engine

    from engine_manager import supervisor as sv
    from engine_manager.engine_state import READY
    from engine_manager.settings import load_settings

    monkeypatch.setenv("DSV41_PORT", str(free_port))
    settings = load_settings().settings
    # what DeepSeekOneGpuBackend._start_engine makes: the supervisor that writes who started the engine
    sup = sv.Supervisor(settings, hardware=hw(), poll_s=0.05, started_by="inferencekey")
    try:
        _, st = drain(sup.run(tiny_engine(), watch=False))
        assert st.state == READY and st.started_by == "inferencekey"
        assert json.loads(sup.state_path.read_text())["started_by"] == "inferencekey"
        # the panel on this machine (another supervisor, another process) reads it and labels it
        other = sv.Supervisor(load_settings().settings, hardware=hw())
        assert other.status().started_by_words == "started by the InferenceKey backend"
        r = dsv41("status")
        assert r.returncode == 0 and "started by the InferenceKey backend" in r.stdout, r.stdout + r.stderr
        assert json.loads(dsv41("status", "--json").stdout)["started_by"] == "inferencekey"
        # re-attached by the panel (whose own mark is "panel"), it keeps the mark in the state file
        _, again = drain(sv.Supervisor(load_settings().settings, hardware=hw(), poll_s=0.05).run(
            tiny_engine(), watch=False))
        assert again.started_by == "inferencekey"
        assert json.loads(sup.state_path.read_text())["started_by"] == "inferencekey"
    finally:
        drain(sv.Supervisor(load_settings().settings, hardware=hw()).stop(force=True))
    # an engine the panel starts is the panel's (no label)
    assert sv.Supervisor(settings).started_by == "panel"


def test_a_state_record_with_a_bad_started_by_is_set_aside():
    from pydantic import ValidationError

    from engine_manager.engine_record import EngineRecord

    with pytest.raises(ValidationError):
        EngineRecord.model_validate({"started_by": 5})
    with pytest.raises(ValidationError):
        EngineRecord.model_validate({"started_by": "x" * 41})
    assert EngineRecord.model_validate({"started_by": "inferencekey"}).started_by == "inferencekey"




@pytest.mark.slow
def test_the_real_backend_marks_the_engine_it_started(tmp_path):
    """The SDK's runtime serving the real backend on the scripted engine: the panel's status on this machine (``dsv41
    status``, another process) labels the engine the backend started."""
    pytest.importorskip("inferencekey")
    import signal

    from test_inferencekey_backend import Backend, engine_record

    from engine_manager.procs import alive

    b = Backend(tmp_path, DSV41_SIM_ARGS="--load-time 0.3")
    try:
        b.wait_up()
        assert engine_record()["started_by"] == "inferencekey"
        r = dsv41("status")
        assert r.returncode == 0 and "started by the InferenceKey backend" in r.stdout, r.stdout + r.stderr
    finally:
        b.stop()
        try:
            rec = engine_record()
        except (OSError, ValueError):
            rec = {}
        if rec.get("pgid") and alive(rec.get("keeper_pid")):
            os.killpg(rec["pgid"], signal.SIGKILL)
