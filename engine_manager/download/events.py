"""Download constants, errors (each with the fix) and the typed events every download yields."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Generator

from .. import fmt
from ..errors import UserError
from ..eventbase import Event
from ..fmt import MIB


STATE_DIR = ".dsv41-download"
DEFAULT_JOBS = 4
BUF_BYTES = 4 * MIB                 # one receive buffer
CHECKPOINT_BYTES = 64 * MIB         # resumable state every this many bytes: what a kill can cost
SYNC_BYTES = 1024 * MIB             # fdatasync (on a side thread) every this many: what a reboot can cost
STALL_TIMEOUT_S = 30.0              # no byte for this long: the connection is dropped and retried
MIN_SPEED_BPS = 1024                # below this over STALL_TIMEOUT_S counts as a stall too
RESERVE_BYTES = 512 * MIB           # free disk kept beyond the download itself
MAX_TRIES_WITHOUT_PROGRESS = 8
MAX_CORRUPT_RETRIES = 2
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 60.0)
HTTP_SIZE_LIMIT = 50 * 1000**3      # huggingface_hub's http_get refuses single files above this (wants hf_xet)

# a download as the caller drives it: the events it yields, then the folder it filled (None when stopped)
DownloadRun = Generator[Any, None, "Path | None"]


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
            f"Not enough free disk at {path}: the download needs {fmt.bytes_si(needed_bytes)} "
            f"(including {fmt.bytes_si(RESERVE_BYTES)} headroom), {fmt.bytes_si(free_bytes)} is free — "
            f"{fmt.bytes_si(self.missing_bytes)} missing. Nothing was written.",
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


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Resolved(Event):
    kind: ClassVar[str] = "resolved"
    repo: str
    revision: str                    # what was asked for (a branch, tag or commit)
    commit: str                      # the commit sha every request uses
    pinned: bool                     # True: the commit came from an earlier resolve of this folder
    files: list[RemoteFile]
    total_bytes: int
    target_dir: Path


@dataclass(frozen=True)
class DiskChecked(Event):
    kind: ClassVar[str] = "disk_checked"
    path: Path
    free_bytes: int
    needed_bytes: int


@dataclass(frozen=True)
class Checking(Event):
    kind: ClassVar[str] = "checking"
    """Hashing files already on disk."""
    name: str
    done_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class FileProgress(Event):
    kind: ClassVar[str] = "file_progress"
    name: str
    size_bytes: int
    done_bytes: int
    speed_bps: float | None
    eta_s: float | None
    state: str                       # queued, downloading, paused, retrying, verifying, verified, present, failed


@dataclass(frozen=True)
class Progress(Event):
    kind: ClassVar[str] = "progress"
    files: list[FileProgress]
    done_bytes: int
    total_bytes: int
    speed_bps: float | None
    eta_s: float | None
    elapsed_s: float

    @property
    def fraction(self) -> float:
        return self.done_bytes / self.total_bytes if self.total_bytes else 1.0


@dataclass(frozen=True)
class Retrying(Event):
    kind: ClassVar[str] = "retrying"
    name: str
    attempt: int
    delay_s: float
    reason: str


@dataclass(frozen=True)
class FileVerified(Event):
    kind: ClassVar[str] = "file_verified"
    name: str
    path: Path
    sha256: str
    downloaded: bool                 # False: it was already there


@dataclass(frozen=True)
class FileCorrupt(Event):
    kind: ClassVar[str] = "file_corrupt"
    name: str
    expected: str
    actual: str
    action: str


@dataclass(frozen=True)
class Notice(Event):
    kind: ClassVar[str] = "notice"
    text: str


@dataclass(frozen=True)
class Paused(Event):
    kind: ClassVar[str] = "paused"


@dataclass(frozen=True)
class Resumed(Event):
    kind: ClassVar[str] = "resumed"


@dataclass(frozen=True)
class Finished(Event):
    kind: ClassVar[str] = "finished"
    target_dir: Path
    files: list[Path]
    fetched_bytes: int
    elapsed_s: float
    commit: str | None = None
    what: str = "model"


@dataclass(frozen=True)
class Stopped(Event):
    kind: ClassVar[str] = "stopped"
    """Cancelled or interrupted: partial files and their state are kept; running again resumes."""
    kept_bytes: int
    total_bytes: int
    target_dir: Path
    reason: str = "cancelled"


