"""The stand-in Strata release (tests/strata_release/) refuses what Strata refuses and serves what it serves.

Every test starts the stand-in the way Strata's setup starts Strata (an argv list; the key in STRATA_API_KEY, never on
the command line) and checks one behaviour read in Strata's code; the docstrings name the file and function.
"""
from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import threading
from pathlib import Path

import httpx
import pytest

from supervisor_helpers import wait_until
from strata_support import engine_env, release_python, run_iq_pack, stop, strata_config, wait_port, write_config

KEY = "test-key-0123456789"


def server_argv(release: Path, port: int, *extra: str) -> list:
    return [str(release_python(release)), str(release / "serve" / "server.py"), *extra, "--host", "127.0.0.1",
            "--port", str(port)]


def server_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
    env.update({"STRATA_API_KEY": KEY, **extra})
    return env


def start(argv: list, env: dict, tmp_path: Path) -> subprocess.Popen:
    out = open(tmp_path / "server.out", "w")
    return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def server_output(tmp_path: Path) -> str:
    return (tmp_path / "server.out").read_text(encoding="utf-8", errors="replace")


def run_to_end(argv: list, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def chat(port: int, text: str, *, key: str = KEY, stream: bool = False, max_tokens: int = 200):
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "stream": stream}
    return httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {key}"}, timeout=120)


def sse_frames(text: str) -> list:
    return [block for block in text.split("\n\n") if block.strip()]


@pytest.fixture
def strata_server(small_model, strata_release, tmp_path, free_port):
    """serve/server.py --engine strata on the stand-in pack, ready; yields (port, log path, config)."""
    log = tmp_path / "engine.log"
    cfg = strata_config(strata_release, small_model["pack"], small_model["shard1"], log)
    conf = write_config(tmp_path / "strata.json", cfg)
    proc = start(server_argv(strata_release, free_port, "--engine", "strata", "--config", str(conf)), server_env(),
                 tmp_path)
    try:
        wait_port(free_port, proc)
        yield free_port, log, cfg
    finally:
        stop(proc)


@pytest.fixture
def strata_server_proc(small_model, strata_release, tmp_path, free_port):
    """The same server as strata_server, handed over as (process, port, tmp_path) to a test that stops it itself."""
    conf = write_config(tmp_path / "strata.json", strata_config(strata_release, small_model["pack"],
                                                                small_model["shard1"], tmp_path / "engine.log"))
    proc = start(server_argv(strata_release, free_port, "--engine", "strata", "--config", str(conf)), server_env(),
                 tmp_path)
    try:
        wait_port(free_port, proc)
        yield proc, free_port, tmp_path
    finally:
        stop(proc)


# ---------------------------------------------------------------------------------------------------- refusals
def test_without_engine_strata_the_server_runs_its_mock_engine(strata_release, tmp_path, free_port):
    """serve/server.py @2291cb3 main(): `--engine` choices mock|strata, default "mock"; the mock engine's script is
    "Thinking about it.</think>\\n\\nHello from the mock engine." and /health (the `/health` branch of do_GET) says
    loaded. A launch that forgets `--engine strata` looks ready and answers with the greeting."""
    proc = start(server_argv(strata_release, free_port), server_env(), tmp_path)
    try:
        wait_port(free_port, proc)
        health = httpx.get(f"http://127.0.0.1:{free_port}/health", timeout=30).json()
        assert health["loaded"] is True and health["service"] == "strata"
        r = chat(free_port, "hello")
        assert r.status_code == 200
        msg = r.json()["choices"][0]["message"]
        assert msg["content"] == "Hello from the mock engine."
        assert msg["reasoning_content"] == "Thinking about it."
    finally:
        stop(proc)


