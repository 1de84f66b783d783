"""The supervisor against real processes: the scripted engine (``python -m engine_manager.sim``) started behind
its keeper and NUMA binding, measured with psutil. Fault switches come through ``DSV41_SIM_ARGS``."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from supervisor_helpers import (
    drain,
    hw,
    listening,
    live_group,
    sim_engine,
    tiny_engine,
    wait_until,
)

from engine_manager import paths
from engine_manager import supervisor as sv
from engine_manager.crash import classify_exit
from engine_manager.engine_state import STATE_FILE, STATE_SCHEMA, ExitInfo, RunningEngine
from engine_manager.launch import KEEPER
from engine_manager.logtail import LOG_NAME, LogTail, read_log_tail
from engine_manager.procs import alive
from engine_manager.supervisor_events import Note, Ready, StartFailed
from engine_manager.settings import load_settings

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def port(monkeypatch, free_port):
    monkeypatch.setenv("DSV41_PORT", str(free_port))
    monkeypatch.setenv("DSV41_SIM_ARGS", "--load-time 0.2")
    return free_port


def make(**kw) -> sv.Supervisor:
    opts = dict(hardware=hw(), grace_s=5.0, backoff_base_s=0.1, backoff_max_s=1.0, poll_s=0.05,
                health_every_s=0.5, silent_after_s=30.0, progress_every_s=0.2)
    opts.update(kw)
    return sv.Supervisor(load_settings().settings, **opts)


@pytest.fixture(autouse=True)
def no_engine_left_behind():
    """Safety net: whatever a test left running is stopped (and the test fails if its group survived)."""
    yield
    rec = sv.Supervisor(load_settings(generate_key=False).settings, hardware=hw()).files.read_state()
    if rec and rec.keeper_pid and alive(rec.keeper_pid, rec.keeper_start_time):
        for _ in sv.Supervisor(load_settings().settings, hardware=hw()).stop(force=True):
            pass
        pytest.fail("the test left an engine running")


class Runner:
    """Runs a supervisor generator on a thread (as the GUI's worker does) and lets the test wait for events."""

    def __init__(self, gen):
        self.q: queue.Queue = queue.Queue()
        self.events: list = []
        self.result = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(gen,), daemon=True)
        self.thread.start()

    def _run(self, gen):
        try:
            while True:
                try:
                    ev = next(gen)
                except StopIteration as stop:
                    self.result = stop.value
                    break
                self.q.put(ev)
        except BaseException as exc:  # surfaced by wait_for / join
            self.error = exc
        finally:
            self.q.put(None)

    def wait_for(self, pred, timeout: float = 20.0):
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out; events: {[e.kind for e in self.events][-30:]}")
            try:
                ev = self.q.get(timeout=left)
            except queue.Empty:
                continue
            if ev is None:
                raise AssertionError(f"generator ended ({self.error!r}); events: {[e.kind for e in self.events]}")
            self.events.append(ev)
            if pred(ev):
                return ev

    def join(self, timeout: float = 30.0):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the supervisor generator did not return"
        while True:
            try:
                ev = self.q.get_nowait()
            except queue.Empty:
                break
            if ev is not None:
                self.events.append(ev)
        if self.error:
            raise self.error
        return self.result


def kinds(evs, kind):
    return [e for e in evs if e.kind == kind]


def assert_gone(pgid: int, port: int) -> None:
    left = wait_until(lambda: not live_group(pgid), timeout=5)
    assert left, f"processes of group {pgid} left: {[(p.pid, p.name()) for p in live_group(pgid)]}"
    assert not listening(port)


# -- start → ready → chat → stop -----------------------------------------------------------------------------

def test_start_ready_chat_stop_leaves_nothing(port):
    sup = make()
    evs, st = drain(sup.run(sim_engine(), watch=False))
    ready = kinds(evs, "ready")
    assert ready and st.state == "ready", [e.to_dict() for e in evs if e.kind in ("failed", "crashed")]
    assert st.port == port and st.base_url == f"http://127.0.0.1:{port}"
    assert st.binding and "numactl" in st.binding
    pid, pgid = st.pid, st.pgid
    engine = psutil.Process(pid)
    assert os.getpgid(pid) == pgid and os.getsid(pid) == pgid != os.getsid(0)     # own session and group
    assert "engine_manager.sim" in " ".join(engine.cmdline())
    # the key is on no command line (`ps` shows those to every local user): not the engine's, not its keeper's
    key = load_settings().settings.api_key
    keeper = psutil.Process(st.keeper_pid)
    for proc in (engine, keeper):
        assert key not in " ".join(proc.cmdline()) and "--api-key-file" in proc.cmdline()
    key_file = Path(engine.cmdline()[engine.cmdline().index("--api-key-file") + 1])
    assert key_file.read_text().strip() == key and stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert sorted(engine.cpu_affinity()) == sorted(sv.Supervisor(load_settings().settings,
                                                                  hardware=hw()).binding().cpus)
    # one chat request answered
    key = load_settings().settings.api_key
    r = httpx.post(st.base_url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                   json={"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16,
                         "reasoning_effort": "none", "stream": False}, timeout=30)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["choices"][0]["message"]["content"] and answer["usage"]["completion_tokens"] > 0
    # state file: atomic, 0600, the masked command, never the key
    sf = paths.data_dir() / STATE_FILE
    assert stat.S_IMODE(sf.stat().st_mode) == 0o600
    text = sf.read_text()
    rec = json.loads(text)
    assert key not in text and rec["pid"] == pid and rec["pgid"] == pgid and rec["port"] == port
    assert rec["keeper_start_time"] and rec["pid_start_time"] and rec["engine"] == "sim"
    # the log got the engine's lines, and never the key
    log = (paths.logs_dir() / LOG_NAME).read_text()
    assert "READY" in log and key not in log
    evs, st = drain(sup.stop())
    assert st.state == "stopped" and kinds(evs, "stopped")[0].leftovers == []
    assert not kinds(evs, "stopped")[0].forced            # the sim stops on SIGTERM
    assert_gone(pgid, port)
    assert json.loads(sf.read_text())["state"] == "stopped" and "pid" not in json.loads(sf.read_text())


