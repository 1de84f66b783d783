"""The Benchmark against hostile input and hostile timing: a seeded corpus of damaged result files (read by
``--show``, ``--compare``, ``--history`` and the Benchmark tab: words, never a traceback; one bad file never hides
the others), impossible numbers from the engine (missing, never measured), strict JSON out, ``--out`` and every
``--config`` checked before anything starts, SIGTERM / SIGHUP taking Ctrl-C's path, prompt lengths the engine did
not confirm said in the report, and a stalled engine given up on from its own pace instead of after 15 minutes."""

from __future__ import annotations

import copy
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from loopback_http import LoopbackServer, QuietHandler
from supervisor_helpers import drain

from engine_manager import bench
from engine_manager import supervisor as sv
from engine_manager.engine_state import READY, STOPPED
from engine_manager.bench import prompts as P
from engine_manager.bench import results
from engine_manager.bench.config import BASELINE
from engine_manager.bench.runner import BenchSpec, _combine, _monitor_summary
from engine_manager.bench.stats import finite_json, measured, measured_int
from engine_manager.bench.streams import StreamRecord, Streams, decode_figures
from engine_manager.cancel import CancelToken
from engine_manager.chat import ChatClient, ChatOptions
from engine_manager.cli.bench import _save, exit_code
from engine_manager.errors import UserError
from engine_manager.settings import load_settings

ROOT = Path(__file__).resolve().parents[1]


def fake_result(prompt_tokens: int | None = 130) -> dict:
    """A result document as the runner assembles it, from two streams' token times (no engine needed)."""
    recs = [StreamRecord(i, sent_at=0.0, token_times=[0.5 + i * 0.01 + k * 0.02 for k in range(60)], ended_at=2.0,
                         prompt_tokens=prompt_tokens, engine_tok_s=50.0) for i in range(2)]
    figs = decode_figures(recs)
    figs.update(repeat=0, prompt_check=[P.length_check(128, r.prompt_tokens) for r in recs],
                timeline=[list(r.token_times) for r in recs])
    raw = {"started_at": time.time(), "spec": BenchSpec.make("sim", quick=True).to_dict(),
           "configs": [{"config": BASELINE.to_dict(), "baseline": True, "phases": {"users_2": _combine([figs])},
                        "monitor": {"users_2": {"hit_rate": 0.9, "ticks": 3}},
                        "engine": {"engine": "sim", "label": "Scripted engine (SIMULATED)",
                                   "model": "DeepSeek-V4.1-Flash", "simulated": True}}],
           "finished_at": time.time(), "duration_s": 1.0, "cancelled": False, "error": None,
           "token_ratio": P.TokenRatio(1.2, 9, prompt_tokens is not None).to_dict()}
    return results.assemble(raw, None, None)


def use_everything(d: dict) -> None:
    """What the CLI and the Benchmark tab do with a loaded result."""
    results.render(d)
    results.findings(d)
    results.render_compare(results.compare(d, d))


# ------------------------------------------------------------------------------------------------ result files
def test_a_seeded_corpus_of_damaged_result_files_gives_a_result_or_words(tmp_path):
    good = fake_result()
    results.save(copy.deepcopy(good), tmp_path)
    hostile = [None, "x", "", -7, 10**400, float("inf"), float("nan"), True, [], {}, [None], [[["deep"]]],
               {"users": "x"}, "\x1b]0;title\x07"]

    def paths_of(d, prefix=()):
        if isinstance(d, dict):
            for k, v in d.items():
                yield prefix + (k,)
                yield from paths_of(v, prefix + (k,))
        elif isinstance(d, list) and d:
            yield prefix + (0,)
            yield from paths_of(d[0], prefix + (0,))

    all_paths = [p for p in paths_of(good) if p[0] not in ("schema",)]
    rng = random.Random(10)
    refused = read = 0
    for n in range(400):
        doc = json.loads(json.dumps(good))
        path = rng.choice(all_paths)
        target = doc
        for k in path[:-1]:
            target = target[k]
        target[path[-1]] = copy.deepcopy(rng.choice(hostile))
        f = tmp_path / f"bench_20260101T0000{n:02d}Z_{n}.json"
        f.write_text(json.dumps(doc))
        try:
            d = results.load(f)
        except UserError as exc:
            assert "Traceback" not in str(exc)
            refused += 1
            continue
        use_everything(d)
        read += 1
    assert refused > 50 and read > 50, (refused, read)
    skipped: list[str] = []
    rows = results.history(tmp_path, skipped=skipped)
    assert good["id"] in [r["id"] for r in rows]           # the bad files never hide the good one
    assert len(rows) + len(skipped) == 401 and all(s.startswith("Skipped bench_") for s in skipped)


