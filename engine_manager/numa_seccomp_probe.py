"""Run a command under a real seccomp filter that refuses chosen system calls — the way a container does.

    python -m engine_manager.numa_seccomp_probe [--deny set_mempolicy,mbind] [--errno EPERM] [-- CMD ...]

Without a command it runs the binding probe (``python -m engine_manager.numa --json --no-gpu-probe``):
- ``--deny set_mempolicy,mbind`` (EPERM: Docker's default profile without CAP_SYS_NICE): ``numactl --preferred``
  fails with "set_mempolicy: Operation not permitted"; ``numactl --cpunodebind`` still works.
- ``--deny get_mempolicy,set_mempolicy,mbind --errno ENOSYS`` (a sandbox that hides the calls): numactl cannot run
  at all ("does not support NUMA policy"); ``taskset`` still works. Add ``sched_setaffinity``: nothing can bind.
The filter is installed with libseccomp (``libseccomp.so.2``, through ctypes) in this process, which then ``exec``s
the command: the filter is inherited by it and by everything it starts, and cannot be lifted. ``name:ERRNO`` in
``--deny`` sets a per-call errno.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno as errno_mod
import os
import sys

SCMP_ACT_ALLOW = 0x7FFF0000


def SCMP_ACT_ERRNO(code: int) -> int:  # noqa: N802 - libseccomp's macro name
    return 0x00050000 | (code & 0x0000FFFF)


class SeccompError(RuntimeError):
    pass


def _lib() -> ctypes.CDLL:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as exc:
        raise SeccompError(f"libseccomp is not installed ({exc}); on Debian: apt-get install libseccomp2") from exc
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.restype = ctypes.c_int
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add.restype = ctypes.c_int
    lib.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
    lib.seccomp_load.restype = ctypes.c_int
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_release.restype = None
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    return lib


def _errno(name_or_num: str) -> int:
    s = name_or_num.strip().upper()
    if s.isdigit():
        return int(s)
    code = getattr(errno_mod, s, None)
    if not isinstance(code, int):
        raise SeccompError(f"unknown errno {name_or_num!r} (use a name such as EPERM or ENOSYS)")
    return code


def install_filter(deny: list[str], default_errno: int = errno_mod.EPERM) -> None:
    """Install a filter in *this* process: every call in ``deny`` (``name`` or ``name:ERRNO``) fails with that
    errno, everything else is allowed. Sets no_new_privs (libseccomp's default), so no privilege is needed."""
    lib = _lib()
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        raise SeccompError("seccomp_init failed")
    try:
        for item in deny:
            name, _, code = item.partition(":")
            nr = lib.seccomp_syscall_resolve_name(name.strip().encode())
            if nr < 0:
                raise SeccompError(f"unknown system call {name!r}")
            rc = lib.seccomp_rule_add(ctx, SCMP_ACT_ERRNO(_errno(code) if code else default_errno), nr, 0)
            if rc < 0:
                raise SeccompError(f"seccomp_rule_add({name}) failed: {os.strerror(-rc)}")
        rc = lib.seccomp_load(ctx)
        if rc < 0:
            raise SeccompError(f"seccomp_load failed: {os.strerror(-rc)}")
    finally:
        lib.seccomp_release(ctx)


def main(argv: list[str] | None = None) -> int:
    import argparse

    argv = list(sys.argv[1:] if argv is None else argv)
    cmd: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, cmd = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="python -m engine_manager.numa_seccomp_probe",
                                description="Run a command (default: the NUMA binding probe) under a seccomp "
                                            "filter that refuses the given system calls.")
    p.add_argument("--deny", default="set_mempolicy,mbind",
                   help="comma-separated system calls to refuse, each optionally name:ERRNO "
                        "(default: set_mempolicy,mbind)")
    p.add_argument("--errno", default="EPERM", help="errno for refused calls (default EPERM)")
    args = p.parse_args(argv)
    if not cmd:
        cmd = [sys.executable, "-m", "engine_manager.numa", "--json", "--no-gpu-probe"]
    try:
        install_filter([d for d in args.deny.split(",") if d.strip()], _errno(args.errno))
    except SeccompError as exc:
        print(f"numa_seccomp_probe: {exc}", file=sys.stderr)
        return 2
    try:
        os.execvp(cmd[0], cmd)
    except OSError as exc:
        print(f"numa_seccomp_probe: cannot run {cmd[0]}: {exc}", file=sys.stderr)
        return 127
    return 0  # pragma: no cover - exec does not return


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
