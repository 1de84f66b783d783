"""The engine release: a pinned archive, verified before it is unpacked safely."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import tarfile
import time
import zipfile
import zlib
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

from ..atomic import atomic_write_json
from ..cancel import CancelToken
from ..engines._http import bearer_headers
from ..settings import Settings
from .events import (
    DownloadRun,
    BACKOFF_S,
    CHECKPOINT_BYTES,
    MAX_TRIES_WITHOUT_PROGRESS,
    MIN_SPEED_BPS,
    RESERVE_BYTES,
    STALL_TIMEOUT_S,
    STATE_DIR,
    ArchiveError,
    DiskChecked,
    DiskSpaceError,
    Finished,
    Stopped,
    VerificationError,
)
from .fetch import _Job, _run_jobs
from .http import (
    hf_token,
    hub_endpoint,
)
from .store import (
    FolderLock,
    _command_words,
    _forget_verified,
    engine_release_dir,
    free_bytes,
    load_manifest,
)


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
            "Use a release folder you already have (`dsv41 download engine --from DIR`, or the Downloads tab's "
            "\"Use an engine release I already have…\"), or download the release by its URL (`dsv41 download "
            "engine --url URL [--sha256 HEX]`, or \"Download from a URL\" there): without a published sha256 you "
            "compare the one shown with the release page before it is unpacked. (A release whose URL, size and "
            "sha256 are known can be pinned in resources/manifests/engine.json.)")
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


#: caps on what an archive may unpack to (a Strata release is ~100 MB without its .venv, a few GB with one)
MAX_UNPACKED_BYTES = 64 * 1024**3
MAX_MEMBERS = 200_000


def _name_problem(name: str) -> str | None:
    """Why an archive member's name may not be unpacked (absolute, a drive, ``..``), or None."""
    pp = PurePosixPath(name.replace("\\", "/"))
    if not name or "\0" in name:
        return f"{name!r} has an empty or invalid name"
    if name.startswith(("/", "\\")) or pp.is_absolute() or re.match(r"^[A-Za-z]:", name):
        return f"{name!r} is an absolute path"
    if ".." in pp.parts:
        return f"{name!r} climbs out with '..'"
    return None


def _refuse(archive: Path, problems: list[str]) -> ArchiveError:
    return ArchiveError(f"Refused to unpack {archive.name}: " + "; ".join(problems[:5]) +
                        (f" (+{len(problems) - 5} more)" if len(problems) > 5 else "") + ".",
                        "The archive is unsafe; it was not unpacked. Use the official release.")


def _size_problems(archive: Path, total: int, count: int, max_bytes: int, max_members: int) -> list[str]:
    out = []
    if count > max_members:
        out.append(f"it holds {count:,} entries, more than the {max_members:,} a release may have")
    if total > max_bytes:
        out.append(f"it would unpack to {total / 1e9:.1f} GB, more than the {max_bytes / 1e9:.1f} GB a release may "
                   "take")
    return out


def safe_extract(archive: Path, dest: Path, *, max_bytes: int = MAX_UNPACKED_BYTES,
                 max_members: int = MAX_MEMBERS) -> list[str]:
    """Unpack a tar archive into ``dest`` refusing absolute paths, ``..``, links leaving ``dest``, devices, and
    more than ``max_members`` entries or ``max_bytes`` unpacked; then extract with tarfile's ``data`` filter as a
    second guard. Returns the member names."""
    dest = Path(dest).absolute()
    try:
        tar = tarfile.open(archive)
    except (tarfile.TarError, OSError) as exc:
        raise ArchiveError(f"{archive.name} is not a readable tar archive ({exc}).",
                           "Download it again; if it keeps failing, the release is damaged.") from None
    with tar:
        members = []
        for m in tar:               # read lazily, so a huge member list is refused before it is all in memory
            members.append(m)
            if len(members) > max_members:
                break
        problems = _size_problems(archive, sum(m.size for m in members if m.isfile()), len(members), max_bytes,
                                  max_members)
        problems += [p for p in (_member_problem(m, dest) for m in members) if p]
        if problems:
            raise _refuse(archive, problems)
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


