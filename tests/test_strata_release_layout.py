"""The Strata engine release as Strata's setup really lays it out, and Strata's own refusals and stop.

Facts (tests/data/strata/SOURCES.md, "The release as Strata's setup lays it out"):
- setup.py @28c47b1 ``get_prebuilt``: ``engine/strata`` with ``engine/BUILD.json`` beside it (no ``bin/strata``);
  serve/server.py @2291cb3 ``StrataEngine.__init__`` reads ``Path(exe).parent / "BUILD.json"``;
- setup.py ``pip_install``/``cuda_lib_dirs``: the release's ``.venv`` holds the server's packages and NVIDIA's CUDA 13
  wheels (``site-packages/nvidia/cu13/lib``), the config's ``lib_dirs``, which server.py ``child_env`` puts first on
  ``LD_LIBRARY_PATH``;
- server.py ``ENGINE_READY_S`` (``STRATA_ENGINE_READY_S``, 900 s): "the engine did not report READY within N s";
- server.py ``main()``: SIGTERM → KeyboardInterrupt → ``engine.close()``: QUIT first (a second SIGTERM kills);
- expert_cache.cpp @2249c24 ``ExpertCache::open``; tools/iq_pack.py @d4e6823 ``main()``'s architecture refusal and
  ``Model.__init__``'s shard names.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from strata_support import cuda_lib_dir, make_strata_release, release_python, run_iq_pack
from supervisor_helpers import drain

from engine_manager import provision, release_check
from engine_manager.crash import classify_exit
from engine_manager.engine_state import ExitInfo
from engine_manager.engines import get_engine
from engine_manager.engines.strata import shard_name_problem
from engine_manager.gguf_split import find_split
from engine_manager.replica import ReplicaSpec, write_replica
from engine_manager.settings import load_settings
from engine_manager.testing.tinymoe import write_tinymoe

ROOT = Path(__file__).resolve().parents[1]
STRATA = get_engine("strata")
STEM = "replica-not-the-real-name"


def settings_for(tmp_path: Path, **env):
    e = {"DSV41_NUMA": "off", **{k: str(v) for k, v in env.items()}}
    return load_settings(env=e, path=tmp_path / "settings.json").settings


@pytest.fixture(scope="module")
def replica(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("replica")
    write_replica(d, ReplicaSpec(file_stem=STEM))
    return d


# ------------------------------------------------------------------------------------------------ 1. engine/ + BUILD
def test_the_engine_binary_is_found_in_engine_with_its_build_json(strata_release, replica, tmp_path):
    assert not (strata_release / "bin").exists()
    s = settings_for(tmp_path, DSV41_ENGINE_DIR=strata_release, DSV41_MODEL_DIR=replica)
    spec = STRATA.build_launch(s, None, tmp_path / "run")
    cfg = json.loads(Path(spec.files["config"]).read_text())
    assert cfg["exe"] == str(strata_release / "engine" / "strata")
    assert not any("engine binary" in p for p in STRATA.preflight(spec))
    assert STRATA.release_summary(s) == "version 0.1.42, CUDA 13.0, sm_120"
    build = release_check.read_build_json(strata_release / "engine" / "BUILD.json")
    assert build.archs == (120,) and build.runs_on("12.0") and build.runs_on("9.0") is False


def test_build_json_is_read_capped_validated_and_never_through_a_link(tmp_path):
    good = tmp_path / "BUILD.json"
    good.write_text(json.dumps({"version": 7, "cuda": "13.0\x1b[2J", "archs": [120, "x", True, -1, 89],
                                "ptx": "yes", "cuda_dirs": ["/opt/cuda/lib64", 5]}))
    b = release_check.read_build_json(good)
    assert (b.version, b.cuda, b.archs, b.ptx, b.lib_dirs) == ("7", "13.0[2J", (120, 89), False, ("/opt/cuda/lib64",))
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"version": "x" * 70_000}))
    link = tmp_path / "link.json"
    link.symlink_to(good)
    for path, words in ((big, "larger than 64 KiB"), (link, "symbolic link"), (tmp_path / "none.json", "cannot be"),
                        (good.with_name("list.json"), "not a JSON object")):
        if path.name == "list.json":
            path.write_text("[1, 2]")
        with pytest.raises(release_check.ReleaseError, match=words):
            release_check.read_build_json(path)


# ------------------------------------------------------------------------------------------------ 2. .venv, lib_dirs
def test_the_server_runs_with_the_releases_venv_and_the_cuda_wheels_folder(strata_release, replica, tmp_path):
    s = settings_for(tmp_path, DSV41_ENGINE_DIR=strata_release, DSV41_MODEL_DIR=replica)
    spec = STRATA.build_launch(s, None, tmp_path / "run")
    assert spec.argv[0] == str(release_python(strata_release)) != sys.executable
    cfg = json.loads(Path(spec.files["config"]).read_text())
    assert cfg["lib_dirs"][0] == str(cuda_lib_dir(strata_release))
    # the panel's own interpreter cannot run Strata's server: it lacks the release's packages (jinja2)
    cp = subprocess.run([sys.executable, str(strata_release / "serve" / "server.py"), "--help"], capture_output=True,
                        text=True, timeout=60)
    assert cp.returncode != 0 and "No module named 'jinja2'" in cp.stderr


def test_a_release_without_a_venv_is_refused_before_starting_with_what_to_run(replica, tmp_path):
    release = make_strata_release(tmp_path / "release", venv=False)
    s = settings_for(tmp_path, DSV41_ENGINE_DIR=release, DSV41_MODEL_DIR=replica)
    spec = STRATA.build_launch(s, None, tmp_path / "run")
    assert spec.argv[0] != sys.executable
    text = " ".join(STRATA.preflight(spec))
    assert "has no .venv" in text and "./setup.sh" in text and "python3 -m venv .venv" in text
    with pytest.raises(provision.ProvisionError, match="has no .venv"):
        drain(STRATA.prepare(s, None))


# ------------------------------------------------------------------------------------------------ 3, 6. env and args
def test_the_servers_ready_deadline_is_the_panels_and_prefill_is_auto(strata_release, replica, tmp_path):
    s = settings_for(tmp_path, DSV41_ENGINE_DIR=strata_release, DSV41_MODEL_DIR=replica, DSV41_READY_TIMEOUT=5400)
    spec = STRATA.build_launch(s, None, tmp_path / "run")
    assert int(spec.env["STRATA_ENGINE_READY_S"]) >= s.ready_timeout_s == 5400
    args = json.loads(Path(spec.files["config"]).read_text())["args"]
    assert args[args.index("--prefill") + 1] == "auto"
    off = settings_for(tmp_path, DSV41_ENGINE_DIR=strata_release, DSV41_MODEL_DIR=replica,
                       DSV41_STRATA_PREFILL_AUTO="false")
    args = json.loads(Path(STRATA.build_launch(off, None, tmp_path / "run2").files["config"]).read_text())["args"]
    assert "--prefill" not in args


# ------------------------------------------------------------------------------------------------ 5. failure words
def _hint(*lines: str, rc: int = 1):
    return classify_exit(STRATA, ExitInfo(rc, None, source="exit-file"), list(lines))


def test_stratas_own_failure_words_get_causes_and_fixes():
    oom = ("strata generate: ExpertCache: 5825 slots x 12792627 B = 69.40 GiB, but only 60.12 GiB of VRAM is free "
           "(35.47 GiB of 95.59 GiB total). Lower --expert-cache.")
    h = _hint("[engine] " + oom)
    assert h.cause == "expert_cache_oom" and oom in h.title
    # the slots that fit 60.12 GiB, and the planner's budget lowered by what was missing (69.40 - 60.12) + 0.5
    assert f"about {int(60.12 * 2**30 // 12792627):,} slots fit" in h.fix and "--vram-gib 85.8" in h.fix
    h = _hint("[engine] /r/engine/strata: error while loading shared libraries: libcublas.so.13: cannot open shared "
              "object file: No such file or directory", rc=127)
    assert h.cause == "cuda_libs_missing" and "nvidia-cublas==13.0.2.14" in h.fix and "libcublas.so.13" in h.title
    h = _hint("__main__.EngineDied: the engine did not report READY within 900 s (see /r/strata-engine.log)",
              "the engine log's last lines:", "  strata serve: session is up")
    assert h.cause == "engine_ready_timeout" and "within 900 s" in h.title and "ready_timeout_s" in h.fix
    h = _hint("[engine] strata generate: --native requires --ple-gguf: no shard of the model holds "
              "per_layer_token_embd.weight")
    assert h.cause == "ple_gguf_missing" and "deepseek-one-gpu" in h.fix
    h = _hint("unsupported architecture 'deepseek2'")
    assert h.cause == "pack_arch_unsupported" and "deepseek-one-gpu" in h.fix and "again does not help" in h.fix
    from engine_manager.crash import PERMANENT_CAUSES
    assert {"expert_cache_oom", "cuda_libs_missing", "engine_ready_timeout"} <= PERMANENT_CAUSES


def test_provisioning_quotes_the_tools_first_error_not_the_wrapper(tmp_path):
    lines = ["model shards: a, b", "Traceback (most recent call last):", '  File "x", line 1',
             "ValueError: blk.3.ffn_gate_inp.weight is F32 with values that are not BF16",
             "Traceback (most recent call last):",
             "subprocess.CalledProcessError: Command '['python', 'strata_tokenizer.py']' returned non-zero exit "
             "status 1."]
    assert provision.first_error_line(lines).startswith("ValueError: blk.3.ffn_gate_inp.weight")
    assert provision.first_error_line(["\x1b]0;owned\x07unsupported architecture 'deepseek2'"]) == \
        "]0;ownedunsupported architecture 'deepseek2'"


def test_iq_packs_architecture_refusal_says_use_the_fork_not_download_again(strata_release, replica, tmp_path,
                                                                           monkeypatch):
    monkeypatch.setenv("STRATA_STANDIN_UPSTREAM_ARCHES", "1")
    r = run_iq_pack(strata_release, find_split(replica).first, tmp_path / "pack")
    assert r.returncode == 1 and r.stdout.strip() == "unsupported architecture 'deepseek2'"
    with pytest.raises(provision.ProvisionError) as ei:
        drain(provision.provision(strata_release, replica, pack=tmp_path / "pack2"))
    err = ei.value
    assert err.cause == "pack_arch_unsupported" and "said: unsupported architecture 'deepseek2'" in str(err)
    assert "deepseek-one-gpu" in str(err) and "disk has room" not in str(err)


# ------------------------------------------------------------------------------------------------ 7. shard names
def test_shards_not_named_as_strata_finds_them_are_refused_before_starting(tmp_path):
    d = tmp_path / "model"
    write_tinymoe(d, shards=2)
    split = find_split(d)
    assert shard_name_problem(str(split.first)) is None
    for i, p in enumerate(split.shards):
        p.rename(p.with_name(f"part-{'ab'[i]}.gguf"))
    words = shard_name_problem(str(d / "part-a.gguf"))
    assert words and "BY NAME" in words and "part-b.gguf → part-a-00002-of-00002.gguf" in words


# ------------------------------------------------------------------------------------------------ 8. doctor
def test_the_release_check_names_each_fix(strata_release, tmp_path):
    by = {c.id: c for c in release_check.check_release(strata_release, compute_capability="12.0",
                                                       driver_cuda="13.0")}
    assert all(c.status == "pass" for c in by.values()), by
    assert {"engine_binary", "build_json", "build_cuda", "build_arch", "venv", "cuda_libs", "server",
            "iq_pack"} <= set(by)
    by = {c.id: c for c in release_check.check_release(strata_release, compute_capability="9.0",
                                                       driver_cuda="12.8")}
    assert by["build_arch"].status == "fail" and "sm_120" in by["build_arch"].figure
    assert by["build_cuda"].status == "fail" and "CUDA 13.0" in by["build_cuda"].fix
    bare = make_strata_release(tmp_path / "bare", venv=False)
    (bare / "engine" / "strata").chmod(0o644)
    by = {c.id: c for c in release_check.check_release(bare)}
    assert by["venv"].status == "fail" and "./setup.sh" in by["venv"].fix
    assert by["cuda_libs"].status == "fail" and by["engine_binary"].status == "fail" and "chmod" in \
        by["engine_binary"].fix
    shutil.rmtree(strata_release / ".venv" / "lib")
    (strata_release / ".venv" / "lib").mkdir()
    assert {c.id: c.status for c in release_check.check_release(strata_release)}["cuda_libs"] == "fail"


def test_dsv41_doctor_checks_the_release(strata_release):
    env = {**os.environ, "DSV41_ENGINE_DIR": str(strata_release)}
    cp = subprocess.run([sys.executable, "-m", "engine_manager", "doctor"], capture_output=True, text=True,
                        timeout=120, cwd=str(ROOT), env=env)
    assert cp.returncode == 0, cp.stderr
    assert "Engine BUILD.json" in cp.stdout and "version 0.1.42, CUDA 13.0, sm_120" in cp.stdout
    assert "imports jinja2, regex" in cp.stdout


# ------------------------------------------------------------------------------------------------
def test_a_5000_digit_progress_number_is_no_traceback():
    assert provision.parse_progress("9" * 5000 + "/" + "9" * 5000, 43) is None
    assert provision.parse_progress("layer " + "9" * 5000, 43) is None
    assert provision.parse_progress("layer 7  Q2_K", 43) == (8, 43)


FAKE_TOOL = r'''
import os, pathlib, sys
out = pathlib.Path(sys.argv[sys.argv.index("--out") + 1])
(out / "tokenizer").mkdir(parents=True, exist_ok=True)
(out / "index.txt").write_text("# index\n")
(out / "tokenizer" / "vocab.json").write_text("{}")
os.symlink(sys.argv[sys.argv.index("--gguf") + 1], out / "native_experts.txt")
'''


def test_a_pack_whose_marker_is_a_symbolic_link_is_not_complete(tmp_path):
    release = tmp_path / "release"
    (release / "tools").mkdir(parents=True)
    (release / "tools" / "iq_pack.py").write_text(FAKE_TOOL)
    d = tmp_path / "model"
    write_tinymoe(d, shards=2)
    with pytest.raises(provision.ProvisionError, match="native_experts.txt in the pack as a symbolic link"):
        drain(provision.provision(release, d, python=sys.executable, pack=tmp_path / "pack"))
    assert not (tmp_path / "pack").exists()
    # a pack made properly, whose vocab.json is then replaced by a link, is made again
    real = make_strata_release(tmp_path / "real")
    _, pack = drain(provision.provision(real, d, pack=tmp_path / "pack"))
    assert provision.pack_state(pack, find_split(d))[0]
    vocab = pack / "tokenizer" / "vocab.json"
    keep = tmp_path / "vocab.json"
    shutil.copy(vocab, keep)
    vocab.unlink()
    vocab.symlink_to(keep)
    ready, why = provision.pack_state(pack, find_split(d))
    assert not ready and "tokenizer/vocab.json" in why


# ------------------------------------------------------------------------------------------------ 9. the stand-in
def test_the_stand_in_engine_needs_the_cuda_folder_on_ld_library_path(strata_release, small_model):
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    r = subprocess.run([str(strata_release / "engine" / "strata"), "--serve", "--pack", str(small_model["pack"]),
                        "--native", str(small_model["shard1"])], capture_output=True, text=True, timeout=60,
                       input="QUIT\n", env=env)
    assert r.returncode == 127
    assert "error while loading shared libraries: libcublas.so.13: cannot open shared object file" in r.stderr


# ------------------------------------------------------------------------------------------------ 10. acceptance
def make_plan(dsv41, replica: Path, tmp_path: Path) -> Path:
    """A plan for the guides' workstation (this machine has no GPU), as tests/test_strata_e2e.py makes one."""
    out = tmp_path / "plan.json"
    cp = dsv41("plan", "--model-dir", str(replica), "--vram-gib", "95.6", "--ram-gib", "280", "--out", str(out),
               "--no-save")
    assert cp.returncode == 0, cp.stdout + cp.stderr
    return out


