"""`dsv41 start | stop | status | logs | binding` as a user runs them: real CLI processes, the scripted engine
left running detached between commands, measured with psutil."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from engine_manager import supervisor as sv
from engine_manager.settings import load_settings
from supervisor_helpers import listening, live_group, wait_until

ROOT = Path(__file__).resolve().parents[1]


def dsv41(*args: str, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine_manager", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=str(ROOT), **kw)


@pytest.fixture
def port(monkeypatch, free_port):
    monkeypatch.setenv("DSV41_PORT", str(free_port))
    monkeypatch.setenv("DSV41_SIM_ARGS", "--load-time 0.2")
    yield free_port
    for _ in sv.Supervisor(load_settings().settings).stop(force=True):   # never leave an engine behind
        pass


def status() -> dict:
    return sv.Supervisor(load_settings().settings).status().to_dict()


def test_start_status_logs_stop_round_trip(port):
    cp = dsv41("start")
    assert cp.returncode == 0, cp.stdout + cp.stderr
    out = cp.stdout
    assert "No NVIDIA GPU here" in out and "scripted engine (simulated)" in out and "replica" in out
    assert "ready:" in out and f"http://127.0.0.1:{port}" in out and "dsv41 stop" in out
    # the engine outlives the CLI, in its own session
    st = json.loads(dsv41("status", "--json").stdout)
    for k in ("state", "engine", "pid", "port", "base_url", "binding"):
        assert k in st
    assert st["state"] == "ready" and st["engine"] == "sim" and st["port"] == port
    assert st["base_url"] == f"http://127.0.0.1:{port}" and "numactl" in st["binding"]
    pid, pgid = st["pid"], st["pgid"]
    assert psutil.pid_exists(pid) and os.getsid(pid) == pgid != os.getsid(0)
    logs = dsv41("logs", "-n", "50").stdout
    assert "READY" in logs and "(masked)" in logs
    # a second start says it is already running and starts nothing new
    again = dsv41("start")
    assert again.returncode == 0 and "already running" in again.stdout
    assert status()["pid"] == pid
    stop = dsv41("stop")
    assert stop.returncode == 0 and "Stopped" in stop.stdout
    assert wait_until(lambda: not live_group(pgid) or all(p.status() == psutil.STATUS_ZOMBIE
                                                          for p in live_group(pgid)), timeout=10)
    assert not listening(port)
    text = dsv41("status").stdout
    assert "stopped" in text and "binding" in text


def test_dry_run_prints_every_command_and_starts_nothing(port):
    cp = dsv41("start", "--dry-run")
    assert cp.returncode == 0, cp.stderr
    out = cp.stdout
    assert "probe binding numactl-preferred" in out and "numactl --cpunodebind=0 --preferred=0 true" in out
    assert "engine_manager.sim" in out and "keeper.py" in out and "(masked)" in out
    assert "export PYTHONPATH=" in out and "one NUMA node" in out
    settings = json.loads((Path(os.environ["DSV41_CONFIG_DIR"]) / "settings.json").read_text())
    assert settings["api_key"] not in out
    assert not listening(port) and status()["state"] == "stopped"


def test_port_in_use_is_refused_with_who_and_what_to_do(port):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
    try:
        cp = dsv41("start")
        assert cp.returncode == 1
        assert f"Port {port} is in use by pid {os.getpid()}" in cp.stdout
        assert "dsv41 settings set port" in cp.stdout
        st = status()
        assert st["state"] == "stopped" and st["external"]["pid"] == os.getpid()
        stop = dsv41("stop")                           # shown, never stopped
        assert stop.returncode == 1 and "never stops" in stop.stdout
    finally:
        s.close()


def test_foreground_prints_the_log_and_stops_on_ctrl_c(port):
    p = subprocess.Popen([sys.executable, "-m", "engine_manager", "start", "--foreground"], cwd=str(ROOT),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in p.stdout:
            lines.append(line)
            if line.startswith("ready:"):
                break
        assert any("| READY" in ln for ln in lines), "".join(lines)
        pid = status()["pid"]
        pgid = os.getpgid(pid)
        p.send_signal(signal.SIGINT)
        rest = p.communicate(timeout=30)[0]
        assert p.returncode == 130, rest
        assert "Stopped" in rest
        assert not live_group(pgid) and not listening(port)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_crash_loop_from_the_cli_exits_1(port, monkeypatch):
    monkeypatch.setenv("DSV41_SIM_ARGS", "--load-time 0 --fail-at-load driver")
    cp = dsv41("start")
    assert cp.returncode == 1
    assert "CRASHED" in cp.stdout and "driver is too old" in cp.stdout.lower().replace("nvidia ", "")
    assert "580.65" in cp.stdout


def test_binding_command_explains_one_node():
    cp = dsv41("binding")
    assert cp.returncode == 0
    if len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) <= 1:
        assert "one NUMA node" in cp.stdout and "cannot change speed" in cp.stdout
    assert "probe:" in cp.stdout


def test_logs_without_any_engine_says_so():
    cp = dsv41("logs")
    assert cp.returncode == 0 and "No engine log yet" in cp.stderr
