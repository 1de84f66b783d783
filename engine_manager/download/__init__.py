"""The model's seven GGUF shards and the engine release: resumable, verified downloads.

Every long operation here is a generator of typed events (``Resolved``, ``DiskChecked``, ``Checking``,
``Progress``, ``Retrying``, ``FileVerified``, ``FileCorrupt``, ``Notice``, ``Paused``/``Resumed``, and finally
``Finished`` or ``Stopped``); errors are :class:`DownloadError` subclasses whose ``fix`` says what to do. The CLI
prints the events, the GUI turns them into signals, the tests assert on them. Pause/resume/cancel go through a
:class:`engine_manager.cancel.CancelToken`; closing the generator (Ctrl+C, the GUI's worker quitting) is a cancel too.

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

The package's seams: :mod:`.events` (constants, errors, events), :mod:`.http` (the ranged GET, the hub's endpoint,
token and errors), :mod:`.store` (the folder lock, folders, manifests, verification records, checkpoint state),
:mod:`.fetch` (resumable jobs on worker threads), :mod:`.model` (the model's shards), :mod:`.release` (the
pinned engine archive, safe unpacking) and :mod:`.release_source` (a release the user names: a folder, or a URL
whose sha256 is pinned or confirmed by the user). sha256 lives in :mod:`engine_manager.hashing`, split metadata
in :mod:`engine_manager.gguf_split`.
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
