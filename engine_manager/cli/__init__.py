"""``dsv41``: the headless CLI. It drives the same engine_manager functions as the GUI.

Each sub-command lives in its own module of this package with ``register(subparsers)``; the parser it adds sets
``func=run`` where ``run(args, ctx) -> int`` (an :class:`engine_manager.exitcodes.ExitCode`). Exit codes: 0 ok,
1 failed, 2 bad settings or usage, 3 refused (e.g. a placement the host cannot hold), 130 interrupted.
"""

from __future__ import annotations

import signal
import sys
import threading


def _exit_quietly(_signum, _frame) -> None:
    """Ctrl+C while the CLI is still loading (its imports take seconds under load): leave with exit code 130 and
    one word, never a Python traceback."""
    try:
        sys.stderr.write("\ninterrupted\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    raise SystemExit(130)                 # ExitCode.INTERRUPTED (not imported yet)


def quiet_interrupts() -> bool:
    """Make Ctrl+C end the process quietly (:func:`_exit_quietly`) until :func:`loud_interrupts`; True when it did.
    A SIGINT the process inherited as ignored (``dsv41 start --foreground &`` in a script) stays ignored, and a
    handler someone else installed is left alone."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return False
    signal.signal(signal.SIGINT, _exit_quietly)
    return True


def loud_interrupts(installed: bool) -> None:
    """Back to Python's KeyboardInterrupt, which the commands handle (stop an answer, stop a start …)."""
    if installed and signal.getsignal(signal.SIGINT) is _exit_quietly:
        signal.signal(signal.SIGINT, signal.default_int_handler)


# first, before the heavy imports below (pydantic …): the console script `dsv41` (engine_manager.cli:main) and
# `python -m engine_manager` import this module before main() runs
_QUIET = quiet_interrupts()

import argparse  # noqa: E402
import importlib  # noqa: E402
from functools import cached_property  # noqa: E402

from .. import __version__  # noqa: E402
from ..errors import PlacementRefused, UserError  # noqa: E402
from ..exitcodes import ExitCode  # noqa: E402
from ..paths import PathVariableError  # noqa: E402
from ..settings import LoadedSettings, SettingsError, load_settings  # noqa: E402

loud_interrupts(_QUIET)    # importing this module (a test, the GUI) leaves Ctrl+C as it was

# Order is the order of `dsv41 --help`.
COMMAND_MODULES = (
    "doctor", "settings_cmd", "download", "plan", "engine", "chat", "monitor", "sim", "connections", "bench",
    "inferencekey", "diagnose",
)



class Context:
    """Lazily loaded shared state for sub-commands."""

    @cached_property
    def loaded(self) -> LoadedSettings:
        loaded = load_settings()
        for n in loaded.notices:
            print(f"note: {n}", file=sys.stderr)
        return loaded

    @property
    def settings(self):
        return self.loaded.settings

    @cached_property
    def settings_for_stop(self):
        """The settings, with any bad value skipped (its default used, and said): stopping the engine needs only
        the state file, so an unrelated bad setting must not block it. A folder variable
        that cannot be used is still refused: the state file lives there."""
        try:
            return self.settings
        except SettingsError:
            loaded = load_settings(generate_key=False, lenient=True)
            for n in loaded.notices:
                print(f"note: {n}", file=sys.stderr)
            return loaded.settings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dsv41",
        description="Run DeepSeek-V4.1-Flash on one GPU workstation: probe, download, plan, start, chat.",
    )
    parser.add_argument("--version", action="version", version=f"dsv41 {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            mod = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"{__name__}.{name}":
                continue
            raise
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    quiet = quiet_interrupts()          # the sub-commands' imports (httpx, numpy …) come next
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
    finally:
        loud_interrupts(quiet)
    if not getattr(args, "func", None):
        parser.print_help()
        return ExitCode.USAGE
    ctx = Context()
    try:
        return int(args.func(args, ctx) or 0)
    except (SettingsError, PathVariableError) as exc:
        print(f"dsv41: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    except PlacementRefused as exc:
        print(f"dsv41: {exc}", file=sys.stderr)
        return ExitCode.REFUSED
    except UserError as exc:  # expected failures carry their own plain-words message and fix
        print(f"dsv41: {exc}", file=sys.stderr)
        return ExitCode.FAIL
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return ExitCode.INTERRUPTED
    except BrokenPipeError:
        return ExitCode.OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
