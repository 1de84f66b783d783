"""The import contracts in pyproject.toml ([tool.importlinter]), checked by the real `lint-imports` the way
scripts/lint (and so CI) runs it: kept on the real tree, and broken on a temporary copy of the tree with one
forbidden import added: Qt or app/ in engine_manager, one panel importing another, app.workers importing a panel,
a module of engine_manager importing one from a layer above its own (or a new module placed in no layer). And the
engine's one door: only engine_manager.session.EngineSession makes a Supervisor or runs its generators."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from conftest import require_or_skip

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
RULES = {c["id"]: c for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]}
CONTRACTS = {cid: c["name"] for cid, c in RULES.items()}
GUIDANCE = {cid: c["broken_contract_guidance"] for cid, c in RULES.items()}
QT_FREE, PANELS, BASE, FIXTURES = "core-qt-free", "panels-independent", "app-foundation", "fixtures-not-product"
LAYERS = "core-layers"


def lint_imports(where: Path) -> tuple[int, str]:
    if not LINT_IMPORTS.exists():
        require_or_skip(f"{LINT_IMPORTS} is missing: install the lint extra (./scripts/test does)")
    env = {**os.environ, "PYTHONPATH": str(where)}    # the copy's packages, not the installed (editable) ones
    cp = subprocess.run([str(LINT_IMPORTS), "--no-logo", "--no-cache"], cwd=where, env=env, capture_output=True,
                        text=True, timeout=120, stdin=subprocess.DEVNULL)
    return cp.returncode, cp.stdout + cp.stderr


def verdicts(out: str) -> dict[str, str]:
    """Contract id -> KEPT / BROKEN, from the summary lines `<name> KEPT|BROKEN`."""
    got = {}
    for cid, name in CONTRACTS.items():
        m = re.search(rf"^{re.escape(name)} (KEPT|BROKEN)\b", out, re.MULTILINE)
        assert m, f"no verdict for {name!r} in:\n{out}"
        got[cid] = m[1]
    return got


@pytest.fixture
def tree(tmp_path) -> Path:
    """A copy of the two packages and pyproject.toml: what lint-imports reads."""
    dest = tmp_path / "tree"
    for pkg in ("engine_manager", "app"):
        shutil.copytree(ROOT / pkg, dest / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def add_lines(path: Path, *lines: str) -> None:
    text = path.read_text() if path.exists() else ""
    path.write_text(text + ("\n" if text and not text.endswith("\n") else "") + "\n".join(lines) + "\n")


def test_the_contracts_are_the_five_that_scripts_lint_enforces():
    assert set(CONTRACTS) == {QT_FREE, PANELS, BASE, FIXTURES, LAYERS}
    assert set(RULES[QT_FREE]["forbidden_modules"]) >= {"PySide6", "shiboken6", "pyqtgraph", "superqt", "app"}
    assert RULES[QT_FREE]["source_modules"] == ["engine_manager"]


# app modules that are not a panel nor part of one: the entry points, the window that puts the panels together,
# what every panel builds on, and the window's own furniture (status bar, dialogs, first-run flow)
SHELL = {"__init__", "__main__", "main", "main_window", "context", "workers", "panel_base", "statusbar", "first_run",
         "doctor_view", "notify", "compact_view",
         "plot_export", "theme", "pyside_hook",
         "settings_dialog"}


def test_every_app_module_is_a_panel_in_the_contract_or_part_of_the_shell():
    """A new panel (or a new part of a split one) that nobody adds to the contract would be free to import the
    others: this makes its author decide."""
    panels = {m.removeprefix("app.") for m in RULES[PANELS]["modules"]}
    modules = {p.stem for p in (ROOT / "app").glob("*.py")}
    unplaced = modules - panels - SHELL
    assert not unplaced, (f"app/{sorted(unplaced)[0]}.py is in neither list: add it to the panels-independent "
                          "contract in pyproject.toml (with its panel's imports of it under ignore_imports) or, if "
                          "it is no panel, to SHELL in tests/test_boundaries.py")
    assert not panels & SHELL
    assert panels <= modules, f"the contract names modules that are gone: {sorted(panels - modules)}"


def test_every_part_of_a_package_split_across_layers_is_in_a_layer():
    """The layers contract is exhaustive over engine_manager's own modules, but a package whose parts sit in
    different layers (the engines, the scripted engine, InferenceKey) is listed part by part: a new part (a new
    engine adapter) must be placed too."""
    rule = RULES[LAYERS]
    placed = {m.strip() for layer in rule["layers"] for m in layer.split(":")}
    split = set(rule["exhaustive_ignores"]) - {"testing"}       # testing: the fixtures, in no layer
    parts = {f"{pkg}.{p.stem}" for pkg in split for p in (ROOT / "engine_manager" / pkg).glob("*.py")
             if p.stem != "__init__"}
    assert split == {"engines", "sim", "inferencekey"}
    assert not parts - placed, (f"engine_manager.{sorted(parts - placed)[0]} is in no layer: add it to the "
                                "core-layers contract in pyproject.toml, in the layer of the highest module it imports")


def test_the_real_tree_keeps_every_contract():
    rc, out = lint_imports(ROOT)
    assert rc == 0, out
    assert set(verdicts(out).values()) == {"KEPT"}, out


def test_an_untouched_copy_keeps_every_contract(tree):
    rc, out = lint_imports(tree)
    assert rc == 0, out
    assert set(verdicts(out).values()) == {"KEPT"}, out


def lazy(statement: str, name: str) -> list[str]:
    """A function-level import: grimp reads those too, so a lazy import is still a dependency."""
    return ["", "", "def _boundary_probe():", f"    {statement}", f"    return {name}"]


# (what is added, to which file, the contracts it breaks, the import chain the report must name); the probe module
# sits in the top layer (cli), so what it imports breaks no layer
PROBE, PROBED = "engine_manager/cli/_boundary_probe.py", "engine_manager.cli._boundary_probe"
BREAKS = [
    (["import PySide6"], PROBE, {QT_FREE}, f"{PROBED} -> PySide6"),
    (["from PySide6.QtCore import QObject"], PROBE, {QT_FREE}, f"{PROBED} -> PySide6"),
    (["import shiboken6"], PROBE, {QT_FREE}, f"{PROBED} -> shiboken6"),
    (["import pyqtgraph as pg"], PROBE, {QT_FREE}, f"{PROBED} -> pyqtgraph"),
    (["from superqt.utils import thread_worker"], PROBE, {QT_FREE}, f"{PROBED} -> superqt"),
    (["from app import workers"], PROBE, {QT_FREE}, f"{PROBED} -> app"),
    (lazy("from PySide6 import QtWidgets", "QtWidgets"), "engine_manager/errors.py", {QT_FREE},
     "engine_manager.errors -> PySide6"),
    (["from app import placement_view  # noqa: E402"], "app/log_view.py", {PANELS},
     "app.log_view -> app.placement_view"),
    # the main window imports every panel, so a panel that imports it reaches them all (an indirect chain)
    (lazy("from app.main_window import MainWindow", "MainWindow"), "app/engine_panel.py", {PANELS},
     "app.engine_panel -> app.main_window"),
    # app.monitor_view may import its own parts, but they are still not the chat pane's
    (["from app.chat_pane import ChatPane  # noqa: E402"], "app/monitor_cards.py", {PANELS},
     "app.monitor_cards -> app.chat_pane"),
    # the benchmark tab borrowing the monitor's plots
    (["from app.monitor_plots import PlotSpec  # noqa: E402"], "app/bench_view.py", {PANELS},
     "app.bench_view -> app.monitor_plots"),
    # two parts of two split panels
    (lazy("from app import monitor_plots", "monitor_plots"), "app/chat_render.py", {PANELS},
     "app.chat_render -> app.monitor_plots"),
    # every panel imports app.workers: a panel imported by it is reached from every other panel too
    (lazy("from app.download_panel import DownloadPanel", "DownloadPanel"), "app/workers.py", {BASE, PANELS},
     "app.workers -> app.download_panel"),
    # product code reaching for a test fixture (the tiny model, the local hub)
    (lazy("from engine_manager.testing import tinymoe", "tinymoe"), "engine_manager/replica.py", {FIXTURES},
     "engine_manager.replica -> engine_manager.testing.tinymoe"),
    (lazy("from engine_manager.testing.hub import make_file", "make_file"), "app/download_panel.py", {FIXTURES},
     "app.download_panel -> engine_manager.testing.hub"),
    # an engine adapter reaching up for the supervisor (the log tail is engine_manager.logtail's)
    (lazy("from engine_manager.supervisor import read_log_tail", "read_log_tail"), "engine_manager/engines/llamacpp.py",
     {LAYERS}, "engine_manager.engines.llamacpp -> engine_manager.supervisor"),
    # the supervisor reaching up for the session that holds it
    (lazy("from engine_manager.session import EngineSession", "EngineSession"), "engine_manager/supervisor.py",
     {LAYERS}, "engine_manager.supervisor -> engine_manager.session"),
    # the bottom layer importing the top one
    (["from engine_manager.cli import main  # noqa: E402,F401"], "engine_manager/fmt.py", {LAYERS},
     "engine_manager.fmt -> engine_manager.cli"),
    # the planner reaching for the engines that start its plans
    (lazy("from engine_manager.engines.strata import StrataEngine", "StrataEngine"), "engine_manager/placement.py",
     {LAYERS}, "engine_manager.placement -> engine_manager.engines.strata"),
    # a new module of engine_manager that nobody placed in a layer (the contract is exhaustive)
    (["import json  # noqa: F401"], "engine_manager/unplaced_probe.py", {LAYERS}, "- engine_manager.unplaced_probe"),
]


def _case_id(case) -> str:
    lines, where = case[0], case[1]
    statement = next(ln for ln in lines if "import" in ln).split("#")[0].strip()
    return f"{Path(where).stem}: {statement}"


@pytest.mark.parametrize("lines, where, broken, chain", BREAKS, ids=[_case_id(b) for b in BREAKS])
def test_one_forbidden_import_breaks_its_contract_and_ci_says_what_to_do(tree, lines, where, broken, chain):
    add_lines(tree / where, *lines)
    rc, out = lint_imports(tree)
    assert rc != 0, out
    assert verdicts(out) == {cid: "BROKEN" if cid in broken else "KEPT" for cid in CONTRACTS}, out
    flat = " ".join(out.split())
    assert chain in flat, out
    for cid in broken:                                     # each broken contract's guidance: what to do instead
        assert " ".join(GUIDANCE[cid].split()) in flat, out


# -- the engine's one door -----------------------------------------------------------------------------------------
# engine_manager.session.EngineSession makes the Supervisor (supervisor.py defines it); every front end goes through
# the session: its start/watch/stop feed each event to it, so its ``running`` stays right
DOOR = {"engine_manager/session.py", "engine_manager/supervisor.py"}
GENERATORS = {"run", "watch", "stop"}


def second_doors(source: str) -> list[int]:
    """The lines of ``source`` that make a Supervisor (``Supervisor(…)``, ``sv.Supervisor(…)``), import the class
    by name (an alias would hide the call) or reach for a supervisor's generator (``x.supervisor.run``)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        match node:
            case ast.Call(func=ast.Name(id="Supervisor") | ast.Attribute(attr="Supervisor")):
                lines.append(node.lineno)
            case ast.ImportFrom(names=names) if any(a.name == "Supervisor" for a in names):
                lines.append(node.lineno)
            case ast.Attribute(value=ast.Attribute(attr="supervisor"), attr=attr) if attr in GENERATORS:
                lines.append(node.lineno)
    return sorted(set(lines))


def test_the_door_check_finds_a_second_door():
    sample = ("from engine_manager import supervisor as sv\n"          # 1: the module: fine
              "from engine_manager.supervisor import Supervisor as S\n"  # 2: the class by name
              "def status(settings, ctx) -> 'sv.Supervisor':\n"        # 3: an annotation: fine
              "    st = sv.Supervisor(settings).status()\n"             # 4: a second supervisor
              "    crash = ctx.supervisor.last_failure\n"               # 5: reading it: fine
              "    tasks.start('run', ctx.supervisor.run)\n"            # 6: its generator, past the session
              "    return S(settings), ctx.session.start('sim')\n")     # 7: the session's: fine
    assert second_doors(sample) == [2, 4, 6]


def test_only_the_session_makes_a_supervisor_or_runs_its_generators():
    found = []
    for pkg in ("engine_manager", "app"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel not in DOOR:
                found += [f"{rel}:{line}" for line in second_doors(path.read_text())]
    assert not found, ("a Supervisor made or driven outside engine_manager/session.py: "
                       + ", ".join(found) + ". Go through an EngineSession (engine_manager.session): "
                       "EngineSession(settings, hardware=…, started_by=…) and its start/watch/stop/status/dry_run.")
