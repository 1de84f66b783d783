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

from engine_manager import hardware
from engine_manager import supervisor as sv
from engine_manager.exitcodes import ExitCode
from engine_manager.procs import alive
from engine_manager.settings import load_settings
from supervisor_helpers import listening, live_group, wait_until
from terminal_sigint import popen_interruptible

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
    key = load_settings().settings.api_key
    assert "READY" in logs and "--api-key-file" in logs and key not in logs     # the key is in a 0600 file
    # a second start says it is already running and starts nothing new
    again = dsv41("start")
    assert again.returncode == 0 and "already running" in again.stdout
    assert status()["pid"] == pid
    # another engine is refused, naming what runs and where and how to stop it (exit 1, nothing attached)
    other = dsv41("start", "--engine", "llamacpp")
    assert other.returncode == 1, other.stdout + other.stderr
    assert (f"The scripted engine (simulated) is already running on port {port}" in other.stdout
            and "llama.cpp was not started" in other.stdout and "dsv41 stop" in other.stdout)
    assert "re-attached" not in other.stdout and status()["pid"] == pid
    # a dry run names the port's holder as the panel's own engine, not a conflict
    dry = dsv41("start", "--dry-run")
    assert dry.returncode == 0 and "held now by the panel's own engine" in dry.stdout
    assert "IN USE now" not in dry.stdout
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
    assert "engine_manager.sim" in out and "keeper.py" in out and "--api-key-file" in out
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
        assert stop.returncode == ExitCode.FAIL and "never stops" in stop.stdout
        # as JSON lines the refusal carries the free port as a field of its own (no front end parses the fix)
        js = dsv41("start", "--json")
        failed = [d for d in map(json.loads, js.stdout.splitlines()) if d["kind"] == "failed"]
        assert js.returncode == ExitCode.FAIL and len(failed) == 1 and failed[0]["cause"] == "port_in_use"
        alt = failed[0]["suggested_port"]
        assert isinstance(alt, int) and alt != port and f"settings set port {alt}" in failed[0]["fix"]
        assert isinstance(failed[0]["t"], float)
    finally:
        s.close()


def test_foreground_prints_the_log_and_stops_on_ctrl_c(port):
    p = popen_interruptible([sys.executable, "-m", "engine_manager", "start", "--foreground"], cwd=str(ROOT),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in p.stdout:               # until both the engine's READY line and the CLI's "ready:" are shown
            lines.append(line)
            if any(ln.startswith("ready:") for ln in lines) and any("| READY" in ln for ln in lines):
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


# `dsv41` with the supervisor's restart backoff shortened (2 s doubling to 16 s by default, 30 s of waiting for the
# five crashes of a loop); nothing else differs from `python -m engine_manager`. No setting changes the backoff.
FAST_BACKOFF_CLI = """
import sys
from engine_manager import supervisor as sv
from engine_manager.cli import main
init = sv.Supervisor.__init__
def fast(self, *a, **kw):
    kw.setdefault("backoff_base_s", 0.05)
    init(self, *a, **kw)
sv.Supervisor.__init__ = fast
sys.exit(main(sys.argv[1:]))
"""


def test_crash_loop_from_the_cli_gives_up_says_so_and_exits_1(port, monkeypatch):
    """A crash the supervisor may retry (a segfault while loading): `dsv41 start` restarts it with backoff until
    the crash-loop limit, then gives up, says so and exits 1, leaving nothing running."""
    monkeypatch.setenv("DSV41_SIM_ARGS", "--load-time 0 --fail-at-load crash")
    cp = subprocess.run([sys.executable, "-c", FAST_BACKOFF_CLI, "start"], capture_output=True, text=True,
                        timeout=120, cwd=str(ROOT))
    out = cp.stdout
    assert cp.returncode == 1, out + cp.stderr
    limit = sv.Supervisor(load_settings().settings).crash_limit
    assert out.count("CRASHED:") == limit, out
    retries = [ln for ln in out.splitlines() if ln.startswith("  restarting in")]
    assert len(retries) == limit - 1, out                           # every crash but the last is retried
    gave_up = [ln for ln in out.splitlines() if ln.startswith("gave up:")]
    assert len(gave_up) == 1 and "crash loop" in gave_up[0] and f"crashed {limit} times" in gave_up[0], out
    crashed = {ln for ln in out.splitlines() if ln.startswith("CRASHED:")}
    assert len(crashed) == 1 and "crash" in crashed.pop().lower()     # one cause, said each time
    assert "Last cause: The engine crashed" in gave_up[0]
    st = status()
    assert st["state"] == "crashed" and st["pid"] is None and not listening(port)


def test_permanent_failure_from_the_cli_is_not_retried_and_exits_1(port, monkeypatch):
    monkeypatch.setenv("DSV41_SIM_ARGS", "--load-time 0 --fail-at-load driver")
    cp = dsv41("start")
    assert cp.returncode == 1
    assert "CRASHED" in cp.stdout and "driver is too old" in cp.stdout.lower().replace("nvidia ", "")
    assert "580.65" in cp.stdout and "restarting in" not in cp.stdout and "cannot fix" in cp.stdout


# an engine started the way `dsv41 start` leaves it (detached, its starter gone), which ignores SIGTERM
START_IGNORING_TERM = """
import sys
sys.path.insert(0, sys.argv[1])
from supervisor_helpers import tiny_engine
from engine_manager.settings import load_settings
from engine_manager.supervisor import Supervisor
for ev in Supervisor(load_settings().settings).run(tiny_engine("ignore-term"), watch=False):
    if ev.kind == "ready":
        print("READY", ev.pid, flush=True)
"""


def nothing_running_in(pgid: int) -> bool:
    """No process of the group runs (a zombie waiting for init to reap it runs nothing)."""
    try:
        return all(p.status() == psutil.STATUS_ZOMBIE for p in live_group(pgid))
    except psutil.NoSuchProcess:
        return False


def test_stop_force_kills_at_once_and_leaves_nothing(port):
    cp = subprocess.run([sys.executable, "-c", START_IGNORING_TERM, str(Path(__file__).parent)],
                        capture_output=True, text=True, timeout=60, cwd=str(ROOT))
    assert cp.returncode == 0 and cp.stdout.startswith("READY"), cp.stdout + cp.stderr
    pid = int(cp.stdout.split()[1])
    pgid = os.getpgid(pid)
    assert status()["state"] == "ready" and listening(port)
    # a grace period far beyond the timeout: only a SIGKILL at once can finish in time
    stop = dsv41("stop", "--force", "--grace", "3600", timeout=60)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert "Stopped with SIGKILL." in stop.stdout and "SIGTERM" not in stop.stdout, stop.stdout
    assert wait_until(lambda: nothing_running_in(pgid), timeout=5), [p.pid for p in live_group(pgid)]
    assert not alive(pid) and not listening(port)
    assert status()["state"] == "stopped"


def test_binding_command_explains_one_node():
    cp = dsv41("binding")
    assert cp.returncode == 0
    if len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) <= 1:
        assert "one NUMA node" in cp.stdout and "cannot change speed" in cp.stdout
    assert "probe:" in cp.stdout


