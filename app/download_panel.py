"""The Downloads tab: the seven model shards (a progress bar, speed, ETA and a verified tick each), the total,
pause / resume / cancel, the engine release, and "use a folder that already has the shards".

The engine release has three ways in: "Download engine" (when the manifest pins a release); "Use an engine release I
already have…" (a folder checked as ``dsv41 doctor`` checks one, ``engine_manager.release_check.check_release``,
each failure shown with its fix, saved as the ``engine_dir`` setting when none fails:
:meth:`DownloadPanel.use_release_folder`); and "Download from URL" (an archive whose sha256 is given beforehand, or
shown on arrival and confirmed by the user before anything is unpacked: ``engine_manager.download.release_source``).
All work runs in ``engine_manager.download`` generators on a worker (``app.workers.TaskOwner``); this widget only
renders their events and forwards the user's intents (a ``CancelToken``).
``shutdown()`` (the window closing mid-download) cancels the download (partial files keep their checkpoints; the
cancel also aborts connections waiting for bytes) and waits at most ``SHUTDOWN_WAIT_MS`` for the generator to end,
so no worker emits signals while Qt objects are torn down; every slot is a no-op once the panel is closing."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Iterator

from PySide6.QtCore import Qt, QUrl, Signal
from PySide6.QtGui import QDesktopServices, QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QFileDialog, QFrame, QGridLayout, QGroupBox, QHBoxLayout, QHeaderView, QLabel, QLineEdit, QProgressBar,
    QPushButton, QSizePolicy, QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget,
)

from engine_manager import fmt
from engine_manager import download as dl
from engine_manager.cancel import CancelToken
from engine_manager.download import release_source as rs
from engine_manager.gguf_split import short_name
from engine_manager.release_check import ReleaseCheck, build_info, check_release, usable

from .panel_base import Panel
from .workers import TaskOwner

COLS = ("", "Shard", "Progress", "Size", "Speed", "ETA", "State")
STATE_WORDS = {
    "queued": "queued", "downloading": "downloading", "paused": "paused", "retrying": "retrying…",
    "verifying": "verifying sha256", "verified": "verified", "present": "verified", "failed": "failed",
    "missing": "not downloaded", "partial": "partly downloaded", "stopped": "stopped (resumable)",
    "checking": "checking", "bad": "damaged: will be fetched again", "unverified": "on disk, not verified yet",
}
# the widest text each fixed-width column shows (sizes, speeds and ETAs as engine_manager.fmt writes them), so
# the columns keep one width whatever state the rows are in
COLUMN_SAMPLES = {0: "✓", 1: "shard 10 of 10", 3: "999.9 MB", 4: "999.9 MB/s", 5: "111:06:40"}
SHUTDOWN_WAIT_MS = 5000     # how long closing the window waits for a download to stop (it takes ~0.2 s here)


class ErrorBox(QFrame):
    """A plain-words error and what to do about it."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setObjectName("downloadError")
        self.setFrameShape(QFrame.Shape.StyledPanel)
        self.setStyleSheet("#downloadError { background: #fdecea; border: 1px solid #f5c2c0; border-radius: 4px; }"
                           "#downloadError QLabel { color: #611a15; }")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(8, 6, 8, 6)
        self.message = QLabel()
        self.message.setObjectName("downloadErrorMessage")
        self.message.setWordWrap(True)
        self.message.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.fix = QLabel()
        self.fix.setObjectName("downloadErrorFix")
        self.fix.setWordWrap(True)
        self.fix.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        lay.addWidget(self.message)
        lay.addWidget(self.fix)
        row = QHBoxLayout()
        self.action = QPushButton()
        self.action.setObjectName("downloadErrorAction")
        self.action.hide()
        self.action.clicked.connect(self._act)
        row.addWidget(self.action)
        row.addStretch(1)
        lay.addLayout(row)
        self._action_fn: Callable[[], None] | None = None
        self.hide()

    def show_error(self, message: str, fix: str = "", action: tuple[str, Callable[[], None]] | None = None) -> None:
        self.message.setText(f"<b>{_esc(message)}</b>")
        self.fix.setText(f"What to do: {_esc(fix)}" if fix else "")
        self.fix.setVisible(bool(fix))
        self._action_fn = action[1] if action else None
        self.action.setText(action[0] if action else "")
        self.action.setVisible(action is not None)
        self.show()

    def _act(self) -> None:
        fn = self._action_fn
        if fn is not None:
            fn()


