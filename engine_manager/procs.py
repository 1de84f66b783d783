"""Process, process-group and port helpers of the supervisor (psutil), the key's fingerprint, and the stop.

A pid is only "ours" with its recorded start time (a reused number is another process); a process group is only
ours while its leader started when we recorded. Command lines shown to people are masked.

The stop (:func:`terminate`): SIGTERM to the whole group, a grace period, then SIGKILL — an engine whose top process
stops its own children (``Engine.stop_leader_grace_s``: Strata's server sends its engine QUIT) gets one SIGTERM to
that process alone first, and the group only after that budget — and no process of the group (nor any descendant
that left it) is left. Never imports Qt.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Generator

import psutil

from .supervisor_events import Stopping

@dataclass(frozen=True)
class Capped:
    """What :func:`run_capped` got: the exit status (None: killed at its deadline or its cap), at most ``cap`` bytes
    of each stream, whether either was cut, and the program's pid (reaped: gone once this is returned)."""
    returncode: int | None
    stdout: bytes
    stderr: bytes
    cut: bool
    pid: int = 0


def run_capped(argv: list[str], *, timeout: float, cap: int, env: dict[str, str] | None = None,
               cwd: str | None = None) -> Capped:
    """Run ``argv`` (no stdin) and read its output with a cap: a program that writes without end is killed once it
    wrote ``cap`` bytes on either stream, and any is killed at ``timeout`` (``subprocess.run`` would hold all of
    its output in memory until then). Raises ``OSError`` when it cannot be started."""
    import selectors

    p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                         cwd=cwd, start_new_session=True)
    bufs = {"out": bytearray(), "err": bytearray()}
    cut = False
    end = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        assert p.stdout is not None and p.stderr is not None
        sel.register(p.stdout, selectors.EVENT_READ, "out")
        sel.register(p.stderr, selectors.EVENT_READ, "err")
        while sel.get_map() and not cut:
            left = end - time.monotonic()
            if left <= 0:
                cut = True
                break
            for key, _ in sel.select(min(left, 0.5)):
                chunk = os.read(key.fileobj.fileno(), 65536)   # type: ignore[union-attr]
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf = bufs[key.data]
                buf += chunk[:max(0, cap - len(buf))]
                if len(buf) >= cap:
                    cut = True
    if cut:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        rc = p.wait(5.0)
    except subprocess.TimeoutExpired:
        p.kill()
        rc = p.wait()
    p.stdout.close()
    p.stderr.close()
    return Capped(None if cut else rc, bytes(bufs["out"]), bytes(bufs["err"]), cut, p.pid)


# -- a process's start: who a pid is ---------------------------------------------------------------------------
# A pid names "our" process only together with the moment that process started. psutil's create_time() is not that
# moment's stable name on Linux: it adds the start (clock ticks since boot, /proc/PID/stat) to the boot time of
# /proc/stat, which the kernel works out from the wall clock at each read and rounds to whole seconds — a clock
# step (NTP, a person setting the time) moves every process's create_time() by whole seconds, and a recorded
# keeper would then read as another process. The start since boot never moves; with the boot's id it names one
# process for good.

LEGACY_WALL = 1e9           # a recorded start this large is a wall-clock time (seconds since 1970), as older
                            # panels recorded it; a start since boot would need 31 years of uptime to get there


def _read_boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            raw = f.read(100).strip().decode("ascii", "replace")
    except OSError:
        return None
    return raw if re.fullmatch(r"[0-9a-fA-F-]{8,64}", raw) else None


BOOT_ID: str | None = _read_boot_id()   # this boot's id (Linux); a start since boot is only compared within one


def _clock_ticks() -> int:
    try:
        return max(1, int(os.sysconf("SC_CLK_TCK")))
    except (ValueError, OSError, AttributeError):
        return 100


_TICKS = _clock_ticks()
_TOL = 0.5 / _TICKS         # two starts since boot are one when they fall in the same clock tick
_LEGACY_TOL = 0.05          # two wall-clock starts (psutil's create_time()), as older panels compared them


_PROCFS = os.path.isdir("/proc/self")
_GONE = (b"Z", b"X", b"x")                 # a zombie or a dead task: the state letter of /proc/PID/stat


def _stat(pid: int) -> tuple[bytes, float] | None:
    """The state letter and the ``starttime`` of ``/proc/PID/stat`` (its 3rd and 22nd fields; the start counted in
    clock ticks since boot, proc(5)), the start in seconds. None: no such process, or a line that does not parse.
    One read: what the supervisor's watch asks several times a second."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            raw = f.read(4096)
    except (OSError, ValueError):
        return None
    # the command name (field 2) sits in parentheses and may itself hold ')' or spaces: the fields after it are
    # counted from its last ')'; the 3rd field is the first one there, so the 22nd is the 20th
    _, sep, rest = raw.rpartition(b")")
    fields = rest.split()
    if not sep or len(fields) < 20 or not fields[19].isdigit():
        return None
    return fields[0], int(fields[19]) / _TICKS


def ctime_of(pid: int) -> float | None:
    """When ``pid`` started, as the supervisor records it: seconds since this boot on Linux (a clock step leaves
    it alone), psutil's ``create_time()`` elsewhere. None: no such process."""
    if _PROCFS:
        st = _stat(pid)
        return None if st is None else st[1]
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None