def test_logs_without_any_engine_says_so():
    cp = dsv41("logs")
    assert cp.returncode == 0 and "No engine log yet" in cp.stderr


def test_status_after_an_unattended_crash_explains_it_like_stop(port):
    assert dsv41("start").returncode == 0
    pid = status()["pid"]
    os.kill(pid, signal.SIGKILL)                       # e.g. the OOM killer, while no panel watches
    assert wait_until(lambda: not alive(pid), timeout=10)
    st = dsv41("status")
    assert st.returncode == 0 and "crashed" in st.stdout
    assert "killed by signal 9" in st.stdout and "ended while no panel was watching" in st.stdout
    title = next(ln for ln in st.stdout.splitlines() if ln.startswith("last failure:")).split(":", 1)[1].strip()
    fix = next(ln for ln in st.stdout.splitlines() if ln.startswith("what to do:")).split(":", 1)[1].strip()
    assert "out-of-memory" in title and "journalctl" in fix
    stop = dsv41("stop")                                # the clean-up says the very same
    assert f"CRASHED: {title}" in stop.stdout and f"what to do: {fix}" in stop.stdout


def test_dry_run_with_a_refused_plan_prints_the_commands_under_the_refusal(port):
    if hardware.probe(Path("/tmp")).has_gpu:
        pytest.skip("Strata's plan is refused here only without a GPU")
    cp = dsv41("start", "--engine", "strata", "--dry-run")
    assert cp.returncode == 3, cp.stdout + cp.stderr          # the start would be refused
    out = cp.stdout
    assert out.splitlines()[1].startswith("# REFUSED") and "no GPU to plan for" in out
    assert "keeper.py" in out and "serve/server.py" in out and "--config" in out and "numactl" in out
    assert "export STRATA_API_KEY=" in out and "(masked)" in out and "/health" in out
    settings = json.loads((Path(os.environ["DSV41_CONFIG_DIR"]) / "settings.json").read_text())
    assert settings["api_key"] not in out and not listening(port)


def test_logs_follow_exits_130_on_ctrl_c(port):
    log = sv.Supervisor(load_settings().settings).log_path
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("[dsv41] an earlier line\n")
    p = popen_interruptible([sys.executable, "-m", "engine_manager", "logs", "-f"], cwd=str(ROOT),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert "an earlier line" in p.stdout.readline()
        with open(log, "a") as f:
            f.write("a new line\n")
        assert "a new line" in p.stdout.readline()           # following
        p.send_signal(signal.SIGINT)
        p.communicate(timeout=20)
        assert p.returncode == 130
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_doctor_says_no_gpu_once_per_line():
    """On a machine without the NVIDIA driver (this one: NVML's library is absent), `dsv41 doctor` gives the reason
    once; it used to print "GPU: none (no NVIDIA driver found (…is missing): no NVIDIA GPU)"."""
    gpus, reason, _ = hardware.probe_gpus()
    if gpus or not reason or "libnvidia-ml" not in reason:
        pytest.skip(f"needs a machine without the NVIDIA driver (here: {len(gpus)} GPU(s), {reason!r})")
    cp = dsv41("doctor")
    lines = [ln for ln in cp.stdout.splitlines() if "libnvidia-ml.so" in ln]
    assert len(lines) == 2, cp.stdout                      # the summary line and the GPU check
    for ln in lines:
        said = ln.lower()
        assert said.count("none") + said.count("no nvidia gpu") + said.count("not found") <= 1, ln
        assert said.count("no nvidia") == 1, ln
