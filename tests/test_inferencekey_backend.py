"""The InferenceKey custom backend served by the SDK's real runtime, on real engines, loopback only.

``python -m inferencekey.backend.serve --port P --backend engine_manager.inferencekey.backend:DeepSeekOneGpuBackend``
is what a worker runs (inferencekey/backend/serve.py ``main``): GET /healthz (503 until setup() returns), GET /meta,
POST /process (InvalidInput → 400, any other exception → 500 with the server alive). The engine is the scripted
engine (no GPU here); a strata start on this machine is refused by the planner with the numbers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("inferencekey")

from engine_manager import paths  # noqa: E402
from engine_manager.inferencekey import ENTRYPOINT, SLUG  # noqa: E402
from engine_manager.procs import alive, free_port  # noqa: E402

pytestmark = pytest.mark.slow
TESTS = Path(__file__).parent
REPO = TESTS.parent


class Backend:
    """One ``python -m inferencekey.backend.serve`` process, its output in a file."""

    def __init__(self, tmp_path: Path, backend: str = ENTRYPOINT, **env: str):
        self.port = free_port("127.0.0.1")
        self.out = tmp_path / f"backend-{self.port}.log"
        e = dict(os.environ)
        e.update({"DSV41_PORT": str(free_port("127.0.0.1")), "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS)]),
                  "PYTHONUNBUFFERED": "1"})
        e.update(env)
        self.f = open(self.out, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "inferencekey.backend.serve", "--port", str(self.port),
                                      "--backend", backend], stdout=self.f, stderr=subprocess.STDOUT, env=e,
                                     cwd=str(tmp_path), start_new_session=True)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", trust_env=False, timeout=120)

    def text(self) -> str:
        return self.out.read_text(encoding="utf-8", errors="replace")

    def wait_up(self, timeout: float = 240.0) -> list[int]:
        """Poll /healthz until 200; the codes seen (503 while setup() runs)."""
        seen: list[int] = []
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            assert self.proc.poll() is None, f"the backend exited ({self.proc.returncode}):\n{self.text()}"
            try:
                code = self.http.get("/healthz", timeout=5).status_code
            except httpx.TransportError:
                time.sleep(0.1)
                continue
            if not seen or seen[-1] != code:
                seen.append(code)
            if code == 200:
                return seen
            time.sleep(0.1)
        raise AssertionError(f"not ready in {timeout} s:\n{self.text()}")

    def job(self, job_id: str, **inp) -> httpx.Response:
        return self.http.post("/process", json={"id": job_id, "input": inp}, timeout=300)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self.http.close()
        self.f.close()


def engine_record() -> dict:
    return json.loads((paths.data_dir() / "engine-state.json").read_text())


def engine_key() -> str:
    return json.loads((paths.data_dir() / "inferencekey" / "backend-settings.json").read_text())["api_key"]


def wait_gone(pid: int, timeout: float = 60.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not alive(pid):
            return True
        time.sleep(0.2)
    return False


@pytest.fixture
def backends(tmp_path):
    made: list[Backend] = []

    def start(*a, **kw) -> Backend:
        b = Backend(tmp_path, *a, **kw)
        made.append(b)
        return b

    yield start
    for b in made:
        b.stop()
    try:                                  # nothing of a test may outlive it: the engine it started included
        rec = engine_record()
    except (OSError, ValueError):
        return
    if rec.get("pgid") and alive(rec.get("keeper_pid")):
        os.killpg(rec["pgid"], signal.SIGKILL)


def test_serves_on_the_scripted_engine_batches_survives_a_crash_and_dies_with_the_engine(backends):
    b = backends(DSV41_SIM_ARGS="--load-time 3 --speed 4 --reply-tokens 100000", DSV41_CONTEXT_LENGTH="8192",
                 DSV41_SLOTS="4", DSV41_DEFAULT_MAX_TOKENS="48")
    seen = b.wait_up()
    assert seen[0] == 503 and seen[-1] == 200, seen        # 503 while setup() downloads/plans/starts, then 200
    log = b.text()
    assert "model loaded" in log and "SIMULATED" in log and "binding" in log.lower()

    meta = b.http.get("/meta").json()
    assert meta["name"] == SLUG and meta["task_type"] == "text2text"

    # DSV41_* overrides reached the engine's command line (through the panel's settings model)
    argv = engine_record()["argv"]
    assert argv[argv.index("--slots") + 1] == "4" and argv[argv.index("--max-context") + 1] == "8192", argv

    r = b.job("prompt", prompt="How does expert offload work?")
    assert r.status_code == 200, r.text
    out = r.json()["output"]
    assert out["text"] and out["finish_reason"] in ("stop", "length")
    assert out["usage"]["completion_tokens"] == 48          # DSV41_DEFAULT_MAX_TOKENS when the job gives none
    assert out["usage"]["prompt_tokens"] > 0 and out["timings"]["engine_tok_s"] > 0 and out["simulated"] is True

    r = b.job("chat", messages=[{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "What is a hot set?"}], max_tokens=20,
              reasoning_effort="none", strata_reproducible=True)
    assert r.status_code == 200, r.text
    assert r.json()["output"]["usage"]["completion_tokens"] <= 20

    # 4 jobs at once: all answered, and the engine held them in its slots together (batched)
    results: dict[str, httpx.Response] = {}
    busy_max = 0
    key = engine_key()
    base = f"http://127.0.0.1:{engine_record()['port']}"

    def send(i: int) -> None:
        results[f"c{i}"] = b.job(f"c{i}", prompt=f"Question number {i} about routing", max_tokens=150)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    with httpx.Client(trust_env=False, headers={"Authorization": f"Bearer {key}"}, timeout=10) as eng:
        while any(t.is_alive() for t in threads):
            slots = eng.get(f"{base}/slots").json()
            busy_max = max(busy_max, sum(1 for s in slots if s.get("is_processing")))
            time.sleep(0.05)
    for t in threads:
        t.join()
    assert sorted(results) == ["c0", "c1", "c2", "c3"]
    assert all(r.status_code == 200 and r.json()["output"]["text"] for r in results.values())
    assert busy_max >= 2, busy_max

    # tools are refused with 400; a job with no text too; the server stays up
    r = b.job("tools", prompt="call it", tools=[{"type": "function", "function": {"name": "f"}}])
    assert r.status_code == 400 and "tools" in r.json()["error"]
    assert b.job("empty").status_code == 400
    assert b.job("bad", prompt="x", max_tokens=0).status_code == 400

    # the engine killed mid-job: that job is a 500, the engine is restarted, the next job is answered
    first_engine = engine_record()["pid"]
    box: dict[str, httpx.Response] = {}
    t = threading.Thread(target=lambda: box.update(r=b.job("long", prompt="Tell me everything", max_tokens=4000)))
    t.start()
    time.sleep(1.5)
    os.kill(first_engine, signal.SIGKILL)
    t.join()
    assert box["r"].status_code == 500, box["r"].text
    r = b.job("after", prompt="Are you back?", max_tokens=16)
    assert r.status_code == 200, r.text + b.text()
    second_engine = engine_record()["pid"]
    assert second_engine != first_engine and alive(second_engine)

    # the backend SIGKILLed: nothing holds the engine after it (the watchdog stops it)
    os.killpg(b.proc.pid, signal.SIGKILL)
    b.proc.wait(30)
    assert wait_gone(second_engine), b.text()
    assert "stopping the engine it started" in b.text()


def test_an_answer_that_cannot_finish_in_the_limit_is_answered_before_it_and_sigterm_stops_the_engine(backends):
    b = backends("inferencekey_backends:ShortLimit", DSV41_SIM_ARGS="--reply-tokens 100000 --speed 1")
    b.wait_up()
    from inferencekey_backends import ShortLimit

    for i in range(2):      # the first is cut by the timer; the second by the rate the first measured
        r = b.job(f"long{i}", prompt="Write a very long essay", max_tokens=30000)
        assert r.status_code == 200, r.text
        out = r.json()["output"]
        assert out["finish_reason"] == "time_limit", out
        assert "limit" in out["note"] and out["text"]
        assert out["timings"]["total_s"] < ShortLimit.REQUEST_LIMIT_S
        if i == 1:                                   # cut before it was sent, from the measured rate
            assert "at the measured" in out["note"], out["note"]
    engine = engine_record()["pid"]
    os.killpg(b.proc.pid, signal.SIGTERM)           # the runtime's clean shutdown: atexit stops the engine
    assert b.proc.wait(60) == 0, b.text()
    assert wait_gone(engine), b.text()
    assert "stopping the engine this backend started" in b.text()


def test_a_host_below_the_minimum_fails_setup_with_the_numbers(backends):
    b = backends(DSV41_SERVER_ENGINE="strata")       # no GPU, ~24 GB RAM: far below the minimum layout
    rc = b.proc.wait(240)
    out = b.text()
    assert rc != 0, out
    assert "setup() failed" in out and "cannot hold the model's minimum layout" in out
    assert "RAM cannot hold the minimum layout" in out and "GB short" in out and "missing" in out
    assert not (paths.data_dir() / "engine-state.json").exists() or not alive(engine_record().get("pid"))


@pytest.mark.llamacpp
@pytest.mark.timeout(400)
def test_serves_on_stock_llamacpp_with_the_tiny_moe_and_dies_with_it(backends, tmp_path):
    """The same backend on a real llama-server (the ``[llamacpp]`` extra) serving the tiny MoE GGUF: setup() plans
    and starts it, /process answers a prompt and chat messages with the engine's own token counts, tools are refused,
    a killed engine is one 500 and then a good answer, and SIGTERM to the runtime stops the engine."""
    from conftest import require_or_skip

    from engine_manager import llamacpp_bin
    from engine_manager.testing.tinymoe import write_tinymoe

    try:
        llamacpp_bin.find_llama_server()
    except llamacpp_bin.LlamaServerNotFound as exc:
        require_or_skip(f"llama-server is not installed: {exc}")
    model = write_tinymoe(tmp_path / "tinymoe")
    b = backends(DSV41_SERVER_ENGINE="llamacpp", DSV41_LLAMACPP_MODEL=str(model), DSV41_SLOTS="2",
                 DSV41_CONTEXT_LENGTH="4096", DSV41_DEFAULT_MAX_TOKENS="24")
    seen = b.wait_up(300)
    assert seen[-1] == 200, seen
    log = b.text()
    assert "engine: llamacpp" in log and "SIMULATED" not in log, log
    assert engine_record()["engine"] == "llamacpp"

    r = b.job("prompt", prompt="Say something.")
    assert r.status_code == 200, r.text
    out = r.json()["output"]
    assert isinstance(out["text"], str) and out["finish_reason"] in ("stop", "length")
    assert 0 < out["usage"]["completion_tokens"] <= 24 and out["usage"]["prompt_tokens"] > 0
    assert out["simulated"] is False and out["timings"]["engine_tok_s"] > 0

    r = b.job("chat", messages=[{"role": "user", "content": "Hello there"}], max_tokens=8)
    assert r.status_code == 200, r.text
    assert 0 < r.json()["output"]["usage"]["completion_tokens"] <= 8
    r = b.job("tools", prompt="call it", tools=[{"type": "function", "function": {"name": "f"}}])
    assert r.status_code == 400 and "tools" in r.json()["error"]

    # the engine killed mid-job: that job is a 500, the engine is restarted, the next job is answered
    first_engine = engine_record()["pid"]
    box: dict[str, httpx.Response] = {}
    t = threading.Thread(target=lambda: box.update(r=b.job("long", prompt="Go on and on", max_tokens=3500)))
    t.start()
    end = time.monotonic() + 60                  # until the engine is busy with it (its /slots says so)
    key, base = engine_key(), f"http://127.0.0.1:{engine_record()['port']}"
    with httpx.Client(trust_env=False, headers={"Authorization": f"Bearer {key}"}, timeout=10) as eng:
        while time.monotonic() < end and t.is_alive():
            try:
                if any(s.get("is_processing") for s in eng.get(f"{base}/slots").json()):
                    break
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.02)
    os.kill(first_engine, signal.SIGKILL)
    t.join(120)
    assert box["r"].status_code == 500 and "engine_died" in box["r"].text, box["r"].text
    r = b.job("after", prompt="Are you back?", max_tokens=8)
    assert r.status_code == 200, r.text + b.text()
    second_engine = engine_record()["pid"]
    assert second_engine != first_engine and alive(second_engine)

    os.killpg(b.proc.pid, signal.SIGTERM)           # the runtime's clean shutdown: the engine goes with it
    assert b.proc.wait(60) == 0, b.text()
    assert wait_gone(second_engine), b.text()
