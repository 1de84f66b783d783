"""Asking an engine binary its usage (llama-server ``--help``, Strata's option loop) reads its answer with a cap:
a binary that writes without end, or never ends, is killed and gives no verdict — the panel's memory never holds
more than the cap (``subprocess.run`` kept everything until its timeout). Real processes."""

from __future__ import annotations

import resource
import stat
import sys
from pathlib import Path

import psutil

from engine_manager.engines.llamacpp import accepted_options
from engine_manager.engines.strata import refused_arguments
from engine_manager.procs import run_capped

ENDLESS = "import sys\nwhile True:\n    sys.stdout.write('--option-%d ' % 1 * 4096)\n"
FOREVER = "import time\ntime.sleep(3600)\n"


def script(tmp_path: Path, name: str, body: str) -> Path:
    p = tmp_path / name
    p.write_text(f"#!{sys.executable}\n{body}")
    p.chmod(p.stat().st_mode | stat.S_IXUSR)
    return p


def gone(pid: int) -> bool:
    return not psutil.pid_exists(pid)


def test_a_program_that_writes_without_end_is_cut_at_the_cap_and_killed(tmp_path):
    r = run_capped([sys.executable, "-c", ENDLESS], timeout=120, cap=1 << 20)
    assert r.cut and r.returncode is None and len(r.stdout) == 1 << 20 and r.stderr == b""
    assert gone(r.pid)


def test_a_program_that_never_ends_is_killed_at_its_deadline(tmp_path):
    r = run_capped([sys.executable, "-c", FOREVER], timeout=1.0, cap=1 << 20)
    assert r.cut and r.returncode is None and r.stdout == b""
    assert gone(r.pid)


def test_a_program_that_answers_is_read_whole(tmp_path):
    r = run_capped([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(2)"],
                   timeout=60, cap=1 << 20)
    assert not r.cut and r.returncode == 2 and r.stdout == b"out\n" and r.stderr == b"err\n"


def test_usage_questions_give_no_verdict_on_an_endless_or_hanging_binary(tmp_path, monkeypatch):
    monkeypatch.setattr("engine_manager.engines.llamacpp.HELP_TIMEOUT_S", 2.0)
    monkeypatch.setattr("engine_manager.engines.strata.HELP_TIMEOUT_S", 2.0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss          # KiB: this process's high-water mark
    for body in (ENDLESS, FOREVER):
        exe = script(tmp_path, f"bin-{len(body)}", body)
        assert accepted_options(str(exe)) is None
        assert refused_arguments({"exe": str(exe), "args": ["--no-such-flag"]}, None) == []
    # what was read of the endless writer stayed within the caps (1 MB a stream), not seconds of its output
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 100 * 1024
    # a binary that does answer as Strata's option loop does: its refusal, in its words
    said = ("import sys\nfor a in sys.argv[1:]:\n    if a == '--help':\n        sys.exit(0)\n"
            "    if a not in ('--serve',):\n        print('unknown argument: ' + a, file=sys.stderr)\n"
            "        print('usage: strata --pack DIR [--serve]', file=sys.stderr)\n        sys.exit(2)\n")
    exe = script(tmp_path, "strata", said)
    out = refused_arguments({"exe": str(exe), "args": ["--no-such-flag", "1"]}, None)
    assert len(out) == 1 and 'answered "unknown argument: --no-such-flag"' in out[0]
    assert refused_arguments({"exe": str(exe), "args": []}, None) == []


def test_a_release_python_that_never_answers_is_said_so(tmp_path):
    """``dsv41 doctor``'s question to the release's own Python (does it import the server's needs?)."""
    from engine_manager.release_check import python_imports

    for body in (ENDLESS, FOREVER):
        ok, said = python_imports(script(tmp_path, f"python-{len(body)}", body), timeout_s=2.0)
        assert not ok and "did not answer within 2 s (or wrote more than 1 MB)" in said, said
    ok, said = python_imports(Path(sys.executable), modules=("json",))
    assert ok and said == ""
    ok, said = python_imports(Path(sys.executable), modules=("no_such_module_here",))
    assert not ok and "No module named 'no_such_module_here'" in said