def _records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


@pytest.mark.timeout(600)
def test_start_chat_stop_a_release_in_stratas_layout_ends_the_engine_by_quit(strata_release, replica, tmp_path,
                                                                             free_port):
    """``dsv41 start --engine strata`` on engine/strata + BUILD.json + .venv: it starts, chats and stops; the engine
    saw the .venv's CUDA folder on LD_LIBRARY_PATH and a STRATA_ENGINE_READY_S no shorter than the panel's ready
    timeout; it ended by the server's QUIT, not by a signal; the server ran under the release's own Python."""
    record = tmp_path / "engine-record.jsonl"
    env = {**os.environ, "DSV41_ENGINE_DIR": str(strata_release), "DSV41_MODEL_DIR": str(replica),
           "DSV41_PORT": str(free_port), "DSV41_NUMA": "off", "DSV41_AUTO_RESTART": "false",
           "DSV41_READY_TIMEOUT": "3600", "STRATA_STANDIN_RECORD": str(record), "PYTHONUNBUFFERED": "1"}
    env.pop("LD_LIBRARY_PATH", None)

    def dsv41(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "engine_manager", *args], capture_output=True, text=True,
                              timeout=300, cwd=str(ROOT), env=env, stdin=subprocess.DEVNULL)

    try:
        cp = dsv41("start", "--engine", "strata", "--plan", str(make_plan(dsv41, replica, tmp_path)))
        assert cp.returncode == 0, cp.stdout + cp.stderr
        st = json.loads(dsv41("status", "--json").stdout)
        assert st["state"] == "ready" and st["engine_build"] == "version 0.1.42, CUDA 13.0, sm_120"
        server = psutil.Process(st["pid"])
        assert Path(server.cmdline()[0]) == release_python(strata_release)
        cp = dsv41("chat", "--max-tokens", "16", "Say hello")
        assert cp.returncode == 0 and "native engine reads" in cp.stdout, cp.stdout + cp.stderr
        cp = dsv41("stop")
        assert cp.returncode == 0, cp.stdout + cp.stderr
        assert "SIGKILL" not in cp.stdout
    finally:
        dsv41("stop", "--force")
    recs = _records(record)
    start = [r for r in recs if r["event"] == "start"]
    ends = [r for r in recs if r["event"] == "end"]
    assert len(start) == 1, recs
    assert start[0]["ld_library_path"].split(os.pathsep)[0] == str(cuda_lib_dir(strata_release))
    assert float(start[0]["ready_s"]) >= 3600
    assert [e["by"] for e in ends] == ["QUIT"], recs


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", ["oom", "no-venv-libs", "ready", "arch", "no-numpy"])
def test_stratas_refusals_reach_start_and_logs_with_cause_and_fix(strata_release, replica, tmp_path, free_port,
                                                                  case):
    env = {**os.environ, "DSV41_ENGINE_DIR": str(strata_release), "DSV41_MODEL_DIR": str(replica),
           "DSV41_PORT": str(free_port), "DSV41_NUMA": "off", "DSV41_AUTO_RESTART": "false",
           "DSV41_READY_TIMEOUT": "240", "PYTHONUNBUFFERED": "1"}
    if case == "oom":
        env["STRATA_STANDIN_FAIL"] = "oom"
        words, fix = "ExpertCache: ", "dsv41 plan --vram-gib"
    elif case == "no-venv-libs":
        shutil.rmtree(cuda_lib_dir(strata_release))
        words, fix = "error while loading shared libraries: libcublas.so.13", "nvidia-cublas==13.0.2.14"
    elif case == "ready":
        # the server's deadline is the panel's ready timeout, and the panel waits a margin longer
        # (StrataEngine.ready_margin_s), so the server's own words are what the user reads (found running the real
        # server.py @2291cb3: with equal deadlines the panel always gave up first, with no engine words)
        env.update({"STRATA_STANDIN_FAIL": "no-ready", "DSV41_READY_TIMEOUT": "5"})
        words, fix = "did not report READY within 5 s", "ready_timeout_s"
    elif case == "no-numpy":
        # iq_pack @d4e6823 imports numpy at its top: a release .venv without it is named as such, not "check disk"
        shutil.rmtree(next((strata_release / ".venv" / "lib").glob("python3*/site-packages")) / "numpy")
        words, fix = "No module named 'numpy'", "install the named package into the release's .venv"
    else:
        env["STRATA_STANDIN_UPSTREAM_ARCHES"] = "1"
        words, fix = "unsupported architecture 'deepseek2'", "deepseek-one-gpu"

    def dsv41(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "engine_manager", *args], capture_output=True, text=True,
                              timeout=300, cwd=str(ROOT), env=env, stdin=subprocess.DEVNULL)

    try:
        cp = dsv41("start", "--engine", "strata", "--plan", str(make_plan(dsv41, replica, tmp_path)))
        out = cp.stdout + cp.stderr
        assert cp.returncode == 1, out
        assert words in out and fix in out, out
        assert "Traceback" not in cp.stderr and "CalledProcessError" not in out
        assert "disk has room" not in out
        # whether the engine ran or the start failed before it (a refused pack), `dsv41 logs` and `dsv41 status`
        # tell this failure — never an earlier run's (found running against the real iq_pack @d4e6823)
        logs = dsv41("logs", "-n", "0").stdout
        assert words in logs and re.search(r"last failure: .*" + re.escape(words), logs), logs
        assert fix in logs
        status = json.loads(dsv41("status", "--json").stdout)
        assert words in (status.get("last_failure") or {}).get("title", ""), status
    finally:
        dsv41("stop", "--force")
