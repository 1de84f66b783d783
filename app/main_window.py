"""The main window: a control column (engine, state, Start/Stop), the plot area (Monitor, Placement, Downloads,
Log tabs), the chat pane, and a status bar with live RAM / CPU / GPU. Geometry and splitter sizes persist."""

from __future__ import annotations

import base64

from PySide6.QtCore import QByteArray, Qt
from PySide6.QtGui import QAction, QCloseEvent, QKeySequence
from PySide6.QtWidgets import (
    QFrame,
    QLabel,
    QMainWindow,
    QMessageBox,
    QSplitter,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from engine_manager import __version__, hardware, uistate

from . import first_run
from .chat_pane import ChatPane
from .doctor_view import DoctorDialog
from .download_panel import DownloadPanel
from .engine_panel import EnginePanel
from .log_view import LogView
from .monitor_view import MonitorView
from .placement_view import PlacementView
from .settings_dialog import SettingsDialog
from .statusbar import LiveStatusBar
from .workers import run_function

TABS = (("Monitor", MonitorView), ("Placement", PlacementView), ("Downloads", DownloadPanel), ("Log", LogView))


class HardwareBanner(QLabel):
    """One line under the window title of the control column: which GPU, or why there is none."""

    def __init__(self, ctx, parent=None):
        super().__init__("Probing hardware…", parent)
        self.ctx = ctx
        self.setObjectName("hardwareBanner")
        self.setWordWrap(True)
        self.setTextFormat(Qt.TextFormat.RichText)
        self.setFrameShape(QFrame.Shape.StyledPanel)
        self.setMargin(6)
        ctx.hardwareChanged.connect(self.show_report)
        ctx.settingsChanged.connect(lambda _l: self.show_report(ctx.hardware) if ctx.hardware else None)

    def show_report(self, report: hardware.HardwareReport) -> None:
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
    def __init__(self, ctx, parent=None):
        super().__init__(parent)
        self.ctx = ctx
        self.setWindowTitle("dsv41 panel — DeepSeek-V4.1-Flash on one GPU")
        self.resize(1440, 900)

        # control column ------------------------------------------------------------------------------------
        self.banner = HardwareBanner(ctx)
        self.engine_panel = EnginePanel(ctx)
        control = QWidget()
        control.setObjectName("controlColumn")
        cl = QVBoxLayout(control)
        cl.setContentsMargins(6, 6, 6, 6)
        cl.addWidget(self.banner)
        cl.addWidget(self.engine_panel, 1)
        control.setMinimumWidth(240)

        # plot area -------------------------------------------------------------------------------------------
        self.tabs = QTabWidget()
        self.tabs.setDocumentMode(True)
        self.pages: dict[str, QWidget] = {}
        for name, cls in TABS:
            page = cls(ctx)
            self.pages[name] = page
            self.tabs.addTab(page, name)
        self.monitor_view = self.pages["Monitor"]
        self.placement_view = self.pages["Placement"]
        self.download_panel = self.pages["Downloads"]
        self.log_view = self.pages["Log"]

        # chat pane ---------------------------------------------------------------------------------------------
        self.chat_pane = ChatPane(ctx)
        self.chat_pane.setMinimumWidth(300)

        self.splitter = QSplitter(Qt.Orientation.Horizontal)
        self.splitter.setObjectName("mainSplitter")
        self.splitter.addWidget(control)
        self.splitter.addWidget(self.tabs)
        self.splitter.addWidget(self.chat_pane)
        self.splitter.setStretchFactor(0, 0)
        self.splitter.setStretchFactor(1, 3)
        self.splitter.setStretchFactor(2, 2)
        self.splitter.setSizes([270, 700, 470])
        self.setCentralWidget(self.splitter)

        self.status = LiveStatusBar(ctx)
        self.setStatusBar(self.status)
        self._build_menus()
        first_run.install(self)  # Help ▸ Getting started…, shown once at startup while no model is present
        ctx.requestTab.connect(self.show_tab)
        self._restore_state()
        for n in ctx.loaded.notices:
            ctx.statusMessage.emit(n, 15000)
        self.refresh_hardware()

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
        file_menu = mb.addMenu("&File")
        self.settings_action = self._action(file_menu, "&Settings…", self.open_settings, "Ctrl+,", "actionSettings")
        for act in getattr(self.monitor_view, "file_actions", lambda: [])():
            file_menu.addAction(act)
        file_menu.addSeparator()
        self._action(file_menu, "&Quit", self.close, QKeySequence.StandardKey.Quit, "actionQuit")

        engine_menu = mb.addMenu("&Engine")
        for act in getattr(self.engine_panel, "actions_for_menu", lambda: [])():
            engine_menu.addAction(act)
        engine_menu.addSeparator()
        self._action(engine_menu, "Check this machine (&doctor)…", self.open_doctor, "Ctrl+D", "actionDoctor")
        self._action(engine_menu, "Re-probe &hardware", self.refresh_hardware, None, "actionReprobe")

        view_menu = mb.addMenu("&View")
        for i, (name, _cls) in enumerate(TABS, start=1):
            self._action(view_menu, name, lambda _c=False, n=name: self.show_tab(n), f"Ctrl+{i}")
        view_menu.addSeparator()
        self.chat_toggle = self._action(view_menu, "Show &chat pane", self.toggle_chat, "Ctrl+Shift+C")
        self.chat_toggle.setCheckable(True)
        self.chat_toggle.setChecked(True)

        help_menu = mb.addMenu("&Help")
        self._action(help_menu, "&About dsv41 panel", self.about, None, "actionAbout")

    def show_tab(self, name: str) -> None:
        page = self.pages.get(name)
        if page is not None:
            self.tabs.setCurrentWidget(page)

    def toggle_chat(self, checked: bool) -> None:
        self.chat_pane.setVisible(checked)

    def open_settings(self) -> None:
        SettingsDialog(self.ctx, self).exec()

    def refresh_hardware(self) -> None:
        run_function(hardware.probe, self.ctx.settings.cache_path, on_done=self.ctx.set_hardware)

    def open_doctor(self) -> None:
        report = self.ctx.hardware
        if report is None:
            self.ctx.statusMessage.emit("Still probing the hardware; try again in a moment.", 4000)
            return
        DoctorDialog(report, self.ctx.settings, self).exec()

    def about(self) -> None:
        QMessageBox.about(
            self, "About dsv41 panel",
            f"<b>dsv41 panel {__version__}</b><p>Runs DeepSeek-V4.1-Flash (763 B parameters, 384 experts per layer, "
            "264.5 GB at Q2_K) on one GPU workstation: the most-used experts live in VRAM, the rest are computed "
            "on the CPU from RAM.</p><p>Engines: deepseek-one-gpu / Strata, stock llama.cpp, and a scripted engine "
            "(simulated) for machines without the GPU.</p>")

    # -- state -----------------------------------------------------------------------------------------------
    def _restore_state(self) -> None:
        st = uistate.load()
        geo = st.get("main_geometry")
        if geo:
            self.restoreGeometry(QByteArray(base64.b64decode(geo)))
        sizes = st.get("main_splitter")
        if isinstance(sizes, list) and len(sizes) == 3 and all(isinstance(s, int) for s in sizes):
            self.splitter.setSizes(sizes)
        tab = st.get("main_tab")
        if isinstance(tab, str):
            self.show_tab(tab)
        if st.get("chat_visible") is False:
            self.chat_toggle.setChecked(False)
            self.chat_pane.setVisible(False)

    def save_state(self) -> None:
        uistate.save({
            "main_geometry": base64.b64encode(bytes(self.saveGeometry())).decode(),
            "main_splitter": [int(s) for s in self.splitter.sizes()],
            "main_tab": self.tabs.tabText(self.tabs.currentIndex()),
            "chat_visible": self.chat_pane.isVisibleTo(self),
        })

    def closeEvent(self, event: QCloseEvent) -> None:  # noqa: N802 - Qt's name
        confirm = getattr(self.engine_panel, "confirm_close", None)
        if confirm is not None and not confirm(self):
            event.ignore()
            return
        for w in (self.chat_pane, self.monitor_view, self.download_panel, self.placement_view, self.log_view,
                  self.engine_panel):
            shutdown = getattr(w, "shutdown", None)
            if shutdown is not None:
                shutdown()
        self.save_state()
        event.accept()
