"""engine_manager.history: the SQLite store, its crash recovery, search and export — and the acceptance check that
a chat killed mid-answer (SIGKILL of a real ``dsv41 chat`` process) leaves an intact history on restart."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time

import pytest
from chat_support import ROOT

from engine_manager import history as hist
from engine_manager import paths


def _conv(store, *pairs):
    cid = store.create_conversation()
    for role, text in pairs:
        store.add_message(cid, role, text)
    return cid


def test_file_is_owner_only_and_in_wal_mode():
    store = hist.HistoryStore()
    cid = _conv(store, ("user", "hi"))
    assert store.path == paths.data_dir() / "chat_history.sqlite3"
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600
    assert stat.S_IMODE(store.path.parent.stat().st_mode) == 0o700
    with store.connect() as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        # keep a reader open so the -wal/-shm files exist, and check their mode too
        conn.execute("BEGIN")
        conn.execute("SELECT * FROM messages").fetchall()
        store.add_message(cid, "user", "more")
        for suffix in ("-wal", "-shm"):
            side = store.path.with_name(store.path.name + suffix)
            assert side.exists() and stat.S_IMODE(side.stat().st_mode) == 0o600
        conn.execute("COMMIT")


def test_conversations_messages_titles_rename_delete():
    store = hist.HistoryStore()
    cid = store.create_conversation()
    assert store.get_conversation(cid).title == hist.DEFAULT_TITLE
    store.add_message(cid, "user", "\n\n## How do experts get placed in VRAM on a single workstation GPU today?\nmore")
    title = store.get_conversation(cid).title
    assert title.startswith("How do experts get placed") and len(title) <= hist.TITLE_CHARS
    store.add_message(cid, "assistant", "By frequency.", reasoning="think")
    store.add_message(cid, "user", "second")              # only the first message names it
    assert store.get_conversation(cid).title == title
    other = _conv(store, ("user", "another topic"))
    listed = store.list_conversations()
    assert [c.id for c in listed] == [other, cid]          # newest first
    assert listed[1].message_count == 3
    store.rename(cid, "  Placement  ")
    assert store.get_conversation(cid).title == "Placement"
    with pytest.raises(hist.HistoryError):
        store.rename(cid, "   ")
    store.delete(cid)
    assert [c.id for c in store.list_conversations()] == [other]
    with pytest.raises(hist.HistoryError, match="no conversation"):
        store.get_conversation(cid)
    with store.connect() as conn:
        assert conn.execute("SELECT COUNT(*) FROM messages WHERE conversation_id = ?", (cid,)).fetchone()[0] == 0


def test_context_leaves_out_reasoning_and_empty_answers():
    store = hist.HistoryStore()
    cid = _conv(store, ("user", "q1"))
    store.add_message(cid, "assistant", "a1", reasoning="secret thoughts")
    store.add_message(cid, "user", "q2")
    store.add_message(cid, "assistant", "", status=hist.STATUS_ERROR)
    store.add_message(cid, "user", "q3")
    ctx = store.context_messages(cid)
    assert ctx == [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
                   {"role": "user", "content": "q2"}, {"role": "user", "content": "q3"}]


def test_context_up_to_a_message_and_taking_a_question_back():
    """What run_turn needs to send a regenerate / edit without changing the history first, and to take a question
    back out when its answer never began."""
    store = hist.HistoryStore()
    cid = _conv(store, ("user", "q1"), ("assistant", "a1"), ("user", "q2"), ("assistant", "a2"))
    ids = [m.id for m in store.messages(cid)]
    assert store.context_messages(cid, through_id=ids[2]) == [
        {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
    assert len(store.context_messages(cid)) == 4
    store.delete_messages(cid, [ids[2], ids[3]])
    assert [m.content for m in store.messages(cid)] == ["q1", "a1"]
    assert store.get_conversation(cid).updated_at == store.messages(cid)[-1].updated_at
    with pytest.raises(hist.HistoryError, match="no conversation"):
        store.delete_messages(999, [1])
    # an answer another live process is writing cannot be replaced
    rec = store.begin_answer(cid)
    with pytest.raises(hist.HistoryError, match="still streaming"):
        store.refuse_if_streaming(cid, after=ids[0])
    rec.finish(hist.STATUS_COMPLETE, None)
    store.refuse_if_streaming(cid, after=ids[0])


def test_edit_and_regenerate_truncate():
    store = hist.HistoryStore()
    cid = _conv(store, ("user", "q1"), ("assistant", "a1"), ("user", "q2"), ("assistant", "a2"))
    ids = [m.id for m in store.messages(cid)]
    assert store.drop_trailing_answers(cid) == ids[2]
    assert [m.id for m in store.messages(cid)] == ids[:3]
    store.edit_message(cid, ids[0], "q1 edited")
    msgs = store.messages(cid)
    assert [(m.role, m.content) for m in msgs] == [("user", "q1 edited")]
    with pytest.raises(hist.HistoryError, match="Only your own"):
        aid = store.add_message(cid, "assistant", "x")
        store.edit_message(cid, aid, "y")
    assert store.drop_trailing_answers(store.create_conversation()) is None


def test_recorder_flushes_throttled_and_finish_records_everything():
    store = hist.HistoryStore()
    cid = _conv(store, ("user", "q"))
    rec = store.begin_answer(cid, options={"max_tokens": 5}, model="m")
    m = store.message(rec.message_id)
    assert m.status == hist.STATUS_STREAMING and m.model == "m" and m.options == {"max_tokens": 5}
    rec.add_reasoning("r1 ")
    assert not rec.due(3600) and rec.due(0)
    rec.flush()
    assert store.message(rec.message_id).reasoning == "r1 "
    rec.add_content("c1")
    assert store.message(rec.message_id).content == ""      # not flushed yet: at most one interval is at risk
    rec.finish(hist.STATUS_COMPLETE, {"completion_tokens": 2, "tok_s": 3.5}, None)
    m = store.message(rec.message_id)
    assert (m.status, m.reasoning, m.content, m.stats["tok_s"]) == (hist.STATUS_COMPLETE, "r1 ", "c1", 3.5)
    rec.add_content("late")
    rec.flush()                                              # after finish: ignored
    assert store.message(rec.message_id).content == "c1"


def test_recovery_marks_only_answers_whose_writer_is_gone():
    store = hist.HistoryStore()
    cid = _conv(store, ("user", "q"))
    mine = store.begin_answer(cid)                           # this process: alive
    gone = store.begin_answer(cid)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with store.connect() as conn:
        conn.execute("UPDATE messages SET writer_pid = ?, writer_started = ? WHERE id = ?",
                     (dead.pid, time.time() - 5, gone.message_id))
        conn.execute("UPDATE messages SET content = 'partial' WHERE id = ?", (gone.message_id,))
    again = hist.HistoryStore()
    assert again.recovered == 1
    assert again.message(gone.message_id).status == hist.STATUS_INTERRUPTED
    assert again.message(gone.message_id).content == "partial"
    assert again.message(mine.message_id).status == hist.STATUS_STREAMING
    # a pid that was reused by another process (start time differs) counts as gone
    with store.connect() as conn:
        conn.execute("UPDATE messages SET writer_started = ? WHERE id = ?", (1.0, mine.message_id))
    assert hist.HistoryStore().recovered == 1


def test_search_finds_titles_messages_and_reasoning():
    store = hist.HistoryStore()
    a = _conv(store, ("user", "NUMA binding question"), ("assistant", "Bind to node 0 with numactl"))
    b = _conv(store, ("user", "KV cache"))
    store.add_message(b, "assistant", "int8 is the default", reasoning="maybe mention numactl")
    c = _conv(store, ("user", "unrelated"))
    store.rename(c, "My numactl notes")
    hits = store.search("NUMACTL")
    assert sorted(h.conversation_id for h in hits) == sorted([a, b, c])
    ha = next(h for h in hits if h.conversation_id == a)
    assert ha.role == "assistant" and "numactl" in ha.snippet
    assert next(h for h in hits if h.conversation_id == c).message_id is None
    assert store.search("100%_literal") == []                 # LIKE wildcards are escaped
    _conv(store, ("user", "a 100%_literal thing"))
    assert len(store.search("100%_literal")) == 1
    assert store.search("   ") == []


def test_export_markdown_and_json():
    store = hist.HistoryStore()
    cid = _conv(store, ("user", "What is **Q2_K**?"))
    rec = store.begin_answer(cid, options={"max_tokens": 64})
    rec.add_reasoning("Think about quantisation.")
    rec.add_content("A 2-bit quantisation.\n\n```python\nprint(1)\n```")
    rec.finish(hist.STATUS_INTERRUPTED, {"completion_tokens": 12, "tok_s": 20.0, "ttft_s": 0.5},
               "The engine stopped while answering.")
    md = store.export_markdown(cid)
    assert md.startswith("# What is **Q2_K**?") or md.startswith("# What is")
    assert "## You" in md and "## Assistant" in md and "```python\nprint(1)\n```" in md
    assert "<details><summary>Reasoning</summary>" in md and "Think about quantisation." in md
    assert "12 tokens · 20.0 tok/s" in md and "interrupted: The engine stopped" in md
    data = store.export_json(cid)
    json.dumps(data)
    assert data["schema"] == 1 and data["id"] == cid
    assert [m["role"] for m in data["messages"]] == ["user", "assistant"]
    assert data["messages"][1]["status"] == "interrupted" and data["messages"][1]["stats"]["tok_s"] == 20.0


def test_a_corrupt_file_is_moved_aside_not_lost():
    path = paths.data_dir() / "chat_history.sqlite3"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"this is not a database" * 100)
    store = hist.HistoryStore()
    assert store.notices and "moved to" in store.notices[0]
    moved = [p for p in path.parent.iterdir() if p.name.startswith("chat_history.sqlite3.corrupt-")]
    assert moved and moved[0].read_bytes().startswith(b"this is not a database")
    assert store.list_conversations() == []
    _conv(store, ("user", "works again"))


def test_a_newer_schema_is_refused_in_plain_words():
    store = hist.HistoryStore()
    with store.connect() as conn:
        conn.execute("PRAGMA user_version = 99")
    with pytest.raises(hist.HistoryError, match="newer dsv41 panel"):
        hist.HistoryStore()


def _chat_env(sim) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"DSV41_PORT": str(sim.port), "DSV41_API_KEY": sim.api_key,
                "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")})
    return env


def test_killed_chat_process_leaves_history_intact(start_sim):
    """Acceptance: a process streaming an answer into the history is SIGKILLed mid-answer; on reopening, the
    question and the partial answer are there, marked interrupted, and the database is sound."""
    sim = start_sim("--reply-tokens", "3000", speed=1.0)
    store = hist.HistoryStore()
    before = _conv(store, ("user", "an older conversation"), ("assistant", "its answer"))
    proc = subprocess.Popen([sys.executable, "-m", "engine_manager", "chat", "--max-tokens", "3000",
                             "Explain expert offload on one GPU"], env=_chat_env(sim), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        partial = ""
        while time.monotonic() < deadline:
            convs = [c for c in store.list_conversations() if c.id != before]
            if convs:
                msgs = store.messages(convs[0].id)
                if len(msgs) == 2 and len(msgs[1].content.split()) >= 20:
                    partial = msgs[1].content
                    break
            time.sleep(0.1)
        assert partial, "the answer was not being saved as it streamed"
        assert proc.poll() is None
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    reopened = hist.HistoryStore()                # what the panel does on its next start
    assert reopened.recovered == 1
    with reopened.connect() as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    cid = next(c.id for c in reopened.list_conversations() if c.id != before)
    q, a = reopened.messages(cid)
    assert q.content == "Explain expert offload on one GPU"
    assert a.status == hist.STATUS_INTERRUPTED and "ended before it was complete" in a.error
    assert a.content.startswith(partial) and len(a.content) >= len(partial)
    assert [m.content for m in reopened.messages(before)] == ["an older conversation", "its answer"]
    # and the conversation continues: the interrupted partial answer is part of the context
    assert reopened.context_messages(cid)[-1] == {"role": "assistant", "content": a.content}
