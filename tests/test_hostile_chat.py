"""The chat path against hostile servers on loopback: endless lines and events, endless error bodies, keep-alives
and empty frames for ever, tokens past max_tokens without an end, malformed chunks, a key echoed back, impossible
numbers and terminal escapes. Each server is a real socket server (:class:`HostileServer`) that streams what a
test gives it until the client goes away (or a bound: a test that fails must fail, not hang)."""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Iterable, Iterator

import pytest
from chat_support import ROOT

from engine_manager import history as hist
from engine_manager.chat import (
    ChatClient, ChatError, ChatOptions, ContentDelta, StreamDone, TimingsInfo, UsageInfo,
)
from engine_manager.chat_turn import TurnEnded, run_turn
from engine_manager.engine_state import RunningEngine
from engine_manager.engines._http import SSE_LINE_CAP

Q = [{"role": "user", "content": "hello"}]
KEY = "sk-hostile-test-0123456789abcdef"
SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
SEND_BOUND = 256 * 1024 * 1024        # the most any server here sends: an unbounded client fails, it does not hang


def frame(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def delta(**d) -> bytes:
    return frame({"choices": [{"index": 0, "delta": d, "finish_reason": None}]})


def last(finish: str = "stop", **usage) -> bytes:
    return (frame({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}], "usage": usage})
            + b"data: [DONE]\n\n")


class HostileServer:
    """A loopback server: ``POST /v1/chat/completions`` gets ``head`` then the pieces of ``body()`` (a fresh
    iterator per request, maybe endless; ``pause_s`` between pieces) until the client goes away or SEND_BOUND;
    anything else (the client's ``GET /health`` probe) gets a small 200. Counts what it sent and keeps the
    request bodies."""

    def __init__(self, head: bytes, body: Callable[[], Iterable[bytes]], pause_s: float = 0.0):
        self.head, self.body, self.pause_s = head, body, pause_s
        self.sent = 0
        self.bodies: list[dict] = []
        self.done = threading.Event()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                got = conn.recv(65536)
                if not got:
                    return
                data += got
            head, _, rest = data.partition(b"\r\n\r\n")
            if not head.startswith(b"POST /v1/chat/completions"):
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
                             b"Connection: close\r\n\r\n{}")
                return
            n = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
            while len(rest) < n:
                rest += conn.recv(65536)
            self.bodies.append(json.loads(rest))
            try:
                conn.sendall(self.head)
                for piece in self.body():
                    conn.sendall(piece)
                    self.sent += len(piece)
                    if self.sent > SEND_BOUND:
                        break
                    if self.pause_s:
                        time.sleep(self.pause_s)
            except OSError:
                pass                        # the client went away: what a bounded client does
            finally:
                self.done.set()

    def stop(self) -> None:
        self.sock.close()


@pytest.fixture
def hostile():
    made: list[HostileServer] = []

    def make(head: bytes, body: Callable[[], Iterable[bytes]], pause_s: float = 0.0) -> HostileServer:
        srv = HostileServer(head, body, pause_s)
        made.append(srv)
        return srv

    yield make
    for srv in made:
        srv.stop()


def forever(piece: bytes, first: bytes = b"") -> Callable[[], Iterator[bytes]]:
    return lambda: itertools.chain([first] if first else [], itertools.repeat(piece))


def for_seconds(piece: bytes, seconds: float, first: bytes = b"") -> Callable[[], Iterator[bytes]]:
    """``first``, then ``piece`` again and again for ``seconds``: then the stream just ends (no [DONE]), so a client
    that waits for the end fails the test instead of hanging it."""
    def body() -> Iterator[bytes]:
        if first:
            yield first
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            yield piece
    return body


def fail(srv: HostileServer, options: ChatOptions | None = None, **kw) -> tuple[ChatError, list]:
    """Stream from ``srv`` until it raises; the ChatError and the events that came first."""
    got: list = []
    with ChatClient(srv.url, KEY, **kw) as c, pytest.raises(ChatError) as ei:
        for ev in c.stream(Q, options or ChatOptions(max_tokens=50)):
            got.append(ev)
    return ei.value, got


def no_python_words(text: str) -> None:
    for bad in ("object has no attribute", "Traceback", "Error:", "<class", "'str'", "'dict'", "'list'"):
        assert bad not in text, text


