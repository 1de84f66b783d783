"""A tiny OpenAI-style SSE engine on loopback, for the chat tests while (or where) the scripted engine is not
available. A real separate process: ``python tests/chat_engine_stub.py --api-key K --port-file F [faults]``.

It streams ``reasoning_content`` then ``content`` word by word at ``--tok-s``, then a chunk with finish_reason,
usage and llama.cpp-style timings, then ``[DONE]``. 401 for a wrong key, 400 for ``tools``. Faults:
``--error-after N`` (an ``{"error": ...}`` frame after N tokens), ``--die-after N`` (the process exits after N
tokens), ``--stall-after N`` (stops sending, keeps the connection).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

REASONING = "Let me think about this step by step . The user greets me , so I answer briefly ."
CONTENT = ("Hello ! Here is **bold** text and code :\n\n```python\nprint('hi')\n```\n\nThat is all .")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--port-file")
    ap.add_argument("--api-key", default="")
    ap.add_argument("--tok-s", type=float, default=200.0)
    ap.add_argument("--repeat", type=int, default=1, help="repeat the content this many times")
    ap.add_argument("--error-after", type=int, default=-1)
    ap.add_argument("--die-after", type=int, default=-1)
    ap.add_argument("--stall-after", type=int, default=-1)
    a = ap.parse_args()

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def _json(self, code, obj):
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                self._json(200, {"status": "ok", "loaded": True, "model": "stub", "service": "stub"})
            else:
                self._json(404, {"error": {"message": "not found"}})

        def _chunk(self, obj):
            data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        def do_POST(self):
            n = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(n) or b"{}")
            if a.api_key and self.headers.get("Authorization") != f"Bearer {a.api_key}":
                return self._json(401, {"error": {"type": "authentication_error", "message": "invalid api key"}})
            if body.get("tools"):
                return self._json(400, {"error": {"type": "invalid_request_error",
                                                  "message": "tool calls are not supported"}})
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            ka = b": keep-alive\n\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(ka), ka))
            tokens = [("reasoning_content", w + " ") for w in REASONING.split(" ")]
            tokens += [("content", w + " ") for w in (CONTENT * a.repeat).split(" ")]
            maxt = body.get("max_tokens")
            if isinstance(maxt, int):
                tokens = tokens[:maxt]
            dt = 1.0 / a.tok_s
            t0 = time.perf_counter()
            self._chunk({"choices": [{"index": 0, "delta": {"role": "assistant"}}], "echo": body})
            for i, (kind, text) in enumerate(tokens):
                if i == a.error_after:
                    self._chunk({"error": {"type": "server_error", "message": "simulated engine fault"}})
                    self._chunk(b"[DONE]")
                    self.wfile.write(b"0\r\n\r\n")
                    return
                if i == a.die_after:
                    os._exit(3)
                if i == a.stall_after:
                    time.sleep(3600)
                time.sleep(dt)
                self._chunk({"choices": [{"index": 0, "delta": {kind: text}, "finish_reason": None}]})
            ms = (time.perf_counter() - t0) * 1000
            self._chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop" if maxt is None or
                                      len(tokens) < maxt else "length"}],
                         "usage": {"prompt_tokens": 7, "completion_tokens": len(tokens),
                                   "total_tokens": 7 + len(tokens)},
                         "timings": {"prompt_n": 7, "prompt_ms": 1.0, "prompt_per_second": 7000.0,
                                     "predicted_n": len(tokens), "predicted_ms": ms,
                                     "predicted_per_second": len(tokens) / (ms / 1000)}})
            self._chunk(b"[DONE]")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    srv = ThreadingHTTPServer(("127.0.0.1", a.port), H)
    srv.daemon_threads = True
    if a.port_file:
        tmp = a.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(srv.server_address[1]))
        os.replace(tmp, a.port_file)
    print(f"READY {srv.server_address[1]}", flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    sys.exit(0)


if __name__ == "__main__":
    main()
