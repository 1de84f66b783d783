"""The first-run flow: this machine (doctor) → the model (download, or a folder that has the shards) → the
placement plan → start. A non-modal wizard; the main window shows it at startup while no verified model is present
and the user has not turned it off, and always from Help ▸ Getting started…"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QAction
from PySide6.QtWidgets import (
    QCheckBox,
    QHBoxLayout,
    QLabel,
    QProgressBar,
    QPushButton,
    QScrollArea,
    QVBoxLayout,
    QWizard,
    QWizardPage,
)

from engine_manager import doctor, hardware, uistate
from engine_manager import fmt
from engine_manager import download as dl

from .doctor_view import verdicts_html
from .workers import run_function

DISMISS_KEY = "first_run_dismissed"      # finished or closed with "Don't show this at startup" ticked
KEEP_KEY = "first_run_keep_showing"      # the user unticked it: shown at every start until a model is present


class DoctorPage(QWizardPage):
    def __init__(self, ctx, parent=None):
        super().__init__(parent)
        self.ctx = ctx
        self.setTitle("1 · This machine")
        self.setSubTitle("What DeepSeek-V4.1-Flash needs (a big NVIDIA GPU, ~280 GB RAM, ~300 GB disk) against "
                         "what this machine has.")
        lay = QVBoxLayout(self)
        self.table = QLabel("")
        self.table.setObjectName("doctorVerdicts")
        self.table.setWordWrap(True)
        self.table.setTextFormat(Qt.TextFormat.RichText)
        self.table.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QScrollArea.Shape.NoFrame)
        scroll.setWidget(self.table)
        lay.addWidget(scroll, 1)
        self.summary = QLabel("Probing the hardware…")
        self.summary.setObjectName("doctorSummary")
        self.summary.setWordWrap(True)
        lay.addWidget(self.summary)
        ctx.hardwareChanged.connect(self.show_report)
        if ctx.hardware is not None:
            self.show_report(ctx.hardware)
        else:
            run_function(hardware.probe, ctx.settings.cache_path, on_done=ctx.set_hardware)

    def show_report(self, report) -> None:
        vs = doctor.verdicts(report, self.ctx.settings)
        self.verdicts = vs
        self.table.setText(verdicts_html(vs))
        fails = [v for v in vs if v.status == "fail"]
        if fails:
            self.summary.setText(f"{len(fails)} requirement(s) not met: " + ", ".join(v.title for v in fails) +
                                 ". You can still go on: without the GPU the panel runs the scripted engine "
                                 "(simulated), so everything else can be tried.")
        else:
            self.summary.setText("This machine meets the requirements (warnings above are worth a look).")


class ModelPage(QWizardPage):
    def __init__(self, ctx, panel=None, parent=None):
        super().__init__(parent)
        self.ctx = ctx
        self.panel = panel
        self.setTitle("2 · The model")
        # (a wizard's subtitle is cut to the height of the first page's: the longer words go in the page)
        self.setSubTitle("DeepSeek-V4.1-Flash at Q2_K: 264.5 GB in seven GGUF files, for the real engine.")
        lay = QVBoxLayout(self)
        intro = QLabel("Download them (resumable, every byte verified), or use a folder that already has them. The "
                       "scripted engine (what a machine without a big NVIDIA GPU runs, labelled simulated) needs "
                       "none of it: press Next to skip this step.")
        intro.setObjectName("firstRunModelIntro")
        intro.setWordWrap(True)
        lay.addWidget(intro)
        self.state = QLabel("Looking at the model folder…")
        self.state.setObjectName("firstRunModelState")
        self.state.setWordWrap(True)
        lay.addWidget(self.state)
        row = QHBoxLayout()
        self.download_btn = QPushButton("Download the model (264.5 GB)")
        self.download_btn.setObjectName("firstRunDownload")
        self.folder_btn = QPushButton("Use a folder that already has the shards…")
        self.folder_btn.setObjectName("firstRunFolder")
        row.addWidget(self.download_btn)
        row.addWidget(self.folder_btn)
        row.addStretch(1)
        lay.addLayout(row)
        self.bar = QProgressBar()
        self.bar.setObjectName("firstRunBar")
        self.bar.setRange(0, 1000)
        self.bar.hide()
        lay.addWidget(self.bar)
        note = QLabel("The download goes on in the Downloads tab if you close this window; it also resumes after "
                      "the panel is closed or the machine restarts.")
        note.setWordWrap(True)
        lay.addWidget(note)
        # the Strata engine release: a folder the user has (checked, then saved as engine_dir), or a download by URL
        self.release_state = QLabel("The Strata engine release: use one you already have (it is checked first), or "
                                    "download it by its URL in the Downloads tab.")
        self.release_state.setObjectName("firstRunReleaseState")
        self.release_state.setWordWrap(True)
        lay.addWidget(self.release_state)
        rrow = QHBoxLayout()
        self.release_btn = QPushButton("Use an engine release I already have…")
        self.release_btn.setObjectName("firstRunReleaseFolder")
        self.release_url_btn = QPushButton("Download it by URL (Downloads tab)")
        self.release_url_btn.setObjectName("firstRunReleaseUrl")
        rrow.addWidget(self.release_btn)
        rrow.addWidget(self.release_url_btn)
        rrow.addStretch(1)
        lay.addLayout(rrow)
        self.release_btn.clicked.connect(self.pick_release)
        self.release_url_btn.clicked.connect(lambda: ctx.requestTab.emit("Downloads"))
        # the provisioning step: the Strata engine loads a pack made from the shards by the release's own tool
        self.prep_state = QLabel("Then, for the Strata engine: prepare the model (once; the engine release's own "
                                 "tool makes its pack from the verified shards).")
        self.prep_state.setObjectName("firstRunPrepareState")
        self.prep_state.setWordWrap(True)
        lay.addWidget(self.prep_state)
        self.prep_btn = QPushButton("Prepare the model for the Strata engine")
        self.prep_btn.setObjectName("firstRunPrepare")
        lay.addWidget(self.prep_btn, 0, Qt.AlignmentFlag.AlignLeft)
        self.prep_bar = QProgressBar()
        self.prep_bar.setObjectName("firstRunPrepareBar")
        self.prep_bar.setRange(0, 0)
        self.prep_bar.hide()
        lay.addWidget(self.prep_bar)
        lay.addStretch(1)
        self.download_btn.clicked.connect(self.start_download)
        self.folder_btn.clicked.connect(self.pick_folder)
        self.prep_btn.clicked.connect(self.start_prepare)
        if panel is not None:
            panel.progressChanged.connect(self._progress)
            panel.modelFinished.connect(self._finished)
            panel.errorRaised.connect(self._error)
            panel.prepareEvent.connect(self._prep_event)
            panel.prepareFinished.connect(self._prep_done)
            panel.prepareFailed.connect(self._prep_failed)
            panel.releaseChecked.connect(self._release_checked)
        self.refresh()

    def pick_release(self) -> None:
        if self.panel is None:
            self.ctx.requestTab.emit("Downloads")
            return
        self.panel.choose_release_folder()

    def _release_checked(self, folder: Any, checks: Any) -> None:
        fails = [c for c in checks if c.status == "fail"]
        self.release_state.setText(f"✓ The engine release in {folder} passed its checks and is used." if not fails
                                   else f"✗ {folder}: {len(fails)} check(s) failed — the Downloads tab lists each "
                                   f"with what to do (first: {fails[0].title}: {fails[0].fix})")

    def refresh(self) -> None:
        run_function(dl.local_status, self.ctx.settings, on_done=self._show_status)

    def _show_status(self, st: dl.LocalStatus) -> None:
        if st.verified:
            self.state.setText(f"✓ All seven shards are in {st.folder}, verified.")
            self.download_btn.setEnabled(False)
        elif st.present or st.partial_bytes:
            self.state.setText(f"{len(st.present)} of 7 shards in {st.folder} "
                               f"({fmt.bytes_si(st.partial_bytes)} partly downloaded): Download resumes.")
        else:
            self.state.setText(f"Not downloaded yet. It will go to {st.folder}.")

    def start_download(self) -> None:
        if self.panel is None:
            self.ctx.requestTab.emit("Downloads")
            return
        self.bar.show()
        self.state.setText("Starting the download…")
        self.panel.start_model()

    def pick_folder(self) -> None:
        if self.panel is not None:
            self.panel.choose_folder()

    def _progress(self, p: dl.Progress) -> None:
        self.bar.show()
        self.bar.setValue(int(p.fraction * 1000))
        self.state.setText(f"Downloading: {fmt.bytes_si(p.done_bytes)} of {fmt.bytes_si(p.total_bytes)} · "
                           f"{fmt.bytes_si(p.speed_bps)}/s · ETA {fmt.clock(p.eta_s)}")

    def _finished(self, ev: Any) -> None:
        self.bar.setValue(1000)
        self.state.setText(f"✓ All seven shards verified in {ev.target_dir}.")
        self.download_btn.setEnabled(False)

    def _error(self, msg: str, fix: str) -> None:
        self.state.setText(f"✗ {msg}" + (f" — {fix}" if fix else ""))

    def start_prepare(self) -> None:
        if self.panel is None:
            self.ctx.requestTab.emit("Downloads")
            return
        self.prep_bar.setRange(0, 0)
        self.prep_bar.show()
        self.prep_btn.setEnabled(False)
        self.prep_state.setText("Preparing the model for the Strata engine…")
        self.panel.start_prepare()

    def _prep_event(self, ev: Any) -> None:
        self.prep_bar.show()
        if ev.phase == "progress" and ev.fraction is not None:
            self.prep_bar.setRange(0, 1000)
            self.prep_bar.setValue(int(ev.fraction * 1000))
            eta = f" · ETA {fmt.clock(ev.eta_s)}" if ev.eta_s is not None else ""
            self.prep_state.setText(f"Preparing: {ev.done} of {ev.total}{eta}")
        elif ev.phase != "output":
            self.prep_state.setText(ev.text)

    def _prep_done(self, pack: str) -> None:
        self.prep_bar.setRange(0, 1000)
        self.prep_bar.setValue(1000)
        self.prep_btn.setEnabled(True)
        self.prep_state.setText(f"✓ The model is prepared for the Strata engine ({pack}).")

    def _prep_failed(self, msg: str) -> None:
        self.prep_bar.hide()
        self.prep_btn.setEnabled(True)
        self.prep_state.setText(f"✗ {msg}")


class PlanPage(QWizardPage):
    def __init__(self, ctx, parent=None):
        super().__init__(parent)
        self.ctx = ctx
        self.setTitle("3 · Where the experts live")
        self.setSubTitle("The planner reads the shards' headers and this machine, then keeps the most used experts "
                         "in VRAM and the rest in RAM.")
        lay = QVBoxLayout(self)
        text = QLabel("The Placement tab shows the plan: how many experts fit on the GPU, the VRAM and RAM budget "
                      "term by term, and the predicted hit rate once the engine has seen traffic. It refuses a "
                      "machine that cannot hold the minimum layout, and says what is missing.")
        text.setWordWrap(True)
        lay.addWidget(text)
        self.open_btn = QPushButton("Open the Placement tab")
        self.open_btn.setObjectName("firstRunPlan")
        self.open_btn.clicked.connect(lambda: ctx.requestTab.emit("Placement"))
        lay.addWidget(self.open_btn, 0, Qt.AlignmentFlag.AlignLeft)
        lay.addStretch(1)

    def initializePage(self) -> None:  # noqa: N802 - Qt's name
        self.ctx.requestTab.emit("Placement")


class StartPage(QWizardPage):
    def __init__(self, ctx, parent=None):
        super().__init__(parent)
        self.ctx = ctx
        self.setTitle("4 · Start")
        self.setSubTitle("Start the engine with the plan; the Monitor tab shows it loading, then its speed and "
                         "GPU hit rate; chat on the right once it is ready.")
        lay = QVBoxLayout(self)
        self.engine = QLabel()
        self.engine.setWordWrap(True)
        lay.addWidget(self.engine)
        self.start_btn = QPushButton("Start the engine")
        self.start_btn.setObjectName("firstRunStart")
        self.start_btn.clicked.connect(self.start)
        lay.addWidget(self.start_btn, 0, Qt.AlignmentFlag.AlignLeft)
        lay.addStretch(1)

    def initializePage(self) -> None:  # noqa: N802
        from engine_manager.engines import find_engine

        name = self.ctx.engine_name()
        sim = " — the scripted engine, simulated (no NVIDIA GPU here)" if find_engine(name).simulated else ""
        self.engine.setText(f"Engine: <b>{name}</b>{sim}. First start of the real engine may take well over five "
                            "minutes (it reads 264.5 GB).")

    def start(self) -> None:
        self.ctx.requestStart.emit()
        self.ctx.requestTab.emit("Monitor")
        self.wizard().accept()


class FirstRunDialog(QWizard):
    def __init__(self, ctx, download_panel=None, parent=None):
        super().__init__(parent)
        self.ctx = ctx
        self.setObjectName("firstRunDialog")
        self.setWindowTitle("Getting started with dsv41 panel")
        self.setWizardStyle(QWizard.WizardStyle.ClassicStyle)
        self.setOption(QWizard.WizardOption.NoBackButtonOnStartPage, True)
        self.setOption(QWizard.WizardOption.HaveCustomButton1, True)
        # finished or closed, it stays away at the next starts (ticked by default); unticked, it comes back
        self.dont_show = QCheckBox("Don't show this at startup (Help ▸ Getting started… opens it)")
        self.dont_show.setObjectName("firstRunDontShow")
        self.dont_show.setChecked(not uistate.load().get(KEEP_KEY))
        self.setButton(QWizard.WizardButton.CustomButton1, self.dont_show)
        self.setButtonLayout([QWizard.WizardButton.CustomButton1, QWizard.WizardButton.Stretch,
                              QWizard.WizardButton.BackButton, QWizard.WizardButton.NextButton,
                              QWizard.WizardButton.FinishButton, QWizard.WizardButton.CancelButton])
        self.doctor_page = DoctorPage(ctx)
        self.model_page = ModelPage(ctx, download_panel)
        self.plan_page = PlanPage(ctx)
        self.start_page = StartPage(ctx)
        for p in (self.doctor_page, self.model_page, self.plan_page, self.start_page):
            self.addPage(p)
        self.setButtonText(QWizard.WizardButton.CancelButton, "Close")
        self.resize(880, 560)
        self.finished.connect(self._remember)

    def _remember(self, _result: int) -> None:
        uistate.save({DISMISS_KEY: self.dont_show.isChecked(), KEEP_KEY: not self.dont_show.isChecked()})


def should_show(ctx) -> bool:
    """At startup: no verified model and the user has not turned the wizard off."""
    if uistate.load().get(DISMISS_KEY):
        return False
    return not dl.model_present(ctx.settings)


def open_dialog(window) -> FirstRunDialog:
    dlg = getattr(window, "first_run_dialog", None)
    if dlg is None or not dlg.isVisible():
        dlg = FirstRunDialog(window.ctx, getattr(window, "download_panel", None), window)
        dlg.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose, True)
        window.first_run_dialog = dlg
    dlg.show()
    dlg.raise_()
    return dlg


def install(window, autoshow: bool = True) -> None:
    """Add Help ▸ Getting started… to ``window`` and show the wizard once at startup when it should (``autoshow``;
    off for automation: `dsv41-panel --quit-after/--screenshot`)."""
    window.first_run_dialog = None
    act = QAction("&Getting started…", window)
    act.setObjectName("actionGettingStarted")
    act.triggered.connect(lambda: open_dialog(window))
    help_menu = None
    for a in window.menuBar().actions():
        if a.menu() is not None and a.text().replace("&", "") == "Help":
            help_menu = a.menu()
    if help_menu is not None:
        first = help_menu.actions()[0] if help_menu.actions() else None
        help_menu.insertAction(first, act)
        if first is not None:
            help_menu.insertSeparator(first)
    window.getting_started_action = act

    def maybe_show() -> None:
        run_function(should_show, window.ctx,
                     on_done=lambda yes: open_dialog(window) if yes and window.isVisible() else None)

    if autoshow:
        QTimer.singleShot(0, maybe_show)
