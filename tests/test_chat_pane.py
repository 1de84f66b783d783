"""The chat pane under a real X server (pytest-xvfb), talking to the scripted engine as a real process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from chat_support import ROOT
from PySide6.QtCore import Qt, QUrl
from PySide6.QtGui import QGuiApplication, QTextCursor
from PySide6.QtWidgets import QLabel, QStyle, QStyleOptionButton

from app.chat_pane import EMPTY_LIST_HINT, ChatPane, MarkdownRenderer, _theme
from app.context import AppContext
from engine_manager import history as hist
from engine_manager.sim import corpus
from engine_manager.engine_state import RunningEngine
from engine_manager.settings import load_settings

pytestmark = pytest.mark.gui


def ready(ctx, base_url: str, key: str) -> None:
    """The panel's own engine is ready at ``base_url`` (what the engine session tells the context)."""
    ctx.set_running(RunningEngine.from_status(None, base_url, key, engine="sim"))


@pytest.fixture
def ctx():
    return AppContext(load_settings())


@pytest.fixture
def pane(qtbot, ctx):
    p = ChatPane(ctx)
    qtbot.addWidget(p)
    p.resize(520, 900)
    p.show()
    qtbot.waitUntil(lambda: p.store is not None, timeout=10000)
    yield p
    p.shutdown()


def doc(p: ChatPane) -> str:
    return p.document_text()


