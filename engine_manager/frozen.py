"""Running from the one-folder bundle (``packaging/dsv41-panel.spec``, PyInstaller) as well as from Python.

In the bundle ``sys.executable`` is the bundle's ``dsv41`` (or ``dsv41-panel``), which cannot take ``-m
engine_manager.sim`` or ``-I -S keeper.py``, so every place that starts one of this project's modules as a process
asks :func:`module_argv` for the command line: from Python ``[sys.executable, -I -S, "-m", MODULE]`` (the flags only
where given); in the bundle ``[<bundle>/dsv41, "-m", MODULE]``, whose ``engine_manager/__main__.py`` calls
:func:`run_module_if_asked` first to run the module as ``__main__`` and exit. Only the modules in :data:`MODULES` are
run this way; any other is refused with a plain error (exit 2).

The bundle's loader puts its private library folder first on ``LD_LIBRARY_PATH`` (the user's value kept in
``LD_LIBRARY_PATH_ORIG``), which a program started from the bundle (``llama-server``, Strata's Python,
``nvidia-smi``, ``xvfb-run``) would load from. :func:`restore_environment`, called first by both of the bundle's
entry scripts, puts the user's value back in ``os.environ``; the running process is unaffected (the dynamic loader
reads the variable once, at start-up), and a bundled executable started later sets it again for itself.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

CLI_NAME = "dsv41"
#: the modules the bundle's ``dsv41 -m MODULE`` runs (the ones the project starts as processes of their own)
MODULES = ("engine_manager.sim", "engine_manager.keeper", "engine_manager.numa")


def is_frozen() -> bool:
    """Running inside the PyInstaller bundle."""
    return bool(getattr(sys, "frozen", False))


def cli_executable() -> str:
    """The bundle's ``dsv41`` executable (beside ``dsv41-panel``, whichever of the two is running)."""
    return str(Path(sys.executable).with_name(CLI_NAME))


def module_argv(module: str, *, script: str | os.PathLike | None = None) -> list[str]:
    """The command line that runs ``module`` (one of :data:`MODULES`) as a program of its own, in this same
    installation: ``[python, -m, module]``, or with ``script`` (the keeper: stdlib only, it starts in ~20 ms so)
    ``[python, -I, -S, script]``. In the bundle: ``[<bundle>/dsv41, -m, module]``."""
    if module not in MODULES:
        raise ValueError(f"{module} is not one of the modules the bundle can run ({', '.join(MODULES)})")
    if is_frozen():
        return [cli_executable(), "-m", module]
    if script is not None:
        return [sys.executable, "-I", "-S", str(script)]
    return [sys.executable, "-m", module]


def panel_argv() -> list[str]:
    """The command line that starts the panel again (``dsv41-panel`` re-running itself under ``xvfb-run``)."""
    return [sys.executable] if is_frozen() else [sys.executable, "-m", "app"]


def restore_environment(environ: dict[str, str] | None = None) -> None:
    """Give programs started from the bundle the user's ``LD_LIBRARY_PATH``, not the bundle loader's. Does
    nothing outside the bundle."""
    if not is_frozen():
        return
    env = os.environ if environ is None else environ
    orig = env.pop("LD_LIBRARY_PATH_ORIG", None)
    if orig is not None:
        env["LD_LIBRARY_PATH"] = orig
    else:
        env.pop("LD_LIBRARY_PATH", None)


def run_module_if_asked(argv: list[str] | None = None) -> None:
    """In the bundle, ``dsv41 -m MODULE ARGS...`` runs MODULE as ``__main__`` with ``sys.argv = [MODULE, ARGS...]``
    and exits with its status. Outside the bundle, or without ``-m``, returns and the CLI runs as usual."""
    argv = sys.argv if argv is None else argv
    if not is_frozen() or len(argv) < 2 or argv[1] != "-m":
        return
    if len(argv) < 3 or argv[2] not in MODULES:
        got = argv[2] if len(argv) > 2 else "nothing"
        print(f"dsv41: -m takes one of {', '.join(MODULES)} (got {got}); it is how the bundle starts its own "
              "engine helpers. Run `dsv41 --help` for the commands.", file=sys.stderr)
        raise SystemExit(2)
    module = argv[2]
    sys.argv = [module, *argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    raise SystemExit(0)
