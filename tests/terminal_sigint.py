"""Ctrl+C as a terminal delivers it, for the CLI processes a test starts and then interrupts.

A test suite started as a background job by a non-interactive shell (``./scripts/test &``, ``nohup … &``, a CI
step that backgrounds it) runs with SIGINT *ignored* (POSIX: the shell does that for ``&`` when job control is
off), and an ignored signal stays ignored across ``exec``. Python then installs no KeyboardInterrupt handler, so a
test's ``send_signal(SIGINT)`` to ``dsv41`` is dropped and the test times out. A *handled* signal, by contrast, is
reset to the default at ``exec``. So, around the ``Popen`` of a process the test will interrupt, the test process
handles SIGINT (Python's own ``default_int_handler``, what a foreground pytest has anyway) and the child starts
with SIGINT at its default, as under a terminal.

Why here and not in ``dsv41`` itself: a program that un-ignores SIGINT breaks the convention the shell relies on
— ``dsv41 start --foreground &`` in a script must survive the Ctrl+C its user presses for the foreground job —
so the CLI honours an inherited SIG_IGN, and the tests, which stand in for a user at a terminal, give their child
the terminal's disposition. (``preexec_fn`` would do the same in the child, but is unsafe with threads: these
tests run a local hub's server threads.)"""

from __future__ import annotations

import signal
import subprocess
from typing import Any


def popen_interruptible(*args: Any, **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen`` whose child starts with SIGINT at its default whatever this process inherited."""
    old = signal.getsignal(signal.SIGINT)
    if old is not signal.SIG_IGN:
        return subprocess.Popen(*args, **kwargs)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(*args, **kwargs)
    finally:
        signal.signal(signal.SIGINT, old)
