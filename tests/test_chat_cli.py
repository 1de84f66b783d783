"""``dsv41 chat`` and ``dsv41 history`` as real processes against the scripted engine."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time

from chat_support import ROOT

from engine_manager import history as hist
from engine_manager.sim import corpus


def env_for(sim=None, key=None, port=None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if sim is not None:
        env["DSV41_PORT"] = str(sim.port)
        env["DSV41_API_KEY"] = key or sim.api_key
    if port is not None:
        env["DSV41_PORT"] = str(port)
    return env


def dsv41(*args, env, timeout=60, input=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine_manager", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, input=input)


def test_chat_streams_reasoning_then_answer_and_prints_stats(shared_sim):
    r = dsv41("chat", "--max-tokens", "400", "--reasoning-effort", "high", "--reproducible",
              "Explain expert offload on one GPU", env=env_for(shared_sim))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    # not a tty: the parts are labelled instead of dimmed
    assert "\x1b[" not in out
    assert out.index("[reasoning]") < out.index("[answer]")
    answer = out.split("[answer]", 1)[1]
    # the scripted engine's canned answer for the question's topic (engine_manager.sim.corpus), labelled as such
    said, offload = corpus.sentences(answer), corpus.topic_named("offload")
    assert corpus.topic_of("Explain expert offload on one GPU") is offload
    assert said[0] == corpus.LABEL and len(said) >= 2 and set(said[1:]) <= set(offload.answer) | {corpus.CLOSER}
    thought = corpus.sentences(out.split("[answer]", 1)[0].split("[reasoning]", 1)[1])
    assert thought[0] == offload.reasoning[0] and set(thought) <= set(offload.reasoning)
    assert "tokens" in r.stderr and "tok/s" in r.stderr and "first token" in r.stderr
    assert "saved as conversation 1" in r.stderr
    store = hist.HistoryStore()
    q, a = store.messages(1)
    assert q.content == "Explain expert offload on one GPU" and a.content.strip() == answer.strip()
    assert a.options["reasoning_effort"] == "high" and a.options["reproducible"] is True


def test_chat_dims_reasoning_on_a_terminal(shared_sim):
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "engine_manager", "chat", "--max-tokens", "60", "hello there"],
                            env=env_for(shared_sim), cwd=ROOT, stdout=slave, stderr=subprocess.PIPE)
    os.close(slave)
    data = b""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        r, _, _ = select.select([master], [], [], 0.5)
        if r:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            data += chunk
        elif proc.poll() is not None:
            break
    proc.wait(30)
    os.close(master)
    text = data.decode("utf-8", "replace")
    assert proc.returncode == 0
    assert "\x1b[2m" in text and "\x1b[0m" in text            # reasoning dimmed, then reset for the answer
    assert text.index("\x1b[2m") < text.index("\x1b[0m")
    assert "[reasoning]" not in text


def test_chat_continues_a_conversation_and_reads_stdin(shared_sim):
    env = env_for(shared_sim)
    assert dsv41("chat", "--max-tokens", "30", "first question", env=env).returncode == 0
    r = dsv41("chat", "--conversation", "1", "--no-reasoning", "--max-tokens", "30", env=env,
              input="a follow-up from stdin\n")
    assert r.returncode == 0, r.stderr
    assert "[reasoning]" not in r.stdout
    msgs = hist.HistoryStore().messages(1)
    assert [m.role for m in msgs] == ["user", "assistant", "user", "assistant"]
    assert msgs[2].content == "a follow-up from stdin\n"
    r = dsv41("chat", "--conversation", "99", "x", env=env)
    assert r.returncode == 1 and "no conversation 99" in r.stderr


def test_chat_errors_in_plain_words_and_leave_no_error_conversations(shared_sim, free_port):
    r = dsv41("chat", "hello", env=env_for(shared_sim, key="wrong-key-0123456789"))
    assert r.returncode == 1
    assert "refused the API key (HTTP 401)" in r.stderr and "DSV41_API_KEY" in r.stderr
    assert "wrong-key-0123456789" not in r.stderr + r.stdout
    assert "Nothing was saved" in r.stderr and "run the same command again" in r.stderr
    r = dsv41("chat", "hello", env=env_for(port=free_port))
    assert r.returncode == 1 and "No engine answers" in r.stderr and "Start the engine" in r.stderr
    assert "`dsv41 start`" in r.stderr and "engine start" not in r.stderr          # m2
    # m13: two failed chats, no "[error]" conversation
    r = dsv41("history", "list", env=env_for())
    assert r.returncode == 0 and r.stdout.startswith("No saved conversations"), r.stdout
    # a saved conversation keeps exactly what it had when a follow-up fails
    assert dsv41("chat", "--max-tokens", "10", "first", env=env_for(shared_sim)).returncode == 0
    r = dsv41("chat", "--conversation", "1", "second", env=env_for(port=free_port))
    assert r.returncode == 1 and "Nothing was saved" in r.stderr
    assert [m.content for m in hist.HistoryStore().messages(1)][0] == "first"
    assert len(hist.HistoryStore().messages(1)) == 2


def test_chat_refuses_a_program_the_panel_did_not_start(foreign_server, free_port):
    """m3: something else holds the settings' port: refused in plain words, exit 1, and it gets nothing — no
    request, so no API key. --url still reaches it when the user names it."""
    srv = foreign_server(free_port)
    env = env_for(port=free_port)
    env["DSV41_API_KEY"] = "secret-key-0123456789abcdef"
    r = dsv41("chat", "hello", env=env)
    assert r.returncode == 1, r.stderr
    assert f"Port {free_port} is held by pid {srv.proc.pid}" in r.stderr and "http.server" in r.stderr
    assert "not by an engine this panel started" in r.stderr and "not your API key" in r.stderr
    assert "dsv41 settings set port" in r.stderr and f"--url http://127.0.0.1:{free_port}" in r.stderr
    assert "secret-key-0123456789abcdef" not in r.stderr + r.stdout
    assert srv.requests() == []
    assert hist.HistoryStore().list_conversations() == []
    r = dsv41("chat", "--url", srv.base_url, "hello", env=env)
    assert r.returncode == 1 and "HTTP 501" in r.stderr and "web page" in r.stderr
    assert "<html" not in r.stderr.lower() and "Nothing was saved" in r.stderr
    assert any("POST /v1/chat/completions" in ln for ln in srv.requests())
    r = dsv41("chat", "--url", "localhost:8080", "hello", env=env)
    assert r.returncode == 2 and "--url must be" in r.stderr


def test_chat_talks_to_the_engine_the_panel_started(panel_sim):
    env = env_for()                   # the settings' own key, saved when the panel started the engine
    r = dsv41("chat", "--max-tokens", "30", "hello there", env=env)
    assert r.returncode == 0, r.stderr
    assert "saved as conversation 1" in r.stderr
    assert hist.HistoryStore().messages(1)[1].status == hist.STATUS_COMPLETE


def test_chat_refuses_bad_arguments(capsys):
    rc, _, err = cli(capsys, "chat", "--reasoning-effort", "extreme", "hello")
    assert rc == 2 and "must be one of" in err
    rc, _, err = cli(capsys, "chat", "--max-tokens", "0", "hello")
    assert rc == 2 and "--max-tokens must be 1 or more" in err
    rc, _, err = cli(capsys, "chat", "   ")
    assert rc == 2 and "nothing to send" in err


def test_chat_interrupted_by_the_engine_dying_exits_1_and_keeps_the_start(start_sim):
    sim = start_sim("--die-after-tokens", "15")
    r = dsv41("chat", "--max-tokens", "300", "Explain expert offload", env=env_for(sim))
    assert r.returncode == 1
    assert "stopped while answering" in r.stderr and "partial answer is saved" in r.stderr
    a = hist.HistoryStore().messages(1)[1]
    assert a.status == hist.STATUS_INTERRUPTED and (a.reasoning or a.content)
    # m6: the tokens that arrived, not 0; and what to do in a terminal (no Regenerate button here)
    n = a.stats["completion_tokens"]
    assert 0 < n <= 15 and f"[{n} tokens arrived" in r.stderr
    assert "run the same command again, or `dsv41 chat --conversation 1" in r.stderr
    assert "Regenerate" not in r.stderr
    show = dsv41("history", "show", "1", env=env_for())
    assert f"_{n} tokens" in show.stdout and "interrupted" in show.stdout


def test_ctrl_c_stops_cleanly_and_saves(start_sim):
    sim = start_sim("--reply-tokens", "3000", speed=1.0)
    proc = subprocess.Popen([sys.executable, "-m", "engine_manager", "chat", "--max-tokens", "3000", "long one"],
                            env=env_for(sim), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        got = proc.stdout.read(200)             # the answer is streaming
        assert got
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    assert "stopped" in err and "saved in conversation 1" in err
    a = hist.HistoryStore().messages(1)[1]
    assert a.status == hist.STATUS_STOPPED and (a.content or a.reasoning)


def cli(capsys, *args) -> tuple[int, str, str]:
    """The same ``dsv41`` entry point, in this process (the history commands need no terminal of their own)."""
    from engine_manager.cli import main
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def test_history_commands(shared_sim, capsys, monkeypatch):
    monkeypatch.setenv("DSV41_PORT", str(shared_sim.port))
    monkeypatch.setenv("DSV41_API_KEY", shared_sim.api_key)
    assert cli(capsys, "history", "list")[1].startswith("No saved conversations")
    assert cli(capsys, "chat", "--max-tokens", "40", "Tell me about NUMA binding")[0] == 0
    assert cli(capsys, "chat", "--max-tokens", "40", "And the KV cache?")[0] == 0
    rc, out, _ = cli(capsys, "history", "list")
    assert rc == 0 and "Tell me about NUMA binding" in out and "And the KV cache?" in out
    listed = json.loads(cli(capsys, "history", "list", "--json")[1])
    assert {c["id"] for c in listed} == {1, 2}
    rc, out, _ = cli(capsys, "history", "show", "1")
    assert rc == 0 and out.startswith("# Tell me about NUMA binding") and "## Assistant" in out
    data = json.loads(cli(capsys, "history", "export", "2", "--format", "json")[1])
    assert data["messages"][0]["content"] == "And the KV cache?"
    rc, out, _ = cli(capsys, "history", "search", "numa")
    assert rc == 0 and "Tell me about NUMA binding" in out
    assert cli(capsys, "history", "search", "nothing-like-this")[0] == 1
    assert cli(capsys, "history", "rename", "1", "NUMA notes")[0] == 0
    assert "NUMA notes" in cli(capsys, "history", "list")[1]
    rc, _, err = cli(capsys, "history", "delete", "1")
    assert rc == 2 and "not a terminal" in err and "add --yes" in err     # nobody to ask: refused, kept
    assert len(hist.HistoryStore().list_conversations()) == 2
    assert cli(capsys, "history", "delete", "1", "--yes")[0] == 0
    rc, _, err = cli(capsys, "history", "show", "1")
    assert rc == 1 and "no conversation 1" in err                         # p10: a failure, not a usage error
    rc, _, err = cli(capsys, "history", "rename", "2", "  ")
    assert rc == 2 and "empty" in err


def _delete_on_a_terminal(cid: int, answer: bytes) -> tuple[int, str]:
    """``dsv41 history delete ID`` with a terminal on standard input; answers the prompt with ``answer``."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "engine_manager", "history", "delete", str(cid)],
                            env=env_for(), cwd=ROOT, stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    data = b""
    deadline = time.monotonic() + 30
    answered = False
    try:
        while time.monotonic() < deadline:
            r, _, _ = select.select([master], [], [], 0.2)
            if r:
                try:
                    chunk = os.read(master, 4096)
                except OSError:
                    break
                if not chunk:
                    break
                data += chunk
                if not answered and b"[y/N]" in data:
                    os.write(master, answer)
                    answered = True
            elif proc.poll() is not None:
                break
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    return proc.returncode, data.decode("utf-8", "replace")