BAD_FILES = {
    "table_str": {"table": "x"},
    "users_str": {"table": [{"users": "x"}]},
    "engine_int": {"engine": 5},
    "long_prompt_list": {"long_prompt": []},
    "ab_label": {"ab": [{"config": "c", "users": 1, "label": 5}]},
    "monitor": {"configs": [{"monitor": {"users_1": 0.5}}]},
    "timeline": {"configs": [{"phases": {"long_prompt": {"timeline": "x"}}}]},
    "client": {"client": {"cpu_share_of_wall": {"users_1": "x"}}},
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_show_and_compare_refuse_a_damaged_file_in_words(tmp_path, name):
    good = fake_result()
    gp, _ = results.save(copy.deepcopy(good), tmp_path)
    bad = {**json.loads(gp.read_text()), **BAD_FILES[name]}
    bp = tmp_path / "bad.json"
    bp.write_text(json.dumps(bad))
    with pytest.raises(UserError, match="not a benchmark result this panel can read"):
        results.load(bp)
    for args in (["--show", str(bp)], ["--compare", str(gp), str(bp)]):
        r = subprocess.run([sys.executable, "-m", "engine_manager", "bench", *args], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 1 and "Traceback" not in r.stderr and str(bp) in r.stderr, r.stderr[-2000:]


def test_files_that_are_not_results_are_refused_in_words(tmp_path):
    cases = {"deep": "[" * 100_000 + "]" * 100_000, "list": "[1, 2]", "text": "hello",
             "no_schema": json.dumps({"table": []})}
    for name, text in cases.items():
        p = tmp_path / f"{name}.json"
        p.write_text(text)
        with pytest.raises(UserError):
            results.load(p)


def test_infinity_and_nan_of_an_older_file_read_as_missing(tmp_path):
    good = fake_result()
    good["table"][0]["total_tok_s"] = float("inf")
    good["long_prompt"] = {"pause_s": float("nan"), "prompt_tokens": 100}
    p = tmp_path / "bench_20260101T000000Z.json"
    p.write_text(json.dumps(good))                        # Python writes Infinity / NaN: not JSON
    d = results.load(p)
    assert d["table"][0]["total_tok_s"] is None and d["long_prompt"]["pause_s"] is None
    use_everything(d)


def test_results_are_written_as_strict_json(tmp_path):
    r = fake_result()
    r["table"][0]["total_tok_s"] = float("inf")
    r["configs"][0]["phases"]["users_2"]["ttft_s"]["median"] = float("nan")
    jp, cp = results.save(r, tmp_path)

    def refuse(name):
        raise ValueError(f"{name} in a result file")
    doc = json.loads(jp.read_text(), parse_constant=refuse)
    assert doc["table"][0]["total_tok_s"] is None and doc["configs"][0]["phases"]["users_2"]["ttft_s"]["median"] is None
    assert "inf" not in cp.read_text()


def test_history_names_a_bad_file_and_lists_the_rest(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV41_DATA_DIR", str(tmp_path))
    good = fake_result()
    results.save(copy.deepcopy(good))
    (results.bench_dir() / "bench_20990101T000000Z.json").write_text(json.dumps({"schema": "dsv41-bench",
                                                                                  "table": "x"}))
    r = subprocess.run([sys.executable, "-m", "engine_manager", "bench", "--history"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    assert good["id"] in r.stdout and "Skipped bench_20990101T000000Z.json" in r.stderr
    assert "Traceback" not in r.stderr


# ------------------------------------------------------------------------------------------------ impossible numbers
def test_impossible_numbers_are_missing():
    assert [measured(x) for x in (1.5, 0, -7, float("inf"), float("nan"), True, "3", None)] == \
        [1.5, 0.0, None, None, None, None, None, None]
    assert measured(1.2, hi=1.0) is None and measured(-0.5, lo=None) == -0.5
    assert [measured_int(x) for x in (5, -7, 5.0, 5.5, float("inf"), True, 10**50)] == [5, None, 5, None, None,
                                                                                          None, None]
    assert finite_json({"a": [1.0, float("inf"), {"b": float("nan")}]}) == {"a": [1.0, None, {"b": None}]}


def test_the_monitor_summary_leaves_out_readings_that_are_not_figures():
    ticks = [("users_1", {"hit_rate": float("inf"), "decode_tok_s": -7.0, "swaps_per_s": float("nan"),
                          "gpu_util_pct": 250.0}),
             ("users_1", {"hit_rate": 0.8, "decode_tok_s": 60.0, "swaps_per_s": 2.0, "gpu_util_pct": 50.0}),
             ("users_1", {"hit_rate": -0.2, "hit_rate_last": 0.6})]
    d = _monitor_summary(ticks)["users_1"]
    assert d["hit_rate"] == pytest.approx(0.7) and d["decode_tok_s"] == 60.0
    assert d["swaps_per_s"] == 2.0 and d["gpu_util_pct"] == 50.0


class _Impossible(QuietHandler):
    """A chat stream whose usage and timings are impossible: a negative prompt, a NaN rate."""

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        frames = [{"choices": [{"index": 0, "delta": {"content": f"w{i} "}, "finish_reason": None}]}
                  for i in range(5)]
        frames.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                       "usage": {"prompt_tokens": -7, "completion_tokens": 5, "total_tokens": -2},
                       "timings": {"prompt_n": 3, "prompt_ms": -1.0, "prompt_per_second": float("nan"),
                                   "predicted_n": 5, "predicted_ms": 10.0, "predicted_per_second": -50.0}})
        body = b"".join(b"data: " + json.dumps(f).encode() + b"\n\n" for f in frames) + b"data: [DONE]\n\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_a_streams_impossible_usage_and_timings_are_missing():
    srv = LoopbackServer(_Impossible)
    client = ChatClient(srv.base_url, "k")
    try:
        st = Streams(client, [P.messages("hi")], [ChatOptions(max_tokens=5)]).start()
        assert st.wait(30)
        rec = st.records[0]
        assert rec.error is None and len(rec.token_times) == 5
        assert rec.prompt_tokens is None and rec.completion_tokens == 5
        assert rec.engine_tok_s is None and rec.engine_prompt_tok_s is None and rec.engine_prompt_ms is None
    finally:
        client.close()
        srv.stop()


# ------------------------------------------------------------------------------------------------ the report
def test_prompt_lengths_the_engine_did_not_confirm_are_said():
    r = fake_result(prompt_tokens=None)
    assert r["table"][0]["prompt_ok"] is None                  # not "ok" because nobody said otherwise
    text = results.render(r)
    assert "Prompt lengths unconfirmed" in text and "one token per word" in text
    off = fake_result(prompt_tokens=400)
    assert off["table"][0]["prompt_ok"] is False and "Prompt lengths off at 2 users" in results.render(off)
    assert not any("Prompt lengths" in f for f in results.findings(fake_result()))


def test_no_figures_is_a_failure():
    r = fake_result()
    assert exit_code(r) == 0
    r["table"] = []
    assert "No figures were measured." in results.headline(r) and exit_code(r) == 1
    assert exit_code(dict(r, cancelled=True)) == 130 and exit_code(fake_result(), save_rc=1) == 1


def test_a_save_that_fails_says_where_and_keeps_the_result(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV41_DATA_DIR", str(tmp_path / "data"))
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    line, rc = _save(fake_result(), blocker / "sub", results)
    assert rc == 1 and f"could not be written to {blocker / 'sub'}" in line and "Saved in the bench folder" in line
    assert len(list(results.bench_dir().glob("bench_*.json"))) == 1


# ------------------------------------------------------------------------------------------------ real runs
@pytest.fixture
def port(monkeypatch, free_port):
    monkeypatch.setenv("DSV41_PORT", str(free_port))
    yield free_port
    for _ in sv.Supervisor(load_settings().settings).stop(force=True):
        pass


def dsv41_bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine_manager", "bench", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ))


def test_out_that_is_not_a_folder_is_refused_before_the_run(port, tmp_path):
    f = tmp_path / "results.txt"
    f.write_text("mine")
    r = dsv41_bench("--engine", "sim", "--quick", "--out", str(f))
    assert r.returncode == 2 and "is a file, not a folder" in r.stderr, r.stderr[-2000:]
    assert "Starting the engine" not in r.stdout and f.read_text() == "mine"


@pytest.mark.parametrize("config,words", [("bad:cpu_numerics=fast", "refuse"), ("x:no_such=1", "not a setting"),
                                          ("h:expert_cache=many", "not a whole number")])
def test_every_config_is_checked_before_the_first_start(port, config, words):
    r = dsv41_bench("--engine", "sim", "--quick", "--config", config)
    assert r.returncode == 2 and words in r.stderr, r.stdout[-1000:] + r.stderr[-2000:]
    assert "Starting the engine" not in r.stdout and "decoding" not in r.stdout


def test_a_bad_config_leaves_the_running_engine_alone(port):
    settings = load_settings().settings
    before = sv.Supervisor(settings)
    drain(before.run("sim", None, watch=False))
    st0 = before.status()
    spec = bench.BenchSpec.make("sim", presets=[], users=(1,), tokens=8, repeats=1, long_prompt_tokens=0)
    spec.configs = [bench.parse_config("bad:cpu_numerics=fast")]
    events, r = drain(bench.run_bench(settings, spec))
    assert r["error"] and "bad" in r["error"]
    assert not any(e.kind == "progress" and e.phase == "start" for e in events)
    st = sv.Supervisor(settings).status()
    assert st.state == READY and st.pid == st0.pid                  # never stopped


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_take_the_ctrl_c_path(port, tmp_path, sig):
    settings = load_settings().settings
    if sig == signal.SIGTERM:                       # the user's engine runs before: it must run again after
        before = sv.Supervisor(settings)
        drain(before.run("sim", None, watch=False))
        pid0 = before.status().pid
    proc = subprocess.Popen([sys.executable, "-m", "engine_manager", "bench", "--engine", "sim", "--quick",
                             "--out", str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=dict(os.environ))
    seen = []
    assert proc.stdout is not None
    for line in proc.stdout:
        seen.append(line)
        if "4 users decoding, repeat 1" in line:
            proc.send_signal(sig)
            break
    out = "".join(seen) + proc.communicate(timeout=180)[0]
    assert proc.returncode == 130, out[-3000:]
    assert "Cancelled; the figures measured so far are kept." in out
    (saved,) = tmp_path.glob("bench_*.json")
    r = results.load(saved)
    assert r["cancelled"] is True and [x["users"] for x in r["table"]] == [1]
    st = sv.Supervisor(settings).status(check_health=False)
    if sig == signal.SIGTERM:
        assert st.state == READY and st.pid != pid0 and "--slots 1 " in " ".join(st.argv) + " "
    else:
        assert st.state == STOPPED


def test_a_stalled_engine_is_given_up_on_from_its_pace(port, monkeypatch):
    """The scripted engine stops for 120 s after 100 tokens; the bench measured ~16 ms between tokens in the
    warm-up, so it gives up after its stall deadline (3 s here) — not after the phase's limit (60 s here, 900 s by
    default), which a wait on the chat read would have taken."""
    monkeypatch.setenv("DSV41_SIM_ARGS", "--stall-after-tokens 100 --stall-s 120")
    settings = load_settings().settings
    spec = bench.BenchSpec.make("sim", presets=[], users=(1,), tokens=300, repeats=1, long_prompt_tokens=0,
                                timeout_s=60.0, stall_min_s=3.0)
    stop = CancelToken()
    events, r = drain(bench.run_bench(settings, spec, stop=stop))
    assert r["error"] and "sent no token for" in r["error"] and "at 1 user" in r["error"], r["error"]
    assert "looks stuck" in r["error"] and math.isfinite(r["duration_s"])
    assert sv.Supervisor(settings).status(check_health=False).state == STOPPED
