"""The scripted engine against Strata's own answers: the REAL sim process (``python -m engine_manager.sim``) is made
idle, generating alone (the solo path), generating batched and reading a prompt, and each of its live answers is
diffed *structurally* against the fixture of the same state in ``tests/data/strata`` (built from Strata's
``serve/server.py`` at commit 2291cb3, field by field; sources in ``tests/data/strata/SOURCES.md``): the same keys,
the same JSON types, the same nulls — the values may differ. Also the SSE frames, FIFO queueing of chat requests
(409 ``model_busy`` only for ``/v1/load``/``/v1/unload``), 401/404 bodies, and HTTP/1.0 with the connection closed
by the server.

The sim's documented differences, and nothing else, are allowed:

* ``EXTRA_KEYS``: the ``simulated`` marker (the panel's label) may appear in any document;
* ``NULL_OK``: GPU temperature and power are not modelled, so the sim reports them null where Strata's NVML
  telemetry has numbers (and Prometheus has no sample for them, as Strata's ``serve/prometheus.py`` skips a null).
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from engine_manager.sim.launch import SimProcess

DATA = Path(__file__).parent / "data" / "strata"
EXTRA_KEYS = {"simulated"}
NULL_OK = {"hardware.gpu_temp", "hardware.gpu_power", "hardware.gpu_power_limit", "history.gpu_temp[]",
           "history.gpu_power[]", "machine.gpu.temp_c", "machine.gpu.power_w"}
PROM_NOT_MODELLED = {"strata:gpu_temp_celsius", "strata:gpu_power_watts"}
GENERAL_Q = "Hello there, how are you today?"


def fixture(name: str) -> Any:
    return json.loads((DATA / name).read_text())


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, (int, float)):
        return "number"
    return type(v).__name__


def shape_diff(want: Any, got: Any, path: str = "") -> list[str]:
    """Where ``got`` differs from ``want`` in keys, JSON types or nullness (values are free)."""
    out: list[str] = []
    kw, kg = _kind(want), _kind(got)
    if kw != kg:
        if path in NULL_OK and kg == "null" and kw != "null":
            return out
        return [f"{path or '<root>'}: Strata has {kw} ({want!r:.60}), the sim {kg} ({got!r:.60})"]
    if isinstance(want, dict):
        missing = sorted(set(want) - set(got))
        extra = sorted(set(got) - set(want) - EXTRA_KEYS)
        if missing:
            out.append(f"{path or '<root>'}: the sim lacks {missing}")
        if extra:
            out.append(f"{path or '<root>'}: the sim adds {extra}")
        for k in sorted(set(want) & set(got)):
            out += shape_diff(want[k], got[k], f"{path}.{k}" if path else k)
    elif isinstance(want, list) and want and got:
        for item in got:
            like = want[0]
            if isinstance(item, dict) and "state" in item:       # slots: compare with a slot of the same state
                like = next((w for w in want if isinstance(w, dict) and w.get("state") == item["state"]), None)
                if like is None:
                    continue
            out += shape_diff(like, item, path + "[]")
    return out


def assert_conforms(fixture_name: str, got: Any) -> None:
    diff = shape_diff(fixture(fixture_name), got)
    assert diff == [], f"{fixture_name}:\n" + "\n".join(diff)


def get(sp: SimProcess, path: str, **headers: str) -> httpx.Response:
    return httpx.get(sp.url(path), headers={**sp.headers, **headers}, timeout=20)


def metrics(sp: SimProcess) -> dict:
    r = get(sp, "/metrics")
    assert r.status_code == 200
    return r.json()


def wait_metrics(sp: SimProcess, pred, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(sp)
        if pred(m):
            return m
        assert time.monotonic() < deadline, f"the sim never reached the state; last live: {m['live']}"
        time.sleep(0.05)


class Stream:
    """A streamed chat request on its own thread: its frames, and a way to drop it (the client goes away)."""

    def __init__(self, sp: SimProcess, content: str = GENERAL_Q, max_tokens: int = 4000):
        self.frames: list[Any] = []
        self.first = threading.Event()
        self.done = threading.Event()
        self.stop = threading.Event()
        self.status: int | None = None
        self.http_version: str | None = None
        self._t = threading.Thread(target=self._run, args=(sp, content, max_tokens), daemon=True)
        self._t.start()

    def _run(self, sp: SimProcess, content: str, max_tokens: int) -> None:
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "stream": True}
        try:
            with httpx.Client(timeout=120) as c, c.stream("POST", sp.url("/v1/chat/completions"), json=body,
                                                          headers=sp.headers) as r:
                self.status, self.http_version = r.status_code, r.http_version
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line[6:]
                        self.frames.append(data if data == "[DONE]" else json.loads(data))
                        if len(self.frames) >= 2:
                            self.first.set()
                    elif line.startswith(":"):
                        self.frames.append(line)
                    if self.stop.is_set():
                        break
        finally:
            self.first.set()
            self.done.set()

    def close(self) -> None:
        self.stop.set()
        self.done.wait(30)


def finish_one(sp: SimProcess, content: str = GENERAL_Q, max_tokens: int = 8) -> dict:
    r = httpx.post(sp.url("/v1/chat/completions"), headers=sp.headers, timeout=60,
                   json={"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens})
    assert r.status_code == 200
    return r.json()


# ------------------------------------------------------------------------------------------------ /metrics
def test_metrics_idle_solo_and_batched_match_stratas_shape(sim_process):
    """--batch 4: idle (every slot listed, tok_s null), one request alone (solo path: all slots idle, outside 1),
    three together (slots reading/decoding with their own tok_s, no hit rate), each against Strata's fixture."""
    sp = sim_process("--slots", "4", "--speed", "3", "--reply-tokens", "100000").wait_ready()
    finish_one(sp)                                             # a finished request: requests[] is not empty
    idle = metrics(sp)
    assert idle["live"]["state"] == "idle" and idle["live"]["tok_s"] is None         # not a stale rate
    assert [s["state"] for s in idle["live"]["slots"]] == ["idle"] * 4
    assert_conforms("metrics_idle.json", idle)

    streams = [Stream(sp)]
    try:
        solo = wait_metrics(sp, lambda m: m["live"]["state"] == "generating" and (m["live"]["generated"] or 0) > 2)
        assert solo["live"]["running"] == 1 and solo["live"]["outside_slots"] == 1
        assert all(s["state"] == "idle" for s in solo["live"]["slots"]) and solo["live"]["tok_s"] > 0
        assert_conforms("metrics_generating_solo.json", solo)

        streams += [Stream(sp), Stream(sp)]
        # a slot decodes from the end of its prompt; its rate exists from its first token on
        batch = wait_metrics(sp, lambda m: sum(s["state"] == "decoding" and s["generated"] > 0
                                               for s in m["live"]["slots"]) == 3)
        busy = [s for s in batch["live"]["slots"] if s["state"] != "idle"]
        assert batch["live"]["running"] == 3 and batch["live"]["outside_slots"] == 0
        assert all(s["tok_s"] is not None and "hit_rate" not in s for s in busy)
        assert_conforms("metrics_generating_batch.json", batch)
        assert_conforms("v1_status.json", get(sp, "/v1/status").json())
        slots = get(sp, "/slots").json()
        assert [s["is_processing"] for s in slots].count(True) == 3 and len(slots) == 4
    finally:
        for s in streams:
            s.close()
    done = wait_metrics(sp, lambda m: m["live"]["state"] == "idle" and m["totals"]["requests"] == 4)
    assert {r["finish"] for r in done["requests"][:3]} == {"disconnect"}        # dropped clients, recorded
    assert all(isinstance(r["hit_rate"], float) and r["hit_rate"] == round(r["hit_rate"], 3)
               for r in done["requests"])
    assert_conforms("metrics_idle.json", done)
    assert_conforms("v1_status_idle.json", get(sp, "/v1/status").json())


