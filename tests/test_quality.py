"""The quality check (``dsv41 bench --preset quality``): the sandbox that runs generated code holds (network, writes
outside its folder, 10 GB, a fork bomb, a hang: each stopped and scored 0 within its limits), a known-good HumanEval
answer scores 1 and a known-bad 0, GSM8K files are checked and scored by their final number, the determinism table
on the scripted engine (batched fork answers diverge; gpu numerics and strata_reproducible never), and the CLI end
to end on the scripted engine, the engine put back as it was."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from engine_manager import supervisor as sv
from engine_manager.engine_state import READY
from engine_manager.bench import quality as Q
from engine_manager.bench.sandbox import Limits, SandboxUnavailable, run_python
from engine_manager.errors import UserError
from engine_manager.settings import load_settings

ROOT = Path(__file__).resolve().parents[1]
FAST = Limits(cpu_s=5, memory_bytes=1024 * 2**20, file_bytes=1 * 2**20, processes=16, wall_s=10.0)


def _sandbox_or_skip() -> None:
    try:
        run_python("pass", FAST)
    except SandboxUnavailable as exc:      # a machine without namespaces: the refusal itself is what is checked
        assert "not run here" in str(exc)
        pytest.skip(str(exc))


@pytest.fixture
def port(monkeypatch, free_port):
    monkeypatch.setenv("DSV41_PORT", str(free_port))
    monkeypatch.setenv("DSV41_SIM_ARGS", "--speed 10")
    yield free_port
    for _ in sv.Supervisor(load_settings().settings).stop(force=True):
        pass


# ------------------------------------------------------------------------------------------------ the sandbox
def test_a_known_good_humaneval_answer_scores_1_and_a_known_bad_0():
    _sandbox_or_skip()
    probs = Q.humaneval_problems()
    p = probs["HumanEval/0"]
    good = Q.check_humaneval(p, p["canonical_solution"], FAST)                  # the completion, as the package has it
    assert good["passed"] and good["status"] == "passed"
    whole = "```python\n" + p["prompt"] + p["canonical_solution"] + "```"     # the whole function, in a code block
    assert Q.check_humaneval(p, whole, FAST)["passed"]
    bad = Q.check_humaneval(p, "    return not True\n", FAST)
    assert not bad["passed"] and bad["status"] == "failed" and "AssertionError" in bad["output"]


@pytest.mark.parametrize("name, source, words", [
    ("network", "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=3)\n", "unreachable"),
    ("loopback", "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=3)\n", "unreachable"),
    ("write outside", "open({target!r}, 'w').write('x')\n", "Read-only file system"),
    ("10 GB", "x = bytearray(10 * 2**30)\n", "MemoryError"),
    ("big file", "open('big', 'wb').write(b'x' * (8 * 2**20))\n", "File too large"),
])
def test_a_sample_that_escapes_is_stopped_and_scored_0(name, source, words):
    _sandbox_or_skip()
    import shutil
    import tempfile
    open_dir = Path(tempfile.mkdtemp())       # a folder anyone may write: only the read-only mount stops the write
    open_dir.chmod(0o777)
    try:
        target = open_dir / f"escape-{uuid.uuid4().hex}"
        r = run_python(source.format(target=str(target)), FAST)
        assert not r.passed and r.status == "failed", (name, r)
        assert words in r.output, (name, r.output)
        assert not target.exists()
    finally:
        shutil.rmtree(open_dir, ignore_errors=True)


def _sandboxed() -> set[int]:
    """The processes running a sandboxed program now (``python -I -S -B prog.py``)."""
    out = set()
    for p in psutil.process_iter(["cmdline"]):
        if (p.info["cmdline"] or [])[-1:] == ["prog.py"]:
            out.add(p.pid)
    return out


@pytest.mark.parametrize("name, source, statuses", [
    ("hang", "while True:\n    pass\n", {"killed", "timeout"}),                 # the CPU limit or the wall clock
    ("sleep", "import time\ntime.sleep(1000)\n", {"timeout"}),
    ("fork bomb", "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
     {"killed", "timeout"}),
    ("escaped child", "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(1000)\n"
                      "time.sleep(1000)\n", {"timeout"}),
])
def test_a_sample_that_hangs_or_forks_without_end_is_killed_and_scored_0(name, source, statuses):
    _sandbox_or_skip()
    before = _sandboxed()
    limits = Limits(cpu_s=3, memory_bytes=512 * 2**20, file_bytes=2**20, processes=16, wall_s=4.0)
    r = run_python(source, limits)
    assert not r.passed and r.status in statuses, (name, r)
    assert r.wall_s < limits.wall_s + 30          # killed on its limits, not left to run (generous: a loaded host)
    # nothing of it is left: the PID namespace died with its first process (also a child that left the process
    # group), and the fork bomb was held by the process limit
    assert not _sandboxed() - before


def test_the_fork_bomb_is_held_by_the_process_limit():
    """Counted from inside: at most the process limit's worth of forks succeed (RLIMIT_NPROC; as root the
    program runs as nobody, since the kernel does not hold root to that limit)."""
    _sandbox_or_skip()
    src = ("import os, sys\nn = 0\nfor _ in range(200):\n    try:\n        pid = os.fork()\n    except OSError:\n"
           "        break\n    if pid == 0:\n        import time; time.sleep(30)\n        os._exit(0)\n    n += 1\n"
           "print('forked', n)\nsys.exit(0 if n < 200 else 1)\n")
    r = run_python(src, Limits(cpu_s=5, memory_bytes=512 * 2**20, file_bytes=2**20, processes=8, wall_s=10.0))
    assert r.passed, r
    forked = int(r.output.split("forked", 1)[1].split()[0])
    assert forked < 8


def test_a_sample_writes_in_its_own_folder_only():
    _sandbox_or_skip()
    r = run_python("open('here.txt', 'w').write('ok')\nprint(open('here.txt').read())\n", FAST)
    assert r.passed and "ok" in r.output


# ------------------------------------------------------------------------------------------------ data and scoring
def test_the_subset_is_fixed_by_its_seed():
    ids = [f"HumanEval/{i}" for i in range(164)]
    assert Q.subset(ids, 10, 7) == Q.subset(list(reversed(ids)), 10, 7)
    assert Q.subset(ids, 10, 7) != Q.subset(ids, 10, 8)
    assert len(Q.subset(ids, 500, 1)) == 164


def test_gsm8k_files_are_checked_and_scored_by_the_final_number(tmp_path):
    f = tmp_path / "gsm.jsonl"
    f.write_text(json.dumps({"question": "2+2?", "answer": "2+2=4\n#### 4"}) + "\n\n"
                 + json.dumps({"question": "Cost?", "answer": "#### 1,250"}) + "\n")
    items = Q.load_gsm8k(f)
    assert [x["expected"] for x in items] == ["4", "1250"]
    assert Q.gsm8k_extract("so 2+2 = 4.\nAnswer: 4") == "4"
    assert Q.gsm8k_extract("It costs $1,250.00 in all") == "1250"
    assert Q.gsm8k_extract("first 3, then 5") == "5"
    assert Q.gsm8k_extract("no number") is None
    bad = tmp_path / "bad.jsonl"
    for text, words in (("not json\n", "not JSON"), (json.dumps({"q": 1}) + "\n", "question"),
                        (json.dumps({"question": "x", "answer": "no marker"}) + "\n", "####"), ("\n", "no items")):
        bad.write_text(text)
        with pytest.raises(UserError, match=words) as e:
            Q.load_gsm8k(bad)
        assert "openai/gsm8k" in str(e.value) or "no items" in str(e.value)
    with pytest.raises(UserError, match="No GSM8K file"):
        Q.load_gsm8k(tmp_path / "missing.jsonl")


def test_first_divergence():
    assert Q.first_divergence(["a", "b", "c"], ["a", "b", "c"]) is None
    assert Q.first_divergence(["a", "b", "c"], ["a", "x", "c"]) == 1
    assert Q.first_divergence(["a", "b"], ["a", "b", "c"]) == 2


# ------------------------------------------------------------------------------------------------ the scripted engine
def test_the_determinism_table_on_the_scripted_engine(port, tmp_path):
    """Batched fork answers diverge late; gpu numerics and strata_reproducible never (simulated)."""
    from supervisor_helpers import drain
    spec = Q.QualitySpec.make("sim", quick=True, humaneval_n=0, gsm8k_n=0)
    events, doc = drain(Q.run_quality(load_settings().settings, spec))
    assert doc["error"] is None and not doc["cancelled"], doc["error"]
    rows = {r["mode"]: r for r in doc["determinism"]}
    assert set(rows) == {"fork", "reproducible", "gpu"}
    assert all(r["simulated"] for r in rows.values())
    fork = rows["fork"]
    assert fork["identical"] < fork["prompts"] and fork["first_divergence_min"] is not None
    assert fork["first_divergence_min"] >= spec.determinism_tokens // 2          # late, not at the first token
    for m in ("reproducible", "gpu"):
        assert rows[m]["identical"] == rows[m]["prompts"] == spec.determinism_prompts
        assert rows[m]["first_divergence_min"] is None


def test_the_cli_runs_the_quality_check_end_to_end_and_puts_the_engine_back(port, tmp_path):
    _sandbox_or_skip()
    env = dict(os.environ)
    # an engine runs before: it must run again afterwards, as it was
    for _ in sv.Supervisor(load_settings().settings).run("sim", None, watch=False):
        pass
    before = sv.Supervisor(load_settings().settings).status()
    assert before.state == READY
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text(json.dumps({"question": "Tom has 3 apples and buys 4. How many?", "answer": "#### 7"}) + "\n")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "engine_manager", "bench", "--preset", "quality", "--quick",
                           "--engine", "sim", "--json", "--gsm8k", str(gsm), "--out", str(out)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["schema"] == "dsv41-quality" and doc["simulated"] is True and doc["error"] is None
    assert doc["spec"]["seed"] == Q.QualitySpec().seed and doc["spec"]["quick"] is True
    assert len(doc["tasks"]["humaneval"]) == 3 and doc["tasks"]["gsm8k"] == ["gsm8k/1"]
    he = [x for x in doc["items"] if x["bench"] == "humaneval"]
    assert len(he) == 3 and all(x["answer"] and x["status"] in ("failed", "passed") for x in he)
    assert doc["scores"]["humaneval"]["guide"] == 0.890 and doc["scores"]["gsm8k"]["deepseek_api"] == 0.960
    assert doc["scores"]["ifeval"]["items"] == 0 and "not scored" in doc["ifeval"]["why"]
    assert {r["mode"] for r in doc["determinism"]} == {"fork", "reproducible", "gpu"}
    assert doc["engine_settings"]["cpu_numerics"] == "fork"
    assert load_settings().settings.api_key not in proc.stdout
    saved = list(out.glob("quality_*.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text())["id"] == doc["id"]
    csv_rows = (out / f"{doc['id']}.csv").read_text().splitlines()
    assert csv_rows[0].startswith("bench,id,passed") and len(csv_rows) == 1 + 4 + 3 * 4
    after = sv.Supervisor(load_settings().settings).status()
    assert after.state == READY and after.engine == "sim" and after.pid != before.pid
    assert "--slots 1 " in " ".join(after.argv) + " "          # its own settings again, not the check's 4 slots


@pytest.mark.llamacpp
@pytest.mark.timeout(600)
def test_the_cli_runs_the_quality_check_on_stock_llamacpp_with_the_tiny_moe(monkeypatch, free_port, tmp_path):
    """The same pipeline on a real llama-server serving the tiny MoE GGUF: HumanEval answers run in the sandbox and
    are scored, GSM8K by its final number, the determinism table (alone vs batched) is measured; the scores are
    marked as not comparable with the guides' (a model of a few MB), and nothing is left running."""
    from conftest import require_or_skip

    from engine_manager import llamacpp_bin
    from engine_manager.testing.tinymoe import write_tinymoe

    try:
        llamacpp_bin.find_llama_server()
    except llamacpp_bin.LlamaServerNotFound as exc:
        require_or_skip(f"llama-server is not installed: {exc}")
    _sandbox_or_skip()
    model = write_tinymoe(tmp_path / "tinymoe")
    monkeypatch.setenv("DSV41_PORT", str(free_port))
    env = {**os.environ, "DSV41_LLAMACPP_MODEL": str(model), "DSV41_CONTEXT_LENGTH": "4096"}
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text(json.dumps({"question": "Tom has 3 apples and buys 4. How many?", "answer": "#### 7"}) + "\n")
    try:
        proc = subprocess.run([sys.executable, "-m", "engine_manager", "bench", "--preset", "quality", "--quick",
                               "--engine", "llamacpp", "--json", "--gsm8k", str(gsm), "--out", str(tmp_path / "out")],
                              capture_output=True, text=True, env=env, cwd=ROOT, timeout=540)
    finally:
        for _ in sv.Supervisor(load_settings().settings).stop(force=True):
            pass
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["error"] is None and doc["simulated"] is False and doc["engine"]["engine"] == "llamacpp"
    assert doc["comparable"] is False and doc["verdict"].startswith("Not the guides' model (")
    assert doc["model_file"]["sha256"] and doc["model_file"]["file"] == str(model)
    he = [x for x in doc["items"] if x["bench"] == "humaneval"]
    assert len(he) == 3 and all(x["status"] in ("failed", "passed") for x in he), he    # each ran, none errored
    gs = [x for x in doc["items"] if x["bench"] == "gsm8k"]
    assert len(gs) == 1 and gs[0]["expected"] == "7"
    assert doc["scores"]["humaneval"]["items"] == 3 and 0.0 <= doc["scores"]["humaneval"]["score"] <= 1.0
    rows = doc["determinism"]
    assert [r["mode"] for r in rows] == ["engine"] and rows[0]["prompts"] > 0 and not rows[0]["simulated"]
    assert sv.Supervisor(load_settings().settings).status().state != READY       # nothing left running
