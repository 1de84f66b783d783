"""The engine log viewer: the size-rotated ``engine.log`` (secrets already masked by the keeper), followed live.

Every line the engine prints while the tab is open carries the time the panel read it (``12:04:31``, at most a
poll interval after the engine wrote it; Times turns them off); the lines of the file read at opening carry no
time but the keeper's own ``[dsv41 keeper <date time>]`` lines. Follow (keeps the newest line in view), search
(Ctrl+F, Enter / Shift+Enter or F3 / Shift+F3 for next / previous, with a match count), copy (selection with
Ctrl+C, or Copy all). Big logs stay cheap: the view holds at most
``MAX_LINES`` lines (``QPlainTextEdit.maximumBlockCount``), new lines arrive in batches from the supervisor
(``ctx.engineLog``), and the initial read of the file's tail happens on a worker thread.
"""

from __future__ import annotations

import re
import time
from collections import deque

from PySide6.QtCore import QEvent, Qt, QTimer
from PySide6.QtGui import (
    QColor, QFont, QFontDatabase, QGuiApplication, QKeySequence, QShortcut, QSyntaxHighlighter, QTextCharFormat,
    QTextCursor, QTextDocument, QTextOption,
)
from PySide6.QtWidgets import (
    QCheckBox, QHBoxLayout, QLabel, QLineEdit, QPlainTextEdit, QPushButton, QSizePolicy, QVBoxLayout, QWidget,
)

from engine_manager.logtail import log_path, read_log_tail

from .panel_base import Panel
from .workers import TaskOwner

MAX_LINES = 20_000
INITIAL_BYTES = 2_000_000
STAMP = re.compile(r"^\d\d:\d\d:\d\d  ")
STAMP_LEN = 10
NO_STAMP = ""                       # a line read from the file at opening: its time is not known


def stamp(t: float | None = None) -> str:
    """The time a line was read, as shown before it: ``HH:MM:SS`` and two spaces."""
    return time.strftime("%H:%M:%S  ", time.localtime(time.time() if t is None else t))


class LogHighlighter(QSyntaxHighlighter):
    """Errors red, the panel's own lines grey-blue, READY green, phases dark blue."""

    RULES = (
        (re.compile(r"error|fatal|traceback|killed|out of memory|refused|segmentation|insufficient", re.I), "#b00020",
         True),
        (re.compile(r"^(?:\d\d:\d\d:\d\d  )?\[dsv41"), "#4a5d7a", False),
        (re.compile(r"\bREADY\b"), "#1b7a2b", True),
        (re.compile(r"^(?:\d\d:\d\d:\d\d  )?\s*phase:", re.I), "#1f4e99", False),
        (re.compile(r"\bwarn(ing)?\b", re.I), "#9a6700", False),
    )

    def __init__(self, doc):
        super().__init__(doc)
        self.formats = []
        self.stamp_format = QTextCharFormat()
        self.stamp_format.setForeground(QColor("#8a8f98"))
        self.stamp_format.setFontWeight(QFont.Weight.Normal)
        for rx, color, bold in self.RULES:
            f = QTextCharFormat()
            f.setForeground(QColor(color))
            if bold:
                f.setFontWeight(QFont.Weight.DemiBold)
            self.formats.append((rx, f))

    def highlightBlock(self, text: str) -> None:  # noqa: N802 - Qt's name
        for rx, fmt in self.formats:
            if rx.search(text):
                self.setFormat(0, len(text), fmt)
                break
        if STAMP.match(text):
            self.setFormat(0, STAMP_LEN, self.stamp_format)


