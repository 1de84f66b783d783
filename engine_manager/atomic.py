"""Atomic, owner-only file writes with rotating backups.

Every config, state and history file the panel writes goes through here: write to a temp file in the same
directory, fsync, chmod 0600, rename over the target (atomic on POSIX), fsync the directory.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

OWNER_ONLY = 0o600


def ensure_private_dir(path: Path) -> Path:
    """Create ``path`` (and parents) with mode 0700 where we create it."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def atomic_write_bytes(path: Path, data: bytes, mode: int = OWNER_ONLY, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` through a temporary file (never left behind, even on a full disk). With
    ``durable`` the data and the rename are fsynced; without, a crash may lose the write but never tears it."""
    path = Path(path)
    ensure_private_dir(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if not durable:
        return
    try:
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def atomic_write_text(path: Path, text: str, mode: int = OWNER_ONLY, durable: bool = True) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), mode, durable)


def atomic_write_json(path: Path, obj: Any, mode: int = OWNER_ONLY, durable: bool = True) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n", mode, durable)


def rotate_backup(path: Path, backup_dir: Path, keep: int) -> Path | None:
    """Copy the current ``path`` into ``backup_dir`` as a timestamped file; keep the newest ``keep``."""
    path = Path(path)
    if not path.exists():
        return None
    ensure_private_dir(backup_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S") + f"-{time.time_ns() % 1_000_000_000:09d}"
    dest = backup_dir / f"{path.stem}-{stamp}{path.suffix}"
    atomic_write_bytes(dest, path.read_bytes())
    backups = sorted(backup_dir.glob(f"{path.stem}-*{path.suffix}"))
    for old in backups[:-keep] if keep > 0 else backups:
        try:
            old.unlink()
        except FileNotFoundError:
            pass
    return dest


def move_aside(path: Path, reason: str = "corrupt") -> Path:
    """Rename a bad file out of the way (never delete it) and return where it went."""
    path = Path(path)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest = path.with_name(f"{path.name}.{reason}-{stamp}")
    n = 1
    while dest.exists():
        dest = path.with_name(f"{path.name}.{reason}-{stamp}-{n}")
        n += 1
    os.replace(path, dest)
    return dest


class LinkRefused(OSError):
    """A file the panel reads or writes is a symbolic link: it is refused, never followed."""


def _nofollow_open(path: Path, flags: int, mode: int = OWNER_ONLY) -> int:
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            try:
                target = os.readlink(path)
            except OSError:
                target = "?"
            raise LinkRefused(errno.ELOOP, f"{path} is a symbolic link (to {target}); the panel does not read or "
                                           f"write through links. Remove the link (`rm {path}`) and try again",
                              str(path)) from None
        raise


class NotARegularFile(OSError):
    """A file the panel reads is a named pipe, a device, a socket or a folder: refused (a pipe would block the
    read for ever, a device could be endless)."""


def read_bytes_nofollow(path: Path, max_bytes: int | None = None) -> bytes:
    """The bytes of ``path`` (at most ``max_bytes``), refusing a symbolic link (:class:`LinkRefused`) instead of
    reading what it points to, and anything but a regular file (:class:`NotARegularFile`: opened without blocking,
    so a named pipe with no writer cannot hang the caller)."""
    import stat

    fd = _nofollow_open(Path(path), os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotARegularFile(errno.EINVAL, f"{path} is not a regular file (a named pipe, a device or a folder); "
                                            "give a plain file", str(path))
    with os.fdopen(fd, "rb") as f:
        return f.read() if max_bytes is None else f.read(max_bytes)


def read_json_capped(path: Path, cap: int) -> Any:
    """The JSON document in ``path``: never through a link (:class:`LinkRefused`), a regular file only
    (:class:`NotARegularFile`), at most ``cap`` bytes. ``FileNotFoundError`` when it is not there; ``ValueError``
    in plain words when it is larger than ``cap``, not UTF-8, not JSON, or nested too deeply for Python's parser
    (a ``RecursionError``, which is not a ``ValueError``, turned into one)."""
    raw = read_bytes_nofollow(Path(path), max_bytes=cap + 1)
    if len(raw) > cap:
        raise ValueError(f"it is larger than {cap:,} bytes")
    try:
        return json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise ValueError("it nests too deeply to be read") from None
    except UnicodeDecodeError:
        raise ValueError("it is not UTF-8 text") from None


def open_append_nofollow(path: Path, mode: int = OWNER_ONLY) -> int:
    """An owner-only file descriptor appending to ``path`` (created if missing), never through a symbolic link
    (:class:`LinkRefused`); an existing file is tightened to ``mode`` through the descriptor (never via the name)."""
    fd = _nofollow_open(Path(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT, mode)
    try:
        os.fchmod(fd, mode)
    except OSError:
        os.close(fd)
        raise
    return fd
