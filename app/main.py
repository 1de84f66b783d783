"""``dsv41-panel``: start the GUI.

With no display (no ``DISPLAY``/``WAYLAND_DISPLAY``), re-runs itself under ``xvfb-run`` when that exists, so the
panel also starts on a headless box (screenshots, demos, CI); otherwise it says what to install.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys


def _has_display() -> bool:
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")) or \
        os.environ.get("QT_QPA_PLATFORM") in {"offscreen", "minimal", "vnc"}


def _reexec_under_xvfb(argv: list[str]) -> int | None:
    xvfb = shutil.which("xvfb-run")
    if not xvfb or os.environ.get("DSV41_UNDER_XVFB"):
        return None
    env = dict(os.environ, DSV41_UNDER_XVFB="1")
    from engine_manager.frozen import panel_argv     # the bundle re-runs its own executable
    os.execvpe(xvfb, [xvfb, "-a", "-s", "-screen 0 1600x1000x24", *panel_argv(), *argv], env)
    return 0  # not reached


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dsv41-panel", description="Desktop control panel for DeepSeek-V4.1-Flash.")
    p.add_argument("--screenshot", metavar="PNG",
                   help="after --screenshot-delay seconds, save a picture of the window and quit (for docs/tests)")
    p.add_argument("--screenshot-delay", type=float, default=3.0, metavar="S")
    p.add_argument("--quit-after", type=float, metavar="S", help="quit after S seconds (smoke tests)")
    # benchmarks/startup.py: print the wall-clock time of the window's first paint and of the pages being built
    p.add_argument("--report-startup", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if not _has_display():
        if _reexec_under_xvfb(argv) is None:
            print("dsv41-panel: no display found. Run it on a desktop, or install xvfb (apt-get install xvfb) "
                  "to run it headless; the CLI `dsv41` needs no display.", file=sys.stderr)
            return 2

    from PySide6.QtCore import QTimer
    from PySide6.QtGui import QIcon
    from PySide6.QtWidgets import QApplication, QMessageBox

    from . import pyside_hook
    pyside_hook.install()       # every later import is cheaper (app/pyside_hook.py)

    app = QApplication.instance() or QApplication([sys.argv[0], *argv])
    app.setApplicationName("dsv41 panel")
    app.setOrganizationName("dsv41")
    app.setDesktopFileName("dsv41-panel")
    from engine_manager import paths
    icon = paths.resources_dir() / "dsv41-panel.svg"
    if icon.exists():
        app.setWindowIcon(QIcon(str(icon)))

    from .main_window import MainWindow

    # the window shows first; the settings are read and its pages (plots, chat, engine panel: most of
    # the start-up's imports) built right after its first paint
    automated = bool(args.screenshot or args.quit_after is not None)

    def make_context():
        from engine_manager.paths import PathVariableError
        from engine_manager.settings import SettingsError, load_settings
        try:
            loaded = load_settings()
        except (SettingsError, PathVariableError) as exc:  # a bad setting or folder variable: the message
            print(f"dsv41-panel: {exc}", file=sys.stderr, flush=True)
            win.hide()
            # on a virtual screen or in automation nobody can click the box away: the message above is the answer
            if not (os.environ.get("DSV41_UNDER_XVFB") or args.screenshot or args.quit_after is not None):
                box = QMessageBox(QMessageBox.Icon.Critical, "dsv41 panel: a setting is not valid", str(exc))
                box.setInformativeText("Fix it (the environment variable or the settings file) and start the panel "
                                       "again. `dsv41 settings list` shows every setting and what it allows.")
                box.exec()
            app.exit(2)
            return None
        from engine_manager.session import EngineSession

        from .context import AppContext
        # the engine session (its supervisor, the ready engine) belongs to the application, not to a widget; the
        # context re-emits its events for the panels
        return AppContext(loaded, session=EngineSession(loaded.settings))

    win = MainWindow(make_context, lazy=True, show_first_run=not automated)
    win.ask_on_close = not automated       # nobody is there to answer a question
    if args.report_startup:
        report_startup(app, win)

    def frozen() -> None:
        # The window's ~120k long-lived objects made one full garbage-collection pass take 93 ms (a visible stall
        # in the plots, benchmarks/gui_load.py); freezing them moves them out of every later pass.
        import gc
        gc.collect()
        gc.freeze()
    win.pagesBuilt.connect(frozen)
    win.show()

    def quit_now() -> None:
        # a staged start under way is finished first, so an automated run ends with every page as the user's would
        # (a quit before the first paint, --quit-after 0, builds nothing)
        if win.staging():
            win.build_pages()
        # dialogs first (the Getting-started wizard, a message box): an open one kept the application running
        for w in app.topLevelWidgets():
            if w is not win and w.isVisible():
                w.close()
        win.close()
        app.quit()
    if args.screenshot:
        def shoot() -> None:
            win.build_pages()
            win.grab().save(args.screenshot)
            quit_now()
        QTimer.singleShot(int(args.screenshot_delay * 1000), shoot)
    if args.quit_after is not None:
        QTimer.singleShot(max(0, int(args.quit_after * 1000)), quit_now)
    rc = app.exec()
    rc = _leave(rc)
    _dispose(win)
    return rc


def _dispose(win) -> None:
    """Delete the window — its pages, their plots and the plots' scenes — in Qt's own order while Python is whole,
    after the workers have ended. Left to PySide's clean-up at interpreter exit (which deletes what Python owns in
    no set order), a plot layout was deleted before its plots, their relayout called back into a pyqtgraph item
    half torn down and the process died with SIGSEGV: 1 quit in ~18 at ``--quit-after 0.05`` under load (gdb:
    ``PySide::destroyQCoreApplication`` → ``~QGraphicsWidget`` → ``QGraphicsWidget::itemChange`` → a Python
    override's error printed by shiboken)."""
    import shiboken6

    if shiboken6.isValid(win):
        shiboken6.delete(win)


def _leave(rc: int, wait_ms: int = 8000) -> int:
    """After the event loop: let every worker thread end before Python tears the Qt wrappers down. A quit in the
    first moments (``--quit-after 0.2``) left workers started by the page build running while the interpreter
    finalised: their signal objects were deleted under them ("Signal source has been deleted") and the process
    died with SIGSEGV. Workers are asked to stop and waited for; one still blocked in a call that cannot be
    interrupted after ``wait_ms`` is left behind with ``os._exit`` (output flushed) instead of a crash."""
    from PySide6.QtCore import QThreadPool

    from .workers import stop_all
    stop_all(wait_ms)
    if not QThreadPool.globalInstance().waitForDone(wait_ms):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


def report_startup(app, win) -> None:
    """Print ``startup shown_at=<epoch s>`` when the window is first painted, ``startup usable_at=`` once the page
    on screen is built, painted and the event loop is free again, ``startup done_at=`` once that page's second step
    (the Monitor's plots) is painted too, and ``startup built_at=`` once every page is built
    (``benchmarks/startup.py`` reads them)."""
    import time

    from PySide6.QtCore import QEvent, QObject, QTimer
    from PySide6.QtWidgets import QWidget

    class FirstPaint(QObject):
        def eventFilter(self, obj, ev):  # noqa: N802 - Qt's name
            if ev.type() == QEvent.Type.Paint and isinstance(obj, QWidget) and obj.window() is win:
                app.removeEventFilter(self)
                print(f"startup shown_at={time.time():.6f}", flush=True)
            return False
    app._first_paint = FirstPaint(app)
    app.installEventFilter(app._first_paint)
    # usable: the engine column and the page on screen built and painted, and the event loop back to take input
    win.firstPageShown.connect(
        lambda: QTimer.singleShot(0, lambda: print(f"startup usable_at={time.time():.6f}", flush=True)))
    # done: that page's second step too (the Monitor's plots, built after its bar and cards) painted
    win.firstPageDone.connect(
        lambda: QTimer.singleShot(0, lambda: print(f"startup done_at={time.time():.6f}", flush=True)))
    win.pagesBuilt.connect(lambda: print(f"startup built_at={time.time():.6f}", flush=True))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
