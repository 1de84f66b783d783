"""The Qt-free card presenter (``engine_manager.metrics.presenter``): what the Monitor's cards, its status line and
``dsv41 monitor`` say, from ticks of a REAL scripted engine process and from ticks built field by field for the
cases an engine cannot be made to show on demand (a Strata sample, every source missing)."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from engine_manager import metrics as M
from engine_manager.engines.base import Sample
from engine_manager.metrics import presenter as P
from engine_manager.engine_state import RunningEngine


def tick(t: float | None = None, engine: str = "strata", simulated: bool = False, **values) -> M.Tick:
    v = {c: None for c in M.COLUMN_NAMES}
    v.update(values)
    return M.Tick(seq=1, t=time.time() if t is None else t, values=v, engine=engine, simulated=simulated)


def test_the_presenter_never_imports_qt():
    code = ("import sys, engine_manager.metrics.presenter, engine_manager.cli.monitor\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('PySide6', 'shiboken6', 'pyqtgraph', 'superqt', 'app'))\n"
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == ""


def test_wording_figures_leaves_numpy_to_the_hub_and_the_store():
    """The presenter and the guides (the Monitor's cards, the Placement tab, the panel's first step) import
    neither numpy nor the hub; the package's other names are there on first use, with their real values."""
    code = ("import sys\n"
            "import engine_manager.metrics as M\n"
            "from engine_manager.metrics import guides, presenter\n"
            "print('light', [m for m in ('numpy', 'engine_manager.metrics.hub', 'engine_manager.metrics.store',\n"
            "                            'engine_manager.metrics.sources', 'psutil', 'httpx') if m in sys.modules])\n"
            "from engine_manager.metrics.store import RingStore\n"
            "print('names', M.RingStore is RingStore, M.Tick.__module__, callable(M.build_hub),\n"
            "      'export_csv' in dir(M), 'numpy' in sys.modules)\n"
            "try:\n"
            "    M.no_such_name\n"
            "except AttributeError as exc:\n"
            "    print('missing', exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    # psutil: the engines' process checks (engine_manager.procs), not the metrics'
    assert "light []" in out.stdout or "light ['psutil']" in out.stdout, out.stdout
    assert "names True engine_manager.metrics.hub True True True" in out.stdout, out.stdout
    assert "missing module 'engine_manager.metrics' has no attribute 'no_such_name'" in out.stdout, out.stdout


def test_cards_status_and_cli_line_from_a_real_scripted_engine(sim1):
    running = RunningEngine.from_status(None, sim1.base_url, sim1.api_key, engine="sim")
    assert running.simulated and running.engine == "sim"
    hub = M.build_hub(running, hz=4.0, record=True)
    try:
        hub.tick_once()                                   # rates need two readings
        r = httpx.post(sim1.url("/v1/chat/completions"), headers=sim1.headers, timeout=30,
                       json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 20})
        assert r.status_code == 200
        for _ in range(200):                              # the reply is over once no slot is busy
            t = hub.tick_once()
            if t.values.get("slots_busy") == 0:
                break
        assert t.values.get("slots_busy") == 0, t.missing
        cards = P.cards(t)
        assert [k for k, _ in P.CARDS] == list(cards)
        # idle: no decode rate (a window still emptying is not a rate of now), said in words
        assert cards["decode"].value == "—" and cards["decode"].detail.startswith("idle")
        assert cards["decode"].simulated and not cards["decode"].stale
        assert cards["vram"].simulated and cards["vram"].value.endswith("GiB")
        assert cards["vram"].detail == "modelled by the scripted engine"
        # the host's RAM is measured (psutil), never labelled simulated
        ram = cards["ram"]
        assert not ram.simulated and ram.value.endswith("GiB") and ram.detail == "host (psutil)"
        if "gpu" in t.missing:                            # no NVIDIA GPU here: said, not drawn as 0
            assert cards["gpu"].value == "—" and cards["gpu"].detail == "no NVIDIA GPU"
            assert cards["gpu"].tip.startswith("missing: ")
        line = P.text_line(t)
        assert "decode — " in line and "users 0 (idle)" in line and line.endswith("[simulated]")
        from engine_manager.cli.monitor import fmt_line
        assert fmt_line(t) == line                        # `dsv41 monitor` prints the presenter's line
        text, tip = P.status_text(hub, t)
        assert text.startswith("sim (simulated) · 4 Hz") and "recording to " in text
        assert tip is not None and str(hub.recorder.csv_path) in tip
        assert "missing: gpu" not in text                 # a source this machine cannot have is said on its card
    finally:
        hub.stop()


def test_missing_figures_are_dashes_with_the_reason_never_zero():
    t = tick(engine="sim")
    t.missing = {"engine": "nothing answers at http://127.0.0.1:9 (connection refused)",
                 "host": "psutil timed out", "gpu": "no NVIDIA GPU"}
    cards = P.cards(t)
    for key, c in cards.items():
        assert "—" in c.value, (key, c.value)
        assert not any(ch.isdigit() for ch in c.value), (key, c.value)
    assert cards["decode"].tip == "missing: nothing answers at http://127.0.0.1:9 (connection refused)"
    assert cards["ram"].tip == "missing: psutil timed out" and cards["gpu"].detail == "no NVIDIA GPU"
    assert "missing: nothing answers" in cards["vram"].tip and "missing: no NVIDIA GPU" in cards["vram"].tip
    line = P.text_line(t)
    assert "decode — " in line and "VRAM — " in line and "[simulated]" not in line
    assert " 0 " not in line and "0.0" not in line


