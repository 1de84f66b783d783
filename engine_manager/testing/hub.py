"""A local Hugging Face hub on 127.0.0.1, for tests and demos (``python -m engine_manager.testing.hub``).

It is a real HTTP server that answers the routes ``huggingface_hub`` 2.x calls, so ``HF_ENDPOINT`` can point at it
and the real library (``hf_hub_download``, ``snapshot_download``, ``HfApi.model_info``/``list_repo_tree``/
``get_paths_info``) works against it unchanged:

- ``GET /api/models/{repo}`` and ``GET /api/models/{repo}/revision/{rev}`` (``?blobs=true`` adds sizes and LFS
  sha256 to ``siblings``): the model info with the commit ``sha``.
- ``GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=…``: the file list (paginated with a ``Link`` header).
- ``POST /api/models/{repo}/paths-info/{rev}``: info for given paths, LFS sha256 included.
- ``HEAD/GET /{repo}/resolve/{rev}/{path}``: ``X-Repo-Commit``, ``ETag``, ``Content-Length``, ``Accept-Ranges``,
  and for LFS files ``X-Linked-Etag``/``X-Linked-Size`` with a 302 to a "CDN" URL on another host name
  (``localhost`` instead of ``127.0.0.1``), as the real hub does; ``Range`` gives 206 with ``Content-Range``.
- Errors carry ``X-Error-Code`` (``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``) as the hub's do.

Files come from disk (big sparse replica shards are served with ``os.sendfile``) or from bytes in memory.
Fault switches (``Fault``) make it the test double for a bad network: drop the connection at byte N, stall at
byte N, serve wrong bytes, answer a status code (404, 5xx, 429), or limit the rate. Each fault applies to files
whose path matches a glob, ``times`` times (``None``: until cleared). ``hub.stats()`` counts the body bytes
actually sent per file and logs every request (method, path, status, the file served, its ``Range`` header and the
body bytes that response sent; ``hub.requests()``), so tests can tell where a resumed download asked to continue
and how much it fetched again.

Admin routes (for a hub running in another process): ``POST /_hub/faults`` (JSON fault or list),
``DELETE /_hub/faults``, ``GET /_hub/stats``, ``POST /_hub/stats/reset``.
"""

from __future__ import annotations

import errno
import fnmatch
import hashlib
import http.server
import json
import os
import secrets
import select
import socket
import socketserver
import sys
import threading
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qs, quote, unquote, urlsplit

from ..hashing import sha256_file
from .demo import release_manifest, write_demo_release, write_demo_shards  # noqa: F401 - re-exported

SEND_CHUNK = 8 << 20          # bytes per sendfile()/send() call on the fast path
LFS_SUFFIXES = (".gguf", ".bin", ".safetensors", ".tar", ".gz", ".xz", ".zst", ".zip", ".pt", ".npz")
LFS_MIN_SIZE = 10 << 20


# ---------------------------------------------------------------------------------------------------------------
# content
# ---------------------------------------------------------------------------------------------------------------

def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


@dataclass
class HubFile:
    path: str
    size: int
    sha256: str
    lfs: bool
    source: Path | None = None
    data: bytes | None = None
    git_oid: str = ""
    pointer_size: int = 0

    def open_fd(self) -> int | None:
        return os.open(self.source, os.O_RDONLY) if self.source is not None else None

    def read(self, offset: int, n: int, fd: int | None) -> bytes:
        """``n`` bytes at ``offset``: from memory, or from ``fd`` (``open_fd()``) for a file on disk."""
        if self.data is not None:
            return self.data[offset:offset + n]
        if fd is None:
            raise ValueError(f"{self.path}: a file served from disk is read through its open_fd()")
        return os.pread(fd, n, offset)

    def tree_entry(self) -> dict[str, Any]:
        e: dict[str, Any] = {"type": "file", "oid": self.git_oid, "size": self.size, "path": self.path}
        if self.lfs:
            e["lfs"] = {"oid": self.sha256, "size": self.size, "pointerSize": self.pointer_size}
        return e

    def sibling(self, blobs: bool) -> dict[str, Any]:
        s: dict[str, Any] = {"rfilename": self.path}
        if blobs:
            s["size"] = self.size
            s["blobId"] = self.git_oid
            if self.lfs:
                s["lfs"] = {"size": self.size, "sha256": self.sha256, "pointerSize": self.pointer_size}
        return s


