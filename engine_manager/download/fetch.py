"""Fetching files: one resumable, checkpointed, hashed-as-it-arrives file per job, several jobs on worker
threads run as one generator of events."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import queue
import random
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generator

from ..atomic import OWNER_ONLY, ensure_private_dir
from ..cancel import Cancelled, CancelToken
from ..fmt import MIB
from .events import (
    BUF_BYTES,
    MAX_CORRUPT_RETRIES,
    SYNC_BYTES,
    DiskFullError,
    DownloadError,
    FileCorrupt,
    FileProgress,
    FileVerified,
    HubError,
    Paused,
    Progress,
    Resumed,
    Retrying,
    VerificationError,
)
from .http import (
    _abort_connection,
    _HTTPStatus,
    _hub_error,
    _ranged_get,
    _scrub,
)
from .store import (
    _boot_id,
    _disk_full,
    _fsync_dir,
    _pwrite_all,
    _record_verified,
    _write_state,
    free_bytes,
)


class _TooSlow(TimeoutError):
    """Bytes still arrive, but slower than ``min_speed_bps`` over a whole stall window: treated as a stall."""


class _Restart(Exception):
    """Internal: the partial file cannot be continued (the server ignored the Range, or the range is past the
    end); start the file over from byte 0."""


class _Hasher:
    """sha256 of a partial file computed on its own thread while the file is written.

    The writer offers each filled buffer (``offer``); when the hasher's pool has no free buffer the writer keeps
    its own and the hasher later reads those bytes back from the file (``_gap``). Starting at offset 0 with a
    kept prefix, the hasher reads the prefix from the file first, while the download goes on."""

    POOL = 4

    def __init__(self, part: Path, bufsize: int = BUF_BYTES):
        self.part = part
        self.h = hashlib.sha256()
        self.hashed = 0
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.pool: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(self.POOL):
            self.pool.put(bytearray(bufsize))
        self.spare = bytearray(bufsize)
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._rfd = os.open(part, os.O_RDONLY)
        self._gapbuf = bytearray(8 * MIB)
        self._thread = threading.Thread(target=self._run, name=f"sha256:{part.name}", daemon=True)
        self._thread.start()

    def buffer(self) -> tuple[bytearray, bool]:
        """A buffer to receive into and whether it is the hasher's (to be offered back)."""
        try:
            return self.pool.get_nowait(), True
        except queue.Empty:
            return self.spare, False

    def offer(self, offset: int, buf: bytearray, n: int) -> None:
        self.q.put((offset, buf, n))

    def finish(self, size: int, timeout: float | None = None) -> str:
        self.q.put(("end", size, 0))
        self._done.wait(timeout)
        self.close()
        if self.error is not None:
            raise self.error
        if self.hashed != size:
            raise VerificationError(f"{self.part.name}: hashed {self.hashed} of {size} bytes")
        return self.h.hexdigest()

    def close(self) -> None:
        self.q.put(None)
        self._thread.join(timeout=10)
        try:
            os.close(self._rfd)
        except OSError:
            pass

    def _gap(self, end: int) -> None:
        mv = memoryview(self._gapbuf)
        while self.hashed < end:
            n = os.preadv(self._rfd, [mv[:min(len(mv), end - self.hashed)]], self.hashed)
            if n <= 0:
                raise VerificationError(f"{self.part.name}: the partial file ended at {self.hashed} while hashing")
            self.h.update(mv[:n])
            self.hashed += n

    def _run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            off, buf, n = item
            try:
                if off == "end":
                    if self.error is None:
                        self._gap(buf)
                    self._done.set()
                    continue
                if self.error is None:
                    if off > self.hashed:
                        self._gap(off)
                    if off + n > self.hashed:
                        skip = self.hashed - off
                        self.h.update(memoryview(buf)[skip:n])
                        self.hashed = off + n
            except BaseException as exc:  # noqa: BLE001 - reported by finish()
                self.error = exc
            finally:
                if not isinstance(off, str):
                    self.pool.put(buf)


