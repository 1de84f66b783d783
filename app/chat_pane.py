"""The chat pane: conversations on top, the selected conversation's transcript, per-request options and the composer.

Everything the pane does goes through :mod:`engine_manager.chat` (``run_turn``: stream one answer and record it) and
:mod:`engine_manager.history` (the SQLite store), always on worker threads (``app.workers``); the GUI thread only
renders.

Rendering stays cheap with many answers streaming at once: every conversation has its own ``QTextDocument``; a chunk
is appended to the end of its document with one ``QTextCursor.insertText`` (no re-render), and only the streaming
message of the conversation on screen is re-rendered as Markdown, throttled (at most every 0.3 s, and never more
often than 20 times what the last render cost). Hidden conversations are rendered as Markdown when they finish or
when shown. ``benchmarks/chat_latency.py`` measures chunk arrival → text in the document with 8 streams.
"""

from __future__ import annotations

import html
import inspect
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import shiboken6
from markdown_it import MarkdownIt
from PySide6.QtCore import Qt, QTimer, QUrl, Signal
from PySide6.QtGui import (
    QDesktopServices,
    QFont,
    QGuiApplication,
    QKeySequence,
    QPalette,
    QShortcut,
    QTextCursor,
    QTextDocument,
)
from PySide6.QtWidgets import (
    QAbstractItemView,
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFileDialog,
    QFrame,
    QGridLayout,
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QMessageBox,
    QPlainTextEdit,
    QPushButton,
    QSizePolicy,
    QSpinBox,
    QSplitter,
    QTextBrowser,
    QToolButton,
    QVBoxLayout,
    QWidget,
)
from superqt import QElidingLabel

from engine_manager import history as hist
from engine_manager import uistate
from engine_manager.chat import (
    MIN_RATE_SPAN_S,
    REASONING_EFFORTS,
    CancelToken,
    ChatClient,
    ChatOptions,
    ContentDelta,
    ReasoningDelta,
    StreamStats,
    TurnEnded,
    TurnStarted,
    check_target,
    run_turn,
)

from .workers import run_function, run_generator

EMPTY_LIST_HINT = "No conversations yet.\nAsk something below; it is kept here."
RENDER_MIN_INTERVAL_S = 0.3        # the streaming message's Markdown re-render, at most this often …
RENDER_COST_FACTOR = 20.0          # … and never more often than 20× its own last cost
SCHEME = "dsv41"


# ------------------------------------------------------------------------------------------------ markdown → Qt
def _theme(palette: QPalette) -> dict[str, str]:
    dark = palette.color(QPalette.ColorRole.Base).lightness() < 128
    if dark:
        return {"dim": "#9aa0a6", "code_bg": "#1f2327", "code_border": "#3c4043", "user_bg": "#243447",
                "link": "#8ab4f8", "warn": "#fdd663", "err": "#f28b82", "role": "#e8eaed", "reason_bg": "#26292d"}
    return {"dim": "#6a737d", "code_bg": "#f6f8fa", "code_border": "#d0d7de", "user_bg": "#eef3fb",
            "link": "#0b57d0", "warn": "#8a5a00", "err": "#b3261e", "role": "#202124", "reason_bg": "#f5f5f5"}


