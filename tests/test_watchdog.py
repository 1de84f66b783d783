"""The liveness watchdog (engine_manager/watchdog.py) through `dsv41 monitor --json` against the scripted engine:
an engine that stops emitting tokens while alive is "stalled"; one that answers but fails every request is
"unavailable"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import psutil
import pytest

from engine_manager import supervisor as sv
from engine_manager.engines.base import Sample
from engine_manager.settings import load_settings
from engine_manager.watchdog import STALLED, Watchdog

ROOT = Path(__file__).resolve().parents[1]


def ask(sp, max_tokens: int) -> None:
    try:
        httpx.post(sp.base_url + "/v1/chat/completions", headers={"Authorization": f"Bearer {sp.api_key}"},
                   json={"messages": [{"role": "user", "content": "How does expert offload work?"}],
                         "max_tokens": max_tokens, "stream": False}, timeout=180)
    except httpx.HTTPError:
        pass                     # the engine is stopped at the end of the test, mid-answer


def monitor_until(base_url: str, api_key: str, want: str, limit_s: float = 120, url: bool = True,
                  then=None) -> tuple[dict | None, list[dict]]:
    """Run `dsv41 monitor --json` on the engine until a line's liveness is ``want`` (or the limit passes);
    ``then()`` runs (on a thread) once the monitor printed its first line."""
    env = {**os.environ, "DSV41_API_KEY": api_key}
    where = ["--url", base_url, "--engine", "sim"] if url else []
    proc = subprocess.Popen([sys.executable, "-m", "engine_manager", "monitor", *where, "--json", "--hz", "2",
                             "--seconds", str(limit_s)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env=env, cwd=str(ROOT))
    seen: list[dict] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            d = json.loads(line)
            seen.append(d["liveness"])
            if then is not None and len(seen) == 1:
                threading.Thread(target=then, daemon=True).start()
            if d["liveness"]["state"] == want:
                return d["liveness"], seen
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    return None, seen


@pytest.fixture
def started(monkeypatch, free_port):
    """The scripted engine started with `dsv41 start` (so the monitor knows its process) with ``flags``."""
    monkeypatch.setenv("DSV41_PORT", str(free_port))

    def go(*flags: str):
        monkeypatch.setenv("DSV41_SIM_ARGS", " ".join(("--load-time 0.2", *flags)))
        cp = subprocess.run([sys.executable, "-m", "engine_manager", "start"], capture_output=True, text=True,
                            timeout=120, cwd=str(ROOT))
        assert cp.returncode == 0, cp.stdout + cp.stderr
        return sv.Supervisor(load_settings().settings).status()

    yield go
    for _ in sv.Supervisor(load_settings().settings).stop(force=True):
        pass


class _Engine:
    def __init__(self, base_url: str, api_key: str):
        self.base_url, self.api_key = base_url, api_key


def test_an_engine_that_stops_emitting_tokens_while_alive_is_stalled(started):
    st = started("--stall-after-tokens 40 --stall-s 300")
    key = load_settings().settings.api_key
    threading.Thread(target=ask, args=(_Engine(st.base_url, key), 400), daemon=True).start()
    live, seen = monitor_until(st.base_url, key, STALLED, url=False)
    assert live is not None, seen[-5:]
    assert any(x["state"] == "ok" for x in seen)                  # it was serving before it stalled
    assert live["since_progress_s"] > live["stall_after_s"] >= 10
    # the engine's CPU time over the stall beside it (its process is known: the panel started it)
    assert live["cpu_time_delta_s"] is not None and "engine CPU time +" in live["detail"]
    assert psutil.pid_exists(st.pid)                              # alive all along: not a crash


def test_an_engine_that_fails_every_request_is_unavailable(sim_process):
    sp = sim_process("--error-after-tokens", "3", "--speed", "5").wait_ready()

    def three() -> None:
        for _ in range(3):
            ask(sp, 50)

    live, seen = monitor_until(sp.base_url, sp.api_key, "unavailable", limit_s=60, then=three)
    assert live is not None, seen[-5:]
    assert live["failed_streak"] >= 3 and "ended in an error" in live["detail"]


def _sample(t: float, state: str, generated: int, tok_s: float | None = None) -> Sample:
    s = Sample(t=t, engine="sim", state=state, decode_tok_s=tok_s, tokens_generated_total=0, requests_total=0)
    s.extra = {"generated": generated}
    return s


def test_the_limit_follows_the_measured_pace_and_progress_resets_it():
    wd = Watchdog()
    assert wd.feed_sample(_sample(0, "generating", 1, 0.5)).state == "ok"      # 2 s a token: 40 s allowed
    assert wd.stall_after_s == 40
    assert wd.feed_sample(_sample(30, "generating", 1)).state == "ok"
    assert wd.feed_sample(_sample(41, "generating", 1)).state == STALLED
    assert wd.feed_sample(_sample(42, "generating", 2)).state == "ok"           # a token: progress again
    assert wd.feed_sample(_sample(100, "idle", 2)).state == "idle"              # nothing in flight: never stalled
    assert Watchdog(stall_after_s=5).feed_sample(_sample(0, "generating", 1, 100.0)).stall_after_s == 5


def test_a_rate_that_falls_while_nothing_moves_does_not_push_the_limit_away():
    # An engine's rate over its last seconds falls while it is stuck (the scripted engine's live.tok_s, Strata's):
    # only a reading whose counters moved teaches the watchdog the pace.
    wd = Watchdog()
    for i in range(5):
        assert wd.feed_sample(_sample(float(i), "generating", 10 * (i + 1), 10.0)).state == "ok"
    assert wd.stall_after_s == 10                                   # 0.1 s a token: the 10 s floor
    for t, tok_s in ((6, 5.0), (8, 1.0), (10, 0.2), (12, 0.1), (15, 0.1)):
        live = wd.feed_sample(_sample(float(t), "generating", 50, tok_s))
    assert wd.token_gap_s == 0.1 and live.state == STALLED and live.since_progress_s == 11


def test_a_step_of_the_wall_clock_is_not_a_stall():
    """A Monitor tick carries its monotonic time; the watchdog measures on it, so the wall clock set an hour
    forward mid-request (NTP, a person) is not an hour without progress — the panel would restart the engine."""
    from engine_manager.desktop_notices import NoticeFilter
    from engine_manager.metrics.hub import Tick

    wall, mono = 1_800_000_000.0, 500.0
    wd = Watchdog()
    notices = NoticeFilter(Watchdog())
    for i in range(6):                                     # a prompt being read: nothing counted moves for a while
        step = 3600.0 if i == 3 else 0.0
        wall += 1.0 + step
        mono += 1.0
        s = _sample(wall, "reading", 10, 10.0)
        tick = Tick(seq=i, t=wall, mono=mono, values={}, engine="sim", sample=s)
        live = wd.feed_tick(tick)
        assert live.state == "ok" and (live.since_progress_s or 0) <= 6, live
        assert notices.sample(tick.to_sample()) is None
        assert notices.watchdog.last is not None and notices.watchdog.last.state == "ok"
    wd2 = Watchdog()                                       # the same wall times without the monotonic clock
    wall = 1_800_000_000.0
    for i in range(6):
        wall += 1.0 + (3600.0 if i == 3 else 0.0)
        live = wd2.feed_sample(_sample(wall, "reading", 10, 10.0))
    assert live.state == STALLED                           # what the step alone reads as