def test_engine_strata_without_vocab_json_exits_2(small_model, strata_release, tmp_path, free_port):
    """serve/server.py @2291cb3 main(): `if a.engine == "strata" and not (tpath / "vocab.json").exists():
    ap.error("the model's tokenizer is missing (...); run setup again")` - argparse's exit 2."""
    empty = tmp_path / "no-tokenizer"
    empty.mkdir()
    cfg = strata_config(strata_release, small_model["pack"], small_model["shard1"], tmp_path / "engine.log",
                        tokenizer=str(empty))
    conf = write_config(tmp_path / "strata.json", cfg)
    r = run_to_end(server_argv(strata_release, free_port, "--engine", "strata", "--config", str(conf)), server_env())
    assert r.returncode == 2
    assert f"the model's tokenizer is missing ({empty / 'vocab.json'}); run setup again" in r.stderr
    cfg.pop("tokenizer")                                  # no tokenizer key: the default pack/full/tokenizer, absent
    write_config(conf, cfg)
    r = run_to_end(server_argv(strata_release, free_port, "--engine", "strata", "--config", str(conf)), server_env())
    assert r.returncode == 2 and "the model's tokenizer is missing" in r.stderr


@pytest.mark.parametrize("value", ["", "   "])
def test_an_empty_api_key_exits_2(strata_release, free_port, value):
    """serve/server.py @2291cb3 main(): STRATA_API_KEY set but blank (#213: "an empty key would switch
    authentication off without a word") prints "[strata] an API key was given but it is empty: ..." and returns 2."""
    r = run_to_end(server_argv(strata_release, free_port), server_env(STRATA_API_KEY=value))
    assert r.returncode == 2
    assert "[strata] an API key was given but it is empty" in r.stderr


@pytest.mark.parametrize("bad", [["--cpu-numerics", "gpu"], ["MODEL_PATH"], ["--max-neww", "16"]])
def test_an_unknown_engine_argument_stops_the_start_and_is_in_the_log(small_model, strata_release, tmp_path,
                                                                      free_port, bad):
    """src/program/generate.cpp main() option loop: any argument it does not know - a bare model path, Strata's
    missing --cpu-numerics, a typo - is `fprintf(stderr, "unknown argument: %s\\n")`, usage, return 2. The server
    (serve/server.py @2291cb3 StrataEngine.__init__) appends the engine's stderr to the config's `log` and raises
    EngineDied("the engine exited before it was ready (see LOG)" + the log's last lines), which main() does not
    catch: the server exits 1 naming the cause."""
    log = tmp_path / "engine.log"
    bad = [str(small_model["shard1"]) if b == "MODEL_PATH" else b for b in bad]
    cfg = strata_config(strata_release, small_model["pack"], small_model["shard1"], log,
                        args=["--max-context", "4096", *bad])
    conf = write_config(tmp_path / "strata.json", cfg)
    r = run_to_end(server_argv(strata_release, free_port, "--engine", "strata", "--config", str(conf)), server_env())
    assert r.returncode != 0
    assert f"unknown argument: {bad[0]}" in log.read_text()
    assert "the engine exited before it was ready" in r.stderr
    assert f"unknown argument: {bad[0]}" in r.stderr          # the log's last lines ride on the error


def test_the_engine_option_loop_refuses_like_generate_cpp(small_model, strata_release):
    """src/program/generate.cpp main(): `next(what)` without a value is "<flag> needs a value", exit 2; --kv takes
    fp16|int8|q4_0|k8v4 ("strata generate: --kv must be fp16, int8, q4_0 or k8v4", exit 2); without --serve,
    --tokens is required; known flags with their values pass."""
    exe = [str(strata_release / "engine" / "strata")]
    base = ["--serve", "--pack", str(small_model["pack"]), "--native", str(small_model["shard1"])]

    def run(*args):
        return subprocess.run(exe + list(args), capture_output=True, text=True, timeout=60, input="QUIT\n",
                              env=engine_env(strata_release))

    r = run(*base, "--expert-cache")
    assert r.returncode == 2 and "--expert-cache needs a value" in r.stderr
    r = run(*base, "--kv", "q8")
    assert r.returncode == 2 and "strata generate: --kv must be fp16, int8, q4_0 or k8v4" in r.stderr
    r = run("--pack", str(small_model["pack"]))
    assert r.returncode == 2 and "strata generate: --tokens is required" in r.stderr
    r = run(*base, "--expert-cache", "auto", "--vram-reserve-mib", "700", "--max-context", "8192", "--kv", "q4",
            "--prefill", "auto", "--batch", "4", "--pcie-frac", "0.5", "--pool-workers", "2", "--adapt-every", "8",
            "--adapt-swaps", "16", "--adapt-decay", "0.9", "--mmap-experts")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "READY 8192 stop"
    assert "kv=q4_0" in r.stdout.splitlines()[0]