class MarkdownRenderer:
    """markdown-it-py (CommonMark + tables + strikethrough, raw HTML off) → the HTML subset QTextDocument renders.
    Code blocks become a boxed table with a Copy link; the code text is kept in ``codes`` for the link."""

    def __init__(self, theme: dict[str, str]):
        self.theme = theme
        self.md = MarkdownIt("commonmark", {"html": False, "linkify": False, "typographer": False})
        self.md.enable(["table", "strikethrough"])
        # markdown-it binds a rule to its renderer (the first argument), so the rules are closures over self
        self.md.add_render_rule("fence", lambda _r, *a: self._code(*a))
        self.md.add_render_rule("code_block", lambda _r, *a: self._code(*a))
        self.md.add_render_rule("image", lambda _r, *a: self._image(*a))
        self.md.add_render_rule("table_open", lambda *_a: '<table border="1" cellspacing="0" cellpadding="4" '
                                f'style="border-color:{self.theme["code_border"]}; border-collapse:collapse">')

    def _code(self, tokens, idx, _options, env) -> str:
        tok = tokens[idx]
        codes: list[str] = env["codes"]
        codes.append(tok.content)
        key = len(codes) - 1 + env.get("base", 0)
        lang = html.escape((tok.info or "").strip().split(" ")[0]) if tok.type == "fence" else ""
        t = self.theme
        code = html.escape(tok.content.rstrip("\n"))
        return (f'<table width="100%" cellspacing="0" cellpadding="6" style="background-color:{t["code_bg"]}; '
                f'border: 1px solid {t["code_border"]}; margin-top:4px; margin-bottom:4px">'
                f'<tr><td><span style="color:{t["dim"]}">{lang or "code"}</span>&nbsp;&nbsp;'
                f'<a href="{SCHEME}:copy-code/{key}">Copy code</a></td></tr>'
                f'<tr><td><pre style="font-family:monospace; margin:0; white-space:pre-wrap">{code}</pre></td></tr>'
                f'</table>\n')

    def _image(self, tokens, idx, _options, _env) -> str:
        # Never load an image the model names (it could be any local file): show it as a link.
        tok = tokens[idx]
        src = html.escape(tok.attrGet("src") or "")
        alt = html.escape(tok.content or "image")
        return f'<a href="{src}">[image: {alt}]</a>'

    def render(self, text: str, codes: list[str], base: int = 0) -> str:
        return self.md.render(text, {"codes": codes, "base": base})


def _plain_html(text: str, color: str | None = None, italic: bool = False) -> str:
    style = "white-space:pre-wrap; margin-top:2px; margin-bottom:2px"
    if color:
        style += f"; color:{color}"
    if italic:
        style += "; font-style:italic"
    return f'<p style="{style}">{html.escape(text)}</p>'


def _clock(t: float) -> str:
    return time.strftime("%H:%M", time.localtime(t)) if t else ""


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


# ------------------------------------------------------------------------------------------------ conversation state
@dataclass
class LiveMessage:
    """A message as the pane holds it; the streaming one accumulates its text in lists (no quadratic concat)."""

    msg: hist.Message
    content_parts: list[str] = field(default_factory=list)
    reasoning_parts: list[str] = field(default_factory=list)
    t_first: float | None = None
    t_first_content: float | None = None
    t_sent: float = 0.0
    n_chunks: int = 0
    t_last: float | None = None

    @property
    def content(self) -> str:
        if self.content_parts:
            self.msg.content = "".join(self.content_parts)
            self.content_parts = [self.msg.content]
        return self.msg.content

    @property
    def reasoning(self) -> str:
        if self.reasoning_parts:
            self.msg.reasoning = "".join(self.reasoning_parts)
            self.reasoning_parts = [self.msg.reasoning]
        return self.msg.reasoning

    def live_tok_s(self) -> float | None:
        if (self.n_chunks >= 2 and self.t_first is not None and self.t_last
                and self.t_last - self.t_first >= MIN_RATE_SPAN_S):
            return (self.n_chunks - 1) / (self.t_last - self.t_first)
        return None