def test_dry_run_lists_every_command_with_the_key_masked(port):
    sup = make()
    dr = sup.dry_run(sim_engine())
    text = dr.render()
    key = load_settings().settings.api_key
    assert key not in text and "--api-key-file" in text
    assert "numactl --cpunodebind=0 --preferred=0 true" in text or "taskset" in text
    assert "keeper.py" in text and "engine_manager.sim" in text and f"--port {port}" in text
    assert "export PYTHONPATH=" in text
    assert "kill -TERM" in text and "/health" in text
    assert not listening(port) and not (paths.data_dir() / STATE_FILE).exists()


# -- crashes -------------------------------------------------------------------------------------------------

def test_the_watch_wakes_on_the_keepers_exit_and_on_a_request_not_on_a_quick_clock(port):
    """A ready engine's watch looks at its log once a second; the keeper's end (a pidfd) and a stop or detach (an
    eventfd) end its wait at once instead."""
    import select

    sup = make()
    assert sup.watch_poll_s >= 1.0
    run = Runner(sup.run(sim_engine()))
    run.wait_for(lambda e: e.kind == "ready")
    fd = sup._handle.exit_fd()
    assert fd is not None                     # Linux ≥ 5.3 has pidfd_open: exits are not found on a clock
    try:
        exit_poll = select.poll()
        exit_poll.register(fd, select.POLLIN)
        assert exit_poll.poll(0) == []            # the keeper runs
        wake = sv._Wake()
        wake_poll = select.poll()
        wake_poll.register(wake._fd, select.POLLIN)
        assert wake_poll.poll(0) == [] and not wake.is_set()
        wake.set()
        assert wake_poll.poll(0) and wake.is_set()
        assert wake.wait(60.0, fd) is False       # set: returns at once (not after 60 s); the keeper runs
        wake.clear()
        assert wake_poll.poll(0) == [] and not wake.is_set()
        evs, st = drain(sup.stop())
        assert st.state == "stopped"
        assert exit_poll.poll(30_000)             # the keeper's end made it readable
        assert wake.wait(60.0, fd) is True        # ... and ends a wait at once
    finally:
        os.close(fd)
    run.join()


def test_sigkill_is_explained_within_a_second_and_auto_restart_brings_it_back(port):
    sup = make(auto_restart=True)
    run = Runner(sup.run(sim_engine()))
    first = run.wait_for(lambda e: e.kind == "ready")
    old_pid = first.pid
    old_pgid = os.getpgid(old_pid)
    t_kill = time.time()
    os.kill(old_pid, signal.SIGKILL)
    crash = run.wait_for(lambda e: e.kind == "crashed")
    state = next(e for e in run.events if e.kind == "state" and e.state == "crashed")
    assert state.t - t_kill < 1.0, f"crash state after {state.t - t_kill:.2f} s"
    assert crash.cause == "oom_killed" and crash.signal == 9
    assert "out-of-memory killer" in crash.title and "journalctl -k" in crash.fix
    assert crash.will_restart and crash.restart_in_s == pytest.approx(0.1)
    again = run.wait_for(lambda e: e.kind == "ready")
    assert again.pid != old_pid and psutil.pid_exists(again.pid)
    assert not live_group(old_pgid)                     # the crashed group is fully gone
    evs, st = drain(sup.stop())
    result = run.join()
    assert st.state == "stopped" and result.state == "stopped"
    assert_gone(os.getpgid(again.pid) if psutil.pid_exists(again.pid) else again.pid, port)


def test_crash_loop_gives_up_and_says_so(port, monkeypatch):
    monkeypatch.setenv("DSV41_SIM_ARGS", "--load-time 0 --fail-at-load crash")
    sup = make(auto_restart=True, crash_limit=3, backoff_base_s=0.05)
    evs, st = drain(sup.run(sim_engine()))
    crashes = kinds(evs, "crashed")
    assert len(crashes) == 3 and all(c.while_starting for c in crashes)
    assert [c.will_restart for c in crashes] == [True, True, False]
    assert [c.restart_in_s for c in crashes[:2]] == [pytest.approx(0.05), pytest.approx(0.1)]   # backoff doubles
    gave = kinds(evs, "gave_up")
    assert len(gave) == 1 and "crash loop" in gave[0].message and "3 times" in gave[0].message
    assert st.state == "crashed" and not listening(port)


@pytest.mark.parametrize("fault,cause,restarts", [
    ("--fail-at-load cuda-oom", "cuda_oom", True),
    ("--fail-at-load driver", "driver_too_old", False),
    ("--fail-at-load profile", "placement_refused", False),
    ("--fail-bind", "port_in_use", False),
])
def test_failures_are_classified_in_plain_words(port, monkeypatch, fault, cause, restarts):
    monkeypatch.setenv("DSV41_SIM_ARGS", f"--load-time 0 {fault}")
    sup = make(auto_restart=True, crash_limit=2)
    evs, st = drain(sup.run(sim_engine()))
    crash = kinds(evs, "crashed")[0]
    assert crash.cause == cause, crash.to_dict()
    assert crash.title and crash.fix
    assert crash.will_restart is restarts
    if not restarts:
        assert "cannot fix" in kinds(evs, "gave_up")[0].message
    assert not listening(port)


def test_unknown_exit_shows_the_last_20_log_lines():
    eng = sim_engine()
    tail = [f"line {i}" for i in range(30)]
    hint = classify_exit(eng, ExitInfo(3, None), tail)
    assert hint.cause == "unknown" and "exit code 3" in hint.title
    assert "line 29" in hint.fix and "line 10" in hint.fix and "line 9\n" not in hint.fix


def test_silent_engine_is_stopped_and_explained(port):
    sup = make(auto_restart=False, silent_after_s=1.5, health_every_s=0.3)
    run = Runner(sup.run(sim_engine()))
    ready = run.wait_for(lambda e: e.kind == "ready")
    pgid = os.getpgid(ready.pid)
    os.kill(ready.pid, signal.SIGSTOP)                # hung: alive but not answering
    crash = run.wait_for(lambda e: e.kind == "crashed", timeout=20)
    assert crash.cause == "engine_silent" and "no reply to its health check" in crash.title
    run.join()
    assert_gone(pgid, port)