def click_link(qtbot, p: ChatPane, href: str) -> None:
    """A real mouse click on the link ``href`` in the transcript: found through the document's layout, scrolled
    into view, clicked in the middle of its text."""
    d = p.browser.document()
    block = d.begin()
    where = None
    while block.isValid() and where is None:
        it = block.begin()
        while not it.atEnd():
            frag = it.fragment()
            if frag.charFormat().isAnchor() and frag.charFormat().anchorHref() == href:
                where = (frag.position(), frag.length())
                break
            it += 1
        block = block.next()
    assert where is not None, f"no link {href} in the transcript"
    cur = QTextCursor(d)
    cur.setPosition(where[0] + where[1] // 2)
    p.browser.setTextCursor(cur)
    p.browser.ensureCursorVisible()
    point = p.browser.cursorRect(cur).center()
    assert p.browser.anchorAt(point) == href
    qtbot.mouseClick(p.browser.viewport(), Qt.MouseButton.LeftButton, pos=point)


def listed(p: ChatPane) -> list:
    """The conversations in the list (not the grey hint lines)."""
    items = [p.conv_list.item(i) for i in range(p.conv_list.count())]
    return [it for it in items if isinstance(it.data(Qt.ItemDataRole.UserRole), int)]


# The scripted engine answers with its curated sentences for the question's topic (engine_manager.sim.corpus): the
# reasoning opens with the topic's first reasoning sentence, the answer with the canned-answer label.
THINKING = corpus.topic_named("offload").reasoning[0][:50]      # "The question is about how the model's experts…"
ANSWER_START = corpus.LABEL[:45]                                 # "This is a canned answer from the scripted engine"


def _canned_for(question: str, answer: str, whole: bool = True) -> bool:
    """``answer`` is the scripted engine's reply to ``question``: the label, then sentences of the question's
    topic only (the last one may be cut by a token limit unless ``whole``)."""
    said = corpus.sentences(answer)
    pool = set(corpus.topic_of(question).answer) | {corpus.CLOSER}
    body, last = (said[1:], None) if whole else (said[1:-1], said[-1])
    return (len(said) >= 2 and said[0] == corpus.LABEL and set(body) <= pool
            and (last is None or any(s.startswith(last) for s in pool)))


def test_type_send_stream_reasoning_and_stop(qtbot, pane, ctx, start_sim):
    sim = start_sim("--reply-tokens", "3000", speed=1.0)
    ready(ctx, sim.base_url, sim.api_key)
    assert not pane.send_button.isEnabled()                  # nothing typed yet
    qtbot.keyClicks(pane.composer, "Explain expert offload")
    qtbot.keyClick(pane.composer, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
    assert pane.streaming_count() == 0                        # Shift+Enter is a new line, not send
    qtbot.keyClicks(pane.composer, "on one GPU")
    assert pane.composer.toPlainText() == "Explain expert offload\non one GPU"
    assert pane.send_button.isEnabled()
    qtbot.keyClick(pane.composer, Qt.Key.Key_Return)
    assert pane.composer.toPlainText() == ""
    qtbot.waitUntil(lambda: "Reasoning…" in doc(pane) and THINKING in doc(pane), timeout=20000)
    assert pane.stop_button.isEnabled() and not pane.send_button.isEnabled()
    # the answer begins: the reasoning folds into a block that can be opened
    qtbot.waitUntil(lambda: ANSWER_START in doc(pane), timeout=20000)
    qtbot.waitUntil(lambda: "▸ Reasoning" in doc(pane), timeout=5000)
    assert THINKING not in doc(pane)
    qtbot.waitUntil(lambda: "Streaming:" in pane.live_label.text() and "tok/s" in pane.live_label.text(),
                    timeout=5000)
    qtbot.mouseClick(pane.stop_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: not pane.is_streaming(), timeout=10000)
    text = doc(pane)
    assert "Stopped by you" in text and "tokens" in text and "tok/s" in text and "first token" in text
    m = pane.store.messages(pane.current_conversation_id())
    assert [x.role for x in m] == ["user", "assistant"]
    assert m[0].content == "Explain expert offload\non one GPU"
    assert m[1].status == hist.STATUS_STOPPED and m[1].content.startswith(corpus.LABEL[:len(m[1].content)])
    assert ANSWER_START in m[1].content and m[1].reasoning.startswith(corpus.topic_named("offload").reasoning[0])
    assert m[1].stats["cancelled"] is True
    # the reasoning block opens on a click on its line, and closes on the next
    click_link(qtbot, pane, f"dsv41:toggle-reasoning/{m[1].id}")
    qtbot.waitUntil(lambda: "▾ Reasoning" in doc(pane), timeout=5000)
    assert THINKING in doc(pane)
    click_link(qtbot, pane, f"dsv41:toggle-reasoning/{m[1].id}")
    qtbot.waitUntil(lambda: "▸ Reasoning" in doc(pane), timeout=5000)
    assert THINKING not in doc(pane)
    qtbot.waitUntil(lambda: len(listed(pane)) == 1, timeout=5000)
    assert pane.conv_list.item(0).text().startswith("Explain expert offload")


def test_no_engine_says_why_and_offers_start(qtbot, pane, ctx, shared_sim):
    assert "No engine is running" in pane.engine_label.text()
    assert pane.start_button.isVisibleTo(pane)
    pane.composer.setPlainText("kept while the engine starts")
    assert not pane.send_button.isEnabled()
    assert pane.send() is False and pane.composer.toPlainText() == "kept while the engine starts"
    with qtbot.waitSignal(ctx.requestStart, timeout=2000):
        qtbot.mouseClick(pane.start_button, Qt.MouseButton.LeftButton)
    ctx.engineStateChanged.emit({"state": "starting"})
    assert "starting" in pane.engine_label.text()
    ready(ctx, shared_sim.base_url, shared_sim.api_key)
    assert "Engine ready" in pane.engine_label.text() and not pane.start_button.isVisibleTo(pane)
    qtbot.waitUntil(lambda: "simulated" in pane.engine_label.text(), timeout=5000)
    assert pane.send_button.isEnabled()
    ctx.set_running(None)                                    # stopped
    assert "No engine is running" in pane.engine_label.text() and not pane.send_button.isEnabled()


def test_the_engine_handle_says_where_and_whether_it_is_simulated(qtbot, pane, ctx, recording_engine):
    """the pane takes the engine from ctx.engineRunning (a RunningEngine): its address and key, and
    "simulated" from the handle, never guessed from /health (this engine's /health does not say it); a handle
    of an address and key alone is nothing known to be simulated."""
    sim = RunningEngine(recording_engine.base_url, "k" * 24, engine="sim", label="Scripted engine",
                        simulated=True)
    ctx.set_running(sim)
    qtbot.waitUntil(lambda: recording_engine.MODEL in pane.engine_label.text(), timeout=5000)
    assert "(simulated engine)" in pane.engine_label.text() and pane.engine_ready() and pane.running is sim
    assert pane.send("Are you simulated?")
    qtbot.waitUntil(lambda: pane.streaming_count() == 0 and "Recorded and answered." in doc(pane), timeout=20000)
    assert recording_engine.bodies[-1]["model"] == recording_engine.MODEL
    ctx.set_running(None)                                        # stopped
    assert "No engine is running" in pane.engine_label.text() and not pane.engine_ready()
    real = sim.with_(engine="llamacpp", simulated=False)
    ctx.set_running(real)
    qtbot.waitUntil(lambda: recording_engine.MODEL in pane.engine_label.text(), timeout=5000)
    assert "simulated" not in pane.engine_label.text()
    # a handle of the address and key alone (nothing known to be simulated)
    ctx.set_running(RunningEngine(recording_engine.base_url, "other-key-0123456789", engine="llamacpp"))
    qtbot.waitUntil(lambda: recording_engine.MODEL in pane.engine_label.text(), timeout=5000)
    assert "simulated" not in pane.engine_label.text() and pane.running.api_key == "other-key-0123456789"
    ctx.set_running(None)
    assert not pane.engine_ready()


def test_several_conversations_stream_at_once(qtbot, pane, ctx, start_sim):
    sim = start_sim("--reply-tokens", "150", speed=2.0, slots=4)
    ready(ctx, sim.base_url, sim.api_key)
    questions = ["Tell me about NUMA", "Tell me about PCIe", "Tell me about Python"]     # three topics
    assert len({corpus.topic_of(q).name for q in questions}) == 3
    for i, q in enumerate(questions):
        if i:
            pane.new_conversation()
        assert pane.send(q)
    assert pane.streaming_count() == 3
    qtbot.waitUntil(lambda: sum(pane.is_streaming(c) for c in pane._convs) == 3, timeout=10000)
    qtbot.waitUntil(lambda: pane.streaming_count() == 0, timeout=60000)
    convs = pane.store.list_conversations()
    assert len(convs) == 3
    for c in convs:
        user, answer = pane.store.messages(c.id)
        assert answer.status == hist.STATUS_COMPLETE and answer.stats["completion_tokens"] == 150
        assert _canned_for(user.content, answer.content, whole=False)    # each answer is to its own question
    # the hidden conversations were drawn as Markdown when they finished; showing one shows its answer
    other = next(c.id for c in convs if c.id != pane.current_conversation_id())
    pane.open_conversation(other)
    assert pane.store.messages(other)[1].content.split()[0] in doc(pane)
    qtbot.waitUntil(lambda: len(listed(pane)) == 3, timeout=5000)


EDITED = "How do I bind the engine to the NUMA node of the GPU?"


def test_regenerate_and_edit_and_resend(qtbot, pane, ctx, shared_sim):
    ready(ctx, shared_sim.base_url, shared_sim.api_key)
    assert pane.send("Explain expert offload")
    qtbot.waitUntil(lambda: pane.streaming_count() == 0, timeout=30000)
    cid = pane.current_conversation_id()
    first = pane.store.messages(cid)
    assert "Regenerate" in doc(pane)
    pane._on_anchor(QUrl(f"dsv41:regenerate/{first[1].id}"))
    qtbot.waitUntil(lambda: pane.streaming_count() == 0 and len(pane.store.messages(cid)) == 2
                    and pane.store.messages(cid)[1].id != first[1].id, timeout=30000)
    pane._on_anchor(QUrl(f"dsv41:edit/{first[0].id}"))
    assert pane.edit_banner.isVisibleTo(pane) and pane.composer.toPlainText() == "Explain expert offload"
    pane.composer.setPlainText(EDITED)
    qtbot.keyClick(pane.composer, Qt.Key.Key_Return)
    assert not pane.edit_banner.isVisibleTo(pane)
    qtbot.waitUntil(lambda: pane.streaming_count() == 0, timeout=30000)
    msgs = pane.store.messages(cid)
    assert [m.content for m in msgs][0] == EDITED and len(msgs) == 2
    # the new answer is to the edited question (its topic, host, is not the first question's)
    assert corpus.topic_of(EDITED) is not corpus.topic_of("Explain expert offload")
    assert _canned_for(EDITED, msgs[1].content) and EDITED in doc(pane)
    assert corpus.sentences(msgs[1].content)[1] in doc(pane)
    assert "Explain expert offload" not in doc(pane)


def test_engine_killed_mid_answer_is_shown_and_saved_as_interrupted(qtbot, pane, ctx, start_sim):
    sim = start_sim("--sigkill-after-tokens", "25")
    ready(ctx, sim.base_url, sim.api_key)
    assert pane.send("Explain expert offload")
    qtbot.waitUntil(lambda: pane.streaming_count() == 0, timeout=30000)
    assert "Interrupted" in doc(pane) and "stopped while answering" in doc(pane)
    a = pane.store.messages(pane.current_conversation_id())[1]
    assert a.status == hist.STATUS_INTERRUPTED and (a.reasoning or a.content)


def test_shutdown_while_streaming_marks_the_answer_interrupted(qtbot, ctx, start_sim):
    sim = start_sim("--reply-tokens", "3000", speed=1.0)
    p = ChatPane(ctx)
    qtbot.addWidget(p)
    qtbot.waitUntil(lambda: p.store is not None, timeout=10000)
    ready(ctx, sim.base_url, sim.api_key)
    assert p.send("Explain expert offload")
    qtbot.waitUntil(lambda: ANSWER_START in doc(p), timeout=20000)
    cid = p.current_conversation_id()
    p.shutdown()
    a = hist.HistoryStore().messages(cid)[1]
    assert a.status == hist.STATUS_INTERRUPTED and "panel was closed" in a.error
    assert ANSWER_START in a.content


def test_code_blocks_copy_and_markdown_is_safe(qtbot, pane):
    store = pane.store
    cid = store.create_conversation(title="Code")
    store.add_message(cid, "user", "show code")
    store.add_message(cid, "assistant", "Run this:\n\n```python\nprint('hi')\n```\n\n<b>raw</b> and "
                      "![x](https://example.com/x.png) and ![y](file:///etc/passwd) and **bold**",
                      reasoning="some thinking")
    pane.reload_list()
    qtbot.waitUntil(lambda: len(listed(pane)) == 1, timeout=5000)
    pane.conv_list.setCurrentRow(0)
    qtbot.waitUntil(lambda: "Run this:" in doc(pane), timeout=5000)
    text = doc(pane)
    assert "Copy code" in text and "python" in text and "print('hi')" in text
    assert "<b>raw</b>" in text                              # raw HTML from the model is shown, not rendered
    assert "[image: x]" in text                              # images are never loaded: shown as a link
    assert "![y](file:///etc/passwd)" in text                # a file: link is not even made a link
    assert "▸ Reasoning" in text and "some thinking" not in text
    pane._on_anchor(QUrl("dsv41:copy-code/0"))
    assert QGuiApplication.clipboard().text() == "print('hi')\n"
    html = MarkdownRenderer(_theme(pane.palette())).render("<script>x</script>", [])
    assert "<script>" not in html and "&lt;script&gt;" in html


def test_conversation_list_rename_search_delete(qtbot, pane):
    store = pane.store
    a = store.create_conversation()
    store.add_message(a, "user", "about NUMA nodes")
    b = store.create_conversation()
    store.add_message(b, "user", "about the KV cache")
    pane.reload_list()
    qtbot.waitUntil(lambda: len(listed(pane)) == 2, timeout=5000)
    pane.rename_conversation(a, "NUMA notes")
    qtbot.waitUntil(lambda: store.get_conversation(a).title == "NUMA notes", timeout=5000)
    pane.search_edit.setText("kv cache")
    qtbot.waitUntil(lambda: len(listed(pane)) == 1 and "KV cache" in pane.conv_list.item(0).text(),
                    timeout=5000)
    pane.search_edit.setText("")
    qtbot.waitUntil(lambda: len(listed(pane)) == 2, timeout=5000)
    pane.delete_conversation(b, confirm=False)
    qtbot.waitUntil(lambda: len(listed(pane)) == 1, timeout=5000)
    assert [c.id for c in store.list_conversations()] == [a]


def test_export_from_the_pane(qtbot, pane, tmp_path):
    store = pane.store
    cid = store.create_conversation()
    store.add_message(cid, "user", "export me")
    target = tmp_path / "out.md"
    pane.export_conversation(cid, target, "md")
    qtbot.waitUntil(target.exists, timeout=5000)
    assert target.read_text().startswith("# export me")


PANEL_SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    from PySide6.QtWidgets import QApplication
    from PySide6.QtCore import QTimer
    app = QApplication([])
    from engine_manager import history
    from engine_manager.settings import load_settings
    from engine_manager.engine_state import RunningEngine
    from app.context import AppContext
    from app.chat_pane import ChatPane

    # every chunk the answer's recorder is given, with its arrival (monotonic, the same clock in every process),
    # goes to a side file before the recorder sees it: what this process had received when it was killed
    side = os.open(sys.argv[3], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    def tap(kind, add):
        def tapped(self, text):
            os.write(side, (json.dumps([kind, time.monotonic(), text]) + "\\n").encode())
            add(self, text)
        return tapped
    history.AnswerRecorder.add_content = tap("content", history.AnswerRecorder.add_content)
    history.AnswerRecorder.add_reasoning = tap("reasoning", history.AnswerRecorder.add_reasoning)

    ctx = AppContext(load_settings())
    pane = ChatPane(ctx)
    pane.show()
    def go():
        if pane.store is None:
            QTimer.singleShot(50, go)
            return
        ctx.set_running(RunningEngine.from_status(None, sys.argv[1], sys.argv[2], engine="sim"))
        pane.send("Explain expert offload on one GPU")
    QTimer.singleShot(0, go)
    app.exec()
""")

STREAM_BEFORE_KILL_S = 3.0      # how long the answer streams (its saves watched all along) before the kill
MOST_LOST_S = 1.5               # "killing the panel loses at most about a second" (it saves every 0.5 s)


def _received(path) -> list[tuple[str, float, str]]:
    """The side file of PANEL_SCRIPT: (kind, arrival, text) per chunk; a line cut by the kill is not a chunk."""
    out = []
    for line in (path.read_text().splitlines() if path.exists() else []):
        try:
            kind, t, text = json.loads(line)
        except ValueError:
            continue
        out.append((kind, t, text))
    return out


def _unsaved_s(saved: dict[str, str], received: list[tuple[str, float, str]], now: float) -> float:
    """How much of the stream, in seconds of arrival up to ``now``, is not in ``saved`` (reasoning, content): from
    the first chunk that arrived and is not saved to ``now``. Also checks that what is saved is what arrived."""
    for k in saved:
        got = "".join(x for kind, _t, x in received if kind == k)
        assert got.startswith(saved[k]), f"the saved {k} is not what arrived"
    upto = {k: 0 for k in saved}
    for kind, t, text in received:
        upto[kind] += len(text)
        if upto[kind] > len(saved[kind]) and t <= now:
            return now - t
    return 0.0


def test_panel_killed_mid_stream_history_intact_on_restart(qtbot, start_sim, tmp_path):
    """Acceptance: the whole panel process is SIGKILLed while an answer streams; a new pane shows the question and
    the partial answer, marked interrupted, and a kill at any moment loses at most about a second of the stream:
    checked at the kill and all along the stream before it (the saved answer read against what had arrived)."""
    sim = start_sim("--reply-tokens", "3000", speed=1.0)
    side = tmp_path / "received.jsonl"
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", PANEL_SCRIPT, sim.base_url, sim.api_key, str(side)], env=env,
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    store = hist.HistoryStore()
    worst = (0.0, 0.0)                    # (seconds unsaved, seconds into the answer)
    try:
        deadline = time.monotonic() + 60
        first = None
        while time.monotonic() < deadline and proc.poll() is None:
            with store.connect() as conn:
                row = conn.execute("SELECT reasoning, content FROM messages WHERE role = 'assistant' "
                                   "ORDER BY id DESC LIMIT 1").fetchone()
            now = time.monotonic()        # the saved state read is at least this fresh
            received = _received(side)    # read after it: every chunk saved is in it
            if row is not None and received:
                first = received[0][1]
                lag = _unsaved_s({"reasoning": row["reasoning"], "content": row["content"]}, received, now)
                worst = max(worst, (lag, now - first))
                if now - first >= STREAM_BEFORE_KILL_S:
                    break
            time.sleep(0.05)
        assert first is not None and time.monotonic() - first >= STREAM_BEFORE_KILL_S, (
            proc.stderr.read().decode() if proc.poll() is not None else "the answer did not stream")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    received = _received(side)             # everything the panel had been sent when it died
    assert worst[0] <= MOST_LOST_S, (f"{worst[1]:.1f} s into the answer, the last {worst[0]:.2f} s of what had "
                                     f"arrived was not saved yet")
    ctx = AppContext(load_settings())
    p = ChatPane(ctx)
    qtbot.addWidget(p)
    qtbot.waitUntil(lambda: p.store is not None and len(listed(p)) == 1, timeout=10000)
    assert p.store.recovered == 1
    assert p.conv_list.item(0).text().startswith("⚠")
    p.conv_list.setCurrentRow(0)
    qtbot.waitUntil(lambda: "Interrupted" in doc(p), timeout=5000)
    q, a = p.store.messages(p.current_conversation_id())
    assert q.content == "Explain expert offload on one GPU"
    assert a.status == hist.STATUS_INTERRUPTED and "ended before it was complete" in a.error
    assert a.content, "nothing of the answer was saved while it streamed"
    assert "Explain expert offload on one GPU" in doc(p) and a.content.split()[0] in doc(p)
    # the kill itself: what was saved is what had arrived, less a tail that arrived within about a second
    lost_s = _unsaved_s({"reasoning": a.reasoning, "content": a.content}, received, received[-1][1])
    assert lost_s <= MOST_LOST_S, f"the kill lost the last {lost_s:.2f} s of the stream"
    p.shutdown()


def test_pane_state_survives_a_restart(qtbot, ctx):
    p = ChatPane(ctx)
    qtbot.addWidget(p)
    qtbot.waitUntil(lambda: p.store is not None, timeout=10000)
    cid = p.store.create_conversation(title="Keep me open")
    p.store.add_message(cid, "user", "remember this conversation")
    p.open_conversation(cid)
    qtbot.waitUntil(lambda: "remember this conversation" in doc(p), timeout=5000)
    p.options_toggle.setChecked(True)
    p.shutdown()
    again = ChatPane(AppContext(load_settings()))
    qtbot.addWidget(again)
    qtbot.waitUntil(lambda: again.current_conversation_id() == cid and "remember this" in doc(again), timeout=10000)
    assert again.options_toggle.isChecked() and again.options_box.isVisibleTo(again)
    again.shutdown()


def _send_and_wait_refusal(qtbot, p: ChatPane, text: str) -> None:
    p.composer.setPlainText(text)
    qtbot.keyClick(p.composer, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: p.streaming_count() == 0 and p.live_label.text().startswith("Not sent"), timeout=20000)


def test_a_refused_request_leaves_no_conversation_and_gives_the_text_back(qtbot, pane, ctx, shared_sim, free_port):
    """m13: nothing listening, or a wrong key (401): no "[error]" conversation, the question back in the composer;
    a follow-up that fails leaves its conversation as it was."""
    ready(ctx, f"http://127.0.0.1:{free_port}", "k" * 24)
    _send_and_wait_refusal(qtbot, pane, "Explain expert offload")
    assert "No engine answers" in pane.live_label.text() and "back in the box" in pane.live_label.text()
    assert pane.composer.toPlainText() == "Explain expert offload"
    assert pane.current_conversation_id() is None and "Explain expert offload" not in doc(pane)
    ready(ctx, shared_sim.base_url, "wrong-key-0123456789")
    _send_and_wait_refusal(qtbot, pane, "Explain expert offload")
    assert "HTTP 401" in pane.live_label.text() and pane.composer.toPlainText() == "Explain expert offload"
    assert pane.store.list_conversations() == []
    qtbot.waitUntil(lambda: pane.conv_list.count() == 1 and pane.conv_list.item(0).text() == EMPTY_LIST_HINT,
                    timeout=5000)
    # now it works: the text still in the box is sent as it is
    ready(ctx, shared_sim.base_url, shared_sim.api_key)
    qtbot.keyClick(pane.composer, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: pane.streaming_count() == 0 and pane.current_conversation_id() is not None,
                    timeout=30000)
    cid = pane.current_conversation_id()
    before = [m.id for m in pane.store.messages(cid)]
    assert len(before) == 2
    ready(ctx, f"http://127.0.0.1:{free_port}", "k" * 24)
    _send_and_wait_refusal(qtbot, pane, "a follow-up")
    assert [m.id for m in pane.store.messages(cid)] == before and pane.current_conversation_id() == cid
    assert "a follow-up" not in doc(pane) and pane.composer.toPlainText() == "a follow-up"
    assert [c.id for c in pane.store.list_conversations()] == [cid]


def test_a_program_the_panel_did_not_start_gets_nothing_from_the_pane(qtbot, monkeypatch, foreign_server, free_port):
    """m3: the address the pane was given is held by another program (the supervisor's status says so): refused
    before anything is sent, the question kept in the composer."""
    monkeypatch.setenv("DSV41_PORT", str(free_port))
    srv = foreign_server(free_port)
    ctx = AppContext(load_settings())
    p = ChatPane(ctx)
    qtbot.addWidget(p)
    p.show()
    qtbot.waitUntil(lambda: p.store is not None, timeout=10000)
    ready(ctx, srv.base_url, ctx.settings.api_key)
    _send_and_wait_refusal(qtbot, p, "hello")
    text = p.live_label.text()
    assert f"pid {srv.proc.pid}" in text and "not by an engine this panel started" in text
    assert p.composer.toPlainText() == "hello" and p.store.list_conversations() == []
    assert [ln for ln in srv.requests() if "/v1/chat" in ln] == []
    p.shutdown()


def test_empty_list_hint_and_long_titles_end_in_an_ellipsis(qtbot, pane):
    """p1: an empty conversation list says what will appear there; p4: a long title is elided with "…"."""
    qtbot.waitUntil(lambda: pane.conv_list.count() == 1, timeout=5000)
    hint = pane.conv_list.item(0)
    assert hint.text() == EMPTY_LIST_HINT and hint.flags() == Qt.ItemFlag.NoItemFlags
    assert listed(pane) == []
    pane.conv_list.setCurrentRow(0)
    assert pane.current_conversation_id() is None
    long = "Question 3: explain NUMA binding and PCIe swaps in detail, with numbers for every step please"
    cid = pane.store.create_conversation()
    pane.store.add_message(cid, "user", long)
    pane.reload_list()
    qtbot.waitUntil(lambda: len(listed(pane)) == 1 and pane.conv_list.count() == 1, timeout=5000)
    pane.open_conversation(cid)
    qtbot.waitUntil(lambda: pane.title_label.text() == hist.title_from(long), timeout=5000)
    pane.resize(320, 700)
    qtbot.waitUntil(lambda: QLabel.text(pane.title_label).endswith("…"), timeout=5000)   # what is painted
    shown = QLabel.text(pane.title_label)
    assert hist.title_from(long).startswith(shown[:-1])
    assert pane.title_label.fontMetrics().horizontalAdvance(shown) <= pane.title_label.width()
    assert pane.title_label.toolTip() == hist.title_from(long)


def test_request_options_set_in_the_pane_reach_the_engine_and_are_stored(qtbot, monkeypatch, recording_engine):
    """Temperature, reasoning effort and reproducible set in the Options box are what the engine receives, as
    top-level keys, with max_tokens from the DSV41_DEFAULT_MAX_TOKENS setting; the answer keeps them."""
    monkeypatch.setenv("DSV41_DEFAULT_MAX_TOKENS", "777")
    ctx = AppContext(load_settings())
    p = ChatPane(ctx)
    qtbot.addWidget(p)
    p.resize(520, 900)
    p.show()
    qtbot.waitUntil(lambda: p.store is not None, timeout=10000)
    ready(ctx, recording_engine.base_url, "k" * 24)
    qtbot.waitUntil(lambda: recording_engine.MODEL in p.engine_label.text(), timeout=5000)
    qtbot.mouseClick(p.options_toggle, Qt.MouseButton.LeftButton)
    assert p.options_box.isVisibleTo(p)
    assert p.max_tokens.value() == 777 and "777 tokens" in p.options_toggle.text()
    p.temperature.setValue(0.7)
    p.effort.setCurrentIndex(p.effort.findData("high"))
    box = QStyleOptionButton()
    p.reproducible.initStyleOption(box)                     # a check box takes clicks on its box and label only
    hit = p.reproducible.style().subElementRect(QStyle.SubElement.SE_CheckBoxClickRect, box, p.reproducible)
    qtbot.mouseClick(p.reproducible, Qt.MouseButton.LeftButton, pos=hit.center())
    assert p.reproducible.isChecked()
    assert "temperature 0.7" in p.options_toggle.text() and "reasoning high" in p.options_toggle.text()
    p.composer.setPlainText("Which options did you get?")
    qtbot.keyClick(p.composer, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: p.streaming_count() == 0 and "Recorded and answered." in doc(p), timeout=20000)
    [body] = recording_engine.bodies
    assert body["max_tokens"] == 777 and body["temperature"] == 0.7
    assert body["reasoning_effort"] == "high" and body["strata_reproducible"] is True
    assert "extra_body" not in body and body["model"] == recording_engine.MODEL
    assert body["messages"][-1] == {"role": "user", "content": "Which options did you get?"}
    cid = p.current_conversation_id()
    _q, a = p.store.messages(cid)
    assert a.status == hist.STATUS_COMPLETE and a.content == "Recorded and answered."
    assert a.reasoning == "Thinking it over. " and a.model == recording_engine.MODEL
    assert {k: a.options[k] for k in ("max_tokens", "temperature", "reasoning_effort", "reproducible")} == \
        {"max_tokens": 777, "temperature": 0.7, "reasoning_effort": "high", "reproducible": True}
    assert p.store.get_conversation(cid).options == a.options
    p.shutdown()


def test_a_system_prompt_set_in_the_pane_is_sent_first_and_kept_with_the_conversation(qtbot, pane, ctx,
                                                                                      recording_engine):
    """The Options box's system prompt goes as the first message of every request of the conversation, is stored
    with it, and comes back in the box when the conversation is opened again (and not into another one)."""
    ready(ctx, recording_engine.base_url, "k" * 24)
    qtbot.waitUntil(lambda: recording_engine.MODEL in pane.engine_label.text(), timeout=5000)
    qtbot.mouseClick(pane.options_toggle, Qt.MouseButton.LeftButton)
    assert pane.system_prompt.isVisibleTo(pane)
    qtbot.mouseClick(pane.system_prompt.viewport(), Qt.MouseButton.LeftButton)
    qtbot.keyClicks(pane.system_prompt, "Answer in one line.")
    assert "system prompt" in pane.options_toggle.text()
    for text in ("First question", "Second question"):
        pane.composer.setPlainText(text)
        qtbot.keyClick(pane.composer, Qt.Key.Key_Return)
        qtbot.waitUntil(lambda: pane.streaming_count() == 0 and doc(pane).count("Recorded and answered.") ==
                        len(recording_engine.bodies), timeout=20000)
    first, second = (b["messages"] for b in recording_engine.bodies)
    assert first == [{"role": "system", "content": "Answer in one line."},
                     {"role": "user", "content": "First question"}]
    assert second[0] == {"role": "system", "content": "Answer in one line."} and len(second) == 4
    cid = pane.current_conversation_id()
    assert pane.store.get_conversation(cid).options["system"] == "Answer in one line."
    # another conversation with its own (no) system prompt, then back: the box follows the conversation shown
    other = pane.store.create_conversation(options={"max_tokens": 100})
    pane.open_conversation(other)
    qtbot.waitUntil(lambda: pane.max_tokens.value() == 100, timeout=5000)
    assert pane.system_prompt.toPlainText() == "" and "system prompt" not in pane.options_toggle.text()
    pane.open_conversation(cid)
    qtbot.waitUntil(lambda: pane.system_prompt.toPlainText() == "Answer in one line.", timeout=5000)