class ConversationDoc:
    """One conversation's ``QTextDocument`` and how its messages are drawn into it."""

    def __init__(self, theme: dict[str, str], font: QFont):
        self.doc = QTextDocument()
        self.doc.setUndoRedoEnabled(False)
        self.doc.setDefaultFont(font)
        self.doc.setDocumentMargin(8)
        self.theme = theme
        self.renderer = MarkdownRenderer(theme)
        self.codes: list[str] = []
        self.stream_start: int | None = None     # where the streaming message's part of the document begins
        self.stream_phase: str | None = None     # "reasoning" or "content": what raw appends are adding to
        self._cursor: QTextCursor | None = None
        self.last_render_s = 0.0
        self.last_render_at = 0.0
        self.expanded: set[int] = set()          # message ids whose reasoning is shown
        self.tail_renders = 0                    # how often the streaming message was re-rendered (benchmark)
        self.tail_render_s = 0.0
        self._pending: list[tuple[str, float]] = []   # (chunk, arrival) appended to the model, not yet drawn
        self._flush_queued = False
        self.probe: Callable[[float], None] | None = None

    # -- HTML of one message ----------------------------------------------------------------------------
    def message_html(self, lm: LiveMessage, *, streaming: bool, last_answer: bool, can_act: bool) -> str:
        m, t = lm.msg, self.theme
        out: list[str] = []
        if m.role == "user":
            edit = f' &nbsp; <a href="{SCHEME}:edit/{m.id}">Edit</a>' if can_act else ""
            out.append(f'<p style="margin-top:14px; margin-bottom:2px"><b style="color:{t["role"]}">You</b>'
                       f' &nbsp;<span style="color:{t["dim"]}">{_clock(m.created_at)}</span>{edit}'
                       f' &nbsp; <a href="{SCHEME}:copy-message/{m.id}">Copy</a></p>')
            out.append(f'<table width="100%" cellpadding="6" cellspacing="0" style="background-color:{t["user_bg"]}">'
                       f'<tr><td>{_plain_html(lm.content)}</td></tr></table>')
            return "\n".join(out)
        model = f' · {html.escape(m.model)}' if m.model else ""
        out.append(f'<p style="margin-top:14px; margin-bottom:2px"><b style="color:{t["role"]}">Assistant</b>'
                   f'<span style="color:{t["dim"]}"> &nbsp;{_clock(m.created_at)}{model}</span></p>')
        reasoning = lm.reasoning
        content = lm.content
        if reasoning:
            thinking_now = streaming and not content
            shown = thinking_now or m.id in self.expanded
            if thinking_now:
                label = "Reasoning…"
            else:
                span = ""
                if lm.t_first is not None and lm.t_first_content is not None:
                    span = f" · thought for {lm.t_first_content - lm.t_first:.1f} s"
                elif (m.stats or {}).get("first_content_s") is not None and (m.stats or {}).get("ttft_s") is not None:
                    span = f" · thought for {m.stats['first_content_s'] - m.stats['ttft_s']:.1f} s"
                label = f"{'▾' if shown else '▸'} Reasoning ({len(reasoning.split())} words{span})"
            if thinking_now:
                out.append(f'<p style="margin-top:2px; margin-bottom:0px; color:{t["dim"]}"><i>{label}</i></p>')
            else:
                out.append(f'<p style="margin-top:2px; margin-bottom:0px"><a href="{SCHEME}:toggle-reasoning/{m.id}">'
                           f'{label}</a></p>')
            if shown:
                out.append(_plain_html(reasoning, color=t["dim"], italic=True))
        if content:
            out.append(self.renderer.render(content, self.codes))
        elif not streaming and not reasoning and m.status == hist.STATUS_COMPLETE:
            out.append(_plain_html("(empty answer)", color=t["dim"]))
        if not streaming:
            out.append(self._footer(lm, last_answer, can_act))
        return "\n".join(out)

    def _footer(self, lm: LiveMessage, last_answer: bool, can_act: bool) -> str:
        m, t = lm.msg, self.theme
        bits: list[str] = []
        stats = StreamStats.from_dict(m.stats) if m.stats else None
        if stats and (stats.tokens or stats.ttft_s is not None):
            bits.append(html.escape(stats.summary()))
        if stats and stats.finish_reason == "length":
            mt = (m.options or {}).get("max_tokens")
            bits.append(f'<span style="color:{t["warn"]}">cut at max tokens{f" ({mt})" if mt else ""}: raise it '
                        f'in Options for a longer answer</span>')
        status = ""
        if m.status == hist.STATUS_STOPPED:
            status = f'<span style="color:{t["warn"]}">■ Stopped by you</span>'
        elif m.status == hist.STATUS_INTERRUPTED:
            status = f'<span style="color:{t["warn"]}">⚠ Interrupted: {html.escape(m.error or "")}</span>'
        elif m.status == hist.STATUS_ERROR:
            status = f'<span style="color:{t["err"]}">✖ {html.escape(m.error or "The request failed.")}</span>'
        elif m.status == hist.STATUS_STREAMING:
            status = f'<span style="color:{t["dim"]}">streaming in another program…</span>'
        acts = [f'<a href="{SCHEME}:copy-message/{m.id}">Copy</a>'] if (lm.content or lm.reasoning) else []
        if last_answer and can_act:
            acts.append(f'<a href="{SCHEME}:regenerate/{m.id}">Regenerate</a>')
        line = " · ".join(bits)
        parts = [p for p in (status, line) if p]
        text = "<br>".join(parts)
        if acts:
            text += (" &nbsp; " if text else "") + " · ".join(acts)
        return f'<p style="margin-top:2px; margin-bottom:6px; color:{t["dim"]}; font-size:small">{text}</p>'

    # -- whole document ----------------------------------------------------------------------------------
    def render_all(self, messages: list[LiveMessage], streaming_id: int | None) -> None:
        t0 = time.perf_counter()
        if streaming_id is None:
            self._report()              # a finished message is drawn whole
        self.codes = []
        last_answer_id = next((lm.msg.id for lm in reversed(messages) if lm.msg.role == "assistant"), None)
        can_act = streaming_id is None
        done = [lm for lm in messages if lm.msg.id != streaming_id]
        body = "\n".join(self.message_html(lm, streaming=False, last_answer=lm.msg.id == last_answer_id,
                                           can_act=can_act) for lm in done)
        if not messages:
            body = _plain_html("Ask anything. The answer streams here, the model's reasoning dimmed above it. "
                               "Enter sends, Shift+Enter starts a new line.", color=self.theme["dim"])
        self.doc.setHtml(f"<body>{body}</body>")
        self.stream_start = None
        self._cursor = None
        live = next((lm for lm in messages if lm.msg.id == streaming_id), None)
        if live is not None:
            cur = QTextCursor(self.doc)
            cur.movePosition(QTextCursor.MoveOperation.End)
            if not self.doc.isEmpty():
                cur.insertBlock()
            self.stream_start = cur.position()
            self._render_tail(live)
        self.last_render_s = time.perf_counter() - t0
        self.last_render_at = time.perf_counter()

    def _render_tail(self, live: LiveMessage) -> None:
        assert self.stream_start is not None
        cur = QTextCursor(self.doc)
        cur.setPosition(self.stream_start)
        cur.movePosition(QTextCursor.MoveOperation.End, QTextCursor.MoveMode.KeepAnchor)
        cur.removeSelectedText()
        cur.insertHtml(self.message_html(live, streaming=True, last_answer=True, can_act=False))
        if not live.content and not live.reasoning:
            cur.insertHtml(f'<span style="color:{self.theme["dim"]}"><i>waiting for the first token…</i></span>')
            self.stream_phase = None
        else:
            self.stream_phase = "content" if live.content else "reasoning"
        cur.movePosition(QTextCursor.MoveOperation.End)
        self._cursor = cur
        self._report()                  # the tail was drawn from the whole message: pending chunks are in

    def rerender_tail(self, live: LiveMessage) -> None:
        if self.stream_start is None:
            return
        t0 = time.perf_counter()
        self._render_tail(live)
        self.last_render_s = time.perf_counter() - t0
        self.last_render_at = time.perf_counter()
        self.tail_renders += 1
        self.tail_render_s += self.last_render_s

    def append(self, live: LiveMessage, kind: str, text: str, t_arrival: float) -> None:
        """One chunk (already added to ``live``): a raw append at the end, or (on a phase change) a re-render of
        the streaming message. Appends are coalesced per event-loop turn: a paragraph is laid out again as a
        whole on every insert (measured: 2.4 ms per insert into a 7,000-character paragraph), so chunks that
        queued up while the GUI was busy go in with one insert."""
        if self.stream_start is None:
            return
        if kind == "reasoning" and self.stream_phase == "content":
            return                     # the reasoning is folded away once the answer began: drawn on re-render
        self._pending.append((text, t_arrival))
        if self.stream_phase != kind:
            self.rerender_tail(live)
            return
        if not self._flush_queued:
            self._flush_queued = True
            QTimer.singleShot(0, self._flush)

    def _flush(self) -> None:
        self._flush_queued = False
        if not self._pending or self.stream_start is None:
            self._pending.clear()
            return
        cur = self._cursor
        if cur is None:
            cur = QTextCursor(self.doc)
            cur.movePosition(QTextCursor.MoveOperation.End)
            self._cursor = cur
        cur.insertText("".join(t for t, _a in self._pending))
        self._report()

    def _report(self) -> None:
        """The pending chunks are in the document now (tell the benchmark probe, if any)."""
        if self.probe is not None and self._pending:
            now = time.perf_counter()
            for _t, arrival in self._pending:
                self.probe(now - arrival)
        self._pending.clear()


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