def _recorded(recorded: float | int | None, boot: str | None) -> float | None | bool:
    """A recorded start as a number (None: none recorded), or False when it names no process of this boot (another
    boot's, or a damaged value)."""
    if boot is not None and BOOT_ID is not None and boot != BOOT_ID:
        return False
    if recorded is None:
        return None
    try:
        return float(recorded)
    except (TypeError, ValueError):         # a hostile or damaged record names no process of ours
        return False


def alive(pid: int | None, ctime: float | None = None, boot: str | None = None) -> bool:
    """True when ``pid`` runs (not a zombie) and, if given, started at ``ctime`` (from :func:`ctime_of`) during the
    boot ``boot`` (None: not recorded) — not another process that got the number since. A ``ctime`` that is a
    wall-clock time (:data:`LEGACY_WALL`: a record of an older panel) is compared with psutil's ``create_time()``."""
    if not pid:
        return False
    rec = _recorded(ctime, boot)
    if rec is False:
        return False
    if _PROCFS and (rec is None or rec < LEGACY_WALL):
        st = _stat(pid)                     # state and start in one read
        return st is not None and st[0] not in _GONE and (rec is None or abs(st[1] - rec) < _TOL)
    try:
        p = psutil.Process(pid)
        if rec is not None and abs(p.create_time() - rec) > _LEGACY_TOL:
            return False
        return p.status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, OSError):
        return False


def boot_clock() -> float | None:
    """Seconds since this boot on the boot clock (``CLOCK_BOOTTIME``: the clock the starts of ``/proc/PID/stat``
    count on; one for every process of the machine, and no clock step moves it). None where there is none."""
    try:
        return time.clock_gettime(time.CLOCK_BOOTTIME)
    except (AttributeError, OSError):
        return None


def seconds_since(started: float | None, wall_started: float) -> float:
    """How long ago a process started: on the boot clock against its start since boot (:func:`ctime_of`), so a
    clock step changes nothing; on the wall clock from ``wall_started`` where ``started`` is a wall-clock time
    (an older panel's record) or there is no boot clock."""
    now = boot_clock() if _PROCFS and started is not None and 0 <= started < LEGACY_WALL else None
    if now is not None and started is not None:
        return max(0.0, now - started)
    return max(0.0, time.time() - wall_started)


def group_members(pgid: int, since: float | None = None, boot: str | None = None) -> list[psutil.Process]:
    """Live (non-zombie) processes whose process group is ``pgid`` (started at/after ``since``, the group
    leader's start from :func:`ctime_of`, during the boot ``boot`` when recorded).

    Safe against a reused number: Linux never hands out a pid that is still some group's id, so while any member of
    our old group lives, ``pgid`` cannot be a newer group. A *live* process with pid ``pgid`` that started at
    another time than ``since`` therefore leads a different group: nothing is returned for it."""
    if boot is not None and BOOT_ID is not None and boot != BOOT_ID:
        return []                           # recorded before the machine restarted: that group is gone
    legacy = since is not None and float(since) >= LEGACY_WALL
    tol = _LEGACY_TOL if legacy else _TOL
    if since is not None:
        try:
            lead = psutil.Process(pgid).create_time() if legacy else ctime_of(pgid)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            lead = None                     # the leader is gone: its group may still have members
        except (psutil.Error, OSError):
            return []
        if lead is not None and abs(lead - float(since)) > tol:
            return []
    out: list[psutil.Process] = []
    for pid in psutil.pids():
        try:
            if os.getpgid(pid) != pgid:     # one system call: the group first, the files of /proc only for members
                continue
            p = psutil.Process(pid)
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            if since is not None:
                start = p.create_time() if legacy else ctime_of(pid)
                if start is None or start < float(since) - tol:
                    continue
            out.append(p)
        except (ProcessLookupError, PermissionError, psutil.Error, OSError):
            continue
    return out


