"""The one worker idiom of the GUI: run an engine_manager generator (or plain function) on a worker thread
(superqt's thread workers) and get its yielded events, result and error back on the GUI thread as signals.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from superqt.utils import FunctionWorker, GeneratorWorker, create_worker


def run_generator(fn: Callable[..., Iterator[Any]], *args: Any,
                  on_event: Callable[[Any], None] | None = None,
                  on_done: Callable[[Any], None] | None = None,
                  on_error: Callable[[BaseException], None] | None = None,
                  on_finished: Callable[[], None] | None = None,
                  **kwargs: Any) -> GeneratorWorker:
    """Start ``fn(*args, **kwargs)`` (a generator function) on a thread; each yielded event reaches
    ``on_event`` on the GUI thread. ``worker.quit()`` asks the generator to stop at its next yield."""
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
