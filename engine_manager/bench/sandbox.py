"""Run untrusted generated code (a HumanEval completion and its tests) in a sandbox, and say whether it passed.

:func:`run_python` starts this file as ``python -I -S sandbox.py`` (it imports only the standard library then),
which:
- enters fresh network (no interface up, not even loopback), mount and PID namespaces (a user namespace first when
  not root); where the OS refuses them the run is refused with the reason (:class:`SandboxUnavailable`), never run
  without them;
- forks the program as PID 1 of the new PID namespace, so nothing it starts (``setsid()`` included) outlives it;
- remounts every filesystem read-only except its own throw-away folder (writes elsewhere fail with EROFS);
- sets CPU, address-space, file-size and process limits and no core files (as root it first drops to ``nobody``:
  the kernel does not hold root to ``RLIMIT_NPROC``); its parent's death kills it (``PR_SET_PDEATHSIG``);
- runs the program with ``python -I -S -B`` in its folder, with an empty environment but ``PATH``, ``HOME`` and
  ``TMPDIR``.
The caller kills the whole process group on a wall-clock timeout, reads at most ``Limits.output_bytes`` of output
and removes the folder. A sample passes only when it exits 0 within its limits.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from dataclasses import asdict, dataclass
from typing import Any

REFUSED_EXIT = 97          # the init's own exit: the namespaces or the mounts were refused (reason on stderr)
REFUSED_TAG = "sandbox-refused: "
NOBODY = 65534
CONFIG_MAX_BYTES = 64 * 1024

# <sched.h> / <sys/mount.h> / <sys/prctl.h> (Linux)
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG = 1
_MOUNT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
                "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 10                        # CPU seconds (RLIMIT_CPU)
    memory_bytes: int = 1024 * 2**20       # address space (RLIMIT_AS)
    file_bytes: int = 4 * 2**20            # largest file it may write (RLIMIT_FSIZE)
    processes: int = 32                    # processes of its user (RLIMIT_NPROC)
    wall_s: float = 20.0                   # killed (its whole process group) after this
    output_bytes: int = 64 * 1024          # what it printed, kept for the report

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class SandboxResult:
    passed: bool
    status: str                  # "passed", "failed" (exit not 0), "timeout" (killed on the wall clock), "killed"
    returncode: int | None       # a signal as a negative number (the CPU limit: SIGKILL/SIGXCPU)
    wall_s: float
    output: str                  # stdout and stderr together, the last Limits.output_bytes of them

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------------------------------------ the caller's side
class SandboxUnavailable(Exception):
    """The OS refused what the sandbox needs (namespaces, mounts): generated code is not run without them."""


def run_python(source: str, limits: Limits = Limits(), *, python: str | None = None) -> SandboxResult:
    """Run ``source`` (a whole Python program) in the sandbox; returns how it ended. Raises
    :class:`SandboxUnavailable` when the OS refuses the sandbox (the reason in words)."""
    import shutil
    import subprocess
    import tempfile
    import time

    exe = python or interpreter()
    work = tempfile.mkdtemp(prefix="dsv41-sandbox-")      # 0700, ours: the program's folder and its output file
    try:
        folder = os.path.join(work, "run")
        os.mkdir(folder, 0o700)
        with open(os.path.join(folder, "prog.py"), "w", encoding="utf-8") as f:
            f.write(source)
        if os.geteuid() == 0:                 # the program runs as nobody: its folder must be its own
            os.chmod(work, 0o711)
            os.chown(folder, NOBODY, NOBODY)
            os.chown(os.path.join(folder, "prog.py"), NOBODY, NOBODY)
        out_path = os.path.join(work, "output")
        config = json.dumps({"folder": folder, "python": exe, "cpu_s": int(limits.cpu_s),
                             "memory_bytes": int(limits.memory_bytes), "file_bytes": int(limits.file_bytes),
                             "processes": int(limits.processes)})
        t0 = time.monotonic()
        with open(out_path, "wb") as out:
            proc = subprocess.Popen([exe, "-I", "-S", "-B", os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
                                    env={"PATH": os.defpath, "LANG": "C.UTF-8"}, cwd=work)
            try:
                assert proc.stdin is not None
                proc.stdin.write(config.encode())
                proc.stdin.close()
            except OSError:
                pass
            timed_out = False
            try:
                rc = proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc.pid)
                rc = proc.wait()
            finally:                    # also on Ctrl-C while it runs: nothing of it outlives the call
                _kill_group(proc.pid)   # anything of its group still there (the PID namespace took the rest)
                proc.wait()
        wall = time.monotonic() - t0
        with open(out_path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(max(0, size - limits.output_bytes))
            text = f.read(limits.output_bytes).decode("utf-8", "replace")
        if rc == REFUSED_EXIT and REFUSED_TAG in text:
            reason = text.split(REFUSED_TAG, 1)[1].strip().splitlines()[0]
            advice = (" It needs Linux namespaces (network, mount, PID), which need root or unprivileged user "
                      "namespaces (sysctl kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0)."
                      if "unshare" in reason or "id maps" in reason else "")
            raise SandboxUnavailable(f"Generated code is not run here: the sandbox it needs cannot be made on this "
                                     f"machine ({reason}).{advice}")
        if timed_out:
            status = "timeout"
        elif rc == 0:
            status = "passed"
        elif rc is not None and (rc < 0 or rc > 128):
            status = "killed"          # a signal: the CPU limit (SIGXCPU / SIGKILL), the file-size limit (SIGXFSZ)
        else:
            status = "failed"
        return SandboxResult(status == "passed", status, rc, round(wall, 3), text)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def interpreter() -> str:
    """The Python the sandboxed program runs with: this one, unless it runs as root (the program then runs as
    ``nobody``) and ``nobody`` cannot reach it (a Python under /root, say) — then the system's ``python3``. A
    HumanEval program needs the standard library only."""
    here = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    if os.geteuid() != 0:
        return here
    for exe in (here, os.path.realpath(sys.executable), "/usr/bin/python3", "/usr/local/bin/python3"):
        if _others_can_run(exe):
            return exe
    return here


def _others_can_run(path: str) -> bool:
    """Every folder on ``path``'s way searchable by others and the file readable and runnable by them."""
    import stat
    try:
        if not os.path.isfile(path) or (os.stat(path).st_mode & 0o005) != 0o005:
            return False
        d = os.path.dirname(path)
        while True:
            if not os.stat(d).st_mode & stat.S_IXOTH:
                return False
            if d == os.path.dirname(d):
                return True
            d = os.path.dirname(d)
    except OSError:
        return False