def test_history_delete_asks_on_a_terminal():
    """p10: without --yes, on a terminal, it asks y/N (and keeps the conversation unless told yes)."""
    store = hist.HistoryStore()
    cid = store.create_conversation("keep me?")
    store.add_message(cid, "user", "hello")
    rc, text = _delete_on_a_terminal(cid, b"n\n")
    assert "Delete conversation 1 'keep me?' (1 messages)? This cannot be undone. [y/N]" in text
    assert rc == 1 and "kept conversation 1" in text
    assert [c.id for c in store.list_conversations()] == [cid]
    rc, text = _delete_on_a_terminal(cid, b"y\n")
    assert rc == 0 and "deleted conversation 1" in text
    assert store.list_conversations() == []


def test_history_export_to_a_file(shared_sim, tmp_path):
    env = env_for(shared_sim)
    r = dsv41("chat", "--json", "--max-tokens", "20", "hello", env=env)
    assert r.returncode == 0
    saved = json.loads(r.stdout)                           # --json: nothing but the JSON on stdout
    assert saved["conversation_id"] == 1 and saved["message"]["status"] == "complete"
    assert saved["message"]["stats"]["completion_tokens"] == 20
    target = tmp_path / "chat.md"
    r = dsv41("history", "export", "1", "--format", "md", "-o", str(target), env=env)
    assert r.returncode == 0 and target.read_text().startswith("# hello")
    assert oct(target.stat().st_mode & 0o777) == "0o600"