# ------------------------------------------------------------------------------------------------ size caps
def test_a_line_that_never_ends_is_capped(hostile):
    srv = hostile(SSE_HEAD, forever(b"x" * 65536, first=delta(content="Hi") + b"data: "))
    err, got = fail(srv)
    assert err.kind == "too_large" and "sent a line longer than 1 MB" in str(err) and srv.url in str(err)
    assert "".join(e.text for e in got if isinstance(e, ContentDelta)) == "Hi"
    assert srv.sent < 64 * SSE_LINE_CAP                  # stopped near the cap, not at the server's bound


def test_an_event_of_short_lines_that_never_ends_is_capped(hostile):
    srv = hostile(SSE_HEAD, forever(b"data: x\n" * 8192))        # data lines, never the blank line ending them
    err, _ = fail(srv)
    assert err.kind == "too_large" and "an event longer than 1 MB" in str(err)
    assert srv.sent < 64 * SSE_LINE_CAP


def test_an_endless_error_body_is_read_only_up_to_its_cap(hostile):
    head = b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n"
    srv = hostile(head, forever(b"the request is wrong " * 3000))
    err, _ = fail(srv)
    assert err.kind == "bad_request" and "the request is wrong" in str(err)
    assert srv.sent < 64 * SSE_LINE_CAP
    assert len(str(err)) < 2000                         # the engine's words are quoted, not its whole body


def test_an_answer_sent_whole_as_json_is_read_and_capped(hostile):
    answer = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Whole answer.",
                                                   "reasoning_content": "Thought."}, "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}
    data = json.dumps(answer).encode()
    head = (f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
            f"Connection: close\r\n\r\n").encode()
    srv = hostile(head, lambda: [data])
    with ChatClient(srv.url, KEY) as c:
        content, reasoning, stats = c.complete(Q, ChatOptions(max_tokens=50))
    assert (content, reasoning) == ("Whole answer.", "Thought.")
    assert stats.completion_tokens == 4 and stats.finish_reason == "stop"
    # the same without an end: refused at its cap, never read whole
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n"
    big = hostile(head, forever(b'{"choices": [' + b" " * 65536, ))
    err, _ = fail(big, ChatOptions(max_tokens=5))
    assert err.kind == "too_large" and "larger than 1 MB" in str(err)
    assert big.sent < 64 * SSE_LINE_CAP


# ------------------------------------------------------------------------------------------------ never ending
def test_keep_alives_after_the_first_token_do_not_hold_the_chat(hostile):
    srv = hostile(SSE_HEAD, for_seconds(b": ping\n\n", 30, first=delta(content="One")), pause_s=0.05)
    err, got = fail(srv, read_timeout_s=1.0)
    assert err.kind == "stalled" and "sent no token for 1 s" in str(err) and "keep-alives" in str(err)
    assert [e.text for e in got if isinstance(e, ContentDelta)] == ["One"]
    assert err.stats is not None and err.stats.completion_tokens == 1


def test_empty_frames_after_the_first_token_do_not_hold_the_chat(hostile):
    srv = hostile(SSE_HEAD, for_seconds(delta(), 30, first=delta(content="One") + delta(content="")), pause_s=0.01)
    err, _ = fail(srv, read_timeout_s=1.0)
    assert err.kind == "stalled" and "sent no token for 1 s" in str(err)


def test_keep_alives_before_the_first_token_count_only_until_the_first_token_deadline(hostile):
    srv = hostile(SSE_HEAD, for_seconds(b": keep-alive\n\n", 30), pause_s=0.05)
    err, got = fail(srv, read_timeout_s=0.5, first_token_deadline_s=2.0)
    assert err.kind == "stalled" and "sent no token within 2 s of the question" in str(err)
    assert not any(isinstance(e, ContentDelta) for e in got)


def test_tokens_past_max_tokens_without_an_end_are_cut_off_and_saved_as_such(hostile):
    srv = hostile(SSE_HEAD, forever(delta(content="more ")), pause_s=0.001)
    store = hist.HistoryStore()
    events = list(run_turn(store, None, engine=RunningEngine(srv.url, KEY), user_text="count for ever",
                           options=ChatOptions(max_tokens=5), read_timeout_s=5.0))
    ended = events[-1]
    assert isinstance(ended, TurnEnded) and ended.error_kind == "overrun" and ended.saved
    assert "cut off" in ended.error and "max tokens 5" in ended.error
    n = sum(isinstance(e, ContentDelta) for e in events)
    assert 5 < n <= 5 + 64
    msg = store.message(ended.assistant_message_id)
    assert msg.status == hist.STATUS_INTERRUPTED and msg.content == "more " * n
    assert "cut off" in msg.error