def live(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (psutil.Error, OSError):
            continue
    return out


def mask_cmdline(cmd: list[str]) -> list[str]:
    out: list[str] = []
    hide = False
    for a in cmd:
        if hide:
            out.append(a[:4] + "…(masked)")
            hide = False
            continue
        if a in ("--api-key", "--api_key", "-k", "--token", "--hf-token"):
            hide = True
        elif re.match(r"--(api[-_]key|token|hf[-_]token)=", a):
            k, _, v = a.partition("=")
            a = f"{k}={v[:4]}…(masked)"
        out.append(a)
    return out


def port_owner(host: str, port: int) -> dict[str, Any] | None:
    """Who listens on ``port`` (TCP): pid, name, masked command line, user; ``pid`` None when the OS hides it."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        conns = []
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port:
            info: dict[str, Any] = {"pid": c.pid, "address": f"{c.laddr.ip}:{c.laddr.port}"}
            if c.pid:
                try:
                    p = psutil.Process(c.pid)
                    info.update(name=p.name(), cmdline=mask_cmdline(p.cmdline()), user=p.username(),
                                create_time=p.create_time())
                except (psutil.Error, OSError):
                    pass
            return info
    return None


def describe_owner(info: dict[str, Any] | None) -> str:
    if not info:
        return "another program (the system does not say which)"
    if not info.get("pid"):
        return ("a process of another user (run `sudo ss -ltnp` to see which)")
    cmd = " ".join(info.get("cmdline") or [])
    if len(cmd) > 160:                  # cut between words (never inside a masked key), and say it was cut
        cmd = cmd[:160].rsplit(" ", 1)[0] + " …"
    return f"pid {info['pid']} ({info.get('name', '?')}{': ' + cmd if cmd else ''})"


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the kernel's pick), for an engine, a test server or a tunnel's local end."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_free(host: str, port: int) -> bool:
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def suggest_port(host: str, port: int) -> int | None:
    for p in range(port + 1, min(port + 50, 65535)):
        if port_free(host, p):
            return p
    return None


def key_fingerprint(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:12] if key else ""


def find_child(popen: subprocess.Popen, wait_s: float = 2.0) -> tuple[int | None, float | None]:
    """The keeper's child (the engine, after the binding prefix exec'd into it)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            kids = psutil.Process(popen.pid).children()
        except (psutil.Error, OSError):
            return None, None
        if kids:
            try:
                return kids[0].pid, ctime_of(kids[0].pid)
            except (psutil.Error, OSError):
                return None, None
        if popen.poll() is not None:
            return None, None
        time.sleep(0.003)
    return None, None


# -- the engine's process group: kill what is left, stop it ---------------------------------------------------

@dataclass(frozen=True)
class EngineGroup:
    """The processes of one engine: the keeper leads the group ``pgid`` and started at ``keeper_ctime``; the
    engine is its child. ``popen``: the keeper's handle when this process started it (then it is reaped here)."""

    pgid: int
    keeper_pid: int
    keeper_ctime: float
    engine_pid: int | None
    engine_ctime: float | None
    popen: subprocess.Popen | None = None


def wait_keeper(popen: subprocess.Popen | None, timeout: float = 5.0) -> None:
    """Reap the keeper this process started (at most ``timeout`` seconds)."""
    if popen is not None:
        try:
            popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass


def kill_group(pgid: int, since: float | None, not_waited: int | None = None, boot: str | None = None) -> int:
    """SIGKILL every live member of the group ``pgid`` (its leader started at ``since`` during ``boot``) and wait
    up to 3 s for them (but ``not_waited``: the keeper, which its starter reaps). Returns how many there were."""
    left = group_members(pgid, since, boot)
    for p in left:
        try:
            p.kill()
        except (psutil.Error, OSError):
            pass
    if left:
        psutil.wait_procs([p for p in left if p.pid != not_waited], timeout=3)
    return len(left)


