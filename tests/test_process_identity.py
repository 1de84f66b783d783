"""Who a recorded pid is: its start since boot and the boot's id, which a clock step leaves alone.

psutil's ``create_time()`` on Linux is ``/proc/PID/stat``'s start (clock ticks since boot) plus the ``btime`` line
of ``/proc/stat``, which the kernel works out from the wall clock at each read, in whole seconds: a clock step moves
every process's ``create_time()``. A step is simulated here the way the library would see one: psutil reads its
``/proc`` from ``psutil.PROCFS_PATH`` (a documented setting), pointed at a folder that holds the real entries of
``/proc`` and a ``stat`` whose ``btime`` moved.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from engine_manager import history as hist
from engine_manager import procs
from engine_manager.engine_record import EngineRecord

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="the start since boot is Linux's")

OTHER_BOOT = "00000000-0000-4000-8000-000000000000"


@pytest.fixture
def clock_step(tmp_path, monkeypatch):
    """Call it with a number of seconds: from then on psutil sees the boot time moved by that much."""
    fake = tmp_path / "proc"
    fake.mkdir()

    def step(seconds: int) -> None:
        for name in os.listdir("/proc"):
            if name != "stat" and not (fake / name).is_symlink():
                (fake / name).symlink_to(f"/proc/{name}")
        lines = []
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                line = f"btime {int(line.split()[1]) + seconds}"
            lines.append(line)
        (fake / "stat").write_text("\n".join(lines) + "\n")
        monkeypatch.setattr(psutil, "PROCFS_PATH", str(fake))

    return step


@pytest.fixture
def child():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    yield p
    if p.poll() is None:
        p.kill()
    p.wait()


def _wall_start(pid: int) -> float:
    return psutil.Process(pid).create_time()


def test_a_clock_step_leaves_a_recorded_engine_ours(clock_step, child):
    started = procs.ctime_of(child.pid)
    wall = _wall_start(child.pid)
    rec = EngineRecord.model_validate({"keeper_pid": child.pid, "keeper_start_time": started,
                                       "pgid": child.pid, "boot_id": procs.BOOT_ID})
    assert rec.alive() and procs.alive(child.pid, started)
    clock_step(7)
    assert _wall_start(child.pid) == pytest.approx(wall + 7, abs=0.02)    # psutil sees the step
    assert procs.alive(child.pid, started)
    assert rec.alive()
    assert [p.pid for p in procs.group_members(child.pid, started)] == [child.pid]
    assert procs.ctime_of(child.pid) == started


def test_a_clock_step_leaves_this_panels_streaming_answer_its_own(clock_step, tmp_path):
    store = hist.HistoryStore(tmp_path / "history.sqlite3")
    cid = store.create_conversation("q")
    mine = store.begin_answer(cid)
    clock_step(5)
    again = hist.HistoryStore(store.path)
    assert again.recovered == 0
    assert again.message(mine.message_id).status == hist.STATUS_STREAMING


def test_a_record_from_another_boot_names_no_live_process(child):
    started = procs.ctime_of(child.pid)
    rec = EngineRecord.model_validate({"keeper_pid": child.pid, "keeper_start_time": started,
                                       "pgid": child.pid, "boot_id": OTHER_BOOT})
    assert not rec.alive()
    assert procs.group_members(child.pid, started, OTHER_BOOT) == []
    assert procs.kill_group(child.pid, started, boot=OTHER_BOOT) == 0
    assert child.poll() is None                                      # nobody killed what it did not start
    assert procs.kill_group(child.pid, started, boot=procs.BOOT_ID) == 1
    child.wait(10)                                  # reaped by kill_group's wait, or here
    assert not procs.alive(child.pid, started)


def test_a_reused_pid_is_another_process(child):
    started = procs.ctime_of(child.pid)
    assert started is not None
    assert not procs.alive(child.pid, started - 1.0)
    assert not procs.alive(child.pid, started + 0.01)                # one clock tick later: another process
    assert procs.group_members(child.pid, started - 1.0) == []
    assert not procs.alive(child.pid, "1x")                          # a damaged record names nobody


def test_an_older_panels_wall_clock_records_still_name_their_process(child):
    wall = _wall_start(child.pid)
    rec = EngineRecord.model_validate({"keeper_pid": child.pid, "keeper_start_time": wall, "pgid": child.pid})
    assert rec.alive()
    assert [p.pid for p in procs.group_members(child.pid, wall)] == [child.pid]
    assert not procs.alive(child.pid, wall - 1.0)


def test_the_start_is_read_past_a_command_name_with_parentheses_and_spaces():
    code = ("import sys, time\nopen('/proc/self/comm', 'w').write('a) b (c 1 2')\n"
            "print('named', flush=True)\ntime.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "named"
        assert psutil.Process(p.pid).name() == "a) b (c 1 2"
        ours = procs.ctime_of(p.pid)
        assert ours is not None
        assert ours == pytest.approx(_wall_start(p.pid) - psutil.boot_time(), abs=0.02)
    finally:
        p.kill()
        p.wait()
        if p.stdout is not None:
            p.stdout.close()
    assert procs.ctime_of(p.pid) is None                             # gone: no start


def test_history_rows_of_another_boot_or_an_older_panel(tmp_path):
    store = hist.HistoryStore(tmp_path / "history.sqlite3")
    cid = store.create_conversation("q")
    other = store.begin_answer(cid)
    legacy = store.begin_answer(cid)
    with store.connect() as conn:
        conn.execute("UPDATE messages SET writer_boot = ? WHERE id = ?", (OTHER_BOOT, other.message_id))
        conn.execute("UPDATE messages SET writer_started = ?, writer_boot = NULL WHERE id = ?",
                     (_wall_start(os.getpid()), legacy.message_id))
    again = hist.HistoryStore(store.path)
    assert again.recovered == 1
    assert again.message(other.message_id).status == hist.STATUS_INTERRUPTED
    assert again.message(legacy.message_id).status == hist.STATUS_STREAMING


def test_a_history_written_before_the_boot_column_is_opened_and_kept(tmp_path):
    path = tmp_path / "history.sqlite3"
    first = hist._SCHEMA.replace("    writer_boot     TEXT,", "")       # schema 1 as an older panel wrote it
    assert first != hist._SCHEMA
    now = time.time()
    conn = sqlite3.connect(path)
    with conn:
        conn.executescript(first)
        conn.execute("PRAGMA user_version = 1")
        conn.execute("INSERT INTO conversations (title, created_at, updated_at) VALUES ('old', ?, ?)", (now, now))
        conn.execute("INSERT INTO messages (conversation_id, role, content, status, writer_pid, writer_started, "
                     "created_at, updated_at) VALUES (1, 'assistant', 'half', 'streaming', ?, ?, ?, ?)",
                     (os.getpid(), _wall_start(os.getpid()), now, now))
    assert "writer_boot" not in {r[1] for r in conn.execute("PRAGMA table_info(messages)")}
    conn.close()
    os.chmod(path, 0o600)
    store = hist.HistoryStore(path)
    assert store.recovered == 0                             # an older panel's row of a live writer: still its own
    with store.connect() as c2:
        assert "writer_boot" in {r[1] for r in c2.execute("PRAGMA table_info(messages)")}
    assert [m.content for m in store.messages(1)] == ["half"]
    rec = store.begin_answer(1)
    assert store.message(rec.message_id).status == hist.STATUS_STREAMING


def test_the_state_file_records_the_boot(tmp_path):
    rec = EngineRecord.from_json(json.dumps({"keeper_pid": os.getpid(), "keeper_start_time":
                                             procs.ctime_of(os.getpid()), "boot_id": procs.BOOT_ID}).encode())
    assert rec.alive() and rec.to_json_dict()["boot_id"] == procs.BOOT_ID
    with pytest.raises(ValueError):
        EngineRecord.from_json(json.dumps({"boot_id": "x" * 65}).encode())


def test_a_zombie_is_not_alive_though_its_start_is_still_readable():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    started = procs.ctime_of(p.pid)
    try:
        for _ in range(2000):                               # not reaped: it stays a zombie once it has exited
            if psutil.Process(p.pid).status() == psutil.STATUS_ZOMBIE:
                break
            time.sleep(0.005)
        assert psutil.Process(p.pid).status() == psutil.STATUS_ZOMBIE
        assert procs.ctime_of(p.pid) == started
        assert not procs.alive(p.pid, started) and not procs.alive(p.pid)
        assert p.pid not in [q.pid for q in procs.group_members(os.getpgid(0))]
    finally:
        p.wait()


def test_the_uptime_is_counted_from_the_keepers_start_on_the_boot_clock(child, monkeypatch):
    from types import SimpleNamespace

    from engine_manager.engine_state import EngineStatus

    started = procs.ctime_of(child.pid)
    now = time.time()
    st = EngineStatus("ready", started_at=now, keeper_start=started)
    assert st.uptime_s() is not None and 0 <= st.uptime_s() < 60
    # procs' view of the time module with the wall clock set two hours back (the boot clock is the real one)
    stepped = SimpleNamespace(time=lambda: time.time() - 7200, clock_gettime=time.clock_gettime,
                              CLOCK_BOOTTIME=time.CLOCK_BOOTTIME)
    monkeypatch.setattr(procs, "time", stepped)
    assert 0 <= st.uptime_s() < 60
    assert EngineStatus("ready", started_at=now, keeper_start=None).uptime_s() == 0.0   # the wall clock's word
    assert EngineStatus("stopped", started_at=now, keeper_start=started).uptime_s() is None


def test_damaged_writer_values_in_the_history_name_nobody(tmp_path):
    store = hist.HistoryStore(tmp_path / "history.sqlite3")
    cid = store.create_conversation("q")
    rows = [store.begin_answer(cid) for _ in range(4)]
    damaged = [("abc", procs.ctime_of(os.getpid()), procs.BOOT_ID), (os.getpid(), "x", procs.BOOT_ID),
               (os.getpid(), procs.ctime_of(os.getpid()), 5), (True, procs.ctime_of(os.getpid()), procs.BOOT_ID)]
    with store.connect() as conn:
        for rec, (pid, started, boot) in zip(rows, damaged):
            conn.execute("UPDATE messages SET writer_pid = ?, writer_started = ?, writer_boot = ? WHERE id = ?",
                         (pid, started, boot, rec.message_id))
    again = hist.HistoryStore(store.path)
    assert again.recovered == 4
    assert {again.message(r.message_id).status for r in rows} == {hist.STATUS_INTERRUPTED}