def test_strata_hit_rate_is_the_last_requests_and_prefill_between_prompts_is_the_last_one():
    """Strata reports a hit rate only when a request finishes (tests/data/strata/SOURCES.md "Live hit rate"): the
    card says whose figure it is and greys it; prefill while no prompt is read is the last request's."""
    t = tick(decode_tok_s=61.0, slots_busy=1.0, slots_total=1.0, prefill_tok_s=1234.0, hit_rate_rolling=0.8)
    t.sample = Sample(t=t.t, engine="strata", state="generating")
    t.sample.extra.update(hit_rate_last=0.9, hit_rate_recent=0.85, hit_rate_recent_requests=3)
    t.notes["prefill_live"] = False
    t.predicted_hit_rate = 0.874
    t.values["hit_rate_last"] = 0.9
    t.origin = M.derive(t.values, simulated=False)
    t.sample.extra["hit_rate_scope"] = "request"
    cards = P.cards(t)
    # the observed share of routed picks served from VRAM (no PCIe share reported: the hit rate), the newest
    # finished request's, beside the planner's prediction and the engine's own hit rate under its name
    assert cards["hit"].value == "last request 90.0 %" and cards["hit"].stale
    assert cards["hit"].detail == "plan 87.4% · 1 min 80.0%\nhit rate 90.0%"
    assert cards["prefill"].value == "last 1234 tok/s" and cards["prefill"].stale
    assert cards["prefill"].detail == "last request · generating"
    assert cards["decode"].value == "61.0 tok/s" and cards["decode"].detail == "1/1 slots busy"
    assert "last prefill 1234 tok/s" in P.text_line(t)
    # a prompt being read: live, not greyed
    t.notes["prefill_live"] = True
    live = P.cards(t)["prefill"]
    assert live.value == "1234 tok/s" and not live.stale and live.detail == "state: generating"


def test_cpu_card_splits_by_binding_only_when_bound():
    bound = P.cards(tick(cpu_bound_pct=88.0, cpu_rest_pct=4.0, cpu_total_pct=46.0))["cpu"]
    assert (bound.value, bound.detail) == ("bound 88 %", "rest 4 % · all 46 %")
    free = P.cards(tick(cpu_total_pct=46.0))["cpu"]
    assert free.value == "all 46 %" and free.detail == "engine not bound to a node" and "NUMA" in free.tip


def test_stopped_cards_say_so():
    stopped = P.stopped_cards()
    assert list(stopped) == [k for k, _ in P.CARDS]
    assert all(c.value == "—" and c.detail == "engine stopped" and c.stale and not c.simulated
               for c in stopped.values())
    assert P.stopped_status(True).startswith("Engine stopped") and "Ctrl+E" in P.stopped_status(True)
    assert P.stopped_status(False) == "Not collecting: no engine is running."


def test_the_followed_time_range_grows_in_few_steps_then_slides_in_small_ones():
    """What the Monitor's plots show while following the newest reading, a reading a second for 1.5 windows: the
    range holds every reading kept, is laid out again only when it steps, and steps rarely while the run is young
    (each step redraws every plot) yet keeps the readings over most of the width."""
    first = 1_000_003.7
    for window in (60.0, 600.0, 3600.0):
        ranges = [P.follow_range(first, first + age, window) for age in range(int(window * 1.5))]
        steps = [age for age in range(1, len(ranges)) if ranges[age] != ranges[age - 1]]
        for age, (x0, x1) in enumerate(ranges):
            now = first + age
            assert x1 >= now and x0 <= max(first, now - window + window / 30) + 1e-9, (window, age)
            if age < window - window / 30:
                assert x0 == first, (window, age)                          # a young run: all of it
            assert x1 - x0 <= window + 1e-9 and x1 - x0 >= min(30.0, window)
            if age >= 30 and age < window:
                assert (now - first) / (x1 - x0) >= 2 / 3 - 1e-9, (window, age)   # the run fills most of it
        young = [a for a in steps if a < window]
        assert len([a for a in young if 5 <= a <= 35]) == 1                          # at 30 s
        assert len(young) == len([s for s in P.YOUNG_SPANS_S if s < window]) + 1          # + into the window
        # older than the window: the window itself, its right edge a 30th of it ahead at most, on a 30th's grid
        for age in range(int(window) + int(window / 30) + 1, len(ranges)):
            x0, x1 = ranges[age]
            assert x1 - x0 == pytest.approx(window) and 0 < x1 - (first + age) <= window / 30 + 1e-6
            assert x1 / (window / 30) == pytest.approx(round(x1 / (window / 30)))
        old = [a for a in steps if a > window + window / 30]
        assert len(old) == pytest.approx((len(ranges) - window) / (window / 30), abs=2)
    # everything: from the first reading, the right edge a tenth of the age ahead at most (60 s at first)
    for age in (0.0, 59.0, 61.0, 3_000.0, 86_400.0):
        x0, x1 = P.follow_range(first, first + age, None)
        assert x0 == first and first + age <= x1 <= first + age + max(60.0, age) / 10 * 1.5
