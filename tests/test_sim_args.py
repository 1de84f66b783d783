"""``DSV41_SIM_ARGS`` (the ``sim_args`` setting) is appended after the command line the panel builds, so a flag
there would win over the panel's: ``--host 0.0.0.0`` would put the engine on every interface, against the rule
that every engine listens on 127.0.0.1 with a generated key. Where it listens and with which key are refused
there, in words, by the scripted engine itself and before the panel starts it; its other flags still work."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from supervisor_helpers import drain

from engine_manager import supervisor as sv
from engine_manager.engine_state import READY
from engine_manager.supervisor_events import StartFailed
from engine_manager.engines.sim import ENGINE as SIM
from engine_manager.errors import EngineSetupError
from engine_manager.settings import load_settings
from engine_manager.sim.__main__ import env_args_problem

ROOT = Path(__file__).resolve().parents[1]
PANEL_ONLY = ["--host 0.0.0.0", "--host=0.0.0.0", "--ho 0.0.0.0", "--slots 2 --host 0.0.0.0", "--port 1",
              "--api-key k", "--api-key-file /tmp/k", "--plan /tmp/p.json"]


@pytest.mark.parametrize("extra", PANEL_ONLY)
def test_the_scripted_engine_refuses_where_it_listens_from_the_environment(sim_process, extra):
    sp = sim_process(env={"DSV41_SIM_ARGS": extra})
    assert sp.proc.wait(60) == 2
    out = "\n".join(sp.lines)
    assert "DSV41_SIM_ARGS gives" in out and "only the panel sets" in out, out
    assert "READY" not in out


def test_its_other_flags_still_come_from_the_environment(sim_process):
    assert env_args_problem("--slots 2 --speed 4 --die-after-tokens 20") is None
    sp = sim_process(env={"DSV41_SIM_ARGS": "--fail-at-load driver"})
    assert sp.wait_exit() == 1 and any("driver" in ln for ln in sp.lines)


def test_a_bad_value_there_is_said_not_a_traceback():
    assert "DSV41_SIM_ARGS" in env_args_problem("--port notaport")
    assert "cannot be split" in env_args_problem("--skew 'open")


@pytest.mark.parametrize("extra", PANEL_ONLY[:3])
def test_the_panel_refuses_it_before_starting_the_engine(tmp_path, extra):
    settings = load_settings().settings.model_copy(update={"sim_args": extra})
    with pytest.raises(EngineSetupError, match="only the panel sets"):
        SIM.build_launch(settings, None, tmp_path)


def test_dsv41_start_says_so_and_nothing_listens_anywhere(free_port, tmp_path):
    env = {k: v for k, v in os.environ.items()}
    env.update(DSV41_PORT=str(free_port), DSV41_SIM_ARGS="--host 0.0.0.0")
    try:
        cp = subprocess.run([sys.executable, "-m", "engine_manager", "start", "--engine", "sim"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=120)
        assert cp.returncode == 1, cp.stdout + cp.stderr
        assert "DSV41_SIM_ARGS gives --host" in cp.stdout + cp.stderr
        assert "Traceback" not in cp.stderr
    finally:
        for _ in sv.Supervisor(load_settings().settings).stop(force=True):
            pass


def test_the_supervisor_fails_the_start_in_words(monkeypatch, free_port):
    monkeypatch.setenv("DSV41_PORT", str(free_port))
    monkeypatch.setenv("DSV41_SIM_ARGS", "--host=0.0.0.0")
    sup = sv.Supervisor(load_settings().settings)
    events, _ = drain(sup.run("sim", None, watch=False))
    failed = [e for e in events if isinstance(e, StartFailed)]
    assert failed and "only the panel sets" in failed[0].message
    assert sup.status(check_health=False).state != READY