# ------------------------------------------------------------------------------------------------ malformed
MALFORMED = [
    ("content-object", delta(content={"text": "hi"}), "`choices[0].delta.content` is an object"),
    ("content-list", delta(content=["h", "i"]), "`choices[0].delta.content` is a list"),
    ("reasoning-object", delta(reasoning_content={"t": 1}), "`choices[0].delta.reasoning_content` is an object"),
    ("choices-text", frame({"choices": "hi"}), "`choices` is text"),
    ("choice-text", frame({"choices": ["hi"]}), "`choices[0]` is text"),
    ("delta-text", frame({"choices": [{"delta": "hi"}]}), "`choices[0].delta` is text"),
    ("frame-list", frame([1, 2]), "a frame is a list"),
]


@pytest.mark.parametrize("name,bad,words", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_a_malformed_chunk_is_a_protocol_error_in_plain_words(hostile, name, bad, words):
    srv = hostile(SSE_HEAD, lambda: [delta(content="Before. "), bad, last(completion_tokens=2)])
    err, _ = fail(srv)
    assert err.kind == "protocol" and words in str(err) and "malformed" in str(err)
    no_python_words(str(err))
    # recorded: the answer so far is kept, marked interrupted with the same words (never "internal")
    store = hist.HistoryStore()
    ended = list(run_turn(store, None, engine=RunningEngine(srv.url, KEY), user_text="q",
                          options=ChatOptions(max_tokens=50)))[-1]
    assert ended.error_kind == "protocol" and words in ended.error
    msg = store.message(ended.assistant_message_id)
    assert msg.status == hist.STATUS_INTERRUPTED and msg.content == "Before. "
    no_python_words(msg.error)


# ------------------------------------------------------------------------------------------------ the key
def test_a_key_echoed_in_a_400_body_is_masked(hostile):
    body = json.dumps({"error": {"message": f"bad header Authorization: Bearer {KEY}"}}).encode()
    head = (f"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n").encode()
    srv = hostile(head, lambda: [body])
    err, _ = fail(srv)
    assert err.kind == "bad_request" and KEY not in str(err) and KEY not in (err.engine_message or "")
    assert "bad header Authorization: Bearer sk-h…(masked)" in str(err)


def test_a_key_echoed_in_an_error_frame_is_masked_in_the_history_and_its_export(hostile):
    srv = hostile(SSE_HEAD, lambda: [delta(content="Partial "),
                                     frame({"error": {"type": "server_error", "message": f"key {KEY} revoked"}}),
                                     b"data: [DONE]\n\n"])
    store = hist.HistoryStore()
    ended = list(run_turn(store, None, engine=RunningEngine(srv.url, KEY), user_text="q",
                          options=ChatOptions(max_tokens=50)))[-1]
    assert ended.error_kind == "stream_error" and KEY not in ended.error and "revoked" in ended.error
    cid = ended.conversation_id
    assert KEY not in store.export_markdown(cid) and KEY not in json.dumps(store.export_json(cid))
    assert KEY not in store.message(ended.assistant_message_id).error


# ------------------------------------------------------------------------------------------------ numbers
def test_impossible_usage_and_timings_are_missing_and_the_turn_is_complete(hostile):
    tail = (b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], '
            b'"usage": {"prompt_tokens": NaN, "completion_tokens": 1e999, "total_tokens": -7}, '
            b'"timings": {"predicted_per_second": Infinity, "prompt_per_second": -3.5, "predicted_n": 1e999, '
            b'"prompt_n": 12}}\n\ndata: [DONE]\n\n')
    srv = hostile(SSE_HEAD, lambda: [delta(content="Fine "), delta(content="answer."), tail])
    with ChatClient(srv.url, KEY) as c:
        events = list(c.stream(Q, ChatOptions(max_tokens=50)))
    usage = next(e for e in events if isinstance(e, UsageInfo))
    timings = next(e for e in events if isinstance(e, TimingsInfo))
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (None, None, None)
    assert (timings.predicted_per_second, timings.prompt_per_second, timings.predicted_n) == (None, None, None)
    assert timings.prompt_n == 12
    stats = events[-1].stats
    assert isinstance(events[-1], StreamDone) and stats.completion_tokens == 2 and stats.engine_tok_s is None
    store = hist.HistoryStore()
    ended = list(run_turn(store, None, engine=RunningEngine(srv.url, KEY), user_text="q",
                          options=ChatOptions(max_tokens=50)))[-1]
    assert ended.status == hist.STATUS_COMPLETE and ended.error is None
    saved = store.message(ended.assistant_message_id)
    assert saved.status == hist.STATUS_COMPLETE and saved.stats["timings"] == {"prompt_n": 12}