def test_one_request_at_a_time_reading_a_long_prompt(sim_process):
    """Without --batch: no slot keys; while a prompt is read, state "reading" with prompt_read/prompt_total, and the
    stream sends `: keep-alive` comments."""
    sp = sim_process("--speed", "1").wait_ready()
    finish_one(sp)
    s = Stream(sp, "word " * 12000, max_tokens=2)                # ~4 modelled (= wall) seconds of reading
    try:
        reading = wait_metrics(sp, lambda m: m["live"]["state"] == "reading" and m["live"]["prompt_read"])
        assert reading["live"]["prompt_total"] >= 12000 and reading["live"]["tok_s"] is None
        assert "slots" not in reading["live"] and "batch_slots" not in reading["engine"]
        assert_conforms("metrics_reading_single.json", reading)
    finally:
        s.done.wait(60)
    assert ": keep-alive" in s.frames and s.frames[-1] == "[DONE]"


def test_prometheus_texts_use_stratas_names(sim_process):
    sp = sim_process("--slots", "4", "--speed", "20").wait_ready()
    finish_one(sp)

    def families(text: str) -> set[str]:
        return set(re.findall(r"^# TYPE (\S+) ", text, re.M))

    vllm = get(sp, "/metrics", Accept="text/plain")
    assert vllm.status_code == 200 and vllm.headers["content-type"].startswith("text/plain")
    want = families((DATA / "prometheus.txt").read_text())
    assert want - PROM_NOT_MODELLED <= families(vllm.text)
    assert families(vllm.text) - want <= {"strata:simulated"}
    assert families(get(sp, "/metrics?format=prometheus").text) == families(vllm.text)
    lc = get(sp, "/metrics/prometheus")
    want = families((DATA / "metrics_prometheus_llamacpp.txt").read_text())
    assert families(lc.text) - {"strata:simulated"} == want


