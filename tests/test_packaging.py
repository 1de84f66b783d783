"""Packaging: the wheel carries the resources and runs from a fresh virtual environment; the entry
scripts run as the one-folder bundle runs them (top-level scripts); in the bundle the project's own helper
processes (keeper, scripted engine) start through the bundle's ``dsv41``; the desktop entry installs for a bundle
and its removal leaves nothing behind.

The slow part, building the PyInstaller bundle and smoke-testing it (start/chat/stop, window screenshot), is in
``scripts/smoke_packaging.sh``, not here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
RESOURCES = ["dsv41-panel.desktop", "dsv41-panel.svg", "manifests/engine.json", "manifests/model.json"]


def _run(argv, **kw) -> subprocess.CompletedProcess:
    kw.setdefault("timeout", 240)
    return subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, **kw)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """``pip wheel . --no-deps`` of a copy of the source (as a fresh clone has it: no build/ or egg-info)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    junk = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("engine_manager", "app", "resources"):
        shutil.copytree(ROOT / name, src / name, ignore=junk)
    out = tmp_path_factory.mktemp("wheel")
    r = _run([PY, "-m", "pip", "wheel", str(src), "--no-deps", "-q", "-w", str(out)])
    if r.returncode != 0 and ("Could not find a version" in r.stderr or "No matching distribution" in r.stderr):
        pytest.skip(f"the wheel's build requirements cannot be fetched here: {r.stderr[-300:]}")
    assert r.returncode == 0, r.stderr
    (whl,) = out.glob("dsv41_panel-*.whl")
    return whl


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """The wheel installed (not editable) into a fresh virtual environment. Its dependencies come from the test
    environment's site-packages through a path file (added to ``sys.path`` only, so the test environment's own
    editable install of this project is not seen)."""
    venv = tmp_path_factory.mktemp("venv")
    r = _run([PY, "-m", "venv", "--without-pip", str(venv)])
    assert r.returncode == 0, r.stderr
    import sysconfig
    deps = sysconfig.get_paths()["purelib"]
    site = Path(_run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
                     ).stdout.strip())
    (site / "zz-test-deps.pth").write_text(deps + "\n")
    r = _run([PY, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--no-deps", "--no-index", "-q",
              str(wheel)])
    assert r.returncode == 0, r.stderr
    return venv


