"""Shared fixtures. Every test runs with its own config and data dirs, and with no DSV41_* variable from the
caller's environment, so nothing a developer has set leaks in and nothing a test writes leaks out."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"


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


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def data_dir() -> Path:
    return DATA


@pytest.fixture
def sims():
    """Start scripted engines (``SimProcess``, real processes on loopback) with ``sims(*argv, **kw)``; every one
    is stopped at the end of the test."""
    from engine_manager.sim.launch import SimProcess

    started: list[SimProcess] = []

    def start(*args: str, **kw) -> SimProcess:
        sp = SimProcess(args, **kw).start()
        started.append(sp)
        return sp

    yield start
    for sp in started:
        sp.stop()