# ------------------------------------------------------------------------------------------------ widgets
class Composer(QPlainTextEdit):
    """Enter sends, Shift+Enter starts a new line, Esc stops the answer (or cancels an edit)."""

    submitted = Signal()
    escape = Signal()
    MIN_LINES, MAX_LINES = 2, 8

    def __init__(self, parent=None):
        super().__init__(parent)
        self.document().documentLayout().documentSizeChanged.connect(self._fit)
        self._fit()

    def _fit(self, *_a) -> None:
        """Grow with the text from 2 to 8 lines, then scroll."""
        lines = max(1, int(self.document().size().height()))   # a plain-text layout measures in lines
        lines = min(max(lines, self.MIN_LINES), self.MAX_LINES)
        m = self.contentsMargins()
        h = (lines * self.fontMetrics().lineSpacing() + 2 * int(self.document().documentMargin())
             + m.top() + m.bottom() + 2)
        self.setFixedHeight(h)

    def keyPressEvent(self, e):  # noqa: N802 - Qt's name
        if e.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
            mods = e.modifiers()
            if mods & Qt.KeyboardModifier.ShiftModifier:
                self.insertPlainText("\n")
                return
            if not mods & (Qt.KeyboardModifier.AltModifier | Qt.KeyboardModifier.MetaModifier):
                self.submitted.emit()
                return
        if e.key() == Qt.Key.Key_Escape:
            self.escape.emit()
            return
        super().keyPressEvent(e)