def test_an_expert_profile_of_another_shape_is_refused(small_model, strata_release, tmp_path):
    """src/core/expert_cache.cpp @2249c24 read_expert_profile(): a STRP file whose n_layers x n_expert differs from the
    model is "read_expert_profile: %s is %ux%u but this model is %lldx%lld - it is a profile for a different artifact",
    printed by generate.cpp as "strata generate: %s", exit 1. The right shape (every block, as this panel's
    engine_manager.expert_routing.write_strp writes it) is accepted."""
    from engine_manager.expert_routing import write_strp
    spec = small_model["spec"]
    good = write_strp(tmp_path / "good.strp", [(spec.n_dense, 3), (spec.n_dense + 1, 5)], spec.n_layers,
                      spec.n_expert, 2)
    bad = write_strp(tmp_path / "bad.strp", [(0, 3)], len(spec.moe_layers), spec.n_expert, 1)
    exe = [str(strata_release / "engine" / "strata"), "--serve", "--pack", str(small_model["pack"]),
           "--native", str(small_model["shard1"])]
    r = subprocess.run(exe + ["--expert-profile", str(bad)], capture_output=True, text=True, timeout=60, input="",
                       env=engine_env(strata_release))
    assert r.returncode == 1
    assert (f"strata generate: read_expert_profile: {bad} is {len(spec.moe_layers)}x{spec.n_expert} but this model "
            f"is {spec.n_layers}x{spec.n_expert} - it is a profile for a different artifact") in r.stderr
    r = subprocess.run(exe + ["--expert-profile", str(good), "--expert-cache", "auto"], capture_output=True,
                       text=True, timeout=60, input="QUIT\n", env=engine_env(strata_release))
    assert r.returncode == 0, r.stderr
    assert "expert_slots=2" in r.stdout


def test_a_pack_without_its_completion_marker_is_refused(small_model, strata_release, tmp_path):
    """tools/iq_pack.py @0902837 main(): dense.bin and index.txt are written in place, native_experts.txt last through
    native_experts.txt.tmp (#172). A run killed part-way leaves files that merely exist and no marker; the engine
    does not take such a pack."""
    pack = tmp_path / "pack"
    r = run_iq_pack(strata_release, small_model["shard1"], pack, env={"STRATA_STANDIN_PACK_FAIL": "after-dense"})
    assert r.returncode != 0
    assert (pack / "dense.bin").exists() and not (pack / "native_experts.txt").exists()
    assert not (pack / "index.txt").exists()
    r = run_iq_pack(strata_release, small_model["shard1"], pack, env={"STRATA_STANDIN_PACK_FAIL": "after-index"})
    assert r.returncode != 0 and (pack / "index.txt").exists() and not (pack / "native_experts.txt").exists()
    r = subprocess.run([str(strata_release / "engine" / "strata"), "--serve", "--pack", str(pack), "--native",
                        str(small_model["shard1"])], capture_output=True, text=True, timeout=60, input="",
                       env=engine_env(strata_release))
    assert r.returncode == 1 and "no native_experts.txt" in r.stderr
    r = run_iq_pack(strata_release, small_model["shard1"], pack)          # the step done again completes the pack
    assert r.returncode == 0, r.stderr
    assert {"index.txt", "dense.bin", "conversions.json", "native_experts.txt", "tokenizer"} <= \
        {p.name for p in pack.iterdir()}
    assert {"vocab.json", "merges.txt", "token_type.json", "chat_template.jinja"} <= \
        {p.name for p in (pack / "tokenizer").iterdir()}
    assert "index.txt: " in r.stdout and "model shards: " in r.stdout