# ------------------------------------------------------------------------------------------------ other documents
def test_health_models_errors_and_status_documents(sim_process):
    sp = sim_process("--speed", "20").wait_ready()
    with httpx.Client(timeout=20) as c:
        for path in ("/health", "/api/health"):
            h = c.get(sp.url(path))                           # open: no key
            assert h.status_code == 200 and h.json()["service"] == "strata-sim" and h.json()["simulated"] is True
            assert_conforms("health.json" if path == "/health" else "api_health.json", h.json())
        r = c.get(sp.url("/metrics"))
        assert r.status_code == 401
        assert r.json() == fixture("error_401.json")           # the same words as Strata
        assert c.get(sp.url("/metrics"), headers={"x-api-key": sp.api_key}).status_code == 200
        r = c.get(sp.url("/no/such/thing"), headers=sp.headers)
        assert r.status_code == 404 and r.json() == fixture("error_404.json")
        assert_conforms("v1_models.json", c.get(sp.url("/v1/models"), headers=sp.headers).json())
    finish_one(sp)
    assert_conforms("v1_status_idle.json", get(sp, "/v1/status").json())


def test_chat_requests_queue_fifo_and_only_load_unload_answer_409(sim_process):
    """One slot: a second chat request waits its turn (live.queued 1, never 409) and is answered once the first
    ends; /v1/unload while a request runs or waits is Strata's 409 model_busy, and 200 when idle."""
    sp = sim_process("--speed", "3", "--reply-tokens", "100000").wait_ready()
    first = Stream(sp)
    second: dict[str, Any] = {}

    def post() -> None:
        second["r"] = httpx.post(sp.url("/v1/chat/completions"), headers=sp.headers, timeout=120,
                                 json={"messages": [{"role": "user", "content": GENERAL_Q}], "max_tokens": 5})

    t = threading.Thread(target=post, daemon=True)
    try:
        assert first.first.wait(30) and first.status == 200
        t.start()
        waiting = wait_metrics(sp, lambda m: m["live"]["queued"] == 1)
        assert waiting["live"]["state"] == "generating" and "r" not in second
        busy = httpx.post(sp.url("/v1/unload"), headers=sp.headers, json={}, timeout=20)
        assert busy.status_code == 409 and busy.json() == fixture("error_409_load_busy.json")
    finally:
        first.close()
    t.join(60)
    assert second["r"].status_code == 200 and second["r"].json()["usage"]["completion_tokens"] == 5
    idle = wait_metrics(sp, lambda m: m["live"]["state"] == "idle" and m["live"]["queued"] == 0)
    assert [r["finish"] for r in idle["requests"][:2]] == ["length", "disconnect"]       # newest first
    r = httpx.post(sp.url("/v1/unload"), headers=sp.headers, json={}, timeout=20)
    assert r.status_code == 200 and r.json()["status"] == "unloaded"
    assert httpx.get(sp.url("/health")).json()["loaded"] is False
    assert_conforms("v1_models_unloaded.json", get(sp, "/v1/models").json())
    finish_one(sp)                                          # a request loads it again (auto_load)
    assert httpx.get(sp.url("/health")).json()["loaded"] is True


