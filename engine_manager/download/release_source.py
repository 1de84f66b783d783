"""An engine release the user names: a folder they already have, or an archive at a URL they give.

Both end the same way: the folder is checked as ``dsv41 doctor`` checks one
(:func:`engine_manager.release_check.check_release`), and only a folder with no failed check becomes the
``engine_dir`` setting (the caller saves it). A URL is fetched in two steps, so nothing unverified is unpacked or run:

1. :func:`fetch_release` downloads the archive into ``<cache_dir>/engine/.downloads/``, hashing it as it arrives. A
   sha256 given beforehand (the release page's, or ``--sha256``) refuses and deletes a mismatch; without one the
   archive is kept *pending* beside a record (URL, sha256, size) and its sha256 shown for the user to compare.
2. :func:`install_release` takes the confirmed sha256, hashes the archive again (still the file shown), unpacks it
   safely (:func:`.release.safe_unpack`: no absolute paths, no ``..``, no links out, capped sizes) into
   ``<cache_dir>/engine/<asset name>``, records how it was verified in ``.dsv41-release.json``, and checks it.

Never imports Qt.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import shutil
import socket
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar
from urllib.parse import unquote, urlsplit

from ..atomic import atomic_write_json, ensure_private_dir, read_json_capped
from ..cancel import CancelToken
from ..eventbase import Event
from ..hashing import sha256_file
from ..release_check import ReleaseCheck, check_release
from ..settings import Settings
from .events import (
    RESERVE_BYTES,
    STALL_TIMEOUT_S,
    STATE_DIR,
    ArchiveError,
    DiskChecked,
    DiskFullError,
    DiskSpaceError,
    DownloadRun,
    FileProgress,
    Progress,
    Stopped,
)
from .http import _abort_connection, _HTTPStatus, _ranged_get
from .release import RELEASE_MARKER, safe_unpack
from .store import FolderLock, _command_words, _disk_full, free_bytes

MAX_ARCHIVE_BYTES = 32 * 1024**3           # a release archive larger than this is refused before it is fetched
READ_BYTES = 1024 * 1024
RECORD_MAX_BYTES = 16 * 1024
PENDING_SUFFIX = ".pending.json"
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar.xz", ".txz", ".tar.bz2", ".tbz2", ".tar", ".zip")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")

#: how an installed release's archive was verified (written into its .dsv41-release.json)
VERIFIED_PINNED = "pinned"          # the sha256 was given before the download and matched
VERIFIED_CONFIRMED = "confirmed"    # the user compared the sha256 of what arrived with the release page


@dataclass(frozen=True)
class ArchiveFetched(Event):
    """The archive arrived whole. ``pinned``: it matched the sha256 given before the download; otherwise it waits
    for the user to confirm ``sha256`` against the release page (:func:`install_release`)."""
    kind: ClassVar[str] = "archive_fetched"
    path: Path
    url: str
    sha256: str
    size: int
    pinned: bool


@dataclass(frozen=True)
class InstalledRelease:
    """A release unpacked from a confirmed archive, and how its folder checked out."""
    folder: Path
    checks: list[ReleaseCheck] = field(default_factory=list)

    @property
    def usable(self) -> bool:
        return not any(c.status == "fail" for c in self.checks)


@dataclass(frozen=True)
class PendingArchive:
    """A downloaded archive waiting for the user's confirmation of its sha256."""
    path: Path
    url: str
    sha256: str
    size: int


# ------------------------------------------------------------------------------------------------ words
def sha256_text(text: str | None) -> str | None:
    """The 64-hex sha256 in what a user pasted — ``ABCD…``, ``sha256:abcd…`` (GitHub's release page),
    ``abcd…  file.tar.gz`` (``sha256sum``'s line) — lower-cased; None when there is none."""
    if not text:
        return None
    t = text.strip().lower()
    for prefix in ("sha256:", "sha256="):
        if t.startswith(prefix):
            t = t[len(prefix):].strip()
    t = t.split()[0] if t.split() else ""
    return t if _HEX64.match(t) else None


