"""The local hub against the real huggingface_hub (and plain HTTP for the fault switches)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from huggingface_hub import HfApi, hf_hub_download
from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

from engine_manager.testing.hub import Fault, LocalHub, parse_range, sha256_file, write_demo_shards

REPO = "vcruz305/DeepSeek-V4.1-Flash-GGUF"
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def shards(tmp_path) -> list[Path]:
    return write_demo_shards(tmp_path / "src", bytes_per_shard=256 * 1024)


@pytest.fixture(params=[True, False], ids=["cdn-redirect", "direct"])
def hub(request, shards):
    with LocalHub(redirect_lfs=request.param) as h:
        repo = h.repo(REPO)
        for s in shards:
            repo.add_file(s.name, s)
        repo.add_file("README.md", b"# fixture\n")
        repo.add_file("extra/config.json", b'{"a": 1}\n')
        yield h


def test_model_info_tree_and_paths_info_with_real_library(hub, shards):
    api = HfApi(endpoint=hub.url, token=False)
    info = api.model_info(REPO, files_metadata=True)
    assert info.sha == hub.repo(REPO).head and len(info.sha) == 40
    sib = {s.rfilename: s for s in info.siblings}
    for s in shards:
        assert sib[s.name].size == s.stat().st_size
        assert sib[s.name].lfs.sha256 == sha256_file(s)
    assert sib["README.md"].lfs is None
    # revision endpoint with a commit sha
    assert api.model_info(REPO, revision=info.sha).sha == info.sha
    # recursive tree (paginated: 3 entries per page) lists every file and the folder
    hub.page_size = 3
    tree = list(api.list_repo_tree(REPO, recursive=True, revision=info.sha))
    paths = {e.path for e in tree}
    assert {s.name for s in shards} | {"README.md", "extra", "extra/config.json"} == paths
    lfs = {e.path: e.lfs.sha256 for e in tree if getattr(e, "lfs", None)}
    assert lfs[shards[0].name] == sha256_file(shards[0])
    # paths-info (POST, form encoded)
    got = api.get_paths_info(REPO, [shards[2].name, "extra"], revision="main")
    assert got[0].lfs.sha256 == sha256_file(shards[2]) and got[1].path == "extra"


def test_hf_hub_download_and_errors(hub, shards, tmp_path):
    p = hf_hub_download(REPO, shards[1].name, endpoint=hub.url, cache_dir=tmp_path / "c", token=False)
    assert sha256_file(Path(p)) == sha256_file(shards[1])
    with pytest.raises(RepositoryNotFoundError):
        HfApi(endpoint=hub.url, token=False).model_info("nobody/nothing")
    with pytest.raises(RevisionNotFoundError):
        HfApi(endpoint=hub.url, token=False).model_info(REPO, revision="no-such-branch")
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(REPO, "missing.gguf", endpoint=hub.url, cache_dir=tmp_path / "c", token=False)


def test_snapshot_download_through_hf_endpoint_in_a_fresh_process(hub, shards, tmp_path):
    """HF_ENDPOINT is read by huggingface_hub at import: a fresh process with only the variable set."""
    code = ("import sys, hashlib, pathlib\nfrom huggingface_hub import snapshot_download\n"
            f"d = pathlib.Path(snapshot_download({REPO!r}, cache_dir=sys.argv[1], token=False))\n"
            "for p in sorted(d.rglob('*')):\n"
            "    if p.is_file(): print(p.relative_to(d), hashlib.sha256(p.read_bytes()).hexdigest())\n")
    env = dict(os.environ, HF_ENDPOINT=hub.url, HF_HUB_DISABLE_PROGRESS_BARS="1")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "snap")], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = dict(line.split() for line in out.stdout.splitlines())
    for s in shards:
        assert got[s.name] == sha256_file(s)
    assert got["extra/config.json"] == hashlib.sha256(b'{"a": 1}\n').hexdigest()


def test_resolve_headers_and_ranges(hub, shards):
    url = f"{hub.url}/{REPO}/resolve/main/{shards[0].name}"
    sha = sha256_file(shards[0])
    size = shards[0].stat().st_size
    with httpx.Client(follow_redirects=False) as c:
        h = c.head(url)
        assert h.headers["X-Repo-Commit"] == hub.repo(REPO).head
        assert h.headers["X-Linked-Etag"] == f'"{sha}"' and int(h.headers["X-Linked-Size"]) == size
        if hub.redirect_lfs:
            assert h.status_code == 302 and "/_cdn/" in h.headers["Location"]
            url = h.headers["Location"]
        else:
            assert h.status_code == 200 and int(h.headers["Content-Length"]) == size
            assert h.headers["ETag"] == f'"{sha}"'
        r = c.get(url, headers={"Range": "bytes=100-199"})
        assert r.status_code == 206 and r.headers["Content-Range"] == f"bytes 100-199/{size}"
        assert r.content == shards[0].read_bytes()[100:200]
        r = c.get(url, headers={"Range": f"bytes={size - 10}-"})
        assert r.status_code == 206 and r.content == shards[0].read_bytes()[-10:]
        r = c.get(url, headers={"Range": f"bytes={size}-"})
        assert r.status_code == 416 and r.headers["Content-Range"] == f"bytes */{size}"


def test_parse_range():
    assert parse_range("bytes=0-9", 100) == (0, 10)
    assert parse_range("bytes=90-", 100) == (90, 100)
    assert parse_range("bytes=-5", 100) == (95, 100)
    assert parse_range("bytes=100-", 100) == "invalid"
    assert parse_range(None, 100) is None and parse_range("items=1-2", 100) is None


def test_token_required(shards, tmp_path):
    with LocalHub(token="hf_secret_fixture_token") as h:
        h.repo(REPO).add_file(shards[0].name, shards[0])
        with pytest.raises(RepositoryNotFoundError):
            HfApi(endpoint=h.url, token=False).model_info(REPO)
        assert HfApi(endpoint=h.url, token="hf_secret_fixture_token").model_info(REPO).sha
        p = hf_hub_download(REPO, shards[0].name, endpoint=h.url, token="hf_secret_fixture_token",
                            cache_dir=tmp_path / "c")
        assert sha256_file(Path(p)) == sha256_file(shards[0])


# -- faults ------------------------------------------------------------------------------------------------------

def _cdn_url(h: LocalHub, name: str) -> str:
    f = h.repo(REPO).files(h.repo(REPO).head)[name]
    return f"{h.url}/_cdn/{f.sha256}/{name}"


def test_fault_drop_at_byte(hub, shards):
    name = shards[0].name
    hub.add_fault(kind="drop", path="*00001*", at=50_000)
    with httpx.Client() as c:
        got = bytearray()
        with pytest.raises(httpx.RemoteProtocolError):
            with c.stream("GET", _cdn_url(hub, name)) as r:
                for chunk in r.iter_bytes():
                    got += chunk
        assert bytes(got) == shards[0].read_bytes()[:50_000]
        # times=1: the next request is whole
        assert c.get(_cdn_url(hub, name)).content == shards[0].read_bytes()
    # the hub's handler thread counts a chunk after writing it: the client can hold the whole body before the
    # last count lands (seen under load), so wait for the count rather than read it at once
    want = 50_000 + shards[0].stat().st_size
    deadline = time.monotonic() + 30
    while hub.bytes_sent(name) < want and time.monotonic() < deadline:
        time.sleep(0.02)
    assert hub.bytes_sent(name) == want


def _settled(h: LocalHub) -> None:
    """Wait until the hub's handlers are done (they count a piece after the client may already have it)."""
    deadline = time.monotonic() + 10
    while h.open_connections() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_request_log_has_the_range_the_file_and_the_bytes_sent(hub, shards):
    name, size = shards[0].name, shards[0].stat().st_size
    hub.add_fault(kind="drop", path=name, at=20_000)
    with httpx.Client() as c:
        with pytest.raises(httpx.RemoteProtocolError):
            c.get(_cdn_url(hub, name))
        assert c.get(_cdn_url(hub, name), headers={"Range": "bytes=20000-"}).status_code == 206
        assert c.head(_cdn_url(hub, name)).status_code == 200
        c.get(f"{hub.url}/api/models/{REPO}")
    _settled(hub)
    got = [(r["method"], r["status"], r["range"], r["sent"]) for r in hub.requests(name)]
    assert got == [("GET", 200, None, 20_000), ("GET", 206, "bytes=20000-", size - 20_000), ("HEAD", 200, None, 0)]
    assert [r["range"] for r in hub.requests(name, method="GET")] == [None, "bytes=20000-"]
    log = hub.stats()["requests"]
    assert log[-1]["file"] is None and log[-1]["path"] == f"/api/models/{REPO}"
    # the same log over the admin route, for a hub in another process
    with httpx.Client() as c:
        remote = c.get(f"{hub.url}/_hub/stats").json()["requests"]
    assert [(r["file"], r["range"], r["sent"]) for r in remote[:2]] == [(name, None, 20_000),
                                                                        (name, "bytes=20000-", size - 20_000)]