def test_iq_pack_finds_the_other_shards_by_name(small_model, strata_release, tmp_path):
    """tools/iq_pack.py @0902837 Model.__init__: the shards are <name>-0000N-of-0000M.gguf beside --gguf; a missing
    one is FileNotFoundError("missing model shards (wait for the download): ..."). A shard 1 renamed away from that
    pattern cannot reach its siblings: the stand-in says so instead of packing half a model."""
    lone = tmp_path / "m"
    lone.mkdir()
    (lone / small_model["shard1"].name).symlink_to(small_model["shard1"])
    r = run_iq_pack(strata_release, lone / small_model["shard1"].name, tmp_path / "p1")
    assert r.returncode != 0 and "missing model shards (wait for the download)" in r.stderr
    (lone / "renamed.gguf").symlink_to(small_model["shard1"])
    r = run_iq_pack(strata_release, lone / "renamed.gguf", tmp_path / "p2")
    assert r.returncode != 0 and "cannot be found beside it" in r.stderr


# ---------------------------------------------------------------------------------------------------- serving
def test_a_wrong_key_is_401_and_health_is_open(strata_server):
    """serve/server.py @2291cb3 make_handler `_authorized`: "Authorization: Bearer KEY" or "x-api-key", constant
    time, else 401 {"error": {"type": "authentication_error", "message": "missing or wrong API key"}}; /health and
    /api/health answer without a key (service "strata")."""
    port, _, _ = strata_server
    base = f"http://127.0.0.1:{port}"
    for path in ("/v1/models", "/metrics", "/v1/status", "/slots", "/props", "/status"):
        r = httpx.get(base + path, headers={"Authorization": "Bearer wrong"}, timeout=30)
        assert r.status_code == 401, path
        assert r.json() == {"error": {"type": "authentication_error", "message": "missing or wrong API key"}}
        assert httpx.get(base + path, headers={"x-api-key": KEY}, timeout=30).status_code == 200, path
    assert chat(port, "hello", key="wrong").status_code == 401
    for path in ("/health", "/api/health"):
        h = httpx.get(base + path, timeout=30).json()
        assert h["service"] == "strata" and h["loaded"] is True and h["api_key"] is True


def test_a_chat_gets_the_native_engines_answer_end_to_end(small_model, strata_server):
    """The whole path, started by hand: serve/server.py --engine strata (StrataEngine spawns `bin/strata --serve`
    with the config's args, waits for READY), the prompt tokenized with the pack's tokenizer/ files, `GEN` to the
    engine, `T` ids back, detokenized; the stream has reasoning_content then content, a last chunk with usage and
    timings (openai_chunks), then [DONE]; the engine's own stderr lines are in the config's log; /metrics' finished
    request carries hit_rate = hits / lookups from the DONE line (Service.run history)."""
    port, log, cfg = strata_server
    r = chat(port, "hello there")
    assert r.status_code == 200
    body = r.json()
    msg = body["choices"][0]["message"]
    assert msg["content"].startswith("native engine answer: ")
    assert "stand-in native engine" in msg["reasoning_content"]
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["model"] == cfg["model_name"]
    n_prompt = body["usage"]["prompt_tokens"]
    assert f"({n_prompt} prompt tokens read)" in msg["content"]     # the engine answered THIS prompt's ids

    s = chat(port, "hello again", stream=True)
    assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
    assert s.headers["connection"] == "close"                    # HTTP/1.0: the server ends the stream by closing
    frames = sse_frames(s.text)
    assert frames[-1] == "data: [DONE]"
    chunks = [json.loads(f[len("data: "):]) for f in frames if f.startswith("data: {")]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text.startswith("native engine answer: ")
    assert any(c["choices"][0]["delta"].get("reasoning_content") for c in chunks)
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] == "stop"
    assert set(last["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"}
    assert {"prompt_n", "cache_n", "predicted_n", "predicted_ms"} <= set(last["timings"])

    text_log = log.read_text()
    assert "engine started: " in text_log and " --serve --pack " in text_log
    assert "strata serve: prompt " in text_log and "strata serve: decode expert cache hit rate: " in text_log
    m = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"x-api-key": KEY}, timeout=30).json()
    assert m["live"]["state"] == "idle" and m["live"]["tok_s"] is None
    assert m["requests"][0]["hit_rate"] == 0.0 and m["totals"]["requests"] == 2
    assert m["engine"]["engine"].endswith("standin")


