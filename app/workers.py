"""The one worker idiom of the GUI: run an engine_manager generator (or plain function) on a worker thread of
Qt's global pool and get its yielded events, result and error back on the GUI thread as signals.

The workers are this module's own (:class:`Worker`), written in place of superqt's thread workers, whose API they
keep (``started``/``yielded``/``returned``/``errored``/``finished``, ``quit()``, ``is_running``): importing
``superqt.utils`` runs superqt's package, which imports all its widgets and qtpy (qtpy star-imports QtCore, QtGui,
QtOpenGL and QtWidgets, creating every class PySide6 would otherwise create on first use) — 176 ms on the panel's
first step, where the engine column starts its first task (2-core machine, ``python -X importtime -m app``;
benchmarks/results/startup.md), for what is here about eighty lines.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Iterator

import functools
import threading
import time

from PySide6.QtCore import QCoreApplication, QObject, QRunnable, Qt, QThreadPool, Signal

from engine_manager.cancel import CancelToken

# Qt's global pool's default size is the number of cores (2 on small machines). Our workers are long-lived and
# I/O-bound (a streaming chat answer, a readiness wait, the metrics poller, a download), so a pool that small lets
# two of them starve every other panel: seen with a third conversation that did not start until another answer
# finished. They sleep on sockets, so many threads cost little.
MIN_POOL_THREADS = 64


QUIT_WAIT_MS = 3000
_quit_hooked = False


class _Signals(QObject):
    """A worker's signals (a QRunnable is not a QObject). Made on the thread that makes the worker (the GUI
    thread), so what a worker thread emits reaches the slots there, queued."""

    started = Signal()
    yielded = Signal(object)        # each value a generator yields
    returned = Signal(object)       # the return value (not after quit())
    errored = Signal(object)        # the exception the work raised
    finished = Signal()             # last, whatever happened
    _done = Signal(object)          # the worker, to let go of it on the GUI thread


class Worker(QRunnable):
    """``fn(*args, **kwargs)`` on a thread of Qt's global pool: a generator function yields its events one by one
    (``quit()`` stops it at its next yield, without ``returned``); a plain function runs to its end (``quit()``
    only keeps ``returned`` from being emitted). The signals are reached as attributes (``worker.yielded``)."""

    _live: ClassVar[set[Worker]] = set()        # started and not yet let go of: Qt's pool holds no Python ref

    def __init__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any):
        super().__init__()
        import inspect

        self._fn, self._args, self._kwargs = fn, args, kwargs
        self._generator = inspect.isgeneratorfunction(fn)
        self._quit = threading.Event()
        self._running = False
        self.signals = _Signals()
        self.started = self.signals.started
        self.yielded = self.signals.yielded
        self.returned = self.signals.returned
        self.errored = self.signals.errored
        self.finished = self.signals.finished
        self.signals._done.connect(Worker._let_go)

    def quit(self) -> None:
        self._quit.set()

    @property
    def is_running(self) -> bool:
        return self._running

    def start(self) -> None:
        if self in Worker._live:
            raise RuntimeError("this worker has already been started")
        Worker._live.add(self)
        _ensure_pool()
        QThreadPool.globalInstance().start(self)

    @classmethod
    def _let_go(cls, worker: Worker) -> None:
        cls._live.discard(worker)

    def run(self) -> None:  # the pool's thread
        self._running = True
        self.signals.started.emit()
        try:
            result = self._work()
            if not self._quit.is_set():
                self.signals.returned.emit(result)
        except Exception as exc:  # noqa: BLE001 - handed to errored, as the work's outcome
            self.signals.errored.emit(exc)
        finally:
            self._running = False
            self.signals.finished.emit()
            self.signals._done.emit(self)

    def _work(self) -> Any:
        if not self._generator:
            return self._fn(*self._args, **self._kwargs)
        gen = self._fn(*self._args, **self._kwargs)
        while not self._quit.is_set():
            try:
                value = next(gen)
            except StopIteration as stop:
                return stop.value
            self.signals.yielded.emit(value)
        return None


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
    for worker in list(Worker._live):
        worker.quit()
    return QThreadPool.globalInstance().waitForDone(wait_ms)


def _reraise(exc: BaseException) -> None:
    raise exc           # an error nobody handles: on the GUI thread, where Qt reports an exception in a slot


def make_worker(fn: Callable[..., Any], *args: Any,
                on_event: Callable[[Any], None] | None = None,
                on_done: Callable[[Any], None] | None = None,
                on_error: Callable[[BaseException], None] | None = None,
                on_finished: Callable[[], None] | None = None,
                **kwargs: Any) -> Worker:
    """A :class:`Worker` for ``fn`` with the callbacks connected, not started (connect more, then ``start()``).
    Without ``on_error`` an error is raised again on the GUI thread."""
    worker = Worker(fn, *args, **kwargs)
    _connect(worker, on_event, on_done, on_error if on_error is not None else _reraise, on_finished)
    return worker


def run_generator(fn: Callable[..., Iterator[Any]], *args: Any,
                  on_event: Callable[[Any], None] | None = None,
                  on_done: Callable[[Any], None] | None = None,
                  on_error: Callable[[BaseException], None] | None = None,
                  on_finished: Callable[[], None] | None = None,
                  **kwargs: Any) -> Worker:
    """Start ``fn(*args, **kwargs)`` (a generator function) on a thread; each yielded event reaches
    ``on_event`` on the GUI thread. ``worker.quit()`` asks the generator to stop at its next yield."""
    worker = make_worker(fn, *args, on_event=on_event, on_done=on_done, on_error=on_error,
                         on_finished=on_finished, **kwargs)
    worker.start()
    return worker


def run_function(fn: Callable[..., Any], *args: Any,
                 on_done: Callable[[Any], None] | None = None,
                 on_error: Callable[[BaseException], None] | None = None,
                 on_finished: Callable[[], None] | None = None,
                 **kwargs: Any) -> Worker:
    """Run a blocking call (I/O, a probe) off the GUI thread; its return value reaches ``on_done``."""
    worker = make_worker(fn, *args, on_done=on_done, on_error=on_error, on_finished=on_finished, **kwargs)
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

        # a plain function never yields: its on_event, if any, is never called
        worker = make_worker(fn, *args, on_event=guard(on_event), on_done=guard(on_done),
                             on_error=guard(on_error) if on_error is not None else None,
                             on_finished=finished, **kwargs)
        holder.append(worker)
        self._tasks[key] = worker
        self._tokens[key] = task_token
        done = threading.Event()
        self._done[id(worker)] = done
        # set in the worker's own thread as it finishes (a queued slot would need the GUI loop, which is blocked
        # while shutdown() waits)
        worker.finished.connect(done.set, Qt.ConnectionType.DirectConnection)
        worker.finished.connect(functools.partial(self._done.pop, id(worker), None))
        worker.start()                      # every connection made first: none can miss a signal
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
        # only this owner's workers (stop_all would quit every worker of the application)
        deadline = time.monotonic() + wait_ms / 1000.0
        ok = True
        for done in list(self._done.values()):
            ok = done.wait(max(0.0, deadline - time.monotonic())) and ok
        return ok
