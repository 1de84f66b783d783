"""`dsv41 diagnose --out FILE` on a machine with the scripted engine running: every part is in the zip, the file is
owner-only, and no key or token is inside — not even one the engine printed into its own log."""

from __future__ import annotations

import json
import secrets
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from engine_manager import supervisor as sv
from engine_manager.settings import load_settings

ROOT = Path(__file__).resolve().parents[1]


def dsv41(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine_manager", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=str(ROOT))


@pytest.fixture
def engine(monkeypatch, free_port):
    key, token = "sk-" + secrets.token_urlsafe(24), "hf_" + secrets.token_urlsafe(24)
    monkeypatch.setenv("DSV41_PORT", str(free_port))
    monkeypatch.setenv("DSV41_API_KEY", key)
    monkeypatch.setenv("DSV41_HF_TOKEN", token)
    monkeypatch.setenv("DSV41_SIM_ARGS", "--load-time 0.2 --speed 20")
    cp = dsv41("start")
    assert cp.returncode == 0, cp.stdout + cp.stderr
    yield key, token
    for _ in sv.Supervisor(load_settings().settings).stop(force=True):
        pass


def test_the_bundle_holds_every_part_and_no_secret(engine, tmp_path):
    key, token = engine
    assert dsv41("chat", "--max-tokens", "8", "hello").returncode == 0
    st = sv.Supervisor(load_settings().settings).status()
    # an engine that printed the key into its own log: the bundle masks it again
    with open(st.log_path, "a", encoding="utf-8") as f:
        f.write(f"engine: debug: Authorization: Bearer {key} token={token}\n")
    out = tmp_path / "bundle.zip"
    cp = dsv41("diagnose", "--out", str(out))
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    with zipfile.ZipFile(out) as z:
        names = set(z.namelist())
        blobs = {n: z.read(n) for n in names}
    assert {"doctor.json", "status.json", "plan.json", "settings.json", "checks.json", "engine-log-tail.txt",
            "README.txt"} <= names
    for name, data in blobs.items():
        assert key.encode() not in data and token.encode() not in data, name
        assert key[4:20].encode() not in data, name            # not even most of it
    log = blobs["engine-log-tail.txt"].decode()
    assert "Authorization: Bearer sk-" in log and "(masked)" in log
    checks = json.loads(blobs["checks.json"])
    assert {c["name"] for c in checks["checks"]} >= {"experts_in_vram", "no_file_reads"}
    assert json.loads(blobs["plan.json"])["hot_experts"] > 0
    assert json.loads(blobs["settings.json"])["api_key"] != key


def test_a_folder_or_a_missing_folder_is_refused_in_words(tmp_path):
    cp = dsv41("diagnose", "--out", str(tmp_path))
    assert cp.returncode == 2 and "is a folder" in cp.stderr
    cp = dsv41("diagnose", "--out", str(tmp_path / "nope" / "b.zip"))
    assert cp.returncode == 1 and "does not exist" in cp.stderr
