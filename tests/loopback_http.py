"""A small HTTP server on 127.0.0.1 for tests that need a counterpart the panel talks to (Python's own
``http.server`` on a daemon thread, port picked by the kernel): the quiet request handler, the OpenAI chat event
stream, and the server's start and stop. Shared by ``attach_support.FixtureServer`` and
``chat_support.RecordingEngine``."""

from __future__ import annotations

import http.server
import json
import threading


class QuietHandler(http.server.BaseHTTPRequestHandler):
    """HTTP/1.1 with keep-alive, no access log on stderr, and ``_send`` for a whole answer with its length."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *_a) -> None:
        pass

    def _send(self, status: int, ctype: str, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def word_deltas(answer: str) -> list[dict]:
    """``answer`` as content deltas, one a word (the space kept with the word before it)."""
    words = answer.split(" ")
    return [{"content": w + (" " if i < len(words) - 1 else "")} for i, w in enumerate(words)]


def chat_stream(deltas: list[dict], prompt_tokens: int) -> bytes:
    """An OpenAI chat event stream: a chunk a delta, then the finish reason with usage (a completion token a
    delta), then ``[DONE]``."""
    frames: list[dict] = [{"choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    frames.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                   "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(deltas),
                             "total_tokens": prompt_tokens + len(deltas)}})
    return b"".join(b"data: " + json.dumps(f).encode() + b"\n\n" for f in frames) + b"data: [DONE]\n\n"


class LoopbackServer:
    """Serves ``handler`` on 127.0.0.1 (a free port) from a daemon thread until :meth:`stop`."""

    def __init__(self, handler: type[http.server.BaseHTTPRequestHandler]):
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
