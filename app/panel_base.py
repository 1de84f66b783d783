"""What every page and panel of the window is: a :class:`Panel` with one ``shutdown(wait_ms)``, and the
:class:`Pages` the main window iterates when it closes — so a page added to the window is shut down with the rest.

A panel owns its background work through ``self.tasks`` (:class:`app.workers.TaskOwner`: one cancel token per task).
"""

from __future__ import annotations

from typing import Iterable, Protocol, runtime_checkable

from .workers import QUIT_WAIT_MS


@runtime_checkable
class Closable(Protocol):
    def shutdown(self, wait_ms: int = ...) -> None: ...


class Panel:
    """Mixin for a page or panel (``class LogView(Panel, QWidget)``). ``shutdown(wait_ms)``: the window is closing —
    stop the timers, cancel every task (its token too) and drop its later callbacks, and wait up to ``wait_ms`` for
    the workers that must finish (a stream's answer being saved). A panel with more to stop overrides it, same
    signature; its default ``wait_ms`` is what that panel needs."""

    def shutdown(self, wait_ms: int = QUIT_WAIT_MS) -> None:
        tasks = getattr(self, "tasks", None)
        if tasks is not None:
            tasks.shutdown(wait_ms)


class Pages(Protocol):
    """What holds panels (the main window): :meth:`panels` lists every one, in the order they are shut down."""

    def panels(self) -> Iterable[Closable]: ...


def shutdown_all(pages: Pages) -> None:
    """Shut every panel of ``pages`` down, each with its own wait."""
    for panel in pages.panels():
        panel.shutdown()
