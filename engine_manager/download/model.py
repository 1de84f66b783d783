"""The model: resolve its shards at a pinned commit, check what is on disk, download what is missing."""

from __future__ import annotations

import functools
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generator
from urllib.parse import urlsplit

from .. import fmt
from ..atomic import atomic_write_json, ensure_private_dir
from ..cancel import Cancelled, CancelToken
from ..gguf_split import split_problems
from ..hashing import sha256_file
from ..settings import Settings
from .events import (
    DownloadRun,
    BACKOFF_S,
    CHECKPOINT_BYTES,
    DEFAULT_JOBS,
    HTTP_SIZE_LIMIT,
    MAX_TRIES_WITHOUT_PROGRESS,
    MIN_SPEED_BPS,
    RESERVE_BYTES,
    STALL_TIMEOUT_S,
    STATE_DIR,
    Checking,
    DiskChecked,
    DiskFullError,
    DiskSpaceError,
    DownloadError,
    FileCorrupt,
    FileProgress,
    FileVerified,
    Finished,
    HubError,
    Notice,
    PinnedCommitGone,
    RemoteFile,
    Resolved,
    Stopped,
    VerificationError,
)
from .fetch import _Job, _run_jobs
from .http import (
    _hub_error,
    hf_token,
    hub_endpoint,
)
from .store import (
    FolderLock,
    _command_words,
    _default_target,
    _disk_full,
    _forget_verified,
    _load_records,
    _load_state,
    _record_verified,
    _state_path,
    default_model_dir,
    free_bytes,
    known_verified,
    shard_names,
)


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
        size = lfs.size if lfs.size is not None else s.size
        if size is None:
            raise HubError(f"{n} has no size on the hub, so it cannot be verified.",
                           "The panel only downloads files it can verify; report this repository.")
        files.append(RemoteFile(n, int(size), str(lfs.sha256)))
    return Resolved(repo, requested, commit, pinned, files, sum(f.size for f in files), target)


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


def check_existing(files: list[RemoteFile], folder: Path, *, verify: str = "quick",
                   control: CancelToken | None = None, jobs: int = DEFAULT_JOBS
                   ) -> Generator[Any, None, dict[str, bool | None]]:
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
    control = control or CancelToken()
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
                digest = sha256_file(p, progress=functools.partial(done.__setitem__, f.name), cancel=control)
            except Cancelled:
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
        raise Cancelled()
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
                   control: CancelToken | None = None, endpoint: str | None = None, token: str | None = None,
                   verify: str = "quick", repin: bool = False, checkpoint_bytes: int = CHECKPOINT_BYTES,
                   stall_timeout_s: float = STALL_TIMEOUT_S, min_speed_bps: float = MIN_SPEED_BPS,
                   max_tries: int = MAX_TRIES_WITHOUT_PROGRESS, backoff_s: tuple[float, ...] = BACKOFF_S,
                   reserve_bytes: int = RESERVE_BYTES, progress_interval_s: float = 0.25) -> DownloadRun:
    """Make the model folder hold the seven verified shards; yield events (see the module docstring).

    The folder is ``target_dir``, else ``settings.model_dir`` (a complete verified set there means nothing is
    downloaded; an incomplete one is completed in place), else ``<cache_dir>/models/<owner>--<name>``. A complete
    verified set finishes without asking the hub (so it works offline) unless ``verify="full"`` or ``repin``.
    ``repin`` resolves the requested revision again instead of the folder's pinned commit.
    Raises :class:`DownloadError` (its subclasses say what went wrong) with the fix."""
    control = control or CancelToken()
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
            yield Notice(f"{f.name} is {fmt.bytes_si(f.size)}, over huggingface_hub's 50 GB plain-HTTP limit; it is "
                         "fetched with ranged requests, which have no such limit.")

    try:
        existing = yield from check_existing(res.files, target, verify=verify, control=control, jobs=jobs)
    except Cancelled:
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
                     pending: list[RemoteFile], *, control: CancelToken, jobs: int, token: str | None,
                     endpoint: str, checkpoint_bytes: int, stall_timeout_s: float, min_speed_bps: float,
                     max_tries: int, backoff_s: tuple[float, ...], progress_interval_s: float,
                     t0: float) -> DownloadRun:
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
                     control: CancelToken | None = None, jobs: int = DEFAULT_JOBS,
                     verify: str = "quick") -> Generator[Any, None, list[str]]:
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
    except Cancelled:
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