# ------------------------------------------------------------------------------------------------ dsv41 chat
def dsv41(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    env["DSV41_API_KEY"] = KEY
    return subprocess.run([sys.executable, "-m", "engine_manager", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def dsv41_chat(url: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return dsv41("chat", "--url", url, *args, timeout=timeout)


def test_dsv41_chat_ends_on_an_endless_stream_and_saves_the_answer_as_cut_off(hostile):
    srv = hostile(SSE_HEAD, forever(delta(content="tok ")), pause_s=0.001)
    r = dsv41_chat(srv.url, "--timeout", "5", "--max-tokens", "5", "count for ever")
    assert r.returncode == 1 and "cut off" in r.stderr and "saved in conversation 1" in r.stderr
    [_q, a] = hist.HistoryStore().messages(1)
    assert a.status == hist.STATUS_INTERRUPTED and a.content.startswith("tok tok tok tok tok tok")
    # keep-alives after a token: ended after --timeout, not held by them
    pings = hostile(SSE_HEAD, for_seconds(b": ping\n\n", 60, first=delta(content="One")), pause_s=0.05)
    r = dsv41_chat(pings.url, "--timeout", "2", "--max-tokens", "5", "ping me")
    assert r.returncode == 1 and "sent no token for 2 s" in r.stderr


def test_dsv41_chat_escapes_terminal_control_from_the_server(hostile):
    evil = "\x1b]0;pwned\x07\x1b[2J\x1b[1A"
    srv = hostile(SSE_HEAD, lambda: [delta(reasoning_content=f"think{evil}"), delta(content=f"Answer{evil}\nline 2"),
                                     frame({"error": {"message": f"engine says{evil}"}}), b"data: [DONE]\n\n"])
    r = dsv41_chat(srv.url, "q")
    assert r.returncode == 1
    assert "\x1b" not in r.stdout and "\x07" not in r.stdout and "\x1b" not in r.stderr
    assert "Answer\\x1b]0;pwned\\x07" in r.stdout and "line 2" in r.stdout      # newlines of the answer kept
    assert "engine says\\x1b" in r.stderr
    for args in (("history", "show", "1"), ("history", "list"), ("history", "search", "Answer")):
        r = dsv41(*args)
        assert r.returncode == 0 and "\x1b" not in r.stdout and "\x07" not in r.stdout, (args, r.stdout)
    assert "\x1b" in hist.HistoryStore().messages(1)[1].content       # saved as the engine sent it


def test_an_answer_cut_by_the_inferencekey_time_limit_says_so_in_the_cli_and_the_pane(hostile):
    """finish_reason "time_limit" (the InferenceKey backend answered before the worker's limit per request): the CLI
    and the chat pane's footer give the same reason (StreamStats.end_note), each with its own way to ask for less."""
    from engine_manager.chat_events import StreamStats

    srv = hostile(SSE_HEAD, lambda: [delta(content="partial "), delta(content="answer"),
                                     last("time_limit", prompt_tokens=4, completion_tokens=2, total_tokens=6)])
    r = dsv41_chat(srv.url, "--max-tokens", "50", "q")
    assert r.returncode == 0, r.stderr
    assert "time limit per request: ask for fewer tokens (--max-tokens)" in r.stderr
    saved = hist.HistoryStore().messages(1)[1]
    pane = StreamStats.from_dict(saved.stats).end_note(50, gui=True)
    assert pane == "answered before the InferenceKey worker's time limit per request: ask for fewer tokens in Options"
    assert StreamStats(completion_tokens=9, finish_reason="stop").end_note(50) is None


@pytest.mark.parametrize("completion,words,not_words", [
    (3, "ended the answer at 3 tokens, before --max-tokens 50", "stopped at --max-tokens"),
    (50, "stopped at --max-tokens 50", "before --max-tokens"),
])
def test_dsv41_chat_says_stopped_at_max_tokens_only_when_the_count_reached_it(hostile, completion, words,
                                                                               not_words):
    """Strata answers finish_reason "length" for max_tokens, and also for a reply that repeats one token 256 times
    or whose thinking loops (serve/server.py@2291cb3 Service.run): the count decides which."""
    srv = hostile(SSE_HEAD, lambda: [delta(content="a "), delta(content="b "), delta(content="c"),
                                     last("length", prompt_tokens=4, completion_tokens=completion,
                                          total_tokens=4 + completion)])
    r = dsv41_chat(srv.url, "--max-tokens", "50", "q")
    assert r.returncode == 0, r.stderr
    assert words in r.stderr and not_words not in r.stderr