class LogView(Panel, QWidget):
    def __init__(self, ctx, parent=None):
        super().__init__(parent)
        self.ctx = ctx
        self.setObjectName("logView")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)

        bar = QHBoxLayout()
        self.follow = QCheckBox("Follow")
        self.follow.setObjectName("logFollow")
        self.follow.setChecked(True)
        self.follow.setToolTip("Keep the newest line in view")
        self.wrap = QCheckBox("Wrap")
        self.wrap.setObjectName("logWrap")
        self.wrap.setChecked(True)
        self.wrap.setToolTip("Wrap long lines at the window's edge (off: one line per log line, scroll sideways)")
        self.times = QCheckBox("Times")
        self.times.setObjectName("logTimes")
        self.times.setChecked(True)
        self.times.setToolTip("Show the time each line arrived (the lines read from the file at opening have none)")
        self.search = QLineEdit()
        self.search.setObjectName("logSearch")
        self.search.setPlaceholderText("Search the log (Ctrl+F; Enter next, Shift+Enter previous)")
        self.search.setClearButtonEnabled(True)
        self.matches = QLabel("")
        self.matches.setObjectName("logMatches")
        self.matches.setMinimumWidth(90)
        self.prev_btn = QPushButton("◀")
        self.prev_btn.setToolTip("Previous match (Shift+F3)")
        self.next_btn = QPushButton("▶")
        self.next_btn.setToolTip("Next match (F3)")
        for b in (self.prev_btn, self.next_btn):
            b.setFixedWidth(32)
        self.copy_btn = QPushButton("Copy all")
        self.copy_btn.setObjectName("logCopyAll")
        self.copy_btn.setToolTip("Copy every line shown to the clipboard (Ctrl+C copies the selection)")
        self.reload_btn = QPushButton("Reload")
        self.reload_btn.setToolTip("Read the log file again")
        bar.addWidget(self.follow)
        bar.addWidget(self.wrap)
        bar.addWidget(self.times)
        bar.addWidget(self.search, 1)
        bar.addWidget(self.prev_btn)
        bar.addWidget(self.next_btn)
        bar.addWidget(self.matches)
        bar.addWidget(self.copy_btn)
        bar.addWidget(self.reload_btn)
        lay.addLayout(bar)

        self.text = QPlainTextEdit()
        self.text.setObjectName("logText")
        self.text.setReadOnly(True)
        # long lines wrap (the start of every line stays in view); Wrap off gives one row per line
        self.text.setLineWrapMode(QPlainTextEdit.LineWrapMode.WidgetWidth)
        self.text.setWordWrapMode(QTextOption.WrapMode.WrapAtWordBoundaryOrAnywhere)
        self.text.setMaximumBlockCount(MAX_LINES)
        self.text.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.text.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse
                                          | Qt.TextInteractionFlag.TextSelectableByKeyboard)
        self.highlighter = LogHighlighter(self.text.document())
        lay.addWidget(self.text, 1)

        self.path_label = QLabel()
        self.path_label.setObjectName("logPath")
        self.path_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.path_label.setStyleSheet("color: palette(mid);")
        # a long log path wraps (never widens the window past a 1280-pixel screen); whole in the tooltip
        self.path_label.setWordWrap(True)
        self.path_label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        lay.addWidget(self.path_label)

        self.search.returnPressed.connect(self.find_next)
        self.search.textChanged.connect(self._search_changed)
        self.next_btn.clicked.connect(self.find_next)
        self.prev_btn.clicked.connect(self.find_previous)
        self.copy_btn.clicked.connect(self.copy_all)
        self.reload_btn.clicked.connect(self.reload)
        self.follow.toggled.connect(lambda on: on and self._scroll_to_end())
        self.wrap.toggled.connect(self.set_wrap)
        self.times.toggled.connect(lambda _on: self._render_all())
        # the user's own scrolling (wheel, bar, keys on the bar) turns Follow off or, at the end, on again: Qt's
        # moves as lines arrive and the text is laid out trigger no action (taken for the user's, they had turned
        # Follow off while the page was hidden, and as the first lines came into an empty log)
        self.text.verticalScrollBar().actionTriggered.connect(self._user_scrolled)
        # Qt lays long text out a piece at a time after it is appended, so the scroll range keeps growing after the
        # view went to its end: a following view goes with it
        self.text.verticalScrollBar().rangeChanged.connect(self._range_grew)
        self.text.installEventFilter(self)       # keys in the text: they scroll it too
        ctx_sc = Qt.ShortcutContext.WidgetWithChildrenShortcut
        for seq, slot in ((QKeySequence.StandardKey.Find, self.focus_search), ("F3", self.find_next),
                          ("Shift+F3", self.find_previous), ("Shift+Return", self.find_previous)):
            sc = QShortcut(QKeySequence(seq), self)
            sc.setContext(ctx_sc)
            sc.activated.connect(slot)
        ctx.engineLog.connect(self.append_lines)
        self.tasks = TaskOwner(self)        # "tail": the first read of the log file's tail
        self._loading = False
        self._pending: list[tuple[str, str]] = []
        self._entries: deque[tuple[str, str]] = deque(maxlen=MAX_LINES)    # (stamp or NO_STAMP, line)
        self._scroll_when_shown = False      # lines arrived while hidden: follow them once the page shows
        self._count_timer = QTimer(self)
        self._count_timer.setSingleShot(True)
        self._count_timer.setInterval(250)
        self._count_timer.timeout.connect(self._count_matches)
        QTimer.singleShot(0, self.reload)

    # -- content -----------------------------------------------------------------------------------------------
    def reload(self) -> None:
        if self._loading:
            return
        self._loading = True
        self._pending = []
        path = log_path()
        self.path_label.setText(f"{path}  (rotated to {path.name}.1 … by size; the API key is masked)")
        self.path_label.setToolTip(str(path))
        self.tasks.start("tail", read_log_tail, path, INITIAL_BYTES, on_done=self._loaded,
                         on_finished=lambda: setattr(self, "_loading", False))

    def _rendered(self, entries) -> str:
        if self.times.isChecked():
            return "\n".join(s + ln for s, ln in entries)
        return "\n".join(ln for _s, ln in entries)

    def _render_all(self) -> None:
        self.text.setPlainText(self._rendered(self._entries))
        if self.follow.isChecked():
            self._scroll_to_end()

    def _loaded(self, lines: list[str]) -> None:
        pending, self._pending = self._pending, []
        cut = max(0, len(lines) + len(pending) - MAX_LINES)
        self._entries.clear()
        self._entries.extend((NO_STAMP, ln) for ln in lines)
        self._entries.extend(pending)
        self.text.setPlainText(self._rendered(self._entries))
        if not lines:
            self.text.setPlaceholderText("The engine log is empty: it fills once the engine is started.")
        if cut:
            self.path_label.setText(self.path_label.text() + f" — showing the last {MAX_LINES:,} lines")
        self._scroll_to_end()

    def append_lines(self, batch) -> None:
        lines = getattr(batch, "lines", batch)
        if not lines:
            return
        now = stamp()
        entries = [(now, ln) for ln in lines]
        if self._loading:
            self._pending.extend(entries)
            return
        self._entries.extend(entries)
        bar = self.text.verticalScrollBar()
        keep = bar.value()
        self.text.appendPlainText(self._rendered(entries))
        if self.follow.isChecked():
            if self.isVisible():
                self._scroll_to_end()
            else:
                # another page is on screen: going to the end lays the text out, two thirds of an
                # append's cost (0.55 against 0.22 ms for 3 lines with 20,000 kept); done once when the page shows
                self._scroll_when_shown = True
        else:
            bar.setValue(keep)

    def set_wrap(self, on: bool) -> None:
        self.text.setLineWrapMode(QPlainTextEdit.LineWrapMode.WidgetWidth if on
                                  else QPlainTextEdit.LineWrapMode.NoWrap)
        self.text.horizontalScrollBar().setValue(0)
        if self.follow.isChecked():
            self._scroll_to_end()

    def _scroll_to_end(self) -> None:
        """The newest line in view, from its start. The scroll bars are set, the text cursor is left alone: moved
        to the end, Qt scrolled again after laying the text out to show it (sideways at the end of a long line,
        or with the cursor's line at the top after a large append), and that move turned Follow off."""
        bar = self.text.verticalScrollBar()
        bar.setValue(bar.maximum())
        self.text.horizontalScrollBar().setValue(0)

    def showEvent(self, ev) -> None:  # noqa: N802 - Qt's name
        super().showEvent(ev)
        if self._scroll_when_shown:
            self._scroll_when_shown = False
            # after the text has been laid out at its size on screen (its scroll range is set then)
            QTimer.singleShot(0, lambda: self.follow.isChecked() and self._scroll_to_end())

    _keying = False

    def _range_grew(self, _lo: int, hi: int) -> None:
        if self.follow.isChecked() and self.isVisible() and not self._keying:
            self.text.verticalScrollBar().setValue(hi)

    def eventFilter(self, obj, ev) -> bool:  # noqa: N802 - Qt's name
        if obj is self.text:
            following = self.follow.isChecked()
            if ev.type() == QEvent.Type.FocusIn and following and not self.text.textCursor().hasSelection():
                # the keys start from the newest line (the view is there: putting the cursor there scrolls nothing)
                cur = self.text.textCursor()
                cur.movePosition(QTextCursor.MoveOperation.End)
                cur.movePosition(QTextCursor.MoveOperation.StartOfBlock)
                self.text.setTextCursor(cur)
            elif ev.type() == QEvent.Type.KeyPress:
                self._keying = True             # the key moves the text now (Page Up, the arrows, Ctrl+End), and
                try:                            # the text laid out meanwhile does not pull the view back down ...
                    self.text.event(ev)
                finally:
                    self._keying = False
                self._user_scrolled()           # ... where it left the view says whether to follow
                return True
        return super().eventFilter(obj, ev)

    def _user_scrolled(self, action: int | None = None) -> None:
        bar = self.text.verticalScrollBar()
        # where the bar's action takes it (the value changes after the signal), or where a key left it
        at_end = (bar.sliderPosition() if action is not None else bar.value()) >= bar.maximum() - 2
        if self.follow.isChecked() != at_end:
            self.follow.blockSignals(True)
            self.follow.setChecked(at_end)
            self.follow.blockSignals(False)

    def line_count(self) -> int:
        return self.text.blockCount() if self.text.toPlainText() else 0

    # -- search and copy ---------------------------------------------------------------------------------------
    def focus_search(self) -> None:
        self.search.setFocus()
        self.search.selectAll()

    def _search_changed(self, _text: str) -> None:
        self._count_timer.start()

    def _count_matches(self) -> int:
        needle = self.search.text()
        if not needle:
            self.matches.setText("")
            return 0
        doc = self.text.document()
        n = 0
        cur = doc.find(needle, 0)
        while not cur.isNull() and n < 10_000:
            n += 1
            cur = doc.find(needle, cur)
        self.matches.setText(f"{n:,}{'+' if n >= 10_000 else ''} match{'es' if n != 1 else ''}")
        return n

    def _find(self, backward: bool) -> bool:
        needle = self.search.text()
        if not needle:
            return False
        flags = QTextDocument.FindFlag.FindBackward if backward else QTextDocument.FindFlag(0)
        if self.text.find(needle, flags):
            self._follow_off()
            return True
        cur = self.text.textCursor()                          # wrap around
        cur.movePosition(QTextCursor.MoveOperation.End if backward else QTextCursor.MoveOperation.Start)
        self.text.setTextCursor(cur)
        found = self.text.find(needle, flags)
        if found:
            self._follow_off()
        else:
            self.matches.setText("no match")
        return found

    def _follow_off(self) -> None:
        self.follow.blockSignals(True)
        self.follow.setChecked(False)
        self.follow.blockSignals(False)

    def find_next(self) -> bool:
        self._count_matches()
        return self._find(False)

    def find_previous(self) -> bool:
        return self._find(True)

    def copy_all(self) -> None:
        QGuiApplication.clipboard().setText(self.text.toPlainText())
        self.ctx.statusMessage.emit(f"Copied {self.line_count():,} log lines to the clipboard.", 3000)
