"""Day-one CLI behaviour: Ctrl+C while ``dsv41`` is still loading, and words meant for people (no Python ``None``).

Ctrl+C is delivered the way a terminal does, at a chosen moment: the child installs an audit hook (``sys.audit``'s
``import`` event) that sends SIGINT to its own process when a given module starts to be imported, then runs the
real entry point — the console script ``dsv41`` (``engine_manager.cli:main``) or ``python -m engine_manager``. So
the interrupt lands inside the imports every time, with no sleeping and guessing."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest
from terminal_sigint import popen_interruptible

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import os, runpy, signal, sys
trigger, how, ignore = sys.argv[1], sys.argv[2], sys.argv[3] == "ignore"
if ignore:
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # as a background job started by a script inherits it
fired = []
def hook(event, args):
    if event == "import" and args[0] == trigger and not fired:
        fired.append(True)
        os.kill(os.getpid(), signal.SIGINT)           # Ctrl+C, while that module is being imported
sys.addaudithook(hook)
if how == "-m":
    sys.argv = ["dsv41", "settings", "path"]
    runpy.run_module("engine_manager", run_name="__main__", alter_sys=True)
else:
    sys.argv = [how, "settings", "path"]
    runpy.run_path(how, run_name="__main__")
"""


def run_child(trigger: str, how: str, ignore: bool = False) -> tuple[int, str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = popen_interruptible([sys.executable, "-c", CHILD, trigger, how, "ignore" if ignore else "default"],
                               env=env, cwd=ROOT, stdout=-1, stderr=-1, text=True)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


def console_script() -> str:
    script = Path(sys.executable).with_name("dsv41")
    if not script.exists():
        pytest.skip("the dsv41 console script is not installed in this environment")
    return str(script)


# engine_manager.settings: imported by engine_manager.cli itself, before main() runs;
# engine_manager.doctor: imported by a sub-command's module while main() builds the parser
@pytest.mark.parametrize("trigger", ["engine_manager.settings", "engine_manager.doctor"])
@pytest.mark.parametrize("entry", ["script", "-m"])
def test_ctrl_c_while_loading_exits_130_without_a_traceback(trigger, entry):
    rc, out, err = run_child(trigger, console_script() if entry == "script" else "-m")
    assert rc == 130, (rc, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert err.strip() == "interrupted" and out == ""


def test_an_inherited_ignored_sigint_stays_ignored():
    """``dsv41 … &`` from a script: the shell ignores SIGINT for it, and the CLI keeps it so."""
    rc, out, err = run_child("engine_manager.settings", "-m", ignore=True)
    assert rc == 0, err
    assert out.strip().endswith("settings.json")


def test_importing_the_cli_leaves_ctrl_c_as_it_was():
    """The quiet exit is for the CLI's own start-up: a program that imports it (the GUI, a test) keeps
    KeyboardInterrupt."""
    import engine_manager.cli as cli
    before = signal.getsignal(signal.SIGINT)
    cli.main(["settings", "path"])
    assert signal.getsignal(signal.SIGINT) is before


def test_settings_show_says_not_set_never_none(capsys):
    """Unset folders and files read "(not set)", not Python's ``None``; booleans as the file writes them."""
    import engine_manager.cli as cli
    assert cli.main(["settings", "show"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line and not line.startswith("file:")}
    assert "None" not in out and "True" not in out and "False" not in out
    assert "(not set)" in rows["model_dir"] and rows["auto_restart"].split()[1] in ("true", "false")


def test_the_shipped_manifests_name_only_modules_that_exist():
    """A manifest's words point at commands a user can run: every ``python -m MODULE`` in them exists."""
    import importlib.util
    import re
    for p in (ROOT / "resources" / "manifests").glob("*.json"):
        for mod in re.findall(r"python -m ([\w.]+)", p.read_text()):
            assert importlib.util.find_spec(mod) is not None, f"{p.name} names {mod}, which does not exist"


def test_bench_history_and_compare_name_the_engine_and_phases_in_words(tmp_path):
    """A saved run records its engine as {"engine": kind, "label": words} (no "name"): the history said
    "None (sim)". Phase ids (``users_4``) reach people as "4 users"."""
    from engine_manager.bench import results

    doc = {"id": "bench_20261202T000000Z", "engine": {"engine": "sim", "label": "Scripted engine (SIMULATED)"},
           "simulated": True, "table": []}
    assert results.engine_words(doc) == "Scripted engine (SIMULATED)"
    assert results.engine_words({"engine": {"engine": "llamacpp"}}) == "llamacpp"
    assert results.engine_words({}) == "engine not recorded"
    c = results.compare(doc, doc)
    assert c["a"]["engine"] == "Scripted engine (SIMULATED)" and "None" not in results.render_compare(c)
    assert [results.phase_words(k) for k in ("users_1", "users_4", "warmup", "long_prompt")] == \
        ["1 user", "4 users", "warm-up", "long prompt"]


def _strings(path: Path):
    """Every string literal of a module that is not a docstring or a comment: what can reach a person."""
    import ast
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            yield node.value


@pytest.mark.parametrize("words", ["./scripts/test", "Engine tab", "engine_manager.hub "])
def test_no_developer_words_in_what_the_panel_says(words):
    """A user never reads "run ./scripts/test" (a developer's script), about an "Engine tab" there is none of, or a
    module that does not exist."""
    found = [f"{p.relative_to(ROOT)}: {s[:80]!r}"
             for p in sorted([*(ROOT / "app").glob("*.py"), *(ROOT / "engine_manager").rglob("*.py")])
             if "testing" not in p.parts for s in _strings(p) if words in s]
    assert not found, found