def check_url(url: str) -> str:
    """An http(s) URL with a host, else :class:`ArchiveError` in plain words."""
    u = urlsplit((url or "").strip())
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ArchiveError(f"{url!r} is not an http(s) address.",
                           "Give the address of the release's archive (its asset), e.g. "
                           "https://github.com/OWNER/REPO/releases/download/v0.1.0/ASSET.tar.gz.")
    return u.geturl()


def asset_name(url: str) -> str:
    """The archive's file name from the URL's last path part (only letters, digits and ``._+-``)."""
    name = unquote(PurePosixPath(urlsplit(url).path).name)
    name = re.sub(r"[^A-Za-z0-9._+-]", "_", name).lstrip(".")[:120]
    return name or "engine-release.tar.gz"


def release_folder_name(asset: str) -> str:
    """``strata-v0.1.0-cuda13-sm120.tar.gz`` → ``strata-v0.1.0-cuda13-sm120``."""
    low = asset.lower()
    for suf in ARCHIVE_SUFFIXES:
        if low.endswith(suf):
            asset = asset[:-len(suf)]
            break
    return re.sub(r"[^A-Za-z0-9._+-]", "_", asset).lstrip(".") or "release"


def _downloads(settings: Settings) -> Path:
    return settings.cache_path / "engine" / ".downloads"


def _record_path(archive: Path) -> Path:
    return archive.with_name(archive.name + PENDING_SUFFIX)


# ------------------------------------------------------------------------------------------------ fetching
def fetch_release(settings: Settings, url: str, *, sha256: str | None = None, control: CancelToken | None = None,
                  stall_timeout_s: float = STALL_TIMEOUT_S, progress_interval_s: float = 0.25,
                  max_bytes: int = MAX_ARCHIVE_BYTES, reserve_bytes: int = RESERVE_BYTES) -> DownloadRun:
    """Download the archive at ``url`` into ``<cache_dir>/engine/.downloads/``, hashing it as it arrives. With
    ``sha256`` a mismatch refuses the file and deletes it (:class:`ArchiveError`). Yields ``DiskChecked``,
    ``Progress``, then :class:`ArchiveFetched` (or ``Stopped`` when cancelled: the partial file is deleted).
    Returns the archive's path (None when stopped). Nothing is unpacked here."""
    control = control or CancelToken()
    url = check_url(url)
    want = None
    if sha256:
        want = sha256_text(sha256)
        if want is None:
            raise ArchiveError(f"{sha256!r} is not a sha256 (64 hexadecimal digits).",
                               "Copy the sha256 the release page shows for the asset.")
    downloads = _downloads(settings)
    ensure_private_dir(downloads)
    lock = FolderLock(downloads / STATE_DIR, downloads, _command_words()).acquire()
    try:
        return (yield from _fetch_locked(url, want, downloads, control, stall_timeout_s, progress_interval_s,
                                         max_bytes, reserve_bytes))
    finally:
        lock.release()


