"""The model's seven GGUF shards and the engine release: resumable, verified downloads.

Every long operation here is a generator of typed events (``Resolved``, ``DiskChecked``, ``Checking``,
``Progress``, ``Retrying``, ``FileVerified``, ``FileCorrupt``, ``Notice``, ``Paused``/``Resumed``, and finally
``Finished`` or ``Stopped``); errors are :class:`DownloadError` subclasses whose ``fix`` says what to do. The CLI
prints the events, the GUI turns them into signals, the tests assert on them. Pause/resume/cancel go through a
:class:`DownloadControl`; closing the generator (Ctrl+C, the GUI's worker quitting) is a cancel too.

What ``huggingface_hub`` does and what is written here, and why (measured on this machine, 2 shared cores,
huggingface_hub 2.4, loopback hub serving with sendfile):

- Metadata, URLs and auth are the library's: ``HfApi.model_info(files_metadata=True)`` (commit sha, file list,
  sizes, LFS sha256), ``hf_hub_url`` + ``get_hf_file_metadata`` (the download location after the hub's redirect,
  the size and ETag) and ``build_hf_headers`` (user agent, ``Authorization`` from ``HF_TOKEN`` or the
  ``hf_token`` setting — never printed nor logged; dropped when a redirect leaves the hub's host).
- The byte transfer is not. ``hf_hub_download`` writes to a process-unique ``<etag>.<uuid>.incomplete`` file and
  deletes it in a ``finally``: a killed process leaves an orphan nobody resumes, so the next run starts the 38 GB
  shard over (``tests/test_download.py::test_hf_hub_download_restarts_after_kill`` measures that). Its ``http_get``
  cannot be paused, has a fixed 1 s retry sleep and the import-time ``HF_HUB_DOWNLOAD_TIMEOUT``. Reading the body
  through ``httpx``/``httpx2`` streams reached 200–320 MB/s against curl's 740–1000 MB/s on the same files;
  ``http.client`` reading into a reused buffer reached 740–980 MB/s. So the body is read with ``http.client``
  (stdlib, TLS verified with certifi's CA bundle, proxies from the environment) into a ranged partial file
  ``.dsv41-download/<name>.part`` whose state (offset, pinned commit, expected sha256, boot id) is checkpointed
  beside it every ``checkpoint_bytes``; reads never cross a checkpoint boundary. A rerun truncates the partial to
  the last checkpoint and asks for the rest with ``Range``: a kill costs at most one checkpoint of bytes fetched
  again. A killed process loses nothing the kernel already holds, so checkpoints are not fsynced; an
  ``fdatasync`` runs on a side thread every ``SYNC_BYTES`` (and on pause/stop, and before a finished file is
  renamed) and the state records how far it reached, which is all a resume after a *reboot* trusts. (An
  ``fdatasync`` at every 64 MiB checkpoint made the download 3.6× slower than curl on this machine's disk.)
- sha256 is computed on a worker thread as bytes arrive: the receiving thread hands each filled buffer to a
  hasher thread (hashlib releases the GIL) and only falls back to the hasher re-reading the file when the hasher
  is behind. After a restart the hasher re-reads the kept prefix once while the download already goes on
  (hashlib ~1.0–1.1 GB/s here; ``rehashes``, which can serialise a sha256 state, ran 1.0 GB/s but holds the GIL:
  two threads together made 0.96 GB/s against hashlib's 2.1 GB/s, so with parallel shards re-reading the prefix
  is the cheaper choice). A file is renamed into place atomically only after its sha256 matched.

The pinned revision. ``resources/manifests/model.json`` says ``revision: "main"`` (the real hub is unreachable from
the build machines, so no commit could be pinned there). The first resolve turns the requested revision into the
commit sha the hub answered and writes it into the download state (``.dsv41-download/state.json`` in the model
folder); every later resume of that folder asks for that commit, so a repository that moves on mid-download can
never mix shards of two commits. Changing ``DSV41_MODEL_REVISION`` starts a new pin. If the hub no longer has the
pinned commit (a rewritten repository), :class:`PinnedCommitGone` names it and says how to re-pin:
``download_model(..., repin=True)`` (``dsv41 download --repin``, the Downloads tab's Re-pin button) resolves the
revision again; verified shards whose sha256 is unchanged are kept, partial files of the old commit start over.

A folder whose seven shards are all present, verified before (unchanged since) and agree in their split metadata
needs nothing from the hub: ``download_model`` says so and finishes without a network request (unless
``verify="full"`` or ``repin``), so a complete model works offline.

A set is complete only when all seven files verified (sha256 = the hub's LFS oid) and their GGUF split keys
(``split.no``, ``split.count``, ``split.tensors.count``, read with :func:`engine_manager.layout.read_shard_header`)
agree. Verified files are remembered by (path, size, mtime) in the data dir so a complete set is not re-hashed at
every start; ``verify="full"`` re-hashes anyway.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import http.client
import json
import os
import queue
import random
import re
import shutil
import socket
import ssl
import stat
import tarfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterator
from urllib.parse import urljoin, urlsplit

from . import fmt, paths
from .atomic import OWNER_ONLY, atomic_write_json, ensure_private_dir
from .errors import UserError
from .settings import Settings

GB = 10**9
MiB = 1 << 20

STATE_DIR = ".dsv41-download"
DEFAULT_JOBS = 4
BUF_BYTES = 4 * MiB                 # one receive buffer
CHECKPOINT_BYTES = 64 * MiB         # resumable state every this many bytes: what a kill can cost
SYNC_BYTES = 1024 * MiB             # fdatasync (on a side thread) every this many: what a reboot can cost
STALL_TIMEOUT_S = 30.0              # no byte for this long: the connection is dropped and retried
MIN_SPEED_BPS = 1024                # below this over STALL_TIMEOUT_S counts as a stall too
RESERVE_BYTES = 512 * MiB           # free disk kept beyond the download itself
MAX_TRIES_WITHOUT_PROGRESS = 8
MAX_CORRUPT_RETRIES = 2
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 60.0)
HTTP_SIZE_LIMIT = 50 * 1000**3      # huggingface_hub's http_get refuses single files above this (wants hf_xet)


# ---------------------------------------------------------------------------------------------------------------
# errors and events
# ---------------------------------------------------------------------------------------------------------------

class DownloadError(UserError):
    """A download could not go on. ``str()`` is the message for the user with what to do."""

    def __init__(self, message: str, fix: str = ""):
        self.message, self.fix = message, fix
        super().__init__(message)

    def __str__(self) -> str:
        return f"{self.message} {self.fix}".strip()


class DiskSpaceError(DownloadError):
    def __init__(self, path: Path, free_bytes: int, needed_bytes: int):
        self.path, self.free_bytes, self.needed_bytes = path, free_bytes, needed_bytes
        self.missing_bytes = max(0, needed_bytes - free_bytes)
        super().__init__(
            f"Not enough free disk at {path}: the download needs {fmt_bytes(needed_bytes)} "
            f"(including {fmt_bytes(RESERVE_BYTES)} headroom), {fmt_bytes(free_bytes)} is free — "
            f"{fmt_bytes(self.missing_bytes)} missing. Nothing was written.",
            "Free that much space there, or set DSV41_CACHE_DIR (or --dir) to a bigger disk, or DSV41_MODEL_DIR "
            "to a folder that already holds the seven shards.")


class DiskFullError(DownloadError):
    """The disk filled up while downloading (ENOSPC / over quota): said once, nothing retried; what was written up
    to the last checkpoint is kept for a resume, and no temporary file is left."""

    def __init__(self, path: Path, more_bytes: int):
        self.path, self.more_bytes = path, max(0, more_bytes)
        gb = max(self.more_bytes, 1) / 1e9
        super().__init__(
            f"disk full: {gb:.{1 if gb >= 0.1 else 3}f} GB more needed at {path}. The download stopped there; what "
            "it had written is kept.",
            "Free that much space (or set DSV41_CACHE_DIR / --dir to a bigger disk), then run the download again: "
            "it resumes where it stopped.")


class FolderBusy(DownloadError):
    """Another download (CLI or panel, this or another process) is writing into the same folder."""

    def __init__(self, folder: Path, holder: dict[str, Any]):
        self.folder, self.holder = folder, holder
        pid = holder.get("pid")
        cmd = holder.get("command") or ""
        since = holder.get("since")
        when = time.strftime(" since %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else ""
        who = (f"pid {pid}" + (f" ({cmd})" if cmd else "")) if pid else "another process (it did not say which)"
        super().__init__(
            f"Another download is writing into {folder}: {who}{when}. Two downloads into one folder would overwrite "
            "each other's partial files, so this one did not start.",
            "Wait for that download to finish (or stop it: Ctrl+C in its terminal, or Cancel in the panel), then "
            "run this one again; it picks up whatever is still missing.")


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


class HubError(DownloadError):
    """The hub refused or could not be reached."""


class VerificationError(DownloadError):
    """Bytes did not match their sha256, or the shards' split metadata disagree."""


class ArchiveError(DownloadError):
    """The engine release archive was refused (checksum, unsafe paths, missing executables)."""


