"""The engine release: verified before unpacking, refused and removed on mismatch, unpacked safely."""

from __future__ import annotations

import io
import json
import os
import stat
import tarfile
from pathlib import Path

import pytest

from engine_manager import download as dl
from engine_manager.cli import main as cli_main
from engine_manager.testing.hub import LocalHub, release_manifest, sha256_file, write_demo_release
from engine_manager.settings import load_settings

FAST = dict(backoff_s=(0.05,), progress_interval_s=0.05)


def _settings():
    return load_settings().settings


def _tar(path: Path, members: list[tuple[str, bytes | None, dict]]) -> Path:
    """Write a .tar.gz; each member is (name, data or None for a dir, TarInfo attributes)."""
    with tarfile.open(path, "w:gz") as tar:
        for name, data, attrs in members:
            ti = tarfile.TarInfo(name)
            for k, v in attrs.items():
                setattr(ti, k, v)
            if data is not None and ti.type == tarfile.REGTYPE:
                ti.size = len(data)
                tar.addfile(ti, io.BytesIO(data))
            else:
                tar.addfile(ti)
    return path


@pytest.fixture
def hub():
    with LocalHub() as h:
        yield h


def _engine_root(s) -> Path:
    return s.cache_path / "engine"


def test_good_release_is_verified_unpacked_and_marked_executable(hub, tmp_path):
    archive = write_demo_release(tmp_path / "strata-v0.1.0.tar.gz")
    manifest = release_manifest(hub, archive)
    s = _settings()
    events = list(dl.download_engine(s, manifest=manifest, **FAST))
    fin = events[-1]
    assert isinstance(fin, dl.Finished) and fin.what == "engine"
    dest = dl.engine_release_dir(s, "v0.1.0")
    assert fin.target_dir == dest == s.cache_path / "engine" / "v0.1.0"
    exe = dest / "bin" / "strata-demo"
    assert exe.is_file() and os.access(exe, os.X_OK)
    assert (dest / "DEMO-RELEASE.txt").is_file()
    marker = json.loads((dest / dl.RELEASE_MARKER).read_text())
    assert marker["sha256"] == manifest["sha256"] == sha256_file(archive)
    assert dl.installed_engine(s, manifest) == dest
    assert not list((_engine_root(s) / ".downloads").glob("*.tar.gz"))     # the archive is not kept
    hub.reset_stats()
    again = list(dl.download_engine(s, manifest=manifest, **FAST))
    assert isinstance(again[-1], dl.Finished) and hub.bytes_sent() == 0


@pytest.mark.parametrize("how", ["other-file", "flipped-bytes"])
def test_tampered_archive_is_refused_and_removed(hub, tmp_path, how):
    good = write_demo_release(tmp_path / "good.tar.gz")
    manifest = release_manifest(hub, good, url_path="/rel/v0.1.0/strata.tar.gz")
    if how == "other-file":         # the server now serves another archive under the same URL
        evil = _tar(tmp_path / "evil.tar.gz", [("strata-v0.1.0/bin/strata-demo", b"#!/bin/sh\necho pwned\n",
                                                {"mode": 0o755})])
        hub.add_raw("/rel/v0.1.0/strata.tar.gz", evil)
    else:                           # same size, a few bytes changed on the way
        hub.add_fault(kind="corrupt", path="*strata.tar.gz", at=40, length=3, times=None)
    s = _settings()
    events = []
    with pytest.raises(dl.ArchiveError) as ei:
        for ev in dl.download_engine(s, manifest=manifest, **FAST):
            events.append(ev)
    assert "Refused" in ei.value.message and "removed" in ei.value.fix
    if how == "flipped-bytes":
        assert [e.action for e in events if isinstance(e, dl.FileCorrupt)] == ["fetching it again", "giving up"]
    assert not dl.engine_release_dir(s, "v0.1.0").exists()
    downloads = _engine_root(s) / ".downloads"
    left = [p for p in downloads.rglob("*") if p.is_file()]
    assert left == [], left                          # neither the archive nor a partial of it stays


def test_archive_with_dotdot_paths_is_refused(hub, tmp_path):
    evil = _tar(tmp_path / "dotdot.tar.gz", [
        ("strata-v0.1.0/bin/strata-demo", b"#!/bin/sh\n", {"mode": 0o755}),
        ("strata-v0.1.0/../../../../escaped.txt", b"gotcha\n", {}),
    ])
    manifest = release_manifest(hub, evil)          # the checksum matches: the paths are what is wrong
    s = _settings()
    with pytest.raises(dl.ArchiveError) as ei:
        list(dl.download_engine(s, manifest=manifest, **FAST))
    assert "'..'" in ei.value.message
    assert not dl.engine_release_dir(s, "v0.1.0").exists()
    assert not list(s.cache_path.rglob("escaped.txt")) and not (s.cache_path.parent / "escaped.txt").exists()
    assert not [p for p in (_engine_root(s) / ".downloads").rglob("*") if p.is_file()]


