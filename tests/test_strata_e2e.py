"""Acceptance: the panel starts the Strata engine the way Strata starts itself, end to end, with real
processes and the real CLI, on a machine without a GPU.

- the release: the stand-in in ``DSV41_ENGINE_DIR`` (``tests/strata_support.make_strata_release``: ``serve/server.py``,
  ``bin/strata``, ``tools/iq_pack.py``), which refuses what Strata refuses — ``serve/server.py`` ``main()`` defaults
  to ``--engine mock`` and exits 2 without ``tokenizer/vocab.json``; the native engine's option loop
  (``src/program/generate.cpp``) ends on ``unknown argument: X`` (exit 2) and takes ``--pack PACK --native SHARD1``;
- the model: the header-faithful replica of the DeepSeek-V4.1-Flash Q2_K split (sparse files), its shards NOT named
  like the real ones;
- the flow: ``dsv41 plan --model-dir R --vram-gib 95.6 --ram-gib 280 --out P --no-save``; ``dsv41 start --engine
  strata --plan P`` provisions once (``tools/iq_pack.py``, Strata ``setup.py``'s native-pack branch), starts
  ``--engine strata`` and becomes ready; ``status --json``, ``chat``, ``logs`` (the native engine's stderr, which
  Strata's server writes to the config's ``log``: ``serve/server.py`` ``StrataEngine.__init__``), ``stop``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from conftest import require_or_skip
from engine_manager import provision
from engine_manager.gguf_split import find_split
from engine_manager.replica import ReplicaSpec, write_replica

pytestmark = [pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[1]
STEM = "replica-not-the-real-name"

try:
    from strata_support import make_strata_release
except ImportError:  # pragma: no cover - the stand-in release comes with the suite
    make_strata_release = None


@pytest.fixture(scope="module")
def replica(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("replica")
    write_replica(d, ReplicaSpec(file_stem=STEM))
    return d


@pytest.fixture
def release(tmp_path) -> Path:
    if make_strata_release is None:
        require_or_skip("tests/strata_support.py (the stand-in Strata release) is missing")
    dest = tmp_path / "strata-release"
    make_strata_release(dest)
    return dest


@pytest.fixture
def env(release, replica, free_port, monkeypatch) -> dict:
    e = {**os.environ, "DSV41_ENGINE_DIR": str(release), "DSV41_MODEL_DIR": str(replica),
         "DSV41_PORT": str(free_port), "DSV41_NUMA": "off", "DSV41_AUTO_RESTART": "false",
         "DSV41_READY_TIMEOUT": "240", "PYTHONUNBUFFERED": "1"}
    e.pop("STRATA_STANDIN_PACK_FAIL", None)
    yield e
    subprocess.run([sys.executable, "-m", "engine_manager", "stop", "--force"], capture_output=True, text=True,
                   timeout=120, cwd=str(ROOT), env=e)


def dsv41(env: dict, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine_manager", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=str(ROOT), env=env, stdin=subprocess.DEVNULL)


def make_plan(env: dict, replica: Path, out: Path) -> dict:
    cp = dsv41(env, "plan", "--model-dir", str(replica), "--vram-gib", "95.6", "--ram-gib", "280", "--out", str(out),
               "--no-save")
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert out.is_file(), "plan --out must write the file"
    return json.loads(out.read_text())


def group_left(pgid: int) -> list[str]:
    """Live processes (zombies waiting for their parent are ended) still in the engine's process group."""
    left = []
    for p in psutil.process_iter(["pid", "status", "cmdline"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                left.append(f"{p.pid} {p.info['status']} {' '.join(p.info['cmdline'] or [])[:120]}")
        except (ProcessLookupError, psutil.Error, OSError):
            continue
    return left


def test_start_with_a_saved_plan_provisions_once_runs_strata_and_stops_clean(env, replica, release, tmp_path):
    plan_file = tmp_path / "plan.json"
    plan = make_plan(env, replica, plan_file)
    assert plan["hardware"]["hypothetical"] and not plan["refused"]
    data = Path(env["DSV41_DATA_DIR"])
    assert not (data / "plans" / "last-plan.json").exists()                  # --no-save kept

    cp = dsv41(env, "start", "--engine", "strata", "--plan", str(plan_file))
    out = cp.stdout + cp.stderr
    assert cp.returncode == 0, out
    assert "warning: this plan was made for hypothetical host" in out        # names the host it was made for
    assert "Preparing the model for the Strata engine" in out and "pack is ready" in out
    shard1 = find_split(replica).first
    assert shard1.name == f"{STEM}-00001-of-00007.gguf"
    pack = provision.pack_dir_for(shard1)
    assert (pack / provision.SENTINEL).is_file() and (pack / "tokenizer" / "vocab.json").is_file()

    st = json.loads(dsv41(env, "status", "--json").stdout)
    assert st["state"] == "ready" and st["engine"] == "strata" and st["simulated"] is False
    # the launch as Strata's launcher makes it: --engine strata, the key in the environment only
    proc = psutil.Process(st["pid"])
    cmd = proc.cmdline()
    assert cmd[1].endswith("serve/server.py") and cmd[2:4] == ["--engine", "strata"]
    cfg = json.loads(Path(cmd[cmd.index("--config") + 1]).read_text())
    assert cfg["args"][:4] == ["--pack", str(pack), "--native", str(shard1)]
    assert cfg["tokenizer"] == str(pack / "tokenizer") and "--batch" not in cfg["args"]
    assert not any("key" in k.lower() for k in cfg)

    cp = dsv41(env, "chat", "--max-tokens", "16", "Say hello")
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert cp.stdout.strip(), "the native engine's answer"
    assert "Hello from the mock engine" not in cp.stdout

    logs = dsv41(env, "logs", "-n", "0").stdout
    assert "[engine] " in logs                                           # the native engine's own stderr

    cp = dsv41(env, "stop")
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert group_left(st["pgid"]) == []

    # a second start does not prepare again; its plan is one `dsv41 plan` saved, as the Placement tab saves one,
    # with its Strata profile file — which Strata's read_expert_profile must accept (it refused the old profiles,
    # which ranked every pair: "the header claims more ranked pairs than slots", expert_cache.cpp @2249c24)
    saved_file = tmp_path / "saved-plan.json"
    cp = dsv41(env, "plan", "--model-dir", str(replica), "--vram-gib", "95.6", "--ram-gib", "280", "--out",
               str(saved_file))
    assert cp.returncode == 0, cp.stdout + cp.stderr
    saved = json.loads(saved_file.read_text())
    assert saved["strp_path"] and Path(saved["strp_path"]).is_file()
    cp = dsv41(env, "start", "--engine", "strata", "--plan", str(saved_file))
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert "Preparing the model" not in cp.stdout + cp.stderr
    cfg2 = json.loads((data / "runs" / "strata" / "strata-config.json").read_text())
    assert saved["strp_path"] in cfg2["args"]
    st2 = json.loads(dsv41(env, "status", "--json").stdout)
    assert dsv41(env, "stop").returncode == 0 and group_left(st2["pgid"]) == []


# (a plan carrying an unknown flag no longer reaches the engine: `start --plan` refuses any flag the planner never
# writes, exit 2 — so the engine's own refusal is shown with the fork's flag)
def test_an_engine_that_refuses_an_argument_is_asked_before_the_start_and_its_words_shown(env, replica, tmp_path):
    """generate.cpp @2291cb3's option loop: "unknown argument: X", exit 2; ``--help`` after every argument it takes
    prints its usage and exits 0. ``--cpu-numerics`` is the fork's flag, which plain Strata refuses: the panel passes
    it only for cpu_numerics=gpu, asks the binary with the same arguments and ``--help`` first, and refuses the start
    with the engine's own words and the fix — no server, no engine is started."""
    plan_file = tmp_path / "plan.json"
    make_plan(env, replica, plan_file)
    record = tmp_path / "engine-record.jsonl"
    env = {**env, "DSV41_CPU_NUMERICS": "gpu", "STRATA_STANDIN_RECORD": str(record)}
    cp = dsv41(env, "start", "--engine", "strata", "--plan", str(plan_file))
    out = cp.stdout + cp.stderr
    assert cp.returncode == 1, out
    assert 'answered "unknown argument: --cpu-numerics"' in out and "asked before the start" in out, out
    assert "dsv41 settings set cpu_numerics fork" in out
    st = json.loads(dsv41(env, "status", "--json").stdout)
    assert st["state"] != "ready"
    assert "unknown argument: --cpu-numerics" in json.dumps(st.get("last_failure"))
    assert "unknown argument: --cpu-numerics" in dsv41(env, "logs", "-n", "0").stdout
    events = [json.loads(ln)["event"] for ln in record.read_text().splitlines()]
    assert events == ["help"], events                    # asked once; never started
    # with the fork's default, the same question passes and the engine starts
    env["DSV41_CPU_NUMERICS"] = "fork"
    cp = dsv41(env, "start", "--engine", "strata", "--plan", str(plan_file))
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert dsv41(env, "stop").returncode == 0
    events = [json.loads(ln)["event"] for ln in record.read_text().splitlines()]
    assert events[:3] == ["help", "help", "start"], events


def test_the_dry_run_shows_the_engines_refusal_and_the_quit_first_stop_and_starts_nothing(env, replica, tmp_path):
    """`dsv41 start --dry-run`: the binary's own refusal of an argument as a warning (it was asked, nothing was
    started), and the stop as Strata's server does it — SIGTERM to the server alone, its own budget, then the
    group."""
    plan_file = tmp_path / "plan.json"
    make_plan(env, replica, plan_file)
    record = tmp_path / "engine-record.jsonl"
    env = {**env, "DSV41_CPU_NUMERICS": "gpu", "STRATA_STANDIN_RECORD": str(record)}
    cp = dsv41(env, "start", "--engine", "strata", "--plan", str(plan_file), "--dry-run")
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert "# WARNING: This Strata engine" in cp.stdout and 'answered "unknown argument: --cpu-numerics"' in cp.stdout
    assert "stop: SIGTERM to the engine's top process alone, up to 70 s" in cp.stdout
    assert "kill -TERM <pid>; sleep 70; kill -TERM -<pgid>" in cp.stdout
    assert [json.loads(ln)["event"] for ln in record.read_text().splitlines()] == ["help"]
    assert json.loads(dsv41(env, "status", "--json").stdout)["state"] == "stopped"


def test_a_plan_file_that_is_not_a_plan_is_a_usage_error(tmp_path):
    bad = tmp_path / "plan.json"
    bad.write_text('{"hello": 1}')
    for path, words in ((bad, "is not a plan saved by this panel"), (tmp_path / "none.json", "does not exist")):
        cp = subprocess.run([sys.executable, "-m", "engine_manager", "start", "--engine", "strata", "--plan",
                             str(path)], capture_output=True, text=True, timeout=120, cwd=str(ROOT))
        assert cp.returncode == 2 and words in cp.stderr and "dsv41 plan --out" in cp.stderr, cp.stderr
        assert "Traceback" not in cp.stderr


def test_a_killed_provisioning_step_is_redone_by_the_next_start(env, replica, tmp_path):
    plan_file = tmp_path / "plan.json"
    make_plan(env, replica, plan_file)
    cp = dsv41({**env, "STRATA_STANDIN_PACK_FAIL": "after-index"}, "prepare", "--plan", str(plan_file))
    assert cp.returncode == 1 and "iq_pack.py stopped with exit code 1" in cp.stderr, cp.stdout + cp.stderr
    pack = provision.pack_dir_for(find_split(replica).first)
    assert not (pack / provision.SENTINEL).exists()
    cp = dsv41(env, "start", "--engine", "strata", "--plan", str(plan_file))
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert "Preparing the model" in cp.stdout and (pack / provision.SENTINEL).is_file()
    assert dsv41(env, "stop").returncode == 0