def test_fault_stall_wrong_bytes_status_and_slow(hub, shards):
    name = shards[1].name
    data = shards[1].read_bytes()
    hub.add_fault(Fault("stall", path=name, at=1000, seconds=30))
    with httpx.Client(timeout=httpx.Timeout(5.0, read=0.5)) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.get(_cdn_url(hub, name))
    hub.add_fault(kind="corrupt", path=name, at=5000, length=16)
    with httpx.Client() as c:
        got = c.get(_cdn_url(hub, name)).content
        assert len(got) == len(data) and got != data
        assert got[:5000] == data[:5000] and got[5016:] == data[5016:]
        assert all(a ^ b == 0xFF for a, b in zip(got[5000:5016], data[5000:5016]))
        hub.add_fault(kind="status", path=name, status=503, times=2, method="any")
        assert c.get(_cdn_url(hub, name)).status_code == 503
        assert c.get(_cdn_url(hub, name)).status_code == 503
        assert c.get(_cdn_url(hub, name)).content == data
        hub.add_fault(kind="status", path=name, status=404)
        assert c.get(_cdn_url(hub, name)).status_code == 404
        hub.add_fault(kind="slow", path=name, rate_bps=1_000_000, times=None)
        t = time.monotonic()
        assert c.get(_cdn_url(hub, name)).content == data
        # a rate limit is a lower bound on the time, whatever the machine's load
        assert time.monotonic() - t >= 0.8 * len(data) / 1_000_000


