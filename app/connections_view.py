"""Attach: watch engines the panel did not start, from the engine column.

- :class:`ConnectionsView` — "Watching": a picker with "This panel's engine" and every saved connection
  (:mod:`engine_manager.connections`), "Attach to…" (:class:`AddConnectionDialog`) and Remove. Choosing one resolves
  it on a worker (detection, the SSH forward when it names a host) and points the Monitor and the chat pane at it
  through ``ctx.watch``, as at a started engine; the panel's own engine keeps running, and choosing "This panel's
  engine" shows it again. The choice survives a restart (``uistate``).
- :class:`OverviewStrip` — every saved connection with its state, users and tok/s, polled by
  :class:`engine_manager.connections.OverviewPoller` every ``OVERVIEW_PERIOD_S``, each connection (and the panel's
  own engine) on its own worker, never the GUI thread: one slow connection holds up no other line (every request has
  a size cap and a deadline). A figure an engine cannot give is "—", never 0; a connection that does not answer is
  "unreachable", with the reason and when it was last seen in its tooltip. Clicking a line watches that connection.
Keys are typed into a password field, stored by ``engine_manager.connections`` (keyring or an owner-only file) and
never shown, logged or put in a label.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QAction, QBrush, QColor, QFont, QKeySequence
from PySide6.QtWidgets import (
    QAbstractItemView,
    QApplication,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFormLayout,
    QFrame,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QMessageBox,
    QPushButton,
    QScrollArea,
    QSizePolicy,
    QTreeWidget,
    QTreeWidgetItem,
    QVBoxLayout,
    QWidget,
)

from engine_manager import connections as C
from engine_manager import uistate

from .panel_base import Panel
from .workers import TaskOwner

OWN = "This panel's engine"
OWN_ROW = "(this panel)"     # the own engine's line in the overview (no saved name can start with "(")
UISTATE_KEY = "attach_connection"
MISSING = "—"


def _plain_label(name: str) -> QLabel:
    label = QLabel()
    label.setObjectName(name)
    label.setWordWrap(True)
    label.setTextFormat(Qt.TextFormat.PlainText)
    label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    return label


class AddConnectionDialog(QDialog):
    """Name, URL, API key (a password field), optional SSH host; "Test connection" runs the detection on a worker
    and says what was found and what is missing; Save stores it (the key apart: keyring or an owner-only file)."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setWindowTitle("Attach to an engine")
        self.setObjectName("addConnectionDialog")
        self.saved: C.Connection | None = None
        self.detection: C.Detection | None = None
        self.tasks = TaskOwner(self)
        lay = QVBoxLayout(self)
        intro = QLabel("An engine this panel did not start — on this machine or another one. The panel watches it "
                       "and chats with it, and never starts or stops it.")
        intro.setWordWrap(True)
        lay.addWidget(intro)
        form = QFormLayout()
        # the fields take the dialog's width (never squeezed to their minimum), one row each
        form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.AllNonFixedFieldsGrow)
        form.setRowWrapPolicy(QFormLayout.RowWrapPolicy.DontWrapRows)
        self.name = QLineEdit()
        self.name.setObjectName("connName")
        self.name.setPlaceholderText("gpu-box")
        self.url = QLineEdit()
        self.url.setObjectName("connUrl")
        self.url.setPlaceholderText("http://127.0.0.1:8000")
        self.url.setToolTip("The engine's base URL as it answers on its own machine (http or https)")
        self.key = QLineEdit()
        self.key.setObjectName("connKey")
        self.key.setEchoMode(QLineEdit.EchoMode.Password)
        self.key.setPlaceholderText("the engine's API key (kept in the keyring, never shown)")
        self.ssh = QLineEdit()
        self.ssh.setObjectName("connSsh")
        self.ssh.setPlaceholderText("optional: gpu-box or user@gpu-box")
        self.ssh.setToolTip("Reach the engine through an SSH forward to this host (your ~/.ssh/config and agent "
                            "apply); the URL is then where the engine listens over there")
        form.addRow("Name", self.name)
        form.addRow("URL", self.url)
        form.addRow("API key", self.key)
        form.addRow("SSH host", self.ssh)
        for field in (self.name, self.url, self.key, self.ssh):
            field.setMinimumWidth(self.FIELD_MIN_WIDTH)
        lay.addLayout(form)
        row = QHBoxLayout()
        self.test_button = QPushButton("Test connection")
        self.test_button.setObjectName("connTest")
        self.test_button.clicked.connect(self.test)
        row.addWidget(self.test_button)
        row.addStretch(1)
        lay.addLayout(row)
        # what the test found: wrapped, in a scrolling box between the fields and the buttons, so a long message
        # is read whole (scrolled) and never pushes the fields together or runs under the buttons
        self.result = _plain_label("connTestResult")
        self.result.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
        self.result_area = QScrollArea()
        self.result_area.setObjectName("connTestResultArea")
        self.result_area.setWidgetResizable(True)
        self.result_area.setFrameShape(QFrame.Shape.NoFrame)
        self.result_area.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.result_area.setWidget(self.result)
        self.result_area.setMinimumHeight(self.fontMetrics().lineSpacing() * 4 + 8)
        self.result_area.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)
        lay.addWidget(self.result_area, 1)
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Save |
                                        QDialogButtonBox.StandardButton.Cancel)
        self.save_button = self.buttons.button(QDialogButtonBox.StandardButton.Save)
        self.save_button.setObjectName("connSave")
        self.buttons.accepted.connect(self.save)
        self.buttons.rejected.connect(self.reject)
        lay.addWidget(self.buttons)
        self.finished.connect(lambda _r: self.tasks.shutdown(0))
        self._fit_screen()

    FIELD_MIN_WIDTH = 280
    SIZE = (640, 440)              # room for the fields and ~8 lines of a test's message

    def _fit_screen(self) -> None:
        """Open at SIZE, or smaller on a small screen (a 1280×800 one has room for it): never beyond the screen's
        available area."""
        screen = (self.parent().screen() if self.parent() is not None else None) or QApplication.primaryScreen()
        w, h = self.SIZE
        if screen is not None:
            avail = screen.availableGeometry()
            w, h = min(w, avail.width() - 40), min(h, avail.height() - 80)
        self.resize(max(w, self.minimumSizeHint().width()), max(h, self.minimumSizeHint().height()))

    def values(self) -> tuple[str, str, str | None, str | None]:
        return (self.name.text().strip(), self.url.text().strip(), self.key.text().strip() or None,
                self.ssh.text().strip() or None)

    def test(self) -> None:
        _name, url, key, ssh = self.values()
        self._tested_values = (url, key, ssh)
        self.detection = None
        self.test_button.setEnabled(False)
        self.result.setStyleSheet("")
        self.result.setText(f"Testing {url or '(no URL)'}…")
        self.tasks.start("test", C.check_unsaved, url, key, ssh, on_done=self._tested, on_error=self._refused,
                         on_finished=lambda: self.test_button.setEnabled(True))

    def _tested(self, det: C.Detection) -> None:
        self.detection = det
        self.test_button.setEnabled(True)      # with the result, not later: a click right after it must work
        self.result.setStyleSheet(f"color: {'#1b6b2b' if det.ok else '#a1131c'};")
        self.result.setText(("✓ " if det.ok else "✗ ") + det.summary(gui=True))     # the window's words

    def _refused(self, exc: BaseException) -> None:
        self.test_button.setEnabled(True)
        self.save_button.setEnabled(True)
        self.result.setStyleSheet("color: #a1131c;")
        self.result.setText(f"✗ {C.gui_words(exc)}")

    def save(self) -> None:
        name, url, key, ssh = self.values()
        # the test of these very values is kept as the connection's last test (`dsv41 connections list` says it)
        tested = self.detection if getattr(self, "_tested_values", None) == (url, key, ssh) else None
        self.save_button.setEnabled(False)
        self.tasks.start("save", C.add_connection, name, url, key, ssh, tested=tested, on_done=self._saved,
                         on_error=self._refused, on_finished=lambda: self.save_button.setEnabled(True))

    def _saved(self, conn: C.Connection) -> None:
        self.saved = conn
        self.accept()