RECORDER = r"""
import socket, sys, threading
port, out = int(sys.argv[1]), sys.argv[2]
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", port))
srv.listen(16)
print("LISTENING", flush=True)
lock = threading.Lock()
def serve(conn):
    conn.settimeout(2.0)
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                break
            data += chunk
        try:
            data += conn.recv(65536)
        except OSError:
            pass
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
    except OSError:
        pass
    finally:
        with lock, open(out, "ab") as f:        # every byte any client sent: headers and body
            f.write(b"--- connection ---\n" + data + b"\n")
        conn.close()
while True:
    c, _ = srv.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


def test_after_the_panels_engine_died_a_stranger_on_its_port_gets_no_key_and_no_question(panel_sim, tmp_path):
    """start, kill -9 the engine, another program listens on the port. `dsv41 chat` sent
    ``Authorization: Bearer <key>`` and the question to it, `dsv41 monitor --once` four more requests: the state
    file still said "started by the panel" at that address. Now the listener must BE the recorded engine (its pid,
    or a process of its group): nothing is sent, and both commands say why in plain words."""
    from engine_manager.settings import load_settings
    import psutil

    key = load_settings().settings.api_key
    port = panel_sim.port
    os.kill(panel_sim.pid, signal.SIGKILL)
    keeper = psutil.Process(panel_sim.keeper_pid)
    keeper.wait(timeout=30)
    rec_file = tmp_path / "received.bin"
    rec_file.write_bytes(b"")
    stranger = subprocess.Popen([sys.executable, "-c", RECORDER, str(port), str(rec_file)], stdout=subprocess.PIPE,
                                text=True, start_new_session=True)
    try:
        assert stranger.stdout.readline().strip() == "LISTENING"
        question = "what is my bank password q8Zr"
        r = dsv41("chat", question, env=env_for())
        assert r.returncode == 1, r.stdout + r.stderr
        assert f"Port {port} is held by pid {stranger.pid}" in r.stderr, r.stderr
        assert "not your question, not your API key" in r.stderr and "not running any more" in r.stderr
        m = dsv41("monitor", "--once", env=env_for())
        assert m.returncode == 1, m.stdout + m.stderr
        assert "dsv41 monitor:" in m.stderr and f"held by pid {stranger.pid}" in m.stderr
        assert key not in r.stderr + r.stdout + m.stderr + m.stdout
        got = rec_file.read_bytes()
        assert key.encode() not in got and question.encode() not in got and b"Authorization" not in got
        assert got == b"", got[:300]                 # not even a connection
    finally:
        os.killpg(stranger.pid, signal.SIGKILL)
        stranger.wait(timeout=10)


# ------------------------------------------------------------------------------------------------ a conversation
class Terminal:
    """``dsv41 chat`` in a real pseudo-terminal that is its controlling terminal (``setsid -c``), so typed keys
    arrive as a person's do: Enter, Ctrl+C (SIGINT from the terminal), Ctrl+D (end of input)."""

    def __init__(self, args: list[str], env: dict[str, str]):
        from terminal_sigint import popen_interruptible

        self.master, slave = pty.openpty()
        env = dict(env, TERM="dumb")
        self.proc = popen_interruptible(["setsid", "-c", sys.executable, "-m", "engine_manager", *args], env=env,
                                        cwd=ROOT, stdin=slave, stdout=slave, stderr=slave)
        os.close(slave)
        self.out = ""
        self.seen = 0                    # what expect() has looked past

    def read(self, timeout: float = 0.2) -> None:
        r, _, _ = select.select([self.master], [], [], timeout)
        if r:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:
                return
            self.out += chunk.decode("utf-8", "replace")

    def expect(self, text: str, timeout: float = 60) -> str:
        """Wait for ``text`` after what was already matched; returns the output up to it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            i = self.out.find(text, self.seen)
            if i >= 0:
                got, self.seen = self.out[self.seen:i + len(text)], i + len(text)
                return got
            self.read()
        raise AssertionError(f"no {text!r} within {timeout} s; the terminal shows:\n{self.out[-3000:]}")

    def type(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def close(self) -> int:
        deadline = time.monotonic() + 30
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.read()
        if self.proc.poll() is None:
            self.proc.kill()
        rc = self.proc.wait(10)
        os.close(self.master)
        return rc


def test_an_interactive_chat_at_a_terminal(start_sim, tmp_path):
    """``dsv41 chat`` with no message at a terminal: questions and answers kept in one conversation of the history,
    /help, /system, /save FILE, /new; Ctrl+C at the prompt clears the line, during an answer stops it (saved, the
    conversation goes on); Ctrl+D leaves with 0."""
    sim = start_sim("--reply-tokens", "400", speed=2.0)
    term = Terminal(["chat", "--max-tokens", "400"], env_for(sim))
    try:
        term.expect("Ctrl+D leaves")
        term.expect("you> ")
        term.type("/help\r")
        assert "/system TEXT" in term.expect("you> ")
        term.type("First question about expert offload\r")
        said = term.expect("you> ")
        assert "conversation 1]" in said and "tok/s" in said
        # Ctrl+C at the prompt: the line is dropped. A ^C that lands between the prompt being written and readline
        # waiting for a key is taken by Python but wakes nothing until the next key (CPython's readline hook);
        # a user presses it again, and so does the test until the words come
        for _ in range(10):
            term.type("\x03")
            try:
                term.expect("(Ctrl+D or /quit leaves)", timeout=6)
                break
            except AssertionError:
                continue
        else:
            raise AssertionError(f"Ctrl+C at the prompt never answered; the terminal shows:\n{term.out[-3000:]}")
        term.expect("you> ")
        term.type("/system Answer like a pirate.\r")
        assert "system prompt set" in term.expect("you> ")
        term.type("Second question, a long one\r")
        term.expect("\x1b[2m")                                     # the answer streams (its reasoning, dimmed)
        term.type("\x03")                                          # Ctrl+C: stop this answer, stay in the chat
        said = term.expect("you> ")
        assert "[stopped:" in said and "saved in conversation 1" in said
        term.type(f"/save {tmp_path / 'conv.md'}\r")
        assert "wrote" in term.expect("you> ")
        term.type("/new\r")
        term.expect("you> ")
        term.type("Third question\r")
        assert "conversation 2]" in term.expect("you> ")
        term.type("\x04")                                          # Ctrl+D: leave
        rc = term.close()
    finally:
        if term.proc.poll() is None:
            term.proc.kill()
    assert rc == 0, term.out[-2000:]
    store = hist.HistoryStore()
    first = store.get_conversation(1)
    assert [(m.role, m.status) for m in first.messages] == [
        ("user", hist.STATUS_COMPLETE), ("assistant", hist.STATUS_COMPLETE),
        ("user", hist.STATUS_COMPLETE), ("assistant", hist.STATUS_STOPPED)]
    assert first.messages[0].content == "First question about expert offload"
    assert first.options["system"] == "Answer like a pirate." and "system" not in first.messages[1].options
    assert first.messages[3].options["system"] == "Answer like a pirate."
    saved = (tmp_path / "conv.md").read_text()
    assert "## System prompt\n\nAnswer like a pirate." in saved and "Second question, a long one" in saved
    second = store.get_conversation(2)                             # /new: a conversation of its own, no system
    assert [m.role for m in second.messages] == ["user", "assistant"] and "system" not in second.options


def test_the_system_prompt_reaches_the_engine_and_stays_with_the_conversation(recording_engine):
    env = env_for()
    env["DSV41_API_KEY"] = "k" * 24
    url = recording_engine.base_url
    r = dsv41("chat", "--url", url, "--system", "Be brief.", "first", env=env)
    assert r.returncode == 0, r.stderr
    r = dsv41("chat", "--url", url, "--conversation", "1", "second", env=env)     # kept: no --system needed
    assert r.returncode == 0, r.stderr
    r = dsv41("chat", "--url", url, "--conversation", "1", "--system", "", "third", env=env)   # removed
    assert r.returncode == 0, r.stderr
    first, second, third = (b["messages"] for b in recording_engine.bodies)
    assert first == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "first"}]
    assert second[0] == {"role": "system", "content": "Be brief."} and second[-1]["content"] == "second"
    assert all(m["role"] != "system" for m in third) and third[-1]["content"] == "third"
    assert "system" not in hist.HistoryStore().get_conversation(1).options
    assert all(m.role != "system" for m in hist.HistoryStore().messages(1))     # an option, never a message
