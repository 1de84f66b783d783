"""The engine log: follow it across the keeper's rotations, read its tail, and pick out one run's lines.

Opened without following symbolic links. Never imports Qt.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from typing import BinaryIO

from . import paths
from .atomic import read_bytes_nofollow

LOG_NAME = "engine.log"

RUN_MARK = re.compile(r"^\[dsv41 [^\]]*\] (?:run (?P<run>\S+): )?starting ")


def run_lines(lines: list[str], run_id: str | None) -> list[str]:
    """The lines of one run of the engine in the log: after its start line (``[dsv41 …] run ID: starting …``)
    and before the next run's. Without its start line in view (rotated away, or an older record without a run
    id): everything after the last start line that is not some other run's. Crash causes are read from these
    only, never from an earlier run's lines."""
    marks = [(i, m.group("run")) for i, ln in enumerate(lines) if (m := RUN_MARK.match(ln))]
    mine = [i for i, r in marks if run_id is not None and r == run_id]
    if mine:
        start = mine[-1] + 1
        later = [i for i, _ in marks if i >= start]
        return lines[start:later[0] if later else len(lines)]
    if run_id is not None and marks:             # ours rotated away: what comes before the next run is ours
        return lines[:marks[0][0]]
    return lines[marks[-1][0] + 1:] if marks else list(lines)



class LogTail:
    """Follow the engine log across the keeper's rotations (``engine.log`` → ``engine.log.1``)."""

    def __init__(self, path: Path, offset: int | None = None):
        self.path = Path(path)
        self._lock = threading.Lock()      # the owning generator and a stop() on another thread may both read
        self._f: BinaryIO | None = None
        self._ino: int | None = None
        self._buf = b""
        self._open(offset)

    def _open(self, offset: int | None) -> None:
        try:
            f = os.fdopen(os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb")
        except OSError:             # missing, or a symbolic link (never followed)
            self._f, self._ino = None, None
            return
        st = os.fstat(f.fileno())
        if offset is None:
            offset = st.st_size
        f.seek(min(offset, st.st_size))
        self._f, self._ino = f, st.st_ino

    def read(self) -> list[str]:
        with self._lock:
            return self._read()

    def _read(self) -> list[str]:
        data = b""
        if self._f is None:
            self._open(0)
            if self._f is None:
                return []
        data += self._f.read()
        try:
            ino = os.stat(self.path).st_ino
        except FileNotFoundError:
            ino = None
        if ino is not None and ino != self._ino:       # rotated: finish the old file, continue in the new one
            data += self._f.read()
            self._f.close()
            # the file we read became engine.log.K; engine.log.K-1 … .1 were written after it, in that order
            newer: list[Path] = []
            for k in range(1, 1000):
                rotated = self.path.with_name(f"{self.path.name}.{k}")
                try:
                    if os.stat(rotated).st_ino == self._ino:
                        break
                except FileNotFoundError:
                    newer = []                          # ours was deleted already: the gap cannot be read
                    break
                newer.insert(0, rotated)
            for rotated in newer:
                try:
                    data += read_bytes_nofollow(rotated)
                except OSError:
                    pass
            self._open(0)
            if self._f is not None:
                data += self._f.read()
        if not data:
            return []
        self._buf += data
        if b"\n" not in self._buf:
            return []
        *lines, self._buf = self._buf.split(b"\n")
        return [ln.decode("utf-8", "replace").rstrip("\r") for ln in lines]

    def close(self) -> None:
        with self._lock:
            if self._f is not None:
                self._f.close()
                self._f = None


def log_path() -> Path:
    """The engine log (the keeper rotates it to ``engine.log.1`` … beside it)."""
    return paths.logs_dir() / LOG_NAME


def read_log_tail(path: Path | None = None, max_bytes: int = 2_000_000) -> list[str]:
    """The last ``max_bytes`` of the log (the newest rotated file first if the current one is short)."""
    path = Path(path) if path else log_path()
    chunks: list[bytes] = []
    need = max_bytes
    for p in (path, path.with_name(path.name + ".1")):
        try:
            with os.fdopen(os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                f.seek(max(0, size - need))
                data = f.read()
        except OSError:             # missing, or a symbolic link (never followed)
            continue
        chunks.insert(0, data)
        need -= len(data)
        if need <= 0:
            break
    text = b"".join(chunks).decode("utf-8", "replace")
    lines = text.splitlines()
    if chunks and len(b"".join(chunks)) >= max_bytes and lines:
        lines = lines[1:]        # first line was cut
    return lines
