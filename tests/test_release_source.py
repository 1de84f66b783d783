"""An engine release the user names: a folder they already have (`dsv41 download engine --from DIR`), or an archive
at a URL (`--url URL [--sha256 HEX]`), served here by a real loopback HTTP server (the local hub) from a real tar or
zip of the stand-in Strata release. Hostile archives, a wrong sha256, and a folder that fails each release check."""

from __future__ import annotations

import io
import json
import os
import stat
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from engine_manager import download as dl
from engine_manager.cli import main as cli_main
from engine_manager.download import release_source as rs
from engine_manager.hashing import sha256_file
from engine_manager.release_check import check_release, usable
from engine_manager.settings import load_settings
from engine_manager.testing.hub import LocalHub

from strata_support import make_strata_release

ROOT = Path(__file__).resolve().parents[1]


def _settings():
    return load_settings().settings


def _engine_dir():
    return load_settings().settings.engine_dir


def _installed_folders(s) -> list[Path]:
    root = s.cache_path / "engine"
    return sorted(p for p in root.iterdir() if not p.name.startswith(".")) if root.is_dir() else []


def _tar_release(release: Path, out: Path, root: str = "strata-v0.1.0", dereference: bool = True) -> Path:
    """A .tar.gz of the release under one top folder. ``dereference``: the .venv's links to the system's Python
    become files (a venv made elsewhere links out of the folder, which the unpacking refuses)."""
    with tarfile.open(out, "w:gz", dereference=dereference) as tar:
        tar.add(release, arcname=root)
    return out