def _esc(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def checks_html(folder: Path, checks: list[ReleaseCheck]) -> str:
    """A release's checks: the verdict, then each failure and warning with its fix, then what passed (one line)."""
    fails = [c for c in checks if c.status == "fail"]
    warns = [c for c in checks if c.status == "warn"]
    passed = [c for c in checks if c.status == "pass"]
    head = (f"✓ <b>{_esc(str(folder))}</b> passed the release checks and is now the engine folder."
            if not fails else
            f"✗ <b>{_esc(str(folder))}</b>: {len(fails)} of {len(checks)} checks failed.")
    rows = [head]
    for c in fails + warns:
        mark, colour = ("✗", "#b71c1c") if c.status == "fail" else ("!", "#8a5a00")
        rows.append(f"<span style='color:{colour}'>{mark} <b>{_esc(c.title)}</b>: {_esc(c.figure)}</span>"
                    + (f"<br>&nbsp;&nbsp;&nbsp;What to do: {_esc(c.fix)}" if c.fix else ""))
    if passed:
        rows.append("<span style='color:#1b5e20'>✓ " + " · ".join(_esc(c.title) for c in passed) + "</span>")
    return "<br>".join(rows)


class DownloadPanel(Panel, QWidget):
    progressChanged = Signal(object)      # engine_manager.download.Progress
    modelFinished = Signal(object)        # Finished
    engineFinished = Signal(object)       # Finished
    errorRaised = Signal(str, str)        # message, fix
    busyChanged = Signal(bool)
    # the provisioning step (engine_manager.provision: the Strata pack, made by the release's own tool)
    prepareEvent = Signal(object)         # ProvisionEvent
    prepareFinished = Signal(str)         # the pack folder
    prepareFailed = Signal(str)           # plain words
    # an engine release the user named (a folder, or an archive from a URL), checked: (folder, [ReleaseCheck])
    releaseChecked = Signal(object, object)

    def __init__(self, ctx, parent=None):
        super().__init__(parent)
        self.ctx = ctx
        self.control: CancelToken | None = None
        self.stopped_in_time: bool | None = None      # after shutdown(): whether the download stopped within its wait
        self.tasks = TaskOwner(self)          # "download" (model, engine, verify), "prepare", "local" (disk reads)
        self.kind: str | None = None          # "model", "engine", "verify"
        self.rows: dict[str, int] = {}
        self.bars: dict[str, QProgressBar] = {}
        self.last_progress: dl.Progress | None = None
        self._closing = False
        self._release_folder: Path | None = None       # the release folder last checked
        self._fetched: rs.ArchiveFetched | None = None  # a downloaded archive waiting for its sha256's confirmation
        self._engine_note: str | None = None            # why the release last named is not used (until the next)
        self._build()
        ctx.settingsChanged.connect(lambda _l: self.refresh())
        self.refresh()

    # -- layout --------------------------------------------------------------------------------------------------
    def _build(self) -> None:
        lay = QVBoxLayout(self)
        lay.setContentsMargins(8, 8, 8, 8)

        model_box = QGroupBox("Model: DeepSeek-V4.1-Flash Q2_K (seven GGUF shards)")
        ml = QVBoxLayout(model_box)
        self.where = QLabel()
        self.where.setObjectName("downloadWhere")
        self.where.setWordWrap(True)
        self.where.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        ml.addWidget(self.where)

        self.table = QTableWidget(0, len(COLS))
        self.table.setObjectName("shardTable")
        self.table.setHorizontalHeaderLabels(COLS)
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.table.setSelectionMode(QTableWidget.SelectionMode.NoSelection)
        self.table.setFocusPolicy(Qt.FocusPolicy.NoFocus)
        hh = self.table.horizontalHeader()
        fm = self.table.fontMetrics()
        hfm = hh.fontMetrics()
        samples = dict(COLUMN_SAMPLES)
        samples[6] = max(STATE_WORDS.values(), key=fm.horizontalAdvance)
        for c, sample in samples.items():
            hh.setSectionResizeMode(c, QHeaderView.ResizeMode.Fixed)
            hh.resizeSection(c, max(fm.horizontalAdvance(sample), hfm.horizontalAdvance(COLS[c])) + 18)
        # Progress stretches while the table has room; in a narrow tab (1280-px window) the fixed columns took
        # all of it and the header read "ogre": there it keeps a readable width and the table scrolls sideways
        self._progress_min = max(hfm.horizontalAdvance(COLS[2]) + 24, 110)
        self._fixed_width = sum(hh.sectionSize(c) for c in samples)
        self._fit_progress()
        self.table.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)
        ml.addWidget(self.table, 1)

        tot = QHBoxLayout()
        self.total_bar = QProgressBar()
        self.total_bar.setObjectName("totalBar")
        self.total_bar.setRange(0, 1000)
        self.total_bar.setFormat("%p%")
        self.total_label = QLabel("—")
        self.total_label.setObjectName("totalLabel")
        self.total_label.setMinimumWidth(self.total_label.fontMetrics().horizontalAdvance(
            "999.9 GB of 999.9 GB · 999.9 MB/s · ETA 111:06:40"))
        self.total_label.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        tot.addWidget(QLabel("Total"))
        tot.addWidget(self.total_bar, 1)
        tot.addWidget(self.total_label)
        ml.addLayout(tot)

        self.status = QLabel()
        self.status.setObjectName("downloadStatus")
        self.status.setWordWrap(True)
        ml.addWidget(self.status)

        btns = QHBoxLayout()
        self.download_btn = QPushButton("&Download model")
        self.download_btn.setObjectName("downloadButton")
        self.download_btn.setToolTip("Download the missing shards (resumes partial ones) and verify every byte")
        self.pause_btn = QPushButton("&Pause")
        self.pause_btn.setObjectName("pauseButton")
        self.resume_btn = QPushButton("&Resume")
        self.resume_btn.setObjectName("resumeButton")
        self.cancel_btn = QPushButton("&Cancel")
        self.cancel_btn.setObjectName("cancelButton")
        self.cancel_btn.setToolTip("Stop; the partial files stay and the next download resumes them")
        self.folder_btn = QPushButton("Use a &folder that already has the shards…")
        self.folder_btn.setObjectName("useFolderButton")
        self.open_btn = QPushButton("&Open folder")
        self.open_btn.setObjectName("openFolderButton")
        self.download_btn.clicked.connect(lambda: self.start_model())
        self.pause_btn.clicked.connect(self.pause)
        self.resume_btn.clicked.connect(self.resume)
        self.cancel_btn.clicked.connect(self.cancel)
        self.folder_btn.clicked.connect(self.choose_folder)
        self.open_btn.clicked.connect(self._open_folder)
        for b in (self.download_btn, self.pause_btn, self.resume_btn, self.cancel_btn):
            btns.addWidget(b)
        btns.addStretch(1)
        ml.addLayout(btns)
        btns = QHBoxLayout()
        btns.addWidget(self.folder_btn)
        btns.addWidget(self.open_btn)
        btns.addStretch(1)
        ml.addLayout(btns)
        lay.addWidget(model_box, 1)

        eng_box = QGroupBox("Engine release")
        el = QGridLayout(eng_box)
        self.engine_label = QLabel()
        self.engine_label.setObjectName("engineStatus")
        self.engine_label.setWordWrap(True)
        self.engine_btn = QPushButton("Download &engine")
        self.engine_btn.setObjectName("engineButton")
        self.engine_btn.clicked.connect(self.start_engine)
        self.engine_bar = QProgressBar()
        self.engine_bar.setObjectName("engineBar")
        self.engine_bar.setRange(0, 1000)
        self.engine_bar.hide()
        el.addWidget(self.engine_label, 0, 0, 2, 1)
        el.addWidget(self.engine_btn, 0, 1)
        src = QHBoxLayout()
        self.release_folder_btn = QPushButton("Use an engine release I already &have…")
        self.release_folder_btn.setObjectName("useReleaseFolderButton")
        self.release_folder_btn.setToolTip("Choose the folder of an unpacked Strata release (engine/strata, "
                                           "BUILD.json, .venv, serve/, tools/); it is checked before it is used")
        self.release_folder_btn.clicked.connect(self.choose_release_folder)
        self.url_edit = QLineEdit()
        self.url_edit.setObjectName("releaseUrl")
        self.url_edit.setPlaceholderText("Release archive URL (.tar.gz / .zip)")
        self.url_edit.setClearButtonEnabled(True)
        self.sha_edit = QLineEdit()
        self.sha_edit.setObjectName("releaseSha256")
        self.sha_edit.setPlaceholderText("its sha256, if published")
        self.sha_edit.setToolTip("The sha256 the release page publishes for the asset. Without it, the sha256 of "
                                 "what arrived is shown for you to compare before anything is unpacked.")
        self.url_btn = QPushButton("Download from &URL")
        self.url_btn.setObjectName("releaseUrlButton")
        self.url_btn.clicked.connect(lambda: self.start_release_url())
        self.url_edit.returnPressed.connect(lambda: self.start_release_url())
        src.addWidget(self.url_edit, 3)
        src.addWidget(self.sha_edit, 2)
        src.addWidget(self.url_btn)
        el.addWidget(self.release_folder_btn, 1, 1)
        el.addWidget(self.engine_bar, 2, 0, 1, 2)
        el.addLayout(src, 3, 0, 1, 2)
        # the sha256 of a download nobody pinned, for the user to compare with the release page
        self.confirm_box = QFrame()
        self.confirm_box.setObjectName("releaseConfirm")
        self.confirm_box.setFrameShape(QFrame.Shape.StyledPanel)
        cl = QGridLayout(self.confirm_box)
        cl.setContentsMargins(8, 4, 8, 4)
        self.digest_label = QLabel()
        self.digest_label.setObjectName("releaseDigest")
        self.digest_label.setWordWrap(True)
        self.digest_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.confirm_edit = QLineEdit()
        self.confirm_edit.setObjectName("releaseConfirmSha256")
        self.confirm_edit.setPlaceholderText("paste the sha256 the release page shows")
        self.confirm_edit.textChanged.connect(self._confirm_text_changed)
        self.confirm_btn = QPushButton("Confirm and unpack")
        self.confirm_btn.setObjectName("releaseConfirmButton")
        self.confirm_btn.setEnabled(False)
        self.confirm_btn.clicked.connect(lambda: self.confirm_release(self.confirm_edit.text()))
        self.discard_btn = QPushButton("Delete the download")
        self.discard_btn.setObjectName("releaseDiscardButton")
        self.discard_btn.clicked.connect(self.discard_release)
        self.match_label = QLabel()
        self.match_label.setObjectName("releaseMatch")
        cl.addWidget(self.digest_label, 0, 0, 1, 4)
        cl.addWidget(self.confirm_edit, 1, 0)
        cl.addWidget(self.match_label, 1, 1)
        cl.addWidget(self.confirm_btn, 1, 2)
        cl.addWidget(self.discard_btn, 1, 3)
        cl.setColumnStretch(0, 1)
        self.confirm_box.hide()
        el.addWidget(self.confirm_box, 4, 0, 1, 2)
        # the release checks of the folder last named, each failure with its fix
        self.checks_label = QLabel()
        self.checks_label.setObjectName("releaseChecks")
        self.checks_label.setWordWrap(True)
        self.checks_label.setTextFormat(Qt.TextFormat.RichText)
        self.checks_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.checks_label.hide()
        self.recheck_btn = QPushButton("Check a&gain")
        self.recheck_btn.setObjectName("releaseRecheckButton")
        self.recheck_btn.setToolTip("Check the same folder again (after fixing what the checks name)")
        self.recheck_btn.clicked.connect(lambda: self.use_release_folder(self._release_folder)
                                         if self._release_folder is not None else None)
        self.recheck_btn.hide()
        el.addWidget(self.checks_label, 5, 0, 1, 2)
        el.addWidget(self.recheck_btn, 6, 1)
        el.setColumnStretch(0, 1)
        lay.addWidget(eng_box)

        prep_box = QGroupBox("Prepare the model for the Strata engine")
        pl = QGridLayout(prep_box)
        self.prep_label = QLabel("Once the shards are verified and the engine release is installed, the release's "
                                 "own tool (tools/iq_pack.py) makes the model's pack, once. Starting the Strata "
                                 "engine does it too when it is needed.")
        self.prep_label.setObjectName("prepareStatus")
        self.prep_label.setWordWrap(True)
        self.prep_btn = QPushButton("&Prepare")
        self.prep_btn.setObjectName("prepareButton")
        self.prep_btn.clicked.connect(self.start_prepare)
        self.prep_bar = QProgressBar()
        self.prep_bar.setObjectName("prepareBar")
        self.prep_bar.setRange(0, 0)
        self.prep_bar.hide()
        pl.addWidget(self.prep_label, 0, 0)
        pl.addWidget(self.prep_btn, 0, 1)
        pl.addWidget(self.prep_bar, 1, 0, 1, 2)
        pl.setColumnStretch(0, 1)
        lay.addWidget(prep_box)

        self.error = ErrorBox()
        lay.addWidget(self.error)

        QShortcut(QKeySequence("Ctrl+Shift+P"), self, self._toggle_pause,
                  context=Qt.ShortcutContext.WidgetWithChildrenShortcut)
        self._set_busy(False)

    # -- state on disk (cheap: no network, no hashing) --------------------------------------------------------------
    def refresh(self) -> None:
        if self.worker is not None or self._closing:
            return
        self.tasks.start("local", self._read_local, on_done=self._show_local)

    def _read_local(self) -> dict[str, Any]:
        s = self.ctx.settings
        out: dict[str, Any] = {"status": dl.local_status(s), "engine": None, "engine_error": None,
                               "engine_dir": None}
        if s.engine_dir:
            folder = Path(s.engine_dir).expanduser()
            build, _why = build_info(folder) if folder.is_dir() else (None, None)
            out["engine_dir"] = (folder, folder.is_dir(), build.summary() if build else None,
                                 dl.release_record(folder))
        try:
            m = dl.read_engine_manifest()
            out["engine"] = (m["version"], dl.installed_engine(s, m), m["size"])
        except dl.DownloadError as exc:
            out["engine_error"] = exc.message
        except (OSError, ValueError) as exc:
            out["engine_error"] = str(exc)
        return out

    def _show_local(self, info: dict[str, Any]) -> None:
        if self.worker is not None or self._closing:
            return
        st: dl.LocalStatus = info["status"]
        self.folder = st.folder
        src = "model_dir (DSV41_MODEL_DIR)" if self.ctx.settings.model_dir else "the cache"
        commit = f" · pinned commit {st.commit[:12]}" if st.commit else ""
        self.where.setText(f"Folder: <code>{_esc(str(st.folder))}</code> — from {src}{commit}")
        names = dl.shard_names()
        self._ensure_rows(names)
        for n in names:
            size = st.sizes.get(n)
            if n in st.present:
                self._set_row(n, 1.0, size, None, None, "verified" if st.verified else "unverified")
            elif st.kept.get(n):
                # a partial file a resume keeps: its share, not "0% not downloaded"
                self._set_row(n, st.kept[n] / size if size else None, size, None, None, "partial")
            else:
                self._set_row(n, 0.0, size, None, None, "missing")
        total = sum(st.sizes.values()) if len(st.sizes) == len(names) else 0
        have = sum(st.sizes.get(n, 0) for n in st.present) + st.partial_bytes
        if total:
            self.total_bar.setValue(int(have / total * 1000))
            self.total_label.setText(f"{fmt.bytes_si(have)} of {fmt.bytes_si(total)} on disk")
        if st.verified:
            self.status.setText("All seven shards are here and verified. Nothing to download.")
            self.total_bar.setValue(1000)
        elif st.present or st.partial_bytes:
            self.status.setText(f"{len(st.present)} of 7 shards present, {fmt.bytes_si(st.partial_bytes)} of partial "
                                f"files kept ({len(st.kept)} shard(s) partly downloaded): Download resumes them.")
        else:
            self.status.setText("The model is not downloaded yet: 264.5 GB in seven files. Or use a folder that "
                                "already has them.")
        self._show_engine(info)

    def _show_engine(self, info: dict[str, Any]) -> None:
        """The engine line: why the release last named is not used, else the release folder in use (engine_dir),
        else the manifest's release."""
        if self._engine_note:
            self.engine_label.setText(self._engine_note)
            self.engine_btn.setEnabled(bool(info["engine"]) and info["engine"][1] is None)
        elif info.get("engine_dir"):
            folder, exists, summary, record = info["engine_dir"]
            how = ""
            if record and record.get("verified") == rs.VERIFIED_CONFIRMED:
                how = " · its archive's sha256 was confirmed by you against the release page"
            elif record and record.get("verified") == rs.VERIFIED_PINNED:
                how = " · its archive matched the published sha256"
            self.engine_label.setText(
                f"Engine release in use (engine_dir): <code>{_esc(str(folder))}</code>"
                + (f" — {_esc(summary)}" if summary else "") + how if exists else
                f"The engine folder <code>{_esc(str(folder))}</code> (engine_dir) does not exist: choose the "
                "release's folder again, or download it.")
            self.engine_label.setToolTip("")
            self.engine_btn.setEnabled(bool(info["engine"]) and info["engine"][1] is None)
        elif info["engine"]:
            version, where, size = info["engine"]
            self.engine_label.setText(f"Strata {version}: installed and verified in <code>{_esc(str(where))}</code>"
                                      if where else f"Strata {version} ({fmt.bytes_si(size)}): not installed.")
            self.engine_btn.setEnabled(where is None)
        else:
            self.engine_label.setText(f"Engine release: {_esc(info['engine_error'] or '')}")
            self.engine_label.setToolTip("The manifest (resources/manifests/engine.json) pins no release yet: use a "
                                         "release folder you have, or download the release by its URL, below.")
            self.engine_btn.setEnabled(False)

    # -- rows ------------------------------------------------------------------------------------------------------
    def _ensure_rows(self, names: list[str]) -> None:
        for n in names:
            if n in self.rows:
                continue
            r = self.table.rowCount()
            self.table.insertRow(r)
            self.rows[n] = r
            item = QTableWidgetItem(short_name(n))
            item.setToolTip(n)
            self.table.setItem(r, 1, item)
            bar = QProgressBar()
            bar.setRange(0, 1000)
            bar.setTextVisible(True)
            bar.setObjectName(f"bar_{r}")
            self.bars[n] = bar
            self.table.setCellWidget(r, 2, bar)
            for c in (0, 3, 4, 5, 6):
                self.table.setItem(r, c, QTableWidgetItem(""))

    def _set_row(self, name: str, frac: float | None, size: int | None, speed: float | None, eta: float | None,
                 state: str) -> None:
        self._ensure_rows([name])
        r = self.rows[name]
        ok = state in ("verified", "present") and frac == 1.0
        tick = self.table.item(r, 0)
        tick.setText("✓" if ok else ("✗" if state in ("failed", "bad") else ""))
        tick.setForeground(Qt.GlobalColor.darkGreen if ok else Qt.GlobalColor.darkRed)
        tick.setToolTip("sha256 verified" if ok else "")
        bar = self.bars[name]
        if frac is None:
            if state == "verifying":
                bar.setRange(0, 0)
            else:
                bar.setRange(0, 1000)
                bar.setValue(0)
        else:
            bar.setRange(0, 1000)
            bar.setValue(int(frac * 1000))
        if size is not None:
            self.table.item(r, 3).setText(fmt.bytes_si(size))
        self.table.item(r, 4).setText(f"{fmt.bytes_si(speed)}/s" if speed else "")
        self.table.item(r, 5).setText(fmt.clock(eta) if state == "downloading" and eta is not None else "")
        self.table.item(r, 6).setText(STATE_WORDS.get(state, state))
        self.table.item(r, 6).setToolTip(STATE_WORDS.get(state, state))   # whole, where the column shortens it

    def shard_state(self, name: str) -> str:
        """The state word shown for ``name`` (tests and the first-run page read it)."""
        r = self.rows.get(name)
        return self.table.item(r, 6).text() if r is not None else ""

    def verified_count(self) -> int:
        return sum(1 for r in self.rows.values() if self.table.item(r, 0).text() == "✓")

    # -- actions ---------------------------------------------------------------------------------------------------
    def _set_busy(self, busy: bool, kind: str | None = None) -> None:
        self.kind = kind if busy else None
        self.download_btn.setEnabled(not busy)
        self.folder_btn.setEnabled(not busy)
        for b in (self.release_folder_btn, self.url_btn, self.recheck_btn, self.confirm_btn, self.discard_btn):
            b.setEnabled(not busy)
        if not busy:
            self._confirm_text_changed(self.confirm_edit.text())
        self.pause_btn.setEnabled(busy and kind in ("model", "engine"))
        self.resume_btn.setEnabled(False)
        self.cancel_btn.setEnabled(busy)
        if busy:
            self.engine_btn.setEnabled(False)
        self.busyChanged.emit(busy)

    @property
    def busy(self) -> bool:
        return self.worker is not None

    @property
    def worker(self) -> Any:
        """The running download, model or engine, or folder check (None when idle)."""
        return self.tasks.get("download")

    @property
    def prep_worker(self) -> Any:
        """The running Strata preparation (None when idle)."""
        return self.tasks.get("prepare")

    def _run(self, fn: Callable[..., Iterator[Any]], *args: Any, on_done: Callable[[Any], None],
             **kwargs: Any) -> None:
        self.tasks.start("download", fn, *args, control=self.control, token=self.control, on_event=self._on_event,
                         on_done=on_done, on_error=self._on_error, on_finished=self._on_finished, **kwargs)

    def start_model(self, repin: bool = False) -> None:
        """Download the missing shards; ``repin``: pin what the revision is now (the pinned commit is gone)."""
        if self.worker is not None or self._closing:
            return
        self.error.hide()
        self.control = CancelToken()
        self.status.setText("Re-pinning: resolving the revision on the hub again…" if repin else
                            "Checking the model folder…")
        self._set_busy(True, "model")
        self._run(dl.download_model, self.ctx.settings, on_done=self._on_done, **({"repin": True} if repin else {}))

    def start_engine(self) -> None:
        if self.worker is not None or self._closing:
            return
        self.error.hide()
        self.control = CancelToken()
        self.engine_bar.show()
        self.engine_bar.setValue(0)
        self.engine_label.setText("Downloading the engine release…")
        self._set_busy(True, "engine")
        self._run(dl.download_engine, self.ctx.settings, on_done=self._on_done)

    def pause(self) -> None:
        if self.control is not None and self.kind in ("model", "engine"):
            self.control.pause()
            self.pause_btn.setEnabled(False)
            self.resume_btn.setEnabled(True)
            self.status.setText("Pausing… (the connections close; partial files are kept)")

    def resume(self) -> None:
        if self.control is not None:
            self.control.resume()
            self.pause_btn.setEnabled(True)
            self.resume_btn.setEnabled(False)
            self.status.setText("Resuming…")

    def _toggle_pause(self) -> None:
        if self.control is None:
            return
        self.resume() if self.control.paused else self.pause()

    def cancel(self) -> None:
        if self.control is not None:
            self.control.cancel()
            self.status.setText("Stopping… partial files are kept and the next download resumes them.")

    def choose_folder(self) -> None:
        start = str(self.ctx.settings.model_dir or Path.home())
        d = QFileDialog.getExistingDirectory(self, "A folder that already has the seven shards", start)
        if d:
            self.use_folder(Path(d))

    def use_folder(self, folder: Path) -> None:
        """Verify ``folder`` (sha256 against the hub, split metadata) and, if complete, make it model_dir."""
        if self.worker is not None or self._closing:
            return
        self.error.hide()
        self.control = CancelToken()
        self._pending_folder = Path(folder)
        self.status.setText(f"Checking {folder}: every shard's sha256 against the hub (this reads all 264.5 GB "
                            "once; it is remembered afterwards)…")
        self._set_busy(True, "verify")
        self._run(dl.verify_model_dir, self.ctx.settings, Path(folder), on_done=self._on_verified)

    def _open_folder(self) -> None:
        folder = getattr(self, "folder", None)
        if folder is not None and Path(folder).is_dir():
            QDesktopServices.openUrl(QUrl.fromLocalFile(str(folder)))
        else:
            self.ctx.statusMessage.emit("The model folder does not exist yet.", 4000)

    # -- an engine release the user names ---------------------------------------------------------------------------
    def choose_release_folder(self) -> None:
        start = str(self.ctx.settings.engine_dir or Path.home())
        d = QFileDialog.getExistingDirectory(self, "The folder of a Strata engine release you already have", start)
        if d:
            self.use_release_folder(Path(d))

    def _gpu_facts(self) -> tuple[str | None, str | None]:
        report = getattr(self.ctx, "hardware", None)
        gpu = report.gpu(self.ctx.settings.gpu_index) if report is not None else None
        return (gpu.compute_capability, gpu.cuda_driver_version) if gpu is not None else (None, None)

    def use_release_folder(self, folder: Path) -> None:
        """Check ``folder`` the way ``dsv41 doctor`` checks a release (on a worker: it runs the release's Python);
        when no check fails it becomes the engine folder (the ``engine_dir`` setting), otherwise each failure is
        shown with its fix and nothing changes."""
        if self.worker is not None or self._closing:
            return
        self.error.hide()
        self._engine_note = None
        self._release_folder = Path(folder)
        cc, driver = self._gpu_facts()
        self.engine_label.setText(f"Checking the release in <code>{_esc(str(folder))}</code>…")
        self._set_busy(True, "release_check")
        self.tasks.start("download", check_release, Path(folder), compute_capability=cc, driver_cuda=driver,
                         on_done=lambda checks: self._release_checked(Path(folder), checks),
                         on_error=self._on_error, on_finished=self._on_finished)

    def _release_checked(self, folder: Path, checks: list[ReleaseCheck], unpacked: bool = False) -> None:
        if self._closing:
            return
        self._release_folder = folder
        self.checks_label.setText(checks_html(folder, checks))
        self.checks_label.show()
        self.recheck_btn.show()
        if usable(checks):
            try:
                self.ctx.update_settings({"engine_dir": str(folder)})
            except Exception as exc:  # noqa: BLE001 - a settings error is shown, not raised in a slot
                self.error.show_error(f"Could not save engine_dir: {exc}", "Check the settings file's folder.")
            else:
                self.ctx.statusMessage.emit(f"Engine release set to {folder}", 6000)
        else:
            where = f"It was unpacked into <code>{_esc(str(folder))}</code>. " if unpacked else ""
            self._engine_note = (f"✗ Not usable as the engine release yet. {where}Fix what is listed below, then "
                                 "Check again. The engine folder setting was not changed.")
            self.engine_label.setText(self._engine_note)
        self.releaseChecked.emit(folder, checks)

    def start_release_url(self, url: str | None = None, sha256: str | None = None) -> None:
        """Download the release archive at ``url`` (the URL field when None). With a sha256 (the field, when None)
        a mismatch refuses it; without one the sha256 of what arrived is shown for the user to confirm."""
        if self.worker is not None or self._closing:
            return
        url = (url if url is not None else self.url_edit.text()).strip()
        sha256 = (sha256 if sha256 is not None else self.sha_edit.text()).strip() or None
        self.error.hide()
        if not url:
            self.error.show_error("No URL given.", "Paste the address of the release's archive (its asset on the "
                                  "release page) into the URL field.")
            return
        if sha256 and rs.sha256_text(sha256) is None:
            self.error.show_error(f"“{sha256}” is not a sha256 (64 hexadecimal digits).",
                                  "Copy the sha256 the release page shows for the asset, or leave the field empty.")
            return
        self._forget_fetched()
        self._engine_note = None
        self.control = CancelToken()
        self.engine_bar.show()
        self.engine_bar.setValue(0)
        self.engine_label.setText(f"Downloading {_esc(url)}…")
        self._set_busy(True, "release")
        self._run(rs.fetch_release, self.ctx.settings, url, sha256=sha256, on_done=self._release_fetched)

    def _release_fetched(self, path: Any) -> None:
        ev = self._fetched
        if self._closing or path is None or ev is None:
            return
        if ev.pinned:
            self.engine_label.setText(f"{_esc(ev.path.name)} arrived and matches the published sha256; unpacking…")
            self._install(ev, ev.sha256, rs.VERIFIED_PINNED)
            return
        self.digest_label.setText(
            f"<b>{_esc(ev.path.name)}</b> arrived ({fmt.bytes_si(ev.size)}). No published sha256 was given, so it is "
            f"not unpacked until you compare its sha256 with the release page:<br><code>{ev.sha256}</code>")
        self.confirm_edit.clear()
        self.confirm_box.show()
        self.engine_label.setText("Waiting for you to confirm the download's sha256 (below).")

    def _confirm_text_changed(self, text: str) -> None:
        ev = self._fetched
        typed = rs.sha256_text(text)
        if ev is None or not text.strip():
            self.match_label.setText("")
            self.confirm_btn.setEnabled(False)
            return
        ok = typed == ev.sha256
        self.match_label.setText("✓ the same" if ok else "✗ not the same: do not use this file")
        self.match_label.setStyleSheet("color: #1b5e20;" if ok else "color: #b71c1c;")
        self.confirm_btn.setEnabled(ok and self.worker is None)

    def confirm_release(self, text: str) -> bool:
        """The user's confirmation: ``text`` is the sha256 they read on the release page. Unpacks the download
        only when it is the sha256 of what arrived; returns whether it did."""
        ev = self._fetched
        if ev is None or self.worker is not None or self._closing:
            return False
        if rs.sha256_text(text) != ev.sha256:
            self._confirm_text_changed(text)
            return False
        self.confirm_box.hide()
        self._install(ev, ev.sha256, rs.VERIFIED_CONFIRMED)
        return True

    def discard_release(self) -> None:
        ev = self._fetched
        if ev is not None and self.worker is None:
            rs.discard_archive(ev.path)
            self.engine_label.setText(f"{_esc(ev.path.name)} was deleted; nothing was unpacked.")
        self._forget_fetched()

    def _forget_fetched(self) -> None:
        self._fetched = None
        self.confirm_box.hide()
        self.confirm_edit.clear()

    def _install(self, ev: rs.ArchiveFetched, sha256: str, how: str) -> None:
        cc, driver = self._gpu_facts()
        self._fetched = None
        self.engine_bar.show()
        self.engine_bar.setRange(0, 0)
        self._set_busy(True, "install")
        self.tasks.start("download", rs.install_release, self.ctx.settings, ev.path, sha256=sha256, how=how,
                         url=ev.url, compute_capability=cc, driver_cuda=driver,
                         on_done=self._installed, on_error=self._on_error, on_finished=self._install_finished)

    def _install_finished(self) -> None:
        self.engine_bar.setRange(0, 1000)
        self._on_finished()

    def _installed(self, inst: rs.InstalledRelease) -> None:
        if not self._closing:
            self._release_checked(inst.folder, inst.checks, unpacked=True)

    # -- events ----------------------------------------------------------------------------------------------------
    def _on_event(self, ev: Any) -> None:
        if self._closing:
            return
        if isinstance(ev, dl.Progress):
            self.last_progress = ev
            if self.kind in ("engine", "release"):
                self.engine_bar.setValue(int(ev.fraction * 1000))
                self.engine_label.setText(f"Downloading the engine release: {fmt.bytes_si(ev.done_bytes)} of "
                                          f"{fmt.bytes_si(ev.total_bytes)} · ETA {fmt.clock(ev.eta_s)}")
            else:
                for f in ev.files:
                    frac = f.done_bytes / f.size_bytes if f.size_bytes else 1.0
                    self._set_row(f.name, frac, f.size_bytes, f.speed_bps, f.eta_s, f.state)
                self.total_bar.setValue(int(ev.fraction * 1000))
                paused = self.control is not None and self.control.paused
                rate = "paused" if paused else f"{fmt.bytes_si(ev.speed_bps)}/s · ETA {fmt.clock(ev.eta_s)}"
                self.total_label.setText(f"{fmt.bytes_si(ev.done_bytes)} of {fmt.bytes_si(ev.total_bytes)} · {rate}")
                if self.control is not None and self.control.paused:
                    self.status.setText("Paused. Resume goes on where it stopped.")
                elif self.control is not None and not self.control.cancelled:
                    self.status.setText(f"Downloading with {sum(f.state == 'downloading' for f in ev.files)} "
                                        "connections; every byte is hashed as it arrives.")
            self.progressChanged.emit(ev)
        elif isinstance(ev, dl.Resolved):
            self.folder = ev.target_dir
            how = "pinned earlier" if ev.pinned else f"resolved from “{ev.revision}” and pinned"
            self.where.setText(f"Folder: <code>{_esc(str(ev.target_dir))}</code> · {ev.repo} @ "
                               f"<code>{ev.commit[:12]}</code> ({how})")
            for f in ev.files:
                self._set_row(f.name, None, f.size, None, None, "checking")
        elif isinstance(ev, dl.Checking):
            frac = ev.done_bytes / ev.total_bytes if ev.total_bytes else 1.0
            self.status.setText(f"Checking files already on disk: {frac * 100:.0f}% of "
                                f"{fmt.bytes_si(ev.total_bytes)} hashed")
        elif isinstance(ev, dl.DiskChecked):
            self.status.setText(f"{fmt.bytes_si(ev.free_bytes)} free at {ev.path}; "
                                f"{fmt.bytes_si(ev.needed_bytes)} needed.")
        elif isinstance(ev, dl.FileVerified):
            if self.kind != "engine":
                self._set_row(ev.name, 1.0, None, None, None, "verified")
        elif isinstance(ev, dl.FileCorrupt):
            self._set_row(ev.name, 0.0, None, None, None, "bad")
            self.ctx.statusMessage.emit(f"{ev.name}: sha256 mismatch — {ev.action}", 8000)
        elif isinstance(ev, dl.Retrying):
            self.status.setText(f"{short_name(ev.name)}: {ev.reason}; retry {ev.attempt} in {ev.delay_s:.0f} s")
        elif isinstance(ev, dl.Notice):
            self.ctx.statusMessage.emit(ev.text, 10000)
        elif isinstance(ev, dl.Paused):
            self.status.setText("Paused. Resume goes on where it stopped.")
        elif isinstance(ev, dl.Resumed):
            self.status.setText("Resumed.")
        elif isinstance(ev, rs.ArchiveFetched):
            self._fetched = ev
        elif isinstance(ev, dl.Stopped) and self.kind == "release":
            self.engine_label.setText("Download stopped; the partial file was deleted and nothing was unpacked.")
        elif isinstance(ev, dl.Stopped):
            self.status.setText(f"Stopped. {fmt.bytes_si(ev.kept_bytes)} of {fmt.bytes_si(ev.total_bytes)} kept; "
                                "Download resumes from there (also after closing the panel).")
        elif isinstance(ev, dl.Finished):
            if ev.what == "engine":
                self.engine_bar.setValue(1000)
                self.engine_label.setText(f"Engine release verified and unpacked in <code>{_esc(str(ev.target_dir))}"
                                          "</code>")
                self.engineFinished.emit(ev)
            else:
                fetched = f"{fmt.bytes_si(ev.fetched_bytes)} downloaded" if ev.fetched_bytes else "nothing to download"
                self.status.setText(f"All seven shards verified in {ev.target_dir} ({fetched}).")
                self.total_bar.setValue(1000)
                self.modelFinished.emit(ev)

    def _on_done(self, _result: Any) -> None:
        pass

    def _on_verified(self, problems: Any) -> None:
        if self._closing:
            return
        folder = getattr(self, "_pending_folder", None)
        if problems == ["cancelled"]:
            self.status.setText("Check cancelled.")
            return
        if problems:
            self.error.show_error(f"{folder} is not a complete, verified copy of the model: "
                                  + "; ".join(problems[:4]) + ("…" if len(problems) > 4 else ""),
                                  "Pick the folder that holds all seven DeepSeek-V4.1-Flash-Q2_K-0000N-of-00007.gguf "
                                  "files, or download the model.")
            self.errorRaised.emit("incomplete folder", "")
            return
        try:
            self.ctx.update_settings({"model_dir": str(folder)})
        except Exception as exc:  # noqa: BLE001 - a settings error is shown, not raised in a slot
            self.error.show_error(f"Could not save model_dir: {exc}", "Check the settings file's folder.")
            return
        self.status.setText(f"{folder} holds all seven shards, verified. It is now the model folder (model_dir).")
        self.ctx.statusMessage.emit(f"Model folder set to {folder}", 6000)
        self.modelFinished.emit(dl.Finished(Path(folder), [Path(folder) / n for n in dl.shard_names()], 0, 0.0))

    def _on_error(self, exc: BaseException) -> None:
        if self._closing:
            return
        if isinstance(exc, dl.DownloadError):
            msg, fix = exc.message, exc.fix
        else:
            msg, fix = f"{type(exc).__name__}: {exc}", "This is a bug in the panel; the log has the details."
        action = None
        if isinstance(exc, dl.PinnedCommitGone):
            action = (f"Re-pin to “{exc.revision}” now", lambda: self.start_model(repin=True))
        self.error.show_error(msg, fix, action)
        if self.kind in ("release", "install", "release_check"):
            self.engine_label.setText(f"✗ {_esc(msg)}")
        else:
            self.status.setText("Not started: another download is writing into this folder (named above)."
                                if isinstance(exc, dl.FolderBusy) else "Stopped by an error; partial files are kept.")
        self.errorRaised.emit(msg, fix)

    def _on_finished(self) -> None:
        if self._closing:
            return
        self.control = None
        was = self.kind
        self._set_busy(False)
        if was in ("engine", "release", "install") and not self.error.isVisible():
            self.engine_bar.hide()
        if was in ("release_check", "install"):       # the shard rows were not touched: read them all again
            self.refresh()
            return
        self.tasks.start("local", self._read_local, on_done=self._engine_only)

    def _engine_only(self, info: dict[str, Any]) -> None:
        """After a run: refresh the engine line (the shard rows keep the run's final states)."""
        if self.worker is not None or self._closing:
            return
        if info.get("engine_dir") or (info["engine"] and info["engine"][1]):
            self._show_engine(info)
        elif info["engine"]:
            self.engine_btn.setEnabled(info["engine"][1] is None)

    # -- the provisioning step ---------------------------------------------------------------------------------------
    def start_prepare(self, force: bool = False) -> None:
        """Make the Strata pack (``StrataEngine.prepare``: the release's tools/iq_pack.py, once) on a worker."""
        if self.prep_worker is not None or self._closing:
            return
        from engine_manager import plans
        from engine_manager.engines import get_engine

        eng = get_engine("strata")
        settings = self.ctx.settings
        plan = plans.load_last_plan()
        self.prep_btn.setEnabled(False)
        self.prep_bar.setRange(0, 0)
        self.prep_bar.show()
        self.prep_label.setText("Preparing the model for the Strata engine…")
        self.tasks.start("prepare", eng.prepare, settings, plan, force=force, on_event=self._prep_event,
                         on_done=self._prep_done, on_error=self._prep_error, on_finished=self._prep_finished)

    def _prep_event(self, ev: Any) -> None:
        if self._closing:
            return
        if ev.phase == "progress" and ev.fraction is not None:
            self.prep_bar.setRange(0, 1000)
            self.prep_bar.setValue(int(ev.fraction * 1000))
            eta = f" · about {fmt.clock(ev.eta_s)} left" if ev.eta_s is not None else ""
            self.prep_label.setText(f"Preparing the model: {ev.done} of {ev.total}{eta}")
        elif ev.phase == "output":
            self.prep_label.setText(f"Preparing the model: {_esc(ev.text)}")
        else:
            self.prep_label.setText(_esc(ev.text))
        self.prepareEvent.emit(ev)

    def _prep_done(self, pack: Any) -> None:
        if self._closing:
            return
        self.prep_bar.setRange(0, 1000)
        self.prep_bar.setValue(1000)
        self.prep_label.setText(f"✓ The model's Strata pack is ready in <code>{_esc(str(pack))}</code>.")
        self.prepareFinished.emit(str(pack))

    def _prep_error(self, exc: BaseException) -> None:
        if self._closing:
            return
        from engine_manager.errors import UserError

        msg = str(exc) if isinstance(exc, UserError) else f"{type(exc).__name__}: {exc}"
        self.prep_bar.hide()
        self.prep_label.setText(f"✗ {_esc(msg)}")
        self.prepareFailed.emit(msg)

    def _prep_finished(self) -> None:
        if not self._closing:
            self.prep_btn.setEnabled(True)

    def _fit_progress(self) -> None:
        """Progress stretches when the table is wide enough to give it ``_progress_min``, else it keeps that width
        (and the table scrolls sideways) — never a header cut to "ogre"."""
        hh = self.table.horizontalHeader()
        room = self.table.viewport().width() - self._fixed_width
        mode = QHeaderView.ResizeMode.Stretch if room >= self._progress_min else QHeaderView.ResizeMode.Fixed
        if hh.sectionResizeMode(2) != mode:
            hh.setSectionResizeMode(2, mode)
        if mode == QHeaderView.ResizeMode.Fixed and hh.sectionSize(2) != self._progress_min:
            hh.resizeSection(2, self._progress_min)

    def resizeEvent(self, ev) -> None:  # noqa: N802 - Qt's name
        super().resizeEvent(ev)
        if hasattr(self, "_progress_min"):
            self._fit_progress()

    def shutdown(self, wait_ms: int = SHUTDOWN_WAIT_MS) -> None:
        """Window closing: cancel the download (partial files keep their checkpoints; a later Download resumes
        them) and wait up to ``wait_ms`` for its generator to end, so no worker thread is left emitting signals
        while the application tears its objects down. From here on every slot of this panel is a no-op, so a
        signal that still arrives changes nothing. ``stopped_in_time``: whether the worker stopped within the
        wait."""
        self._closing = True
        self.tasks.cancel("prepare")           # closing the generator kills the release's tool
        self.tasks.cancel("local")
        worker, control = self.worker, self.control
        if control is not None:
            control.cancel()
        if worker is None:
            self.tasks.shutdown()
            self.stopped_in_time = True
            return
        # the cancel aborts the connections, so the generator returns within ~0.2 s here; superqt's worker clears
        # is_running once it has, and emits its last signals right after (microseconds)
        deadline = time.monotonic() + wait_ms / 1000.0
        while getattr(worker, "is_running", False) and time.monotonic() < deadline:
            time.sleep(0.005)
        stopped = not getattr(worker, "is_running", False)
        self.tasks.cancel("download")          # stuck in a call that cannot be interrupted: stop at its next event
        self.tasks.shutdown()                  # no task is left: callbacks that still arrive are dropped
        self.control = None
        self.status.setText("Stopped for closing; partial files are kept and the next Download resumes them.")
        self.stopped_in_time = stopped