def _when(t: float | None) -> str:
    import time

    if not t:
        return ""
    fmt = "%H:%M:%S" if time.time() - t < 20 * 3600 else "%Y-%m-%d %H:%M"
    return time.strftime(fmt, time.localtime(t))


def status_words(st: C.ConnectionStatus, shown_name: str) -> tuple[str, str, str]:
    """(state text, colour, tooltip) of an overview line."""
    if st.state == "ok":
        return ("ok" + (" (sim)" if st.simulated else ""), "#1b6b2b",
                f"{shown_name}: {st.label}" + (" — its figures are simulated" if st.simulated else ""))
    seen = (f"Last seen answering at {_when(st.last_seen)}." if st.last_seen
            else "Not seen answering since it was saved.")
    why = st.gui_message or st.message              # the window's words (the CLI's name `dsv41` commands)
    if st.state == "unreachable":
        return "unreachable", "#9a5b00", f"{shown_name} cannot be reached: {why}\n{seen}"
    return "problem", "#a1131c", f"{shown_name}: {why}\n{seen}"


class OverviewStrip(Panel, QTreeWidget):
    """This panel's engine and every saved connection: name, state, users (requests running), tok/s — polled at a
    low rate, each line on its own worker. ``connectionClicked(name)`` when a line is clicked (None: this panel's
    engine)."""

    connectionClicked = Signal(object)
    polled = Signal(object)               # the list of ConnectionStatus just shown (one line each time)

    COLUMNS = ("Connection", "State", "Users", "tok/s")

    def __init__(self, parent=None, *, period_s: float = C.OVERVIEW_PERIOD_S, poller: Any = None,
                 own: Any = None):
        super().__init__(parent)
        self.own = own                        # a callable: the panel's own engine (RunningEngine) or None
        self.setObjectName("connectionsOverview")
        self.setColumnCount(len(self.COLUMNS))
        self.setHeaderLabels(list(self.COLUMNS))
        self.setRootIsDecorated(False)
        self.setUniformRowHeights(True)
        self.setSelectionMode(QAbstractItemView.SelectionMode.NoSelection)
        self.setFocusPolicy(Qt.FocusPolicy.NoFocus)
        self.setToolTip("Every saved connection, polled every few seconds; click one to watch it")
        header = self.header()
        header.setStretchLastSection(False)
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        for i in range(1, len(self.COLUMNS)):
            header.setSectionResizeMode(i, QHeaderView.ResizeMode.ResizeToContents)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Maximum)
        self.poller = poller if poller is not None else C.OverviewPoller()
        self.tasks = TaskOwner(self)
        self.statuses: dict[str, C.ConnectionStatus] = {}
        self.watched: str | None = None
        self.polls = 0
        self._items: dict[str, QTreeWidgetItem] = {}
        self._conns: dict[str, C.Connection] = {}
        self.itemClicked.connect(lambda item, _col: self.connectionClicked.emit(
            item.data(0, Qt.ItemDataRole.UserRole) or None))
        self.timer = QTimer(self)
        self.timer.setInterval(int(period_s * 1000))
        self.timer.timeout.connect(self.poll)
        self.timer.start()

    def set_names(self, names: list[str], conns: list[C.Connection] | None = None) -> None:
        """The saved connections (their order), after this panel's engine; lines of removed ones go, new ones wait
        for the next poll. ``conns``: the saved records (what each line polls)."""
        if conns is not None:
            self._conns = {c.name: c for c in conns}
        names = [OWN_ROW, *names]
        for name in [n for n in self._items if n not in names]:
            self.takeTopLevelItem(self.indexOfTopLevelItem(self._items.pop(name)))
            self.statuses.pop(name, None)
            self.tasks.cancel(f"poll:{name}")
        for name in names:
            if name not in self._items:
                item = QTreeWidgetItem(["This panel" if name == OWN_ROW else name, "…", MISSING, MISSING])
                item.setData(0, Qt.ItemDataRole.UserRole, "" if name == OWN_ROW else name)
                for col in (2, 3):
                    item.setTextAlignment(col, Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                self._items[name] = item
                self.addTopLevelItem(item)
        self._fit()
        self.set_watched(self.watched)

    def _fit(self) -> None:
        rows = max(1, self.topLevelItemCount())
        self.setFixedHeight(self.header().sizeHint().height() + rows * max(18, self.sizeHintForRow(0)) + 6)

    def poll(self) -> None:
        """Poll every line, each on its own worker; a line whose last poll still runs is skipped this time (a slow
        connection holds up only its own line)."""
        if self.tasks.shut_down:
            return
        own = self.own() if self.own is not None else None
        if own is None:
            self._show_stopped_own()
        elif not self.tasks.running(f"poll:{OWN_ROW}"):
            self.tasks.start(f"poll:{OWN_ROW}", self.poller.poll_running, OWN_ROW, own, on_done=self._show_one,
                             on_error=lambda _e: None)
        for name, conn in list(self._conns.items()):
            key = f"poll:{name}"
            if name in self._items and not self.tasks.running(key):
                self.tasks.start(key, self.poller.poll_one, conn, on_done=self._show_one, on_error=lambda _e: None)

    def _show_stopped_own(self) -> None:
        item = self._items.get(OWN_ROW)
        if item is not None:
            item.setText(1, "stopped")
            item.setForeground(1, QBrush(QColor("#6b6f76")))
            item.setText(2, MISSING)
            item.setText(3, MISSING)
            for col in range(len(self.COLUMNS)):
                item.setToolTip(col, "This panel's engine is not running (Start it below)")

    def _show_one(self, st: C.ConnectionStatus) -> None:
        if st.name == OWN_ROW and self.own is not None and self.own() is None:
            self._show_stopped_own()         # it stopped while being polled: no figures of the engine that was
            return
        self._show([st])

    def _show(self, statuses: list[C.ConnectionStatus]) -> None:
        self.polls += 1
        for st in statuses:
            item = self._items.get(st.name)
            if item is None:
                continue
            self.statuses[st.name] = st
            state, colour, tip = status_words(st, item.text(0))
            ok = st.state == "ok"
            item.setText(1, state)
            item.setForeground(1, QBrush(QColor(colour)))
            # figures only for a line that answered now: never one kept from an earlier reading
            item.setText(2, MISSING if not ok or st.users is None else str(st.users))
            item.setText(3, MISSING if not ok or st.decode_tok_s is None else f"{st.decode_tok_s:.1f}")
            for col in range(len(self.COLUMNS)):
                item.setToolTip(col, tip)
        self.polled.emit(statuses)

    def set_watched(self, name: str | None) -> None:
        self.watched = name
        for n, item in self._items.items():
            f = QFont(item.font(0))
            f.setBold(n == (name or OWN_ROW))
            item.setFont(0, f)

    def row_text(self, name: str | None) -> list[str]:
        """The texts of a line (``name`` None: this panel's engine)."""
        item = self._items[name or OWN_ROW]
        return [item.text(c) for c in range(len(self.COLUMNS))]

    def row_tooltip(self, name: str | None) -> str:
        return self._items[name or OWN_ROW].toolTip(1)

    def shutdown(self, wait_ms: int = 500) -> None:
        self.timer.stop()
        self.tasks.shutdown(wait_ms)


class ConnectionsView(Panel, QWidget):
    """The engine column's "Watching" part: the picker, Attach to… / Remove, what is watched, the overview."""

    def __init__(self, ctx, parent=None, *, period_s: float = C.OVERVIEW_PERIOD_S, list_later: bool = False):
        """``list_later``: the saved list is read by :meth:`read_list`, called later (the window's staged start:
        validating the list imports pydantic, 0.11–0.16 s, which the first paint does not wait for)."""
        super().__init__(parent)
        self.ctx = ctx
        self.list_read = False
        self.setObjectName("connectionsView")
        self.tasks = TaskOwner(self)
        self.dialog: AddConnectionDialog | None = None
        self._names: list[str] = []
        self._remote: dict[str, bool] = {}
        self._conns: dict[str, C.Connection] = {}
        self.note = ""                        # what happened to a list file that could not be used
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.setSpacing(4)
        row = QHBoxLayout()
        head = QLabel("Watching")
        f = head.font()
        f.setBold(True)
        head.setFont(f)
        row.addWidget(head)
        self.picker = QComboBox()
        self.picker.setObjectName("connectionPicker")
        self.picker.setToolTip("The engine the Monitor and the chat work on: this panel's own, or a saved "
                               "connection (Ctrl+Shift+W: the next one)")
        self.picker.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.picker.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.picker.setMinimumContentsLength(12)
        self.picker.currentIndexChanged.connect(self._picked)
        row.addWidget(self.picker, 1)
        lay.addLayout(row)
        buttons = QHBoxLayout()
        self.attach_button = QPushButton("Attach to…")
        self.attach_button.setObjectName("attachButton")
        self.attach_button.setToolTip("Add a connection to an engine this panel did not start (Ctrl+Shift+A)")
        self.attach_button.clicked.connect(self.add_dialog)
        buttons.addWidget(self.attach_button)
        self.remove_button = QPushButton("Remove")
        self.remove_button.setObjectName("removeConnection")
        self.remove_button.setToolTip("Forget the chosen connection and its key (the engine is not touched)")
        self.remove_button.clicked.connect(self.remove_current)
        buttons.addWidget(self.remove_button)
        lay.addLayout(buttons)
        self.info = _plain_label("attachInfo")
        self.info.setStyleSheet("color: palette(mid);")
        lay.addWidget(self.info)
        self.overview = OverviewStrip(self, period_s=period_s, own=lambda: getattr(self.ctx, "own", None))
        self.overview.connectionClicked.connect(self.select)
        lay.addWidget(self.overview)

        self.attach_action = QAction("&Attach to an engine…", self)
        self.attach_action.setObjectName("actionAttach")
        self.attach_action.setShortcut(QKeySequence("Ctrl+Shift+A"))
        self.attach_action.triggered.connect(self.add_dialog)
        self.next_action = QAction("&Watch the next engine", self)
        self.next_action.setObjectName("actionWatchNext")
        self.next_action.setShortcut(QKeySequence("Ctrl+Shift+W"))
        self.next_action.triggered.connect(self.select_next)
        self.own_action = QAction("Watch t&his panel's engine", self)
        self.own_action.setObjectName("actionWatchOwn")
        self.own_action.setShortcut(QKeySequence("Ctrl+Shift+H"))
        self.own_action.triggered.connect(lambda: self.select(None))
        for a in self.actions_for_menu():
            self.addAction(a)
        ctx.watchChanged.connect(self._watch_changed)
        ctx.ownEngineChanged.connect(lambda _r: self.overview.poll())
        if list_later:
            self._show_list([])         # this panel's engine alone until the list is read
        else:
            self.read_list()
        self._show_info()

    def reserve(self, height: int) -> None:
        """Keep ``height`` (this part's last start's, with its list) until the list is read, so that the engine
        controls below do not move down when the saved connections' lines come (:meth:`read_list`)."""
        if not self.list_read:
            self.setMinimumHeight(height)

    def read_list(self) -> None:
        """Read the saved list, then watch again what was watched when the panel last closed (once)."""
        if self.list_read:
            return
        self.list_read = True
        self.refresh()
        self.setMinimumHeight(0)
        last = uistate.load().get(UISTATE_KEY)
        if isinstance(last, str) and last in self._names:
            QTimer.singleShot(0, lambda: self.select(last))
        self._show_info()

    def actions_for_menu(self) -> list[QAction]:
        return [self.attach_action, self.next_action, self.own_action]

    # -- the list ------------------------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Read the saved list (a small owner-only file) into the picker and the overview."""
        try:
            conns = C.load_connections()
        except C.ConnectionSetupError as exc:      # a bad list is set aside: said, and a new one starts
            self.note = str(exc)
            try:
                conns = C.load_connections()
            except C.ConnectionSetupError as again:
                self.note, conns = str(again), []
            self._show_info()
        self._show_list(conns)

    def _show_list(self, conns: list[C.Connection]) -> None:
        self._names = [c.name for c in conns]
        self._remote = {c.name: c.remote for c in conns}
        self._conns = {c.name: c for c in conns}
        current = self.ctx.watching
        self.picker.blockSignals(True)
        self.picker.clear()
        self.picker.addItem(OWN, None)
        for c in conns:
            kind = C.KIND_LABELS.get(c.kind or "", "")
            where = f" via {c.ssh_host}" if c.remote else ""
            self.picker.addItem(f"{c.name}" + (f" — {kind}" if kind else "") + where, c.name)
            self.picker.setItemData(self.picker.count() - 1, f"{c.base_url}{where}", Qt.ItemDataRole.ToolTipRole)
        idx = self.picker.findData(current) if current else 0
        self.picker.setCurrentIndex(max(0, idx))
        self.picker.blockSignals(False)
        self.remove_button.setEnabled(bool(current))
        self.overview.set_names(self._names, conns)
        self.overview.poll()

    def names(self) -> list[str]:
        return list(self._names)

    # -- choosing what to watch ------------------------------------------------------------------------------------
    def _picked(self, index: int) -> None:
        self.select(self.picker.itemData(index))

    def select(self, name: str | None) -> None:
        """Watch the saved connection ``name`` (None: this panel's own engine). The connection is resolved on a
        worker; the Monitor and the chat switch when it answers."""
        if name is not None and name not in self._names:
            return
        idx = self.picker.findData(name) if name else 0
        if self.picker.currentIndex() != idx:
            self.picker.blockSignals(True)
            self.picker.setCurrentIndex(max(0, idx))
            self.picker.blockSignals(False)
        self.remove_button.setEnabled(name is not None)
        self.overview.set_watched(name)
        self._save_choice(name)
        self.tasks.cancel("resolve")
        if name is None:
            if self.ctx.watching is not None:
                self.ctx.watch(None)
            return
        self.info.setStyleSheet("color: palette(mid);")
        self.info.setText(f"Connecting to {name}…")
        self.tasks.start("resolve", C.resolve_connection, name,
                         on_done=lambda running: self._resolved(name, running),
                         on_error=lambda exc: self._unreachable(name, exc))

    def select_next(self) -> None:
        order: list[str | None] = [None, *self._names]
        i = order.index(self.ctx.watching) if self.ctx.watching in order else 0
        self.select(order[(i + 1) % len(order)])

    def _resolved(self, name: str, running) -> None:
        self.ctx.watch(running, name, remote=self._remote.get(name, False))
        self.refresh()                       # the detected kind is in the list now

    def _unreachable(self, name: str, exc: BaseException) -> None:
        """Watching ``name``, which does not answer: its own state, said with the reason and when it was last
        seen; nothing of another engine is shown for it (the Monitor and the chat have no engine)."""
        self.ctx.watch(None, name, remote=self._remote.get(name, False))
        self.refresh()                       # its last test (just kept) is in the list now
        conn = self._conns.get(name)
        lt = conn.last_test if conn is not None else None
        seen = (f"Last seen answering at {_when(lt.last_ok)}." if lt is not None and lt.last_ok
                else "Not seen answering since it was saved.")
        self.info.setStyleSheet("color: #a1131c;")
        self.info.setText(f"{C.gui_words(exc)}\n{seen} Choose it again to retry.")

    def _watch_changed(self, name: str | None) -> None:
        self.overview.set_watched(name)
        self._show_info()

    def _show_info(self) -> None:
        name, running = self.ctx.watching, self.ctx.running
        if self.note and name is None:
            self.info.setStyleSheet("color: #a1131c;")
            self.info.setText(self.note)
            return
        if name is None:
            self.info.setStyleSheet("color: palette(mid);")
            self.info.setText("The Monitor and the chat work on the engine this panel starts (below)."
                              if self._names else "Attach to… adds an engine this panel did not start, to watch "
                              "and chat with it.")
        elif running is not None:
            self.info.setStyleSheet("color: palette(mid);")
            sim = " Its figures are simulated." if running.simulated else ""
            conn = self._conns.get(name)
            where = conn.base_url if conn is not None else running.base_url      # not an SSH forward's own URL
            self.info.setText(f"Watching {running.label} at {where}. This panel did not start it: it "
                              f"is never started or stopped from here.{sim}")

    def _save_choice(self, name: str | None) -> None:
        try:
            uistate.save({UISTATE_KEY: name or ""})
        except OSError as exc:
            self.ctx.statusMessage.emit(f"Could not save the watched engine: {exc}", 6000)

    # -- adding and removing -------------------------------------------------------------------------------------
    def add_dialog(self) -> AddConnectionDialog:
        """Open the Add connection dialog (not modal to the event loop); a saved connection is watched at once."""
        dlg = AddConnectionDialog(self.window())
        dlg.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        self.dialog = dlg

        def done(result: int) -> None:
            if result == QDialog.DialogCode.Accepted and dlg.saved is not None:
                self.note = ""
                self.refresh()
                self.select(dlg.saved.name)
            self.dialog = None
        dlg.finished.connect(done)
        dlg.open()
        return dlg

    def ask_remove(self, name: str) -> bool:
        """Whether to forget ``name`` (a question; tests replace this method)."""
        answer = QMessageBox.question(self.window(), "Remove the connection",
                                      f"Forget the connection {name!r} and its key? The engine itself is not "
                                      "touched.")
        return answer == QMessageBox.StandardButton.Yes

    def remove_current(self) -> None:
        name = self.picker.currentData()
        if not name or not self.ask_remove(name):
            return
        if self.ctx.watching == name:
            self.select(None)
        self.remove_button.setEnabled(False)
        self.tasks.start("remove", C.remove_connection, name, on_done=lambda _c: self.refresh(),
                         on_error=lambda exc: self.info.setText(str(exc)))

    def shutdown(self, wait_ms: int = 500) -> None:
        self.overview.shutdown(wait_ms)
        self.tasks.shutdown(wait_ms)
        # the SSH forwards of the connections watched (closed at exit too; closing them here frees their ports now)
        C.close_all_tunnels()