class PinnedCommitGone(HubError):
    """The commit this model folder was pinned to is no longer on the hub (the repository was rewritten)."""

    def __init__(self, repo: str, commit: str, revision: str, pinned_at: float | None, folder: Path):
        self.repo, self.commit, self.revision, self.pinned_at, self.folder = repo, commit, revision, pinned_at, folder
        when = time.strftime(" on %Y-%m-%d", time.localtime(pinned_at)) if isinstance(pinned_at, (int, float)) \
            else ""
        super().__init__(
            f"The hub no longer has commit {commit} of {repo}: the first download into {folder} pinned that commit "
            f"(resolved from '{revision}'{when}) so that every shard comes from one commit, and the repository has "
            "since been rewritten.",
            f"Re-pin to what '{revision}' is now: run `dsv41 download --repin` (or press Re-pin in the Downloads "
            "tab). Shards already verified are kept if their sha256 is unchanged; partial files of the old commit "
            "start over. To pin another revision instead, set DSV41_MODEL_REVISION to a branch, tag or commit the "
            "hub has.")


@dataclass
class RemoteFile:
    name: str
    size: int
    sha256: str


@dataclass
class Resolved:
    repo: str
    revision: str                    # what was asked for (a branch, tag or commit)
    commit: str                      # the commit sha every request uses
    pinned: bool                     # True: the commit came from an earlier resolve of this folder
    files: list[RemoteFile]
    total_bytes: int
    target_dir: Path


@dataclass
class DiskChecked:
    path: Path
    free_bytes: int
    needed_bytes: int


@dataclass
class Checking:
    """Hashing files already on disk."""
    name: str
    done_bytes: int
    total_bytes: int


@dataclass
class FileProgress:
    name: str
    size_bytes: int
    done_bytes: int
    speed_bps: float | None
    eta_s: float | None
    state: str                       # queued, downloading, paused, retrying, verifying, verified, present, failed


@dataclass
class Progress:
    files: list[FileProgress]
    done_bytes: int
    total_bytes: int
    speed_bps: float | None
    eta_s: float | None
    elapsed_s: float

    @property
    def fraction(self) -> float:
        return self.done_bytes / self.total_bytes if self.total_bytes else 1.0


@dataclass
class Retrying:
    name: str
    attempt: int
    delay_s: float
    reason: str


@dataclass
class FileVerified:
    name: str
    path: Path
    sha256: str
    downloaded: bool                 # False: it was already there


@dataclass
class FileCorrupt:
    name: str
    expected: str
    actual: str
    action: str


@dataclass
class Notice:
    text: str


@dataclass
class Paused:
    pass


@dataclass
class Resumed:
    pass


@dataclass
class Finished:
    target_dir: Path
    files: list[Path]
    fetched_bytes: int
    elapsed_s: float
    commit: str | None = None
    what: str = "model"


@dataclass
class Stopped:
    """Cancelled or interrupted: partial files and their state are kept; running again resumes."""
    kept_bytes: int
    total_bytes: int
    target_dir: Path
    reason: str = "cancelled"