def terminate(g: EngineGroup, grace: float, force: threading.Event, *, quiet: bool = False,
              leader_s: float = 0.0) -> Generator[Stopping, None, tuple[bool, list[int]]]:
    """SIGTERM the group (SIGKILL at once when ``grace`` is 0 or ``force`` is set), wait, then SIGKILL; every
    descendant too, also one that left the group. ``force`` set meanwhile (a Force stop) cuts the grace period
    short. ``leader_s`` > 0 (a stop asked for, of an engine that declares ``stop_leader_grace_s``): one SIGTERM to
    the engine's top process alone first, and the group only after that budget. Yields :class:`Stopping` (unless
    ``quiet``); returns ``(forced, leftover pids)``."""
    tracked: dict[int, psutil.Process] = {}

    def track(pid: int | None, ctime: float | None) -> None:
        if pid and alive(pid, ctime):
            try:
                tracked.setdefault(pid, psutil.Process(pid))
            except (psutil.Error, OSError):
                pass

    def refresh() -> None:
        for p in group_members(g.pgid, g.keeper_ctime):
            tracked.setdefault(p.pid, p)
        for p in list(tracked.values()):
            try:
                for c in p.children(recursive=True):
                    tracked.setdefault(c.pid, c)
            except (psutil.Error, OSError):
                pass

    track(g.keeper_pid, g.keeper_ctime)
    track(g.engine_pid, g.engine_ctime)
    refresh()
    forced = grace <= 0 or force.is_set()
    if not forced and leader_s > 0 and g.engine_pid and alive(g.engine_pid, g.engine_ctime):
        # the engine's top process stops its children in its own order (Strata's server: QUIT to the native
        # engine first); it gets ONE SIGTERM, the group only once its own budget has run out
        done = yield from _leader_first(g, tracked, refresh, leader_s, force, quiet)
        if done:
            return False, []
        forced = force.is_set()
    _signal_all(g, tracked, signal.SIGKILL if forced else signal.SIGTERM)
    t0 = time.monotonic()
    killed_at: float | None = t0 if forced else None
    next_ev = 0.0
    next_scan = time.monotonic() + 0.2
    while True:
        if g.popen is not None:
            g.popen.poll()                  # reap the keeper as soon as it exits
        if time.monotonic() >= next_scan:   # a full process scan costs ~25 ms: not every turn
            next_scan = time.monotonic() + 0.2
            refresh()
        left = live(list(tracked.values()))
        if not left:
            refresh()                       # one last look for anything started meanwhile
            left = live(list(tracked.values()))
        if not left:
            break
        el = time.monotonic() - t0
        if not forced and (el >= grace or force.is_set()):
            _signal_all(g, tracked, signal.SIGKILL)
            forced, killed_at = True, time.monotonic()
        if killed_at is not None and time.monotonic() - killed_at > 10:
            break                           # unkillable (stuck in the kernel): reported as leftovers
        if not quiet and time.monotonic() >= next_ev:
            next_ev = time.monotonic() + 0.25
            yield Stopping(el, grace, "SIGKILL" if forced else "SIGTERM", len(left))
        time.sleep(0.02)
    wait_keeper(g.popen)
    return forced, [p.pid for p in live(list(tracked.values()))]


def _leader_first(g: EngineGroup, tracked: dict[int, psutil.Process], refresh: Callable[[], None],
                  budget_s: float, force: threading.Event, quiet: bool) -> Generator[Stopping, None, bool]:
    """SIGTERM (with SIGCONT) to the engine's top process only, then wait until every tracked process has
    ended (→ True) or ``budget_s`` passed or a Force stop was asked for (→ False)."""
    try:
        leader = psutil.Process(g.engine_pid)
        leader.send_signal(signal.SIGTERM)
        leader.send_signal(signal.SIGCONT)
    except (psutil.Error, OSError):
        return False
    t0 = time.monotonic()
    next_ev = next_scan = 0.0
    while time.monotonic() - t0 < budget_s and not force.is_set():
        if g.popen is not None:
            g.popen.poll()
        if not alive(g.engine_pid, g.engine_ctime):
            # the top process is gone but children remain: it died of the SIGTERM instead of stopping them
            # (Strata's server installs its SIGTERM handler only once the engine said READY: server.py
            # @2291cb3 main()), so nothing else will stop them — the group is signalled now, not after the budget
            refresh()
            return not live(list(tracked.values()))
        if time.monotonic() >= next_scan:
            next_scan = time.monotonic() + 0.2
            refresh()
        if not live(list(tracked.values())):
            refresh()
            if not live(list(tracked.values())):
                wait_keeper(g.popen)
                return True
        if not quiet and time.monotonic() >= next_ev:
            next_ev = time.monotonic() + 0.25
            yield Stopping(time.monotonic() - t0, budget_s, "SIGTERM to the engine's server",
                           len(live(list(tracked.values()))))
        time.sleep(0.02)
    return False


def _signal_all(g: EngineGroup, tracked: dict[int, psutil.Process], sig: int) -> None:
    sigs = [sig]
    if sig == signal.SIGTERM:
        # A stopped (SIGSTOP / Ctrl+Z) process must run to act on SIGTERM. Waking it first, then a moment,
        # matters: a SIGTERM that arrives while a multi-threaded Python engine is stopped can land on a
        # non-main thread and never wake the main one (measured with the scripted engine: no exit in 5 s).
        paused = []
        for p in tracked.values():
            try:
                if p.status() == psutil.STATUS_STOPPED:
                    paused.append(p)
            except (psutil.Error, OSError):
                pass
        if paused:
            _signal_all(g, tracked, signal.SIGCONT)
            time.sleep(0.1)
        sigs = [sig, signal.SIGCONT]
    ours = bool(group_members(g.pgid, g.keeper_ctime))    # never signal a group id someone else now holds
    for s in sigs:
        if ours:
            try:
                os.killpg(g.pgid, s)
            except (ProcessLookupError, PermissionError):
                pass
        for p in tracked.values():          # descendants that left the group (setsid) get it too
            try:
                if os.getpgid(p.pid) != g.pgid and p.is_running():
                    p.send_signal(s)
            except (ProcessLookupError, psutil.Error, OSError):
                pass