def _kill_group(pgid: int, wait_s: float = 5.0) -> None:
    """SIGKILL the process group and wait (at most ``wait_s``) until it is gone: the PID namespace's first process
    is in it, and it finishes dying only once the kernel has killed everything else in its namespace."""
    import time
    end = time.monotonic() + wait_s
    while True:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        if time.monotonic() > end:
            return
        time.sleep(0.02)


# ------------------------------------------------------------------------------------------------ the init's side
def _refuse(reason: str) -> None:
    sys.stderr.write(REFUSED_TAG + reason + "\n")
    sys.stderr.flush()
    os._exit(REFUSED_EXIT)


def _libc() -> Any:
    import ctypes
    import ctypes.util
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _errno_words() -> str:
    import ctypes
    e = ctypes.get_errno()
    return f"{os.strerror(e)} (errno {e})"


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _mounts() -> list[tuple[str, int]]:
    """(mount point, its flags to keep) of every mount, from /proc/self/mountinfo (the kernel's escapes decoded)."""
    out = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 6:
                continue
            point = parts[4].encode().decode("unicode_escape") if "\\" in parts[4] else parts[4]
            flags = 0
            for o in parts[5].split(","):
                flags |= _MOUNT_FLAGS.get(o, 0)
            out.append((point, flags))
    return out


def _init() -> None:
    """The sandbox's own process (``python -I -S sandbox.py``, the config as JSON on stdin)."""
    cfg = json.loads(sys.stdin.buffer.read(CONFIG_MAX_BYTES))
    folder, exe = str(cfg["folder"]), str(cfg["python"])
    libc = _libc()
    root = os.geteuid() == 0
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID
    if libc.unshare(flags if root else flags | CLONE_NEWUSER) != 0:
        _refuse(f"unshare of the network, mount and PID namespaces: {_errno_words()}")
    if not root:
        try:
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"0 {uid} 1")
            _write("/proc/self/gid_map", f"0 {gid} 1")
        except OSError as exc:
            _refuse(f"the user namespace's id maps: {exc.strerror or exc}")
    r, w = os.pipe()              # the child tells its setup's failure through it, before its exec closes it
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            _child(libc, folder, exe, cfg, root, w)
        except BaseException as exc:  # noqa: BLE001 - whatever it was, said, and nothing runs
            os.write(w, f"{exc.__class__.__name__}: {exc}".encode()[:2000])
            os._exit(REFUSED_EXIT)
    os.close(w)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    why = b""
    while chunk := os.read(r, 4096):
        why += chunk
    _, status = os.waitpid(pid, 0)
    if why:
        _refuse(why.decode("utf-8", "replace"))
    if os.WIFSIGNALED(status):
        os._exit(128 + os.WTERMSIG(status))
    os._exit(os.WEXITSTATUS(status))


def _child(libc: Any, folder: str, exe: str, cfg: dict[str, Any], root: bool, w: int) -> None:
    import fcntl
    import resource

    fcntl.fcntl(w, fcntl.F_SETFD, fcntl.FD_CLOEXEC)
    # every mount private to this namespace, then read-only, but the folder (bound onto itself, read-write)
    if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        raise OSError(f"making the mounts private: {_errno_words()}")
    if libc.mount(folder.encode(), folder.encode(), None, MS_BIND, None) != 0:
        raise OSError(f"binding the folder: {_errno_words()}")
    mounts = _mounts()
    for point, keep in mounts:
        if point == folder:
            continue
        if libc.mount(None, point.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY | keep, None) == 0:
            continue
        e = _errno_words()
        if libc.mount(None, point.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY, None) == 0:
            continue
        if not point.startswith(("/proc/", "/sys/")):     # (the kernel's own views may refuse; nothing to fill)
            raise OSError(f"making {point} read-only: {e}")
    os.chdir(folder)
    for res, value in ((resource.RLIMIT_CPU, int(cfg["cpu_s"])), (resource.RLIMIT_AS, int(cfg["memory_bytes"])),
                       (resource.RLIMIT_FSIZE, int(cfg["file_bytes"])), (resource.RLIMIT_CORE, 0),
                       (resource.RLIMIT_NPROC, int(cfg["processes"]))):
        resource.setrlimit(res, (value, value))
    if root:                       # the kernel holds no root process to RLIMIT_NPROC: the program runs as nobody
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:   # (after setuid, which clears it)
        raise OSError(f"PR_SET_PDEATHSIG: {_errno_words()}")
    os.execve(exe, [exe, "-I", "-S", "-B", "prog.py"],
              {"PATH": os.defpath, "HOME": folder, "TMPDIR": folder, "LANG": "C.UTF-8"})


if __name__ == "__main__":
    _init()