def _fetch_locked(url: str, want: str | None, downloads: Path, control: CancelToken, stall_timeout_s: float,
                  progress_interval_s: float, max_bytes: int, reserve_bytes: int) -> DownloadRun:
    asset = asset_name(url)
    final = downloads / asset
    part = downloads / f"{asset}.part"
    host = urlsplit(url).hostname
    t0 = time.monotonic()
    conns: list[Any] = []

    def abort() -> None:
        for c in conns:
            _abort_connection(c)

    remove_hook = control.on_cancel(abort)
    done = 0
    resp = None
    try:
        try:
            _conn, resp, _ = _ranged_get(url, {"User-Agent": "dsv41-panel"}, 0, stall_timeout_s,
                                         on_connection=conns.append)
        except _HTTPStatus as exc:
            raise ArchiveError(f"{host} answered HTTP {exc.status} {exc.reason} for {url}.".replace("  ", " "),
                               "Check the URL on the release page (copy the asset's link, not the page's)."
                               ) from None
        except OSError as exc:
            if control.cancelled:
                yield Stopped(0, 0, downloads, control.reason)
                return None
            raise ArchiveError(f"Could not reach {host} ({type(exc).__name__}: {exc}).",
                               "Check the network connection and the proxy settings, then try again.") from None
        length_h = resp.getheader("Content-Length")
        length = int(length_h) if length_h and length_h.isdigit() else None
        if length is not None and length > max_bytes:
            raise ArchiveError(f"{asset} is {length / 1e9:.1f} GB, more than the {max_bytes / 1e9:.0f} GB an engine "
                               "release may be; nothing was downloaded.",
                               "Check the URL: it should name the engine release's archive.")
        where, free = free_bytes(downloads)
        needed = (length or 0) * 3 + reserve_bytes       # the archive, and room for it unpacked
        yield DiskChecked(where, free, needed)
        if free < needed:
            raise DiskSpaceError(where, free, needed)
        h = hashlib.sha256()
        last = 0.0
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            while not control.cancelled:
                try:
                    chunk = resp.read1(READ_BYTES)
                except (socket.timeout, TimeoutError):
                    raise ArchiveError(f"{host} sent nothing for {stall_timeout_s:.0f} s (at byte {done:,}); the "
                                       "partial file was deleted.", "Try again later.") from None
                except OSError as exc:
                    if control.cancelled:
                        break
                    raise ArchiveError(f"The connection to {host} failed at byte {done:,} ({exc}); the partial "
                                       "file was deleted.", "Try again.") from None
                if not chunk:
                    break
                done += len(chunk)
                if done > max_bytes:
                    raise ArchiveError(f"{asset} grew past {max_bytes / 1e9:.0f} GB, more than an engine release may "
                                       "be; it was deleted.", "Check the URL.")
                h.update(chunk)
                try:
                    f.write(chunk)
                except OSError as exc:
                    if _disk_full(exc):
                        raise DiskFullError(where, (length or done) - done) from None
                    raise
                now = time.monotonic()
                if now - last >= progress_interval_s:
                    last = now
                    yield _progress(asset, done, length, now - t0)
        if control.cancelled:
            part.unlink(missing_ok=True)
            yield Stopped(0, length or done, downloads, control.reason)
            return None
        if length is not None and done != length:
            raise ArchiveError(f"The connection to {host} closed at byte {done:,} of {length:,}; the partial file "
                               "was deleted.", "Try again.")
        yield _progress(asset, done, length or done, time.monotonic() - t0, state="verifying")
        digest = h.hexdigest()
        if want is not None and digest != want:
            raise ArchiveError(f"Refused {asset}: its sha256 is {digest}, not the {want} it should have. It was "
                               "deleted and nothing was unpacked.",
                               "Check the sha256 and the URL on the release page; if both are right, the server "
                               "sent a different file than the release.")
        os.replace(part, final)
        atomic_write_json(_record_path(final), {"url": url, "sha256": digest, "size": done, "pinned": want is not None,
                                                "fetched_at": time.time()})
        yield ArchiveFetched(final, url, digest, done, want is not None)
        return final
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    finally:
        remove_hook()
        for c in conns:
            try:
                c.close()
            except OSError:
                pass


def _progress(asset: str, done: int, length: int | None, elapsed: float, state: str = "downloading") -> Progress:
    total = length or done
    speed = done / elapsed if elapsed > 0 else None
    eta = (total - done) / speed if speed and length else None
    return Progress([FileProgress(asset, total, done, speed, eta, state)], done, total, speed, eta, elapsed)


def pending_archive(settings: Settings, url: str) -> PendingArchive | None:
    """The archive an earlier :func:`fetch_release` of ``url`` left waiting for confirmation (its record read,
    capped and checked, its size unchanged), or None."""
    try:
        archive = _downloads(settings) / asset_name(check_url(url))
        rec = read_json_capped(_record_path(archive), RECORD_MAX_BYTES)
        st = os.stat(archive, follow_symlinks=False)
    except (ArchiveError, OSError, ValueError):
        return None
    if not isinstance(rec, dict) or rec.get("url") != url or not stat.S_ISREG(st.st_mode):
        return None
    sha, size = rec.get("sha256"), rec.get("size")
    if not isinstance(sha, str) or not _HEX64.match(sha) or size != st.st_size:
        return None
    return PendingArchive(archive, url, sha, st.st_size)


def discard_archive(archive: os.PathLike | str) -> None:
    """Delete a downloaded archive and its pending record (the user did not confirm it)."""
    archive = Path(archive)
    archive.unlink(missing_ok=True)
    _record_path(archive).unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------------ installing