# -- stop ----------------------------------------------------------------------------------------------------

def test_stop_escalates_to_sigkill_after_the_grace_period(port):
    sup = make(grace_s=0.6)
    evs, st = drain(sup.run(tiny_engine("ignore-term"), watch=False))
    pgid = st.pgid
    t0 = time.monotonic()
    evs, st = drain(sup.stop())
    took = time.monotonic() - t0
    stopped = kinds(evs, "stopped")[0]
    assert stopped.forced and "SIGKILL after the grace period" in stopped.message and took >= 0.6
    assert any(e.signal_name == "SIGTERM" for e in kinds(evs, "stopping"))
    assert_gone(pgid, port)


def test_a_paused_engine_still_stops_on_sigterm(port):
    """SIGCONT follows SIGTERM, so an engine stopped with SIGSTOP (or Ctrl+Z) exits cleanly, no SIGKILL."""
    sup = make(grace_s=10)
    evs, st = drain(sup.run(sim_engine(), watch=False))
    os.kill(st.pid, signal.SIGSTOP)
    evs, _ = drain(sup.stop())
    assert not kinds(evs, "stopped")[0].forced
    assert_gone(st.pgid, port)


def test_stop_kills_a_child_that_left_the_group(port):
    """An engine child that called setsid() is outside the group; stop still leaves nothing behind."""
    sup = make()
    evs, st = drain(sup.run(tiny_engine("escape"), watch=False))
    assert st.state == "ready", [e.to_dict() for e in evs if e.kind in ("failed", "crashed")]
    escaped = wait_until(lambda: [c for c in psutil.Process(st.pid).children() if c.name() == "sleep"])
    assert escaped and os.getpgid(escaped[0].pid) != st.pgid
    evs, _ = drain(sup.stop())
    assert kinds(evs, "stopped")[0].leftovers == []
    assert wait_until(lambda: not alive(escaped[0].pid), timeout=5)
    assert_gone(st.pgid, port)


def test_engine_not_started_by_the_panel_is_shown_but_never_stopped(port):
    foreign = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: listening(port), timeout=10)
        sup = make()
        st = sup.status()
        assert st.state == "stopped" and st.external and st.external["pid"] == foreign.pid
        assert "not started by this panel" in st.message
        evs, _ = drain(sup.stop())
        assert any(e.kind == "note" and "never stops" in e.text for e in evs)
        assert foreign.poll() is None                  # still running
        # and start refuses with who holds the port and what to do
        evs, st = drain(sup.run(sim_engine()))
        failed = kinds(evs, "failed")[0]
        assert failed.cause == "port_in_use"
        assert f"Port {port} is in use by pid {foreign.pid}" in failed.message and "http.server" in failed.message
        assert "dsv41 settings set port" in failed.fix
        assert not (paths.data_dir() / STATE_FILE).exists() or "keeper_pid" not in \
            json.loads((paths.data_dir() / STATE_FILE).read_text())
    finally:
        foreign.terminate()
        foreign.wait(timeout=10)


# -- readiness -----------------------------------------------------------------------------------------------

def test_never_ready_times_out_with_a_message(port, monkeypatch):
    monkeypatch.setenv("DSV41_SIM_ARGS", "--load-time 0.3 --never-ready")
    sup = make(ready_timeout_s=2.5)
    evs, st = drain(sup.run(sim_engine()))
    failed = kinds(evs, "failed")
    assert failed and failed[0].cause == "ready_timeout"
    assert "did not become ready within 2 s" in failed[0].message or "within 3 s" in failed[0].message
    assert "DSV41_READY_TIMEOUT" in failed[0].fix
    assert any("never finishes" in ln for ln in failed[0].log_tail)
    assert len(kinds(evs, "progress")) >= 5 and st.state == "stopped"
    spawned = [e for e in evs if e.kind == "note" and e.text.startswith("Started")]
    assert spawned and not listening(port)


def test_slow_start_reports_phase_and_elapsed(port, monkeypatch):
    monkeypatch.setenv("DSV41_SIM_ARGS", "--load-time 2.5")
    sup = make()
    evs, st = drain(sup.run(sim_engine(), watch=False))
    prog = kinds(evs, "progress")
    phases = {p.phase for p in prog}
    assert any("expert cache" in p for p in phases) and any("warming" in p or "KV cache" in p for p in phases)
    el = [p.elapsed_s for p in prog]
    assert el == sorted(el) and el[-1] > 2.0
    fr = [p.fraction for p in prog if p.fraction is not None]
    assert fr and fr == sorted(fr) and max(fr) <= 1.0
    assert any(p.eta_s is not None for p in prog)
    assert st.state == "ready"
    drain(sup.stop())


def test_cancel_during_start_stops_the_engine(port, monkeypatch):
    monkeypatch.setenv("DSV41_SIM_ARGS", "--load-time 30")
    sup = make()
    run = Runner(sup.run(sim_engine()))
    run.wait_for(lambda e: e.kind == "progress" and e.pid)
    pgid = os.getpgid(run.events[-1].pid)
    evs, st = drain(sup.stop())
    run.join()
    assert st.state == "stopped"
    assert_gone(pgid, port)


# -- re-attach -----------------------------------------------------------------------------------------------

PANEL = """
import sys, time
from engine_manager.settings import load_settings
from engine_manager.supervisor import Supervisor
sup = Supervisor(load_settings().settings, poll_s=0.05)
for ev in sup.run("sim"):
    if ev.kind == "ready":
        print("READY", ev.pid, flush=True)
"""


def start_panel_process() -> tuple[subprocess.Popen, int]:
    panel = subprocess.Popen([sys.executable, "-c", PANEL], stdout=subprocess.PIPE, text=True, cwd=str(ROOT))
    line = panel.stdout.readline()
    assert line.startswith("READY"), line
    return panel, int(line.split()[1])