@dataclass
class _Job:
    name: str
    size: int
    sha256: str
    dest: Path
    state_dir: Path
    locate: Callable[[], tuple[str, dict[str, str]]]   # → (URL to GET, headers): re-run at every attempt
    pin: dict[str, Any] = field(default_factory=dict)  # written into the checkpoint; must match to resume
    max_corrupt_retries: int = MAX_CORRUPT_RETRIES
    # live figures, read by the generator's thread
    done: int = 0                    # bytes written to the partial file
    ckpt_at: int = 0                 # bytes covered by the last checkpoint
    synced: int = 0                  # bytes known to be on disk (fdatasync), for a resume after a reboot
    sync_thread: threading.Thread | None = None
    state: str = "queued"
    fetched: int = 0

    @property
    def part(self) -> Path:
        return self.state_dir / f"{self.name}.part"

    @property
    def ckpt(self) -> Path:
        return self.state_dir / f"{self.name}.part.json"

    def kept_offset(self) -> int:
        """Bytes of the partial file a resume can keep: the last checkpoint, if it belongs to this file."""
        try:
            c = json.loads(self.ckpt.read_text())
            size_on_disk = self.part.stat().st_size
        except (OSError, ValueError):
            return 0
        if c.get("sha256") != self.sha256 or c.get("size") != self.size or c.get("pin") != self.pin:
            return 0
        same_boot = c.get("boot_id") == _boot_id()
        keep = int(c.get("offset", 0)) if same_boot else int(c.get("synced", 0))
        return max(0, min(keep, size_on_disk, self.size))


