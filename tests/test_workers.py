"""app.workers.TaskOwner: the one task idiom of the GUI, on real superqt workers."""

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
