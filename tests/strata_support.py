"""The stand-in Strata release for tests: `serve/server.py`, `engine/strata` (+ `engine/BUILD.json`), `tools/iq_pack.py`
and a `.venv`, laid out as Strata's setup lays a release out (tests/strata_release/, read its files' docstrings for
what each copies from Strata and where it was read).

    release = make_strata_release(tmp_path / "engine")      # DSV41_ENGINE_DIR for the panel
    pack = run_iq_pack(release, shard1, tmp_path / "packs/m")

The `.venv` is a real virtual environment (`python -m venv --without-pip`, the standard library only) whose
site-packages get `tests/strata_release/venv-site-packages/`: stubs NAMED jinja2 and regex (the server and the
tokenizer import them, as Strata's serve/frontend.py and tools/strata_tokenizer.py import the real ones; the panel's
own environment has neither) and `nvidia/cu13/lib/libcublas.so.13` (the folder setup.py's cuda_lib_dirs() finds,
which the stand-in engine needs on LD_LIBRARY_PATH). `engine/strata` gets the .venv's Python as its shebang.
Fault switches (environment of the process that runs them):
  STRATA_STANDIN_FAIL=oom | oom-session | no-ready | die-after:N   (engine/strata)
  STRATA_STANDIN_TOKEN_DELAY_S=X                                    (engine/strata: X s before each token)
  STRATA_STANDIN_RECORD=FILE                                        (engine/strata: what it saw, what ended it)
  STRATA_STANDIN_PACK_FAIL=after-dense | after-index                (tools/iq_pack.py: die part-way)
  STRATA_STANDIN_STRICT_SHARDS=1                                    (tools/iq_pack.py: Strata's refusal of a layer
                                                                     whose experts lie in two shards)
  STRATA_STANDIN_UPSTREAM_ARCHES=1                                  (tools/iq_pack.py: upstream's architecture list)
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

TEMPLATE = Path(__file__).parent / "strata_release"


VENV_SITE = TEMPLATE / "venv-site-packages"


def make_strata_release(dest: Path, venv: bool = True) -> Path:
    """Copy the stand-in release to `dest` (created; must not exist or be empty), make its `.venv` (unless `venv` is
    False: a release whose setup never ran), make `engine/strata` executable with the release's Python as its
    shebang, and return `dest`."""
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise FileExistsError(f"{dest} is not empty")
    shutil.copytree(TEMPLATE, dest, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", VENV_SITE.name))
    python = sys.executable
    if venv:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest / ".venv")], check=True,
                       capture_output=True, timeout=120)
        site = next((dest / ".venv" / "lib").glob("python3*/site-packages"))
        shutil.copytree(VENV_SITE, site, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        python = str(release_python(dest))
    exe = dest / "engine" / "strata"
    lines = exe.read_text(encoding="utf-8").splitlines(keepends=True)
    lines[0] = f"#!{python}\n"
    exe.write_text("".join(lines), encoding="utf-8")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return dest


def release_python(release: Path) -> Path:
    """The stand-in release's own `.venv` Python (what runs its server and tools, as in Strata's setup)."""
    return Path(release) / ".venv" / "bin" / "python"


def cuda_lib_dir(release: Path) -> Path:
    """The release's `.venv` folder with libcublas.so.13 (setup.py cuda_lib_dirs(): nvidia/cu13/lib)."""
    return next((Path(release) / ".venv" / "lib").glob("python3*/site-packages")) / "nvidia" / "cu13" / "lib"


def engine_env(release: Path, **extra) -> dict:
    """The environment Strata's server gives its engine with the config's lib_dirs (server.py child_env): this one's
    with the release's CUDA library folder first on LD_LIBRARY_PATH."""
    old = os.environ.get("LD_LIBRARY_PATH", "")
    return {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join([str(cuda_lib_dir(release))] + ([old] if old else [])),
            **extra}


def run_iq_pack(release: Path, shard1: Path, out: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python tools/iq_pack.py --gguf SHARD1 --out PACK` with the release's .venv Python, the way Strata's setup runs
    it."""
    return subprocess.run([str(release_python(release)), str(Path(release) / "tools" / "iq_pack.py"), "--gguf",
                           str(shard1), "--out", str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def strata_config(release: Path, pack: Path, shard1: Path, log: Path | None, *, args: list | None = None,
                  model_name: str = "DeepSeek-V4.1-Flash", **extra) -> dict:
    """A config shaped like the one Strata's setup writes (write_setup_config): exe relative to cwd, the engine's
    args starting with --pack and --native, the pack's tokenizer, the log."""
    cfg = {"exe": "engine/strata", "cwd": str(release), "args": ["--pack", str(pack), "--native", str(shard1),
                                                             *(args or ["--max-context", "4096"])],
           "tokenizer": str(Path(pack) / "tokenizer"), "model_name": model_name,
           "lib_dirs": [str(cuda_lib_dir(release))]}
    if log is not None:
        cfg["log"] = str(log)
    cfg.update(extra)
    return cfg


def wait_port(port: int, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    """Until 127.0.0.1:port accepts (the server opens it after the engine's READY), or the server ended."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(f"the server ended (exit {proc.returncode}) before it opened port {port}")
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"port {port} did not open within {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def strata_release(tmp_path) -> Path:
    return make_strata_release(tmp_path / "strata-release")


@pytest.fixture(scope="session")
def small_model(tmp_path_factory):
    """A small split replica (2 shards, named <name>-0000N-of-00002.gguf) and its stand-in pack, made once."""
    from engine_manager.replica import ReplicaSpec, write_replica
    d = tmp_path_factory.mktemp("strata-model")
    spec = ReplicaSpec.small(with_chat_template=True)
    result = write_replica(d / "model", spec)
    release = make_strata_release(d / "release")
    pack = d / "packs" / "small"
    r = run_iq_pack(release, result.paths[0], pack)
    assert r.returncode == 0, r.stdout + r.stderr
    return {"paths": list(result.paths), "shard1": result.paths[0], "pack": pack, "spec": spec}


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(json.dumps(cfg), encoding="utf-8")
    return path