class DownloadControl:
    """Pause / resume / cancel from another thread (the GUI, a signal handler)."""

    def __init__(self) -> None:
        self._running = threading.Event()
        self._running.set()
        self._cancel = threading.Event()
        self._hooks: dict[int, Callable[[], None]] = {}
        self._hooks_lock = threading.Lock()
        self._next_hook = 0

    def pause(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def cancel(self) -> None:
        """Stop soon: also aborts the connections that are waiting for bytes (a stalled server would otherwise
        hold a worker until its read timeout), so a cancel — and closing the panel — takes well under a second."""
        self._cancel.set()
        self._running.set()
        with self._hooks_lock:
            hooks = list(self._hooks.values())
        for fn in hooks:
            try:
                fn()
            except Exception:  # noqa: BLE001 - a hook must not stop the others
                pass

    def on_cancel(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Call ``fn`` (from the cancelling thread) when cancelled — at once if already; returns the remover."""
        with self._hooks_lock:
            key = self._next_hook
            self._next_hook += 1
            self._hooks[key] = fn
        if self._cancel.is_set():
            try:
                fn()
            except Exception:  # noqa: BLE001
                pass

        def remove() -> None:
            with self._hooks_lock:
                self._hooks.pop(key, None)
        return remove

    @property
    def paused(self) -> bool:
        return not self._running.is_set() and not self._cancel.is_set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def wait_running(self, timeout: float | None = None) -> bool:
        return self._running.wait(timeout)

    def sleep(self, seconds: float) -> bool:
        """Sleep unless cancelled; True if cancelled."""
        return self._cancel.wait(seconds)


class _Stop(Exception):
    """Internal: the control asked this file's worker to stop."""


class _TooSlow(TimeoutError):
    """Bytes still arrive, but slower than ``min_speed_bps`` over a whole stall window: treated as a stall."""


class _Restart(Exception):
    """Internal: the partial file cannot be continued (the server ignored the Range, or the range is past the
    end); start the file over from byte 0."""


# ---------------------------------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------------------------------

fmt_bytes = fmt.bytes_si
fmt_eta = fmt.clock


def hf_token(settings: Settings | None) -> str | None:
    """The token: ``HF_TOKEN`` from the environment, else the ``hf_token`` setting. Never printed."""
    return os.environ.get("HF_TOKEN") or (settings.hf_token if settings else "") or None


def hub_endpoint() -> str:
    """``HF_ENDPOINT`` read now (huggingface_hub reads it once at import)."""
    from huggingface_hub import constants
    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def _scrub(text: str, token: str | None) -> str:
    if token and token in text:
        text = text.replace(token, "***")
    return text


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


# -- verification records -----------------------------------------------------------------------------------------

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


def sha256_file(path: Path, progress: Callable[[int], None] | None = None,
                control: DownloadControl | None = None, bufsize: int = 8 * MiB) -> str:
    """sha256 of a file, reading into one reused buffer (hashlib releases the GIL on each update)."""
    h = hashlib.sha256()
    buf = bytearray(bufsize)
    mv = memoryview(buf)
    done = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(mv[:n])
            done += n
            if progress is not None:
                progress(done)
            if control is not None and control.cancelled:
                raise _Stop()
    return h.hexdigest()


# -- GGUF split metadata ------------------------------------------------------------------------------------------

def split_problems(files: list[Path]) -> list[str]:
    """Problems with the split keys of ``files`` (in shard order); empty when they agree: every file says
    ``split.count`` = len(files), its own ``split.no`` (0-based) matching its place, and one ``split.tensors.count``.
    Uses :func:`engine_manager.layout.read_shard_header` (the planner's header reader)."""
    from .layout import LayoutError, read_shard_header

    problems: list[str] = []
    totals: set[int] = set()
    for i, p in enumerate(files):
        try:
            md = read_shard_header(p).metadata
        except LayoutError as exc:
            problems.append(str(exc))
            continue
        no, count, tcount = md.get("split.no"), md.get("split.count"), md.get("split.tensors.count")
        if len(files) > 1 and (no is None or count is None):
            problems.append(f"{p.name}: no split.no / split.count keys — not a shard of a split GGUF")
            continue
        if count is not None and int(count) != len(files):
            problems.append(f"{p.name}: split.count is {count}, the set has {len(files)} files")
        if no is not None and int(no) != i:
            problems.append(f"{p.name}: split.no is {no} (shard {int(no) + 1}), but it is named as shard {i + 1}")
        if tcount is not None:
            totals.add(int(tcount))
    if len(totals) > 1:
        problems.append(f"the shards disagree about split.tensors.count ({sorted(totals)}): they come from "
                        "different splits")
    return problems


# ---------------------------------------------------------------------------------------------------------------
# HTTP: one ranged GET with http.client (see the module docstring for the measurement)
# ---------------------------------------------------------------------------------------------------------------

def _ssl_context() -> ssl.SSLContext:
    try:
        import certifi
        return ssl.create_default_context(cafile=certifi.where())
    except ImportError:  # pragma: no cover
        return ssl.create_default_context()


def _connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    """A connection for ``url`` (through the environment's proxy if one applies) and the request target."""
    u = urlsplit(url)
    host = u.hostname or ""
    port = u.port or (443 if u.scheme == "https" else 80)
    target = u.path + (f"?{u.query}" if u.query else "")
    proxies = urllib.request.getproxies()
    proxy = proxies.get(u.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        pu = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        if u.scheme == "https":
            conn = http.client.HTTPSConnection(pu.hostname, pu.port or 80, timeout=timeout, context=_ssl_context())
            conn.set_tunnel(host, port)
            return conn, target
        conn = http.client.HTTPConnection(pu.hostname, pu.port or 80, timeout=timeout)
        return conn, url
    if u.scheme == "https":
        return http.client.HTTPSConnection(host, port, timeout=timeout, context=_ssl_context()), target
    return http.client.HTTPConnection(host, port, timeout=timeout), target


class _HTTPStatus(Exception):
    def __init__(self, status: int, url: str, reason: str = ""):
        self.status, self.url, self.reason = status, url, reason
        super().__init__(f"HTTP {status} {reason}".strip())


def _abort_connection(conn: http.client.HTTPConnection) -> None:
    """From another thread: make a blocked read on ``conn`` return now (shutdown, not close, is thread-safe)."""
    sock = getattr(conn, "sock", None)
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _ranged_get(url: str, headers: dict[str, str], offset: int, timeout: float,
                on_connection: Callable[[http.client.HTTPConnection], None] | None = None
                ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse, int]:
    """GET ``url`` from byte ``offset``; follows redirects (dropping Authorization when the host changes).
    Returns the connection, the response (2xx) and the offset the body starts at. ``on_connection`` sees each
    connection once it is open (so a cancel can abort it)."""
    hdrs = dict(headers)
    hdrs["Accept-Encoding"] = "identity"
    if offset > 0:
        hdrs["Range"] = f"bytes={offset}-"
    for _ in range(10):
        conn, target = _connection(url, timeout)
        if on_connection is not None:
            conn.connect()
            on_connection(conn)
        conn.request("GET", target, headers=hdrs)
        resp = conn.getresponse()
        if resp.status in (301, 302, 303, 307, 308) and resp.getheader("Location"):
            new = urljoin(url, resp.getheader("Location"))
            resp.close()
            conn.close()
            if urlsplit(new).netloc != urlsplit(url).netloc:
                hdrs = {k: v for k, v in hdrs.items() if k.lower() != "authorization"}
            url = new
            continue
        if resp.status == 206:
            m = re.match(r"bytes (\d+)-(\d+)/(\d+|\*)", resp.getheader("Content-Range") or "")
            start = int(m.group(1)) if m else -1
            if start != offset:
                resp.close()
                conn.close()
                raise _HTTPStatus(206, url, f"the server answered a range from byte {start}, not {offset}")
            return conn, resp, offset
        if resp.status == 200:
            return conn, resp, 0
        reason = resp.reason
        resp.close()
        conn.close()
        raise _HTTPStatus(resp.status, url, reason)
    raise _HTTPStatus(310, url, "too many redirects")


# ---------------------------------------------------------------------------------------------------------------
# the hasher that follows the writer
# ---------------------------------------------------------------------------------------------------------------

class _Hasher:
    """sha256 of a partial file computed on its own thread while the file is written.

    The writer offers each filled buffer (``offer``); when the hasher's pool has no free buffer the writer keeps
    its own and the hasher later reads those bytes back from the file (``_gap``). Starting at offset 0 with a
    kept prefix, the hasher reads the prefix from the file first, while the download goes on."""

    POOL = 4

    def __init__(self, part: Path, bufsize: int = BUF_BYTES):
        self.part = part
        self.h = hashlib.sha256()
        self.hashed = 0
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.pool: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(self.POOL):
            self.pool.put(bytearray(bufsize))
        self.spare = bytearray(bufsize)
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._rfd = os.open(part, os.O_RDONLY)
        self._gapbuf = bytearray(8 * MiB)
        self._thread = threading.Thread(target=self._run, name=f"sha256:{part.name}", daemon=True)
        self._thread.start()

    def buffer(self) -> tuple[bytearray, bool]:
        """A buffer to receive into and whether it is the hasher's (to be offered back)."""
        try:
            return self.pool.get_nowait(), True
        except queue.Empty:
            return self.spare, False

    def offer(self, offset: int, buf: bytearray, n: int) -> None:
        self.q.put((offset, buf, n))

    def finish(self, size: int, timeout: float | None = None) -> str:
        self.q.put(("end", size, 0))
        self._done.wait(timeout)
        self.close()
        if self.error is not None:
            raise self.error
        if self.hashed != size:
            raise VerificationError(f"{self.part.name}: hashed {self.hashed} of {size} bytes")
        return self.h.hexdigest()

    def close(self) -> None:
        self.q.put(None)
        self._thread.join(timeout=10)
        try:
            os.close(self._rfd)
        except OSError:
            pass

    def _gap(self, end: int) -> None:
        mv = memoryview(self._gapbuf)
        while self.hashed < end:
            n = os.preadv(self._rfd, [mv[:min(len(mv), end - self.hashed)]], self.hashed)
            if n <= 0:
                raise VerificationError(f"{self.part.name}: the partial file ended at {self.hashed} while hashing")
            self.h.update(mv[:n])
            self.hashed += n

    def _run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            off, buf, n = item
            try:
                if off == "end":
                    if self.error is None:
                        self._gap(buf)
                    self._done.set()
                    continue
                if self.error is None:
                    if off > self.hashed:
                        self._gap(off)
                    if off + n > self.hashed:
                        skip = self.hashed - off
                        self.h.update(memoryview(buf)[skip:n])
                        self.hashed = off + n
            except BaseException as exc:  # noqa: BLE001 - reported by finish()
                self.error = exc
            finally:
                if not isinstance(off, str):
                    self.pool.put(buf)


# ---------------------------------------------------------------------------------------------------------------
# one resumable file
# ---------------------------------------------------------------------------------------------------------------

@dataclass
class _Job:
    name: str
    size: int
    sha256: str
    dest: Path
    state_dir: Path
    locate: Callable[[], tuple[str, dict[str, str]]]   # → (URL to GET, headers): re-run at every attempt
    pin: dict[str, Any] = field(default_factory=dict)  # written into the checkpoint; must match to resume
    max_corrupt_retries: int = MAX_CORRUPT_RETRIES
    # live figures, read by the generator's thread
    done: int = 0                    # bytes written to the partial file
    ckpt_at: int = 0                 # bytes covered by the last checkpoint
    synced: int = 0                  # bytes known to be on disk (fdatasync), for a resume after a reboot
    sync_thread: threading.Thread | None = None
    state: str = "queued"
    fetched: int = 0

    @property
    def part(self) -> Path:
        return self.state_dir / f"{self.name}.part"

    @property
    def ckpt(self) -> Path:
        return self.state_dir / f"{self.name}.part.json"

    def kept_offset(self) -> int:
        """Bytes of the partial file a resume can keep: the last checkpoint, if it belongs to this file."""
        try:
            c = json.loads(self.ckpt.read_text())
            size_on_disk = self.part.stat().st_size
        except (OSError, ValueError):
            return 0
        if c.get("sha256") != self.sha256 or c.get("size") != self.size or c.get("pin") != self.pin:
            return 0
        same_boot = c.get("boot_id") == _boot_id()
        keep = int(c.get("offset", 0)) if same_boot else int(c.get("synced", 0))
        return max(0, min(keep, size_on_disk, self.size))


class _Fetcher:
    def __init__(self, control: DownloadControl, events: queue.SimpleQueue, *, token: str | None,
                 checkpoint_bytes: int, stall_timeout_s: float, min_speed_bps: float, max_tries: int,
                 backoff_s: tuple[float, ...]):
        self.control = control
        self.events = events
        self.token = token
        self.checkpoint_bytes = checkpoint_bytes
        self.stall_timeout_s = stall_timeout_s
        self.min_speed_bps = min_speed_bps
        self.max_tries = max_tries
        self.backoff_s = backoff_s
        self.sync_bytes = SYNC_BYTES
        self.remaining: Callable[[], int] | None = None    # bytes still to fetch, all jobs together

    def _disk_full_error(self, job: _Job) -> DiskFullError:
        left = self.remaining() if self.remaining is not None else job.size - job.ckpt_at
        where, free = free_bytes(job.state_dir)
        return DiskFullError(where, left - free)

    def _checkpoint(self, job: _Job, fd: int, offset: int, durable: bool = False) -> None:
        """Record that the partial file holds ``offset`` good bytes.

        A killed process loses nothing the kernel already has (the page cache outlives it), so the common
        checkpoint is only a small state file (temp + rename). A reboot can lose what was never written back: the
        state also says how far an ``fdatasync`` reached (``synced``, every ``sync_bytes`` on a side thread, and on
        pause/stop) and which boot wrote it; a resume after a reboot keeps only the synced part. (An
        ``fdatasync`` at every checkpoint cost 3.6× curl's time in benchmarks/download_speed.py.)"""
        if durable:
            os.fdatasync(fd)
            job.synced = max(job.synced, offset)
        _write_state(job.ckpt, {"schema": 2, "name": job.name, "size": job.size, "sha256": job.sha256,
                                "pin": job.pin, "offset": offset, "synced": job.synced, "boot_id": _boot_id(),
                                "t": time.time()}, durable)
        job.ckpt_at = offset

    def _sync_in_background(self, job: _Job, fd: int) -> None:
        """fdatasync the partial file on a side thread, then record the synced offset."""
        if job.sync_thread is not None and job.sync_thread.is_alive():
            return
        upto = job.done

        def work() -> None:
            try:
                os.fdatasync(fd)
            except OSError:
                return
            job.synced = max(job.synced, upto)

        job.sync_thread = threading.Thread(target=work, name=f"fdatasync:{job.name}", daemon=True)
        job.sync_thread.start()

    def _wait_if_paused(self, job: _Job) -> None:
        if self.control.cancelled:
            raise _Stop()
        if self.control.paused:
            prev, job.state = job.state, "paused"
            while not self.control.wait_running(0.2):
                pass
            if self.control.cancelled:
                raise _Stop()
            job.state = prev

    def run(self, job: _Job) -> None:
        """Fetch ``job`` into its partial file, verify, rename into place. Raises DownloadError or _Stop; a full
        disk is :class:`DiskFullError` at once (never retried as if it were the network)."""
        try:
            self._run(job)
        except OSError as exc:
            if not _disk_full(exc):
                raise
            job.state = "failed"
            raise self._disk_full_error(job) from None

    def _run(self, job: _Job) -> None:
        ensure_private_dir(job.state_dir)
        corrupt = 0
        while True:
            offset = job.kept_offset()
            fd = os.open(job.part, os.O_RDWR | os.O_CREAT, OWNER_ONLY)
            digest = None
            try:
                os.fchmod(fd, OWNER_ONLY)    # a partial left by an older version may be 0644
                os.ftruncate(fd, offset)     # bytes after the last checkpoint are not trusted
                job.done = job.synced = offset
                hasher = _Hasher(job.part)
                try:
                    self._transfer(job, fd, offset, hasher)
                    job.state = "verifying"
                    digest = hasher.finish(job.size)
                except _Restart:
                    hasher.close()
                    job.ckpt.unlink(missing_ok=True)
                    os.ftruncate(fd, 0)
                    continue
                except BaseException:
                    hasher.close()
                    raise
                if digest == job.sha256:
                    os.fsync(fd)
                    break
            finally:
                if job.sync_thread is not None:
                    job.sync_thread.join()
                os.close(fd)
            corrupt += 1
            action = "fetching it again" if corrupt <= job.max_corrupt_retries else "giving up"
            self.events.put(FileCorrupt(job.name, job.sha256, digest or "?", action))
            job.part.unlink(missing_ok=True)
            job.ckpt.unlink(missing_ok=True)
            job.done = 0
            if corrupt > job.max_corrupt_retries:
                raise VerificationError(
                    f"{job.name} arrived {corrupt} times with the wrong sha256 (expected {job.sha256[:12]}…, got "
                    f"{(digest or '?')[:12]}…); the partial file was removed.",
                    "The server or a proxy on the way serves damaged data; try again later or from another network.")
        job.dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(job.part, job.dest)
        _fsync_dir(job.dest.parent)
        job.ckpt.unlink(missing_ok=True)
        _record_verified(job.dest, job.sha256)
        job.state = "verified"
        job.done = job.size
        self.events.put(FileVerified(job.name, job.dest, job.sha256, True))

    def _transfer(self, job: _Job, fd: int, offset: int, hasher: _Hasher) -> None:
        tries = 0
        job.done = job.ckpt_at = offset
        while job.done < job.size:
            offset = job.done
            self._wait_if_paused(job)
            job.state = "downloading"
            progress_at_start = offset
            conn = None
            unhook: list[Callable[[], None]] = []

            def opened(c: http.client.HTTPConnection, unhook: list[Callable[[], None]] = unhook) -> None:
                unhook.append(self.control.on_cancel(lambda: _abort_connection(c)))

            try:
                url, headers = job.locate()
                conn, resp, start = _ranged_get(url, headers, offset, self.stall_timeout_s, opened)
                if start != offset:
                    raise _Restart()     # the server ignored the Range: start over from byte 0
                length = resp.getheader("Content-Length")
                if length is not None and int(length) != job.size - offset:
                    raise VerificationError(f"{job.name}: the server offers {int(length) + offset:,} bytes, the "
                                        f"metadata says {job.size:,}.",
                                        "The file changed on the server; run the download again to re-resolve it.")
                paused = self._read_body(job, fd, resp, hasher)
                if job.done < job.size and not paused:
                    raise ConnectionError(f"the connection closed at byte {job.done:,} of {job.size:,}")
            except (_Stop, _Restart):
                self._checkpoint(job, fd, job.done, durable=True)
                raise
            except _HTTPStatus as exc:
                if exc.status in (401, 403):
                    raise HubError(f"{job.name}: the server refused access (HTTP {exc.status}).",
                                   "Set HF_TOKEN (or the hf_token setting) to a token that can read the repository, "
                                   "and accept its terms on the hub if it is gated.") from None
                if exc.status == 404:
                    raise HubError(f"{job.name}: not found on the server (HTTP 404).",
                                   "Check DSV41_MODEL_REPO / DSV41_MODEL_REVISION, or the engine manifest's URL.") \
                        from None
                if exc.status == 416:    # our range lies past the end: the partial cannot be right
                    raise _Restart() from None
                tries = self._retry(job, tries, f"HTTP {exc.status} {exc.reason}".strip(),
                                    job.done > progress_at_start)
            except DownloadError:
                raise
            except Exception as exc:  # noqa: BLE001 - network trouble of any kind: retry with backoff
                if _disk_full(exc):          # the disk, not the network: nothing to retry
                    raise
                if self.control.cancelled:   # the cancel aborted the connection: a stop, not a network error
                    self._checkpoint(job, fd, job.done, durable=True)
                    raise _Stop() from None
                from huggingface_hub.errors import HfHubHTTPError
                if isinstance(exc, HfHubHTTPError) and exc.response is not None and \
                        exc.response.status_code in (401, 403, 404):
                    raise _hub_error(exc, self.token) from None
                if isinstance(exc, _TooSlow):
                    reason = str(exc)
                elif isinstance(exc, (socket.timeout, TimeoutError)):
                    reason = f"no data for {self.stall_timeout_s:g} s (stalled)"
                else:
                    reason = _scrub(f"{type(exc).__name__}: {exc}", self.token)
                tries = self._retry(job, tries, reason, job.done > progress_at_start)
            finally:
                for u in unhook:
                    u()
                if conn is not None:
                    conn.close()
            if job.done > job.ckpt_at or job.synced < job.done:
                self._checkpoint(job, fd, job.done, durable=self.control.paused)

    def _retry(self, job: _Job, tries: int, reason: str, progressed: bool) -> int:
        tries = 1 if progressed else tries + 1
        if tries > self.max_tries:
            raise DownloadError(f"{job.name}: gave up after {tries - 1} tries without progress ({reason}).",
                                "Check the network (or HF_ENDPOINT / the proxy settings) and run the download "
                                "again: it resumes where it stopped.")
        delay = self.backoff_s[min(tries - 1, len(self.backoff_s) - 1)] * (0.8 + 0.4 * random.random())
        job.state = "retrying"
        self.events.put(Retrying(job.name, tries, delay, reason))
        if self.control.sleep(delay):
            raise _Stop()
        return tries

    def _read_body(self, job: _Job, fd: int, resp: http.client.HTTPResponse, hasher: _Hasher) -> bool:
        """Read the body into the partial file from ``job.done`` (kept up to date after every write, so an
        exception leaves it right). Returns True when it stopped for a pause."""
        chunked = bool(getattr(resp, "chunked", False))
        raw = resp.fp                # the buffered socket: readinto1 returns what has arrived, up to the buffer
        window_t, window_bytes = time.monotonic(), 0
        control = self.control
        while job.done < job.size and raw is not None:
            offset = job.done
            buf, owned = hasher.buffer()
            mv = memoryview(buf)
            filled = 0
            flush_at = time.monotonic() + 0.25
            # never fill past the next checkpoint: what a kill can cost stays within one checkpoint
            want = min(len(buf), job.size - offset, max(1, job.ckpt_at + self.checkpoint_bytes - offset))
            try:
                while filled < want:
                    if chunked:          # rare for files; http.client undoes the chunk framing
                        data = resp.read1(want - filled)
                        n = len(data)
                        mv[filled:filled + n] = data
                    else:
                        n = raw.readinto1(mv[filled:want])
                    if not n:
                        break
                    filled += n
                    if control.cancelled or control.paused or time.monotonic() >= flush_at:
                        break
            finally:
                if filled:
                    try:
                        _pwrite_all(fd, mv[:filled], offset)
                    except BaseException:
                        if owned:
                            hasher.pool.put(buf)
                        raise
                    if owned:
                        hasher.offer(offset, buf, filled)
                    job.done = offset + filled
                    job.fetched += filled
                    window_bytes += filled
                elif owned:
                    hasher.pool.put(buf)
            if control.cancelled:
                raise _Stop()        # (a cancel also shuts the socket down, so the read above returned at once)
            if not filled:
                break                # the server closed the connection
            if job.done - job.ckpt_at >= self.checkpoint_bytes:
                self._checkpoint(job, fd, job.done)
                if job.done - job.synced >= self.sync_bytes:
                    self._sync_in_background(job, fd)
            now = time.monotonic()
            if now - window_t >= self.stall_timeout_s:
                if window_bytes / (now - window_t) < self.min_speed_bps:
                    raise _TooSlow(f"{window_bytes / (now - window_t):,.0f} B/s over {now - window_t:.1f} s, "
                                   f"below {self.min_speed_bps:,.0f} B/s (stalled)")
                window_t, window_bytes = now, 0
            if control.cancelled:
                raise _Stop()
            if control.paused:
                return True          # close the connection; the caller waits, then reconnects
        return False


_BOOT_ID: str | None = None


def _boot_id() -> str:
    """Changes at every boot: a checkpoint from this boot may trust the page cache, one from before may not."""
    global _BOOT_ID
    if _BOOT_ID is None:
        try:
            _BOOT_ID = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        except OSError:
            import psutil
            _BOOT_ID = f"boot-{int(psutil.boot_time())}"
    return _BOOT_ID


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


def _hub_error(exc: BaseException, token: str | None) -> HubError:
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    text = _scrub(str(exc).splitlines()[0] if str(exc) else type(exc).__name__, token)
    if isinstance(exc, GatedRepoError):
        return HubError(f"The repository is gated: {text}",
                        "Accept its terms on the hub with your account, then set HF_TOKEN (or the hf_token "
                        "setting) to a token of that account.")
    if isinstance(exc, RepositoryNotFoundError):
        return HubError(f"The hub says the repository does not exist or needs a token ({text}).",
                        "Check DSV41_MODEL_REPO; if the repository is private or gated, set HF_TOKEN (or the "
                        "hf_token setting) to a token that can read it.")
    if isinstance(exc, RevisionNotFoundError):
        return HubError(f"The revision does not exist on the hub ({text}).",
                        "Check DSV41_MODEL_REVISION (a branch, tag or 40-hex commit).")
    if isinstance(exc, HfHubHTTPError):
        code = exc.response.status_code if exc.response is not None else "?"
        if code in (401, 403):
            return HubError(f"The hub refused access (HTTP {code}).",
                            "Set HF_TOKEN (or the hf_token setting) to a token that can read the repository.")
        if code == 404:
            return HubError(f"The hub answered HTTP 404 (not found): {text}",
                            "Check DSV41_MODEL_REPO and DSV41_MODEL_REVISION; the file may have been removed at "
                            "that revision.")
        return HubError(f"The hub answered HTTP {code}: {text}", "Try again later; the download resumes.")
    return HubError(f"Could not reach the hub at {hub_endpoint()} ({type(exc).__name__}: {text}).",
                    "Check the network connection, the proxy settings and HF_ENDPOINT, then run the download again.")


# ---------------------------------------------------------------------------------------------------------------
# resolving the model
# ---------------------------------------------------------------------------------------------------------------

def _state_path(target: Path) -> Path:
    return target / STATE_DIR / "state.json"


def _load_state(target: Path) -> dict[str, Any]:
    try:
        data = json.loads(_state_path(target).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _revision_missing(exc: BaseException) -> bool:
    from huggingface_hub.errors import RevisionNotFoundError
    return isinstance(exc, RevisionNotFoundError)


def resolve_model(settings: Settings, target_dir: Path | None = None, *, endpoint: str | None = None,
                  token: str | None = None, retries: int = 3, repin: bool = False) -> Resolved:
    """Resolve the model's files at the pinned commit (or pin one): names, sizes and LFS sha256. ``repin``
    ignores the folder's pinned commit and resolves the requested revision again.

    Raises :class:`HubError` with the fix when the hub refuses or cannot be reached, and
    :class:`PinnedCommitGone` when the hub no longer has the pinned commit."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    target = Path(target_dir) if target_dir else _default_target(settings)
    endpoint = (endpoint or hub_endpoint()).rstrip("/")
    token = token if token is not None else hf_token(settings)
    repo, requested = settings.model_repo, settings.model_revision
    state = _load_state(target)
    pinned = (not repin and bool(state.get("commit")) and state.get("repo") == repo
              and state.get("revision") == requested)
    rev = state["commit"] if pinned else requested
    api = HfApi(endpoint=endpoint, token=token if token else False)
    names = shard_names()
    info = None
    for attempt in range(retries):
        try:
            info = api.model_info(repo, revision=rev, files_metadata=True)
            break
        except HfHubHTTPError as exc:
            code = exc.response.status_code if exc.response is not None else 0
            if pinned and _revision_missing(exc):
                raise PinnedCommitGone(repo, rev, requested, state.get("pinned_at"), target) from None
            if code < 500 and code not in (408, 429) or attempt == retries - 1:
                raise _hub_error(exc, token) from None
        except Exception as exc:  # noqa: BLE001 - transport errors of httpx2
            if attempt == retries - 1:
                raise _hub_error(exc, token) from None
        time.sleep(min(4.0, 0.5 * 2**attempt))
    assert info is not None
    commit = info.sha or rev
    siblings = {s.rfilename: s for s in (info.siblings or [])}
    missing = [n for n in names if n not in siblings]
    if missing:
        raise HubError(f"{repo} at {commit[:12]} does not hold the expected shards (missing: {', '.join(missing)}).",
                       "Check DSV41_MODEL_REPO and DSV41_MODEL_REVISION: the panel expects the seven Q2_K files "
                       "named in resources/manifests/model.json.")
    files = []
    need_paths_info = [n for n in names if siblings[n].lfs is None or siblings[n].size is None]
    extra: dict[str, Any] = {}
    if need_paths_info:
        try:
            for e in api.get_paths_info(repo, need_paths_info, revision=commit):
                extra[e.path] = e
        except Exception as exc:  # noqa: BLE001
            raise _hub_error(exc, token) from None
    for n in names:
        s = extra.get(n) or siblings[n]
        lfs = getattr(s, "lfs", None)
        if lfs is None:
            raise HubError(f"{n} has no LFS sha256 on the hub, so it cannot be verified.",
                           "The panel only downloads files it can verify; report this repository.")
        files.append(RemoteFile(n, int(lfs.size if lfs.size is not None else s.size), str(lfs.sha256)))
    return Resolved(repo, requested, commit, pinned, files, sum(f.size for f in files), target)


def _default_target(settings: Settings) -> Path:
    return Path(settings.model_dir).expanduser() if settings.model_dir else default_model_dir(settings)


def _model_locator(repo: str, commit: str, name: str, endpoint: str, token: str | None, size: int, sha: str
                   ) -> Callable[[], tuple[str, dict[str, str]]]:
    """Where to GET ``name`` from: the hub's resolve URL at the pinned commit, after the hub's redirect
    (``get_hf_file_metadata``), with the hub's headers; Authorization only while on the hub's host."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    def locate() -> tuple[str, dict[str, str]]:
        url = hf_hub_url(repo, name, revision=commit, endpoint=endpoint)
        meta = get_hf_file_metadata(url, token=token if token else False, endpoint=endpoint)
        if meta.size is not None and meta.size != size:
            raise DownloadError(f"{name}: the hub now says {meta.size:,} bytes at commit {commit[:12]}, the "
                                f"resolved list said {size:,}.", "Run the download again to re-resolve.")
        if meta.etag and len(meta.etag) == 64 and meta.etag != sha:
            raise DownloadError(f"{name}: the hub's ETag {meta.etag[:12]}… differs from the LFS sha256 "
                                f"{sha[:12]}….", "Run the download again to re-resolve.")
        headers = build_hf_headers(token=token if token else False)
        if urlsplit(meta.location).netloc != urlsplit(endpoint).netloc:
            headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
        return meta.location, headers

    return locate


# ---------------------------------------------------------------------------------------------------------------
# the running of several jobs, as one generator
# ---------------------------------------------------------------------------------------------------------------

class _Speed:
    """Bytes/s over a sliding window of a few seconds."""

    def __init__(self, window_s: float = 5.0):
        self.window_s = window_s
        self.samples: list[tuple[float, int]] = []

    def add(self, t: float, total: int) -> float | None:
        self.samples.append((t, total))
        while len(self.samples) > 2 and t - self.samples[0][0] > self.window_s:
            self.samples.pop(0)
        t0, b0 = self.samples[0]
        if t - t0 < 0.2:
            return None
        return max(0.0, (total - b0) / (t - t0))


def _run_jobs(jobs: list[_Job], present: list[FileProgress], *, control: DownloadControl, n_workers: int,
              token: str | None, checkpoint_bytes: int, stall_timeout_s: float, min_speed_bps: float,
              max_tries: int, backoff_s: tuple[float, ...], progress_interval_s: float,
              target: Path) -> Iterator[Any]:
    """Run ``jobs`` on ``n_workers`` threads; yield their events and a Progress snapshot now and then.
    Returns the bytes fetched. On cancel (or the generator being closed) the workers checkpoint and stop."""
    events: queue.SimpleQueue = queue.SimpleQueue()
    fetcher = _Fetcher(control, events, token=token, checkpoint_bytes=checkpoint_bytes,
                       stall_timeout_s=stall_timeout_s, min_speed_bps=min_speed_bps, max_tries=max_tries,
                       backoff_s=backoff_s)
    fetcher.remaining = lambda: sum(max(0, j.size - j.ckpt_at) for j in jobs if j.state != "verified")
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for j in jobs:
        todo.put(j)
    errors: list[BaseException] = []
    stop_all = threading.Event()

    def worker() -> None:
        while not stop_all.is_set():
            try:
                job = todo.get_nowait()
            except queue.Empty:
                return
            try:
                fetcher.run(job)
            except _Stop:
                job.state = "paused" if not control.cancelled else "stopped"
                return
            except BaseException as exc:  # noqa: BLE001
                job.state = "failed"
                errors.append(exc)
                stop_all.set()
                control.cancel()
                return

    threads = [threading.Thread(target=worker, name=f"download-{i}", daemon=True)
               for i in range(max(1, min(n_workers, len(jobs))))]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    total_size = sum(j.size for j in jobs) + sum(p.size_bytes for p in present)
    speeds = {j.name: _Speed() for j in jobs}
    total_speed = _Speed()
    was_paused = False
    last = 0.0
    try:
        while True:
            alive = any(t.is_alive() for t in threads)
            try:
                ev = events.get(timeout=min(progress_interval_s, 0.1))
                yield ev
                continue
            except queue.Empty:
                pass
            if control.paused != was_paused:
                was_paused = control.paused
                yield Paused() if was_paused else Resumed()
            now = time.monotonic()
            if now - last >= progress_interval_s or not alive:
                last = now
                yield _snapshot(jobs, present, speeds, total_speed, now, t0, total_size)
            if not alive:
                while True:
                    try:
                        yield events.get_nowait()
                    except queue.Empty:
                        break
                break
    finally:
        if any(t.is_alive() for t in threads):    # closed from outside (Ctrl+C, GUI quit): stop cleanly
            control.cancel()
            for t in threads:
                t.join(timeout=30)
    if errors:
        raise errors[0]
    return sum(j.fetched for j in jobs)


def _snapshot(jobs, present, speeds, total_speed, now, t0, total_size) -> Progress:
    files = list(present)
    done_total = sum(p.done_bytes for p in present)
    for j in jobs:
        sp = speeds[j.name].add(now, j.fetched)
        active = j.state in ("downloading",)
        rem = j.size - j.done
        eta = rem / sp if (sp and active and rem > 0) else (0.0 if rem <= 0 else None)
        files.append(FileProgress(j.name, j.size, j.done, sp if active else 0.0 if j.state != "queued" else None,
                                  eta, j.state))
        done_total += j.done
    tsp = total_speed.add(now, sum(j.fetched for j in jobs))
    rem = total_size - done_total
    eta = rem / tsp if tsp else (0.0 if rem <= 0 else None)
    order = {n: i for i, n in enumerate(sorted(f.name for f in files))}
    files.sort(key=lambda f: order[f.name])
    return Progress(files, done_total, total_size, tsp, eta, now - t0)


# ---------------------------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------------------------

def check_existing(files: list[RemoteFile], folder: Path, *, verify: str = "quick",
                   control: DownloadControl | None = None, jobs: int = DEFAULT_JOBS
                   ) -> Iterator[Any]:
    """Hash the files of ``folder`` that are not known-verified; yield Checking/FileVerified/FileCorrupt and
    return ``{name: True (good) | False (bad) | None (absent)}``."""
    result: dict[str, bool | None] = {}
    to_hash: list[RemoteFile] = []
    for f in files:
        p = folder / f.name
        if not p.is_file():
            result[f.name] = None
        elif p.stat().st_size != f.size:
            result[f.name] = False
            yield FileCorrupt(f.name, f.sha256, f"size {p.stat().st_size}", "fetching it again")
        elif verify != "full" and known_verified(p, f.sha256):
            result[f.name] = True
            yield FileVerified(f.name, p, f.sha256, False)
        else:
            to_hash.append(f)
    if not to_hash:
        return result
    events: queue.SimpleQueue = queue.SimpleQueue()
    done: dict[str, int] = {f.name: 0 for f in to_hash}
    control = control or DownloadControl()
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for f in to_hash:
        todo.put(f)

    def work() -> None:
        while True:
            try:
                f = todo.get_nowait()
            except queue.Empty:
                return
            p = folder / f.name
            try:
                digest = sha256_file(p, progress=lambda n, name=f.name: done.__setitem__(name, n), control=control)
            except _Stop:
                return
            except OSError as exc:
                events.put(("err", f, str(exc)))
                continue
            events.put(("ok" if digest == f.sha256 else "bad", f, digest))

    threads = [threading.Thread(target=work, daemon=True) for _ in range(max(1, min(jobs, len(to_hash))))]
    for t in threads:
        t.start()
    total = sum(f.size for f in to_hash)
    sizes = {f.name: f.size for f in to_hash}
    try:
        while any(t.is_alive() for t in threads) or not events.empty():
            try:
                kind, f, info = events.get(timeout=0.25)
            except queue.Empty:
                busy = [n for n, d in done.items() if 0 < d < sizes[n]]
                yield Checking(", ".join(busy) or to_hash[0].name, sum(done.values()), total)
                continue
            p = folder / f.name
            if kind == "ok":
                _record_verified(p, f.sha256)
                result[f.name] = True
                yield FileVerified(f.name, p, f.sha256, False)
            else:
                result[f.name] = False
                yield FileCorrupt(f.name, f.sha256, info if kind == "bad" else f"unreadable: {info}",
                                  "fetching it again")
    finally:
        if any(t.is_alive() for t in threads):
            control.cancel()
            for t in threads:
                t.join(timeout=10)
    if control.cancelled:
        raise _Stop()
    return result


def complete_offline(settings: Settings, folder: Path) -> tuple[list[RemoteFile], str | None] | None:
    """The shards of ``folder`` if it needs nothing from the hub: all seven present, each verified before and
    unchanged since (size + mtime, against the sha256 the folder's pinned state lists), their split metadata
    agreeing, and the pin (when there is one) for the repository and revision the settings ask for. Returns
    ``(files, pinned commit or None)``, or None when the hub has to be asked."""
    state = _load_state(folder)
    names = shard_names()
    if state.get("commit") and (state.get("repo") != settings.model_repo
                                or state.get("revision") != settings.model_revision):
        return None                  # the settings ask for another repository or revision: resolve it
    listed = {f.get("name"): f for f in state.get("files") or [] if isinstance(f, dict)}
    recs = _load_records()
    files: list[RemoteFile] = []
    for n in names:
        p = folder / n
        rec = recs.get(str(p.resolve())) if p.is_file() else None
        sha = (listed.get(n) or {}).get("sha256") or (rec or {}).get("sha256")
        if not rec or not sha or not known_verified(p, sha):
            return None
        files.append(RemoteFile(n, int(rec["size"]), str(sha)))
    if split_problems([folder / f.name for f in files]):
        return None
    return files, state.get("commit")


def download_model(settings: Settings, *, target_dir: Path | None = None, jobs: int = DEFAULT_JOBS,
                   control: DownloadControl | None = None, endpoint: str | None = None, token: str | None = None,
                   verify: str = "quick", repin: bool = False, checkpoint_bytes: int = CHECKPOINT_BYTES,
                   stall_timeout_s: float = STALL_TIMEOUT_S, min_speed_bps: float = MIN_SPEED_BPS,
                   max_tries: int = MAX_TRIES_WITHOUT_PROGRESS, backoff_s: tuple[float, ...] = BACKOFF_S,
                   reserve_bytes: int = RESERVE_BYTES, progress_interval_s: float = 0.25) -> Iterator[Any]:
    """Make the model folder hold the seven verified shards; yield events (see the module docstring).

    The folder is ``target_dir``, else ``settings.model_dir`` (a complete verified set there means nothing is
    downloaded; an incomplete one is completed in place), else ``<cache_dir>/models/<owner>--<name>``. A complete
    verified set finishes without asking the hub (so it works offline) unless ``verify="full"`` or ``repin``.
    ``repin`` resolves the requested revision again instead of the folder's pinned commit.
    Raises :class:`DownloadError` (its subclasses say what went wrong) with the fix."""
    control = control or DownloadControl()
    t0 = time.monotonic()
    token = token if token is not None else hf_token(settings)
    endpoint = (endpoint or hub_endpoint()).rstrip("/")
    target = Path(target_dir).expanduser() if target_dir else _default_target(settings)
    if target_dir is None and settings.model_dir:
        yield Notice(f"Using the model folder {target} (DSV41_MODEL_DIR / model_dir).")
    if verify != "full" and not repin:
        local = complete_offline(settings, target)
        if local is not None:
            files, commit = local
            at = f" at the pinned commit {commit[:12]}" if commit else ""
            yield Notice(f"All {len(files)} shards are present and verified in {target}{at} (sha256 checked "
                         "before, unchanged since); nothing to download, the hub was not asked (`dsv41 download "
                         "--verify` re-hashes them against it).")
            for f in files:
                yield FileVerified(f.name, target / f.name, f.sha256, False)
            yield Finished(target, [target / f.name for f in files], 0, time.monotonic() - t0, commit, "model")
            return target
    old_commit = _load_state(target).get("commit")
    res = resolve_model(settings, target, endpoint=endpoint, token=token, repin=repin)
    yield res
    if repin and old_commit and old_commit != res.commit:
        yield Notice(f"Re-pinned {res.repo} from commit {old_commit[:12]} to {res.commit[:12]} ('{res.revision}' "
                     "now); verified shards with an unchanged sha256 are kept.")
    for f in res.files:
        if f.size > HTTP_SIZE_LIMIT:
            yield Notice(f"{f.name} is {fmt_bytes(f.size)}, over huggingface_hub's 50 GB plain-HTTP limit; it is "
                         "fetched with ranged requests, which have no such limit.")

    try:
        existing = yield from check_existing(res.files, target, verify=verify, control=control, jobs=jobs)
    except _Stop:
        yield Stopped(0, res.total_bytes, target, "cancelled")
        return None
    state_dir = target / STATE_DIR
    needed = 0
    pending: list[RemoteFile] = []
    for f in res.files:
        if existing.get(f.name):
            continue
        pending.append(f)
        job = _Job(f.name, f.size, f.sha256, target / f.name, state_dir, lambda: ("", {}),
                   pin={"repo": res.repo, "commit": res.commit})
        needed += f.size - job.kept_offset()

    if pending:
        where, free = free_bytes(target)
        yield DiskChecked(where, free, needed + reserve_bytes)
        if free < needed + reserve_bytes:
            raise DiskSpaceError(where, free, needed + reserve_bytes)

    # From here on things are written: only by one download at a time (the GUI and the CLI alike).
    lock = FolderLock(state_dir, target, _command_words()).acquire()
    try:
        return (yield from _download_locked(
            res, target, state_dir, existing, pending, control=control, jobs=jobs, token=token, endpoint=endpoint,
            checkpoint_bytes=checkpoint_bytes, stall_timeout_s=stall_timeout_s, min_speed_bps=min_speed_bps,
            max_tries=max_tries, backoff_s=backoff_s, progress_interval_s=progress_interval_s, t0=t0))
    except OSError as exc:           # the disk filled up outside a transfer (the folder's own state file)
        if not _disk_full(exc):
            raise
        where, free = free_bytes(state_dir)
        raise DiskFullError(where, needed - free) from None
    finally:
        lock.release()


def _download_locked(res: Resolved, target: Path, state_dir: Path, existing: dict[str, bool | None],
                     pending: list[RemoteFile], *, control: DownloadControl, jobs: int, token: str | None,
                     endpoint: str, checkpoint_bytes: int, stall_timeout_s: float, min_speed_bps: float,
                     max_tries: int, backoff_s: tuple[float, ...], progress_interval_s: float,
                     t0: float) -> Iterator[Any]:
    """The writing part of :func:`download_model`, run while its folder lock is held."""
    ensure_private_dir(state_dir)
    atomic_write_json(_state_path(target), {
        "schema": 1, "repo": res.repo, "revision": res.revision, "commit": res.commit, "endpoint": endpoint,
        "files": [f.__dict__ for f in res.files],
        "pinned_at": (_load_state(target).get("pinned_at", time.time()) if _load_state(target).get("commit") ==
                      res.commit else time.time())})
    for f in pending:
        if existing.get(f.name) is False:
            bad = target / f.name
            _forget_verified(bad)
            bad.unlink(missing_ok=True)

    present = [FileProgress(f.name, f.size, f.size, None, 0.0, "present") for f in res.files if existing.get(f.name)]
    job_list = [_Job(f.name, f.size, f.sha256, target / f.name, state_dir,
                     _model_locator(res.repo, res.commit, f.name, endpoint, token, f.size, f.sha256),
                     pin={"repo": res.repo, "commit": res.commit}) for f in pending]
    fetched = 0
    if job_list:
        try:
            fetched = yield from _run_jobs(job_list, present, control=control, n_workers=jobs, token=token,
                                           checkpoint_bytes=checkpoint_bytes, stall_timeout_s=stall_timeout_s,
                                           min_speed_bps=min_speed_bps, max_tries=max_tries, backoff_s=backoff_s,
                                           progress_interval_s=progress_interval_s, target=target)
        except DownloadError:
            raise
        if control.cancelled:
            kept = sum(j.done for j in job_list) + sum(p.size_bytes for p in present)
            yield Stopped(kept, res.total_bytes, target, "cancelled")
            return None
    files = [target / f.name for f in res.files]
    problems = split_problems(files)
    if problems:
        raise VerificationError("The seven files verified one by one, but their split metadata disagree: "
                                + "; ".join(problems) + ".",
                                "The repository mixes shards of different splits; report it, or point "
                                "DSV41_MODEL_REVISION at a consistent commit.")
    yield Finished(target, files, fetched, time.monotonic() - t0, res.commit, "model")
    return target


def verify_model_dir(settings: Settings, folder: Path, *, endpoint: str | None = None, token: str | None = None,
                     control: DownloadControl | None = None, jobs: int = DEFAULT_JOBS,
                     verify: str = "quick") -> Iterator[Any]:
    """Check that ``folder`` holds the complete verified set (sha256 against the hub at the pinned commit, split
    metadata agreeing); yields events and returns the list of problems (empty: complete)."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        return [f"{folder} is not a folder"]
    res = resolve_model(settings, folder if _load_state(folder) else _default_target(settings),
                        endpoint=endpoint, token=token)
    yield res
    try:
        existing = yield from check_existing(res.files, folder, verify=verify, control=control, jobs=jobs)
    except _Stop:
        return ["cancelled"]
    problems = [f"{n}: missing" for n, ok in existing.items() if ok is None]
    problems += [f"{n}: does not match its sha256" for n, ok in existing.items() if ok is False]
    if not problems:
        problems = split_problems([folder / f.name for f in res.files])
    return problems


@dataclass
class LocalStatus:
    """What is on disk, without network or hashing (for the first-run check and the status line)."""
    folder: Path
    present: list[str]
    missing: list[str]
    verified: bool                   # all present and known-verified since their last change
    partial_bytes: int               # bytes of partial files a resume keeps (their last checkpoint)
    commit: str | None
    sizes: dict[str, int] = field(default_factory=dict)       # name → size, from the pinned state (if any)
    kept: dict[str, int] = field(default_factory=dict)        # name → bytes a resume keeps, for missing shards
    pinned_at: float | None = None


def local_status(settings: Settings, target_dir: Path | None = None) -> LocalStatus:
    folder = Path(target_dir).expanduser() if target_dir else _default_target(settings)
    state = _load_state(folder)
    listed = {f["name"]: f for f in state.get("files", []) if isinstance(f, dict) and "name" in f}
    expected = {n: f.get("sha256") for n, f in listed.items()}
    sizes = {n: int(f["size"]) for n, f in listed.items() if isinstance(f.get("size"), int)}
    names = shard_names()
    present = [n for n in names if (folder / n).is_file()]
    missing = [n for n in names if n not in present]
    verified = not missing and all(known_verified(folder / n, expected.get(n)) for n in names)
    kept: dict[str, int] = {}
    pin = {"repo": state.get("repo"), "commit": state.get("commit")}
    for n in missing:
        j = _Job(n, sizes.get(n, 0), expected.get(n) or "", folder / n, folder / STATE_DIR, lambda: ("", {}),
                 pin=pin)
        if n in sizes and expected.get(n):
            k = j.kept_offset()      # what a resume really keeps: the checkpoint, not bytes written after it
        else:
            try:
                k = j.part.stat().st_size
            except OSError:
                k = 0
        if k:
            kept[n] = k
    return LocalStatus(folder, present, missing, verified, sum(kept.values()), state.get("commit"), sizes, kept,
                       state.get("pinned_at"))


def model_present(settings: Settings) -> bool:
    """True when the model folder holds all seven shards that were verified (cheap: no hashing)."""
    st = local_status(settings)
    if st.verified:
        return True
    if settings.model_dir is None:
        return False
    return local_status(settings, default_model_dir(settings)).verified


# ---------------------------------------------------------------------------------------------------------------
# the engine release
# ---------------------------------------------------------------------------------------------------------------

RELEASE_MARKER = ".dsv41-release.json"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def read_engine_manifest(manifest: dict[str, Any] | os.PathLike | str | None = None) -> dict[str, Any]:
    if manifest is None:
        env = os.environ.get("DSV41_ENGINE_MANIFEST")
        m = json.loads(Path(env).read_text()) if env else load_manifest("engine")
    elif isinstance(manifest, dict):
        m = dict(manifest)
    else:
        m = json.loads(Path(manifest).read_text())
    version = str(m.get("version") or "")
    if not re.match(r"^[A-Za-z0-9._+-]+$", version):
        raise ArchiveError(f"The engine manifest's version {version!r} is not usable as a folder name.",
                           "Fix resources/manifests/engine.json.")
    sha = str(m.get("sha256") or "").lower()
    if m.get("placeholder") or not _HEX64.match(sha) or not isinstance(m.get("size"), int) or not m.get("url"):
        raise ArchiveError(
            "The engine manifest pins no usable release (URL, size and sha256 are needed; this build's manifest is "
            "a placeholder because the release could not be reached when it was made). The panel never runs a "
            "binary it has not verified.",
            "Put the release's URL, size and sha256 into resources/manifests/engine.json (or point "
            "DSV41_ENGINE_MANIFEST / --engine-manifest at such a file), or unpack the engine yourself and set "
            "DSV41_ENGINE_DIR.")
    m["sha256"] = sha
    m["executables"] = _manifest_paths(m.get("executables", []), "executables")
    return m


def _manifest_paths(value: Any, key: str) -> list[str]:
    """The manifest's ``key`` as a list of relative paths inside the release folder; anything else (an absolute
    path, ``..``, a non-string) is refused in plain words, before anything is downloaded or touched."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ArchiveError(f"The engine manifest's {key!r} must be a list of paths inside the release folder "
                           f"(got {value!r:.80}).", "Fix the manifest (resources/manifests/engine.json or "
                           "DSV41_ENGINE_MANIFEST / --engine-manifest).")
    bad = []
    for v in value:
        pp = PurePosixPath(v.replace("\\", "/"))
        if not v or "\0" in v or pp.is_absolute() or re.match(r"^[A-Za-z]:", v) or ".." in pp.parts:
            bad.append(v)
    if bad:
        raise ArchiveError(f"The engine manifest's {key!r} names {', '.join(repr(b) for b in bad[:3])}: a path "
                           "that leaves the release folder (absolute, or climbing out with '..'). Nothing was "
                           "downloaded or changed.", "Fix the manifest: list paths inside the release, such as "
                           "\"bin/strata\".")
    return list(value)


def _inside(root: Path, rel: str) -> Path:
    """``root / rel`` resolved (links followed), refused with :class:`ArchiveError` unless it stays in ``root``."""
    base = root.resolve()
    p = (root / rel).resolve()
    if p != base and base not in p.parents:
        raise ArchiveError(f"The engine manifest names {rel!r}, which resolves to {p}, outside the release folder; "
                           "it was not touched and nothing was installed.",
                           "Fix the manifest or the archive (a link inside it points out of the release).")
    return p


def installed_engine(settings: Settings, manifest: dict[str, Any] | None = None) -> Path | None:
    """The unpacked release folder if it is installed and came from an archive with the manifest's sha256."""
    try:
        m = read_engine_manifest(manifest)
    except (ArchiveError, OSError, ValueError):
        return None
    d = engine_release_dir(settings, m["version"])
    try:
        marker = json.loads((d / RELEASE_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return d if marker.get("sha256") == m["sha256"] else None


def _member_problem(m: tarfile.TarInfo, dest: Path) -> str | None:
    name = m.name
    pp = PurePosixPath(name)
    if name.startswith(("/", "\\")) or pp.is_absolute() or re.match(r"^[A-Za-z]:", name):
        return f"{name!r} is an absolute path"
    if ".." in pp.parts or ".." in PurePosixPath(name.replace("\\", "/")).parts:
        return f"{name!r} climbs out with '..'"
    if m.isdev() or m.ischr() or m.isblk() or m.isfifo():
        return f"{name!r} is a device or pipe"
    if m.issym() or m.islnk():
        link = m.linkname
        if link.startswith("/") or PurePosixPath(link).is_absolute():
            return f"{name!r} links to the absolute path {link!r}"
        base = (dest / pp.parent) if m.issym() else dest
        resolved = os.path.normpath(os.path.join(base, link))
        if not (resolved == str(dest) or resolved.startswith(str(dest) + os.sep)):
            return f"{name!r} links outside the release folder ({link!r})"
    if not (m.isfile() or m.isdir() or m.issym() or m.islnk()):
        return f"{name!r} is not a regular file or folder"
    return None


def safe_extract(archive: Path, dest: Path) -> list[str]:
    """Unpack a tar archive into ``dest`` refusing absolute paths, ``..``, links leaving ``dest``, devices; then
    extract with tarfile's ``data`` filter as a second guard. Returns the member names."""
    dest = Path(dest).absolute()
    try:
        tar = tarfile.open(archive)
    except (tarfile.TarError, OSError) as exc:
        raise ArchiveError(f"{archive.name} is not a readable tar archive ({exc}).",
                           "Download it again; if it keeps failing, the release is damaged.") from None
    with tar:
        members = tar.getmembers()
        problems = [p for p in (_member_problem(m, dest) for m in members) if p]
        if problems:
            raise ArchiveError(f"Refused to unpack {archive.name}: " + "; ".join(problems[:5]) +
                               (f" (+{len(problems) - 5} more)" if len(problems) > 5 else "") + ".",
                               "The archive is unsafe; it was not unpacked. Use the official release.")
        dest.mkdir(parents=True, exist_ok=True)
        if hasattr(tarfile, "data_filter"):
            try:
                tar.extractall(dest, members=members, filter="data")
            except tarfile.FilterError as exc:
                raise ArchiveError(f"Refused to unpack {archive.name}: {exc}.",
                                   "The archive is unsafe; use the official release.") from None
        else:  # pragma: no cover - Python without PEP 706 (our own checks above already ran)
            tar.extractall(dest, members=members)
    return [m.name for m in members]


def download_engine(settings: Settings, *, manifest: dict[str, Any] | os.PathLike | str | None = None,
                    control: DownloadControl | None = None, endpoint: str | None = None, token: str | None = None,
                    checkpoint_bytes: int = CHECKPOINT_BYTES, stall_timeout_s: float = STALL_TIMEOUT_S,
                    max_tries: int = MAX_TRIES_WITHOUT_PROGRESS, backoff_s: tuple[float, ...] = BACKOFF_S,
                    reserve_bytes: int = RESERVE_BYTES, progress_interval_s: float = 0.25) -> Iterator[Any]:
    """Download the pinned engine archive, verify its sha256 before unpacking (refused and removed on mismatch),
    unpack it safely into ``<cache_dir>/engine/<version>``, mark its executables. Yields events."""
    control = control or DownloadControl()
    t0 = time.monotonic()
    m = read_engine_manifest(manifest)
    version, url, size, sha = m["version"], m["url"], int(m["size"]), m["sha256"]
    dest = engine_release_dir(settings, version)
    if installed_engine(settings, m) is not None:
        yield Finished(dest, [dest], 0, time.monotonic() - t0, None, "engine")
        return dest
    root = settings.cache_path / "engine"
    downloads = root / ".downloads"
    asset = PurePosixPath(urlsplit(url).path).name or f"engine-{version}.tar.gz"
    where, free = free_bytes(root)
    needed = size * 4 + reserve_bytes        # the archive, and room for it unpacked
    yield DiskChecked(where, free, needed)
    if free < needed:
        raise DiskSpaceError(where, free, needed)

    endpoint = (endpoint or hub_endpoint()).rstrip("/")
    token = token if token is not None else hf_token(settings)

    def locate() -> tuple[str, dict[str, str]]:
        headers = {"User-Agent": "dsv41-panel"}
        if token and urlsplit(url).netloc == urlsplit(endpoint).netloc:
            headers["Authorization"] = f"Bearer {token}"
        return url, headers

    job = _Job(asset, size, sha, downloads / asset, downloads / STATE_DIR, locate, pin={"url": url},
               max_corrupt_retries=1)
    lock = FolderLock(downloads / STATE_DIR, downloads, _command_words()).acquire()
    try:
        return (yield from _install_engine_locked(settings, m, job, root, downloads, asset, dest, control=control,
                                                  token=token, checkpoint_bytes=checkpoint_bytes,
                                                  stall_timeout_s=stall_timeout_s, max_tries=max_tries,
                                                  backoff_s=backoff_s, progress_interval_s=progress_interval_s,
                                                  t0=t0))
    finally:
        lock.release()


def _install_engine_locked(settings: Settings, m: dict[str, Any], job: _Job, root: Path, downloads: Path,
                           asset: str, dest: Path, *, control: DownloadControl, token: str | None,
                           checkpoint_bytes: int, stall_timeout_s: float, max_tries: int,
                           backoff_s: tuple[float, ...], progress_interval_s: float, t0: float) -> Iterator[Any]:
    """The writing part of :func:`download_engine`, run while its folder lock is held."""
    version, url, size, sha = m["version"], m["url"], int(m["size"]), m["sha256"]
    if installed_engine(settings, m) is not None:     # another download installed it while this one waited
        yield Finished(dest, [dest], 0, time.monotonic() - t0, None, "engine")
        return dest
    try:
        fetched = yield from _run_jobs([job], [], control=control, n_workers=1, token=token,
                                       checkpoint_bytes=checkpoint_bytes, stall_timeout_s=stall_timeout_s,
                                       min_speed_bps=MIN_SPEED_BPS, max_tries=max_tries, backoff_s=backoff_s,
                                       progress_interval_s=progress_interval_s, target=downloads)
    except VerificationError as exc:
        job.part.unlink(missing_ok=True)
        job.ckpt.unlink(missing_ok=True)
        raise ArchiveError(f"Refused the engine archive {asset}: {exc.message}",
                           "It was removed and nothing was unpacked. Check the manifest's sha256 and URL; if they "
                           "are right, the server serves a different file than the release.") from None
    if control.cancelled:
        yield Stopped(job.done, size, downloads, "cancelled")
        return None
    # The archive verified (sha256 == manifest) before this point; unpack into a temp folder, then rename.
    tmp = root / f".unpack-{version}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        safe_extract(job.dest, tmp)
        entries = [p for p in tmp.iterdir()]
        rel_root = entries[0] if len(entries) == 1 and entries[0].is_dir() else tmp
        for rel in m.get("executables", []):
            p = _inside(rel_root, rel)
            if not p.is_file():
                raise ArchiveError(f"The engine archive has no {rel}, which the manifest names as its executable.",
                                   "The release does not match the manifest; check both.")
            p.chmod(p.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH | stat.S_IRUSR)
        atomic_write_json(rel_root / RELEASE_MARKER, {"version": version, "url": url, "sha256": sha, "size": size,
                                                      "installed_at": time.time()}, mode=0o644)
        if dest.exists():
            old = dest.with_name(f".old-{version}-{os.getpid()}")
            os.replace(dest, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(rel_root, dest)
    except BaseException:
        job.dest.unlink(missing_ok=True)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    job.dest.unlink(missing_ok=True)
    _forget_verified(job.dest)
    yield Finished(dest, [dest], fetched or 0, time.monotonic() - t0, None, "engine")
    return dest