def test_killed_panel_reattaches_to_its_live_engine(port):
    panel, pid = start_panel_process()
    panel.kill()                                       # the panel dies; the engine (own session) lives on
    panel.wait()
    assert psutil.pid_exists(pid)
    sup = make()
    st = sup.status()
    assert st.state == "ready" and st.pid == pid and st.owner == "panel"
    run = Runner(sup.watch())
    att = run.wait_for(lambda e: e.kind == "attached")
    assert att.pid == pid and att.state == "ready"
    ready = run.wait_for(lambda e: e.kind == "ready")
    assert ready.attached and ready.pid == pid
    rec = json.loads((paths.data_dir() / STATE_FILE).read_text())
    assert rec["pid"] == pid and rec["supervisor_pid"] == os.getpid()          # this panel supervises it now
    assert sum(a.endswith("numactl") for a in rec["argv"]) == 1                 # the command is not garbled
    pgid = os.getpgid(pid)
    evs, st = drain(sup.stop())
    run.join()
    assert st.state == "stopped"
    assert_gone(pgid, port)


def test_status_after_a_panel_restart_keeps_the_launch_files(port, monkeypatch):
    """The routing trace a launch asked for is not on the command line (the scripted engine takes a relative
    ``--dump-routing`` from its settings into its launch files, Strata keeps the flag in its config): after the panel
    is killed, the status a new panel (or ``dsv41 monitor``) reads still says where it is, and the Monitor's hub
    counts it."""
    from engine_manager import metrics as M

    monkeypatch.setenv("DSV41_SIM_ARGS", "--load-time 0.2 --dump-routing mine.trace")
    panel, pid = start_panel_process()
    panel.kill()
    panel.wait()
    sup = make()
    st = sup.status()
    assert st.state == "ready" and st.pid == pid
    trace = st.spec.files["routing_trace"]
    assert Path(trace).is_absolute() and Path(trace).name == "mine.trace"
    assert M.trace_path_from_argv(st.argv) is None                   # the command line alone would not say
    running = RunningEngine.from_status(st, st.base_url, sup.settings.api_key)
    assert running.pid == st.pid and running.spec is st.spec and running.started_by_panel
    hub = M.build_hub(running, record=False, use_nvml=False)
    assert [str(s.path) for s in hub.sources if isinstance(s, M.RoutingSource)] == [trace]
    hub.close()
    pgid = os.getpgid(pid)
    drain(sup.stop())
    assert_gone(pgid, port)


def test_a_stop_from_another_dsv41_is_not_taken_for_a_crash(port):
    """The panel watches; `dsv41 stop` (another process, another Supervisor) stops the engine: the panel reports
    "stopped", does not classify a crash and does not restart."""
    sup = make(auto_restart=True)
    run = Runner(sup.run(sim_engine()))
    ready = run.wait_for(lambda e: e.kind == "ready")
    argv_before = json.loads((paths.data_dir() / STATE_FILE).read_text())["argv"]
    cp = subprocess.run([sys.executable, "-m", "engine_manager", "stop"], cwd=str(ROOT), capture_output=True,
                        text=True, timeout=60)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    stopped = run.wait_for(lambda e: e.kind == "stopped", timeout=20)
    assert "stopped by another dsv41" in stopped.message
    result = run.join()
    assert result.state == "stopped" and not kinds(run.events, "crashed")
    assert not psutil.pid_exists(ready.pid) or psutil.Process(ready.pid).status() == psutil.STATUS_ZOMBIE
    assert argv_before[0].endswith("numactl") and argv_before.count(argv_before[0]) == 1


def test_killed_panel_with_dead_engine_is_cleaned_up(port):
    panel, pid = start_panel_process()
    pgid = os.getpgid(pid)
    panel.kill()
    panel.wait()
    os.kill(pid, signal.SIGKILL)                       # the engine dies while no panel watches
    assert wait_until(lambda: not alive(pid), timeout=5)
    # the keeper (the group's leader) records how the engine ended, then exits: wait for that record
    assert wait_until(lambda: not alive(pgid), timeout=10)
    sup = make()
    before = sup.status(check_health=False)         # what `dsv41 status` shows before anyone cleaned up
    assert before.state == "crashed" and "while no panel was watching" in before.message
    evs, st = drain(sup.watch())
    crash = kinds(evs, "crashed")[0]
    assert crash.cause == "oom_killed"
    # the same classified explanation (cause + fix) as the clean-up gives, not just "killed by signal 9"
    assert before.last_failure["cause"] == "oom_killed"
    assert (before.last_failure["title"], before.last_failure["fix"]) == (crash.title, crash.fix)
    assert any(e.kind == "note" and "while no panel was watching" in e.text for e in evs)
    rec = json.loads((paths.data_dir() / STATE_FILE).read_text())
    assert rec["state"] == "crashed" and "keeper_pid" not in rec and rec["last_failure"]["cause"] == "oom_killed"
    assert_gone(pgid, port)
    # a later panel still shows what happened, and can start again
    st = make().status()
    assert st.state == "crashed" and st.last_failure["cause"] == "oom_killed"
    evs, st = drain(make().watch())                    # a later panel shows the cause again
    assert kinds(evs, "crashed")[0].cause == "oom_killed" and st.state == "crashed"


def test_pid_reuse_is_not_mistaken_for_the_engine(port):
    """A state file whose pid (and process group) now belongs to another process — same number, other start time —
    is neither re-attached nor cleaned up: that process and its group are left alone."""
    sf = paths.data_dir() / STATE_FILE
    sf.parent.mkdir(parents=True, exist_ok=True)
    other = subprocess.Popen(["sleep", "30"], start_new_session=True)          # leads its own group
    oc = psutil.Process(other.pid).create_time()
    sf.write_text(json.dumps({"state": "ready", "engine": "sim", "keeper_pid": other.pid,
                              "keeper_start_time": oc - 1000, "pid": other.pid, "pid_start_time": oc - 1000,
                              "pgid": other.pid, "port": port}))
    sup = make()
    try:
        evs, st = drain(sup.watch())
        assert not kinds(evs, "attached") and other.poll() is None       # not attached, not killed
        assert st.state in ("crashed", "stopped")
        evs, _ = drain(sup.stop())
        assert other.poll() is None                                       # stop does not touch it either
    finally:
        other.kill()
        other.wait()