class _Fetcher:
    def __init__(self, control: CancelToken, events: queue.SimpleQueue, *, token: str | None,
                 checkpoint_bytes: int, stall_timeout_s: float, min_speed_bps: float, max_tries: int,
                 backoff_s: tuple[float, ...]):
        self.control = control
        self.events = events
        self.token = token
        self.checkpoint_bytes = checkpoint_bytes
        self.stall_timeout_s = stall_timeout_s
        self.min_speed_bps = min_speed_bps
        self.max_tries = max_tries
        self.backoff_s = backoff_s
        self.sync_bytes = SYNC_BYTES
        self.remaining: Callable[[], int] | None = None    # bytes still to fetch, all jobs together

    def _disk_full_error(self, job: _Job) -> DiskFullError:
        left = self.remaining() if self.remaining is not None else job.size - job.ckpt_at
        where, free = free_bytes(job.state_dir)
        return DiskFullError(where, left - free)

    def _checkpoint(self, job: _Job, fd: int, offset: int, durable: bool = False) -> None:
        """Record that the partial file holds ``offset`` good bytes.

        A killed process loses nothing the kernel already has (the page cache outlives it), so the common
        checkpoint is only a small state file (temp + rename). A reboot can lose what was never written back: the
        state also says how far an ``fdatasync`` reached (``synced``, every ``sync_bytes`` on a side thread, and on
        pause/stop) and which boot wrote it; a resume after a reboot keeps only the synced part. (An
        ``fdatasync`` at every checkpoint cost 3.6× curl's time in benchmarks/download_speed.py.)"""
        if durable:
            os.fdatasync(fd)
            job.synced = max(job.synced, offset)
        _write_state(job.ckpt, {"schema": 2, "name": job.name, "size": job.size, "sha256": job.sha256,
                                "pin": job.pin, "offset": offset, "synced": job.synced, "boot_id": _boot_id(),
                                "t": time.time()}, durable)
        job.ckpt_at = offset

    def _sync_in_background(self, job: _Job, fd: int) -> None:
        """fdatasync the partial file on a side thread, then record the synced offset."""
        if job.sync_thread is not None and job.sync_thread.is_alive():
            return
        upto = job.done

        def work() -> None:
            try:
                os.fdatasync(fd)
            except OSError:
                return
            job.synced = max(job.synced, upto)

        job.sync_thread = threading.Thread(target=work, name=f"fdatasync:{job.name}", daemon=True)
        job.sync_thread.start()

    def _wait_if_paused(self, job: _Job) -> None:
        if self.control.cancelled:
            raise Cancelled()
        if self.control.paused:
            prev, job.state = job.state, "paused"
            while not self.control.wait_running(0.2):
                pass
            if self.control.cancelled:
                raise Cancelled()
            job.state = prev

    def run(self, job: _Job) -> None:
        """Fetch ``job`` into its partial file, verify, rename into place. Raises DownloadError or Cancelled; a full
        disk is :class:`DiskFullError` at once (never retried as if it were the network)."""
        try:
            self._run(job)
        except OSError as exc:
            if not _disk_full(exc):
                raise
            job.state = "failed"
            raise self._disk_full_error(job) from None

    def _run(self, job: _Job) -> None:
        ensure_private_dir(job.state_dir)
        corrupt = 0
        while True:
            offset = job.kept_offset()
            fd = os.open(job.part, os.O_RDWR | os.O_CREAT, OWNER_ONLY)
            digest = None
            try:
                os.fchmod(fd, OWNER_ONLY)    # a partial left by an older version may be 0644
                os.ftruncate(fd, offset)     # bytes after the last checkpoint are not trusted
                job.done = job.synced = offset
                hasher = _Hasher(job.part)
                try:
                    self._transfer(job, fd, offset, hasher)
                    job.state = "verifying"
                    digest = hasher.finish(job.size)
                except _Restart:
                    hasher.close()
                    job.ckpt.unlink(missing_ok=True)
                    os.ftruncate(fd, 0)
                    continue
                except BaseException:
                    hasher.close()
                    raise
                if digest == job.sha256:
                    os.fsync(fd)
                    break
            finally:
                if job.sync_thread is not None:
                    job.sync_thread.join()
                os.close(fd)
            corrupt += 1
            action = "fetching it again" if corrupt <= job.max_corrupt_retries else "giving up"
            self.events.put(FileCorrupt(job.name, job.sha256, digest or "?", action))
            job.part.unlink(missing_ok=True)
            job.ckpt.unlink(missing_ok=True)
            job.done = 0
            if corrupt > job.max_corrupt_retries:
                raise VerificationError(
                    f"{job.name} arrived {corrupt} times with the wrong sha256 (expected {job.sha256[:12]}…, got "
                    f"{(digest or '?')[:12]}…); the partial file was removed.",
                    "The server or a proxy on the way serves damaged data; try again later or from another network.")
        job.dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(job.part, job.dest)
        _fsync_dir(job.dest.parent)
        job.ckpt.unlink(missing_ok=True)
        _record_verified(job.dest, job.sha256)
        job.state = "verified"
        job.done = job.size
        self.events.put(FileVerified(job.name, job.dest, job.sha256, True))

    def _transfer(self, job: _Job, fd: int, offset: int, hasher: _Hasher) -> None:
        tries = 0
        job.done = job.ckpt_at = offset
        while job.done < job.size:
            offset = job.done
            self._wait_if_paused(job)
            job.state = "downloading"
            progress_at_start = offset
            conn = None
            unhook: list[Callable[[], None]] = []

            def opened(c: http.client.HTTPConnection, unhook: list[Callable[[], None]] = unhook) -> None:
                unhook.append(self.control.on_cancel(lambda: _abort_connection(c)))

            try:
                url, headers = job.locate()
                conn, resp, start = _ranged_get(url, headers, offset, self.stall_timeout_s, opened)
                if start != offset:
                    raise _Restart()     # the server ignored the Range: start over from byte 0
                length = resp.getheader("Content-Length")
                if length is not None and int(length) != job.size - offset:
                    raise VerificationError(f"{job.name}: the server offers {int(length) + offset:,} bytes, the "
                                        f"metadata says {job.size:,}.",
                                        "The file changed on the server; run the download again to re-resolve it.")
                paused = self._read_body(job, fd, resp, hasher)
                if job.done < job.size and not paused:
                    raise ConnectionError(f"the connection closed at byte {job.done:,} of {job.size:,}")
            except (Cancelled, _Restart):
                self._checkpoint(job, fd, job.done, durable=True)
                raise
            except _HTTPStatus as exc:
                if exc.status in (401, 403):
                    raise HubError(f"{job.name}: the server refused access (HTTP {exc.status}).",
                                   "Set HF_TOKEN (or the hf_token setting) to a token that can read the repository, "
                                   "and accept its terms on the hub if it is gated.") from None
                if exc.status == 404:
                    raise HubError(f"{job.name}: not found on the server (HTTP 404).",
                                   "Check DSV41_MODEL_REPO / DSV41_MODEL_REVISION, or the engine manifest's URL.") \
                        from None
                if exc.status == 416:    # our range lies past the end: the partial cannot be right
                    raise _Restart() from None
                tries = self._retry(job, tries, f"HTTP {exc.status} {exc.reason}".strip(),
                                    job.done > progress_at_start)
            except DownloadError:
                raise
            except Exception as exc:  # noqa: BLE001 - network trouble of any kind: retry with backoff
                if _disk_full(exc):          # the disk, not the network: nothing to retry
                    raise
                if self.control.cancelled:   # the cancel aborted the connection: a stop, not a network error
                    self._checkpoint(job, fd, job.done, durable=True)
                    raise Cancelled() from None
                from huggingface_hub.errors import HfHubHTTPError
                if isinstance(exc, HfHubHTTPError) and exc.response is not None and \
                        exc.response.status_code in (401, 403, 404):
                    raise _hub_error(exc, self.token) from None
                if isinstance(exc, _TooSlow):
                    reason = str(exc)
                elif isinstance(exc, (socket.timeout, TimeoutError)):
                    reason = f"no data for {self.stall_timeout_s:g} s (stalled)"
                else:
                    reason = _scrub(f"{type(exc).__name__}: {exc}", self.token)
                tries = self._retry(job, tries, reason, job.done > progress_at_start)
            finally:
                for u in unhook:
                    u()
                if conn is not None:
                    conn.close()
            if job.done > job.ckpt_at or job.synced < job.done:
                self._checkpoint(job, fd, job.done, durable=self.control.paused)

    def _retry(self, job: _Job, tries: int, reason: str, progressed: bool) -> int:
        tries = 1 if progressed else tries + 1
        if tries > self.max_tries:
            raise DownloadError(f"{job.name}: gave up after {tries - 1} tries without progress ({reason}).",
                                "Check the network (or HF_ENDPOINT / the proxy settings) and run the download "
                                "again: it resumes where it stopped.")
        delay = self.backoff_s[min(tries - 1, len(self.backoff_s) - 1)] * (0.8 + 0.4 * random.random())
        job.state = "retrying"
        self.events.put(Retrying(job.name, tries, delay, reason))
        if self.control.sleep(delay):
            raise Cancelled()
        return tries

    def _read_body(self, job: _Job, fd: int, resp: http.client.HTTPResponse, hasher: _Hasher) -> bool:
        """Read the body into the partial file from ``job.done`` (kept up to date after every write, so an
        exception leaves it right). Returns True when it stopped for a pause."""
        chunked = bool(getattr(resp, "chunked", False))
        raw = resp.fp                # the buffered socket: readinto1 returns what has arrived, up to the buffer
        window_t, window_bytes = time.monotonic(), 0
        control = self.control
        while job.done < job.size and raw is not None:
            offset = job.done
            buf, owned = hasher.buffer()
            mv = memoryview(buf)
            filled = 0
            flush_at = time.monotonic() + 0.25
            # never fill past the next checkpoint: what a kill can cost stays within one checkpoint
            want = min(len(buf), job.size - offset, max(1, job.ckpt_at + self.checkpoint_bytes - offset))
            try:
                while filled < want:
                    if chunked:          # rare for files; http.client undoes the chunk framing
                        data = resp.read1(want - filled)
                        n = len(data)
                        mv[filled:filled + n] = data
                    else:
                        n = raw.readinto1(mv[filled:want])
                    if not n:
                        break
                    filled += n
                    if control.cancelled or control.paused or time.monotonic() >= flush_at:
                        break
            finally:
                if filled:
                    try:
                        _pwrite_all(fd, mv[:filled], offset)
                    except BaseException:
                        if owned:
                            hasher.pool.put(buf)
                        raise
                    if owned:
                        hasher.offer(offset, buf, filled)
                    job.done = offset + filled
                    job.fetched += filled
                    window_bytes += filled
                elif owned:
                    hasher.pool.put(buf)
            if control.cancelled:
                raise Cancelled()        # (a cancel also shuts the socket down, so the read above returned at once)
            if not filled:
                break                # the server closed the connection
            if job.done - job.ckpt_at >= self.checkpoint_bytes:
                self._checkpoint(job, fd, job.done)
                if job.done - job.synced >= self.sync_bytes:
                    self._sync_in_background(job, fd)
            now = time.monotonic()
            if now - window_t >= self.stall_timeout_s:
                if window_bytes / (now - window_t) < self.min_speed_bps:
                    raise _TooSlow(f"{window_bytes / (now - window_t):,.0f} B/s over {now - window_t:.1f} s, "
                                   f"below {self.min_speed_bps:,.0f} B/s (stalled)")
                window_t, window_bytes = now, 0
            if control.cancelled:
                raise Cancelled()
            if control.paused:
                return True          # close the connection; the caller waits, then reconnects
        return False


