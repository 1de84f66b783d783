"""The shared caps on what a server may send (engine_manager.engines._http.get_capped) and the terminal escape
(engine_manager.fmt.terminal_safe), against real loopback servers that misbehave on purpose."""

from __future__ import annotations

import gzip
import threading
import time

import httpx
import pytest

from engine_manager.engines._http import AnswerTooLarge, AnswerTooSlow, get_capped
from engine_manager.fmt import terminal_safe
from loopback_http import LoopbackServer, QuietHandler

STOP = threading.Event()


class Hostile(QuietHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/ok":
            self._send(200, "application/json", b'{"status": "ok"}')
        elif self.path == "/endless":            # no length, bytes for ever (until the client hangs up)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Connection", "close")
            self.end_headers()
            try:
                while not STOP.is_set():
                    self.wfile.write(b"x" * 65536)
            except OSError:
                return
        elif self.path == "/declared":           # a huge declared length, nothing sent
            self.send_response(200)
            self.send_header("Content-Length", str(10**12))
            self.end_headers()
        elif self.path == "/drip":               # headers at once, then a byte a second
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            try:
                for _ in range(120):
                    if STOP.is_set():
                        return
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.5)
            except OSError:
                return
        elif self.path == "/bomb":               # 50 MB of zeros, gzipped to ~50 kB
            body = gzip.compress(b"\0" * 50_000_000)
            self.send_response(200)
            self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)


@pytest.fixture(scope="module")
def hostile():
    srv = LoopbackServer(Hostile)
    yield srv.base_url
    STOP.set()
    srv.stop()


def test_a_normal_answer_reads_whole(hostile):
    with httpx.Client() as c:
        r = get_capped(c, hostile + "/ok")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


@pytest.mark.parametrize("path", ["/endless", "/declared", "/bomb"])
def test_a_body_past_the_cap_is_refused_in_words(hostile, path):
    with httpx.Client() as c, pytest.raises(AnswerTooLarge, match=r"larger than 1 MB|expands past 1 MB"):
        get_capped(c, hostile + path, cap=1_000_000, deadline_s=60)


def test_a_dripping_server_is_cut_at_the_overall_deadline(hostile):
    # each byte arrives well within httpx's per-read timeout; only an overall deadline ends it
    with httpx.Client() as c, pytest.raises(AnswerTooSlow, match="did not arrive within 2 s"):
        get_capped(c, hostile + "/drip", deadline_s=2)


def test_answers_leave_no_deadline_behind_and_a_drip_beside_them_is_still_cut(hostile):
    """One shared thread keeps every request's deadline: a request that ends forgets its own (and its socket), and
    a dripping answer read beside many quick ones is still cut at its deadline."""
    from engine_manager.engines import _http

    with httpx.Client() as c:
        for _ in range(20):
            assert get_capped(c, hostile + "/ok").json() == {"status": "ok"}
        assert _http._DEADLINES.pending() == 0
        slow: list[BaseException] = []

        def drip() -> None:
            try:
                with httpx.Client() as c2:
                    get_capped(c2, hostile + "/drip", deadline_s=2)
            except BaseException as exc:  # noqa: BLE001 - the test reads what it was
                slow.append(exc)
        t = threading.Thread(target=drip)
        t.start()
        while t.is_alive():
            get_capped(c, hostile + "/ok")
        t.join()
    assert len(slow) == 1 and isinstance(slow[0], AnswerTooSlow), slow
    assert _http._DEADLINES.pending() == 0


def test_an_earlier_deadline_added_while_the_thread_waits_for_a_later_one_is_kept():
    import socket

    from engine_manager.engines._http import _Deadlines

    d = _Deadlines()
    late_a, late_b = socket.socketpair()
    soon_a, soon_b = socket.socketpair()
    late_fired, soon_fired = threading.Event(), threading.Event()
    try:
        late = d.add(3600.0, late_a, late_fired)      # the thread now waits for an hour
        d.add(0.05, soon_a, soon_fired)
        assert soon_fired.wait(30)
        soon_b.settimeout(30)
        assert soon_b.recv(1) == b""                  # its socket was shut down: the reader sees the end
        assert not late_fired.is_set() and d.pending() == 1
        d.cancel(late)
        assert d.pending() == 0
    finally:
        for s in (late_a, late_b, soon_a, soon_b):
            s.close()


def test_a_child_after_fork_has_deadlines_of_its_own(hostile):
    """A process forked while another thread of its parent held the deadline thread's lock still cuts a dripping
    answer at its deadline (the child gets an empty deadline keeper: the lock and the thread were the parent's)."""
    import os
    import signal

    from engine_manager.engines import _http

    with httpx.Client() as c:
        get_capped(c, hostile + "/ok")                    # the parent's deadline thread is running
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with _http._DEADLINES._cond:
            held.set()
            release.wait(60)
    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(30)
    pid = os.fork()
    if pid == 0:                                          # the child: its answer decides its exit status
        code = 1
        try:
            with httpx.Client() as c:
                get_capped(c, hostile + "/drip", deadline_s=1)
        except AnswerTooSlow:
            code = 0
        except BaseException:  # noqa: BLE001 - any other end is a failure, told by the status
            code = 2
        os._exit(code)
    release.set()
    holder.join()
    status = None
    for _ in range(600):                                  # up to a minute; it ends in about a second
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the child hung: the deadline keeper's lock was still its parent's")
    assert os.waitstatus_to_exitcode(status) == 0


def test_terminal_safe_escapes_control_characters():
    hostile_id = "model\x1b]0;pwned\x07\x1b[2J\rfake: pack is ready\u2028"
    out = terminal_safe(hostile_id)
    assert "\x1b" not in out and "\x07" not in out and "\r" not in out and "\u2028" not in out
    assert out == "model\\x1b]0;pwned\\x07\\x1b[2J\\x0dfake: pack is ready\\u2028"
    assert terminal_safe("two\nlines") == "two\nlines"
    assert terminal_safe("two\nlines", keep_newlines=False) == "two\\x0alines"