def test_chat_requests_queue_and_all_get_answers(small_model, strata_release, tmp_path, free_port):
    """serve/server.py @2291cb3: requests take their turn (Service.run holds `self.fifo`, `status["queued"]` counts
    the waiting ones); a chat that arrives while one runs waits - it is never refused with 409 (model_busy is only
    for /v1/load and /v1/unload). The engine is slowed (STRATA_STANDIN_TOKEN_DELAY_S) so the first request is still
    running when the others arrive, which /metrics' live.queued shows."""
    conf = write_config(tmp_path / "strata.json", strata_config(strata_release, small_model["pack"],
                                                                small_model["shard1"], tmp_path / "engine.log"))
    proc = start(server_argv(strata_release, free_port, "--engine", "strata", "--config", str(conf)),
                 server_env(STRATA_STANDIN_TOKEN_DELAY_S="0.05"), tmp_path)
    results = {}

    def one(i):
        results[i] = chat(free_port, f"question {i}", max_tokens=200)

    try:
        wait_port(free_port, proc)
        threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
        threads[0].start()
        seen = set()
        for _ in range(600):
            live = httpx.get(f"http://127.0.0.1:{free_port}/metrics", headers={"x-api-key": KEY},
                             timeout=30).json()["live"]
            seen.add(live["state"])
            if live["state"] in ("reading", "generating"):
                break
            threads[0].join(0.05)
        for t in threads[1:]:
            t.start()
        queued = 0
        for _ in range(600):
            queued = max(queued, httpx.get(f"http://127.0.0.1:{free_port}/metrics", headers={"x-api-key": KEY},
                                           timeout=30).json()["live"]["queued"])
            if queued >= 1:
                break
            threads[1].join(0.05)
        for t in threads:
            t.join(120)
        assert queued >= 1, f"no request was seen waiting (states seen: {seen})"
        assert [results[i].status_code for i in range(3)] == [200, 200, 200]
        assert all(results[i].json()["choices"][0]["message"]["content"].startswith("native engine answer: ")
                   for i in range(3))
    finally:
        stop(proc)


def test_an_engine_that_dies_mid_stream_ends_with_a_server_error_frame(small_model, strata_release, tmp_path,
                                                                       free_port):
    """serve/server.py @2291cb3 _openai: EngineDied while streaming writes `data: {"error": {"type": "server_error",
    "message": "...; the next request restarts it"}}` then `data: [DONE]`. The engine here is killed (SIGKILL, the
    OOM killer's way) after 3 tokens: STRATA_STANDIN_FAIL=die-after:3 reaches it through the server's environment
    (child_env copies os.environ)."""
    log = tmp_path / "engine.log"
    conf = write_config(tmp_path / "strata.json",
                        strata_config(strata_release, small_model["pack"], small_model["shard1"], log))
    proc = start(server_argv(strata_release, free_port, "--engine", "strata", "--config", str(conf)),
                 server_env(STRATA_STANDIN_FAIL="die-after:3"), tmp_path)
    try:
        wait_port(free_port, proc)
        s = chat(free_port, "hello", stream=True)
        frames = sse_frames(s.text)
        assert frames[-1] == "data: [DONE]"
        err = json.loads(frames[-2][len("data: "):])
        assert err["error"]["type"] == "server_error"
        assert "the engine stopped unexpectedly (exit code -9); the next request restarts it" == err["error"]["message"]
    finally:
        stop(proc)


def test_dump_routing_writes_a_format_2_trace(small_model, strata_release, tmp_path):
    """--dump-routing (generate.cpp; include/strata/core/routing_trace.hpp as tools/make_profile.py and the N0
    simulator read it): records of int32 layer, int32 k, k int32, k float32; the first record is the format tag
    (layer -2), a request tag (-3) comes per GEN, commit tags (-1) close each window; route records have
    0 <= layer < n_layers and k = the model's experts per token."""
    spec = small_model["spec"]
    trace = tmp_path / "routing.bin"
    exe = [str(strata_release / "engine" / "strata"), "--serve", "--pack", str(small_model["pack"]), "--native",
           str(small_model["shard1"]), "--dump-routing", str(trace)]
    r = subprocess.run(exe, capture_output=True, text=True, timeout=60, input="GEN 5 1,2,3\nQUIT\n",
                       env=engine_env(strata_release))
    assert r.returncode == 0, r.stderr
    assert [x.split()[0] for x in r.stdout.splitlines()] == ["INFO", "READY", "PP", "T", "T", "T", "T", "T", "DONE"]
    data = trace.read_bytes()
    records, at = [], 0
    while at < len(data):
        layer, k = struct.unpack_from("<ii", data, at)
        ids = struct.unpack_from(f"<{k}i", data, at + 8)
        records.append((layer, list(ids)))
        at += 8 + 8 * k
    assert at == len(data)
    assert records[0][0] == -2 and records[1] == (-3, [1])
    routes = [x for x in records if x[0] >= 0]
    assert {x[0] for x in routes} == set(spec.moe_layers)
    assert all(len(ids) == spec.n_expert_used and all(0 <= e < spec.n_expert for e in ids) for _, ids in routes)
    assert sum(1 for x in records if x[0] == -1) == 5


