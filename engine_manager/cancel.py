"""One cancel token for every long operation: a chat stream, a download, a hash.

``cancel()`` may be called from any thread, any number of times (the first reason wins). It wakes whatever waits:
the callbacks registered with :meth:`CancelToken.on_cancel` run once, on the cancelling thread — a stream or a
download registers one that shuts its socket down, which makes a read blocked in the kernel return at once (a
plain flag would wait for the next byte, or forever on a stalled server); :meth:`sleep` and :meth:`wait_running`
return at once too. Pause/resume are for downloads: workers call :meth:`wait_running` between reads.

Work that notices the cancel and gives up raises :class:`Cancelled`.
"""

from __future__ import annotations

import threading
from typing import Callable


class Cancelled(Exception):
    """The operation stopped because its :class:`CancelToken` was cancelled."""


class CancelToken:
    """Pause / resume / cancel from another thread (the GUI, a signal handler, a timer)."""

    def __init__(self) -> None:
        self._cancel = threading.Event()
        self._running = threading.Event()
        self._running.set()
        self._lock = threading.Lock()
        self._hooks: dict[int, Callable[[], None]] = {}
        self._next_hook = 0
        self.reason: str = "stopped"

    # -- cancel ---------------------------------------------------------------------------------------------------
    def cancel(self, reason: str = "stopped") -> None:
        """Stop soon: runs the registered callbacks (once), wakes sleepers and paused workers."""
        with self._lock:
            first = not self._cancel.is_set()
            if first:
                self.reason = reason
                self._cancel.set()
            hooks, self._hooks = list(self._hooks.values()), {}
        self._running.set()
        for fn in hooks:
            try:
                fn()
            except Exception:  # noqa: BLE001 - a closing socket may complain; cancel must not, nor stop the others
                pass

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def on_cancel(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Call ``fn`` (from the cancelling thread) when cancelled — at once if already; returns its remover."""
        with self._lock:
            if not self._cancel.is_set():
                key = self._next_hook
                self._next_hook += 1
                self._hooks[key] = fn

                def remove() -> None:
                    with self._lock:
                        self._hooks.pop(key, None)
                return remove
        try:
            fn()
        except Exception:  # noqa: BLE001
            pass
        return lambda: None

    def remove(self, fn: Callable[[], None]) -> None:
        """Forget a callback registered with :meth:`on_cancel` (no error if it is not there)."""
        with self._lock:
            for k, v in list(self._hooks.items()):
                if v is fn:
                    del self._hooks[k]

    def raise_if_cancelled(self) -> None:
        if self._cancel.is_set():
            raise Cancelled(self.reason)

    def sleep(self, seconds: float) -> bool:
        """Sleep unless cancelled; True if cancelled."""
        return self._cancel.wait(seconds)

    # -- pause ----------------------------------------------------------------------------------------------------
    def pause(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    @property
    def paused(self) -> bool:
        return not self._running.is_set() and not self._cancel.is_set()

    def wait_running(self, timeout: float | None = None) -> bool:
        return self._running.wait(timeout)