# ------------------------------------------------------------------------------------------------ SSE
def _fixture_frames(name: str) -> list[Any]:
    out = []
    for line in (DATA / name).read_text().splitlines():
        if line.startswith("data: "):
            out.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
    return out


def test_sse_frames_match_stratas_stream(sim_process):
    """Role chunk, one chunk per piece, the finish chunk with usage (always: include_usage is ignored) and
    timings, then [DONE] — the same frame shapes as Strata's openai_chunks; the connection is HTTP/1.0."""
    sp = sim_process("--speed", "20").wait_ready()
    s = Stream(sp, GENERAL_Q, max_tokens=30)
    assert s.done.wait(60) and s.status == 200 and s.http_version == "HTTP/1.0"
    want = _fixture_frames("sse_stream.txt")
    got = [f for f in s.frames if f != ": keep-alive"]
    assert got[-1] == "[DONE]" and sum(1 for f in got if isinstance(f, dict) and "usage" in f) == 1
    assert shape_diff(want[0], got[0]) == []                                  # {"role": "assistant", "content": ""}
    assert got[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    pieces = [f for f in got[1:-2] if isinstance(f, dict)]
    assert pieces and all(shape_diff(want[1], f) == [] or shape_diff(want[-3], f) == [] for f in pieces)
    assert shape_diff(want[-2], got[-2]) == [], shape_diff(want[-2], got[-2])    # usage + timings, same keys
    s2 = Stream(sp, GENERAL_Q, max_tokens=3)                                  # stopped by max_tokens
    assert s2.done.wait(60)
    length = [f for f in s2.frames if isinstance(f, dict) and f.get("usage")][0]
    assert length["choices"][0]["finish_reason"] == "length"
    # (that fixture's timings omit draft_n: an engine whose DONE line has no draft fields; the sim's engine reports
    # 0 drafts, so it has them, as sse_stream.txt's engine does - request_timings adds them when reported)
    assert shape_diff(_fixture_frames("sse_stream_length.txt")[-2]["usage"], length["usage"]) == []


def test_a_failure_mid_stream_is_a_server_error_frame_then_done(sim_process):
    sp = sim_process("--speed", "20", "--error-after-tokens", "3").wait_ready()
    s = Stream(sp, GENERAL_Q, max_tokens=30)
    assert s.done.wait(60)
    want = _fixture_frames("sse_error.txt")
    assert s.frames[-1] == "[DONE]" and shape_diff(want[-2], s.frames[-2]) == []
    assert s.frames[-2]["error"]["type"] == "server_error"
    r = httpx.post(sp.url("/v1/chat/completions"), headers=sp.headers, timeout=60,
                   json={"messages": [{"role": "user", "content": GENERAL_Q}], "max_tokens": 30})
    assert r.status_code == 503 and shape_diff(fixture("error_503_engine_died.json"), r.json()) == []


def test_http_1_0_and_the_server_closes_the_connection(sim_process):
    sp = sim_process("--speed", "20").wait_ready()
    with socket.create_connection((sp.host, sp.port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n\r\n")
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:                      # the server closed it, though the client asked to keep it
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") and json.loads(body)["status"] == "ok"