def _free_folder(base: Path) -> Path:
    """``base``, or ``base-2``, ``base-3`` … when it exists (an earlier release, perhaps set up by hand, is never
    replaced)."""
    if not base.exists() and not base.is_symlink():
        return base
    for i in range(2, 1000):
        p = base.with_name(f"{base.name}-{i}")
        if not p.exists() and not p.is_symlink():
            return p
    raise ArchiveError(f"{base.parent} holds too many copies of {base.name}.", "Delete the ones you do not use.")


def install_release(settings: Settings, archive: os.PathLike | str, *, sha256: str, how: str, url: str = "",
                    compute_capability: str | None = None, driver_cuda: str | None = None,
                    run_python: bool = True, control: CancelToken | None = None) -> InstalledRelease:
    """Unpack a fetched archive whose ``sha256`` was pinned before the download or confirmed by the user (``how``:
    :data:`VERIFIED_PINNED` or :data:`VERIFIED_CONFIRMED`), then check the folder. The archive is hashed again
    first: a file that changed since its sha256 was shown is refused and deleted. The folder is
    ``<cache_dir>/engine/<asset name>`` (a new name when that exists: nothing the user had is replaced); its
    ``.dsv41-release.json`` records the URL, the sha256 and how it was verified. The archive is deleted afterwards."""
    archive = Path(archive)
    want = sha256_text(sha256)
    if want is None:
        raise ArchiveError(f"{sha256!r} is not a sha256 (64 hexadecimal digits).",
                           "Confirm with the sha256 the release page shows for the asset.")
    if how not in (VERIFIED_PINNED, VERIFIED_CONFIRMED):
        raise ValueError(f"how must be {VERIFIED_PINNED!r} or {VERIFIED_CONFIRMED!r}")
    try:
        digest = sha256_file(archive, cancel=control)
    except FileNotFoundError:
        raise ArchiveError(f"{archive} is gone (deleted since it was downloaded).",
                           "Download the release again.") from None
    if digest != want:
        discard_archive(archive)
        raise ArchiveError(f"Refused {archive.name}: its sha256 is {digest}, not the confirmed {want}. It was "
                           "deleted and nothing was unpacked.",
                           "Download it again and compare the sha256 with the release page once more; if they "
                           "differ, do not use that file.")
    root = settings.cache_path / "engine"
    tmp = root / f".unpack-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        safe_unpack(archive, tmp)
        entries = list(tmp.iterdir())
        rel_root = entries[0] if len(entries) == 1 and entries[0].is_dir() and not entries[0].is_symlink() else tmp
        for rel in ("engine/strata", "engine/strata-vision"):     # a zip made elsewhere may not carry the bit
            p = rel_root / rel
            if p.is_file() and not p.is_symlink():
                p.chmod(p.stat().st_mode | stat.S_IXUSR | stat.S_IRUSR)
        atomic_write_json(rel_root / RELEASE_MARKER, {
            "source": "url", "url": url, "asset": archive.name, "sha256": digest, "size": archive.stat().st_size,
            "verified": how, "verified_words": ("the sha256 given before the download matched" if
                                                how == VERIFIED_PINNED else
                                                "the user compared the sha256 with the release page"),
            "verified_at": time.time()}, mode=0o644)
        dest = _free_folder(root / release_folder_name(archive.name))
        os.replace(rel_root, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    discard_archive(archive)
    checks = check_release(dest, compute_capability=compute_capability, driver_cuda=driver_cuda,
                           run_python=run_python)
    return InstalledRelease(dest, checks)


def release_record(folder: os.PathLike | str) -> dict[str, Any] | None:
    """The ``.dsv41-release.json`` of a release this module installed (how it was verified), or None."""
    try:
        rec = read_json_capped(Path(folder) / RELEASE_MARKER, RECORD_MAX_BYTES)
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def describe_checks(checks: list[ReleaseCheck]) -> str:
    """Plain text, one check a line, each failure followed by its fix (the CLI prints it)."""
    mark = {"pass": "PASS", "warn": "WARN", "fail": "FAIL", "info": "INFO"}
    lines = []
    for c in checks:
        lines.append(f"  {mark.get(c.status, c.status.upper())}  {c.title}: {c.figure}")
        if c.fix and c.status in ("fail", "warn"):
            lines.append(f"        what to do: {c.fix}")
    return "\n".join(lines)
