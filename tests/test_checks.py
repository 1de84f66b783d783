"""Planned vs measured (engine_manager/checks.py) against real processes: the scripted engine started with
`dsv41 start` (its plan, its NUMA binding), faults switched on with DSV41_SIM_ARGS, read back with
`dsv41 status [--json]`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine_manager import checks
from engine_manager import supervisor as sv
from engine_manager.settings import load_settings

ROOT = Path(__file__).resolve().parents[1]
GPU_CHECKS = {"vram_available", "gpu_other_processes"}


def dsv41(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine_manager", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=str(ROOT))


@pytest.fixture
def start(monkeypatch, free_port):
    """``start(*sim_flags)``: `dsv41 start` with the scripted engine (fast load, fast pace) and those flags, then
    one short chat so a request has finished; the engine is stopped at the end."""
    monkeypatch.setenv("DSV41_PORT", str(free_port))

    def go(*flags: str) -> None:
        monkeypatch.setenv("DSV41_SIM_ARGS", " ".join(("--load-time 0.2 --speed 20", *flags)))
        cp = dsv41("start")
        assert cp.returncode == 0, cp.stdout + cp.stderr
        cp = dsv41("chat", "--max-tokens", "8", "What is expert offload?")
        assert cp.returncode == 0, cp.stdout + cp.stderr

    yield go
    for _ in sv.Supervisor(load_settings().settings).stop(force=True):
        pass


def status_checks() -> dict[str, dict]:
    cp = dsv41("status", "--json")
    assert cp.returncode == 0, cp.stderr
    return {c["name"]: c for c in json.loads(cp.stdout)["checks"]}


def test_the_healthy_engine_shows_every_check_ok(start):
    start()
    got = status_checks()
    assert set(got) == {"experts_in_vram", "host_arena", "no_file_reads", "numa_memory", "cpu_affinity",
                        *GPU_CHECKS}
    plan = sv.Supervisor(load_settings().settings).status().plan()
    assert got["experts_in_vram"]["planned"].startswith(f"{plan['hot_experts']:,} experts")
    assert got["experts_in_vram"]["measured"].startswith(f"{plan['hot_experts']:,} experts")
    for name, c in got.items():
        if name in GPU_CHECKS and c["ok"] is None:
            # no NVIDIA driver on this machine: unknown, said why, never ok and never failed
            assert c["state"] == "unknown" and "NVIDIA" in c["fix"]
        else:
            assert c["ok"] is True and c["state"] == "ok", c
    text = dsv41("status").stdout
    assert "Planned vs measured:" in text and "FAILED" not in text


def test_fewer_experts_admitted_and_file_reads_are_flagged_with_figures(start):
    start("--admit-experts 4000", "--file-reads")
    got = status_checks()
    plan = sv.Supervisor(load_settings().settings).status().plan()
    exp = got["experts_in_vram"]
    assert exp["ok"] is False and exp["state"] == "failed"
    assert exp["planned"].startswith(f"{plan['hot_experts']:,} experts") and exp["measured"].startswith("4,000")
    assert f"{plan['hot_experts'] - 4000:,} experts fewer than planned" in exp["fix"] and "dsv41 plan" in exp["fix"]
    reads = got["no_file_reads"]
    assert reads["ok"] is False and "expert reads from the file" in reads["measured"]
    assert not reads["measured"].startswith("0 ") and "model file" in reads["fix"]
    arena = got["host_arena"]
    assert arena["ok"] is False and arena["measured"] == "0 MiB"
    text = dsv41("status").stdout
    assert "3 of 7 checks failed" in text and "FAILED  Experts held in VRAM" in text


def test_affinity_outside_the_binding_and_memory_off_the_node_fail(tmp_path):
    """A real process whose affinity is wider than the binding's CPUs; memory placement off the bound node."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        reading = checks.read_process(proc.pid)
        assert reading.affinity and reading.node_bytes and reading.cpu_time_s is not None
        cpu0 = min(reading.affinity)
        binding = f"numactl --cpunodebind=0 --preferred=0 (node 0, CPUs {cpu0})"
        aff = checks.check_affinity(binding, reading)
        if len(reading.affinity) > 1:
            assert aff.ok is False and "outside the bound node" in aff.fix
        assert checks.check_affinity(f"taskset (node 0, CPUs {','.join(map(str, reading.affinity))})",
                                     reading).ok is True
        far = checks.ProcReading(pids=(proc.pid,), node_bytes={0: 1 << 20, 1: 9 << 20})
        mem = checks.check_numa_memory(binding, far)
        assert mem.ok is False and "10%" in mem.fix and "node 0: 1 MiB (10%)" in mem.measured
        assert checks.check_numa_memory(binding, reading).ok is True       # one node here: all of it on node 0
        # a binding that steers CPUs only: memory is not planned, so unknown — never ok, never failed
        assert checks.check_numa_memory("numactl --cpunodebind=0 (node 0, CPUs 0)", far).ok is None
    finally:
        proc.kill()
        proc.wait()


def test_numa_maps_are_summed_per_node_with_their_page_size():
    data = (b"7f00 default file=/x mapped=2 N0=2 kernelpagesize_kB=4\n"
            b"7f10 prefer:0 anon=3 dirty=3 N0=1 N1=2 kernelpagesize_kB=2048\n"
            b"7f20 default stack anon=1 N1=1\n")
    assert checks.parse_numa_maps(data) == {0: 2 * 4096 + 2 * 1024 * 1024, 1: 4 * 1024 * 1024 + 4096}


def test_an_engine_that_does_not_answer_leaves_its_checks_unknown():
    got = checks.run_checks(plan={"hot_experts": 10, "cold_experts": 5, "model": {"expert_bytes": 1 << 20}},
                            extra=None, engine_missing="the engine did not answer (ConnectError)", local=False)
    assert got and all(c.ok is None and c.state == "unknown" for c in got)
    assert "did not answer" in got[0].fix and checks.summary(got).startswith("no check could be measured")
