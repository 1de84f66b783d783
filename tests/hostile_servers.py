"""Hostile servers on loopback: what a broken or malicious engine (or a program on the wrong port) may answer, for
the tests of everything that reads a server — detection, the overview, the monitor's adapters, the chat stream.

``HostileServer(routes, default="openai")`` serves each path (GET or POST, query ignored) with the behaviour named
in ``routes`` (:data:`BEHAVIOURS`), every other path with ``default``; it records each request as
``(method, path, headers)`` in ``requests`` (to check where a key was sent) and is stopped with :meth:`stop`
(also a context manager). Endless answers end when the client goes away or the server stops.

Behaviours (each a function ``(handler, server)``; add one to :data:`BEHAVIOURS` to extend):

- ``openai`` — a well-behaved OpenAI server: ``/v1/models`` lists one model (owned by ``someone``), ``/health``
  200, chat streams "Hello there." then ``[DONE]``; anything else 404;
- ``not_found`` — 404 with a JSON error;
- ``endless`` — 200, no length, bytes for ever; ``huge_length`` — ``Content-Length: 10**12``, then bytes for ever;
- ``drip`` — 200 with a length of 1,000, then one byte a second;
- ``stall`` — 200 headers, then nothing at all;
- ``garbage_json`` — 200 ``application/json`` that is not JSON; ``deep_json`` — 100,000 nested brackets;
- ``echo_key`` — 400 whose error message repeats the ``Authorization`` header sent; ``echo_key_models`` — a
  model list whose one id is that header; ``escape_models`` — model ids with terminal escapes (window title, clear
  screen, a fake line); ``huge_models`` — a ~10 MB model list with its length; ``many_models`` — 20,000 ids in
  under 1 MB;
- ``bad_metrics`` — vLLM's Prometheus names with a negative gauge, NaN, +Inf and two counters of 1e308 (their
  sum overflows);
- the panel's own engines (the monitor's adapters): ``strata_health`` — Strata's ``/health`` (``service``
  ``strata``, ``loaded``); ``strata_metrics`` — a sane Strata JSON ``/metrics`` without GPU figures (the adapter
  then asks ``/v1/status`` too); ``strata_bad_json`` — Strata's JSON ``/metrics`` with impossible numbers (``-3``
  queued, an integer past what a float holds, ``Infinity``); ``llamacpp_bad_slots`` — llama-server's ``/slots``
  with ``n_decoded: Infinity``; ``llamacpp_bad_metrics`` — its ``/metrics`` with a negative queue;
  ``bad_gzip`` — ``Content-Encoding: gzip`` on a body that is not; ``gzip_bomb`` — 256 MB of zeros gzipped to
  ~250 kB (far under the 16 MB cap as sent);
- SSE (chat): ``sse_endless_line`` — ``data: `` then bytes for ever without a newline; ``sse_ping_forever`` —
  ``: ping`` comments for ever; ``sse_empty_frames`` — empty ``data:`` frames for ever; ``sse_tokens_forever`` —
  one-word content deltas for ever, never ``[DONE]``; ``sse_echo_key`` — an error frame repeating the
  ``Authorization`` header; ``sse_content_object`` — a delta whose ``content`` is an object.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from typing import Callable

from loopback_http import LoopbackServer, QuietHandler, chat_stream, word_deltas

MODEL = "hostile/model"
CHUNK = b"x" * 65536


def _headers(h: QuietHandler, status: int, ctype: str, length: int | None = None) -> None:
    h.send_response(status)
    h.send_header("Content-Type", ctype)
    if length is not None:
        h.send_header("Content-Length", str(length))
    else:
        h.send_header("Connection", "close")
        h.close_connection = True
    h.end_headers()


def _forever(h: QuietHandler, srv: "HostileServer", data: bytes, pause_s: float = 0.0) -> None:
    """Write ``data`` again and again until the client goes away or the server stops."""
    try:
        while not srv.stopping.is_set():
            h.wfile.write(data)
            h.wfile.flush()
            if pause_s:
                time.sleep(pause_s)
    except (BrokenPipeError, ConnectionResetError, OSError):
        pass
    h.close_connection = True


def _json(h: QuietHandler, status: int, obj: object) -> None:
    h._send(status, "application/json", json.dumps(obj).encode())


def _auth(h: QuietHandler) -> str:
    return h.headers.get("Authorization", "")


def openai(h: QuietHandler, srv: "HostileServer") -> None:
    path = h.path.split("?")[0]
    if path == "/v1/models":
        _json(h, 200, {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "someone"}]})
    elif path == "/health":
        h._send(200, "text/plain", b"")
    elif path == "/v1/chat/completions" and h.command == "POST":
        h._send(200, "text/event-stream", chat_stream(word_deltas("Hello there."), prompt_tokens=3))
    else:
        _json(h, 404, {"error": {"message": "Not Found"}})


def not_found(h: QuietHandler, srv: "HostileServer") -> None:
    _json(h, 404, {"error": {"message": "Not Found"}})


def endless(h: QuietHandler, srv: "HostileServer") -> None:
    _headers(h, 200, "application/json")
    _forever(h, srv, CHUNK)


def huge_length(h: QuietHandler, srv: "HostileServer") -> None:
    _headers(h, 200, "application/json", 10**12)
    _forever(h, srv, CHUNK)


def drip(h: QuietHandler, srv: "HostileServer") -> None:
    _headers(h, 200, "application/json", 1000)
    _forever(h, srv, b"[", pause_s=1.0)


def stall(h: QuietHandler, srv: "HostileServer") -> None:
    _headers(h, 200, "application/json", 1000)
    srv.stopping.wait()
    h.close_connection = True          # the connection closes when the server stops: the client's read ends


def garbage_json(h: QuietHandler, srv: "HostileServer") -> None:
    h._send(200, "application/json", b'{"data": [oops, \xff\xfe')


def deep_json(h: QuietHandler, srv: "HostileServer") -> None:
    h._send(200, "application/json", b"[" * 100_000 + b"]" * 100_000)


def echo_key(h: QuietHandler, srv: "HostileServer") -> None:
    _json(h, 400, {"error": {"message": f"invalid request: you sent {_auth(h)}"}})


def echo_key_models(h: QuietHandler, srv: "HostileServer") -> None:
    _json(h, 200, {"object": "list", "data": [{"id": f"echo {_auth(h)}", "owned_by": "someone"}]})


ESCAPES = ["\x1b]0;pwned\x07title", "\x1b[2J\x1b[Hcleared", "ok\r\nPack is ready: fake line", "bell\x07\x9b31m"]


def escape_models(h: QuietHandler, srv: "HostileServer") -> None:
    _json(h, 200, {"object": "list", "data": [{"id": e, "owned_by": "someone"} for e in ESCAPES]})


@functools.lru_cache(maxsize=1)
def _huge_models_body() -> bytes:
    ids = [{"id": f"model-{i:08d}-" + "m" * 30, "owned_by": "someone"} for i in range(170_000)]
    return json.dumps({"object": "list", "data": ids}).encode()


def huge_models(h: QuietHandler, srv: "HostileServer") -> None:
    h._send(200, "application/json", _huge_models_body())


def many_models(h: QuietHandler, srv: "HostileServer") -> None:
    _json(h, 200, {"object": "list", "data": [{"id": f"m{i}", "owned_by": "someone"} for i in range(20_000)]})


BAD_METRICS = b"""\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} -7
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} NaN
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} +Inf
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{model_name="m",engine="0"} 1e308
vllm:generation_tokens_total{model_name="m",engine="1"} 1e308
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{model_name="m"} -5
# TYPE vllm:request_success_total counter
vllm:request_success_total{model_name="m"} 12
"""


def bad_metrics(h: QuietHandler, srv: "HostileServer") -> None:
    h._send(200, "text/plain; version=0.0.4", BAD_METRICS)


def strata_health(h: QuietHandler, srv: "HostileServer") -> None:
    _json(h, 200, {"status": "ok", "service": "strata", "loaded": True, "model": MODEL})


def strata_metrics(h: QuietHandler, srv: "HostileServer") -> None:
    _json(h, 200, {"live": {"state": "generating", "tok_s": 12.5, "queued": 1}, "totals": {"requests": 3}})


def strata_bad_json(h: QuietHandler, srv: "HostileServer") -> None:
    # json.dumps writes Infinity for inf, as Strata's Python server would; 10**400 is valid JSON, past any float
    doc = {"live": {"state": "generating", "tok_s": 12.5, "queued": -3, "running": -7},
           "totals": {"requests": 10**400, "output_tokens": -5},
           "hardware": {"gpu_mem_used": -1, "gpu_mem_total": float("inf"), "ram_used": 2**30}}
    _json(h, 200, doc)


def llamacpp_bad_slots(h: QuietHandler, srv: "HostileServer") -> None:
    h._send(200, "application/json", b'[{"id": 0, "id_task": 5, "is_processing": true, "n_ctx": 4096, '
                                     b'"next_token": [{"n_decoded": Infinity}]}]')


LLAMACPP_BAD_METRICS = b"""# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred -2
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 120
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 40
"""


def llamacpp_bad_metrics(h: QuietHandler, srv: "HostileServer") -> None:
    h._send(200, "text/plain; version=0.0.4", LLAMACPP_BAD_METRICS)


def bad_gzip(h: QuietHandler, srv: "HostileServer") -> None:
    body = b"this is not gzip at all"
    h.send_response(200)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Encoding", "gzip")
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    h.wfile.write(body)


@functools.lru_cache(maxsize=1)
def _gzip_bomb_body() -> bytes:
    import zlib

    c = zlib.compressobj(9, zlib.DEFLATED, 31)          # gzip framing
    zeros = b"\0" * (1 << 20)
    return b"".join(c.compress(zeros) for _ in range(256)) + c.flush()     # 256 MB of zeros in ~250 kB


def gzip_bomb(h: QuietHandler, srv: "HostileServer") -> None:
    body = _gzip_bomb_body()
    h.send_response(200)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Encoding", "gzip")
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    h.wfile.write(body)


def _sse(data: object) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


def sse_endless_line(h: QuietHandler, srv: "HostileServer") -> None:
    _headers(h, 200, "text/event-stream")
    h.wfile.write(b"data: ")
    _forever(h, srv, CHUNK)


def sse_ping_forever(h: QuietHandler, srv: "HostileServer") -> None:
    _headers(h, 200, "text/event-stream")
    _forever(h, srv, b": ping\n\n", pause_s=0.05)


def sse_empty_frames(h: QuietHandler, srv: "HostileServer") -> None:
    _headers(h, 200, "text/event-stream")
    _forever(h, srv, b"data: \n\n", pause_s=0.05)


def sse_tokens_forever(h: QuietHandler, srv: "HostileServer") -> None:
    _headers(h, 200, "text/event-stream")
    _forever(h, srv, _sse({"choices": [{"index": 0, "delta": {"content": "word "}, "finish_reason": None}]}),
             pause_s=0.01)


def sse_echo_key(h: QuietHandler, srv: "HostileServer") -> None:
    body = _sse({"error": {"message": f"bad request from {_auth(h)}"}}) + b"data: [DONE]\n\n"
    h._send(200, "text/event-stream", body)


def sse_content_object(h: QuietHandler, srv: "HostileServer") -> None:
    body = _sse({"choices": [{"index": 0, "delta": {"content": {"text": "x"}}, "finish_reason": None}]})
    h._send(200, "text/event-stream", body + b"data: [DONE]\n\n")


Behaviour = Callable[[QuietHandler, "HostileServer"], None]
BEHAVIOURS: dict[str, Behaviour] = {f.__name__: f for f in (
    openai, not_found, endless, huge_length, drip, stall, garbage_json, deep_json, echo_key, echo_key_models,
    escape_models, huge_models, many_models, bad_metrics, sse_endless_line, sse_ping_forever, sse_empty_frames,
    sse_tokens_forever, sse_echo_key, sse_content_object, strata_health, strata_metrics, strata_bad_json,
    llamacpp_bad_slots, llamacpp_bad_metrics, bad_gzip, gzip_bomb)}


class HostileServer(LoopbackServer):
    """Serves ``routes`` (``{path: behaviour name}``), every other path with ``default``."""

    def __init__(self, routes: dict[str, str] | None = None, default: str = "openai"):
        self.routes = {p: BEHAVIOURS[b] for p, b in (routes or {}).items()}
        self.default = BEHAVIOURS[default]
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.stopping = threading.Event()
        srv = self

        class Handler(QuietHandler):
            def _route(self) -> None:
                if self.command == "POST":
                    self.rfile.read(int(self.headers.get("Content-Length") or 0))
                path = self.path.split("?")[0]
                srv.requests.append((self.command, path, dict(self.headers)))
                try:
                    srv.routes.get(path, srv.default)(self, srv)
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True          # the client stopped reading: as it should

            do_GET = _route      # noqa: N815
            do_POST = _route     # noqa: N815

        super().__init__(Handler)

    def sent_to(self, secret: str) -> list[str]:
        """The paths of the requests whose headers held ``secret``."""
        return [p for _m, p, h in self.requests if any(secret in v for v in h.values())]

    def stop(self) -> None:
        self.stopping.set()
        super().stop()

    def __enter__(self) -> "HostileServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