def test_admin_routes(hub, shards):
    with httpx.Client() as c:
        r = c.post(f"{hub.url}/_hub/faults", json={"kind": "status", "path": "*", "status": 500, "method": "any"})
        assert r.status_code == 200 and r.json()["faults"][0]["status"] == 500
        assert c.get(_cdn_url(hub, shards[0].name)).status_code == 500
        c.delete(f"{hub.url}/_hub/faults")
        assert c.get(_cdn_url(hub, shards[0].name)).status_code == 200
        st = c.get(f"{hub.url}/_hub/stats").json()
        assert st["bytes_sent"][shards[0].name] == shards[0].stat().st_size
        c.post(f"{hub.url}/_hub/stats/reset")
        assert c.get(f"{hub.url}/_hub/stats").json()["bytes_sent"] == {}


def test_fault_spec_parsing():
    f = Fault.parse("drop:at=1048576,path=*00002*,times=2")
    assert (f.kind, f.at, f.path, f.times) == ("drop", 1048576, "*00002*", 2)
    assert Fault.parse("slow:rate_bps=5e6,times=inf").times is None
    with pytest.raises(ValueError):
        Fault.parse("explode:at=1")


def test_big_sparse_file_served_with_sendfile(tmp_path):
    """The planner's replica shards are big sparse files: served without reading them into memory."""
    big = tmp_path / "sparse.gguf"
    with open(big, "wb") as f:
        f.truncate(3 * 1024**3)
        f.seek(3 * 1024**3 - 4)
        f.write(b"TAIL")
    with LocalHub(redirect_lfs=False) as h:
        h.repo(REPO).add_file(big.name, big, sha256="0" * 64)   # a stated sha256: not hashing 3 GiB here
        url = f"{h.url}/{REPO}/resolve/main/{big.name}"
        with httpx.Client() as c:
            assert int(c.head(url).headers["Content-Length"]) == 3 * 1024**3
            r = c.get(url, headers={"Range": "bytes=-4"})
            assert r.status_code == 206 and r.content == b"TAIL"


