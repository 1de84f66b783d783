"""The exit codes of ``dsv41``: one enum instead of a tuple of constants in every command.

``ExitCode`` is an ``IntEnum``, so ``sys.exit(ExitCode.REFUSED)`` exits 3 and a test may compare with ``3``.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0              # done (or, for `dsv41 start`, the engine is ready / already running)
    FAIL = 1            # failed: the message says why and what to do
    USAGE = 2           # bad settings or usage (a bad value, a missing file named on the command line)
    REFUSED = 3         # refused: a placement this host cannot hold
    INTERRUPTED = 130   # Ctrl+C (128 + SIGINT, as shells report it)