class ChatPane(QWidget):
    """The chat pane. ``ChatPane(ctx, parent=None)``; the window calls :meth:`shutdown` when it closes."""

    conversationsChanged = Signal()
    streamFinished = Signal(int, str)        # conversation id, status

    def __init__(self, ctx, parent=None):
        super().__init__(parent)
        self.ctx = ctx
        self.setObjectName("chatPane")
        self.store: hist.HistoryStore | None = None
        self.base_url: str | None = ctx.base_url
        self.api_key: str | None = ctx.api_key
        self.engine_model: str | None = None
        self.engine_simulated = False
        self.engine_state_text: str | None = None
        self._convs: dict[int, ConvState] = {}
        self._streams: list[Stream] = []
        self._current: ConvState | None = None
        self._edit_id: int | None = None
        self._max_tokens_touched = False
        self._theme = _theme(self.palette())
        self._font = QFont(self.font())
        # benchmark probe: (seconds from the chunk's arrival to its text being in the document, shown on screen)
        self.on_delta_rendered: Callable[[float, bool], None] | None = None
        self._shutting_down = False

        # live workers (app.workers), kept referenced until they finish
        self._workers: set = set()

        self._build()
        self._new_draft()
        self._wire()
        self._update_engine_line()
        self._spawn(hist.HistoryStore, on_done=self._store_ready, on_error=self._store_failed)

    # -- construction --------------------------------------------------------------------------------------
    def _build(self) -> None:
        lay = QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)
        lay.setSpacing(4)

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
        self.options_toggle = QToolButton()
        self.options_toggle.setObjectName("chatOptionsToggle")
        self.options_toggle.setCheckable(True)
        self.options_toggle.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.options_toggle.setArrowType(Qt.ArrowType.RightArrow)
        self.options_toggle.setAutoRaise(True)
        bl.addWidget(self.options_toggle)
        self.options_box = QWidget()
        self.options_box.setObjectName("chatOptions")
        og = QGridLayout(self.options_box)
        og.setContentsMargins(16, 0, 0, 0)
        self.max_tokens = QSpinBox()
        self.max_tokens.setObjectName("chatMaxTokens")
        self.max_tokens.setRange(1, 1_048_576)
        self.max_tokens.setValue(self.ctx.settings.default_max_tokens)
        self.max_tokens.setSuffix(" tokens")
        self.max_tokens.setToolTip("Most tokens the answer may have (the default is the default_max_tokens "
                                   "setting, DSV41_DEFAULT_MAX_TOKENS)")
        self.temperature = QDoubleSpinBox()
        self.temperature.setObjectName("chatTemperature")
        self.temperature.setRange(-0.05, 2.0)
        self.temperature.setSingleStep(0.05)
        self.temperature.setDecimals(2)
        self.temperature.setSpecialValueText("engine default")
        self.temperature.setValue(-0.05)
        self.temperature.setToolTip("Sampling temperature; 'engine default' sends none")
        self.effort = QComboBox()
        self.effort.setObjectName("chatEffort")
        self.effort.addItem("engine default", None)
        for e in REASONING_EFFORTS:
            self.effort.addItem(e, e)
        self.effort.setToolTip("reasoning_effort: how long the model thinks before answering")
        self.reproducible = QCheckBox("Reproducible")
        self.reproducible.setObjectName("chatReproducible")
        self.reproducible.setToolTip("strata_reproducible: the same answer whatever else is in the batch "
                                     "(slower)")
        # two narrow columns, so the pane stays usable at its minimum width (300 px)
        self.max_tokens.setPrefix("max ")
        self.temperature.setPrefix("temp ")
        self.temperature.setSpecialValueText("temp: default")
        self.effort.setItemText(0, "reasoning: default")
        for i, e in enumerate(REASONING_EFFORTS, start=1):
            self.effort.setItemText(i, f"reasoning: {e}")
        og.addWidget(self.max_tokens, 0, 0)
        og.addWidget(self.temperature, 0, 1)
        og.addWidget(self.effort, 1, 0)
        og.addWidget(self.reproducible, 1, 1)
        for w in (self.max_tokens, self.temperature, self.effort):
            w.setMinimumWidth(60)
            w.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Fixed)
        self.options_box.setVisible(False)
        bl.addWidget(self.options_box)

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
        self._update_options_label()

        self._list_timer = QTimer(self)
        self._list_timer.setInterval(500)
        self._search_timer = QTimer(self)
        self._search_timer.setSingleShot(True)
        self._search_timer.setInterval(250)
        self._reload_timer = QTimer(self)
        self._reload_timer.setSingleShot(True)
        self._reload_timer.setInterval(150)
        self._reload_select: int | None = None

    def _wire(self) -> None:
        self.composer.submitted.connect(self.send)
        self.composer.escape.connect(self._on_escape)
        self.send_button.clicked.connect(lambda: self.send())
        self.stop_button.clicked.connect(lambda: self.stop())
        self.regen_button.clicked.connect(lambda: self.regenerate())
        self.start_button.clicked.connect(self.ctx.requestStart.emit)
        self.new_button.clicked.connect(self.new_conversation)
        self.edit_cancel.clicked.connect(self.cancel_edit)
        self.conv_list.currentItemChanged.connect(self._on_item_changed)
        self.conv_list.customContextMenuRequested.connect(self._list_menu)
        self.conv_list.itemChanged.connect(self._on_item_renamed)
        self.browser.anchorClicked.connect(self._on_anchor)
        sb = self.browser.verticalScrollBar()
        sb.valueChanged.connect(self._on_scroll)
        sb.rangeChanged.connect(self._on_range)
        self.options_toggle.toggled.connect(self._toggle_options)
        for w in (self.max_tokens, self.temperature):
            w.valueChanged.connect(self._update_options_label)
        self.max_tokens.valueChanged.connect(self._max_tokens_edited)
        self.effort.currentIndexChanged.connect(self._update_options_label)
        self.reproducible.toggled.connect(self._update_options_label)
        self.composer.textChanged.connect(self._update_buttons)
        self._list_timer.timeout.connect(self._refresh_streaming_items)
        self._search_timer.timeout.connect(self._run_search)
        self._reload_timer.timeout.connect(self._reload_now)
        self.search_edit.textChanged.connect(lambda _t: self._search_timer.start())
        self.ctx.engineReady.connect(self._on_engine_ready)
        self.ctx.engineStopped.connect(self._on_engine_stopped)
        self.ctx.engineStateChanged.connect(self._on_engine_state)
        self.ctx.settingsChanged.connect(self._on_settings)
        ctx_shortcut = Qt.ShortcutContext.WidgetWithChildrenShortcut
        for seq, slot in (("Ctrl+N", self.new_conversation), ("Ctrl+F", self._focus_search),
                          ("Ctrl+Shift+R", self.regenerate), ("F2", self._rename_current),
                          ("Ctrl+L", self.composer.setFocus)):
            sc = QShortcut(QKeySequence(seq), self)
            sc.setContext(ctx_shortcut)
            sc.activated.connect(slot)

    def _spawn(self, fn: Callable[..., Any], *args: Any, on_event: Callable | None = None,
               on_done: Callable | None = None, on_error: Callable | None = None,
               on_finished: Callable | None = None, **kwargs: Any):
        """``app.workers.run_generator`` / ``run_function``. Results that arrive after the pane was shut down or
        deleted are dropped."""
        def guard(cb: Callable | None) -> Callable | None:
            if cb is None:
                return None

            def call(*a: Any) -> None:
                if not self._shutting_down and shiboken6.isValid(self):
                    cb(*a)
            return call

        holder: list = []

        def finished() -> None:
            if holder:
                self._workers.discard(holder[0])
            if on_finished is not None:
                guard(on_finished)()

        common = dict(on_done=guard(on_done), on_error=guard(on_error or self._report_error), on_finished=finished)
        if inspect.isgeneratorfunction(fn):
            worker = run_generator(fn, *args, on_event=guard(on_event), **common, **kwargs)
        else:
            worker = run_function(fn, *args, **common, **kwargs)
        holder.append(worker)
        self._workers.add(worker)
        return worker

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
        self._spawn(_restore_ui, store, on_done=self._restore)

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

    def reload_list(self, select: int | None = None) -> None:
        """Refresh the conversation list from the store (coalesced: many calls in 150 ms make one read)."""
        if select is not None:
            self._reload_select = select
        self._reload_timer.start()

    def _reload_now(self) -> None:
        if self.store is None:
            return
        select, self._reload_select = self._reload_select, None
        self._spawn(self.store.list_conversations, on_done=lambda convs, s=select: self._fill_list(convs, s),
                    on_error=self._report_error)

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
        self._spawn(self.store.search, text, on_done=lambda hits, t=text: self._show_hits(t, hits),
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
            self._spawn(self.store.get_conversation, cid, on_done=lambda conv, s=state: self._loaded(s, conv),
                         on_error=self._report_error)

    def _loaded(self, state: ConvState, conv: hist.Conversation) -> None:
        if state.stream is not None:          # a stream began meanwhile: it brought fresher messages
            return
        state.title = conv.title
        state.options = conv.options or {}
        state.messages = [LiveMessage(m) for m in conv.messages]
        state.loaded = True
        state.render()
        if state is self._current:
            self._apply_options(state.options)
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
            self._apply_options(state.options)
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
        self._spawn(self.store.rename, cid, title, on_done=done, on_error=self._report_error)

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
        self._spawn(self.store.delete, cid, on_done=done, on_error=self._report_error)

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
        self._spawn(work, on_done=lambda p: self.ctx.statusMessage.emit(f"Conversation exported to {p}", 6000),
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

    # -- options ----------------------------------------------------------------------------------------------
    def options(self) -> ChatOptions:
        t = self.temperature.value()
        return ChatOptions(max_tokens=self.max_tokens.value(), temperature=None if t < 0 else round(t, 2),
                           reasoning_effort=self.effort.currentData(), reproducible=self.reproducible.isChecked())

    def _apply_options(self, opts: dict[str, Any]) -> None:
        if not opts:
            return
        o = ChatOptions.from_dict(opts)
        for w in (self.max_tokens, self.temperature, self.effort, self.reproducible):
            w.blockSignals(True)
        if o.max_tokens:
            self.max_tokens.setValue(o.max_tokens)
        self.temperature.setValue(-0.05 if o.temperature is None else o.temperature)
        idx = self.effort.findData(o.reasoning_effort) if o.reasoning_effort else 0
        self.effort.setCurrentIndex(max(0, idx))
        self.reproducible.setChecked(bool(o.reproducible))
        for w in (self.max_tokens, self.temperature, self.effort, self.reproducible):
            w.blockSignals(False)
        self._update_options_label()

    def _max_tokens_edited(self, _v: int) -> None:
        self._max_tokens_touched = True

    def _on_settings(self, loaded) -> None:
        if not self._max_tokens_touched:
            self.max_tokens.blockSignals(True)
            self.max_tokens.setValue(loaded.settings.default_max_tokens)
            self.max_tokens.blockSignals(False)
            self._update_options_label()

    def _toggle_options(self, on: bool) -> None:
        self.options_box.setVisible(on)
        self.options_toggle.setArrowType(Qt.ArrowType.DownArrow if on else Qt.ArrowType.RightArrow)

    def _update_options_label(self, *_a) -> None:
        o = self.options()
        bits = [f"{o.max_tokens} tokens"]
        if o.temperature is not None:
            bits.append(f"temperature {o.temperature:g}")
        if o.reasoning_effort:
            bits.append(f"reasoning {o.reasoning_effort}")
        if o.reproducible:
            bits.append("reproducible")
        self.options_toggle.setText("Options: " + " · ".join(bits))

    # -- engine -----------------------------------------------------------------------------------------------
    def _on_engine_ready(self, base_url: str, key: str) -> None:
        self.base_url, self.api_key = base_url, key
        self.engine_state_text = None
        self.engine_model = None
        self._update_engine_line()

        def probe():
            with ChatClient(base_url, key) as c:
                return c.health(timeout_s=3.0)
        self._spawn(probe, on_done=self._on_health, on_error=lambda _e: None)

    def _on_health(self, data: dict) -> None:
        model = data.get("model")
        self.engine_model = str(model) if model else None
        text = " ".join(str(data.get(k, "")) for k in ("service", "model", "engine", "simulated")).lower()
        self.engine_simulated = bool(data.get("simulated")) or "sim" in text.split() or "simulated" in text \
            or "(sim" in text or "scripted" in text
        self._update_engine_line()

    def _on_engine_stopped(self) -> None:
        self.base_url = self.api_key = None
        self.engine_model = None
        self.engine_state_text = None
        self._update_engine_line()

    def _on_engine_state(self, ev) -> None:
        state = getattr(ev, "state", None)
        if state is None and isinstance(ev, dict):
            state = ev.get("state")
        state = str(getattr(state, "value", state) or "")
        if self.base_url and state in ("ready", ""):
            return
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
                self.base_url = self.api_key = None
            self._update_engine_line()

    def engine_ready(self) -> bool:
        return bool(self.base_url)

    def _update_engine_line(self) -> None:
        if self.base_url:
            where = self.base_url.replace("http://", "")
            model = f" · {self.engine_model}" if self.engine_model else ""
            sim = " (simulated engine)" if self.engine_simulated and "simulated" not in model else ""
            self.engine_label.setText(f"Engine ready at {where}{model}{sim}")
            self.engine_label.setStyleSheet(f"color: {self._theme['dim']}")
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
                check_target(settings, kw["base_url"], kw["api_key"])
                yield from run_turn(**kw)
            finally:
                done.set()

        kwargs = dict(store=self.store, conversation_id=st.id, base_url=self.base_url, api_key=self.api_key,
                      options=opts, user_text=text, mode=mode, edit_message_id=edit_id, cancel=token,
                      model=self.engine_model)
        stream.worker = self._spawn(turn, **kwargs,
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

    def shutdown(self, timeout_s: float = 3.0) -> None:
        """Stop every stream (their answers are saved and marked interrupted) and wait briefly for the writes."""
        if self._shutting_down:
            return
        self._shutting_down = True
        streams = list(self._streams)
        for s in streams:
            s.token.cancel("shutdown")
        deadline = time.monotonic() + timeout_s
        for s in streams:
            s.done.wait(max(0.0, deadline - time.monotonic()))
        for s in streams:
            if not s.done.is_set() and s.live is not None and self.store is not None:
                try:
                    self.store.mark_interrupted(s.live.msg.id, "The panel was closed while the answer streamed.")
                except Exception:  # noqa: BLE001 - closing must not fail; recovery marks it on the next start
                    pass
        self._list_timer.stop()
        try:
            uistate.save({"chat_conversation": self.current_conversation_id(),
                          "chat_splitter": [int(x) for x in self.splitter.sizes()],
                          "chat_options_open": self.options_toggle.isChecked()})
        except OSError:
            pass
