"""app.panel_base: every page and panel has one ``shutdown(wait_ms)``, the main window shuts every page down on close
(the Benchmark page too), and each task of a panel has a cancel token that cancelling, replacing or shutting the
task down cancels — waking work blocked where ``quit()`` alone never reaches it."""

from __future__ import annotations

import importlib
import inspect
import threading
from pathlib import Path

import pytest
from PySide6.QtWidgets import QWidget

from app.panel_base import Closable, Panel
from app.workers import TaskOwner
from engine_manager.cancel import CancelToken

pytestmark = pytest.mark.gui

APP = Path(__file__).resolve().parents[1] / "app"


def _blocked(token: CancelToken) -> str:
    """Work blocked on something only its token wakes (a socket read would register a hook; a sleep is the same)."""
    token.sleep(120)
    return token.reason


def test_every_widget_of_app_with_a_shutdown_is_a_panel_with_the_one_signature():
    found = {}
    for path in sorted(APP.glob("*.py")):
        if path.stem in ("__main__", "main"):
            continue
        mod = importlib.import_module(f"app.{path.stem}")
        for _name, cls in inspect.getmembers(mod, inspect.isclass):
            if cls.__module__ == mod.__name__ and issubclass(cls, QWidget) and "shutdown" in vars(cls):
                found[cls.__qualname__] = cls
    assert {"ChatPane", "MonitorView", "PlacementView", "DownloadPanel", "BenchView", "EnginePanel",
            "ConnectionsView", "OverviewStrip", "ChecksView"} <= set(found)
    for name, cls in found.items():
        assert issubclass(cls, Panel), f"{name} has a shutdown but is no app.panel_base.Panel"
        sig = inspect.signature(cls.shutdown)
        assert list(sig.parameters) == ["self", "wait_ms"], f"{name}.shutdown{sig}"
        wait = sig.parameters["wait_ms"]
        assert wait.annotation == "int" and isinstance(wait.default, int), f"{name}.shutdown{sig}"
        assert sig.return_annotation == "None", f"{name}.shutdown{sig}"


def test_closing_the_window_shuts_every_page_down_the_benchmark_page_included(qtbot):
    from app.context import AppContext
    from app.main_window import MainWindow
    from engine_manager.settings import load_settings

    win = MainWindow(AppContext(load_settings()))
    qtbot.addWidget(win)
    win.show()
    qtbot.waitExposed(win)
    panels = win.panels()
    assert all(isinstance(p, Closable) for p in panels)
    assert set(win.pages.values()) <= set(panels) and win.chat_pane in panels and win.engine_panel in panels
    bench = win.pages["Benchmark"]
    token = CancelToken()
    got: list = []
    worker = bench.tasks.start("probe", _blocked, token, token=token, on_done=got.append)
    assert bench.tasks.token("probe") is token
    win.close()
    assert bench.tasks.shut_down and token.cancelled and token.reason == "shutdown"
    qtbot.waitUntil(lambda: not worker.is_running, timeout=30_000)
    qtbot.wait(50)
    assert got == []                                  # its late result is dropped: the page is shut down


def test_a_tasks_token_is_cancelled_when_it_is_cancelled_replaced_or_shut_down(qtbot):
    owner = TaskOwner()
    first, second = CancelToken(), CancelToken()
    w1 = owner.start("a", _blocked, first, token=first)
    w2 = owner.start("a", _blocked, second, token=second)           # the newest wins: the first is cancelled
    assert first.cancelled and not second.cancelled and owner.token("a") is second
    qtbot.waitUntil(lambda: not w1.is_running, timeout=30_000)      # woken from its blocked wait
    owner.cancel("a")
    assert second.cancelled and owner.token("a") is None
    qtbot.waitUntil(lambda: not w2.is_running, timeout=30_000)
    # a task started without one gets a token of its own; cancelling it alone keeps the task's callbacks
    done: list = []
    holder: list = []
    told = threading.Event()

    def own_token() -> str:
        told.wait(30)
        return _blocked(holder[0])

    owner.start("b", own_token, on_done=done.append)
    holder.append(owner.token("b"))
    told.set()
    holder[0].cancel("asked")
    qtbot.waitUntil(lambda: done == ["asked"], timeout=30_000)
    third = CancelToken()
    owner.start("c", _blocked, third, token=third)
    assert owner.shutdown(30_000)                                   # shutdown cancels it: it ends in time
    assert third.cancelled and third.reason == "shutdown"