@pytest.mark.parametrize("member,why", [
    (("/etc/dsv41-evil", b"x", {}), "absolute path"),
    (("pkg/link", None, {"type": tarfile.SYMTYPE, "linkname": "../../outside"}), "links outside"),
    (("pkg/abs", None, {"type": tarfile.SYMTYPE, "linkname": "/etc/passwd"}), "absolute path"),
    (("pkg/hard", None, {"type": tarfile.LNKTYPE, "linkname": "../outside"}), "outside"),
    (("pkg/dev", None, {"type": tarfile.CHRTYPE, "devmajor": 1, "devminor": 3}), "device"),
])
def test_safe_extract_refuses_unsafe_members(tmp_path, member, why):
    archive = _tar(tmp_path / "a.tar.gz", [("pkg/ok.txt", b"fine", {}), member])
    dest = tmp_path / "dest"
    with pytest.raises(dl.ArchiveError) as ei:
        dl.safe_extract(archive, dest)
    assert why in str(ei.value)
    assert not dest.exists()                        # refused before anything was unpacked


def test_safe_extract_keeps_links_inside(tmp_path):
    archive = _tar(tmp_path / "a.tar.gz", [
        ("pkg/bin/tool", b"#!/bin/sh\n", {"mode": 0o755}),
        ("pkg/tool", None, {"type": tarfile.SYMTYPE, "linkname": "bin/tool"}),
    ])
    names = dl.safe_extract(archive, tmp_path / "d")
    assert "pkg/tool" in names and (tmp_path / "d" / "pkg" / "tool").resolve() == \
        (tmp_path / "d" / "pkg" / "bin" / "tool").resolve()
    assert (tmp_path / "d" / "pkg" / "bin" / "tool").stat().st_mode & stat.S_IXUSR


def test_missing_executable_is_refused(hub, tmp_path):
    archive = write_demo_release(tmp_path / "r.tar.gz")
    manifest = release_manifest(hub, archive)
    manifest["executables"] = ["bin/strata-server"]
    s = _settings()
    with pytest.raises(dl.ArchiveError) as ei:
        list(dl.download_engine(s, manifest=manifest, **FAST))
    assert "bin/strata-server" in ei.value.message
    assert not dl.engine_release_dir(s, "v0.1.0").exists()


@pytest.mark.parametrize("entry", ["../../victim", "bin/../../../victim", "ABS"])
def test_manifest_executables_outside_the_release_are_refused_and_nothing_is_touched(hub, tmp_path, entry):
    """an ``executables`` entry climbing out of the release folder (``../victim``) made the panel
    chmod a file outside it (0644 → 0755). Refused in plain words before anything is fetched; the file keeps its
    mode."""
    archive = write_demo_release(tmp_path / "r.tar.gz")
    manifest = release_manifest(hub, archive)
    s = _settings()
    victim = _engine_root(s) / "victim"          # where "../../victim" lands from the unpacked release's root
    victim.parent.mkdir(parents=True, exist_ok=True)
    victim.write_bytes(b"not an executable\n")
    victim.chmod(0o644)
    manifest["executables"] = ["bin/strata-demo", str(victim) if entry == "ABS" else entry]
    with pytest.raises(dl.ArchiveError) as ei:
        list(dl.download_engine(s, manifest=manifest, **FAST))
    msg = str(ei.value)
    assert "leaves the release folder" in msg and "executables" in msg
    assert stat.S_IMODE(victim.stat().st_mode) == 0o644
    assert not dl.engine_release_dir(s, "v0.1.0").exists() and hub.bytes_sent() == 0


def test_an_executable_that_resolves_outside_the_release_is_not_touched(tmp_path):
    """The second guard, at chmod time: a path inside the release that resolves (through a link) outside it."""
    root = tmp_path / "rel"
    (root / "bin").mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_bytes(b"x")
    victim.chmod(0o644)
    (root / "bin" / "tool").symlink_to(victim)
    with pytest.raises(dl.ArchiveError) as ei:
        dl.release._inside(root, "bin/tool")
    assert "outside the release folder" in str(ei.value)
    assert dl.release._inside(root, "bin") == (root / "bin").resolve()
    assert stat.S_IMODE(victim.stat().st_mode) == 0o644


def test_the_shipped_manifest_is_a_marked_placeholder_and_is_refused():
    raw = json.loads((Path(dl.store.paths.resources_dir()) / "manifests" / "engine.json").read_text())
    assert raw["version"] == "v0.1.0" and raw["placeholder"] is True and "PLACEHOLDER" in raw["note"]
    with pytest.raises(dl.ArchiveError) as ei:
        dl.read_engine_manifest()
    assert "never runs a binary it has not verified" in ei.value.message
    assert "engine.json" in ei.value.fix
    assert "dsv41 download engine --from DIR" in ei.value.fix and "--url URL" in ei.value.fix   # the two real ways
    with pytest.raises(dl.ArchiveError):
        dl.read_engine_manifest({"version": "v0.1.0", "url": "http://x/y.tar.gz", "size": 10, "sha256": "abc"})


def test_cli_engine_download(hub, tmp_path, capsys):
    archive = write_demo_release(tmp_path / "r.tar.gz")
    mpath = tmp_path / "engine.json"
    mpath.write_text(json.dumps(release_manifest(hub, archive)))
    assert cli_main(["download", "--engine", "--engine-manifest", str(mpath)]) == 0
    out = capsys.readouterr().out
    assert "release verified and unpacked" in out
    assert (dl.engine_release_dir(_settings(), "v0.1.0") / "bin" / "strata-demo").is_file()
    # the shipped placeholder manifest: refused with what to do, exit 1
    assert cli_main(["download", "--engine"]) == 1
    err = capsys.readouterr().err
    assert "what to do" in err and "engine.json" in err