def test_hub_command_line_serves_a_folder(tmp_path, shards):
    proc = subprocess.Popen([sys.executable, "-m", "engine_manager.testing.hub", "--dir", str(shards[0].parent),
                             "--port", "0", "--fault", "status:status=503,times=1,method=any"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("HF_ENDPOINT=http://127.0.0.1:"), line + proc.stderr.read()
        url = line.split("=", 1)[1]
        api = HfApi(endpoint=url, token=False)
        with httpx.Client() as c:   # the --fault answers the first file request with 503
            assert c.head(f"{url}/{REPO}/resolve/main/{shards[0].name}").status_code == 503
            assert c.head(f"{url}/{REPO}/resolve/main/{shards[0].name}").status_code == 302
        names = {s.rfilename for s in api.model_info(REPO).siblings}
        assert {s.name for s in shards} <= names
        assert json.loads((shards[0].parent / ".hub-sha256.json").read_text())
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        proc.stdout.close()
        proc.stderr.close()


# ------------------------------------------------------------------------------------------------ the boundary
FIXTURE_CONTRACT = '''
[importlinter]
root_packages =
    engine_manager
    app
include_external_packages = True

[importlinter:contract:fixtures-out-of-product]
name = the product never imports the test and demo fixtures (engine_manager.testing)
type = forbidden
source_modules =
    engine_manager
    app
forbidden_modules =
    engine_manager.testing
ignore_imports =
    engine_manager.testing.** -> engine_manager.testing.**
'''


def _lint_fixture_boundary(where: Path, config: Path) -> subprocess.CompletedProcess:
    lint = Path(sys.executable).parent / "lint-imports"
    if not lint.exists():
        from conftest import require_or_skip
        require_or_skip(f"{lint} is missing: install the lint extra (./scripts/test does)")
    config.write_text(FIXTURE_CONTRACT)
    return subprocess.run([str(lint), "--no-logo", "--no-cache", str(config)], cwd=where, capture_output=True,
                          text=True, timeout=180, stdin=subprocess.DEVNULL,
                          env={**os.environ, "PYTHONPATH": str(where)})


def test_the_hub_and_tinymoe_are_fixtures_the_product_never_imports(tmp_path):
    """engine_manager.testing (the local hub, the tiny MoE GGUF) is for tests and demos: import-linter checks that
    nothing in engine_manager or app reaches it, on the real tree, and that one such import on a copy is caught."""
    import shutil

    cp = _lint_fixture_boundary(ROOT, tmp_path / "fixtures.ini")
    assert cp.returncode == 0 and "KEPT" in cp.stdout, cp.stdout + cp.stderr
    copy = tmp_path / "tree"
    for pkg in ("engine_manager", "app"):
        shutil.copytree(ROOT / pkg, copy / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    with open(copy / "engine_manager" / "replica.py", "a") as f:
        f.write("\nfrom .testing.tinymoe import vocabulary  # noqa: E402,F401\n")
    cp = _lint_fixture_boundary(copy, tmp_path / "fixtures-copy.ini")
    assert cp.returncode != 0 and "BROKEN" in cp.stdout, cp.stdout + cp.stderr
    assert "engine_manager.replica -> engine_manager.testing.tinymoe" in cp.stdout, cp.stdout
    # the demo still runs from its new home
    out = subprocess.run([sys.executable, "-m", "engine_manager.testing.hub", "--help"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0 and "--demo DIR" in out.stdout