# -- many cycles ---------------------------------------------------------------------------------------------

def port_bindable(port: int) -> bool:
    """Nothing listens on ``port`` any more: a new listener can take it (SO_REUSEADDR passes connections in
    TIME_WAIT, never another listener)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
    return True


@pytest.mark.slow
def test_fifty_start_stop_cycles_leak_nothing(port, monkeypatch):
    """50 cycles of the scripted engine through the whole path (binding prefix, keeper, state file, log, readiness
    over HTTP, SIGTERM to the group), each checked with psutil: no process of its group left, no listener on the
    port, this process's file descriptors back to where they were (no growth per cycle); at the end no child of
    this process (every keeper reaped, no zombie) and no extra thread."""
    monkeypatch.setenv("DSV41_SIM_ARGS", "--load-time 0")
    me = psutil.Process()
    kids0 = {p.pid for p in me.children(recursive=True)}    # e.g. pytest-xvfb's Xvfb
    sup = make()
    drain(sup.run(sim_engine(), watch=False))                # warm-up (imports, the shared http client)
    drain(sup.stop())

    def settled_threads() -> int:
        # a request's deadline timer (engines._http.get_capped) is cancelled when the answer is in, and its thread
        # ends a moment later: wait for those, so that neither count holds one that is ending
        for t in threading.enumerate():
            if isinstance(t, threading.Timer):
                t.join(10)
        return me.num_threads()

    fds0, threads0 = me.num_fds(), settled_threads()
    slack = 2                                                # lazily made objects; a leak of one per cycle shows
    for i in range(50):
        evs, st = drain(sup.run(sim_engine(), watch=False))
        assert st.state == "ready", (i, [e.to_dict() for e in evs if e.kind in ("failed", "crashed")])
        assert "engine_manager.sim" in " ".join(psutil.Process(st.pid).cmdline())
        pgid = st.pgid
        evs, st = drain(sup.stop())
        assert st.state == "stopped" and kinds(evs, "stopped")[0].leftovers == []
        assert not kinds(evs, "stopped")[0].forced, i          # the sim exits on SIGTERM
        assert_gone(pgid, port)
        assert port_bindable(port), i
        assert me.num_fds() <= fds0 + slack, f"cycle {i}: file descriptors {fds0} → {me.num_fds()}"
    assert {p.pid for p in me.children(recursive=True)} == kids0   # every keeper reaped: no zombie either
    assert me.num_fds() <= fds0 + slack, f"file descriptors: {fds0} → {me.num_fds()}"
    # no more threads than before the cycles (threads of earlier tests in this worker may end meanwhile: 10 → 4
    # was seen under xdist); a thread left per cycle would show as 50 more
    assert settled_threads() <= threads0


# -- logs ----------------------------------------------------------------------------------------------------

def test_keeper_rotates_by_size_masks_the_key_and_records_the_signal(tmp_path):
    log, exitf = tmp_path / "e.log", tmp_path / "exit.json"
    secret = "dsv41-" + "s3cret" * 5
    script = f"for i in $(seq 1 400); do echo \"line $i key={secret}\"; done; kill -9 $$"
    env = dict(os.environ, DSV41_KEEPER_MASK=secret)
    cp = subprocess.run([sys.executable, "-I", "-S", str(KEEPER), "--log", str(log), "--exit-file", str(exitf),
                         "--max-bytes", "4000", "--backups", "2", "--", "sh", "-c", script], env=env, timeout=30)
    assert cp.returncode == 128 + 9
    rec = json.loads(exitf.read_text())
    assert rec["signal"] == 9 and rec["signal_name"] == "SIGKILL" and rec["returncode"] == -9
    files = [log, log.with_name("e.log.1"), log.with_name("e.log.2")]
    assert all(f.exists() for f in files) and not log.with_name("e.log.3").exists()
    assert all(f.stat().st_size <= 4000 + 200 for f in files)
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    text = "".join(f.read_text() for f in reversed(files))
    assert secret not in text and "(masked)" in text
    assert "line 400" in text and "killed by signal 9" in text


def test_log_tail_follows_across_rotations(tmp_path):
    log = tmp_path / "e.log"
    log.write_text("")
    tail = LogTail(log, 0)
    got = []
    script = "for i in $(seq 1 300); do echo \"line $i\"; done"
    p = subprocess.Popen([sys.executable, "-I", "-S", str(KEEPER), "--log", str(log), "--exit-file",
                          str(tmp_path / "x.json"), "--max-bytes", "1500", "--backups", "50", "--", "sh", "-c",
                          f"{script}; sleep 0.2; {script}"])
    while p.poll() is None:
        got += tail.read()
        time.sleep(0.01)
    got += tail.read()
    tail.close()
    lines = [g for g in got if g.startswith("line ")]
    assert lines == [f"line {i}" for i in range(1, 301)] * 2


def test_read_log_tail_returns_the_newest_lines(tmp_path):
    log = tmp_path / "e.log"
    log.with_name("e.log.1").write_text("".join(f"old {i}\n" for i in range(100)))
    log.write_text("".join(f"new {i}\n" for i in range(10)))
    lines = read_log_tail(log, max_bytes=200)
    assert lines[-1] == "new 9" and lines[0].startswith("old") and len("\n".join(lines)) <= 200


# -- one engine at a time ------------------------------------------------------------------------------------

def test_another_engine_is_refused_while_one_runs_and_the_same_one_reattaches(port):
    """`dsv41 start --engine X` while the panel's engine Y runs: refused in plain words naming what runs and where
    (never attached to Y as if it were X); starting Y again re-attaches. A dry run names the port's holder as the
    panel's own engine, not a conflict."""
    sup = make()
    evs, st = drain(sup.run(sim_engine(), watch=False))
    assert st.state == "ready"
    pid = st.pid

    class Other(type(sim_engine())):
        name = "strata"                 # another engine kind (its launch is never reached)

    evs, st2 = drain(make().run(Other(), plan={}))        # (a refused plan would be said first)
    failed = kinds(evs, "failed")
    assert failed and failed[0].cause == "engine_running", [e.to_dict() for e in evs]
    msg = failed[0].message
    assert "scripted engine (simulated) is already running" in msg and f"port {port}" in msg
    assert f"pid {pid}" in msg and "Strata was not started" in msg
    assert "dsv41 stop" in failed[0].fix and "re-attaches" in failed[0].fix
    assert not kinds(evs, "attached") and not kinds(evs, "ready")
    assert sup.status().pid == pid and alive(pid)                     # the running one is untouched
    # a dry run: the port is held by the panel's own engine, named — not "IN USE by pid … engine_manager.sim"
    text = make().dry_run(sim_engine()).render()
    assert "held now by the panel's own engine" in text and "IN USE now" not in text
    assert "would re-attach" in text
    other = make().dry_run(Other()).render()
    assert "`dsv41 start` would refuse now" in other and "dsv41 stop" in other
    # the same engine again: re-attached, said so
    evs, st3 = drain(make().run(sim_engine(), watch=False))
    assert any(e.kind == "note" and "already running" in e.text and "re-attaches" in e.text for e in evs)
    assert kinds(evs, "ready")[0].attached and st3.pid == pid
    pgid = st.pgid
    drain(sup.stop())
    assert_gone(pgid, port)


