"""How the chat pane draws a conversation: Markdown → the HTML subset ``QTextDocument`` renders, and one
conversation's document (:class:`ConversationDoc`) with its messages as the pane holds them (:class:`LiveMessage`).

Rendering stays cheap with many answers streaming at once: every conversation has its own ``QTextDocument``; a chunk
is appended to the end of its document with one ``QTextCursor.insertText`` (no re-render), and only the streaming
message of the conversation on screen is re-rendered as Markdown, throttled (at most every 0.3 s, and never more
often than 20 times what the last render cost). Hidden conversations are rendered as Markdown when they finish or
when shown. ``benchmarks/chat_latency.py`` measures chunk arrival → text in the document with 8 streams.
"""

from __future__ import annotations

import html
import time
from dataclasses import dataclass, field
from typing import Callable

from markdown_it import MarkdownIt
from PySide6.QtCore import QTimer
from PySide6.QtGui import QFont, QPalette, QTextCursor, QTextDocument

from engine_manager import history as hist
from engine_manager.chat_events import MIN_RATE_SPAN_S, StreamStats

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
        note = stats.end_note((m.options or {}).get("max_tokens"), gui=True) if stats else None
        if note:           # why it ended early: the count, the engine's context, the InferenceKey time limit
            bits.append(f'<span style="color:{t["warn"]}">{html.escape(note)}</span>')
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
