"""The chat pane: conversations on top, the selected conversation's transcript, per-request options and the composer.

Everything the pane does goes through :mod:`engine_manager.chat_turn` (``run_turn``: stream one answer and record
it) and :mod:`engine_manager.history` (the SQLite store), always on worker threads (one ``app.workers.TaskOwner``);
the GUI thread only renders. The engine it talks to is the :class:`engine_manager.engine_state.RunningEngine` of
``ctx.engineRunning`` (address, key, whether it is simulated).

Its parts: :mod:`app.chat_render` (Markdown and each conversation's document: how streaming stays cheap),
:mod:`app.chat_conversations` (conversation state and the list), :mod:`app.chat_options` (options form, composer).
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any, Callable

from PySide6.QtCore import Qt, QUrl, Signal
from PySide6.QtGui import QDesktopServices, QFont, QGuiApplication, QKeySequence, QShortcut, QTextCursor
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QSizePolicy,
    QSplitter,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)
from superqt import QElidingLabel

from engine_manager import history as hist
from engine_manager import uistate
from engine_manager.chat import CancelToken, ChatClient, ChatOptions, ContentDelta, ReasoningDelta, check_target
from engine_manager.chat_turn import TurnEnded, TurnStarted, run_turn
from engine_manager.engines import find_engine
from engine_manager.engine_state import RunningEngine

from .chat_conversations import EMPTY_LIST_HINT, ConversationList, ConvState, Stream
from .chat_options import Composer, OptionsForm
from .chat_render import (  # noqa: F401 - MarkdownRenderer, _theme, ConversationDoc: the pane's parts, named here
    RENDER_COST_FACTOR,
    RENDER_MIN_INTERVAL_S,
    SCHEME,
    ConversationDoc,
    LiveMessage,
    MarkdownRenderer,
    _theme,
)
from .panel_base import Panel
from .workers import TaskOwner

__all__ = ["EMPTY_LIST_HINT", "ChatPane", "Composer", "ConversationDoc", "MarkdownRenderer"]


def _restore_ui(store: hist.HistoryStore) -> tuple[dict[str, Any], int | None]:
    """(saved UI state, the conversation to reopen if it still exists) — read on a worker."""
    st = uistate.load()
    cid = st.get("chat_conversation")
    if isinstance(cid, int) and not isinstance(cid, bool):
        try:
            store.get_conversation(cid)
        except hist.HistoryError:
            cid = None
    else:
        cid = None
    return st, cid


class ChatPane(ConversationList, Panel, QWidget):
    """The chat pane. ``ChatPane(ctx, parent=None)``; the window calls :meth:`shutdown` when it closes."""

    conversationsChanged = Signal()
    streamFinished = Signal(int, str)        # conversation id, status

    def __init__(self, ctx, parent=None):
        super().__init__(parent)
        self.ctx = ctx
        self.setObjectName("chatPane")
        self.store: hist.HistoryStore | None = None
        # the engine to talk to: the watched one (the panel's own, or an attached connection)
        self.running: RunningEngine | None = ctx.running
        self.engine_model: str | None = None          # from the engine's /health, sent with each request
        self.engine_state_text: str | None = None
        self._convs: dict[int, ConvState] = {}
        self._streams: list[Stream] = []
        self._current: ConvState | None = None
        self._edit_id: int | None = None
        self._theme = _theme(self.palette())
        self._font = QFont(self.font())
        # benchmark probe: (seconds from the chunk's arrival to its text being in the document, shown on screen)
        self.on_delta_rendered: Callable[[float, bool], None] | None = None
        self._tasks = TaskOwner(self)              # every worker of the pane; dropped after shutdown()
        self._turns = itertools.count(1)

        self._build()
        self._new_draft()
        self._wire()
        self._update_engine_line()
        self._tasks.start("store", hist.HistoryStore, on_done=self._store_ready, on_error=self._store_failed)

    # -- construction --------------------------------------------------------------------------------------
    def _build(self) -> None:
        lay = QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)
        lay.setSpacing(4)

        top = self._build_list()

        # transcript ----------------------------------------------------------------------------------------
        bottom = QWidget()
        bl = QVBoxLayout(bottom)
        bl.setContentsMargins(0, 0, 0, 0)
        bl.setSpacing(4)
        self.title_label = QElidingLabel()           # a long title ends in "…" instead of being cut off
        self.title_label.setObjectName("chatTitle")
        self.title_label.setElideMode(Qt.TextElideMode.ElideRight)
        self.title_label.setTextFormat(Qt.TextFormat.PlainText)
        self.title_label.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        f = self.title_label.font()
        f.setBold(True)
        self.title_label.setFont(f)
        bl.addWidget(self.title_label)
        self.browser = QTextBrowser()
        self.browser.setObjectName("chatTranscript")
        self.browser.setOpenLinks(False)
        self.browser.setOpenExternalLinks(False)
        self.browser.setFrameShape(QFrame.Shape.StyledPanel)
        bl.addWidget(self.browser, 1)
        self.live_label = QLabel()
        self.live_label.setObjectName("chatLive")
        self.live_label.setStyleSheet(f"color: {self._theme['dim']}")
        self.live_label.setWordWrap(True)
        bl.addWidget(self.live_label)

        # options ---------------------------------------------------------------------------------------------
        self.options_form = OptionsForm(self.ctx.settings.default_max_tokens)
        self.options_form.setObjectName("chatOptionsForm")
        f = self.options_form             # its widgets, by the names the pane always had
        self.options_toggle, self.options_box = f.options_toggle, f.options_box
        self.max_tokens, self.temperature, self.effort, self.reproducible, self.system_prompt = \
            f.max_tokens, f.temperature, f.effort, f.reproducible, f.system
        bl.addWidget(self.options_form)

        # edit banner -----------------------------------------------------------------------------------------
        self.edit_banner = QWidget()
        eb = QHBoxLayout(self.edit_banner)
        eb.setContentsMargins(0, 0, 0, 0)
        self.edit_label = QLabel()
        self.edit_label.setWordWrap(True)
        self.edit_label.setStyleSheet(f"color: {self._theme['warn']}")
        eb.addWidget(self.edit_label, 1)
        self.edit_cancel = QPushButton("Cancel edit")
        eb.addWidget(self.edit_cancel)
        self.edit_banner.setVisible(False)
        bl.addWidget(self.edit_banner)

        # composer ----------------------------------------------------------------------------------------------
        self.composer = Composer()
        self.composer.setObjectName("chatComposer")
        self.composer.setPlaceholderText("Message the model — Enter sends, Shift+Enter starts a new line")
        self.composer.setTabChangesFocus(True)
        bl.addWidget(self.composer)

        engine_row = QHBoxLayout()
        self.engine_label = QLabel()
        self.engine_label.setObjectName("chatEngineState")
        self.engine_label.setWordWrap(True)
        self.engine_label.setTextFormat(Qt.TextFormat.PlainText)
        engine_row.addWidget(self.engine_label, 1)
        self.start_button = QPushButton("Start engine")
        self.start_button.setObjectName("chatStartEngine")
        self.start_button.setToolTip("Start the engine (the engine panel does it and shows its progress)")
        engine_row.addWidget(self.start_button, 0, Qt.AlignmentFlag.AlignTop)
        bl.addLayout(engine_row)
        actions = QHBoxLayout()
        actions.addStretch(1)
        self.regen_button = QPushButton("Regenerate")
        self.regen_button.setObjectName("chatRegenerate")
        self.regen_button.setToolTip("Ask again for the last answer (Ctrl+Shift+R)")
        actions.addWidget(self.regen_button)
        self.stop_button = QPushButton("Stop")
        self.stop_button.setObjectName("chatStop")
        self.stop_button.setToolTip("Stop this answer (Esc); what arrived is kept")
        actions.addWidget(self.stop_button)
        self.send_button = QPushButton("Send")
        self.send_button.setObjectName("chatSend")
        self.send_button.setDefault(True)
        self.send_button.setToolTip("Send (Enter)")
        actions.addWidget(self.send_button)
        bl.addLayout(actions)

        self.splitter = QSplitter(Qt.Orientation.Vertical)
        self.splitter.setObjectName("chatSplitter")
        self.splitter.addWidget(top)
        self.splitter.addWidget(bottom)
        self.splitter.setStretchFactor(0, 0)
        self.splitter.setStretchFactor(1, 1)
        self.splitter.setSizes([150, 650])
        self.splitter.setCollapsible(1, False)
        lay.addWidget(self.splitter)

    def _wire(self) -> None:
        self.composer.submitted.connect(self.send)
        self.composer.escape.connect(self._on_escape)
        self.send_button.clicked.connect(lambda: self.send())
        self.stop_button.clicked.connect(lambda: self.stop())
        self.regen_button.clicked.connect(lambda: self.regenerate())
        self.start_button.clicked.connect(self.ctx.requestStart.emit)
        self.edit_cancel.clicked.connect(self.cancel_edit)
        self.browser.anchorClicked.connect(self._on_anchor)
        sb = self.browser.verticalScrollBar()
        sb.valueChanged.connect(self._on_scroll)
        sb.rangeChanged.connect(self._on_range)
        self.composer.textChanged.connect(self._update_buttons)
        self._wire_list()
        self.ctx.engineRunning.connect(self._on_engine_running)
        self.ctx.engineStateChanged.connect(self._on_engine_state)
        self.ctx.settingsChanged.connect(self._on_settings)
        ctx_shortcut = Qt.ShortcutContext.WidgetWithChildrenShortcut
        for seq, slot in (("Ctrl+N", self.new_conversation), ("Ctrl+F", self._focus_search),
                          ("Ctrl+Shift+R", self.regenerate), ("F2", self._rename_current),
                          ("Ctrl+L", self.composer.setFocus)):
            sc = QShortcut(QKeySequence(seq), self)
            sc.setContext(ctx_shortcut)
            sc.activated.connect(slot)

    def _probe_on_screen(self, seconds: float) -> None:
        if self.on_delta_rendered is not None:
            self.on_delta_rendered(seconds, True)

    # -- store --------------------------------------------------------------------------------------------------
    def _store_ready(self, store: hist.HistoryStore) -> None:
        self.store = store
        for n in store.notices:
            self.ctx.statusMessage.emit(n, 15000)
        if store.recovered:
            self.ctx.statusMessage.emit(
                f"Chat history: {store.recovered} answer(s) were cut off when the panel or dsv41 chat stopped; "
                f"they are kept and marked interrupted.", 10000)
        self.reload_list()
        self._update_buttons()
        self._tasks.start("restore", _restore_ui, store, on_done=self._restore, on_error=self._report_error)

    def _restore(self, restored: tuple[dict[str, Any], int | None]) -> None:
        """What the pane looked like when it was last closed: the open conversation, the split, the options."""
        st, cid = restored
        sizes = st.get("chat_splitter")
        if isinstance(sizes, list) and len(sizes) == 2 and all(isinstance(x, int) and x >= 0 for x in sizes):
            self.splitter.setSizes(sizes)
        if st.get("chat_options_open") is True:
            self.options_toggle.setChecked(True)
        fresh = self._current is not None and self._current.id is None and not self._current.messages \
            and self._current.stream is None
        if cid is not None and fresh:
            self.open_conversation(cid)

    def _store_failed(self, exc: BaseException) -> None:
        self.engine_state_text = None
        self.live_label.setText(f"The chat history cannot be opened: {exc}. Chats are not saved until this is "
                                f"fixed (check the data folder's permissions and free space).")
        self._update_buttons()

    # -- conversations --------------------------------------------------------------------------------------
    def _new_draft(self) -> ConvState:
        st = ConvState(None, hist.DEFAULT_TITLE, self._theme, self._font, self._probe_on_screen)
        st.render()
        self._show(st)
        return st

    def new_conversation(self) -> None:
        """Show an empty conversation; it is saved when its first message is sent."""
        if self._current is not None and self._current.id is None and not self._current.stream:
            self.composer.setFocus()
            return
        self.cancel_edit()
        self._new_draft()
        self._select_item(-1)
        self.composer.setFocus()

    def current_conversation_id(self) -> int | None:
        return self._current.id if self._current else None

    def open_conversation(self, cid: int) -> None:
        state = self._convs.get(cid)
        if state is None:
            state = ConvState(cid, "", self._theme, self._font, self._probe_on_screen)
            self._convs[cid] = state
        self._show(state)
        self._select_item(cid)
        if not state.loaded and self.store is not None:
            self._tasks.start(f"load:{cid}", self.store.get_conversation, cid,
                              on_done=lambda conv, s=state: self._loaded(s, conv), on_error=self._report_error)

    def _loaded(self, state: ConvState, conv: hist.Conversation) -> None:
        if state.stream is not None:          # a stream began meanwhile: it brought fresher messages
            return
        state.title = conv.title
        state.options = conv.options or {}
        state.messages = [LiveMessage(m) for m in conv.messages]
        state.loaded = True
        state.render()
        if state is self._current:
            self.options_form.apply(state.options)
            self._show_title()
            self._scroll_to_end()
            self._update_buttons()

    def _show(self, state: ConvState) -> None:
        if self._current is not None and self._current is not state:
            self._current.scroll = self.browser.verticalScrollBar().value()
        self.cancel_edit()
        self._current = state
        self.browser.setDocument(state.view.doc)
        if state.loaded and state.id is not None:
            self.options_form.apply(state.options)
        if state.stream is not None or state.dirty:
            state.render()     # hidden streams were appended raw / finished unseen: draw them properly now
        if state.scroll is not None and not state.follow:
            self.browser.verticalScrollBar().setValue(state.scroll)
        else:
            self._scroll_to_end()
        self._show_title()
        self._update_buttons()
        self._update_live_label()

    def _show_title(self) -> None:
        st = self._current
        if st is None:
            return
        title = st.title if st.id is not None else "New conversation (saved when you send)"
        self.title_label.setText(title)
        self.title_label.setToolTip(title)

    # -- options ----------------------------------------------------------------------------------------------
    def options(self) -> ChatOptions:
        return self.options_form.options()

    def _on_settings(self, loaded) -> None:
        self.options_form.set_default_max_tokens(loaded.settings.default_max_tokens)

    # -- engine -----------------------------------------------------------------------------------------------
    def _on_engine_running(self, running: RunningEngine | None) -> None:
        """``ctx.engineRunning``: the engine is ready (its handle), or it stopped (None)."""
        if running is None:
            self._on_engine_stopped()
        else:
            self._use_engine(running)

    def _use_engine(self, running: RunningEngine) -> None:
        same = (self.running is not None and self.running.base_url == running.base_url
                and self.running.api_key == running.api_key)
        self.running = running
        self.engine_state_text = None
        if not same:                     # another engine (both signals announce the same one: probe it once)
            self.engine_model = None
        if not same and find_engine(running.engine).answers_health:    # an InferenceKey endpoint has none
            def probe():
                with ChatClient.for_engine(running) as c:
                    return c.health(timeout_s=3.0)
            self._tasks.start("health", probe, on_done=self._on_health, on_error=lambda _e: None)
        self._update_engine_line()

    def _on_health(self, data: dict) -> None:
        """The model's name, from the engine's /health (sent with each request, shown in the engine line)."""
        model = data.get("model")
        self.engine_model = str(model) if model else None
        self._update_engine_line()

    def _on_engine_stopped(self) -> None:
        self._tasks.cancel("health")
        self.running = None
        self.engine_model = None
        self.engine_state_text = None
        self._update_engine_line()

    def _on_engine_state(self, ev) -> None:
        state = getattr(ev, "state", None)
        if state is None and isinstance(ev, dict):
            state = ev.get("state")
        state = str(getattr(state, "value", state) or "")
        if self.running is not None and state in ("ready", ""):
            return
        if getattr(self.ctx, "watching", None):
            return                  # the panel's own engine changed state; the attached engine talked to did not
        words = {
            "starting": "The engine is starting; Send becomes available when it is ready (a first start can take "
                        "many minutes).",
            "restarting": "The engine crashed and is being restarted; Send becomes available when it is ready.",
            "stopping": "The engine is stopping.",
            "crashed": "The engine stopped unexpectedly (see the Log tab). Start it again to chat.",
            "stopped": None,
        }
        if state in words:
            self.engine_state_text = words[state]
            if state in ("crashed", "stopped", "stopping"):
                self.running = None
            self._update_engine_line()

    def engine_ready(self) -> bool:
        return self.running is not None

    def _update_engine_line(self) -> None:
        if self.running is not None:
            where = self.running.base_url.replace("http://", "")
            model = f" · {self.engine_model}" if self.engine_model else ""
            sim = " (simulated engine)" if self.running.simulated and "simulated" not in model else ""
            if not getattr(self.ctx, "watching", None):
                self.engine_label.setText(f"Engine ready at {where}{model}{sim}")
            else:                       # an attached connection: its name and kind (label) say which one
                note = find_engine(self.running.engine).chat_note        # InferenceKey: answered whole
                self.engine_label.setText(f"Attached to {self.running.label or where}{model}{sim}"
                                          + (f"\n{note}" if note else ""))
            self.engine_label.setStyleSheet(f"color: {self._theme['dim']}")
            self.start_button.setVisible(False)
        elif getattr(self.ctx, "watching", None):
            self.engine_label.setText(f"The connection {self.ctx.watching!r} cannot be reached now (see the engine "
                                      "column). Choose another engine to watch there; what you type here stays.")
            self.engine_label.setStyleSheet(f"color: {self._theme['warn']}")
            self.start_button.setVisible(False)
        else:
            self.engine_label.setText(self.engine_state_text or
                                      "No engine is running, so nothing can answer yet. Start it; what you type "
                                      "here stays.")
            self.engine_label.setStyleSheet(f"color: {self._theme['warn']}")
            starting = bool(self.engine_state_text and "starting" in self.engine_state_text)
            self.start_button.setVisible(not starting)
        self._update_buttons()

    # -- sending -------------------------------------------------------------------------------------------------
    def _update_buttons(self) -> None:
        st = self._current
        streaming = bool(st and st.stream)
        has_text = bool(self.composer.toPlainText().strip())
        ready = self.engine_ready() and self.store is not None
        self.send_button.setEnabled(ready and has_text and not streaming)
        self.stop_button.setEnabled(streaming)
        has_user = bool(st and any(lm.msg.role == "user" for lm in st.messages))
        self.regen_button.setEnabled(ready and not streaming and has_user and st is not None and st.id is not None)
        if streaming:
            self.send_button.setToolTip("An answer is streaming in this conversation: stop it, or open another "
                                        "conversation to ask something else meanwhile.")
        elif not ready:
            self.send_button.setToolTip("Start the engine first.")
        else:
            self.send_button.setToolTip("Send (Enter)")

    def send(self, text: str | None = None) -> bool:
        """Send ``text`` (or the composer's text) in the current conversation. Returns False (and says why in
        the pane) when it cannot be sent now."""
        st = self._current
        if text is None:
            text = self.composer.toPlainText()
        if not text.strip():
            return False
        if st is None:
            st = self._new_draft()
        if st.stream is not None:
            self.live_label.setText("This conversation is still answering: press Stop (Esc) first, or start a new "
                                    "chat (Ctrl+N).")
            return False
        if not self.engine_ready():
            self.live_label.setText("No engine is ready, so the message was not sent (it is still in the box).")
            return False
        if self.store is None:
            return False
        mode, edit_id = ("edit", self._edit_id) if self._edit_id is not None else ("send", None)
        self._start_turn(st, mode=mode, text=text, edit_id=edit_id)
        self.composer.clear()
        self.cancel_edit()
        return True

    def regenerate(self) -> bool:
        st = self._current
        if st is None or st.id is None or st.stream is not None or not self.engine_ready() or self.store is None:
            return False
        if not any(lm.msg.role == "user" for lm in st.messages):
            return False
        self._start_turn(st, mode="regenerate")
        return True

    def start_edit(self, message_id: int) -> None:
        st = self._current
        if st is None or st.stream is not None:
            return
        idx = next((i for i, lm in enumerate(st.messages) if lm.msg.id == message_id), None)
        if idx is None or st.messages[idx].msg.role != "user":
            return
        after = len(st.messages) - idx - 1
        self._edit_id = message_id
        self.composer.setPlainText(st.messages[idx].content)
        self.composer.moveCursor(QTextCursor.MoveOperation.End)
        self.edit_label.setText("Editing your earlier message: sending replaces it"
                                + (f" and the {after} message(s) after it." if after else "."))
        self.edit_banner.setVisible(True)
        self.composer.setFocus()

    def cancel_edit(self) -> None:
        if self._edit_id is not None:
            self._edit_id = None
            self.edit_banner.setVisible(False)

    def _start_turn(self, st: ConvState, *, mode: str, text: str | None = None, edit_id: int | None = None) -> None:
        token = CancelToken()
        done = threading.Event()
        stream = Stream(st, token, done, mode=mode, text=text, edit_id=edit_id)
        st.stream = stream
        self._streams.append(stream)
        opts = self.options()
        st.options = opts.to_dict()
        # until the worker reports the stored messages, show what was sent
        if mode == "send" and text:
            pending = hist.Message(id=-1, conversation_id=st.id or -1, role="user", content=text,
                                   created_at=time.time())
            st.messages.append(LiveMessage(pending))
            st.render()
            if st is self._current:
                self._scroll_to_end()

        settings = self.ctx.settings

        def turn(**kw):
            try:
                # is the engine at that address the one the panel started? (never send the key to another)
                check_target(settings, kw["engine"].base_url, kw["engine"].api_key)
                yield from run_turn(**kw)
            finally:
                done.set()

        kwargs = dict(store=self.store, conversation_id=st.id, engine=self.running, options=opts, user_text=text,
                      mode=mode, edit_message_id=edit_id, cancel=token, model=self.engine_model)
        stream.worker = self._tasks.start(f"turn:{next(self._turns)}", turn, **kwargs, token=token,
                                          on_event=lambda ev, s=stream: self._on_event(s, ev),
                                          on_error=lambda exc, s=stream: self._on_turn_error(s, exc),
                                          on_finished=lambda s=stream: self._on_turn_finished(s))
        self._list_timer.start()
        self._update_buttons()
        self._update_live_label()

    def stop(self, conversation_id: int | None = None) -> bool:
        """Stop the answer streaming in a conversation (default: the one shown); what arrived is kept."""
        st = self._convs.get(conversation_id) if conversation_id is not None else self._current
        if st is None or st.stream is None:
            return False
        st.stream.token.cancel("stopped")
        return True

    def is_streaming(self, conversation_id: int | None = None) -> bool:
        if conversation_id is None:
            return bool(self._current and self._current.stream)
        st = self._convs.get(conversation_id)
        return bool(st and st.stream)

    def streaming_count(self) -> int:
        return len(self._streams)

    def document_text(self) -> str:
        return self.browser.document().toPlainText()

    def _on_escape(self) -> None:
        if self._edit_id is not None:
            self.cancel_edit()
            self.composer.clear()
        elif self._current is not None and self._current.stream is not None:
            self.stop()

    # -- stream events ----------------------------------------------------------------------------------------
    def _on_event(self, stream: Stream, ev) -> None:
        st = stream.conv
        cls = type(ev)
        if cls is ContentDelta or cls is ReasoningDelta:
            live = stream.live
            if live is None:
                return
            kind = "content" if cls is ContentDelta else "reasoning"
            if live.t_first is None:
                live.t_first = ev.t
            if kind == "content":
                live.content_parts.append(ev.text)
                if live.t_first_content is None:
                    live.t_first_content = ev.t
            else:
                live.reasoning_parts.append(ev.text)
            live.n_chunks += 1
            live.t_last = ev.t
            if st is self._current and st.view.stream_start is not None:
                st.view.append(live, kind, ev.text, ev.t)
                if not st.timer.isActive():
                    gap = max(RENDER_MIN_INTERVAL_S, RENDER_COST_FACTOR * st.view.last_render_s)
                    st.timer.start(int(gap * 1000))
            else:
                # not on screen: the text waits in the model and the conversation is drawn when it is shown
                # (a document that is not shown still lays out every insert, at up to 4.5 ms each)
                st.dirty = True
                if self.on_delta_rendered is not None:
                    self.on_delta_rendered(time.perf_counter() - ev.t, False)
            return
        if cls is TurnStarted:
            self._on_started(stream, ev)
        elif cls is TurnEnded:
            self._on_ended(stream, ev)

    def _on_started(self, stream: Stream, ev: TurnStarted) -> None:
        st = stream.conv
        new = st.id is None
        stream.created = new
        stream.user_id = ev.user_message_id
        st.id = ev.conversation_id
        self._convs[st.id] = st
        st.loaded = True
        st.messages = [LiveMessage(m) for m in ev.messages]
        stream.live = st.messages[-1]
        stream.live.t_sent = stream.t_start
        if not st.tick_connected:
            st.timer.timeout.connect(lambda s=st: self._render_tick(s))
            st.tick_connected = True
        if new:
            first_user = next((lm.msg for lm in st.messages if lm.msg.role == "user"), None)
            st.title = hist.title_from(first_user.content) if first_user else st.title
        if st is self._current:
            st.render()
        else:
            st.dirty = True
        if st is self._current:
            self._show_title()
            self._scroll_to_end()
        self.reload_list(select=self._current.id if self._current else None)
        self._update_buttons()

    def _render_tick(self, st: ConvState) -> None:
        stream = st.stream
        if stream is None or stream.live is None or st is not self._current:
            return
        st.view.rerender_tail(stream.live)

    def _on_ended(self, stream: Stream, ev: TurnEnded) -> None:
        if not ev.saved:
            # refused before an answer began (no engine, 401, 409 …): the history is as it was; so is the pane
            self._not_sent(stream, ev.error or "", stopped=ev.status == hist.STATUS_STOPPED)
            if ev.error_kind in ("unreachable", "unavailable"):
                self.ctx.statusMessage.emit(ev.error or "", 8000)
            self.streamFinished.emit(ev.conversation_id if ev.conversation_id is not None else -1, ev.status)
            return
        live = stream.live
        if live is not None:
            live.content_parts = [ev.content]
            live.reasoning_parts = [ev.reasoning]
            live.msg.status = ev.status
            live.msg.error = ev.error
            live.msg.stats = ev.stats.to_dict()
        self._finish_stream(stream)
        if ev.status == hist.STATUS_ERROR and ev.error_kind in ("unreachable", "unavailable"):
            self.ctx.statusMessage.emit(ev.error or "", 8000)
        self.streamFinished.emit(ev.conversation_id, ev.status)

    def _on_turn_error(self, stream: Stream, exc: BaseException) -> None:
        # refused before anything was sent (not the panel's engine on the port, nothing to regenerate, a history
        # error): undo the optimistic view
        self._not_sent(stream, str(exc))
        self.ctx.statusMessage.emit(f"Chat: {exc}", 8000)

    def _not_sent(self, stream: Stream, why: str, stopped: bool = False) -> None:
        """The turn left nothing in the history: take its question (and, if the engine had accepted the request,
        the conversation it created) back out of the pane and put the text back in the composer."""
        st = stream.conv
        drop = {-1, stream.user_id, stream.live.msg.id if stream.live is not None else None} - {None}
        if stream.mode != "send":
            drop = {-1}
        st.messages = [lm for lm in st.messages if lm.msg.id not in drop]
        stream.live = None
        if stream.created and st.id is not None:          # the conversation it created was deleted again
            self._convs.pop(st.id, None)
            st.id = None
            st.title = hist.DEFAULT_TITLE
            st.messages = []
        self._finish_stream(stream)
        if st.id is None:
            self.reload_list()
        back = False
        if stream.mode in ("send", "edit") and stream.text and not self.composer.toPlainText().strip() \
                and st is self._current:
            if stream.mode == "edit" and stream.edit_id is not None:
                self.start_edit(stream.edit_id)
            self.composer.setPlainText(stream.text)
            self.composer.moveCursor(QTextCursor.MoveOperation.End)
            back = True
        again = " Your message is back in the box: press Enter to send it again." if back else ""
        if stopped:
            self.live_label.setText(f"Not sent: stopped before the engine answered.{again}")
        else:
            self.live_label.setText(f"Not sent: {why.rstrip()}{again}")
        self._show_title()

    def _finish_stream(self, stream: Stream) -> None:
        st = stream.conv
        if stream in self._streams:
            self._streams.remove(stream)
        if st.stream is stream:
            st.stream = None
        st.timer.stop()
        if st is self._current:
            st.render()
            self._scroll_if_following()
        else:
            st.dirty = True        # drawn as Markdown when shown: finishing streams never stall the others
        if st.id is not None:
            item = self._item_for(st.id)
            if item is not None:          # drop the streaming mark now; the reload below refreshes the rest
                last = st.messages[-1].msg.status if st.messages else None
                self._label_item(item, st.title, status=last)
            self.reload_list(select=self._current.id if self._current else None)
        self._update_buttons()
        self._update_live_label()

    def _on_turn_finished(self, stream: Stream) -> None:
        if stream in self._streams:      # ended without TurnEnded (should not happen): still release the UI
            self._finish_stream(stream)

    def _update_live_label(self) -> None:
        st = self._current
        others = [s for s in self._streams if s.conv is not st]
        text = ""
        if st is not None and st.stream is not None:
            live = st.stream.live
            if live is None or live.t_first is None:
                text = "Waiting for the engine to start answering…"
            else:
                n = live.n_chunks
                tok_s = live.live_tok_s()
                ttft = live.t_first - live.t_sent if live.t_sent else None
                text = f"Streaming: {n} tokens" + (f" · {tok_s:.1f} tok/s" if tok_s else "") + \
                       (f" · first token {ttft:.2f} s" if ttft is not None and ttft >= 0 else "") + " · Esc stops"
        if others:
            text += ("  ·  " if text else "") + f"{len(others)} other conversation(s) streaming"
        if text or self._streams or not self.live_label.text().startswith(("Not sent", "No engine", "This conv")):
            self.live_label.setText(text)

    # -- links in the transcript ---------------------------------------------------------------------------------
    def _on_anchor(self, url: QUrl) -> None:
        if url.scheme() != SCHEME:
            if url.scheme() in ("http", "https", "mailto"):
                QDesktopServices.openUrl(url)
            return
        action, _, arg = url.path().partition("/")
        st = self._current
        if st is None:
            return
        if action == "copy-code":
            try:
                QGuiApplication.clipboard().setText(st.view.codes[int(arg)])
                self.ctx.statusMessage.emit("Code copied to the clipboard.", 2500)
            except (ValueError, IndexError):
                pass
        elif action == "copy-message":
            lm = next((x for x in st.messages if str(x.msg.id) == arg), None)
            if lm is not None:
                QGuiApplication.clipboard().setText(lm.content)
                self.ctx.statusMessage.emit("Message copied to the clipboard.", 2500)
        elif action == "toggle-reasoning":
            mid = int(arg)
            if mid in st.view.expanded:
                st.view.expanded.discard(mid)
            else:
                st.view.expanded.add(mid)
            value = self.browser.verticalScrollBar().value()
            st.render()
            self.browser.verticalScrollBar().setValue(value)
        elif action == "edit":
            self.start_edit(int(arg))
        elif action == "regenerate":
            self.regenerate()

    # -- scrolling ------------------------------------------------------------------------------------------------
    def _on_scroll(self, value: int) -> None:
        if self._current is not None:
            sb = self.browser.verticalScrollBar()
            self._current.follow = value >= sb.maximum() - 8

    def _on_range(self, _lo: int, hi: int) -> None:
        if self._current is not None and self._current.follow:
            self.browser.verticalScrollBar().setValue(hi)

    def _scroll_to_end(self) -> None:
        if self._current is not None:
            self._current.follow = True
        sb = self.browser.verticalScrollBar()
        sb.setValue(sb.maximum())

    def _scroll_if_following(self) -> None:
        if self._current is not None and self._current.follow:
            self._scroll_to_end()

    # -- errors and shutdown -------------------------------------------------------------------------------------
    def _report_error(self, exc: BaseException) -> None:
        self.ctx.statusMessage.emit(f"Chat history: {exc}", 8000)

    def shutdown(self, wait_ms: int = 3000) -> None:
        """Stop every stream (their answers are saved and marked interrupted) and wait briefly for the writes."""
        if self._tasks.shut_down:
            return
        streams = list(self._streams)
        for s in streams:
            s.token.cancel("shutdown")
        deadline = time.monotonic() + wait_ms / 1000.0
        for s in streams:
            s.done.wait(max(0.0, deadline - time.monotonic()))
        for s in streams:
            if not s.done.is_set() and s.live is not None and self.store is not None:
                try:
                    self.store.mark_interrupted(s.live.msg.id, "The panel was closed while the answer streamed.")
                except Exception:  # noqa: BLE001 - closing must not fail; recovery marks it on the next start
                    pass
        # every other task is asked to quit and its late results are dropped; the streams were waited for above
        self._tasks.shutdown(wait_ms=0)
        self._list_timer.stop()
        try:
            uistate.save({"chat_conversation": self.current_conversation_id(),
                          "chat_splitter": [int(x) for x in self.splitter.sizes()],
                          "chat_options_open": self.options_toggle.isChecked()})
        except OSError:
            pass