def test_dry_run_with_a_refused_plan_still_prints_every_command(port):
    plan, _ = make()._default_plan("sim")
    refused = dict(plan, refused="RAM cannot hold the minimum layout: it needs 251.6 GB, the host has 25 GB.")
    dr = make().dry_run(sim_engine(), plan=refused)
    text = dr.render()
    lines = text.splitlines()
    assert lines[1].startswith("# REFUSED") and "RAM cannot hold the minimum layout" in text   # said at the top
    assert dr.refused == refused["refused"] and dr.to_dict()["refused"] == refused["refused"]
    assert "keeper.py" in text and "engine_manager.sim" in text and "/health" in text and "kill -TERM" in text
    assert "probe binding" in text and f"sport = :{port}" in text
    # the generated plan file keeps the refusal: the printed command, run by hand, refuses too
    assert json.loads(Path(dr.files["plan"]).read_text())["refused"] == refused["refused"]
    assert not listening(port)


def test_usable_plan_never_starts_a_refused_or_foreign_host_plan():
    from engine_manager.start_plan import usable_plan

    here = {"refused": None, "hardware": {"hypothetical": False}, "hot_experts": 10}
    other = {"refused": None, "hardware": {"hypothetical": True}, "hot_experts": 10}
    refused = {"refused": "RAM cannot hold the minimum layout", "hardware": {"hypothetical": False}}
    assert usable_plan("strata", here) is here and usable_plan("llamacpp", here) is here
    assert usable_plan("strata", other) is None and usable_plan("llamacpp", other) is None
    assert usable_plan("sim", other) is other          # the scripted engine may model another host
    assert all(usable_plan(e, refused) is None for e in ("sim", "strata", "llamacpp"))
    assert usable_plan("sim", None) is None


# -- hardening ----------------------------------------------------------------------------------------

def dsv41_cli(*args, timeout=90) -> subprocess.CompletedProcess:
    """The real CLI in another process, with this test's settings and data dirs (they are in the environment)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "engine_manager", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_a_stop_during_a_start_wins_and_nothing_is_restarted(port, monkeypatch):
    """`dsv41 stop` while a `dsv41 start` (another process) waits for the engine to load. The
    stop said "Stopped.", then the start reported a crash ("exited on its own (exit code 0)"), restarted the engine,
    and it ended up running. The stop must win: the start ends with "stopped by request", nothing restarts."""
    monkeypatch.setenv("DSV41_SIM_ARGS", "--load-time 60")       # a slow start: the stop comes while it loads
    sup = make(auto_restart=True, grace_s=5.0)
    run = Runner(sup.run(sim_engine(), watch=True))
    run.wait_for(lambda e: e.kind == "progress")
    rec = sup.files.read_state()
    assert rec and rec.state == "starting" and rec.alive()
    r = dsv41_cli("stop", "--grace", "5")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Stopped" in r.stdout
    st = run.join(timeout=60)
    assert not kinds(run.events, "crashed") and not kinds(run.events, "restarting"), \
        [e.to_dict() for e in kinds(run.events, "crashed")]
    msgs = [e.message for e in kinds(run.events, "stopped")]
    assert any("Stopped by request" in m and "not restarted" in m for m in msgs), msgs
    assert st.state == "stopped"
    assert_gone(rec.pgid, port)
    after = make().status(check_health=False)
    assert after.state == "stopped" and not after.last_failure


def test_the_crash_cause_comes_from_this_runs_log_only(port, monkeypatch, tmp_path):
    """a `--fail-bind` run, then an engine that exits with code 3 while no panel watches:
    `status` said "port is already in use", read from the earlier run's lines in the same log."""
    monkeypatch.setenv("DSV41_SIM_ARGS", "--load-time 0 --fail-bind")
    evs, _ = drain(make(auto_restart=False).run(sim_engine()))
    assert kinds(evs, "crashed")[0].cause == "port_in_use"          # the earlier run: really a port problem
    trigger = tmp_path / "exit-now"
    evs, st = drain(make().run(tiny_engine(f"exit3-when:{trigger}"), watch=False))
    assert st.state == "ready", [e.to_dict() for e in evs][-5:]
    trigger.write_text("now")
    assert wait_until(lambda: not alive(st.keeper_pid), timeout=20)
    log = read_log_tail(make().log_path)
    assert any("already in use" in ln for ln in log)                # the old run's words are still in the log
    now = make().status(check_health=False)
    assert now.state == "crashed"
    lf = now.last_failure
    assert lf["cause"] != "port_in_use" and "in use" not in lf["title"], lf
    assert lf["returncode"] == 3 and "exit code 3" in now.message
    assert "giving up on purpose" in lf["fix"]                      # this run's own last lines are shown


