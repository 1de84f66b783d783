"""Process, process-group and port helpers of the supervisor (psutil), and the key's fingerprint.

A pid is only "ours" with its recorded start time (a reused number is another process); a process group is only
ours while its leader started when we recorded. Command lines shown to people are masked. Never imports Qt.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import subprocess
import time
from typing import Any

import psutil

def ctime_of(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None


def alive(pid: int | None, ctime: float | None = None) -> bool:
    """True when ``pid`` runs (not a zombie) and, if given, started at ``ctime`` (not a reused pid)."""
    if not pid:
        return False
    try:
        p = psutil.Process(pid)
        if ctime is not None and abs(p.create_time() - ctime) > 0.05:
            return False
        return p.status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, OSError):
        return False


def group_members(pgid: int, since: float | None = None) -> list[psutil.Process]:
    """Live (non-zombie) processes whose process group is ``pgid`` (started at/after ``since``, the group
    leader's start time).

    Safe against a reused number: Linux never hands out a pid that is still some group's id, so while any member of
    our old group lives, ``pgid`` cannot be a newer group. A *live* process with pid ``pgid`` that started at
    another time than ``since`` therefore leads a different group: nothing is returned for it."""
    if since is not None:
        try:
            leader = psutil.Process(pgid)
            if abs(leader.create_time() - since) > 0.05:
                return []
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            pass
        except (psutil.Error, OSError):
            return []
    out: list[psutil.Process] = []
    for p in psutil.process_iter(["create_time", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if since is not None and p.info["create_time"] < since - 0.05:
                continue
            if os.getpgid(p.pid) == pgid:
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
                return kids[0].pid, kids[0].create_time()
            except (psutil.Error, OSError):
                return None, None
        if popen.poll() is not None:
            return None, None
        time.sleep(0.003)
    return None, None