def test_a_layer_split_across_shards_is_strict_only_on_request(small_model, strata_release, tmp_path):
    """tools/iq_pack.py @0902837 main(): native_experts.txt v3 names ONE shard per layer, and a layer whose gate/up/
    down tensors lie in different shards is refused ("layer %d: its gate/up/down tensors are in different shards",
    exit 1). The small replica's layer 2 is such a layer (like several of the real 7-shard split's). Strata's
    refusal is STRATA_STANDIN_STRICT_SHARDS=1; by default the stand-in takes the layer (deepseek-one-gpu runs those
    files) and names the three shards."""
    r = run_iq_pack(strata_release, small_model["shard1"], tmp_path / "strict",
                    env={"STRATA_STANDIN_STRICT_SHARDS": "1"})
    assert r.returncode == 1 and "its gate/up/down tensors are in different shards" in r.stdout
    assert not (tmp_path / "strict" / "native_experts.txt").exists()
    lines = (small_model["pack"] / "native_experts.txt").read_text().splitlines()
    assert lines[0].startswith("# strata native experts v3: ")
    assert [int(x.split()[0]) for x in lines[1:]] == small_model["spec"].moe_layers
    assert any("," in x.split()[-1] for x in lines[1:])          # a layer in two shards names both


def sigterm_caught(pid: int) -> bool:
    """Whether process ``pid`` has a handler for SIGTERM (its ``SigCgt`` mask in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    return False


def test_sigterm_quits_the_engine_and_leaves_no_process(strata_server_proc):
    """serve/server.py @2291cb3 main(): SIGTERM raises KeyboardInterrupt ("docker stop sends SIGTERM"), whose path
    closes the HTTP server and the engine (QUIT on its stdin) and prints "[strata] stopped"; exit 0. The engine
    (bin/strata) ends on QUIT."""
    import psutil
    proc, port, tmp_path = strata_server_proc
    children = psutil.Process(proc.pid).children(recursive=True)
    assert children, "the server has no engine child"
    # serve/server.py @2291cb3 main() sets its SIGTERM handler only after serve() has opened the port and "ready:"
    # is printed: a SIGTERM sent in between ends the server the default way (exit -15). Wait until the kernel says
    # the signal is caught.
    assert wait_until(lambda: sigterm_caught(proc.pid), timeout=60), "the server never set its SIGTERM handler"
    proc.terminate()
    assert proc.wait(timeout=60) == 0
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive
    assert "[strata] stopped" in server_output(tmp_path)


def test_lazy_opens_the_port_unloaded_and_the_first_chat_loads(small_model, strata_release, tmp_path, free_port):
    """serve/server.py @2291cb3 main(): `--lazy` (or "lazy_load": true) starts the API unloaded: /health answers with
    loaded false (never ready), /v1/models lists the model as {"value": "unloaded"} (do_GET), and the first request
    starts the engine (StrataEngine, restart on demand)."""
    conf = write_config(tmp_path / "strata.json", strata_config(strata_release, small_model["pack"],
                                                                small_model["shard1"], tmp_path / "engine.log"))
    proc = start(server_argv(strata_release, free_port, "--engine", "strata", "--config", str(conf), "--lazy"),
                 server_env(), tmp_path)
    try:
        wait_port(free_port, proc)
        base = f"http://127.0.0.1:{free_port}"
        assert httpx.get(base + "/health", timeout=30).json()["loaded"] is False
        models = httpx.get(base + "/v1/models", headers={"x-api-key": KEY}, timeout=30).json()
        assert models["data"][0]["status"] == {"value": "unloaded"}
        assert not (tmp_path / "engine.log").exists()
        r = chat(free_port, "hello")
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].startswith("native engine")
        assert httpx.get(base + "/health", timeout=30).json()["loaded"] is True
    finally:
        stop(proc)


def test_an_engine_out_of_memory_at_start_is_the_servers_error(small_model, strata_release, tmp_path, free_port):
    """src/core/expert_cache.cpp @2249c24 ExpertCache::open: "ExpertCache: N slots x B B = G GiB, but only F GiB of
    VRAM is free (U GiB of T GiB total). Lower --expert-cache." (printed "strata generate: %s", exit 1) before READY;
    serve/server.py @2291cb3
    StrataEngine.__init__ then fails with the log's last lines, so the cause reaches whoever started the server."""
    log = tmp_path / "engine.log"
    conf = write_config(tmp_path / "strata.json",
                        strata_config(strata_release, small_model["pack"], small_model["shard1"], log))
    r = run_to_end(server_argv(strata_release, free_port, "--engine", "strata", "--config", str(conf)),
                   server_env(STRATA_STANDIN_FAIL="oom"))
    assert r.returncode == 1
    assert "the engine exited before it was ready" in r.stderr
    assert "strata generate: ExpertCache: " in r.stderr and "Lower --expert-cache." in log.read_text()