@pytest.mark.parametrize("bad", ['{"keeper_pid": "1x"}', '{"keeper_pid": 12, "port": "80"}', "[1, 2]",
                                 "{not json", '{"keeper_pid": 5}'])
def test_a_malformed_state_file_is_moved_aside_and_said_status_stop_start_work(port, bad):
    """``{"keeper_pid": "1x"}`` made `status`, `stop` and `start` fail with a TypeError. The
    record is validated as a typed one (pydantic); a bad one is moved aside and the commands say so."""
    state = paths.data_dir() / STATE_FILE
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text(bad)
    r = dsv41_cli("status")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "was not valid" in r.stdout and "moved aside to" in r.stdout, r.stdout
    assert not state.exists()
    aside = list(state.parent.glob(STATE_FILE + ".bad-*"))
    assert len(aside) == 1 and aside[0].read_text() == bad           # kept, never deleted
    state.write_text(bad)
    r = dsv41_cli("stop")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "was not valid" in r.stdout and "not running" in r.stdout
    state.write_text(bad)
    evs, st = drain(make().run(sim_engine(), watch=False))
    assert st.state == "ready", [e.to_dict() for e in evs][-5:]
    assert any("was not valid" in e.text for e in kinds(evs, "note"))
    drain(make().stop())


def test_a_symlinked_log_or_state_file_is_refused_not_followed(port, tmp_path):
    """a symlinked ``logs/engine.log`` had the engine's output appended
    to the link's target and the target chmod'ed; a symlinked state file was read through. Both are refused."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    victim.chmod(0o644)
    sup = make()
    sup.logs_dir.mkdir(parents=True, exist_ok=True)
    sup.log_path.symlink_to(victim)
    evs, st = drain(sup.run(sim_engine(), watch=False))
    failed = kinds(evs, "failed")
    assert failed and failed[0].cause == "log_refused" and "symbolic link" in failed[0].message, \
        [e.to_dict() for e in evs]
    assert st.state == "stopped" and not listening(port)
    assert victim.read_text() == "precious\n" and stat.S_IMODE(victim.stat().st_mode) == 0o644
    sup.log_path.unlink()
    # the refused start is what status tells next (the log could not take it; the state file did)
    assert make().status(check_health=False).last_failure["cause"] == "log_refused"
    sup.state_path.unlink()
    # the state file: a link to a record of a live process is not believed, and the target is left alone
    fake = tmp_path / "fake-state.json"
    me = psutil.Process()
    fake.write_text(json.dumps({"keeper_pid": me.pid, "keeper_start_time": me.create_time(), "pgid": os.getpgid(0),
                                "state": "ready", "engine": "sim", "port": port}))
    sup.state_path.parent.mkdir(parents=True, exist_ok=True)
    sup.state_path.symlink_to(fake)
    st = make().status(check_health=False)
    assert st.state == "stopped" and "symbolic link" in st.message and "moved aside" in st.message
    assert not sup.state_path.is_symlink() and fake.is_file()
    evs, _ = drain(make().stop())                                  # never signals the process the link named
    assert me.is_running()


def test_a_stop_while_a_start_prepares_keeps_the_engine_from_starting(port, tmp_path):
    """`dsv41 stop` while a start (another process's view: it holds the start
    lock) still prepares the launch, before any engine process exists. The stop names the start in progress and
    waits for it; the start then starts nothing and ends "stopped by request"."""
    trigger = tmp_path / "go-on"
    base = sim_engine()

    class SlowToPrepare(type(base)):
        def build_launch(self, settings, plan, workdir):
            end = time.monotonic() + 60
            while not trigger.exists() and time.monotonic() < end:
                time.sleep(0.02)
            return super().build_launch(settings, plan, workdir)

    sup = make(grace_s=2.0)
    run = Runner(sup.run(SlowToPrepare(), watch=False))
    assert wait_until(lambda: sup.files.start_in_flight() is not None, timeout=30)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    stop = subprocess.Popen([sys.executable, "-m", "engine_manager", "stop", "--grace", "2"], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_until(lambda: sup.files.stop_request_path.exists(), timeout=60)
        trigger.write_text("go")
        out, err = stop.communicate(timeout=90)
    finally:
        if stop.poll() is None:
            stop.kill()
            stop.wait(timeout=10)
    assert stop.returncode == 0, out + err
    assert f"A start is in progress (pid {os.getpid()})" in out, out
    st = run.join(timeout=60)
    assert not kinds(run.events, "ready") and not kinds(run.events, "crashed")
    assert not [e for e in kinds(run.events, "note") if e.text.startswith("Started ")]     # no process was made
    assert any("Stopped by request" in e.message for e in kinds(run.events, "stopped"))
    assert st.state == "stopped" and not listening(port)


# -- one event base, the typed state file, the engine session ---------------------------------------

def test_events_are_frozen_on_one_base_and_consumed_with_match():
    import dataclasses

    from engine_manager import supervisor_events as events

    classes = [c for c in vars(events).values() if isinstance(c, type) and issubclass(c, events.Event)
               and c is not events.Event]
    assert len({c.kind for c in classes}) == len(classes) == 12           # one kind each
    ready = Ready("http://127.0.0.1:1", 1.5, "sim", 42, simulated=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ready.pid = 7
    d = ready.to_dict()
    assert d["kind"] == "ready" and d["pid"] == 42 and d["t"] <= time.time()
    failed = StartFailed("port_in_use", "Port 1 is in use", "fix", suggested_port=2)
    seen = []
    for ev in (ready, failed, Note("x", "warning", cause="external_engine")):
        match ev:
            case Ready(base_url=url, pid=pid):
                seen.append((url, pid))
            case StartFailed(cause="port_in_use", suggested_port=alt):
                seen.append(alt)
            case Note(cause=cause):
                seen.append(cause)
    assert seen == [("http://127.0.0.1:1", 42), 2, "external_engine"]


def test_the_state_file_is_read_as_a_typed_record(port):
    from engine_manager.engine_record import EngineRecord

    sup = make()
    evs, st = drain(sup.run(sim_engine(), watch=False))
    assert st.state == "ready", [e.to_dict() for e in evs if e.kind in ("failed", "crashed")]
    try:
        rec = sup.files.read_state()
        assert isinstance(rec, EngineRecord) and rec.alive() and rec.pid == st.pid and rec.port == port
        assert rec.schema_version == STATE_SCHEMA and rec.plan_path == st.plan_path
        on_disk = json.loads((paths.data_dir() / STATE_FILE).read_text())
        assert rec.to_json_dict() == on_disk                       # written back as it was read: nothing added
        with pytest.raises(ValueError):
            EngineRecord.from_json(b'{"keeper_pid": 5}')          # a keeper without its start time is not ours
    finally:
        drain(sup.stop())
    assert not sup.files.read_state().alive()


def test_engine_session_keeps_the_running_handle_and_tells_listeners(port):
    from engine_manager.session import EngineSession

    session = EngineSession(load_settings().settings, supervisor=make())
    seen: list = []
    running: list = []
    session.subscribe(on_event=seen.append, on_running=running.append)
    # the session's own start feeds every event it passes on (the one door: no caller touches the supervisor)
    evs, final = drain(session.start(sim_engine(), watch=False))
    r = session.running
    st = session.status(check_health=False)
    assert isinstance(r, RunningEngine) and running == [r] and any(isinstance(e, Ready) for e in seen)
    assert seen == evs and final.state == "ready" == st.state
    assert r.base_url == f"http://127.0.0.1:{port}" and r.pid == st.pid and r.started_by_panel and r.simulated
    assert r.log_path == str(session.log_path) and r.spec is not None and r.api_key not in repr(r)
    # the plan is named, read off the GUI thread only (with_plan / the hub)
    assert r.plan is None and (r.plan_path is None or r.with_plan().plan == st.plan())
    pgid = st.pgid
    quiet = list(session.stop(feed=False))                # the caller feeds (the panel, on the GUI thread)
    assert quiet and session.running is r and running == [r]
    for ev in quiet:
        session.feed(ev)
    assert session.running is None and running == [r, None]
    assert_gone(pgid, port)
    # the plots continue across a restart at the same address within the window, and only then
    now = time.time()
    assert EngineSession.carries_plots(r, r.with_(pid=1), now - 5, now)
    assert not EngineSession.carries_plots(r, r.with_(base_url="http://127.0.0.1:1"), now - 5, now)
    assert not EngineSession.carries_plots(r, r, now - EngineSession.CONTINUE_PLOT_S - 1, now)
    assert not EngineSession.carries_plots(None, r, now, now)


# -- a step of the wall clock --------------------------------------------------------------------------------

class SteppedWallClock:
    """The ``time`` module as the supervisor's modules see it, with a wall clock the test steps as NTP or a person
    setting the time would. A real step needs CAP_SYS_TIME and moves the whole machine's clock (libfaketime cannot
    leave the monotonic clock alone under Python 3.11: its ``clock_nanosleep`` then fails with EINVAL). The
    monotonic and boot clocks, the sleeps and everything else are the real ones."""

    def __init__(self):
        self.offset = 0.0

    def time(self) -> float:
        return time.time() + self.offset

    def time_ns(self) -> int:
        return time.time_ns() + int(self.offset * 1e9)

    def __getattr__(self, name):
        return getattr(time, name)


@pytest.fixture
def wall_clock(monkeypatch):
    from engine_manager import engine_process, procs, state_files

    clock = SteppedWallClock()
    for mod in (sv, engine_process, procs, state_files):
        monkeypatch.setattr(mod, "time", clock)
    return clock


def test_a_clock_step_while_the_engine_loads_does_not_time_it_out(port, monkeypatch, wall_clock):
    monkeypatch.setenv("DSV41_SIM_ARGS", "--load-time 2")
    run = Runner(make(ready_timeout_s=60).run(sim_engine(), watch=False))
    run.wait_for(lambda e: e.kind == "progress")
    wall_clock.offset = 7200.0                       # two hours forward, mid-load
    ready = run.wait_for(lambda e: e.kind in ("ready", "failed"), timeout=60)
    assert ready.kind == "ready", ready.to_dict()
    assert ready.elapsed_s < 60                       # the load's own time, not the step
    assert run.join(timeout=30).state == "ready"
    drain(make().stop())


def test_a_clock_step_back_does_not_starve_the_health_checks(port, wall_clock):
    sup = make(auto_restart=False, silent_after_s=1.5, health_every_s=0.3)
    run = Runner(sup.run(sim_engine()))
    ready = run.wait_for(lambda e: e.kind == "ready")
    pgid = os.getpgid(ready.pid)
    wall_clock.offset = -7200.0                      # two hours back: the next check was due in 0.3 s, not 2 h
    os.kill(ready.pid, signal.SIGSTOP)               # hung: alive but not answering
    crash = run.wait_for(lambda e: e.kind == "crashed", timeout=30)
    assert crash.cause == "engine_silent"
    run.join()
    assert_gone(pgid, port)


def test_a_stop_after_a_clock_step_still_wins_over_a_start(port, monkeypatch, wall_clock):
    """The start's clock read two hours ahead when it began (as after a step back since): the stop written by
    `dsv41 stop` is newer on the boot clock and must still be obeyed."""
    monkeypatch.setenv("DSV41_SIM_ARGS", "--load-time 60")
    wall_clock.offset = 7200.0
    sup = make(auto_restart=True, grace_s=5.0)
    run = Runner(sup.run(sim_engine(), watch=True))
    run.wait_for(lambda e: e.kind == "progress")
    rec = sup.files.read_state()
    r = dsv41_cli("stop", "--grace", "5")
    assert r.returncode == 0, r.stdout + r.stderr
    st = run.join(timeout=60)
    assert not kinds(run.events, "crashed") and not kinds(run.events, "restarting")
    assert st.state == "stopped"
    assert rec is not None and rec.pgid
    assert_gone(rec.pgid, port)
