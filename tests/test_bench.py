"""The Benchmark's Qt-free core: prompts, statistics and figures from token timestamps; a real run on
the scripted engine started through the real supervisor (restarts per configuration, the long-prompt pause, A/B,
the engine put back as it was, cancel); results saved, history, compare; ``dsv41 bench --engine sim --quick
--json`` against the guides' table."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from supervisor_helpers import drain

from engine_manager import bench
from engine_manager import supervisor as sv
from engine_manager.engine_state import READY, STOPPED
from engine_manager.bench import prompts as P
from engine_manager.bench import results
from engine_manager.bench.stats import ratio, summary
from engine_manager.bench.streams import StreamRecord, common_window, decode_figures
from engine_manager.cancel import CancelToken
from engine_manager.errors import UserError
from engine_manager.settings import load_settings

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def port(monkeypatch, free_port):
    monkeypatch.setenv("DSV41_PORT", str(free_port))
    yield free_port
    for _ in sv.Supervisor(load_settings().settings).stop(force=True):
        pass


# ------------------------------------------------------------------------------------------------ pure parts
def test_prompts_are_deterministic_and_sized_from_the_engines_counts():
    assert P.words(50, 3) == P.words(50, 3)
    assert P.words(50, 3) != P.words(50, 4)
    assert len(P.words(50, 3).split()) == 50
    r = P.calibrate(short_tokens=12, long_tokens=12 + 255 * 1.5, long_words=256)
    assert r.measured and r.per_word == pytest.approx(1.5)
    assert r.expected(r.words_for(1000)) == pytest.approx(1000, abs=2)
    assert not P.calibrate(None, 300, 256).measured           # an engine without usage: the guess, said so
    assert P.length_check(1000, 1050)["ok"] is True
    assert P.length_check(1000, 1200)["ok"] is False
    assert P.length_check(1000, None)["ok"] is None


def test_the_scripted_engine_routes_the_prompts_through_its_general_topic():
    from engine_manager.sim.corpus import topic_of
    assert topic_of(P.words(2000, 64)).name == "general"


def test_summary_and_ratio():
    s = summary([10.0, 12.0, None, 11.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (11.0, 10.0, 12.0, 3)
    assert s["spread"] == pytest.approx(2 / 11)
    assert summary([])["median"] is None
    r = ratio(summary([7.0, 8.0]), summary([10.0, 10.0]))
    assert r["ratio"] == pytest.approx(0.75) and r["low"] == pytest.approx(0.7) and r["high"] == pytest.approx(0.8)


def test_decode_figures_use_the_window_where_every_stream_decodes():
    # stream 0 starts at t=0 (10 tok/s), stream 1 at t=1 (5 tok/s); both decode from 1 to 3
    a = StreamRecord(0, sent_at=-0.5, token_times=[i * 0.1 for i in range(31)], ended_at=3.0, client_cpu_s=0.01)
    b = StreamRecord(1, sent_at=-0.5, token_times=[1 + i * 0.2 for i in range(16)], ended_at=4.0, client_cpu_s=0.01)
    assert common_window([a, b]) == pytest.approx((1.0, 3.0))
    f = decode_figures([a, b])
    assert f["per_stream_tok_s"] == pytest.approx([10.0, 5.0])
    assert f["total_tok_s"] == pytest.approx(15.0) and f["slowest_tok_s"] == pytest.approx(5.0)
    assert f["ttft_s"] == pytest.approx([0.5, 1.5])
    assert f["client_cpu_share"] == pytest.approx(0.02 / 4.5)
    gap = StreamRecord(2, token_times=[0, 0.1, 0.2, 4.2, 4.3])
    assert gap.max_gap(after=1.0) == pytest.approx(4.0) and gap.max_gap(before=0.15) == pytest.approx(0.1)


def test_configurations_from_words():
    c = bench.parse_config("g:cpu_numerics=gpu,slots=4,expert_cache=half")
    assert (c.name, c.settings, c.expert_cache) == ("g", {"cpu_numerics": "gpu", "slots": 4}, "half")
    assert bench.parse_config("h:cpu_layers=3+4").cpu_layers == [3, 4]
    for bad in ("nocolon", "x:slots", "x:expert_cache=many"):
        with pytest.raises(UserError):
            bench.parse_config(bad)
    spec = bench.BenchSpec.make("sim", presets=["numerics", "numa"])
    assert spec.baseline.settings == {"cpu_numerics": "fork", "numa_binding": "auto"}
    assert [c.name for c in spec.configs] == ["numerics_gpu", "numa_off"]


def test_a_bad_setting_in_a_configuration_is_refused_in_plain_words(port):
    spec = bench.BenchSpec.make("sim", presets=[], users=(1,), repeats=1, tokens=8, long_prompt_tokens=0)
    spec.configs = [bench.parse_config("bad:cpu_numerics=fast")]
    run = bench.runner.BenchRun(load_settings().settings, spec)
    with pytest.raises(UserError, match="bad"):
        run._settings_for(spec.configs[0])


# ------------------------------------------------------------------------------------------------ a real run
def test_a_run_on_the_scripted_engine_measures_restarts_and_restores(port, tmp_path):
    settings = load_settings().settings
    spec = bench.BenchSpec.make("sim", presets=["numerics"], users=(1, 2), tokens=24, repeats=2,
                                long_prompt_tokens=3000, long_users=2)
    events, r = drain(bench.run_and_save(settings, spec, folder=tmp_path))
    kinds = [e.kind for e in events]
    assert kinds[-1] == "done" and r is events[-1].result
    fractions = [e.fraction for e in events if e.kind == "progress"]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    assert {e.phase for e in events if e.kind == "progress"} >= {"start", "warmup", "users_1", "users_2",
                                                                  "long_prompt", "restore"}
    assert any(e.eta_s is not None and e.eta_s > 0 for e in events if e.kind == "progress")
    # the document
    assert r["schema"] == "dsv41-bench" and r["schema_version"] == 1 and r["simulated"] is True
    assert not r["cancelled"] and r["error"] is None
    assert "api_key" not in r["settings"] and settings.api_key not in json.dumps(r)
    assert r["model_comparable"] is True
    # the engine measured: its own version string, its build, its launch argv (the key masked), per configuration
    from engine_manager.sim.model import VERSION
    assert r["engine_version"] == VERSION and r["engine_build"] == f"Strata {VERSION} (simulated)"
    assert r["engine_args"] and any("engine_manager.sim" in a for a in r["engine_args"])
    assert "--cpu-numerics" in r["configs"][1]["engine"]["engine_args"]
    for c in r["configs"]:
        assert {"engine_version", "engine_build", "engine_args"} <= set(c["engine"])
        assert settings.api_key not in json.dumps(c["engine"]["engine_args"])
    rows = {x["users"]: x for x in r["table"]}
    assert set(rows) == {1, 2}
    one = rows[1]
    assert one["guide_total_tok_s"] == 63.11 and one["simulated"] is True
    assert one["total_tok_s"] > 0 and one["engine_total_tok_s"] > 0
    assert rows[2]["total_tok_s"] > one["total_tok_s"] > rows[2]["slowest_tok_s"]    # shared steps: more, slower
    base = r["configs"][0]
    assert base["settings"]["slots"] == 2 and base["long_settings"]["slots"] == 3
    assert base["phases"]["warmup"]["excluded"] is True
    assert base["phases"]["users_1"]["prompt_ok"] is True
    assert len(base["phases"]["users_2"]["repeats"]) == 2
    assert base["monitor"]["users_1"]["hit_rate"] is not None                  # the Monitor's collectors
    # the long prompt: its length checked, the decoding streams paused while it was read
    lp = base["phases"]["long_prompt"]
    assert lp["prompt_check"]["ok"] is True
    assert lp["pause_s"] > 3 * max(g for g in lp["max_gap_before_s"] if g)
    assert lp["prefill_tok_s_engine"] > 0 and r["long_prompt"]["pause_s"] == lp["pause_s"]
    # A/B: --cpu-numerics gpu is slower, and reported against the guides' 0.743
    (ab,) = r["ab"]
    assert ab["config"] == "numerics_gpu" and ab["guide_ratio"] == pytest.approx(0.743)
    assert 0.5 < ab["ratio"] < 0.95 and ab["low"] <= ab["ratio"] <= ab["high"]
    assert r["configs"][1]["settings"]["cpu_numerics"] == "gpu"
    # the client is not what limits the figures
    assert r["client"]["ok"] is True
    # saved: JSON + CSV, owner-only; history and compare read them back
    jp, cp = Path(r["saved"]["json"]), Path(r["saved"]["csv"])
    for p in (jp, cp):
        assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert results.load(jp)["table"] == json.loads(json.dumps(r["table"]))
    assert cp.read_text().splitlines()[0].startswith("config,phase,repeat,stream")
    assert [h["id"] for h in results.history(tmp_path)] == [r["id"]]
    cmp = results.compare(results.load(jp), results.load(jp))
    assert any(row["figure"] == "1 user: total" and row["ratio"] == pytest.approx(1.0) for row in cmp["rows"])
    assert "1 user" in results.render(r) and "SIMULATED" in r["verdict"]
    # nothing ran before the bench: nothing runs after it
    assert sv.Supervisor(load_settings().settings).status(check_health=False).state == STOPPED


def test_cancel_puts_back_the_engine_that_ran_before(port, tmp_path):
    settings = load_settings().settings
    before = sv.Supervisor(settings)
    for _ in before.run("sim", None, watch=False):
        pass
    st0 = before.status()
    assert st0.state == READY
    stop = CancelToken()
    spec = bench.BenchSpec.make("sim", presets=[], users=(1,), tokens=400, repeats=3, long_prompt_tokens=0)
    gen = bench.run_bench(settings, spec, stop=stop)
    events = []
    for ev in gen:
        events.append(ev)
        if ev.kind == "progress" and ev.phase == "users_1":
            stop.cancel()                     # mid-stream: a 400-token reply takes seconds
    done = events[-1]
    assert done.kind == "done" and done.cancelled and done.result["cancelled"] is True
    assert any(e.kind == "note" and "started again" in e.text for e in events)
    st = sv.Supervisor(settings).status()
    assert st.state == READY and st.engine == "sim" and st.pid != st0.pid
    assert "--slots 1 " in " ".join(st.argv) + " "            # its own settings again, not the bench's


def test_a_results_file_of_another_kind_is_refused(tmp_path):
    p = tmp_path / "bench_20260101T000000Z.json"
    p.write_text('{"schema": "something-else"}')
    with pytest.raises(UserError, match="not a benchmark result"):
        results.load(p)
    with pytest.raises(UserError, match="history"):
        results.load("bench_20990101T000000Z", tmp_path)
    assert results.history(tmp_path) == []


# ------------------------------------------------------------------------------------------------ acceptance
def test_cli_quick_on_the_scripted_engine_reproduces_the_guides_table(port, tmp_path):
    env = {k: v for k, v in os.environ.items()}
    proc = subprocess.run([sys.executable, "-m", "engine_manager", "bench", "--engine", "sim", "--quick", "--json"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    assert r["schema"] == "dsv41-bench" and r["schema_version"] == 1 and r["simulated"] is True
    assert r["duration_s"] < 180
    rows = {x["users"]: x for x in r["table"]}
    guides = {1: (63.11, 63.11), 4: (127.58, 31.87), 8: (152.53, 19.0)}
    for u, (total, slowest) in guides.items():
        assert rows[u]["simulated"] is True
        # the engine's own timings run on the modelled clock: within ±10% of the guides' figures
        assert rows[u]["engine_total_tok_s"] == pytest.approx(total, rel=0.10)
        # the client's wall clock: ±10% too, but a loaded 2-core machine may delay the sim's steps, so 20%
        assert rows[u]["total_tok_s"] == pytest.approx(total, rel=0.20)
        assert rows[u]["slowest_tok_s"] == pytest.approx(slowest, rel=0.20)
    assert r["long_prompt"]["pause_s"] > 2.0 and r["long_prompt"]["prompt_tokens"] > 60000
    (ab,) = [a for a in r["ab"] if a["config"] == "numerics_gpu"]
    assert ab["ratio"] == pytest.approx(0.743, abs=0.06) and ab["simulated"] is True
    assert r["client"]["cpu_share_of_wall"]["users_8"] < 0.05
    assert "saved:" in proc.stderr


def test_cli_ctrl_c_cuts_the_run_keeps_what_was_measured_and_stops_the_engine(port):
    import signal
    proc = subprocess.Popen([sys.executable, "-m", "engine_manager", "bench", "--engine", "sim", "--no-ab",
                             "--users", "1,4", "--tokens", "300", "--long-prompt", "0"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "4 users decoding, repeat 1" in line:
            proc.send_signal(signal.SIGINT)
            break
    out = "".join(seen) + proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, out[-2000:]
    assert "Cancelled; the figures measured so far are kept." in out, out[-3000:]
    saved = [ln for ln in out.splitlines() if ln.startswith("saved: ")]
    r = results.load(saved[0].split()[1])
    assert r["cancelled"] is True and [x["users"] for x in r["table"]] == [1]
    assert sv.Supervisor(load_settings().settings).status(check_health=False).state == STOPPED