def safe_extract_zip(archive: Path, dest: Path, *, max_bytes: int = MAX_UNPACKED_BYTES,
                     max_members: int = MAX_MEMBERS) -> list[str]:
    """Unpack a zip archive into ``dest``: every name is checked first (absolute paths, ``..``), links and
    anything but files and folders are refused (a release needs none; zipfile would write a link as a file
    holding its target), the declared sizes are capped (zipfile stops each member at its declared size and checks
    its CRC). The files' permission bits are kept (owner read/write, no setuid; Strata's prebuilt zip has its
    ``strata`` executable). Returns the member names."""
    dest = Path(dest).absolute()
    try:
        zf = zipfile.ZipFile(archive)
    except (zipfile.BadZipFile, OSError) as exc:
        raise ArchiveError(f"{archive.name} is not a readable zip archive ({exc}).",
                           "Download it again; if it keeps failing, the release is damaged.") from None
    with zf:
        infos = zf.infolist()
        problems = _size_problems(archive, sum(i.file_size for i in infos), len(infos), max_bytes, max_members)
        for i in infos:
            why = _name_problem(i.filename)
            kind = stat.S_IFMT(i.external_attr >> 16)
            if why is None and kind == stat.S_IFLNK:
                why = f"{i.filename!r} is a symbolic link"
            elif why is None and kind not in (0, stat.S_IFREG, stat.S_IFDIR):
                why = f"{i.filename!r} is not a regular file or folder"
            if why:
                problems.append(why)
        if problems:
            raise _refuse(archive, problems)
        dest.mkdir(parents=True, exist_ok=True)
        try:
            for i in infos:
                out = Path(zf.extract(i, dest))
                if not out.resolve().is_relative_to(dest.resolve()):     # zipfile sanitises; checked again
                    raise _refuse(archive, [f"{i.filename!r} landed outside the release folder"])
                mode = (i.external_attr >> 16) & 0o755
                if mode and not i.is_dir():
                    out.chmod(mode | stat.S_IRUSR | stat.S_IWUSR)
        except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
            raise ArchiveError(f"{archive.name} is damaged ({exc}); what it held was not used.",
                               "Download it again; if it keeps failing, the release is damaged.") from None
    return [i.filename for i in infos]


def safe_unpack(archive: Path, dest: Path, **caps: int) -> list[str]:
    """A zip or tar archive (by its content, not its name) unpacked safely into ``dest``."""
    archive = Path(archive)
    if zipfile.is_zipfile(archive):
        return safe_extract_zip(archive, dest, **caps)
    try:
        is_tar = tarfile.is_tarfile(archive)
    except OSError:
        is_tar = False
    if not is_tar:
        raise ArchiveError(f"{archive.name} is neither a zip nor a tar archive (.tar.gz, .tar.xz, .tar.bz2).",
                           "Check the URL: it should name the release's asset (the archive), not its web page.")
    return safe_extract(archive, dest, **caps)


def download_engine(settings: Settings, *, manifest: dict[str, Any] | os.PathLike | str | None = None,
                    control: CancelToken | None = None, endpoint: str | None = None, token: str | None = None,
                    checkpoint_bytes: int = CHECKPOINT_BYTES, stall_timeout_s: float = STALL_TIMEOUT_S,
                    max_tries: int = MAX_TRIES_WITHOUT_PROGRESS, backoff_s: tuple[float, ...] = BACKOFF_S,
                    reserve_bytes: int = RESERVE_BYTES, progress_interval_s: float = 0.25) -> DownloadRun:
    """Download the pinned engine archive, verify its sha256 before unpacking (refused and removed on mismatch),
    unpack it safely into ``<cache_dir>/engine/<version>``, mark its executables. Yields events."""
    control = control or CancelToken()
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
            headers.update(bearer_headers(token))
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
                           asset: str, dest: Path, *, control: CancelToken, token: str | None,
                           checkpoint_bytes: int, stall_timeout_s: float, max_tries: int,
                           backoff_s: tuple[float, ...], progress_interval_s: float, t0: float) -> DownloadRun:
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
