"""The main window: a control column (engine, state, Start/Stop), the plot area (Monitor, Placement, Downloads,
Log tabs), the chat pane, and a status bar with live RAM / CPU / GPU.

The first window fits the screen it opens on (``QScreen.availableGeometry``: the screen less panels and docks), so
the chat's input and Send/Stop are in view on a 1280×800 screen; size, position and the splitter are remembered per
screen (``engine_manager.uistate``), and a remembered window that no longer fits (a smaller screen now) is fitted
again."""

from __future__ import annotations

import base64

from PySide6.QtCore import QByteArray, QRect, Qt, QTimer, Signal
from PySide6.QtGui import QAction, QActionGroup, QCloseEvent, QGuiApplication, QKeySequence
from PySide6.QtWidgets import (
    QFrame,
    QLabel,
    QMainWindow,
    QMessageBox,
    QScrollArea,
    QSplitter,
    QStatusBar,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from engine_manager import __version__, uistate

from . import theme
from .panel_base import Closable, shutdown_all

# The pages are imported when they are built (MainWindow.build_pages), not here: their imports (numpy, pyqtgraph,
# superqt, the supervisor, httpx …) took ~1 s, and a window that waits for them appears that much later.
TAB_NAMES = ("Monitor", "Placement", "Downloads", "Log", "Benchmark")
DEFAULT_SIZE = (1440, 900)      # the first window, where the screen has room for it
FRAME_GUESS = (0, 32)           # what a window manager adds around the window (a title bar) until it is known


def _tab_class(name: str) -> type:
    """The class of the page called ``name``, imported only then (a page that plots brings pyqtgraph and numpy)."""
    if name == "Monitor":
        from .monitor_view import MonitorView
        return MonitorView
    if name == "Placement":
        from .placement_view import PlacementView
        return PlacementView
    if name == "Downloads":
        from .download_panel import DownloadPanel
        return DownloadPanel
    if name == "Log":
        from .log_view import LogView
        return LogView
    from .bench_view import BenchView
    return BenchView


class _Placeholder(QLabel):
    """Where a page goes until it is built: a quiet "Loading…", and the signal that the window was first painted
    (the heavy pages are built after it, so the window appears first)."""

    painted = Signal()

    def __init__(self, text: str = "Loading…", parent=None):
        super().__init__(text, parent)
        self.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.setStyleSheet("QLabel { color: #888; }")
        self._told = False

    def paintEvent(self, ev) -> None:  # noqa: N802 - Qt's name
        super().paintEvent(ev)
        if not self._told:
            self._told = True
            self.painted.emit()


class HardwareBanner(QLabel):
    """One line under the window title of the control column: which GPU, or why there is none."""

    def __init__(self, ctx, parent=None):
        super().__init__("Probing hardware…", parent)
        self.ctx = None
        self.setObjectName("hardwareBanner")
        self.setWordWrap(True)
        # plain text until the report: the first rich-text layout of a process costs ~7 ms (cProfile of the
        # window's construction), which the frame need not wait for
        self.setTextFormat(Qt.TextFormat.PlainText)
        self.setFrameShape(QFrame.Shape.StyledPanel)
        self.setMargin(6)
        if ctx is not None:
            self.attach(ctx)

    def attach(self, ctx) -> None:
        self.ctx = ctx
        ctx.hardwareChanged.connect(self.show_report)
        ctx.settingsChanged.connect(lambda _l: self.show_report(ctx.hardware) if ctx.hardware else None)

    reported = False            # a report is shown (its height is worth keeping for the next start)

    def reserve(self, height: int) -> None:
        """Keep ``height`` (the banner's last start's, with its report) until the report comes, so that what is
        below it — the engine column's Start — does not move down when the probe answers."""
        if not self.reported:
            self.setMinimumHeight(height)

    def show_report(self, report) -> None:     # engine_manager.hardware.HardwareReport
        engine = self.ctx.engine_name()
        self.setTextFormat(Qt.TextFormat.RichText)
        self.reported = True
        self.setMinimumHeight(0)
        if report.has_gpu:
            g = report.gpu(self.ctx.settings.gpu_index) or report.gpus[0]
            self.setStyleSheet("")
            self.setText(f"<b>{g.name}</b><br>{g.vram_total_bytes / 1024**3:.0f} GiB VRAM · driver "
                         f"{g.driver_version}<br>engine: <b>{engine}</b>")
        else:
            self.setStyleSheet("QLabel { background: #fff4e5; color: #7a4b00; }")
            from engine_manager.engines import find_engine     # the engine column has loaded the adapters by now

            sim = " — the <b>scripted engine (simulated)</b> is the default" if find_engine(engine).simulated else ""
            self.setText(f"<b>No NVIDIA GPU found</b><br>{report.gpu_error}{sim}.")


class MainWindow(QMainWindow):
    """``lazy=True`` (the panel's start, ``app/main.py``): the window shows its frame first — control column, tabs,
    chat column, menus, all as placeholders — and builds the pages right after its first paint. ``lazy=False``
    (default, tests and benchmarks): everything is built here. Either way, reading a page attribute
    (``win.monitor_view`` …) builds the pages first if they are not built yet."""

    pagesBuilt = Signal()
    firstPageShown = Signal()       # the staged start: the engine column and the page on screen built and painted
    firstPageDone = Signal()        # … and what that page builds in a second step (the Monitor's plots) too

    def __init__(self, ctx, parent=None, lazy: bool = False, show_first_run: bool = True):
        """``ctx``: the AppContext, or (with ``lazy``) a function that makes it — called after the first paint, so
        the settings are read after the window appears; it returns None when it cannot (a bad
        setting: it has said so), and then no page is built."""
        super().__init__(parent)
        self._ctx_factory = ctx if callable(ctx) else None
        self.ctx = None if self._ctx_factory is not None else ctx
        self.show_first_run = show_first_run      # False: no Getting-started wizard at start (--quit-after, shots)
        self.setWindowTitle("dsv41 panel — DeepSeek-V4.1-Flash on one GPU")
        self.resize(*DEFAULT_SIZE)
        self._placed = False
        self._framed = False
        self.built = False
        self._building = False
        self.pages: dict[str, QWidget] = {}

        # control column ------------------------------------------------------------------------------------
        self.banner = HardwareBanner(self.ctx)
        self._engine_placeholder = _Placeholder()
        self.control = QWidget()
        self.control.setObjectName("controlColumn")
        cl = QVBoxLayout(self.control)
        cl.setContentsMargins(6, 6, 6, 6)
        cl.addWidget(self.banner)
        cl.addWidget(self._engine_placeholder, 1)
        self.control.setMinimumWidth(240)

        # plot area: one placeholder per tab until the pages are built ---------------------------------------------
        self.tabs = QTabWidget()
        self.tabs.setDocumentMode(True)
        self.tabs.currentChanged.connect(self._tab_changed)
        self._placeholders: dict[str, _Placeholder] = {}
        for name in TAB_NAMES:
            ph = _Placeholder()
            self._placeholders[name] = ph
            self.tabs.addTab(ph, name)

        # chat pane ---------------------------------------------------------------------------------------------
        self._chat_placeholder = _Placeholder()
        self._chat_placeholder.setMinimumWidth(300)

        self.splitter = QSplitter(Qt.Orientation.Horizontal)
        self.splitter.setObjectName("mainSplitter")
        self.splitter.addWidget(self.control)
        self.splitter.addWidget(self.tabs)
        self.splitter.addWidget(self._chat_placeholder)
        self.splitter.setStretchFactor(0, 0)
        self.splitter.setStretchFactor(1, 3)
        self.splitter.setStretchFactor(2, 2)
        self.splitter.setSizes([270, 700, 470])
        self.setCentralWidget(self.splitter)

        self.setStatusBar(QStatusBar())         # the live one replaces it once the pages are built
        self._build_menus()
        self._restore_state()
        if lazy:
            # after the window's first paint (a placeholder painted), on the next pass of the event loop
            for ph in (self._placeholders[self._shown_tab_name()], self._engine_placeholder):
                ph.painted.connect(self._build_soon)
        else:
            self.build_pages()

    def _shown_tab_name(self) -> str:
        return self.tabs.tabText(self.tabs.currentIndex()) or TAB_NAMES[0]

    def _build_soon(self) -> None:
        if not self.built and not getattr(self, "_build_queued", False):
            self._build_queued = True
            QTimer.singleShot(0, self._build_staged)

    # -- building the pages ------------------------------------------------------------------------------------
    # Each piece is built once, by whichever comes first: the staged start (what is on screen first, the rest one
    # piece per pass of the event loop, so a click is answered between them), a page attribute read, a tab shown,
    # or build_pages() (everything now).
    _engine_panel = None
    _chat_pane = None
    _status = None
    _closing = False
    _staged = False             # the staged start has begun: a waiting tab, once chosen, is built at once

    def _ensure_ctx(self) -> bool:
        if self.ctx is None:
            self.ctx = self._ctx_factory() if self._ctx_factory is not None else None
            if self.ctx is None:
                return False
            self.banner.attach(self.ctx)
        return True

    def _build_engine_panel(self) -> None:
        if self._engine_panel is not None:
            return
        from .engine_panel import EnginePanel
        self._engine_panel = EnginePanel(self.ctx, list_later=self._staged)
        if self._staged and self._reserved.get("watching"):
            self._engine_panel.connections.reserve(self._reserved["watching"])
        # the column scrolls when the screen is short (1280×800 with a crash banner up): its labels are never
        # squeezed below the height their words need
        self.control_scroll = QScrollArea()
        self.control_scroll.setObjectName("controlScroll")
        self.control_scroll.setWidgetResizable(True)
        self.control_scroll.setFrameShape(QFrame.Shape.NoFrame)
        self.control_scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.control_scroll.setWidget(self._engine_panel)
        cl = self.control.layout()
        cl.replaceWidget(self._engine_placeholder, self.control_scroll)
        cl.setStretchFactor(self.control_scroll, 1)
        # shown now, not by the layout's queued show one pass later: the staged start's first paint has the
        # engine column in it (it painted the "Loading…" placeholder, deleted later, in its place)
        self.control_scroll.show()
        self._engine_placeholder.hide()
        self._engine_placeholder.deleteLater()
        for act in getattr(self._engine_panel, "actions_for_menu", lambda: [])():
            self.engine_menu.insertAction(self._engine_sep, act)

    def _build_tab(self, name: str, in_two_steps: bool = False) -> None:
        """``in_two_steps``: a page that can (the Monitor) leaves its heavy part — the plots and pyqtgraph — for
        :meth:`_finish_tab`."""
        if name in self.pages:
            return
        cls = _tab_class(name)
        page = cls(self.ctx, plots_later=True) if in_two_steps and hasattr(cls, "build_plots") else cls(self.ctx)
        self.pages[name] = page
        current = self.tabs.currentIndex()
        self.tabs.blockSignals(True)
        i = self.tabs.indexOf(self._placeholders[name])
        self.tabs.removeTab(i)
        self.tabs.insertTab(i, page, name)
        self.tabs.setCurrentIndex(current)
        self.tabs.blockSignals(False)
        self._placeholders[name].deleteLater()
        if name == "Monitor":
            for act in getattr(page, "file_actions", lambda: [])():
                self.file_menu.insertAction(self._file_sep, act)

    def _finish_tab(self, name: str, first: bool = False) -> None:
        """The second step of a page built in two (:meth:`_build_tab`); nothing for a page built whole. ``first``:
        the page on screen at the start — in the staged start, painted now, then ``firstPageDone``."""
        page = self.pages.get(name)
        finish = getattr(page, "build_plots", None)
        if finish is not None:
            finish()
        if first and self._staged:
            if self.isVisible():
                self.repaint()
            self.firstPageDone.emit()

    def _build_chat(self) -> None:
        if self._chat_pane is not None:
            return
        from .chat_pane import ChatPane
        self._chat_pane = ChatPane(self.ctx)
        self._chat_pane.setMinimumWidth(300)
        # the sizes restored from the last session until the window has been shown, then the ones on screen
        sizes = self.splitter.sizes() if self.isVisible() else (self._restored_sizes or self.splitter.sizes())
        visible = self._chat_placeholder.isVisibleTo(self) if self.isVisible() else self._chat_wanted
        self.splitter.replaceWidget(2, self._chat_pane)
        self._chat_placeholder.deleteLater()
        self._chat_pane.setVisible(visible)
        self.splitter.setSizes(sizes)

    def _build_status(self) -> None:
        if self._status is not None:
            return
        from .statusbar import LiveStatusBar
        self._status = LiveStatusBar(self.ctx)
        self.setStatusBar(self._status)

    def _finish(self) -> None:
        if self.built:
            return
        from . import first_run
        self.built = True
        # Help ▸ Getting started…, shown once at startup while no model is present
        first_run.install(self, autoshow=self.show_first_run)
        self.ctx.requestTab.connect(self.show_tab)
        for n in self.ctx.loaded.notices:
            self.ctx.statusMessage.emit(n, 15000)
        self.refresh_hardware()
        self.pagesBuilt.emit()

    def _steps(self) -> list:
        """The pieces in the order the staged start builds them: the engine column and the page on screen (its
        controls and figures: the Monitor's bar and cards), then that page's plots, the saved connections' list
        (pydantic validates it), the chat pane, the status bar, the other pages, and last what only a first run
        needs."""
        shown = self._shown_tab_name()
        return [self._build_engine_panel, lambda: self._build_tab(shown, in_two_steps=True),
                lambda: self._finish_tab(shown, first=True), self._read_connections, self._build_chat,
                self._build_status,
                *(lambda n=n: self._build_tab(n) for n in TAB_NAMES if n != shown), self._finish]

    def _read_connections(self) -> None:
        if self._engine_panel is not None:
            self._engine_panel.connections.read_list()

    def build_pages(self) -> None:
        """Build every piece not built yet — engine panel, the tabs, the chat pane, the live status bar — in place
        of its placeholder, now."""
        if self.built or self._building:
            return
        self._building = True
        try:
            if not self._ensure_ctx():
                return
            for step in self._steps():
                step()
        finally:
            self._building = False

    def _build_staged(self) -> None:
        """The panel's own start: the engine column and the page on screen first, painted at once
        (``firstPageShown``), then one piece per pass of the event loop."""
        if self.built or self._building or self._closing:
            return
        self._building = True
        try:
            if not self._ensure_ctx():
                return
            self._staged = True
            steps = self._steps()
            for step in steps[:2]:
                step()
        finally:
            self._building = False
        self.repaint()
        self.firstPageShown.emit()
        self._queue_steps(steps[2:])

    def _queue_steps(self, steps: list) -> None:
        def run_next() -> None:
            if self._closing or self.built or not steps:
                return
            if not self._building:
                self._building = True
                try:
                    steps.pop(0)()
                finally:
                    self._building = False
            if steps:
                QTimer.singleShot(0, run_next)
        QTimer.singleShot(0, run_next)

    def staging(self) -> bool:
        """The staged start has begun and some pieces are still waiting."""
        return self._staged and not self.built

    def _tab_changed(self, index: int) -> None:
        # a page still waiting for the staged start is built when its tab is chosen
        name = self.tabs.tabText(index)
        waiting = name in self._placeholders and name not in self.pages
        if self._staged and self.ctx is not None and waiting and not self._building:
            self._building = True
            try:
                self._build_tab(name)
            finally:
                self._building = False

    # the pages: built on first use when the window has not built them yet
    def _page(self, attr: str):
        if not self.built:
            self.build_pages()
        return getattr(self, attr)

    def panels(self) -> list[Closable]:
        """Every panel of the window built so far, in the order they are shut down on close: the chat pane (its
        answers are saved), the tabs' pages, then the engine panel (it stops watching the engine last)."""
        return [p for p in (self._chat_pane, *self.pages.values(), self._engine_panel) if p is not None]

    engine_panel = property(lambda self: self._page("_engine_panel"))
    chat_pane = property(lambda self: self._page("_chat_pane"))
    status = property(lambda self: self._page("_status"))
    monitor_view = property(lambda self: self._page("pages")["Monitor"])
    placement_view = property(lambda self: self._page("pages")["Placement"])
    download_panel = property(lambda self: self._page("pages")["Downloads"])
    log_view = property(lambda self: self._page("pages")["Log"])

    # -- menus -----------------------------------------------------------------------------------------------
    def _action(self, menu, text, slot, shortcut=None, name=None) -> QAction:
        act = QAction(text, self)
        if shortcut:
            act.setShortcut(QKeySequence(shortcut))
        if name:
            act.setObjectName(name)
        act.triggered.connect(slot)
        menu.addAction(act)
        return act

    def _build_menus(self) -> None:
        mb = self.menuBar()
        self.file_menu = file_menu = mb.addMenu("&File")
        self.settings_action = self._action(file_menu, "&Settings…", self.open_settings, "Ctrl+,", "actionSettings")
        self._file_sep = file_menu.addSeparator()
        self._action(file_menu, "&Quit", self.close, QKeySequence.StandardKey.Quit, "actionQuit")

        self.engine_menu = engine_menu = mb.addMenu("&Engine")
        self._engine_sep = engine_menu.addSeparator()
        self._action(engine_menu, "Check this machine (&doctor)…", self.open_doctor, "Ctrl+D", "actionDoctor")
        self._action(engine_menu, "Re-probe &hardware", self.refresh_hardware, None, "actionReprobe")

        view_menu = mb.addMenu("&View")
        for i, name in enumerate(TAB_NAMES, start=1):
            self._action(view_menu, name, lambda _c=False, n=name: self.show_tab(n), f"Ctrl+{i}")
        view_menu.addSeparator()
        self.chat_toggle = self._action(view_menu, "Show &chat pane", self.toggle_chat, "Ctrl+Shift+C")
        self.chat_toggle.setCheckable(True)
        self.chat_toggle.setChecked(True)
        from .compact_view import open_compact_view
        self._action(view_menu, "Co&mpact view", lambda: open_compact_view(self), "Ctrl+Shift+M", "actionCompactView")
        # light / dark: the desktop's, or a choice that is remembered
        self.theme_menu = view_menu.addMenu("&Theme")
        self.theme_actions: dict[str, QAction] = {}
        group = QActionGroup(self)
        group.setExclusive(True)
        current = theme.saved_mode()
        for mode, words in theme.MODES.items():
            act = self._action(self.theme_menu, words, lambda _c=False, m=mode: self.set_theme(m), None,
                               f"actionTheme_{mode}")
            act.setCheckable(True)
            act.setChecked(mode == current)
            group.addAction(act)
            self.theme_actions[mode] = act
        theme.apply(current)
        app = QGuiApplication.instance()
        if app is not None and not app.property("dsv41_follows_desktop"):
            app.setProperty("dsv41_follows_desktop", True)
            theme.follow_desktop(theme.saved_mode)

        help_menu = mb.addMenu("&Help")
        self._action(help_menu, "Save a &diagnostic bundle…", lambda: self.save_diagnostic_bundle(), None,
                     "actionDiagnose")
        self._action(help_menu, "&About dsv41 panel", self.about, None, "actionAbout")

    def set_theme(self, mode: str) -> None:
        """View ▸ Theme: "auto" (follow the desktop), "light" or "dark"; remembered for the next start."""
        dark = theme.apply(mode)
        if mode in self.theme_actions:
            self.theme_actions[mode].setChecked(True)
        try:
            theme.save_mode(mode)
        except OSError as exc:
            if self.ctx is not None:
                self.ctx.statusMessage.emit(f"The theme is not remembered: {exc}", 6000)
        if self.ctx is not None:
            self.ctx.statusMessage.emit(f"Theme: {theme.MODES[mode].lower()} ({'dark' if dark else 'light'}).",
                                        3000)

    def show_tab(self, name: str) -> None:
        page = self.pages.get(name) or self._placeholders.get(name)
        if page is not None and self.tabs.indexOf(page) >= 0:
            self.tabs.setCurrentWidget(page)

    def _chat_widget(self) -> QWidget:
        return self._chat_pane if self.built else self._chat_placeholder

    def toggle_chat(self, checked: bool) -> None:
        self._chat_wanted = bool(checked)
        self._chat_widget().setVisible(checked)

    def open_settings(self) -> None:
        if not self.built:
            self.build_pages()
        if self.ctx is None:
            return
        from .settings_dialog import SettingsDialog
        SettingsDialog(self.ctx, self).exec()

    def refresh_hardware(self) -> None:
        if self.ctx is None:
            return
        from engine_manager import hardware

        from .workers import run_function
        run_function(hardware.probe, self.ctx.settings.cache_path, on_done=self.ctx.set_hardware)

    def open_doctor(self) -> None:
        report = self.ctx.hardware if self.ctx is not None else None
        if report is None:
            self.ctx.statusMessage.emit("Still probing the hardware; try again in a moment.", 4000)
            return
        from .doctor_view import DoctorDialog
        DoctorDialog(report, self.ctx.settings, self).exec()

    def about(self) -> None:
        QMessageBox.about(
            self, "About dsv41 panel",
            f"<b>dsv41 panel {__version__}</b><p>Runs DeepSeek-V4.1-Flash (763 B parameters, 384 experts per layer, "
            "264.5 GB at Q2_K) on one GPU workstation: the most-used experts live in VRAM, the rest are computed "
            "on the CPU from RAM.</p><p>Engines: deepseek-one-gpu / Strata, stock llama.cpp, and a scripted engine "
            "(simulated) for machines without the GPU.</p>")

    def save_diagnostic_bundle(self, path=None) -> None:
        """Help ▸ Save a diagnostic bundle…: the zip ``dsv41 diagnose --out FILE`` writes (keys masked;
        ``engine_manager.cli.diagnose.write_bundle``) to a file asked for (``path``: that file, no question),
        collected on a worker; then a message says where it is."""
        import time
        from pathlib import Path

        if not self.built:
            self.build_pages()
        if self.ctx is None:
            return
        if path is None:
            from PySide6.QtWidgets import QFileDialog

            suggested = Path.home() / time.strftime("dsv41-diagnose-%Y%m%d-%H%M%S.zip")
            path, _ = QFileDialog.getSaveFileName(self, "Save a diagnostic bundle", str(suggested),
                                                  "Zip archives (*.zip)")
            if not path:
                return
        from engine_manager.cli.diagnose import write_bundle

        from .workers import run_function
        out = Path(path).expanduser()
        self.ctx.statusMessage.emit(f"Collecting the diagnostic bundle for {out.name}…", 0)

        def done(result) -> None:
            size, notes = result
            text = (f"Saved the diagnostic bundle to {out} ({size / 1024:.0f} KiB, readable only by you; keys and "
                    "tokens masked). Attach it to a bug report.")
            self.ctx.statusMessage.emit(text, 15000)
            self.bundle_box = QMessageBox(QMessageBox.Icon.Information, "Diagnostic bundle saved", text,
                                          QMessageBox.StandardButton.Ok, self)
            self.bundle_box.setDetailedText("\n".join(notes))
            self.bundle_box.setModal(False)
            self.bundle_box.show()

        def failed(exc: BaseException) -> None:
            why = getattr(exc, "strerror", None) or exc
            self.ctx.statusMessage.emit(f"The diagnostic bundle was not saved: cannot write {out} ({why}); "
                                        "choose another file.", 15000)

        run_function(write_bundle, self.ctx.settings, out, on_done=done, on_error=failed)

    # -- the window on its screen ----------------------------------------------------------------------------------
    def _screen(self):
        return self.screen() or QGuiApplication.primaryScreen()

    @staticmethod
    def _key_of(screen) -> str:
        g = screen.geometry()
        return uistate.screen_key(screen.name(), g.width(), g.height())

    def screen_key(self) -> str:
        """The screen the window is on, as the UI state names it (name and size)."""
        return self._key_of(self._screen())

    def _frame_extra(self) -> tuple[int, int]:
        fg, g = self.frameGeometry(), self.geometry()
        extra = (fg.width() - g.width(), fg.height() - g.height())
        return extra if self.isVisible() and extra != (0, 0) else FRAME_GUESS

    def fit_to_screen(self, available: QRect | None = None, size: tuple[int, int] | None = None) -> None:
        """Size (``size``, default :data:`DEFAULT_SIZE`) and centre the window within ``available`` (default:
        its screen's available geometry), frame included."""
        avail = available if available is not None else self._screen().availableGeometry()
        want = size or DEFAULT_SIZE
        # never below what the layout needs, as far as the screen allows
        want = (max(want[0], min(self.minimumSizeHint().width(), avail.width())),
                max(want[1], min(self.minimumSizeHint().height(), avail.height())))
        x, y, w, h = uistate.fit_rect(want, (avail.x(), avail.y(), avail.width(), avail.height()),
                                      self._frame_extra())
        self.resize(w, h)
        self.move(x, y)                        # (move places the frame; resize sizes the inside)

    def keep_on_screen(self, available: QRect | None = None) -> bool:
        """Fit the window again when its frame does not lie within ``available`` (its screen's available
        geometry): a size remembered on a bigger screen. True when it moved or shrank."""
        avail = available if available is not None else self._screen().availableGeometry()
        fw, fh = self._frame_extra()
        fg = QRect(self.x(), self.y(), self.width() + fw, self.height() + fh)
        if avail.contains(fg):
            return False
        self.fit_to_screen(avail, (self.width(), self.height()))
        return True

    def showEvent(self, ev) -> None:  # noqa: N802 - Qt's name
        super().showEvent(ev)
        if not self._placed:           # its real screen; the frame, if the window manager has put one on yet
            self._placed = True
            QTimer.singleShot(0, self.keep_on_screen)

    def moveEvent(self, ev) -> None:  # noqa: N802 - Qt's name
        super().moveEvent(ev)
        # the window manager frames the window after it is shown (a title bar, borders) and moves it: the first
        # time the frame is known, the window is fitted again with it
        if self._placed and not self._framed and self._frame_extra() != FRAME_GUESS:
            fg, g = self.frameGeometry(), self.geometry()
            if (fg.width(), fg.height()) != (g.width(), g.height()):
                self._framed = True
                QTimer.singleShot(0, self.keep_on_screen)

    # -- state -----------------------------------------------------------------------------------------------
    _chat_wanted = True
    ask_on_close = True         # False (automation: --quit-after, --screenshot): close without a question, an
    #                             engine that runs is left running (the next panel re-attaches to it)
    _restored_sizes: list[int] | None = None
    # what fills part of the control column comes after the first paint (the probe's report, the saved
    # connections' list): the heights they took at the last start are kept meanwhile (uistate.column_heights)
    _reserved: dict[str, int] = {}

    def _restore_state(self) -> None:
        try:
            st = uistate.load()
            # the screen the window was last on, when it is still there; else the one it opens on
            screens = {self._key_of(sc): sc for sc in QGuiApplication.screens()}
            last = st.get("main_screen")
            key = last if isinstance(last, str) and last in screens else self.screen_key()
            win = uistate.window_state(key)
        except (OSError, ValueError):      # a config folder variable no folder can be named by: the settings'
            st, win = {}, {}               # loading (after the first paint) says so, in a message box
        geo = win.get("geometry")
        restored = False
        if geo:
            try:
                restored = bool(self.restoreGeometry(QByteArray(base64.b64decode(geo, validate=True))))
            except ValueError:
                restored = False
        if restored:
            self.keep_on_screen()
        else:
            self.fit_to_screen()
        sizes = win.get("splitter")
        if isinstance(sizes, list) and len(sizes) == 3:
            self.splitter.setSizes(sizes)
            self._restored_sizes = list(sizes)
        self._reserved = uistate.column_heights(st)
        if self._reserved.get("banner"):
            self.banner.reserve(self._reserved["banner"])
        tab = st.get("main_tab")
        if isinstance(tab, str):
            self.show_tab(tab)
        if st.get("chat_visible") is False:
            self.chat_toggle.setChecked(False)
            self.toggle_chat(False)

    def save_state(self) -> None:
        if self.ctx is None:               # the settings never loaded (a bad one): nothing of this run to keep
            return
        key = self.screen_key()
        uistate.save_window_state(key, base64.b64encode(bytes(self.saveGeometry())).decode(),
                                  [int(s) for s in self.splitter.sizes()])
        heights = dict(self._reserved)
        if self.banner.reported:
            heights["banner"] = self.banner.height()
        watching = getattr(self._engine_panel, "connections", None)
        if watching is not None and watching.list_read:
            heights["watching"] = watching.height()
        uistate.save({
            "main_screen": key,
            "main_tab": self.tabs.tabText(self.tabs.currentIndex()),
            "chat_visible": self._chat_widget().isVisibleTo(self),
            "column_heights": heights,
        })

    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802 - Qt's name
        # pages never built (a quit right at start-up) have nothing to stop; a start still building its pages
        # stops the ones it has
        confirm = getattr(self._engine_panel, "confirm_close", None) if self.ask_on_close else None
        if confirm is not None and not confirm(self):
            event.ignore()
            return
        self._closing = True
        shutdown_all(self)
        self.save_state()
        event.accept()
