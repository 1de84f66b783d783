"""The chat pane's conversations: the state of each open conversation (:class:`ConvState`, with the answer it
streams, :class:`Stream`) and the conversation list above the transcript (:class:`ConversationList`: search,
rename, delete, export, the streaming mark).

:class:`ConversationList` is a part of :class:`app.chat_pane.ChatPane` (a mixin): it reads the pane's ``store``,
``_convs``, ``_current``, ``_streams`` and ``_tasks`` and calls its ``open_conversation`` / ``_new_draft``; every
store call runs on a worker through the pane's ``TaskOwner``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QFont, QPalette
from PySide6.QtWidgets import (
    QAbstractItemView,
    QFileDialog,
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QMessageBox,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from engine_manager import history as hist
from engine_manager.chat import CancelToken

from .chat_render import ConversationDoc, LiveMessage

EMPTY_LIST_HINT = "No conversations yet.\nAsk something below; it is kept here."


@dataclass
class Stream:
    """One answer being streamed into a conversation."""

    conv: "ConvState"
    token: CancelToken
    done: threading.Event
    live: LiveMessage | None = None
    worker: Any = None
    mode: str = "send"
    text: str | None = None
    edit_id: int | None = None
    user_id: int | None = None               # the question as stored, once the engine accepted the request
    created: bool = False                    # this turn created the conversation
    t_start: float = field(default_factory=time.perf_counter)


class ConvState:
    def __init__(self, cid: int | None, title: str, theme: dict[str, str], font: QFont,
                 probe: Callable[[float], None] | None = None):
        self.id = cid
        self.title = title
        self.messages: list[LiveMessage] = []
        self.view = ConversationDoc(theme, font)
        self.view.probe = probe
        self.options: dict[str, Any] = {}
        self.stream: Stream | None = None
        self.loaded = cid is None
        self.scroll: int | None = None
        self.follow = True
        self.timer = QTimer()
        self.timer.setSingleShot(True)
        self.tick_connected = False
        self.dirty = False

    def live_ids(self) -> int | None:
        return self.stream.live.msg.id if self.stream and self.stream.live else None

    def render(self) -> None:
        self.dirty = False
        self.view.render_all(self.messages, self.live_ids())


class ConversationList:
    """The conversation list of the chat pane (see the module docstring)."""

    def _build_list(self) -> QWidget:
        # conversation list -----------------------------------------------------------------------------------
        top = QWidget()
        tl = QVBoxLayout(top)
        tl.setContentsMargins(0, 0, 0, 0)
        tl.setSpacing(3)
        row = QHBoxLayout()
        title = QLabel("<b>Chat</b>")
        row.addWidget(title)
        self.search_edit = QLineEdit()
        self.search_edit.setObjectName("chatSearch")
        self.search_edit.setPlaceholderText("Search conversations (Ctrl+F)")
        self.search_edit.setClearButtonEnabled(True)
        row.addWidget(self.search_edit, 1)
        self.new_button = QPushButton("New chat")
        self.new_button.setObjectName("chatNew")
        self.new_button.setToolTip("Start a new conversation (Ctrl+N)")
        row.addWidget(self.new_button)
        tl.addLayout(row)
        self.conv_list = QListWidget()
        self.conv_list.setObjectName("chatConversations")
        self.conv_list.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.conv_list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.conv_list.setUniformItemSizes(True)
        self.conv_list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.conv_list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.conv_list.setMinimumHeight(60)
        tl.addWidget(self.conv_list, 1)
        self._list_timer = QTimer(self)
        self._list_timer.setInterval(500)
        self._search_timer = QTimer(self)
        self._search_timer.setSingleShot(True)
        self._search_timer.setInterval(250)
        self._reload_timer = QTimer(self)
        self._reload_timer.setSingleShot(True)
        self._reload_timer.setInterval(150)
        self._reload_select: int | None = None
        return top

    def _wire_list(self) -> None:
        self.new_button.clicked.connect(self.new_conversation)
        self.conv_list.currentItemChanged.connect(self._on_item_changed)
        self.conv_list.customContextMenuRequested.connect(self._list_menu)
        self.conv_list.itemChanged.connect(self._on_item_renamed)
        self._list_timer.timeout.connect(self._refresh_streaming_items)
        self._search_timer.timeout.connect(self._run_search)
        self._reload_timer.timeout.connect(self._reload_now)
        self.search_edit.textChanged.connect(lambda _t: self._search_timer.start())

    def reload_list(self, select: int | None = None) -> None:
        """Refresh the conversation list from the store (coalesced: many calls in 150 ms make one read)."""
        if select is not None:
            self._reload_select = select
        self._reload_timer.start()

    def _reload_now(self) -> None:
        if self.store is None:
            return
        select, self._reload_select = self._reload_select, None
        self._tasks.start("list", self.store.list_conversations,
                          on_done=lambda convs, s=select: self._fill_list(convs, s), on_error=self._report_error)

    def _fill_list(self, convs: list[hist.ConversationInfo], select: int | None = None) -> None:
        if self.search_edit.text().strip():
            return                        # a search result is shown; it refreshes on its own
        keep = select if select is not None else (self._current.id if self._current else None)
        self.conv_list.blockSignals(True)
        self.conv_list.clear()
        for c in convs:
            state = self._convs.get(c.id)
            if state is not None:
                state.title = c.title
            self.conv_list.addItem(self._make_item(c.id, c.title, c.updated_at, c.message_count, c.last_status))
        if not convs:
            self.conv_list.addItem(self._hint_item(EMPTY_LIST_HINT))
        self.conv_list.blockSignals(False)
        if keep is not None:
            self._select_item(keep)
        self.conversationsChanged.emit()

    def _hint_item(self, text: str) -> QListWidgetItem:
        """A grey line in the list that cannot be selected (an empty list says what will appear there)."""
        item = QListWidgetItem(text)
        item.setFlags(Qt.ItemFlag.NoItemFlags)
        item.setForeground(self.palette().color(QPalette.ColorGroup.Disabled, QPalette.ColorRole.Text))
        item.setToolTip(text)
        return item

    def _make_item(self, cid: int, title: str, updated: float, count: int, status: str | None) -> QListWidgetItem:
        item = QListWidgetItem()
        item.setData(Qt.ItemDataRole.UserRole, cid)
        item.setData(Qt.ItemDataRole.UserRole + 1, title)
        item.setFlags(item.flags() | Qt.ItemFlag.ItemIsEditable)
        self._label_item(item, title, updated, count, status)
        return item

    def _label_item(self, item: QListWidgetItem, title: str, updated: float | None = None, count: int | None = None,
                    status: str | None = None) -> None:
        cid = item.data(Qt.ItemDataRole.UserRole)
        state = self._convs.get(cid)
        prefix = ""
        tip = title
        if state is not None and state.stream is not None:
            tok_s = state.stream.live.live_tok_s() if state.stream.live else None
            prefix = "● "
            tip += "\nstreaming" + (f" · {tok_s:.1f} tok/s" if tok_s else "")
        elif status in (hist.STATUS_INTERRUPTED, hist.STATUS_ERROR):
            prefix = "⚠ "
            tip += f"\nlast answer: {status}"
        if updated is not None:
            tip += f"\n{time.strftime('%Y-%m-%d %H:%M', time.localtime(updated))}"
        if count is not None:
            tip += f" · {count} messages"
        self.conv_list.blockSignals(True)
        item.setText(prefix + title)
        item.setToolTip(tip)
        self.conv_list.blockSignals(False)

    def _select_item(self, cid: int) -> None:
        for i in range(self.conv_list.count()):
            it = self.conv_list.item(i)
            if it.data(Qt.ItemDataRole.UserRole) == cid:
                self.conv_list.blockSignals(True)
                self.conv_list.setCurrentItem(it)
                self.conv_list.blockSignals(False)
                return
        self.conv_list.blockSignals(True)
        self.conv_list.clearSelection()
        self.conv_list.setCurrentItem(None)
        self.conv_list.blockSignals(False)

    def _item_for(self, cid: int) -> QListWidgetItem | None:
        for i in range(self.conv_list.count()):
            it = self.conv_list.item(i)
            if it.data(Qt.ItemDataRole.UserRole) == cid:
                return it
        return None

    def _refresh_streaming_items(self) -> None:
        any_live = False
        for st in list(self._streams):
            if st.conv.id is None:
                continue
            any_live = True
            it = self._item_for(st.conv.id)
            if it is not None:
                self._label_item(it, st.conv.title)
        self._update_live_label()
        if not any_live and not self._streams:
            self._list_timer.stop()

    def _run_search(self) -> None:
        text = self.search_edit.text().strip()
        if self.store is None:
            return
        if not text:
            self.reload_list()
            return
        self._tasks.start("search", self.store.search, text, on_done=lambda hits, t=text: self._show_hits(t, hits),
                          on_error=self._report_error)

    def _show_hits(self, text: str, hits: list[hist.SearchHit]) -> None:
        if self.search_edit.text().strip() != text:
            return
        self.conv_list.blockSignals(True)
        self.conv_list.clear()
        for h in hits:
            item = QListWidgetItem(f"{h.title}\n   {h.snippet}")
            item.setData(Qt.ItemDataRole.UserRole, h.conversation_id)
            item.setData(Qt.ItemDataRole.UserRole + 1, h.title)
            item.setToolTip(h.snippet)
            self.conv_list.addItem(item)
        if not hits:
            self.conv_list.addItem(self._hint_item(f"Nothing contains “{text}”."))
        self.conv_list.blockSignals(False)

    def _on_item_changed(self, item: QListWidgetItem | None, _prev) -> None:
        if item is None:
            return
        cid = item.data(Qt.ItemDataRole.UserRole)
        if isinstance(cid, int) and (self._current is None or self._current.id != cid):
            self.open_conversation(cid)

    def _on_item_renamed(self, item: QListWidgetItem) -> None:
        cid = item.data(Qt.ItemDataRole.UserRole)
        old = item.data(Qt.ItemDataRole.UserRole + 1)
        new = item.text().lstrip("●⚠ ").strip()
        if not isinstance(cid, int) or not new or new == old:
            return
        self.rename_conversation(cid, new)

    def rename_conversation(self, cid: int, title: str) -> None:
        if self.store is None:
            return
        title = title.strip()

        def done(_r=None):
            st = self._convs.get(cid)
            if st is not None:
                st.title = title
            self._show_title()
            self.reload_list()
        self._tasks.start(f"rename:{cid}", self.store.rename, cid, title, on_done=done, on_error=self._report_error)

    def delete_conversation(self, cid: int, confirm: bool = True) -> None:
        if self.store is None:
            return
        st = self._convs.get(cid)
        if st is not None and st.stream is not None:
            self.ctx.statusMessage.emit("That conversation is still streaming an answer: stop it first.", 5000)
            return
        if confirm:
            title = st.title if st else cid
            if QMessageBox.question(self, "Delete conversation", f"Delete “{title}” and all its messages? "
                                    f"This cannot be undone.") != QMessageBox.StandardButton.Yes:
                return

        def done(_r=None):
            self._convs.pop(cid, None)
            if self._current is not None and self._current.id == cid:
                self._new_draft()
            self.reload_list()
        self._tasks.start(f"delete:{cid}", self.store.delete, cid, on_done=done, on_error=self._report_error)

    def export_conversation(self, cid: int, path: str | Path, fmt: str = "md") -> None:
        """Export to ``path`` as Markdown (``md``) or JSON (``json``), atomically, on a worker."""
        if self.store is None:
            return
        store = self.store

        def work():
            import json as _json

            from engine_manager.atomic import atomic_write_text
            text = (store.export_markdown(cid) if fmt == "md" else
                    _json.dumps(store.export_json(cid), indent=2, ensure_ascii=False, default=str) + "\n")
            atomic_write_text(Path(path), text)
            return str(path)
        self._tasks.start(f"export:{path}", work,
                          on_done=lambda p: self.ctx.statusMessage.emit(f"Conversation exported to {p}", 6000),
                          on_error=self._report_error)

    def _list_menu(self, pos) -> None:
        item = self.conv_list.itemAt(pos)
        if item is None or not isinstance(item.data(Qt.ItemDataRole.UserRole), int):
            return
        cid = item.data(Qt.ItemDataRole.UserRole)
        menu = QMenu(self)
        menu.addAction("Rename…", lambda: self.conv_list.editItem(item) if not self.search_edit.text() else
                       self._rename_dialog(cid))
        menu.addAction("Export as Markdown…", lambda: self._export_dialog(cid, "md"))
        menu.addAction("Export as JSON…", lambda: self._export_dialog(cid, "json"))
        menu.addSeparator()
        menu.addAction("Delete…", lambda: self.delete_conversation(cid))
        menu.exec(self.conv_list.viewport().mapToGlobal(pos))

    def _rename_current(self) -> None:
        if self._current is not None and self._current.id is not None:
            self._rename_dialog(self._current.id)

    def _rename_dialog(self, cid: int) -> None:
        st = self._convs.get(cid)
        text, ok = QInputDialog.getText(self, "Rename conversation", "Title:", text=st.title if st else "")
        if ok and text.strip():
            self.rename_conversation(cid, text)

    def _export_dialog(self, cid: int, fmt: str) -> None:
        st = self._convs.get(cid)
        base = "".join(ch if ch.isalnum() or ch in " -_" else "_" for ch in (st.title if st else f"chat-{cid}"))
        suffix = ".md" if fmt == "md" else ".json"
        path, _f = QFileDialog.getSaveFileName(self, "Export conversation", str(Path.home() / (base.strip() + suffix)),
                                               "Markdown (*.md)" if fmt == "md" else "JSON (*.json)")
        if path:
            self.export_conversation(cid, path, fmt)

    def _focus_search(self) -> None:
        self.search_edit.setFocus()
        self.search_edit.selectAll()
