"""The model's GGUF shards and the engine release: resumable, verified downloads.

Every long operation is a generator of typed events (:mod:`.events`: ``Resolved``, ``Progress``, ``FileVerified``…,
finally ``Finished`` or ``Stopped``); errors are :class:`DownloadError` subclasses whose ``fix`` says what to do.
Pause/resume/cancel go through a :class:`engine_manager.cancel.CancelToken`; closing the generator is a cancel too.

Metadata, URLs and auth are ``huggingface_hub``'s; the bytes are read with ``http.client`` into a ranged partial
file (``.dsv41-download/<name>.part``) checkpointed every ``checkpoint_bytes``, so a killed run resumes where it
stopped, with sha256 computed on a side thread as bytes arrive and a file renamed into place only once it matched.
The first resolve pins the commit the hub answered (a moving repository never mixes shards; ``repin`` resolves
again); a complete, verified folder needs no network. Why this split, with the measurements behind it:
benchmarks/results/download.md.
Seams: :mod:`.events`, :mod:`.http` (ranged GET, hub endpoint, token), :mod:`.store` (lock, manifests,
verification records, state), :mod:`.fetch` (resumable jobs), :mod:`.model` (the shards), :mod:`.release` (the
pinned engine archive) and :mod:`.release_source` (a release the user names).
"""

from __future__ import annotations

from ..cancel import Cancelled, CancelToken
from ..gguf_split import split_problems
from ..hashing import sha256_file
from .events import (
    BACKOFF_S,
    CHECKPOINT_BYTES,
    DEFAULT_JOBS,
    HTTP_SIZE_LIMIT,
    MAX_TRIES_WITHOUT_PROGRESS,
    MIN_SPEED_BPS,
    RESERVE_BYTES,
    STALL_TIMEOUT_S,
    STATE_DIR,
    ArchiveError,
    Checking,
    DiskChecked,
    DiskFullError,
    DiskSpaceError,
    DownloadError,
    FileCorrupt,
    FileProgress,
    FileVerified,
    Finished,
    FolderBusy,
    HubError,
    Notice,
    Paused,
    PinnedCommitGone,
    Progress,
    RemoteFile,
    Resolved,
    Resumed,
    Retrying,
    Stopped,
    VerificationError,
)
from .http import hf_token, hub_endpoint
from .model import (
    LocalStatus,
    check_existing,
    complete_offline,
    download_model,
    local_status,
    model_present,
    resolve_model,
    verify_model_dir,
)
from .release import (
    RELEASE_MARKER,
    download_engine,
    installed_engine,
    read_engine_manifest,
    safe_extract,
    safe_extract_zip,
    safe_unpack,
)
from .release_source import (
    VERIFIED_CONFIRMED,
    VERIFIED_PINNED,
    ArchiveFetched,
    InstalledRelease,
    PendingArchive,
    discard_archive,
    fetch_release,
    install_release,
    pending_archive,
    release_record,
    sha256_text,
)
from .store import (
    FolderLock,
    default_model_dir,
    engine_release_dir,
    free_bytes,
    known_verified,
    load_manifest,
    model_dir,
    shard_names,
)

__all__ = [
    "BACKOFF_S", "CHECKPOINT_BYTES", "DEFAULT_JOBS", "HTTP_SIZE_LIMIT", "MAX_TRIES_WITHOUT_PROGRESS",
    "MIN_SPEED_BPS", "RESERVE_BYTES", "STALL_TIMEOUT_S", "STATE_DIR", "RELEASE_MARKER",
    "ArchiveError", "Checking", "DiskChecked", "DiskFullError", "DiskSpaceError", "DownloadError", "FileCorrupt",
    "FileProgress", "FileVerified", "Finished", "FolderBusy", "HubError", "Notice", "Paused", "PinnedCommitGone",
    "Progress", "RemoteFile", "Resolved", "Resumed", "Retrying", "Stopped", "VerificationError", "LocalStatus",
    "Cancelled", "CancelToken", "FolderLock",
    "hf_token", "hub_endpoint", "check_existing", "complete_offline", "download_model",
    "local_status", "model_present", "resolve_model", "verify_model_dir", "download_engine", "installed_engine",
    "read_engine_manifest", "safe_extract", "default_model_dir", "engine_release_dir", "free_bytes",
    "known_verified", "load_manifest", "model_dir", "shard_names", "sha256_file", "split_problems",
    "safe_extract_zip", "safe_unpack", "VERIFIED_CONFIRMED", "VERIFIED_PINNED", "ArchiveFetched",
    "InstalledRelease", "PendingArchive", "discard_archive", "fetch_release", "install_release",
    "pending_archive", "release_record", "sha256_text",
]
