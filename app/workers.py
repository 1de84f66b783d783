"""The one worker idiom of the GUI: run an engine_manager generator (or plain function) on a worker thread
(superqt's thread workers) and get its yielded events, result and error back on the GUI thread as signals.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator

from PySide6.QtCore import QCoreApplication, QThreadPool

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
