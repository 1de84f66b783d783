"""Recording every run's samples to disk, reading them back, and exporting CSV.

A run is a folder ``runs_dir()/metrics/<YYYYmmdd-HHMMSS>-<engine>/`` with

- ``run.json`` — what was recorded (engine, pid, simulated, binding, rate, predicted hit rate, started/ended),
  written atomically (0600);
- ``metrics.csv`` — one line per tick, appended and flushed every tick (≤ 10 Hz): a kill of the panel loses at
  most the line being written, and the reader skips a torn last line. The file is fsynced every
  ``FSYNC_EVERY_S`` seconds so a power cut loses at most that much.

CSV columns: ``t`` (epoch seconds), ``time`` (UTC ISO 8601), then every column of
:data:`engine_manager.metrics.columns.COLUMN_NAMES` in order. An empty cell is *missing*. Integers (bytes,
counters) are written exactly; rates with 6 significant digits.

Old runs are pruned when a new one starts: the newest ``KEEP_RUNS`` are kept and at most ``KEEP_BYTES`` in all.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from .. import paths
from ..atomic import atomic_write_json, atomic_write_text, ensure_private_dir
from .columns import COLUMN_NAMES
from .store import RingStore

CSV_NAME = "metrics.csv"
META_NAME = "run.json"
FSYNC_EVERY_S = 10.0
KEEP_RUNS = 50
KEEP_BYTES = 2 * 1024**3


def metrics_runs_dir() -> Path:
    return paths.runs_dir() / "metrics"


def _fmt(v: float | int | None) -> str:
    if v is None:
        return ""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return ""
    if not math.isfinite(f):
        return ""
    if f.is_integer() and abs(f) < 1e15:
        return str(int(f))
    return format(f, ".6g")


def fmt_t(t: float) -> str:
    """Epoch seconds with milliseconds: ``1796001392.075``."""
    return f"{t:.3f}"


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass
class RunInfo:
    path: Path
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def csv_path(self) -> Path:
        return self.path / CSV_NAME

    @property
    def started(self) -> float:
        return float(self.meta.get("started_at") or 0.0)


class Recorder:
    """Appends ticks to one run's CSV. Not thread-safe by itself: the hub calls it from its one loop thread."""

    def __init__(self, run_dir: Path, columns: Sequence[str] = COLUMN_NAMES, meta: Mapping[str, Any] | None = None):
        self.dir = ensure_private_dir(Path(run_dir))
        self.columns = tuple(columns)
        self.csv_path = self.dir / CSV_NAME
        self.meta_path = self.dir / META_NAME
        self.meta: dict[str, Any] = dict(meta or {})
        self.meta.setdefault("started_at", time.time())
        self.meta["columns"] = len(self.columns)
        self.meta["schema"] = 1
        self.meta["kind"] = "dsv41-metrics"
        new = not self.csv_path.exists() or self.csv_path.stat().st_size == 0
        if not new:
            self._check_header()
        fd = os.open(self.csv_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._f = os.fdopen(fd, "a", encoding="utf-8", newline="")
        if new:
            self._f.write(",".join(("t", "time", *self.columns)) + "\n")
        else:
            self._heal_torn_tail()
        self._f.flush()
        self._last_fsync = time.monotonic()
        self.rows = 0
        self.write_meta()

    def _check_header(self) -> None:
        with open(self.csv_path, encoding="utf-8", newline="") as f:
            header = f.readline().strip().split(",")
        if header != ["t", "time", *self.columns]:
            raise ValueError(f"{self.csv_path} was written with other columns; start a new run instead")

    def _heal_torn_tail(self) -> None:
        """A kill mid-line leaves a line without its newline; end it so the next row starts clean (the reader
        drops the torn line because its cell count is wrong)."""
        with open(self.csv_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                return
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
        if last != b"\n":
            self._f.write("\n")

    def write_meta(self, **updates: Any) -> None:
        self.meta.update(updates)
        atomic_write_json(self.meta_path, self.meta)

    def write(self, t: float, values: Mapping[str, float | int | None]) -> None:
        line = ",".join((fmt_t(t), iso(t), *(_fmt(values.get(c)) for c in self.columns)))
        self._f.write(line + "\n")
        self._f.flush()
        self.rows += 1
        now = time.monotonic()
        if now - self._last_fsync >= FSYNC_EVERY_S:
            os.fsync(self._f.fileno())
            self._last_fsync = now

    def close(self, **meta_updates: Any) -> None:
        if self._f.closed:
            return
        try:
            self._f.flush()
            os.fsync(self._f.fileno())
        finally:
            self._f.close()
        self.write_meta(ended_at=time.time(), rows_written=self.rows, **meta_updates)


def new_run_dir(engine: str, when: float | None = None) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(when or time.time()))
    base = metrics_runs_dir()
    d = base / f"{stamp}-{engine}"
    n = 1
    while d.exists():
        d = base / f"{stamp}-{engine}-{n}"
        n += 1
    return d


def open_run(engine: str, meta: Mapping[str, Any], resume_pid: int | None = None,
             columns: Sequence[str] = COLUMN_NAMES) -> Recorder:
    """A recorder for this engine. With ``resume_pid``, a recent run of the very same engine process (same pid
    and process start time: a panel restarted against a running engine, or a rate change) is continued;
    otherwise a new run starts and old runs are pruned."""
    if resume_pid is not None:
        for run in list_runs()[:5]:
            m = run.meta
            if (m.get("engine") == engine and m.get("pid") == resume_pid
                    and meta.get("pid_create_time") is not None
                    and m.get("pid_create_time") == meta.get("pid_create_time")
                    and m.get("boot_id") == meta.get("boot_id")):
                try:
                    return Recorder(run.path, columns, {**m, **meta, "started_at": m.get("started_at"),
                                                        "ended_at": None, "resumed_at": time.time()})
                except (OSError, ValueError):
                    break
    prune_runs()
    return Recorder(new_run_dir(engine), columns, meta)


def list_runs() -> list[RunInfo]:
    """Recorded runs, newest first."""
    base = metrics_runs_dir()
    out: list[RunInfo] = []
    if not base.is_dir():
        return out
    for d in base.iterdir():
        if not d.is_dir() or not (d / CSV_NAME).exists():
            continue
        try:
            meta = json.loads((d / META_NAME).read_text())
            if not isinstance(meta, dict) or meta.get("kind") != "dsv41-metrics":
                continue
        except (OSError, ValueError):
            continue
        out.append(RunInfo(d, meta))
    out.sort(key=lambda r: (r.started, r.path.name), reverse=True)
    return out


def prune_runs(keep: int = KEEP_RUNS, keep_bytes: int = KEEP_BYTES) -> list[Path]:
    """Delete the oldest recorded runs beyond ``keep`` runs or ``keep_bytes`` in all. Only folders this module
    wrote (``run.json`` kind ``dsv41-metrics``) are touched."""
    removed: list[Path] = []
    total = 0
    for i, run in enumerate(list_runs()):
        size = sum(p.stat().st_size for p in run.path.iterdir() if p.is_file())
        total += size
        if i >= keep or total > keep_bytes:
            shutil.rmtree(run.path, ignore_errors=True)
            removed.append(run.path)
    return removed


def iter_rows(csv_path: Path) -> Iterator[tuple[float, dict[str, float | None]]]:
    """Rows of a recording as (t, {column: value or None}); a torn or malformed line is skipped."""
    with open(csv_path, encoding="utf-8", newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if not header or header[:2] != ["t", "time"]:
            raise ValueError(f"{csv_path} is not a metrics recording (no t,time header)")
        cols = header[2:]
        for cells in reader:
            if len(cells) != len(header):
                continue
            try:
                t = float(cells[0])
                vals = {c: (float(x) if x != "" else None) for c, x in zip(cols, cells[2:])}
            except ValueError:
                continue
            yield t, vals


def read_recording(csv_path: Path) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """A whole recording as (t, {column: float64 array with NaN for missing})."""
    with open(csv_path, encoding="utf-8", newline="") as f:
        header = f.readline().rstrip("\r\n").split(",")
    if header[:2] != ["t", "time"]:
        raise ValueError(f"{csv_path} is not a metrics recording (no t,time header)")
    cols = header[2:]
    ts: list[float] = []
    rows: list[list[float]] = []
    for t, vals in iter_rows(csv_path):
        ts.append(t)
        rows.append([math.nan if (v := vals[c]) is None else v for c in cols])
    arr = np.asarray(rows, dtype=np.float64).reshape(len(rows), len(cols))
    return np.asarray(ts, dtype=np.float64), {c: arr[:, i] for i, c in enumerate(cols)}


def load_into(store: RingStore, csv_path: Path) -> int:
    """Load a recording into a store (columns matched by name; others missing). Returns rows loaded."""
    t, data = read_recording(csv_path)
    if t.size == 0:
        return 0
    mat = np.full((t.shape[0], len(store.columns)), np.nan, dtype=np.float32)
    for i, c in enumerate(store.columns):
        if c in data:
            mat[:, i] = data[c]
    store.extend(t, mat)
    return int(t.shape[0])


def export_csv(dest: Path, *, recording: Path | None = None, store: RingStore | None = None,
               t0: float | None = None, t1: float | None = None, columns: Sequence[str] | None = None) -> int:
    """Write a clean CSV (header + complete rows) to ``dest`` atomically; returns the rows written.

    From ``recording`` (full precision, the whole run) when given, else from ``store`` (what the monitor holds:
    full rate for the last 24 h, decimated before). ``t0``/``t1`` limit the time range."""
    lo = -math.inf if t0 is None else t0
    hi = math.inf if t1 is None else t1
    buf = io.StringIO()
    n = 0
    if recording is not None:
        with open(recording, encoding="utf-8", newline="") as f:
            header = f.readline().rstrip("\r\n").split(",")
        cols = list(columns) if columns is not None else header[2:]
        buf.write(",".join(("t", "time", *cols)) + "\n")
        for t, vals in iter_rows(Path(recording)):
            if lo <= t <= hi:
                buf.write(",".join((fmt_t(t), iso(t), *(_fmt(vals.get(c)) for c in cols))) + "\n")
                n += 1
    elif store is not None:
        cols = list(columns) if columns is not None else list(store.columns)
        ts, data = store.window(t0, t1, cols)
        buf.write(",".join(("t", "time", *cols)) + "\n")
        for i in range(ts.shape[0]):
            buf.write(",".join((fmt_t(float(ts[i])), iso(float(ts[i])),
                                *(_fmt(float(data[c][i])) for c in cols))) + "\n")
            n += 1
    else:
        raise ValueError("export_csv needs a recording or a store")
    atomic_write_text(Path(dest), buf.getvalue(), mode=0o644)
    return n