class _Speed:
    """Bytes/s over a sliding window of a few seconds."""

    def __init__(self, window_s: float = 5.0):
        self.window_s = window_s
        self.samples: list[tuple[float, int]] = []

    def add(self, t: float, total: int) -> float | None:
        self.samples.append((t, total))
        while len(self.samples) > 2 and t - self.samples[0][0] > self.window_s:
            self.samples.pop(0)
        t0, b0 = self.samples[0]
        if t - t0 < 0.2:
            return None
        return max(0.0, (total - b0) / (t - t0))


def _run_jobs(jobs: list[_Job], present: list[FileProgress], *, control: CancelToken, n_workers: int,
              token: str | None, checkpoint_bytes: int, stall_timeout_s: float, min_speed_bps: float,
              max_tries: int, backoff_s: tuple[float, ...], progress_interval_s: float,
              target: Path) -> Generator[Any, None, int]:
    """Run ``jobs`` on ``n_workers`` threads; yield their events and a Progress snapshot now and then.
    Returns the bytes fetched. On cancel (or the generator being closed) the workers checkpoint and stop."""
    events: queue.SimpleQueue = queue.SimpleQueue()
    fetcher = _Fetcher(control, events, token=token, checkpoint_bytes=checkpoint_bytes,
                       stall_timeout_s=stall_timeout_s, min_speed_bps=min_speed_bps, max_tries=max_tries,
                       backoff_s=backoff_s)
    fetcher.remaining = lambda: sum(max(0, j.size - j.ckpt_at) for j in jobs if j.state != "verified")
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for j in jobs:
        todo.put(j)
    errors: list[BaseException] = []
    stop_all = threading.Event()

    def worker() -> None:
        while not stop_all.is_set():
            try:
                job = todo.get_nowait()
            except queue.Empty:
                return
            try:
                fetcher.run(job)
            except Cancelled:
                job.state = "paused" if not control.cancelled else "stopped"
                return
            except BaseException as exc:  # noqa: BLE001
                job.state = "failed"
                errors.append(exc)
                stop_all.set()
                control.cancel()
                return

    threads = [threading.Thread(target=worker, name=f"download-{i}", daemon=True)
               for i in range(max(1, min(n_workers, len(jobs))))]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    total_size = sum(j.size for j in jobs) + sum(p.size_bytes for p in present)
    speeds = {j.name: _Speed() for j in jobs}
    total_speed = _Speed()
    was_paused = False
    last = 0.0
    try:
        while True:
            alive = any(t.is_alive() for t in threads)
            try:
                ev = events.get(timeout=min(progress_interval_s, 0.1))
                yield ev
                continue
            except queue.Empty:
                pass
            if control.paused != was_paused:
                was_paused = control.paused
                yield Paused() if was_paused else Resumed()
            now = time.monotonic()
            if now - last >= progress_interval_s or not alive:
                last = now
                yield _snapshot(jobs, present, speeds, total_speed, now, t0, total_size)
            if not alive:
                while True:
                    try:
                        yield events.get_nowait()
                    except queue.Empty:
                        break
                break
    finally:
        if any(t.is_alive() for t in threads):    # closed from outside (Ctrl+C, GUI quit): stop cleanly
            control.cancel()
            for t in threads:
                t.join(timeout=30)
    if errors:
        raise errors[0]
    return sum(j.fetched for j in jobs)


def _snapshot(jobs, present, speeds, total_speed, now, t0, total_size) -> Progress:
    files = list(present)
    done_total = sum(p.done_bytes for p in present)
    for j in jobs:
        sp = speeds[j.name].add(now, j.fetched)
        active = j.state in ("downloading",)
        rem = j.size - j.done
        eta = rem / sp if (sp and active and rem > 0) else (0.0 if rem <= 0 else None)
        files.append(FileProgress(j.name, j.size, j.done, sp if active else 0.0 if j.state != "queued" else None,
                                  eta, j.state))
        done_total += j.done
    tsp = total_speed.add(now, sum(j.fetched for j in jobs))
    rem = total_size - done_total
    eta = rem / tsp if tsp else (0.0 if rem <= 0 else None)
    order = {n: i for i, n in enumerate(sorted(f.name for f in files))}
    files.sort(key=lambda f: order[f.name])
    return Progress(files, done_total, total_size, tsp, eta, now - t0)