def _zip_release(release: Path, out: Path, root: str = "strata-v0.1.0") -> Path:
    """A .zip of the release (zipfile follows links and records each file's mode, as `zip` does)."""
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        for p in sorted(release.rglob("*")):
            if p.is_file():
                zf.write(p, f"{root}/{p.relative_to(release)}")
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One stand-in release and its archives, made once for the module."""
    d = tmp_path_factory.mktemp("release-src")
    rel = make_strata_release(d / "rel")
    return {"release": rel, "tar": _tar_release(rel, d / "strata-v0.1.0-linux-x86_64-cuda13-sm120.tar.gz"),
            "zip": _zip_release(rel, d / "strata-v0.1.0-linux-x86_64-cuda13-sm120.zip"),
            "linked_tar": _tar_release(rel, d / "linked.tar.gz", dereference=False)}


@pytest.fixture
def hub():
    with LocalHub() as h:
        yield h


def _serve(hub, archive: Path, name: str | None = None) -> tuple[str, str]:
    path = f"/deepseek-one-gpu/releases/download/v0.1.0/{name or archive.name}"
    f = hub.add_raw(path, archive)
    return hub.raw_url(path), f.sha256


def _cli(capsys, *args) -> tuple[int, str, str]:
    rc = cli_main(["download", *args])
    out = capsys.readouterr()
    return int(rc), out.out, out.err


# ------------------------------------------------------------------------------------------------ --from DIR
def test_from_a_good_folder_checks_it_and_sets_engine_dir(tmp_path, capsys):
    rel = make_strata_release(tmp_path / "my-strata")
    assert _engine_dir() is None
    rc, out, err = _cli(capsys, "engine", "--from", str(rel))
    assert rc == 0, out + err
    assert _engine_dir() == rel
    assert "PASS  Engine binary" in out and "PASS  The release's Python (.venv)" in out
    assert "is now the engine folder (engine_dir)" in out


def _no_binary(rel):
    (rel / "engine" / "strata").unlink()


def _not_executable(rel):
    (rel / "engine" / "strata").chmod(0o644)


def _bad_build_json(rel):
    (rel / "engine" / "BUILD.json").write_text("{not json")


def _no_venv(rel):
    import shutil
    shutil.rmtree(rel / ".venv")


def _venv_without_jinja2(rel):
    import shutil
    shutil.rmtree(next((rel / ".venv" / "lib").glob("python3*/site-packages")) / "jinja2")


def _no_cuda_wheels(rel):
    import shutil
    shutil.rmtree(next((rel / ".venv" / "lib").glob("python3*/site-packages")) / "nvidia")


def _no_server(rel):
    (rel / "serve" / "server.py").unlink()


def _no_iq_pack(rel):
    (rel / "tools" / "iq_pack.py").unlink()


@pytest.mark.parametrize("break_it, check_id, fix_words", [
    (_no_binary, "engine_binary", "engine/strata"),
    (_not_executable, "engine_binary", "chmod +x"),
    (_bad_build_json, "build_json", "BUILD.json"),
    (_no_venv, "venv", "setup"),
    (_venv_without_jinja2, "venv", "pip install jinja2"),
    (_no_cuda_wheels, "cuda_libs", "nvidia-cublas==13.0.2.14"),
    (_no_server, "server", "release is incomplete"),
    (_no_iq_pack, "iq_pack", "release is incomplete"),
])
def test_a_folder_that_fails_a_check_is_refused_with_that_fix(tmp_path, capsys, break_it, check_id, fix_words):
    rel = make_strata_release(tmp_path / "broken")
    break_it(rel)
    checks = check_release(rel)
    failed = [c for c in checks if c.status == "fail"]
    assert [c.id for c in failed][:1] == [check_id] and fix_words in failed[0].fix
    assert not usable(checks)
    rc, out, err = _cli(capsys, "engine", "--from", str(rel))
    assert rc == 1
    assert f"FAIL  {failed[0].title}" in out and fix_words in out          # the failure and its fix, shown
    assert "engine_dir setting was not changed" in err
    assert _engine_dir() is None


def test_choosing_the_releases_engine_subfolder_says_which_folder_to_choose(tmp_path, capsys):
    rel = make_strata_release(tmp_path / "rel")
    rc, out, _ = _cli(capsys, "engine", "--from", str(rel / "engine"))
    assert rc == 1 and f"choose {rel} instead" in out
    assert _engine_dir() is None


def test_a_missing_folder_is_refused(tmp_path, capsys):
    rc, out, err = _cli(capsys, "engine", "--from", str(tmp_path / "nope"))
    assert rc == 1 and "does not exist" in out and _engine_dir() is None


# ------------------------------------------------------------------------------------------------ --url, pinned
def test_url_with_the_right_sha256_downloads_unpacks_checks_and_sets_engine_dir(hub, built, capsys):
    url, sha = _serve(hub, built["tar"])
    rc, out, err = _cli(capsys, "engine", "--url", url, "--sha256", sha.upper())
    assert rc == 0, out + err
    s = _settings()
    folder = s.cache_path / "engine" / "strata-v0.1.0-linux-x86_64-cuda13-sm120"
    assert _engine_dir() == folder
    assert usable(check_release(folder))
    marker = json.loads((folder / dl.RELEASE_MARKER).read_text())
    assert marker["sha256"] == sha and marker["verified"] == rs.VERIFIED_PINNED and marker["url"] == url
    assert os.access(folder / "engine" / "strata", os.X_OK)
    assert not list((s.cache_path / "engine" / ".downloads").glob("*.tar.gz*"))     # the archive is not kept


def test_url_with_a_wrong_sha256_is_refused_and_deleted(hub, built, capsys):
    url, sha = _serve(hub, built["tar"])
    wrong = ("0" if sha[0] != "0" else "1") + sha[1:]
    rc, out, err = _cli(capsys, "engine", "--url", url, "--sha256", wrong)
    assert rc == 1
    assert f"its sha256 is {sha}, not the {wrong}" in err and "deleted" in err
    s = _settings()
    assert _installed_folders(s) == []
    assert not [p for p in (s.cache_path / "engine" / ".downloads").iterdir() if p.is_file()]
    assert _engine_dir() is None


# ------------------------------------------------------------------------------------------------ --url, confirmed
def test_url_without_sha256_shows_it_and_unpacks_nothing_until_confirmed(hub, built, capsys):
    url, sha = _serve(hub, built["zip"])
    assert sha == sha256_file(built["zip"])
    rc, out, err = _cli(capsys, "engine", "--url", url)
    assert rc == 1
    assert sha in out and "not unpacked" in err and f"--yes-i-checked-the-sha256 {sha}" in err
    s = _settings()
    assert _installed_folders(s) == [] and _engine_dir() is None
    pending = rs.pending_archive(s, url)
    assert pending is not None and pending.sha256 == sha
    # the confirmation: the kept download is used (not fetched again), unpacked, checked, recorded
    hub.reset_stats()
    rc, out, err = _cli(capsys, "engine", "--url", url, "--yes-i-checked-the-sha256", f"sha256:{sha}")
    assert rc == 0, out + err
    assert hub.bytes_sent() == 0
    folder = s.cache_path / "engine" / "strata-v0.1.0-linux-x86_64-cuda13-sm120"
    assert _engine_dir() == folder
    marker = json.loads((folder / dl.RELEASE_MARKER).read_text())
    assert marker["verified"] == rs.VERIFIED_CONFIRMED and marker["sha256"] == sha
    assert os.access(folder / ".venv" / "bin" / "python", os.X_OK)          # the zip's modes kept
    assert rs.pending_archive(s, url) is None


def test_confirming_another_sha256_refuses_and_deletes(hub, built, capsys):
    url, sha = _serve(hub, built["zip"])
    other = "ab" * 32
    rc, out, err = _cli(capsys, "engine", "--url", url, "--yes-i-checked-the-sha256", other)
    assert rc == 1 and "refused" in err and other in err
    s = _settings()
    assert _installed_folders(s) == [] and rs.pending_archive(s, url) is None and _engine_dir() is None


def test_at_a_terminal_the_user_pastes_the_release_pages_sha256(hub, built, tmp_path):
    """The interactive confirmation, through a real pseudo-terminal."""
    import pty
    import select
    url, sha = _serve(hub, built["tar"])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    main_fd, sub_fd = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "engine_manager", "download", "engine", "--url", url],
                            stdin=sub_fd, stdout=sub_fd, stderr=sub_fd, cwd=ROOT, env=env, close_fds=True)
    os.close(sub_fd)
    said = b""
    try:
        while b"sha256 from the release page:" not in said:
            ready, _, _ = select.select([main_fd], [], [], 120)
            assert ready, said.decode(errors="replace")
            said += os.read(main_fd, 65536)
        assert sha.encode() in said
        os.write(main_fd, f"sha256:{sha.upper()}\n".encode())
        while proc.poll() is None or select.select([main_fd], [], [], 0)[0]:
            if select.select([main_fd], [], [], 1)[0]:
                try:
                    said += os.read(main_fd, 65536)
                except OSError:
                    break
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(main_fd)
    assert proc.returncode == 0, said.decode(errors="replace")
    folder = _settings().cache_path / "engine" / "strata-v0.1.0-linux-x86_64-cuda13-sm120"
    assert _engine_dir() == folder
    assert json.loads((folder / dl.RELEASE_MARKER).read_text())["verified"] == rs.VERIFIED_CONFIRMED


def test_an_archive_changed_after_its_sha256_was_shown_is_refused(hub, built):
    url, sha = _serve(hub, built["tar"])
    s = _settings()
    events = list(rs.fetch_release(s, url, progress_interval_s=0.01))
    fetched = events[-1]
    assert isinstance(fetched, rs.ArchiveFetched) and fetched.sha256 == sha and not fetched.pinned
    assert any(isinstance(e, dl.Progress) for e in events)
    with open(fetched.path, "r+b") as f:          # someone swaps bytes between the look and the confirmation
        f.seek(100)
        f.write(b"\0" * 16)
    with pytest.raises(dl.ArchiveError, match="not the confirmed"):
        rs.install_release(s, fetched.path, sha256=sha, how=rs.VERIFIED_CONFIRMED, url=url)
    assert not fetched.path.exists() and _installed_folders(s) == []


def test_an_existing_release_folder_is_never_replaced(hub, built):
    url, sha = _serve(hub, built["tar"])
    s = _settings()
    first = list(rs.fetch_release(s, url, sha256=sha))[-1]
    a = rs.install_release(s, first.path, sha256=sha, how=rs.VERIFIED_PINNED, url=url, run_python=False)
    (a.folder / "my-notes.txt").write_text("mine")
    second = list(rs.fetch_release(s, url, sha256=sha))[-1]
    b = rs.install_release(s, second.path, sha256=sha, how=rs.VERIFIED_PINNED, url=url, run_python=False)
    assert b.folder != a.folder and b.folder.name.endswith("-2")
    assert (a.folder / "my-notes.txt").read_text() == "mine"


def test_http_errors_and_bad_input_say_what_to_do(hub, capsys):
    rc, _, err = _cli(capsys, "engine", "--url", hub.raw_url("/nothing/here.tar.gz"))
    assert rc == 1 and "HTTP 404" in err and "what to do:" in err
    rc, _, err = _cli(capsys, "engine", "--url", "ftp://example.org/x.tar.gz")
    assert rc == 1 and "not an http(s) address" in err
    rc, _, err = _cli(capsys, "engine", "--url", hub.raw_url("/x.tar.gz"), "--sha256", "1234")
    assert rc == 2 and "not a sha256" in err
    rc, _, err = _cli(capsys, "engine", "--sha256", "ab" * 32)
    assert rc == 2 and "go with --url" in err


def test_a_cancelled_fetch_leaves_no_partial_file(hub, built):
    url, _ = _serve(hub, built["tar"])
    hub.add_fault(kind="slow", rate_bps=4096, times=None)
    s = _settings()
    control = dl.CancelToken()
    gen = rs.fetch_release(s, url, control=control, progress_interval_s=0.01)
    for ev in gen:
        if isinstance(ev, dl.Progress) and ev.done_bytes > 0:
            control.cancel()
    assert isinstance(ev, dl.Stopped)
    assert not [p for p in (s.cache_path / "engine" / ".downloads").iterdir() if p.is_file()]


def test_sha256_text_reads_what_release_pages_and_sha256sum_show():
    h = "0123456789abcdef" * 4
    assert rs.sha256_text(h.upper()) == h
    assert rs.sha256_text(f"  sha256:{h}\n") == h
    assert rs.sha256_text(f"{h}  strata.tar.gz") == h
    assert rs.sha256_text(h[:-1]) is None and rs.sha256_text("") is None and rs.sha256_text(None) is None


# ------------------------------------------------------------------------------------------------ hostile archives
def _tar(path: Path, members: list[tuple[str, bytes | None, dict]]) -> Path:
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


def _zip(path: Path, members: list[tuple[str, bytes, int]]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data, mode in members:
            zi = zipfile.ZipInfo(name)
            zi.external_attr = mode << 16
            zf.writestr(zi, data)
    return path


GOOD = ("r/serve/server.py", b"print('server')\n", {"mode": 0o644})

HOSTILE = {
    "tar-dotdot": lambda p: _tar(p, [GOOD, ("r/../../evil.txt", b"x", {"mode": 0o644})]),
    "tar-absolute": lambda p: _tar(p, [GOOD, ("/tmp/evil-abs.txt", b"x", {"mode": 0o644})]),
    "tar-symlink-out": lambda p: _tar(p, [GOOD, ("r/engine/strata", None, {"type": tarfile.SYMTYPE,
                                                                          "linkname": "/bin/sh"})]),
    "tar-symlink-climb": lambda p: _tar(p, [GOOD, ("r/link", None, {"type": tarfile.SYMTYPE,
                                                                    "linkname": "../../outside"})]),
    "tar-hardlink-out": lambda p: _tar(p, [GOOD, ("r/hl", None, {"type": tarfile.LNKTYPE,
                                                                 "linkname": "/etc/passwd"})]),
    "tar-device": lambda p: _tar(p, [GOOD, ("r/dev", None, {"type": tarfile.CHRTYPE, "devmajor": 1,
                                                            "devminor": 3})]),
    "zip-dotdot": lambda p: _zip(p, [("r/serve/server.py", b"s", 0o100644), ("../evil.txt", b"x", 0o100644)]),
    "zip-absolute": lambda p: _zip(p, [("r/serve/server.py", b"s", 0o100644), ("/tmp/evil-abs.txt", b"x",
                                                                                0o100644)]),
    "zip-symlink": lambda p: _zip(p, [("r/serve/server.py", b"s", 0o100644), ("r/engine/strata", b"/bin/sh",
                                                                               stat.S_IFLNK | 0o777)]),
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_archives_are_refused_before_anything_is_written(tmp_path, kind):
    archive = HOSTILE[kind](tmp_path / f"{kind}.archive")
    dest = tmp_path / "unpacked"
    with pytest.raises(dl.ArchiveError, match="Refused to unpack"):
        dl.safe_unpack(archive, dest)
    assert not dest.exists()
    assert not (tmp_path / "evil.txt").exists() and not Path("/tmp/evil-abs.txt").exists()


@pytest.mark.parametrize("kind", ["tar-dotdot", "zip-symlink"])
def test_a_confirmed_hostile_archive_still_installs_nothing(hub, tmp_path, kind):
    archive = HOSTILE[kind](tmp_path / f"{kind}.archive")
    url, sha = _serve(hub, archive, name=f"{kind}.tar.gz")
    s = _settings()
    fetched = list(rs.fetch_release(s, url))[-1]
    with pytest.raises(dl.ArchiveError, match="Refused to unpack"):
        rs.install_release(s, fetched.path, sha256=sha, how=rs.VERIFIED_CONFIRMED, url=url)
    assert _installed_folders(s) == [] and _engine_dir() is None
    assert not [p for p in (s.cache_path / "engine").iterdir() if p.name.startswith(".unpack")]


def test_a_release_with_its_venvs_links_to_the_system_python_is_refused(built, tmp_path):
    """A .venv made on another machine links bin/python to that machine's interpreter (an absolute link out of the
    release): refused, named."""
    with pytest.raises(dl.ArchiveError, match=r"\.venv/bin/python.* (links|absolute)"):
        dl.safe_unpack(built["linked_tar"], tmp_path / "x")


def test_size_caps_refuse_a_bomb(tmp_path):
    t = _tar(tmp_path / "big.tar.gz", [("r/a", b"\0" * 200_000, {"mode": 0o644})])
    with pytest.raises(dl.ArchiveError, match="would unpack to"):
        dl.safe_unpack(t, tmp_path / "x", max_bytes=100_000)
    z = _zip(tmp_path / "many.zip", [(f"r/{i}", b"x", 0o100644) for i in range(20)])
    with pytest.raises(dl.ArchiveError, match="entries"):
        dl.safe_unpack(z, tmp_path / "y", max_members=10)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_not_an_archive_says_so(tmp_path):
    p = tmp_path / "page.html"
    p.write_text("<html>release page</html>")
    with pytest.raises(dl.ArchiveError, match="neither a zip nor a tar"):
        dl.safe_unpack(p, tmp_path / "x")
