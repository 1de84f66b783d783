"""Shared fixtures. Every test runs with its own config and data dirs, and with no DSV41_* variable from the
caller's environment, so nothing a developer has set leaks in and nothing a test writes leaks out."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"

# fixtures shared across modules: the GUI tests' fixtures and their marker rule (tests/gui_conftest.py), the Strata
# stand-in release and its small model (tests/strata_support.py), the chat tests' engines (tests/chat_support.py),
# the attach tests' servers and the tiny GGUF (tests/attach_support.py)
pytest_plugins = ["gui_conftest", "strata_support", "chat_support", "attach_support"]


def require_or_skip(reason: str) -> None:
    """A prerequisite of the test is missing here: skip on a developer's machine, but FAIL under CI (CI=true),
    where an acceptance test that silently skips would pass without testing anything."""
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        pytest.fail(f"missing prerequisite under CI: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(autouse=True)
def isolated_dirs(tmp_path_factory, monkeypatch):
    base = tmp_path_factory.mktemp("dsv41home")
    for k in list(os.environ):
        if k.startswith("DSV41_") or k in {"HF_TOKEN", "HF_ENDPOINT"}:
            monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("DSV41_CONFIG_DIR", str(base / "config"))
    monkeypatch.setenv("DSV41_DATA_DIR", str(base / "data"))
    monkeypatch.setenv("DSV41_CACHE_DIR", str(base / "cache"))
    monkeypatch.setenv("HF_HOME", str(base / "hf"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    return base


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_PORT_BLOCK = 1500          # ports of one xdist worker
_next_port: dict[str, int] = {}


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, for an engine a test starts on its own port.

    Taken below the kernel's ephemeral range (``ip_local_port_range``), each xdist worker from its own block: a
    port the kernel picks (``bind(0)``, what ``engine_manager.procs.free_port`` and every test server do, and the
    source port of every outgoing connection) is released before the engine binds it, and another worker's test
    server once took it in that moment ("Port 42217 is in use by pid … python -u -c import sys;exec(…)", CI)."""
    from engine_manager.procs import free_port as pick
    from engine_manager.procs import port_free

    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    n = int(worker[2:]) if worker[2:].isdigit() else 0
    lo = 16000 + (n % 10) * _PORT_BLOCK
    if lo + _PORT_BLOCK > _ephemeral_low():
        return pick("127.0.0.1")              # an unusual range: the kernel's pick, as before
    for _ in range(_PORT_BLOCK):
        port = _next_port.get(worker, lo)
        _next_port[worker] = lo + (port + 1 - lo) % _PORT_BLOCK
        if port_free("127.0.0.1", port):
            return port
    return pick("127.0.0.1")


@pytest.fixture
def data_dir() -> Path:
    return DATA


@pytest.fixture
def sim_process():
    """The one way tests start the scripted engine: ``sim_process(*argv, **kw)`` starts a
    :class:`~engine_manager.sim.launch.SimProcess` (a real process on loopback, its own process group, a generated
    key in a 0600 file) and returns it started, not yet ready (chain ``.wait_ready()``: the one readiness probe).
    ``kw`` goes to ``SimProcess`` (``port``, ``api_key``, ``env``, ``load_time``, ``cwd``). Every one is stopped
    (SIGTERM to its group, then SIGKILL) at the end of the test."""
    from engine_manager.sim.launch import SimProcess

    started: list[SimProcess] = []

    def start(*args: str, **kw) -> SimProcess:
        sp = SimProcess(args, **kw)
        started.append(sp)
        return sp.start()

    yield start
    for sp in started:
        sp.stop()


@pytest.fixture
def sim1(sim_process):
    """The scripted engine with one slot, ready, and the plan's hot set (warm): one user decodes at the guides'
    63.11 tok/s."""
    return sim_process("--slots", "1").wait_ready()