def test_expert_profile_save_writes_every_pair_ranked_at_quit(small_model, strata_release, tmp_path):
    """src/core/expert_cache.cpp @2249c24 rank_learned_profile + write_expert_profile (#477, --expert-profile-save):
    at QUIT every (layer, expert) pair is ranked - the VRAM tier's pairs first - and written as STRP version 1 with
    slots = n_ranked = n_layers x n_experts, through PATH.tmp and a rename."""
    from engine_manager.expert_routing import write_strp
    spec = small_model["spec"]
    prior = write_strp(tmp_path / "prior.strp", [(spec.n_dense, 3), (spec.n_dense + 1, 5)], spec.n_layers,
                       spec.n_expert, 2)
    out = tmp_path / "learned.strp"
    r = subprocess.run([str(strata_release / "engine" / "strata"), "--serve", "--pack", str(small_model["pack"]),
                        "--native", str(small_model["shard1"]), "--expert-profile", str(prior), "--expert-cache",
                        "auto", "--expert-profile-save", str(out)], capture_output=True, text=True, timeout=60,
                       input="GEN 4 1,2,3\nQUIT\n", env=engine_env(strata_release))
    assert r.returncode == 0, r.stderr
    data = out.read_bytes()
    magic, version, nl, ne, slots, n = struct.unpack_from("<4s5I", data, 0)
    assert (magic, version, nl, ne) == (b"STRP", 1, spec.n_layers, spec.n_expert)
    assert slots == n == spec.n_layers * spec.n_expert
    assert len(data) == 24 + 4 * n + 4 * nl * ne
    first = {struct.unpack_from("<HH", data, 24 + 4 * i) for i in range(2)}
    assert first == {(spec.n_dense, 3), (spec.n_dense + 1, 5)}     # the VRAM tier (no swaps without --adapt-every)
    assert not (tmp_path / "learned.strp.tmp").exists()


def test_iq_pack_experts_bin_comes_after_the_marker_with_its_lines(small_model, strata_release, tmp_path):
    """tools/iq_pack.py @0902837 main(): with --experts-bin the experts are written to experts.bin AFTER
    native_experts.txt is published, printing "  layer %2d ..." every 8th layer and "experts.bin: %d layers, %.2f
    GiB"; its size is the sum the marker's header names ("total %d")."""
    pack = tmp_path / "pack"
    r = subprocess.run([str(release_python(strata_release)), str(strata_release / "tools" / "iq_pack.py"), "--gguf",
                        str(small_model["shard1"]), "--out", str(pack), "--experts-bin"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"experts.bin: {len(small_model['spec'].moe_layers)} layers, " in r.stdout
    header = (pack / "native_experts.txt").read_text().splitlines()[0]
    total = int(header.split("total ")[1].split(";")[0])
    assert (pack / "experts.bin").stat().st_size == total
