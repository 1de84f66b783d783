"""The one worker idiom of the GUI: run an engine_manager generator (or plain function) on a worker thread
(superqt's thread workers) and get its yielded events, result and error back on the GUI thread as signals.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator

import functools
import threading
import time

from PySide6.QtCore import QCoreApplication, Qt, QThreadPool

from engine_manager.cancel import CancelToken

if TYPE_CHECKING:
    from superqt.utils import FunctionWorker, GeneratorWorker

# superqt is imported on first use (~0.17 s): the main window appears before any worker is needed

# superqt starts workers on Qt's global pool, whose default size is the number of cores (2 on small machines).
# Our workers are long-lived and I/O-bound (a streaming chat answer, a readiness wait, the metrics poller, a
# download), so a pool that small lets two of them starve every other panel: seen with a third conversation
# that did not start until another answer finished. They sleep on sockets, so many threads cost little.
MIN_POOL_THREADS = 64


QUIT_WAIT_MS = 3000
_quit_hooked = False


def _ensure_pool() -> None:
    global _quit_hooked
    pool = QThreadPool.globalInstance()
    if pool.maxThreadCount() < MIN_POOL_THREADS:
        pool.setMaxThreadCount(MIN_POOL_THREADS)
    app = QCoreApplication.instance()
    if app is not None and not _quit_hooked:
        app.aboutToQuit.connect(stop_all)
        _quit_hooked = True


def stop_all(wait_ms: int = QUIT_WAIT_MS) -> bool:
    """Ask every running worker to stop (generators stop at their next yield) and wait up to ``wait_ms`` for the
    pool: called when the application quits, so no worker emits into widgets that are being deleted. Returns
    whether every worker finished in time (a blocking call that does not yield may outlast the wait)."""
    from superqt.utils import WorkerBase
    try:
        WorkerBase.await_workers(wait_ms)
    except RuntimeError:
        return False
    return True


def run_generator(fn: Callable[..., Iterator[Any]], *args: Any,
                  on_event: Callable[[Any], None] | None = None,
                  on_done: Callable[[Any], None] | None = None,
                  on_error: Callable[[BaseException], None] | None = None,
                  on_finished: Callable[[], None] | None = None,
                  **kwargs: Any) -> GeneratorWorker:
    """Start ``fn(*args, **kwargs)`` (a generator function) on a thread; each yielded event reaches
    ``on_event`` on the GUI thread. ``worker.quit()`` asks the generator to stop at its next yield."""
    from superqt.utils import create_worker
    _ensure_pool()
    kwargs.setdefault("_ignore_errors", on_error is not None)  # handled by on_error: do not re-raise in the GUI
    worker = create_worker(fn, *args, _start_thread=False, **kwargs)
    _connect(worker, on_event, on_done, on_error, on_finished)
    worker.start()
    return worker


def run_function(fn: Callable[..., Any], *args: Any,
                 on_done: Callable[[Any], None] | None = None,
                 on_error: Callable[[BaseException], None] | None = None,
                 on_finished: Callable[[], None] | None = None,
                 **kwargs: Any) -> FunctionWorker:
    """Run a blocking call (I/O, a probe) off the GUI thread; its return value reaches ``on_done``."""
    from superqt.utils import create_worker
    _ensure_pool()
    kwargs.setdefault("_ignore_errors", on_error is not None)
    worker = create_worker(fn, *args, _start_thread=False, **kwargs)
    _connect(worker, None, on_done, on_error, on_finished)
    worker.start()
    return worker


def _connect(worker, on_event, on_done, on_error, on_finished) -> None:
    if on_event is not None and hasattr(worker, "yielded"):
        worker.yielded.connect(on_event)
    if on_done is not None:
        worker.returned.connect(on_done)
    if on_error is not None:
        worker.errored.connect(on_error)
    if on_finished is not None:
        worker.finished.connect(on_finished)


class TaskOwner:
    """The one way a panel owns its background tasks.

    ``start(key, fn, *args, on_event=…, on_done=…, on_error=…, on_finished=…)`` runs ``fn`` (a generator function
    through :func:`run_generator`, anything else through :func:`run_function`) as the task named ``key``; a task
    already running under that key is asked to quit and its later callbacks are dropped (the newest wins: a
    restarted engine's hub replaces the old one's). Callbacks are also dropped after :meth:`shutdown` or once
    ``owner`` (a QObject, usually the panel) is deleted. ``shutdown(wait_ms)`` asks every task to quit and waits up
    to ``wait_ms`` for them; returns whether all finished.

    Every task has a :class:`~engine_manager.cancel.CancelToken` (``token=``: one the caller made and handed to
    ``fn``; else a fresh one), which :meth:`cancel`, a replacing :meth:`start` and :meth:`shutdown` cancel — so work
    blocked on a socket that registered with it wakes, where ``quit()`` alone waits for the next yield.
    ``token(key)`` gives the running task's token: cancelling it asks the work to stop and keeps its callbacks.
    """

    def __init__(self, owner: Any = None):
        self._owner = owner
        self._tasks: dict[str, Any] = {}
        self._serial: dict[str, int] = {}
        self._done: dict[int, threading.Event] = {}    # every worker started and not yet finished, replaced ones too
        self._tokens: dict[str, CancelToken] = {}       # the running task's token under each key
        self.shut_down = False

    def _alive(self) -> bool:
        if self.shut_down:
            return False
        if self._owner is None:
            return True
        import shiboken6
        return shiboken6.isValid(self._owner)

    def running(self, key: str) -> bool:
        return key in self._tasks

    def get(self, key: str) -> Any:
        return self._tasks.get(key)

    def token(self, key: str) -> CancelToken | None:
        """The cancel token of the task running under ``key`` (None when none runs)."""
        return self._tokens.get(key) if key in self._tasks else None

    def current(self, key: str, serial: int) -> bool:
        """Whether ``serial`` (from :meth:`serial`) is still the newest task under ``key`` and the owner lives."""
        return self._alive() and self._serial.get(key) == serial

    def serial(self, key: str) -> int:
        return self._serial.get(key, 0)

    def start(self, key: str, fn: Callable[..., Any], *args: Any,
              on_event: Callable[[Any], None] | None = None,
              on_done: Callable[[Any], None] | None = None,
              on_error: Callable[[BaseException], None] | None = None,
              on_finished: Callable[[], None] | None = None,
              replace: bool = True, token: CancelToken | None = None, **kwargs: Any) -> Any:
        import inspect
        if self.shut_down:
            return None
        if key in self._tasks:
            if not replace:
                return self._tasks[key]
            self.cancel(key)
        serial = self._serial.get(key, 0) + 1
        self._serial[key] = serial

        def guard(cb: Callable | None) -> Callable | None:
            if cb is None:
                return None

            def call(*a: Any) -> None:
                if self.current(key, serial):
                    cb(*a)
            return call

        holder: list = []

        task_token = token if token is not None else CancelToken()

        def finished() -> None:
            if holder and self._tasks.get(key) is holder[0]:
                del self._tasks[key]
                if self._tokens.get(key) is task_token:
                    del self._tokens[key]
            if on_finished is not None and self.current(key, serial):
                on_finished()

        common = dict(on_done=guard(on_done), on_error=guard(on_error), on_finished=finished)
        if on_error is None:
            common.pop("on_error")
        if inspect.isgeneratorfunction(fn):
            worker = run_generator(fn, *args, on_event=guard(on_event), **common, **kwargs)
        else:
            worker = run_function(fn, *args, **common, **kwargs)
        holder.append(worker)
        self._tasks[key] = worker
        self._tokens[key] = task_token
        done = threading.Event()
        self._done[id(worker)] = done
        # set in the worker's own thread as it finishes (a queued slot would need the GUI loop, which is blocked
        # while shutdown() waits)
        worker.finished.connect(done.set, Qt.ConnectionType.DirectConnection)
        worker.finished.connect(functools.partial(self._done.pop, id(worker), None))
        return worker

    def cancel(self, key: str) -> None:
        """Ask the task under ``key`` to quit; its later callbacks are dropped."""
        worker = self._tasks.pop(key, None)
        token = self._tokens.pop(key, None)
        self._serial[key] = self._serial.get(key, 0) + 1
        if token is not None:
            token.cancel("stopped")
        if worker is not None:
            try:
                worker.quit()
            except (RuntimeError, AttributeError):
                pass

    def shutdown(self, wait_ms: int = QUIT_WAIT_MS) -> bool:
        self.shut_down = True
        workers = list(self._tasks.values())
        tokens, self._tokens = list(self._tokens.values()), {}
        for token in tokens:
            token.cancel("shutdown")
        for w in workers:
            try:
                w.quit()
            except (RuntimeError, AttributeError):
                pass
        self._tasks.clear()
        # only this owner's workers (superqt's await_workers would quit every worker of the application)
        deadline = time.monotonic() + wait_ms / 1000.0
        ok = True
        for done in list(self._done.values()):
            ok = done.wait(max(0.0, deadline - time.monotonic())) and ok
        return ok