def make_file(path: str, source: Path | bytes, *, lfs: bool | None = None, sha256: str | None = None) -> HubFile:
    content = bytes(source) if isinstance(source, (bytes, bytearray)) else Path(source)
    if isinstance(content, bytes):
        data, src = content, None
        size = len(content)
        sha = sha256 or hashlib.sha256(content).hexdigest()
    else:
        data, src = None, content
        size = content.stat().st_size
        sha = sha256 or sha256_file(content)
    if lfs is None:
        lfs = path.lower().endswith(LFS_SUFFIXES) or size >= LFS_MIN_SIZE
    if lfs:
        pointer = lfs_pointer(sha, size)
        oid, psize = git_blob_oid(pointer), len(pointer)
    else:
        oid, psize = git_blob_oid(content if isinstance(content, bytes) else content.read_bytes()), 0
    return HubFile(path=path, size=size, sha256=sha, lfs=lfs, source=src, data=data, git_oid=oid, pointer_size=psize)


class HubRepo:
    """A model repository: commits (sha → files) and refs (branch → sha). ``add_file`` writes into the head
    commit of ``main``; ``new_commit()`` starts a new head (a copy of the old one) so earlier commits stay
    resolvable with their own content."""

    def __init__(self, repo_id: str, private: bool = False):
        self.repo_id = repo_id
        self.private = private
        sha = secrets.token_hex(20)
        self.commits: dict[str, dict[str, HubFile]] = {sha: {}}
        self.refs: dict[str, str] = {"main": sha}
        self.created = datetime.now(timezone.utc)

    @property
    def head(self) -> str:
        return self.refs["main"]

    def add_file(self, path: str, source: Path | bytes, *, lfs: bool | None = None,
                 sha256: str | None = None) -> HubFile:
        f = make_file(path, source, lfs=lfs, sha256=sha256)
        self.commits[self.head][path] = f
        return f

    def remove_file(self, path: str) -> None:
        self.commits[self.head].pop(path, None)

    def new_commit(self) -> str:
        sha = secrets.token_hex(20)
        self.commits[sha] = dict(self.commits[self.head])
        self.refs["main"] = sha
        return sha

    def drop_commit(self, sha: str) -> None:
        """Forget commit ``sha`` (as a force-push that rewrote history does): it no longer resolves. The branch
        that pointed at it moves to another commit, a new one if there is none."""
        self.commits.pop(sha, None)
        if not self.commits:
            self.commits[secrets.token_hex(20)] = {}
        for ref, target in list(self.refs.items()):
            if target == sha:
                self.refs[ref] = next(iter(self.commits))

    def resolve(self, revision: str) -> str | None:
        if revision in self.refs:
            return self.refs[revision]
        if revision in self.commits:
            return revision
        return None

    def files(self, sha: str) -> dict[str, HubFile]:
        return self.commits[sha]


# ---------------------------------------------------------------------------------------------------------------
# faults
# ---------------------------------------------------------------------------------------------------------------

FAULT_KINDS = ("drop", "stall", "corrupt", "status", "slow")


@dataclass
class Fault:
    """One fault switch.

    kind: ``drop`` (close the connection once the body reaches byte ``at`` of the file), ``stall`` (stop sending
    at byte ``at`` for ``seconds``; the connection stays open), ``corrupt`` (bytes ``[at, at+length)`` of the file
    are served flipped), ``status`` (answer ``status`` instead, for ``method`` GET/HEAD/any), ``slow`` (limit
    the body to ``rate_bps`` bytes/s). ``path`` is a glob on the file's path (or its base name). ``times``: how
    many responses it hits (``None``: all, until cleared)."""

    kind: str
    path: str = "*"
    at: int = 0
    times: int | None = 1
    status: int = 500
    seconds: float = 3600.0
    length: int = 1
    rate_bps: float = 0.0
    method: str = "GET"
    hits: int = 0

    def __post_init__(self):
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; one of {', '.join(FAULT_KINDS)}")

    def matches(self, path: str) -> bool:
        return fnmatch.fnmatchcase(path, self.path) or fnmatch.fnmatchcase(path.rsplit("/", 1)[-1], self.path)

    @property
    def live(self) -> bool:
        return self.times is None or self.hits < self.times

    @classmethod
    def parse(cls, spec: str) -> "Fault":
        """``drop:at=1048576,path=*00002*,times=1`` → Fault."""
        kind, _, rest = spec.partition(":")
        kw: dict[str, Any] = {}
        for part in filter(None, rest.split(",")):
            k, _, v = part.partition("=")
            k = k.strip()
            if k in ("at", "status", "length"):
                kw[k] = int(v)
            elif k in ("seconds", "rate_bps"):
                kw[k] = float(v)
            elif k == "times":
                kw[k] = None if v in ("", "inf", "none", "None") else int(v)
            else:
                kw[k] = v
        return cls(kind=kind.strip(), **kw)


