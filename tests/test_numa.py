"""NUMA binding: each strategy probed by really running it; the fallback order under a REAL seccomp filter (installed
with libseccomp through ctypes in a launcher process that then execs the probe), the one-node message, an unknown
GPU node on a two-node host, numactl missing from PATH, and a fake numactl as an extra unit test."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import require_or_skip

from engine_manager import numa
from engine_manager.hardware import GpuInfo, HardwareReport, HostInfo, NumaNodeInfo, numa_nodes

HAVE_NUMACTL = shutil.which("numactl") is not None
HAVE_TASKSET = shutil.which("taskset") is not None


def _seccomp_available() -> bool:
    try:
        import ctypes
        ctypes.CDLL("libseccomp.so.2")
        return True
    except OSError:
        return False


def need_tools() -> None:
    """numactl and taskset (skipped without them here; a failure under CI)."""
    if not (HAVE_NUMACTL and HAVE_TASKSET):
        require_or_skip("numactl and taskset are needed (apt-get install numactl util-linux)")


def need_seccomp() -> None:
    if not _seccomp_available():
        require_or_skip("libseccomp.so.2 is not installed (apt-get install libseccomp2)")


def probe_under_seccomp(deny: str, errno_name: str = "EPERM", env: dict | None = None) -> dict:
    """Run `python -m engine_manager.numa --json` in a process whose seccomp filter refuses ``deny``."""
    cmd = [sys.executable, "-m", "engine_manager.numa_seccomp_probe", "--deny", deny, "--errno", errno_name]
    cp = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env,
                        cwd=str(Path(__file__).resolve().parents[1]))
    if cp.returncode == 2 and "seccomp_load failed" in cp.stderr:
        require_or_skip(f"this kernel or sandbox does not let a process install a seccomp filter: "
                        f"{cp.stderr.strip()}")
    assert cp.returncode == 0, cp.stderr
    return json.loads(cp.stdout)


def host_report(nodes: list[NumaNodeInfo], gpu_node: int | None) -> HardwareReport:
    gpu = GpuInfo(0, "NVIDIA RTX PRO 6000", "GPU-x", "00000000:41:00.0", 96 << 30, 95 << 30, 1 << 30,
                  "580.65", "13.0", "12.0", numa_node=gpu_node, numa_node_source="sysfs" if gpu_node is not None
                  else "unknown")
    host = HostInfo("h", "Linux", 512 << 30, 500 << 30, 64, 32, nodes, "/", None, None, shutil.which("numactl"),
                    shutil.which("taskset"))
    return HardwareReport([gpu], None, host)


# -- the real machine -----------------------------------------------------------------------------------------

def test_strongest_binding_works_here_and_one_node_message():
    need_tools()
    b = numa.choose_binding(None)
    assert b.strategy == "numactl-preferred"
    assert Path(b.prefix[0]).name == "numactl" and b.prefix[1:] == [f"--cpunodebind={b.node}", f"--preferred={b.node}"]
    assert [a.strategy for a in b.attempts] == ["numactl-preferred"] and b.attempts[0].ok
    # the probe really ran: the command is `<prefix> true`
    assert b.attempts[0].command[-1] == "true"
    if len(numa_nodes()) == 1:
        assert b.single_node
        assert "one NUMA node" in b.note and "cannot change speed" in b.note
        assert any("one NUMA node" in line for line in b.describe())


def test_binding_prefix_really_binds_a_process():
    """The chosen prefix, run in front of a real command, leaves it with exactly the node's CPUs."""
    need_tools()
    b = numa.choose_binding(None)
    out = subprocess.run([*b.prefix, sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    assert json.loads(out) == sorted(b.cpus)


def test_binding_off_in_settings():
    b = numa.choose_binding(None, mode="off")
    assert b.strategy == "none" and b.prefix == [] and b.attempts == []
    assert "turned off" in b.reason


# -- real seccomp refusals --------------------------------------------------------------------------------------

def test_seccomp_refusing_set_mempolicy_falls_back_to_cpunodebind():
    """Docker's default profile without CAP_SYS_NICE: set_mempolicy/mbind → EPERM."""
    need_seccomp()
    need_tools()
    d = probe_under_seccomp("set_mempolicy,mbind")
    assert d["strategy"] == "numactl-cpunodebind"
    first, second = d["attempts"]
    assert first["strategy"] == "numactl-preferred" and not first["ok"]
    assert "Operation not permitted" in first["output"]            # numactl's own words, from the real refusal
    assert "set_mempolicy" in first["reason"] and "seccomp" in first["reason"]
    assert second["strategy"] == "numactl-cpunodebind" and second["ok"]
    assert "numactl --cpunodebind=0 --preferred=0 true" in d["reason"]


def test_seccomp_hiding_memory_policy_calls_falls_back_to_taskset():
    """A sandbox that answers ENOSYS for the NUMA calls: numactl cannot run at all; taskset still binds CPUs."""
    need_seccomp()
    need_tools()
    d = probe_under_seccomp("get_mempolicy,set_mempolicy,mbind", "ENOSYS")
    assert d["strategy"] == "taskset"
    assert [a["strategy"] for a in d["attempts"]] == ["numactl-preferred", "numactl-cpunodebind", "taskset"]
    assert [a["ok"] for a in d["attempts"]] == [False, False, True]
    assert "does not support NUMA policy" in d["attempts"][0]["output"]
    assert Path(d["prefix"][0]).name == "taskset" and d["prefix"][1] == "-c"


def test_seccomp_refusing_affinity_too_falls_back_to_none_with_every_reason():
    need_seccomp()
    need_tools()
    d = probe_under_seccomp("set_mempolicy,mbind,sched_setaffinity")
    assert d["strategy"] == "none" and d["prefix"] == []
    assert [a["ok"] for a in d["attempts"]] == [False, False, False]
    for a in d["attempts"]:
        assert "Operation not permitted" in a["output"]
        assert "affinity" in a["reason"]
    assert d["reason"].count("failed:") == 3


def test_seccomp_and_no_numactl_on_path_uses_taskset(tmp_path):
    """numactl not installed (a PATH without it) inside a container that refuses set_mempolicy."""
    need_seccomp()
    need_tools()
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("taskset", "true"):
        os.symlink(shutil.which(tool), bindir / tool)
    env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{Path(sys.executable).parent}")
    d = probe_under_seccomp("set_mempolicy,mbind", env=env)
    assert d["strategy"] == "taskset"
    assert "not installed" in d["attempts"][0]["reason"]


def test_seccomp_launcher_refuses_unknown_syscall():
    need_seccomp()
    cp = subprocess.run([sys.executable, "-m", "engine_manager.numa_seccomp_probe", "--deny", "no_such_call", "--",
                         "true"], capture_output=True, text=True, timeout=30)
    assert cp.returncode == 2 and "unknown system call" in cp.stderr


# -- topology cases ------------------------------------------------------------------------------------------------

def test_gpu_node_unknown_on_two_node_host_does_not_guess():
    nodes = [NumaNodeInfo(0, [0, 1], 256 << 30, 200 << 30), NumaNodeInfo(1, [2, 3], 256 << 30, 200 << 30)]
    b = numa.choose_binding(host_report(nodes, None))
    assert b.strategy == "none" and b.attempts == [] and not b.single_node
    assert "unknown" in b.reason and "nvidia-smi topo -m" in b.reason
    assert b.note is None


def test_gpu_node_unknown_on_one_node_host_uses_that_node():
    need_tools()
    nodes = numa_nodes()
    if len(nodes) != 1:
        pytest.skip("needs a one-node host")
    b = numa.choose_binding(host_report(nodes, None))
    assert b.node == nodes[0].id and b.bound


def test_strategy_order_for_a_node():
    s = numa.strategies(1, [8, 9, 10, 11], which=lambda n: f"/usr/bin/{n}")
    assert [x.name for x in s] == ["numactl-preferred", "numactl-cpunodebind", "taskset", "none"]
    assert s[0].prefix == ["/usr/bin/numactl", "--cpunodebind=1", "--preferred=1"]
    assert s[2].prefix == ["/usr/bin/taskset", "-c", "8-11"]


def test_fake_numactl_on_path_unit(tmp_path):
    """Extra unit test: a numactl that always refuses (as a broken install would) makes taskset the choice."""
    if not HAVE_TASKSET:
        require_or_skip("taskset is needed (apt-get install util-linux)")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "numactl"
    fake.write_text("#!/bin/sh\necho 'numactl: fake refusal for the test' >&2\nexit 1\n")
    fake.chmod(0o755)
    os.symlink(shutil.which("taskset"), bindir / "taskset")
    env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    b = numa.choose_binding(None, env=env)
    assert b.strategy == "taskset"
    assert all("fake refusal" in a.output for a in b.attempts[:2])
