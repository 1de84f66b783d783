"""app.workers: the panel's own thread workers on Qt's global pool (events, result, error, quit, stop_all) and
TaskOwner, the one task idiom of the GUI, on them."""

import threading

import pytest
from PySide6.QtWidgets import QWidget

from app.workers import TaskOwner

pytestmark = pytest.mark.gui


def _ticker(stop: threading.Event, label: str):
    i = 0
    while not stop.wait(0.02):
        yield (label, i)
        i += 1


def test_the_newest_task_under_a_key_wins(qtbot):
    owner = TaskOwner()
    got: list = []
    stop = threading.Event()
    owner.start("hub", _ticker, stop, "old", on_event=got.append)
    qtbot.waitUntil(lambda: any(g[0] == "old" for g in got), timeout=10_000)
    owner.start("hub", _ticker, stop, "new", on_event=got.append)
    qtbot.waitUntil(lambda: any(g[0] == "new" for g in got), timeout=10_000)
    cut = len(got)
    qtbot.waitUntil(lambda: len(got) > cut + 3, timeout=10_000)
    assert all(g[0] == "new" for g in got[cut:])       # the replaced task's events are dropped
    assert owner.shutdown(10_000)
    stop.set()


def test_shutdown_waits_for_its_own_tasks_only(qtbot):
    mine, other = TaskOwner(), TaskOwner()
    stop_mine, stop_other = threading.Event(), threading.Event()
    other_events: list = []
    mine.start("a", _ticker, stop_mine, "mine")
    other.start("b", _ticker, stop_other, "other", on_event=other_events.append)
    qtbot.waitUntil(lambda: len(other_events) > 0, timeout=10_000)
    assert mine.shutdown(10_000)
    assert not mine.running("a")
    n = len(other_events)
    qtbot.waitUntil(lambda: len(other_events) > n + 2, timeout=10_000)   # the other owner's task still runs
    assert other.running("b")
    assert mine.start("c", _ticker, stop_mine, "late") is None           # nothing starts after shutdown
    assert other.shutdown(10_000)
    stop_mine.set()
    stop_other.set()


def test_callbacks_are_dropped_once_the_owner_is_deleted(qtbot):
    widget = QWidget()
    owner = TaskOwner(widget)
    done: list = []
    release = threading.Event()

    def slow() -> str:
        release.wait(10)
        return "result"

    owner.start("probe", slow, on_done=done.append)
    widget.deleteLater()
    qtbot.waitUntil(lambda: not owner._alive(), timeout=10_000)
    release.set()
    assert owner.shutdown(10_000)
    qtbot.wait(100)
    assert done == []


def _counted(n: int, where: list, cleaned: list):
    try:
        for i in range(n):
            where.append(threading.current_thread())
            yield i
        return "all"
    finally:
        cleaned.append(threading.current_thread())


def test_a_generators_events_result_and_end_reach_the_gui_thread_in_order(qtbot):
    from app.workers import run_generator

    got: list = []
    ran_on: list = []
    cleaned: list = []
    w = run_generator(_counted, 5, ran_on, cleaned, on_event=lambda v: got.append(("event", v,
                      threading.current_thread() is threading.main_thread())),
                      on_done=lambda r: got.append(("done", r)), on_finished=lambda: got.append(("finished",)))
    qtbot.waitUntil(lambda: bool(got) and got[-1] == ("finished",), timeout=10_000)
    assert got == [*(("event", i, True) for i in range(5)), ("done", "all"), ("finished",)]
    assert ran_on and all(t is not threading.main_thread() for t in ran_on)     # the work ran off the GUI thread
    assert not w.is_running


def test_quit_stops_a_generator_at_its_next_yield_without_a_result_and_cleans_up_off_the_gui_thread(qtbot):
    from app.workers import run_generator

    stop = threading.Event()
    got: list = []
    cleaned: list = []

    def endless():
        try:
            while not stop.is_set():
                yield "tick"
                stop.wait(0.01)
        finally:
            cleaned.append(threading.current_thread())

    w = run_generator(endless, on_event=got.append, on_done=lambda r: got.append(("done", r)),
                      on_finished=lambda: got.append("finished"))
    qtbot.waitUntil(lambda: len(got) >= 3, timeout=10_000)
    w.quit()
    qtbot.waitUntil(lambda: "finished" in got, timeout=10_000)
    assert not any(isinstance(g, tuple) for g in got)         # no result after a quit
    assert len(cleaned) == 1 and cleaned[0] is not threading.main_thread()
    stop.set()


def test_an_error_reaches_on_error_or_is_raised_on_the_gui_thread(qtbot):
    from app.workers import run_function

    def fails(x):
        raise ValueError(f"bad {x}")

    got: list = []
    run_function(fails, 3, on_done=got.append, on_error=lambda e: got.append(repr(e)),
                 on_finished=lambda: got.append("finished"))
    qtbot.waitUntil(lambda: "finished" in got, timeout=10_000)
    assert got == ["ValueError('bad 3')", "finished"]
    done: list = []
    with qtbot.captureExceptions() as raised:
        run_function(fails, 4, on_finished=lambda: done.append(1))
        qtbot.waitUntil(lambda: bool(done), timeout=10_000)
    assert [str(e[1]) for e in raised] == ["bad 4"]


def test_stop_all_quits_every_worker_and_waits_for_the_pool(qtbot):
    from app.workers import Worker, run_generator, stop_all

    stop = threading.Event()
    ended: list = []

    def ticking(label):
        try:
            while not stop.is_set():
                yield label
                stop.wait(0.01)
        finally:
            ended.append(label)

    workers = [run_generator(ticking, n) for n in ("a", "b", "c")]
    qtbot.waitUntil(lambda: all(w.is_running for w in workers), timeout=10_000)
    assert stop_all(10_000)
    assert sorted(ended) == ["a", "b", "c"] and not any(w.is_running for w in workers)
    qtbot.waitUntil(lambda: not (set(workers) & Worker._live), timeout=10_000)   # let go of once finished
    stop.set()