# ---------------------------------------------------------------------------------------------------------------
# the server
# ---------------------------------------------------------------------------------------------------------------

def _iso(dt: datetime) -> str:
    return dt.strftime("%Y-%m-%dT%H:%M:%S.000Z")


def parse_range(header: str | None, size: int) -> tuple[int, int] | None | Literal["invalid"]:
    """``bytes=a-b`` → (a, b+1). None: no (usable) range. "invalid": unsatisfiable (416)."""
    if not header or not header.strip().lower().startswith("bytes="):
        return None
    spec = header.split("=", 1)[1].strip()
    if "," in spec:
        return None  # multiple ranges: serve the whole file, as many servers do
    first, _, last = spec.partition("-")
    try:
        if first == "":
            n = int(last)
            if n <= 0:
                return "invalid"
            return (max(0, size - n), size)
        a = int(first)
        b = int(last) + 1 if last else size
    except ValueError:
        return None
    if a >= size or a < 0:
        return "invalid"
    return (a, min(b, size))


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, addr, handler, hub: "LocalHub"):
        self.hub = hub
        super().__init__(addr, handler)

    def handle_error(self, request, client_address):
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, socket.timeout, TimeoutError, OSError)):
            return          # a client that went away (the faults make many): not worth a traceback
        super().handle_error(request, client_address)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "dsv41-localhub/1"
    server: _Server

    def log_message(self, format, *args):  # noqa: A002 - BaseHTTPRequestHandler's name
        pass  # the hub records requests in stats (of their headers only Range, never Authorization)

    def setup(self):
        super().setup()
        self.connection.settimeout(60)
        self.server.hub._track(self.connection, True)

    def finish(self):
        try:
            super().finish()
        finally:
            self.server.hub._track(self.connection, False)

    # -- helpers ------------------------------------------------------------------------------------------------
    @property
    def hub(self) -> "LocalHub":
        return self.server.hub

    def _json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self.hub._record(self.command, self.path, status, self.headers.get("Range"))

    def _error(self, status: int, code: str | None, message: str) -> None:
        headers = {"X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        self._json(status, {"error": message}, headers)

    def _authorized(self, repo: HubRepo | None) -> bool:
        token = self.hub.token
        if not token:
            return True
        got = self.headers.get("Authorization", "")
        return got == f"Bearer {token}"

    def _repo_or_error(self, repo_id: str) -> HubRepo | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None or not self._authorized(repo):
            self._error(401, "RepoNotFound",
                        "Repository Not Found for url. Please make sure you specified the correct `repo_id` and "
                        "`repo_type`. If you are trying to access a private or gated repo, make sure you are "
                        "authenticated.")
            return None
        return repo

    def _sha_or_error(self, repo: HubRepo, rev: str) -> str | None:
        sha = repo.resolve(rev)
        if sha is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return sha

    # -- verbs --------------------------------------------------------------------------------------------------
    def do_HEAD(self):  # noqa: N802
        self._dispatch()

    def do_GET(self):  # noqa: N802
        self._dispatch()

    def do_POST(self):  # noqa: N802
        self._dispatch()

    def do_DELETE(self):  # noqa: N802
        self._dispatch()

    def _dispatch(self) -> None:
        try:
            self._route()
        except (BrokenPipeError, ConnectionResetError, socket.timeout, TimeoutError):
            self.close_connection = True

    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _route(self) -> None:
        parts = urlsplit(self.path)
        path = parts.path
        query = parse_qs(parts.query)
        hub = self.hub
        if path.startswith("/_hub/"):
            return self._admin(path, query)
        if path.startswith("/_cdn/"):
            seg = path[len("/_cdn/"):].split("/", 1)
            f = hub._by_sha.get(seg[0])
            if f is None:
                return self._error(404, "EntryNotFound", "no such object")
            return self._serve(f, {"ETag": f'"{f.sha256}"'})
        if unquote(path) in hub.raw:
            f = hub.raw[unquote(path)]
            return self._serve(f, {"ETag": f'"{f.sha256}"'})
        if path.startswith("/api/models/"):
            return self._api(path[len("/api/models/"):], query)
        if "/resolve/" in path:
            return self._resolve(path)
        self._error(404, None, f"no route for {path}")

    def _admin(self, path: str, query: dict) -> None:
        hub = self.hub
        if path == "/_hub/faults" and self.command == "POST":
            spec = json.loads(self._body() or b"[]")
            for d in spec if isinstance(spec, list) else [spec]:
                hub.add_fault(Fault(**d))
            return self._json(200, {"faults": [asdict(f) for f in hub.faults]})
        if path == "/_hub/faults" and self.command == "DELETE":
            hub.clear_faults()
            return self._json(200, {"faults": []})
        if path == "/_hub/stats":
            return self._json(200, hub.stats())
        if path == "/_hub/stats/reset" and self.command == "POST":
            hub.reset_stats()
            return self._json(200, hub.stats())
        self._error(404, None, "unknown admin route")

    def _api(self, rest: str, query: dict) -> None:
        segs = [unquote(s) for s in rest.split("/")]
        if len(segs) < 2:
            return self._error(404, None, "bad repo id")
        repo_id = f"{segs[0]}/{segs[1]}"
        tail = segs[2:]
        repo = self._repo_or_error(repo_id)
        if repo is None:
            return
        if self.command in ("GET", "HEAD") and (not tail or tail[0] == "revision"):
            rev = tail[1] if len(tail) >= 2 else "main"
            sha = self._sha_or_error(repo, rev)
            if sha is None:
                return
            blobs = query.get("blobs", ["false"])[0].lower() in ("1", "true")
            return self._json(200, self.hub._model_info(repo, sha, blobs))
        if tail and tail[0] == "tree" and self.command == "GET":
            if len(tail) < 2:
                return self._error(404, "RevisionNotFound", "no revision")
            sha = self._sha_or_error(repo, tail[1])
            if sha is None:
                return
            sub = "/".join(tail[2:]).strip("/")
            recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
            entries = self.hub._tree(repo, sha, sub, recursive)
            if entries is None:
                return self._error(404, "EntryNotFound", f"{sub} does not exist on {tail[1]}")
            cursor = int(query.get("cursor", ["0"])[0])
            page = entries[cursor:cursor + self.hub.page_size]
            headers = {}
            if cursor + self.hub.page_size < len(entries):
                q = f"recursive={str(recursive).lower()}&cursor={cursor + self.hub.page_size}"
                headers["Link"] = f'<{self.hub.url}{urlsplit(self.path).path}?{q}>; rel="next"'
            return self._json(200, page, headers)
        if tail and tail[0] == "paths-info" and self.command == "POST":
            if len(tail) < 2:
                return self._error(404, "RevisionNotFound", "no revision")
            sha = self._sha_or_error(repo, tail[1])
            if sha is None:
                return
            raw = self._body()
            ctype = self.headers.get("Content-Type", "")
            if "json" in ctype:
                wanted = json.loads(raw or b"{}").get("paths", [])
            else:
                wanted = parse_qs(raw.decode()).get("paths", [])
            wanted = [wanted] if isinstance(wanted, str) else wanted
            files = repo.files(sha)
            out = []
            for p in wanted:
                p = p.strip("/")
                if p in files:
                    out.append(files[p].tree_entry())
                elif any(k.startswith(p + "/") for k in files):
                    out.append({"type": "directory", "oid": hashlib.sha1(p.encode()).hexdigest(), "size": 0,
                                "path": p})
            return self._json(200, out)
        self._error(404, None, "unknown api route")

    def _resolve(self, path: str) -> None:
        head, _, rest = path.lstrip("/").partition("/resolve/")
        repo_id = unquote(head)
        rev_q, _, file_q = rest.partition("/")
        rev, fname = unquote(rev_q), unquote(file_q)
        repo = self._repo_or_error(repo_id)
        if repo is None:
            return
        sha = self._sha_or_error(repo, rev)
        if sha is None:
            return
        f = repo.files(sha).get(fname)
        if f is None:
            return self._error(404, "EntryNotFound", f"{fname} does not exist on {rev}")
        headers = {"X-Repo-Commit": sha, "Access-Control-Expose-Headers": "X-Repo-Commit, ETag, X-Linked-Size"}
        if f.lfs:
            headers["X-Linked-Size"] = str(f.size)
            headers["X-Linked-Etag"] = f'"{f.sha256}"'
        if f.lfs and self.hub.redirect_lfs:
            status = self.hub._status_fault(f.path, self.command)
            if status:
                return self._error(status, None, f"fault: status {status}")
            host = self.hub.cdn_host
            loc = (f"http://{host}:{self.hub.port}/_cdn/{f.sha256}/{quote(fname.rsplit('/', 1)[-1])}"
                   f"?X-Amz-Expires=3600&X-Amz-Signature={secrets.token_hex(8)}")
            self.send_response(302)
            headers["ETag"] = f'"{f.git_oid}"'
            headers["Location"] = loc
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", "0")
            self.end_headers()
            self.hub._record(self.command, self.path, 302, self.headers.get("Range"), f.path)
            return
        headers["ETag"] = f'"{f.sha256}"' if f.lfs else f'"{f.git_oid}"'
        self._serve(f, headers)

    # -- file bodies --------------------------------------------------------------------------------------------
    def _serve(self, f: HubFile, headers: dict[str, str]) -> None:
        hub = self.hub
        status = hub._status_fault(f.path, self.command)
        if status:
            return self._error(status, None, f"fault: status {status}")
        rng = parse_range(self.headers.get("Range"), f.size)
        if rng == "invalid":
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{f.size}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            hub._record(self.command, self.path, 416, self.headers.get("Range"), f.path)
            return
        start, end = (0, f.size) if rng is None else rng
        code = 200 if rng is None else 206
        self.send_response(code)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start))
        if code == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{f.size}")
        self.end_headers()
        rec = hub._record(self.command, self.path, code, self.headers.get("Range"), f.path)
        if self.command == "HEAD" or end <= start:
            return
        self.wfile.flush()
        self._send_body(f, start, end, rec)

    def _send_body(self, f: HubFile, start: int, end: int, rec: dict[str, Any] | None = None) -> None:
        hub = self.hub
        faults = hub._body_faults(f.path, start, end)
        drop = next((x for x in faults if x.kind == "drop"), None)
        stall = next((x for x in faults if x.kind == "stall"), None)
        corrupt = [x for x in faults if x.kind == "corrupt"]
        slow = next((x for x in faults if x.kind == "slow"), None)
        stops = sorted({x.at for x in (drop, stall) if x is not None})
        sock = self.connection
        fd = f.open_fd()
        try:
            pos = start
            t0 = time.monotonic()
            sent_since = 0
            while pos < end:
                if stall is not None and pos == stall.at:
                    seconds, stall = stall.seconds, None
                    if self._stall(seconds):
                        self.close_connection = True
                        return          # the client gave up (or the hub stops): send nothing more
                if drop is not None and pos == drop.at:
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    self.close_connection = True
                    return
                limit = end
                for s in stops:
                    if s > pos:
                        limit = min(limit, s)
                        break
                n = min(limit - pos, SEND_CHUNK)
                if slow is not None and slow.rate_bps > 0:
                    n = min(n, max(1, int(slow.rate_bps * 0.05)))
                bad = [c for c in corrupt if c.at < pos + n and c.at + c.length > pos]
                if bad or fd is None or slow is not None:
                    data = bytearray(f.read(pos, n, fd))
                    for c in bad:
                        a = max(c.at, pos) - pos
                        b = min(c.at + c.length, pos + n) - pos
                        for i in range(a, b):
                            data[i] ^= 0xFF
                    # send(), not sendall(): each part the kernel takes is counted, so a client killed halfway
                    # through a piece leaves the count exact (tests compare it with what the client kept)
                    mv, sent = memoryview(data), 0
                    while sent < len(mv):
                        k = sock.send(mv[sent:])
                        sent += k
                        hub._count(f.path, k, rec)
                else:
                    sent = self._sendfile(sock, fd, pos, n)
                    hub._count(f.path, sent, rec)
                pos += sent
                if slow is not None and slow.rate_bps > 0:
                    sent_since += sent
                    ahead = sent_since / slow.rate_bps - (time.monotonic() - t0)
                    if ahead > 0:
                        if hub._stop.wait(ahead):
                            return
        finally:
            if fd is not None:
                os.close(fd)

    def _sendfile(self, sock: socket.socket, fd: int, offset: int, count: int) -> int:
        out = sock.fileno()
        timeout = sock.gettimeout()
        while True:
            try:
                n = os.sendfile(out, fd, offset, count)
                if n == 0:
                    raise BrokenPipeError("file ended early")
                return n
            except BlockingIOError:
                _, w, _ = select.select([], [out], [], timeout)
                if not w:
                    raise socket.timeout("client stopped reading") from None
            except OSError as exc:
                if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                    continue
                raise

    def _stall(self, seconds: float) -> bool:
        """Send nothing for ``seconds``; True if the client closed (or the hub stops) meanwhile."""
        deadline = time.monotonic() + seconds
        sock = self.connection
        while time.monotonic() < deadline:
            if self.hub._stop.is_set():
                return True
            r, _, _ = select.select([sock], [], [], 0.1)
            if r:
                try:
                    if not sock.recv(1, socket.MSG_PEEK):
                        return True
                except OSError:
                    return True
        return False


