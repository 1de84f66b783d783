"""engine_manager.chat against real servers: the scripted engine as a separate process (stream, cancel, error frame,
401, 400, FIFO queueing, engine killed, stall) and a raw loopback socket server for SSE framing edge cases."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
from chat_support import ROOT

from engine_manager import history as hist
from engine_manager.sim import corpus
from engine_manager.chat import (
    CancelToken, ChatClient, ChatError, ChatOptions, ContentDelta, FinishReason, ReasoningDelta, StreamDone,
    StreamOpened, TimingsInfo, UsageInfo,
)
from engine_manager.chat_turn import TurnEnded, TurnStarted, run_turn
from engine_manager.engine_state import RunningEngine

Q = [{"role": "user", "content": "Explain expert offload on one GPU"}]


def collect(events):
    out = {"reasoning": [], "content": [], "events": []}
    for ev in events:
        out["events"].append(ev)
        if isinstance(ev, ReasoningDelta):
            out["reasoning"].append(ev.text)
        elif isinstance(ev, ContentDelta):
            out["content"].append(ev.text)
    return out


# ------------------------------------------------------------------------------------------------ the sim
def test_stream_yields_reasoning_then_content_and_stats(start_sim):
    sim = start_sim(speed=3.0)            # ~190 tok/s: the answer spreads over about half a second
    with ChatClient(sim.base_url, sim.api_key) as c:
        got = collect(c.stream(Q, ChatOptions(max_tokens=400)))
    evs = got["events"]
    assert isinstance(evs[0], StreamOpened) and isinstance(evs[-1], StreamDone)
    r_at = [i for i, e in enumerate(evs) if isinstance(e, ReasoningDelta)]
    c_at = [i for i, e in enumerate(evs) if isinstance(e, ContentDelta)]
    assert r_at and c_at and max(r_at) < min(c_at), "reasoning must stream before the answer"
    # the scripted engine answers with its curated sentences for the question's topic, labelled as canned
    topic = corpus.topic_of(Q[0]["content"])
    assert topic.name == "offload"
    answer = "".join(got["content"])
    assert answer.startswith(corpus.LABEL)
    assert set(corpus.sentences(answer)[1:]) <= set(topic.answer) | {corpus.CLOSER}
    assert len(corpus.sentences(answer)) >= 2
    assert set(corpus.sentences("".join(got["reasoning"]))) <= set(topic.reasoning)
    assert [e.reason for e in evs if isinstance(e, FinishReason)] == ["stop"]
    usage = [e for e in evs if isinstance(e, UsageInfo)][-1]
    timings = [e for e in evs if isinstance(e, TimingsInfo)][-1]
    stats = evs[-1].stats
    n = len(r_at) + len(c_at)
    assert usage.completion_tokens == n == stats.completion_tokens == timings.predicted_n
    assert stats.reasoning_chunks == len(r_at) and stats.content_chunks == len(c_at)
    assert 0 < stats.ttft_s <= stats.first_content_s <= stats.duration_s
    assert stats.tok_s and stats.tok_s > 0
    assert stats.engine_tok_s == timings.predicted_per_second and stats.engine_tok_s > 0
    assert stats.finish_reason == "stop" and not stats.cancelled
    assert "tokens" in stats.summary() and "tok/s" in stats.summary()


def test_max_tokens_and_reasoning_effort_reach_the_engine_as_top_level_keys(shared_sim):
    with ChatClient(shared_sim.base_url, shared_sim.api_key) as c:
        short = collect(c.stream(Q, ChatOptions(max_tokens=5)))
        plain = collect(c.stream(Q, ChatOptions(max_tokens=400, reasoning_effort="none")))
    assert len(short["reasoning"]) + len(short["content"]) == 5
    assert short["events"][-1].stats.finish_reason == "length"
    # 5 tokens within a few ms give no meaningful rate of our own: None, never a made-up figure
    assert short["events"][-1].stats.tok_s is None and short["events"][-1].stats.engine_tok_s > 0
    # the sim thinks unless reasoning_effort (a top-level key) says "none"
    assert plain["reasoning"] == [] and plain["content"]


def test_request_body_puts_non_openai_fields_at_top_level():
    c = ChatClient("http://127.0.0.1:9", "k" * 20, model="m")
    body = c.request_body(Q, ChatOptions(max_tokens=7, temperature=0.3, reasoning_effort="high", reproducible=True,
                                         extra={"strata_tune": {"pcie_frac": 0.5}}))
    c.close()
    assert body["reasoning_effort"] == "high" and body["strata_reproducible"] is True
    assert body["strata_tune"] == {"pcie_frac": 0.5} and "extra_body" not in body
    assert body["max_tokens"] == 7 and body["temperature"] == 0.3 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and body["model"] == "m"
    assert "strata_reproducible" not in ChatClient("http://x", None).request_body(Q, ChatOptions())


def test_cancel_closes_the_stream_and_frees_the_engine_slot(start_sim):
    sim = start_sim("--reply-tokens", "3000", speed=1.0, slots=1)
    token = CancelToken()
    n = 0
    with ChatClient(sim.base_url, sim.api_key) as c:
        events = []
        for ev in c.stream(Q, ChatOptions(max_tokens=3000), token):
            events.append(ev)
            if isinstance(ev, (ReasoningDelta, ContentDelta)):
                n += 1
                if n == 5:
                    token.cancel()
        done = events[-1]
        assert isinstance(done, StreamDone) and done.stats.cancelled
        assert n <= 6, "no more text after cancel"
        # the only slot is free again: a new request is answered (it would wait ~45 s behind the old one)
        again = collect(c.stream(Q, ChatOptions(max_tokens=3)))
    assert len(again["reasoning"]) + len(again["content"]) == 3


def test_cancel_from_another_thread_wakes_a_stalled_read(start_sim):
    sim = start_sim("--stall-after-tokens", "3", "--stall-s", "30", speed=5.0)
    token = CancelToken()
    t0 = time.monotonic()
    with ChatClient(sim.base_url, sim.api_key) as c:
        timer = threading.Timer(0.8, token.cancel)
        timer.start()
        got = collect(c.stream(Q, ChatOptions(max_tokens=100), token))
        timer.cancel()
    assert got["events"][-1].stats.cancelled
    assert time.monotonic() - t0 < 15, "cancel must not wait for the 30 s stall to end"


def test_error_frame_mid_stream_raises_with_the_engines_message(start_sim):
    sim = start_sim("--error-after-tokens", "6")
    seen = []
    with ChatClient(sim.base_url, sim.api_key) as c, pytest.raises(ChatError) as ei:
        for ev in c.stream(Q, ChatOptions(max_tokens=200)):
            if isinstance(ev, (ReasoningDelta, ContentDelta)):
                seen.append(ev.text)
    assert len(seen) == 6
    assert ei.value.kind == "stream_error"
    assert "simulated engine error" in str(ei.value) and "while answering" in str(ei.value)


def test_wrong_key_is_401_in_plain_words(shared_sim):
    """The engine's own words are Strata's (serve/server.py @2291cb3 ``Handler._authorized``: 401
    ``authentication_error`` "missing or wrong API key"; tests/data/strata/error_401.json)."""
    with ChatClient(shared_sim.base_url, "wrong-key-0123456789") as c, pytest.raises(ChatError) as ei:
        list(c.stream(Q))
    e = ei.value
    assert e.kind == "auth" and e.status == 401
    assert "refused the API key" in str(e) and "missing or wrong API key" in str(e)
    assert "wrong-key" not in str(e)


def test_tools_are_refused_with_400(shared_sim):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    with ChatClient(shared_sim.base_url, shared_sim.api_key) as c, pytest.raises(ChatError) as ei:
        list(c.stream(Q, ChatOptions(extra={"tools": tools})))
    assert ei.value.kind == "bad_request" and ei.value.status == 400
    assert "tool calls are not supported" in str(ei.value)


def test_a_second_chat_waits_its_turn_instead_of_being_refused(start_sim):
    """Strata queues chat requests first in, first out and never answers a chat with 409 (serve/server.py
    @2291cb3 ``Service.run`` waits in ``Service.fifo``; 409 ``model_busy`` is only for ``/v1/load``/``/v1/unload``).
    With one slot busy, a second chat is accepted, shown as queued in ``/metrics``, and answered once the first
    one ends: the client reports no error and the two answers do not interleave."""
    import httpx
    sim = start_sim("--reply-tokens", "3000", speed=1.0, slots=1)
    token = CancelToken()
    log: list[tuple[str, str]] = []          # (which chat, what arrived), in arrival order across both threads
    lock = threading.Lock()
    first_token = threading.Event()
    result: dict[str, object] = {}

    def chat(name, opts, cancel=None):
        try:
            with ChatClient(sim.base_url, sim.api_key) as c:
                for ev in c.stream(Q, opts, cancel):
                    if isinstance(ev, (ReasoningDelta, ContentDelta)):
                        with lock:
                            log.append((name, ev.text))
                        first_token.set()
                    elif isinstance(ev, StreamDone):
                        result[name] = ev.stats
        except Exception as exc:            # noqa: BLE001 - reported by the assertions below
            result[name] = exc

    a = threading.Thread(target=chat, args=("A", ChatOptions(max_tokens=3000), token))
    a.start()
    b = None
    try:
        assert first_token.wait(20)
        b = threading.Thread(target=chat, args=("B", ChatOptions(max_tokens=20)))
        b.start()
        deadline = time.monotonic() + 30
        queued = 0
        while time.monotonic() < deadline and not queued:
            live = httpx.get(sim.base_url + "/metrics", headers={"Authorization": f"Bearer {sim.api_key}"},
                             timeout=5).json()["live"]
            queued = live.get("queued") or 0
            if not queued:
                time.sleep(0.05)
        assert queued == 1, "the second chat waits in the engine's queue"
        assert "B" not in result, "a queued chat is not refused (no 409 for chat)"
        with lock:
            assert all(name == "A" for name, _ in log), "the queued chat gets nothing before the first one ends"
    finally:
        token.cancel()
        a.join(20)
        if b is not None:
            b.join(60)
    stats_a = result["A"]
    assert not isinstance(stats_a, Exception) and stats_a.cancelled, f"the first chat: {stats_a}"
    stats_b = result["B"]
    assert not isinstance(stats_b, Exception), f"the queued chat failed: {stats_b}"
    assert stats_b.finish_reason in ("stop", "length") and not stats_b.cancelled
    names = [name for name, _ in log]
    assert names.count("B") == stats_b.completion_tokens > 0
    assert names == sorted(names), "first in, first out: all of A's text, then all of B's"


@pytest.mark.parametrize("fault", ["--die-after-tokens", "--sigkill-after-tokens"])
def test_engine_killed_mid_stream_is_engine_died(start_sim, fault):
    sim = start_sim(fault, "10")
    seen = []
    with ChatClient(sim.base_url, sim.api_key) as c, pytest.raises(ChatError) as ei:
        for ev in c.stream(Q, ChatOptions(max_tokens=200)):
            if isinstance(ev, (ReasoningDelta, ContentDelta)):
                seen.append(ev)
    assert 1 <= len(seen) <= 10
    assert ei.value.kind == "engine_died"
    assert "stopped while answering" in str(ei.value)
    assert ei.value.stats is not None and ei.value.stats.completion_tokens == len(seen)      # m6


def test_nothing_listening_is_unreachable(free_port):
    with ChatClient(f"http://127.0.0.1:{free_port}", "k" * 20) as c, pytest.raises(ChatError) as ei:
        list(c.stream(Q))
    assert ei.value.kind == "unreachable" and "Start the engine" in str(ei.value)
    assert "`dsv41 start`" in str(ei.value) and "engine start" not in str(ei.value)     # m2: the real command


def test_silent_engine_is_reported_as_stalled(start_sim):
    sim = start_sim("--stall-after-tokens", "3", "--stall-s", "8", speed=5.0)
    with ChatClient(sim.base_url, sim.api_key, read_timeout_s=1.0) as c, pytest.raises(ChatError) as ei:
        list(c.stream(Q, ChatOptions(max_tokens=100)))
    assert ei.value.kind == "stalled" and "sent nothing for 1 s" in str(ei.value)


# ------------------------------------------------------------------------------------------------ raw SSE server
class RawServer:
    """A loopback HTTP server that answers one request with raw byte pieces (sent with pauses, so the client
    reads them in separate TCP segments) and records the request body."""

    def __init__(self, head: bytes, pieces: list[bytes], close: bool = True, die: bool = False):
        self.head, self.pieces, self.close, self.die = head, pieces, close, die
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.port = self.sock.getsockname()[1]
        self.body: dict | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        threading.Thread(target=self._health, daemon=True).start()
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, rest = data.partition(b"\r\n\r\n")
            n = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
            while len(rest) < n:
                rest += conn.recv(65536)
            self.body = json.loads(rest)
            conn.sendall(self.head)
            for p in self.pieces:
                conn.sendall(p)
                time.sleep(0.01)
            if not self.close:
                time.sleep(30)
            if self.die:                 # the whole server goes: its port no longer answers, then the stream ends
                self.sock.shutdown(socket.SHUT_RDWR)      # (wakes the health thread's accept; close alone would not)
                self.sock.close()

    def _health(self) -> None:
        """Later connections (the client's "is the engine still there?" probe) get a 200 /health."""
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
                             b"Connection: close\r\n\r\n{}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.sock.close()


SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"


def _frame(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def test_sse_framing_edge_cases_split_utf8_crlf_comments():
    text = "héllo ✓ wörld"
    frames = (b": keep-alive\r\n\r\n"
              + _frame({"choices": [{"delta": {"reasoning_content": "thinking…"}}]}).replace(b"\n", b"\r\n")
              + b"data:" + json.dumps({"choices": [{"delta": {"content": text}}]}, ensure_ascii=False).encode()
              + b"\n\n" + b": comment line\n"
              + _frame({"choices": [{"delta": {}, "finish_reason": "stop"}], "usage": {"completion_tokens": 2}})
              + b"data: [DONE]\n\n")
    # cut into 3-byte pieces: frames, lines and multi-byte characters all straddle reads
    pieces = [frames[i:i + 3] for i in range(0, len(frames), 3)]
    srv = RawServer(SSE_HEAD, pieces)
    try:
        with ChatClient(srv.url, "k" * 20) as c:
            got = collect(c.stream(Q, ChatOptions(reasoning_effort="high", reproducible=True)))
    finally:
        srv.stop()
    assert "".join(got["reasoning"]) == "thinking…"
    assert "".join(got["content"]) == text
    assert got["events"][-1].stats.finish_reason == "stop"
    assert srv.body["reasoning_effort"] == "high" and srv.body["strata_reproducible"] is True


def test_stream_that_just_ends_is_connection_lost_not_complete():
    frames = _frame({"choices": [{"delta": {"content": "half an "}}]})
    srv = RawServer(SSE_HEAD, [frames])
    try:
        with ChatClient(srv.url, "k" * 20) as c, pytest.raises(ChatError) as ei:
            list(c.stream(Q))
    finally:
        srv.stop()
    assert ei.value.kind == "connection_lost"           # the server still answers /health: not dead
    assert "connection to the engine was lost while answering" in str(ei.value)


SSE_HEAD_10 = (b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
               b"X-Accel-Buffering: no\r\n\r\n")       # Strata's: HTTP/1.0, the server closes the connection


@pytest.mark.parametrize("die,kind,words", [(True, "engine_died", "stopped while answering"),
                                            (False, "connection_lost", "lost while answering")])
def test_http10_stream_closed_before_usage_and_done_is_an_interrupted_answer(die, kind, words):
    """Strata answers over HTTP/1.0 and ends every stream by closing the connection, after a last chunk that always
    carries ``usage`` and then ``data: [DONE]`` (serve/server.py @2291cb3 ``openai_chunks``, ``Handler._openai``;
    tests/data/strata/sse_stream.txt). A close after two content frames - the second already with a
    finish_reason - but with neither usage nor [DONE] is an engine that went away mid-answer, never a complete one."""
    frames = [_frame({"choices": [{"index": 0, "delta": {"content": "Half "}, "finish_reason": None}]}),
              _frame({"choices": [{"index": 0, "delta": {"content": "an answer"}, "finish_reason": "stop"}]})]
    srv = RawServer(SSE_HEAD_10, frames, die=die)
    got: list = []
    try:
        with ChatClient(srv.url, "k" * 20) as c, pytest.raises(ChatError) as ei:
            for ev in c.stream(Q):
                got.append(ev)
    finally:
        srv.stop()
    assert ei.value.kind == kind and words in str(ei.value) and "What arrived is kept" in str(ei.value)
    assert "".join(e.text for e in got if isinstance(e, ContentDelta)) == "Half an answer"
    assert not any(isinstance(e, StreamDone) for e in got)
    assert ei.value.stats is not None and ei.value.stats.completion_tokens == 2


def test_not_an_event_stream_is_a_protocol_error():
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n"
    srv = RawServer(head, [b"{}"])
    try:
        with ChatClient(srv.url, "k" * 20) as c, pytest.raises(ChatError) as ei:
            list(c.stream(Q))
    finally:
        srv.stop()
    assert ei.value.kind == "protocol" and "event stream" in str(ei.value)


@pytest.mark.parametrize("status,kind,words", [(503, "unavailable", "not ready"), (409, "busy", "busy"),
                                               (500, "http", "HTTP 500")])
def test_http_errors_carry_the_engines_message(status, kind, words):
    body = json.dumps({"error": {"type": "x", "message": "the engine's own words"}}).encode()
    head = (f"HTTP/1.1 {status} Oops\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            .encode())
    srv = RawServer(head, [body])
    try:
        with ChatClient(srv.url, "k" * 20) as c, pytest.raises(ChatError) as ei:
            list(c.stream(Q))
    finally:
        srv.stop()
    assert ei.value.kind == kind and ei.value.status == status
    assert words in str(ei.value) and "the engine's own words" in str(ei.value)


def test_a_client_for_the_running_engine_uses_its_address_and_key(shared_sim):
    """ChatClient.for_engine: the RunningEngine handle's address and key (a wrong key in the handle is refused)."""
    good = RunningEngine(shared_sim.base_url + "/", shared_sim.api_key, engine="sim", simulated=True)
    with ChatClient.for_engine(good, read_timeout_s=30.0) as c:
        assert c.base_url == shared_sim.base_url and c.read_timeout_s == 30.0
        content, _reasoning, stats = c.complete(Q, ChatOptions(max_tokens=20))
    assert content.startswith(corpus.LABEL[:len(content)]) and stats.completion_tokens == 20
    with ChatClient.for_engine(good.with_(api_key="wrong-key-0123456789")) as c, pytest.raises(ChatError) as ei:
        c.complete(Q, ChatOptions(max_tokens=5))
    assert ei.value.kind == "auth"


def test_the_history_and_the_chat_client_do_not_import_each_other():
    """The import circle chat <-> history is gone: each loads without the other (the turn needs both)."""
    import subprocess
    import sys
    code = ("import sys, importlib; importlib.import_module(sys.argv[1]); "
            "print(sorted(m for m in sys.modules if m in ('engine_manager.chat', 'engine_manager.history', "
            "'engine_manager.chat_turn', 'httpx')))")

    def loaded(mod):
        out = subprocess.run([sys.executable, "-c", code, mod], capture_output=True, text=True, check=True,
                             cwd=ROOT)
        return out.stdout.strip()
    assert loaded("engine_manager.history") == "['engine_manager.history']"
    assert loaded("engine_manager.chat") == "['engine_manager.chat', 'httpx']"
    assert loaded("engine_manager.chat_turn") == \
        "['engine_manager.chat', 'engine_manager.chat_turn', 'engine_manager.history', 'httpx']"


# ------------------------------------------------------------------------------------------------ run_turn
def _turn(store, sim, cid=None, **kw):
    kw.setdefault("user_text", "Explain expert offload on one GPU")
    return list(run_turn(store, cid, engine=RunningEngine(sim.base_url, sim.api_key), **kw))


def test_run_turn_records_the_conversation(shared_sim):
    store = hist.HistoryStore()
    evs = _turn(store, shared_sim, options=ChatOptions(max_tokens=300, reasoning_effort="low"))
    started, ended = evs[0], evs[-1]
    assert isinstance(started, TurnStarted) and isinstance(ended, TurnEnded)
    assert ended.status == hist.STATUS_COMPLETE and ended.error is None
    msgs = store.messages(ended.conversation_id)
    assert [m.role for m in msgs] == ["user", "assistant"]
    a = msgs[1]
    assert a.content == ended.content and a.reasoning == ended.reasoning and a.content
    assert a.status == hist.STATUS_COMPLETE and a.stats["finish_reason"] == "stop"
    assert a.options["max_tokens"] == 300 and a.options["reasoning_effort"] == "low"
    # a second turn sends the history (user + answer, no reasoning) and appends
    evs2 = _turn(store, shared_sim, ended.conversation_id, user_text="And with two GPUs?",
                 options=ChatOptions(max_tokens=50))
    assert evs2[-1].status == hist.STATUS_COMPLETE
    assert [m.role for m in store.messages(ended.conversation_id)] == ["user", "assistant"] * 2


def test_run_turn_saves_while_streaming(start_sim):
    sim = start_sim("--reply-tokens", "400", speed=1.0)
    store = hist.HistoryStore()
    token = CancelToken()
    seen_partial = []
    for ev in run_turn(store, None, engine=RunningEngine(sim.base_url, sim.api_key), user_text="Tell me about offload",
                       options=ChatOptions(max_tokens=400), cancel=token, flush_interval_s=0.2):
        if isinstance(ev, (ContentDelta, ReasoningDelta)):
            m = store.messages(1)[-1]          # read by another connection, as a restarted panel would
            if m.status == hist.STATUS_STREAMING and (m.content or m.reasoning):
                seen_partial.append(len(m.content) + len(m.reasoning))
            if len(seen_partial) >= 3 and seen_partial[-1] > seen_partial[0]:
                token.cancel()
        if isinstance(ev, TurnEnded):
            ended = ev
    assert seen_partial and seen_partial[-1] > seen_partial[0], "the partial answer grows in the database"
    assert ended.status == hist.STATUS_STOPPED
    m = store.messages(ended.conversation_id)[-1]
    assert m.status == hist.STATUS_STOPPED and m.content + m.reasoning == ended.content + ended.reasoning
    assert m.stats["cancelled"] is True


def test_engine_killed_mid_stream_saves_and_marks_interrupted(start_sim, shared_sim):
    sim = start_sim("--sigkill-after-tokens", "30")
    store = hist.HistoryStore()
    evs = _turn(store, sim, options=ChatOptions(max_tokens=400))
    ended = evs[-1]
    assert ended.status == hist.STATUS_INTERRUPTED and ended.error_kind == "engine_died"
    m = store.message(ended.assistant_message_id)
    assert m.status == hist.STATUS_INTERRUPTED and "stopped while answering" in m.error
    assert 0 < len(m.reasoning.split()) + len(m.content.split()) <= 30
    # what was saved is exactly the start of the answer a healthy engine gives to the same question
    ref = collect(ChatClient(shared_sim.base_url, shared_sim.api_key).stream(
        [{"role": "user", "content": "Explain expert offload on one GPU"}], ChatOptions(max_tokens=400)))
    assert "".join(ref["reasoning"]).startswith(m.reasoning)
    assert "".join(ref["content"]).startswith(m.content)


def test_a_refused_request_leaves_the_history_as_it_was(shared_sim, free_port):
    """m13: 401 / nothing listening / 409 before any answer: no "[error]" conversation is left behind, an existing
    conversation keeps its messages, and a failed regenerate does not drop the answer it would replace."""
    store = hist.HistoryStore()
    for _ in range(2):
        evs = list(run_turn(store, None, engine=RunningEngine(shared_sim.base_url, "wrong-key-0123456789"),
                            user_text="hello"))
        assert not any(isinstance(e, TurnStarted) for e in evs)
        ended = evs[-1]
        assert ended.status == hist.STATUS_ERROR and ended.error_kind == "auth" and "401" in ended.error
        assert ended.saved is False and ended.conversation_id is None and ended.assistant_message_id is None
        evs = list(run_turn(store, None, engine=RunningEngine(f"http://127.0.0.1:{free_port}", "k" * 20),
                            user_text="hello"))
        assert evs[-1].error_kind == "unreachable" and evs[-1].saved is False
    assert store.list_conversations() == []
    # an existing conversation: nothing added, and a failed regenerate keeps the old answer
    cid = _turn(store, shared_sim, options=ChatOptions(max_tokens=20))[-1].conversation_id
    before = [(m.id, m.content, m.status) for m in store.messages(cid)]
    for kw in (dict(user_text="a follow-up"), dict(mode="regenerate"),
               dict(mode="edit", edit_message_id=before[0][0], user_text="changed")):
        ended = list(run_turn(store, cid, engine=RunningEngine(f"http://127.0.0.1:{free_port}", "k" * 20), **kw))[-1]
        assert ended.saved is False and ended.conversation_id == cid and ended.error_kind == "unreachable"
        assert [(m.id, m.content, m.status) for m in store.messages(cid)] == before
    assert [c.id for c in store.list_conversations()] == [cid]


def test_accepted_then_failed_before_a_token_takes_the_question_back():
    """m13, the other half: the engine answered 200 and then an error frame before any token: the conversation
    this turn created is gone again (nothing arrived that could be kept)."""
    frame = _frame({"error": {"message": "context too long", "type": "invalid_request_error"}})
    store = hist.HistoryStore()
    srv = RawServer(SSE_HEAD, [frame])
    try:
        evs = list(run_turn(store, None, engine=RunningEngine(srv.url, "k" * 20), user_text="a very long question"))
    finally:
        srv.stop()
    assert any(isinstance(e, TurnStarted) for e in evs)        # it was accepted (and saved while it streamed) …
    ended = evs[-1]
    assert ended.error_kind == "stream_error" and "context too long" in ended.error
    assert ended.saved is False and ended.conversation_id is None
    assert store.list_conversations() == []                     # … and taken back out
    # in an existing conversation only the new question goes
    cid = store.create_conversation()
    store.add_message(cid, "user", "earlier")
    srv = RawServer(SSE_HEAD, [frame])
    try:
        ended = list(run_turn(store, cid, engine=RunningEngine(srv.url, "k" * 20), user_text="new one"))[-1]
    finally:
        srv.stop()
    assert ended.saved is False and ended.conversation_id == cid
    assert [m.content for m in store.messages(cid)] == ["earlier"]


def test_interrupted_answer_counts_the_tokens_that_arrived(start_sim):
    """m6: no usage comes when the stream breaks; the tokens that did arrive are counted (one per delta) and
    stored, instead of 0."""
    sim = start_sim("--sigkill-after-tokens", "40")
    store = hist.HistoryStore()
    deltas = 0
    for ev in run_turn(store, None, engine=RunningEngine(sim.base_url, sim.api_key), user_text="Explain expert offload",
                       options=ChatOptions(max_tokens=400)):
        if isinstance(ev, (ContentDelta, ReasoningDelta)):
            deltas += 1
        ended = ev
    assert ended.status == hist.STATUS_INTERRUPTED and deltas > 0
    assert ended.stats.completion_tokens == deltas == ended.stats.tokens
    assert ended.stats.duration_s and ended.stats.ttft_s is not None
    m = store.message(ended.assistant_message_id)
    assert m.stats["completion_tokens"] == deltas
    assert f"{deltas} tokens" in store.export_markdown(ended.conversation_id)
    assert "Regenerate" not in m.error                          # the stored words fit the CLI and the pane


EDITED = "How do I bind the engine to the NUMA node of the GPU?"


def test_regenerate_and_edit_replace_what_followed(shared_sim):
    store = hist.HistoryStore()
    first = _turn(store, shared_sim, options=ChatOptions(max_tokens=20))[-1]
    cid = first.conversation_id
    _turn(store, shared_sim, cid, user_text="second question", options=ChatOptions(max_tokens=20))
    before = store.messages(cid)
    regen = list(run_turn(store, cid, engine=RunningEngine(shared_sim.base_url, shared_sim.api_key), mode="regenerate",
                          options=ChatOptions(max_tokens=20)))
    after = store.messages(cid)
    assert len(after) == 4 and after[3].id != before[3].id and regen[-1].status == hist.STATUS_COMPLETE
    assert [m.id for m in after[:3]] == [m.id for m in before[:3]]
    edit = list(run_turn(store, cid, engine=RunningEngine(shared_sim.base_url, shared_sim.api_key), mode="edit",
                         edit_message_id=before[0].id, user_text=EDITED, options=ChatOptions(max_tokens=400)))
    msgs = store.messages(cid)
    assert [m.role for m in msgs] == ["user", "assistant"] and msgs[0].content == EDITED
    # the new answer is to the edited question: the scripted engine's canned sentences for its topic (host),
    # not for the first question's (offload)
    host, said = corpus.topic_named("host"), corpus.sentences(msgs[1].content)
    assert corpus.topic_of(EDITED) is host and corpus.topic_of(before[0].content) is not host
    assert edit[-1].status == hist.STATUS_COMPLETE and said[0] == corpus.LABEL
    assert len(said) >= 2 and set(said[1:]) <= set(host.answer) | {corpus.CLOSER}


# ------------------------------------------------------------------------------------------------ which engine (m3)
def _status(settings):
    from engine_manager.supervisor import Supervisor
    return Supervisor(settings).status()


def test_a_program_the_panel_did_not_start_gets_no_request_and_no_key(foreign_server, free_port, monkeypatch):
    from engine_manager.chat import check_target, engine_target
    from engine_manager.settings import load_settings
    monkeypatch.setenv("DSV41_PORT", str(free_port))
    srv = foreign_server(free_port)
    settings = load_settings().settings
    st = _status(settings)
    assert st.external and st.external["pid"] == srv.proc.pid          # what the supervisor's status says …
    with pytest.raises(ChatError) as ei:
        engine_target(settings)
    msg = str(ei.value)
    assert ei.value.kind == "not_ours" and f"pid {srv.proc.pid}" in msg and "http.server" in msg
    assert "not by an engine this panel started" in msg and "API key" in msg and "dsv41 settings set port" in msg
    assert settings.api_key not in msg
    with pytest.raises(ChatError):
        check_target(settings, srv.base_url, settings.api_key)     # the pane's check, same answer
    assert srv.requests() == []                                     # … and nothing was sent there
    # named explicitly (--url), it is the user's call: the request goes, and its HTML 501 is not dumped
    t = engine_target(settings, srv.base_url)
    assert t.explicit and t.base_url == srv.base_url
    assert not t.running().started_by_panel and not t.running().simulated and t.running().pid is None
    with ChatClient(t.base_url, t.api_key) as c, pytest.raises(ChatError) as ei:
        list(c.stream(Q))
    assert ei.value.status == 501 and "web page" in str(ei.value) and "<" not in str(ei.value)
    assert any("POST /v1/chat/completions" in ln for ln in srv.requests())


def test_the_panels_engine_is_the_target_and_a_changed_key_is_caught_before_sending(panel_sim, monkeypatch):
    from engine_manager.chat import engine_target
    from engine_manager.settings import load_settings
    settings = load_settings().settings
    t = engine_target(settings)
    assert t.base_url == panel_sim.base_url and t.api_key == settings.api_key and "the panel started" in t.where
    assert "simulated" in t.where.lower()
    # the handle dsv41 chat talks through: what the supervisor's status says of the engine it started
    running = t.running()
    assert running.base_url == panel_sim.base_url and running.api_key == settings.api_key
    assert running.simulated and running.engine == "sim" and running.started_by_panel
    assert running.pid == panel_sim.pid and running.label == panel_sim.label
    assert settings.api_key not in json.dumps(running.to_dict())
    ended = list(run_turn(hist.HistoryStore(), None, engine=running, user_text="hi",
                          options=ChatOptions(max_tokens=10)))[-1]
    assert ended.status == hist.STATUS_COMPLETE
    monkeypatch.setenv("DSV41_API_KEY", "another-key-0123456789abcdef")
    changed = load_settings().settings
    with pytest.raises(ChatError) as ei:
        engine_target(changed)
    assert ei.value.kind == "key_mismatch" and "dsv41 stop" in str(ei.value)
    assert "another-key" not in str(ei.value)


def test_the_scripted_engine_run_by_hand_is_allowed(start_sim, monkeypatch):
    """``dsv41 sim`` (the scripted engine by hand, with the settings' key) is meant for the panel's chat: it holds
    the port, but it is ours."""
    from engine_manager.chat import engine_target
    from engine_manager.settings import load_settings
    sim = start_sim()
    monkeypatch.setenv("DSV41_PORT", str(sim.port))
    settings = load_settings().settings
    assert _status(settings).external is not None
    t = engine_target(settings)
    assert t.base_url == sim.base_url and "dsv41 sim" in t.where
    running = t.running()
    assert running.simulated and not running.started_by_panel and running.base_url == sim.base_url
    assert running.pid == sim.proc.pid
