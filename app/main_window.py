"""The main window: a control column (engine, state, Start/Stop), the plot area (Monitor, Placement, Downloads,
Log tabs), the chat pane, and a status bar with live RAM / CPU / GPU. Geometry and splitter sizes persist."""

from __future__ import annotations

import base64

from PySide6.QtCore import QByteArray, Qt, QTimer, Signal
from PySide6.QtGui import QAction, QCloseEvent, QKeySequence
from PySide6.QtWidgets import (
    QFrame,
    QLabel,
    QMainWindow,
    QMessageBox,
    QSplitter,
    QStatusBar,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from engine_manager import __version__, uistate

# The pages are imported when they are built (MainWindow.build_pages), not here: their imports (numpy, pyqtgraph,
# superqt, the supervisor, httpx …) took ~1 s, and a window that waits for them appears that much later.
TAB_NAMES = ("Monitor", "Placement", "Downloads", "Log", "Benchmark")


def _tab_classes() -> dict[str, type]:
    from .bench_view import BenchView
    from .download_panel import DownloadPanel
    from .log_view import LogView
    from .monitor_view import MonitorView
    from .placement_view import PlacementView
    return {"Monitor": MonitorView, "Placement": PlacementView, "Downloads": DownloadPanel, "Log": LogView,
            "Benchmark": BenchView}


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
        self.setTextFormat(Qt.TextFormat.RichText)
        self.setFrameShape(QFrame.Shape.StyledPanel)
        self.setMargin(6)
        if ctx is not None:
            self.attach(ctx)

    def attach(self, ctx) -> None:
        self.ctx = ctx
        ctx.hardwareChanged.connect(self.show_report)
        ctx.settingsChanged.connect(lambda _l: self.show_report(ctx.hardware) if ctx.hardware else None)

    def show_report(self, report) -> None:     # engine_manager.hardware.HardwareReport
        engine = self.ctx.engine_name()
        if report.has_gpu:
            g = report.gpu(self.ctx.settings.gpu_index) or report.gpus[0]
            self.setStyleSheet("")
            self.setText(f"<b>{g.name}</b><br>{g.vram_total_bytes / 1024**3:.0f} GiB VRAM · driver "
                         f"{g.driver_version}<br>engine: <b>{engine}</b>")
        else:
            self.setStyleSheet("QLabel { background: #fff4e5; color: #7a4b00; }")
            sim = " — the <b>scripted engine (simulated)</b> is the default" if engine == "sim" else ""
            self.setText(f"<b>No NVIDIA GPU found</b><br>{report.gpu_error}{sim}.")


class MainWindow(QMainWindow):
    """``lazy=True`` (the panel's start, ``app/main.py``): the window shows its frame first — control column, tabs,
    chat column, menus, all as placeholders — and builds the pages right after its first paint. ``lazy=False``
    (default, tests and benchmarks): everything is built here. Either way, reading a page attribute
    (``win.monitor_view`` …) builds the pages first if they are not built yet."""

    pagesBuilt = Signal()

    def __init__(self, ctx, parent=None, lazy: bool = False, show_first_run: bool = True):
        """``ctx``: the AppContext, or (with ``lazy``) a function that makes it — called after the first paint, so
        the settings are read (pydantic, ~0.1 s) after the window appears; it returns None when it cannot (a bad
        setting: it has said so), and then no page is built."""
        super().__init__(parent)
        self._ctx_factory = ctx if callable(ctx) else None
        self.ctx = None if self._ctx_factory is not None else ctx
        self.show_first_run = show_first_run      # False: no Getting-started wizard at start (--quit-after, shots)
        self.setWindowTitle("dsv41 panel — DeepSeek-V4.1-Flash on one GPU")
        self.resize(1440, 900)
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
            QTimer.singleShot(0, self.build_pages)

    def build_pages(self) -> None:
        """Build the engine panel, the four tabs, the chat pane and the live status bar in place of their
        placeholders (once)."""
        if self.built or self._building:
            return
        self._building = True
        if self.ctx is None:
            self.ctx = self._ctx_factory() if self._ctx_factory is not None else None
            if self.ctx is None:
                self._building = False
                return
            self.banner.attach(self.ctx)
        from . import first_run
        from .chat_pane import ChatPane
        from .engine_panel import EnginePanel
        from .statusbar import LiveStatusBar

        ctx = self.ctx
        self._engine_panel = EnginePanel(ctx)
        cl = self.control.layout()
        cl.replaceWidget(self._engine_placeholder, self._engine_panel)
        cl.setStretchFactor(self._engine_panel, 1)
        self._engine_placeholder.deleteLater()

        current = self.tabs.currentIndex()
        self.tabs.blockSignals(True)
        for name, cls in _tab_classes().items():
            page = cls(ctx)
            self.pages[name] = page
            i = self.tabs.indexOf(self._placeholders[name])
            self.tabs.removeTab(i)
            self.tabs.insertTab(i, page, name)
            self._placeholders[name].deleteLater()
        self.tabs.setCurrentIndex(current)
        self.tabs.blockSignals(False)

        self._chat_pane = ChatPane(ctx)
        self._chat_pane.setMinimumWidth(300)
        # the sizes restored from the last session until the window has been shown, then the ones on screen
        sizes = self.splitter.sizes() if self.isVisible() else (self._restored_sizes or self.splitter.sizes())
        visible = self._chat_placeholder.isVisibleTo(self) if self.isVisible() else self._chat_wanted
        self.splitter.replaceWidget(2, self._chat_pane)
        self._chat_placeholder.deleteLater()
        self._chat_pane.setVisible(visible)
        self.splitter.setSizes(sizes)

        self._status = LiveStatusBar(ctx)
        self.setStatusBar(self._status)
        self._add_page_actions()
        self.built = True
        self._building = False
        # Help ▸ Getting started…, shown once at startup while no model is present
        first_run.install(self, autoshow=self.show_first_run)
        ctx.requestTab.connect(self.show_tab)
        for n in ctx.loaded.notices:
            ctx.statusMessage.emit(n, 15000)
        self.refresh_hardware()
        self.pagesBuilt.emit()

    # the pages: built on first use when the window has not built them yet
    def _page(self, attr: str):
        if not self.built:
            self.build_pages()
        return getattr(self, attr)

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

        help_menu = mb.addMenu("&Help")
        self._action(help_menu, "&About dsv41 panel", self.about, None, "actionAbout")

    def _add_page_actions(self) -> None:
        """The pages' own actions (Export metrics CSV…, Start/Stop …) go into the menus once they exist."""
        for act in getattr(self.pages["Monitor"], "file_actions", lambda: [])():
            self.file_menu.insertAction(self._file_sep, act)
        for act in getattr(self._engine_panel, "actions_for_menu", lambda: [])():
            self.engine_menu.insertAction(self._engine_sep, act)

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

    # -- state -----------------------------------------------------------------------------------------------
    _chat_wanted = True
    ask_on_close = True         # False (automation: --quit-after, --screenshot): close without a question, an
    #                             engine that runs is left running (the next panel re-attaches to it)
    _restored_sizes: list[int] | None = None

    def _restore_state(self) -> None:
        try:
            st = uistate.load()
        except (OSError, ValueError):      # a config folder variable no folder can be named by: the settings'
            st = {}                        # loading (after the first paint) says so, in a message box
        geo = st.get("main_geometry")
        if geo:
            self.restoreGeometry(QByteArray(base64.b64decode(geo)))
        sizes = st.get("main_splitter")
        if isinstance(sizes, list) and len(sizes) == 3 and all(isinstance(s, int) for s in sizes):
            self.splitter.setSizes(sizes)
            self._restored_sizes = list(sizes)
        tab = st.get("main_tab")
        if isinstance(tab, str):
            self.show_tab(tab)
        if st.get("chat_visible") is False:
            self.chat_toggle.setChecked(False)
            self.toggle_chat(False)

    def save_state(self) -> None:
        if self.ctx is None:               # the settings never loaded (a bad one): nothing of this run to keep
            return
        uistate.save({
            "main_geometry": base64.b64encode(bytes(self.saveGeometry())).decode(),
            "main_splitter": [int(s) for s in self.splitter.sizes()],
            "main_tab": self.tabs.tabText(self.tabs.currentIndex()),
            "chat_visible": self._chat_widget().isVisibleTo(self),
        })

    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802 - Qt's name
        if self.built:              # pages never built (a quit right at start-up) have nothing to stop
            confirm = getattr(self._engine_panel, "confirm_close", None) if self.ask_on_close else None
            if confirm is not None and not confirm(self):
                event.ignore()
                return
            for w in (self._chat_pane, self.pages["Monitor"], self.pages["Downloads"], self.pages["Placement"],
                      self.pages["Log"], self._engine_panel):
                shutdown = getattr(w, "shutdown", None)
                if shutdown is not None:
                    shutdown()
        self.save_state()
        event.accept()