class LocalHub:
    """The hub: ``with LocalHub() as hub: hub.repo("a/b").add_file(...); os.environ["HF_ENDPOINT"] = hub.url``."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, token: str | None = None,
                 redirect_lfs: bool = True, cdn_host: str = "localhost", page_size: int = 1000):
        self.host = host
        self.token = token
        self.redirect_lfs = redirect_lfs
        self.cdn_host = cdn_host
        self.page_size = page_size
        self.repos: dict[str, HubRepo] = {}
        self.raw: dict[str, HubFile] = {}
        self.faults: list[Fault] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._bytes: dict[str, int] = {}
        self._requests: list[dict[str, Any]] = []
        self._conns: set[socket.socket] = set()
        self._server = _Server((host, port), _Handler, self)
        self.port = self._server.server_address[1]
        self._thread: threading.Thread | None = None

    # -- life -----------------------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "LocalHub":
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="localhub", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._server.serve_forever(poll_interval=0.2)

    def stop(self) -> None:
        self._stop.set()
        self._server.shutdown()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> "LocalHub":
        return self.start() if self._thread is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _track(self, conn: socket.socket, add: bool) -> None:
        with self._lock:
            (self._conns.add if add else self._conns.discard)(conn)

    def open_connections(self) -> int:
        """Client connections open now. Once a killed client's count reaches 0, every byte the hub sent it has
        been counted (a handler ends only after its last send)."""
        with self._lock:
            return len(self._conns)

    # -- content --------------------------------------------------------------------------------------------------
    def repo(self, repo_id: str, *, private: bool = False) -> HubRepo:
        if repo_id not in self.repos:
            self.repos[repo_id] = HubRepo(repo_id, private=private)
        return self.repos[repo_id]

    def add_raw(self, url_path: str, source: Path | bytes) -> HubFile:
        """Serve ``source`` at ``url_path`` (e.g. a release asset path); returns its entry (size, sha256)."""
        url_path = "/" + url_path.lstrip("/")
        f = make_file(url_path.lstrip("/"), source, lfs=False)
        self.raw[url_path] = f
        return f

    def raw_url(self, url_path: str) -> str:
        return self.url + "/" + url_path.lstrip("/")

    @property
    def _by_sha(self) -> dict[str, HubFile]:
        out: dict[str, HubFile] = {}
        for repo in self.repos.values():
            for files in repo.commits.values():
                for f in files.values():
                    if f.lfs:
                        out[f.sha256] = f
        return out

    def _model_info(self, repo: HubRepo, sha: str, blobs: bool) -> dict[str, Any]:
        files = repo.files(sha)
        ns, _, name = repo.repo_id.partition("/")
        info: dict[str, Any] = {
            "_id": hashlib.md5(repo.repo_id.encode()).hexdigest()[:24],
            "id": repo.repo_id, "modelId": repo.repo_id, "author": ns, "sha": sha,
            "lastModified": _iso(datetime.now(timezone.utc)), "createdAt": _iso(repo.created),
            "private": repo.private, "gated": False, "disabled": False, "downloads": 0, "likes": 0,
            "library_name": "gguf", "tags": ["gguf"],
            "siblings": [f.sibling(blobs) for f in sorted(files.values(), key=lambda x: x.path)],
        }
        if blobs:
            info["usedStorage"] = sum(f.size for f in files.values())
        return info

    def _tree(self, repo: HubRepo, sha: str, sub: str, recursive: bool) -> list[dict[str, Any]] | None:
        files = repo.files(sha)
        prefix = sub + "/" if sub else ""
        if sub and sub in files:
            return [files[sub].tree_entry()]
        paths = sorted(p for p in files if p.startswith(prefix))
        if sub and not paths:
            return None
        out: list[dict[str, Any]] = []
        dirs: set[str] = set()
        for p in paths:
            rel = p[len(prefix):]
            parts = rel.split("/")
            for i in range(1, len(parts)):
                d = prefix + "/".join(parts[:i])
                if d not in dirs and (recursive or i == 1):
                    dirs.add(d)
                    out.append({"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0,
                                "path": d})
            if recursive or len(parts) == 1:
                out.append(files[p].tree_entry())
        return out

    # -- faults ---------------------------------------------------------------------------------------------------
    def add_fault(self, fault: Fault | None = None, **kw: Any) -> Fault:
        fault = fault or Fault(**kw)
        with self._lock:
            self.faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        with self._lock:
            self.faults.clear()

    def _status_fault(self, path: str, method: str) -> int | None:
        with self._lock:
            for f in self.faults:
                if f.kind == "status" and f.live and f.matches(path) and f.method in (method, "any", "ANY"):
                    f.hits += 1
                    return f.status
        return None

    def _body_faults(self, path: str, start: int, end: int) -> list[Fault]:
        out = []
        with self._lock:
            for f in self.faults:
                if not (f.live and f.matches(path)) or f.kind == "status":
                    continue
                if f.kind == "slow" or (f.kind in ("drop", "stall") and start <= f.at < end) or \
                        (f.kind == "corrupt" and f.at < end and f.at + f.length > start):
                    f.hits += 1
                    out.append(f)
        return out

    # -- stats ----------------------------------------------------------------------------------------------------
    def _count(self, path: str, n: int, rec: dict[str, Any] | None = None) -> None:
        with self._lock:
            self._bytes[path] = self._bytes.get(path, 0) + n
            if rec is not None:
                rec["sent"] += n

    def _record(self, method: str, path: str, status: int, rng: str | None, file: str | None = None
                ) -> dict[str, Any]:
        rec = {"method": method, "path": urlsplit(path).path, "status": status, "range": rng, "file": file,
               "sent": 0, "t": time.time()}
        with self._lock:
            self._requests.append(rec)
        return rec

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"bytes_sent": dict(self._bytes), "requests": [dict(r) for r in self._requests]}

    def requests(self, file: str | None = None, method: str | None = None) -> list[dict[str, Any]]:
        """The request log, oldest first (copies): each request's method, path, status, ``range`` (its Range
        header or None), ``file`` (the file served, None for API routes) and ``sent`` (body bytes sent so far).
        ``file`` filters by path or base name, as ``bytes_sent`` does."""
        with self._lock:
            out = [dict(r) for r in self._requests]
        if file is not None:
            out = [r for r in out if r["file"] and (r["file"] == file or r["file"].rsplit("/", 1)[-1] == file)]
        if method is not None:
            out = [r for r in out if r["method"] == method]
        return out

    def bytes_sent(self, path: str | None = None) -> int:
        with self._lock:
            if path is None:
                return sum(self._bytes.values())
            return sum(v for k, v in self._bytes.items() if k == path or k.rsplit("/", 1)[-1] == path)

    def reset_stats(self) -> None:
        with self._lock:
            self._bytes.clear()
            self._requests.clear()


def main(argv: list[str] | None = None) -> int:
    """``python -m engine_manager.testing.hub`` (the command line and the demo: :mod:`.demo`)."""
    from .demo import main as demo_main

    return demo_main(argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
