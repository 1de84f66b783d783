"""What a download keeps on disk: the folder lock, where the model and the engine go, the manifests, the
record of verified files, checkpoint state files and the boot id that says whether they can be trusted."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from .. import paths
from ..atomic import OWNER_ONLY, atomic_write_json, ensure_private_dir
from ..procs import BOOT_ID
from ..settings import Settings
from .events import (
    STATE_DIR,
    DownloadError,
    FolderBusy,
)


class FolderLock:
    """An exclusive lock on a download folder (``fcntl.flock`` on ``<folder>/.dsv41-download/lock``), held while
    a download writes there; the holder records its pid and command in the lock file so a second download can
    say who holds it. (``flock`` is released by the kernel when the holder dies, so a stale lock cannot block.
    Written with ``fcntl`` rather than the ``filelock`` package: that one truncates the file when it opens it,
    which would wipe the holder's name a refused download wants to show.)"""

    def __init__(self, state_dir: Path, folder: Path, command: str):
        self.path = Path(state_dir) / "lock"
        self.folder, self.command = folder, command
        self.fd: int | None = None

    def acquire(self) -> "FolderLock":
        ensure_private_dir(self.path.parent)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, OWNER_ONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                try:
                    holder = json.loads(os.pread(fd, 4096, 0).decode("utf-8") or "{}")
                except (OSError, ValueError):
                    holder = {}
                os.close(fd)
                raise FolderBusy(self.folder, holder if isinstance(holder, dict) else {}) from None
            except BaseException:
                os.close(fd)
                raise
            try:                     # the holder before us removes the file as it lets go: lock the current one
                same = os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({"pid": os.getpid(), "command": self.command[:200],
                                      "since": time.time()}).encode(), 0)
        except OSError:
            pass                     # the lock holds either way; only the name shown to a second download is lost
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            try:
                os.unlink(self.path)     # while still held: nothing is left behind in the folder
            except OSError:
                pass
            os.close(self.fd)        # closing drops the flock
            self.fd = None


def _command_words() -> str:
    """This process as a person would name it (``dsv41 download --model``; the panel), no secret in it."""
    import sys
    argv = [os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv or [])]
    if argv and argv[0] in ("__main__.py", "-m", "-c"):
        argv[0] = "dsv41"
    text = " ".join(argv) or "python"
    return re.sub(r"(--?(?:token|hf[-_]token|api[-_]key)[= ])\S+", r"\1…(masked)", text)


def _disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def free_bytes(path: Path) -> tuple[Path, int]:
    """Free bytes on the filesystem that ``path`` is (or would be) on: the nearest existing ancestor."""
    p = Path(path).expanduser().absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p, shutil.disk_usage(p).free


def load_manifest(name: str) -> dict[str, Any]:
    p = paths.resources_dir() / "manifests" / f"{name}.json"
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise DownloadError(f"The {name} manifest {p} could not be read ({exc}).",
                            "Reinstall the panel; the manifest ships with it.") from None


def shard_names(manifest: dict[str, Any] | None = None) -> list[str]:
    m = manifest or load_manifest("model")
    pattern = m.get("pattern", "DeepSeek-V4.1-Flash-Q2_K-{n:05d}-of-00007.gguf")
    return [pattern.format(n=i) for i in range(1, int(m.get("files", 7)) + 1)]


def default_model_dir(settings: Settings) -> Path:
    """Where downloaded shards go unless ``--dir`` or ``model_dir`` says otherwise."""
    return settings.cache_path / "models" / settings.model_repo.replace("/", "--")


def model_dir(settings: Settings) -> Path:
    """The folder the engine should load the model from: ``model_dir`` if set, else the download folder."""
    return Path(settings.model_dir).expanduser() if settings.model_dir else default_model_dir(settings)


def engine_release_dir(settings: Settings, version: str | None = None) -> Path:
    """``<cache_dir>/engine/<version>``: where the engine release is unpacked (the strata engine looks there
    when ``engine_dir`` is empty)."""
    if version is None:
        version = str(load_manifest("engine").get("version", "v0.1.0"))
    return settings.cache_path / "engine" / version


_records_lock = threading.Lock()


def _records_path() -> Path:
    return paths.data_dir() / "downloads" / "verified.json"


def _load_records() -> dict[str, Any]:
    try:
        data = json.loads(_records_path().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _record_verified(path: Path, sha256: str) -> None:
    st = path.stat()
    with _records_lock:
        recs = _load_records()
        recs[str(path.resolve())] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256,
                                     "verified_at": time.time()}
        atomic_write_json(_records_path(), recs)


def _forget_verified(path: Path) -> None:
    with _records_lock:
        recs = _load_records()
        if recs.pop(str(path.resolve()), None) is not None:
            atomic_write_json(_records_path(), recs)


def known_verified(path: Path, sha256: str | None) -> bool:
    """True if ``path`` was verified before and has not changed since (same size and mtime)."""
    try:
        st = path.stat()
    except OSError:
        return False
    rec = _load_records().get(str(path.resolve()))
    return bool(rec and rec.get("size") == st.st_size and rec.get("mtime_ns") == st.st_mtime_ns
                and (sha256 is None or rec.get("sha256") == sha256))


def _boot_id() -> str:
    """Changes at every boot: a checkpoint from this boot may trust the page cache, one from before may not."""
    if BOOT_ID is not None:
        return BOOT_ID
    import psutil
    return f"boot-{int(psutil.boot_time())}"


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (``pwrite`` may write less, e.g. just before the disk is full: the rest
    then raises ENOSPC instead of being lost silently)."""
    done = 0
    while done < len(data):
        n = os.pwrite(fd, data[done:], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "pwrite wrote nothing")
        done += n


def _write_state(path: Path, obj: dict[str, Any], durable: bool) -> None:
    """A small state file, replaced atomically (temp + rename); fsynced only when ``durable``. A write that fails
    (a full disk) leaves the previous state file as it was and no temporary file."""
    atomic_write_json(path, obj, durable=durable)


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _state_path(target: Path) -> Path:
    return target / STATE_DIR / "state.json"


def _load_state(target: Path) -> dict[str, Any]:
    try:
        data = json.loads(_state_path(target).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _default_target(settings: Settings) -> Path:
    return Path(settings.model_dir).expanduser() if settings.model_dir else default_model_dir(settings)