def test_wheel_contains_the_resources(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    data = "dsv41_panel-0.1.0.data/data/share/dsv41-panel/resources/"
    missing = [r for r in RESOURCES if data + r not in names]
    assert not missing, f"the wheel lacks {missing}"
    assert "dsv41_panel-0.1.0.data/data/share/applications/dsv41-panel.desktop" in names
    assert "engine_manager/frozen.py" in names and "app/main.py" in names
    assert not any(n.startswith(("tests/", "resources/")) for n in names)


def test_installed_wheel_runs_and_finds_its_resources(installed, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    bin_ = installed / "bin"
    r = _run([str(bin_ / "dsv41"), "--version"], env=env, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("dsv41 "), r.stderr
    r = _run([str(bin_ / "dsv41"), "doctor", "--json"], env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "hardware" in json.loads(r.stdout)
    where = _run([str(bin_ / "python"), "-c", "import engine_manager, engine_manager.paths as p; "
                  "print(engine_manager.__file__); print(p.resources_dir())"], env=env, cwd=tmp_path)
    assert where.returncode == 0, where.stderr
    module_file, res = where.stdout.split()
    assert Path(module_file).is_relative_to(installed), f"engine_manager came from {module_file}, not the wheel"
    assert Path(res) == installed / "share" / "dsv41-panel" / "resources"
    for name in RESOURCES:
        assert (Path(res) / name).is_file(), name
    assert (bin_ / "dsv41-panel").is_file()


@pytest.mark.gui
def test_installed_wheel_window_screenshot(installed, tmp_path):
    """The installed ``dsv41-panel`` shows its window (on pytest-xvfb's display) and saves a picture of it."""
    png = tmp_path / "window.png"
    r = _run([str(installed / "bin" / "dsv41-panel"), "--screenshot", str(png), "--screenshot-delay", "1"],
             cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    from PySide6.QtGui import QImage
    img = QImage(str(png))
    assert not img.isNull() and img.width() >= 400 and img.height() >= 300


@pytest.mark.parametrize("script,expect", [("engine_manager/__main__.py", "dsv41 "),
                                           ("app/__main__.py", "usage: dsv41-panel")])
def test_entry_scripts_run_as_top_level_scripts(script, expect, tmp_path):
    """PyInstaller runs each entry script as a top-level script (no parent package): a relative import there
    killed both bundled executables with ``ImportError: attempted relative import with no known parent package``."""
    arg = "--version" if script.startswith("engine_manager") else "--help"
    r = _run([PY, str(ROOT / script), arg], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert expect in r.stdout


@pytest.fixture
def as_bundle(monkeypatch, tmp_path):
    """This process as the bundle's ``dsv41-panel`` sees itself: ``sys.frozen`` set and ``sys.executable`` the
    bundle's executable (PyInstaller's bootloader sets both)."""
    bundle = tmp_path / "dsv41-panel"
    bundle.mkdir()
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    monkeypatch.setattr(sys, "executable", str(bundle / "dsv41-panel"))
    return bundle


def test_bundle_starts_the_sim_and_keeper_through_its_dsv41(as_bundle):
    from engine_manager.engines.sim import sim_argv
    from engine_manager.frozen import module_argv
    assert sim_argv(None, "127.0.0.1", 8000, None)[:3] == [str(as_bundle / "dsv41"), "-m", "engine_manager.sim"]
    from engine_manager.launch import KEEPER
    assert module_argv("engine_manager.keeper", script=KEEPER) == [
        str(as_bundle / "dsv41"), "-m", "engine_manager.keeper"]


# runpy warns that engine_manager.numa was imported before (by this test process); the bundle's dsv41 has not
@pytest.mark.filterwarnings("ignore:'engine_manager.numa' found in sys.modules:RuntimeWarning")
def test_bundle_dsv41_runs_only_its_own_helper_modules(as_bundle, capsys):
    from engine_manager.frozen import run_module_if_asked
    with pytest.raises(SystemExit) as e:
        run_module_if_asked([str(as_bundle / "dsv41"), "-m", "engine_manager.numa", "--help"])
    assert e.value.code == 0 and "usage:" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        run_module_if_asked([str(as_bundle / "dsv41"), "-m", "os"])
    assert e.value.code == 2 and "-m takes one of" in capsys.readouterr().err
    run_module_if_asked([str(as_bundle / "dsv41"), "doctor"])      # not -m: returns, the CLI runs


def test_bundle_gives_programs_it_starts_the_users_library_path(as_bundle):
    from engine_manager.frozen import restore_environment
    env = {"LD_LIBRARY_PATH": f"{as_bundle}/_internal:/opt/lib", "LD_LIBRARY_PATH_ORIG": "/opt/lib"}
    restore_environment(env)
    assert env == {"LD_LIBRARY_PATH": "/opt/lib"}
    env = {"LD_LIBRARY_PATH": f"{as_bundle}/_internal"}
    restore_environment(env)
    assert env == {}


def test_desktop_entry_for_the_bundle_and_removal_leaves_nothing(tmp_path):
    """``<bundle>/install-desktop-entry.sh`` (the spec copies it there) points the menu entry at the bundle's
    executable and installs the icon; ``--remove`` takes out all it made."""
    bundle = tmp_path / "dist" / "dsv41-panel"
    (bundle / "_internal").mkdir(parents=True)
    shutil.copytree(ROOT / "resources", bundle / "_internal" / "resources")
    shutil.copy2(ROOT / "packaging" / "install-desktop-entry.sh", bundle / "install-desktop-entry.sh")
    exe = bundle / "dsv41-panel"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    data = tmp_path / "data"
    env = {**os.environ, "XDG_DATA_HOME": str(data), "HOME": str(tmp_path)}
    r = _run([str(bundle / "install-desktop-entry.sh")], env=env)
    assert r.returncode == 0, r.stderr
    entry = (data / "applications" / "dsv41-panel.desktop").read_text()
    assert f'Exec="{exe}"' in entry.splitlines() and "Icon=dsv41-panel" in entry
    assert (data / "icons/hicolor/scalable/apps/dsv41-panel.svg").read_bytes() == \
        (ROOT / "resources" / "dsv41-panel.svg").read_bytes()
    r = _run([str(bundle / "install-desktop-entry.sh"), "--remove"], env=env)
    assert r.returncode == 0, r.stderr
    assert not data.exists() or not any(data.rglob("*")), sorted(data.rglob("*"))
