"""Routing data: Strata expert profiles (STRP), ``--dump-routing`` traces, per-(layer, expert) frequency tables with
merge and decay, and the coverage curve (expected hit rate against hot-set size).

Formats (docs/ENGINE_CONTRACT.md §2, little-endian):

- **STRP profile**: ``b"STRP"``, five uint32 (version = 1, n_layers, n_experts, slots, n_ranked), n_ranked uint16
  (layer, expert) pairs, most useful first, then n_layers × n_experts int32 ranks (−1 = unranked); ``n_layers``
  counts every block, dense ones too, as Strata's ``tools/make_profile.py`` writes it. A ranking without
  frequencies: it orders a hot set but never predicts a hit rate.
- **routing trace**: records of int32 layer, int32 k, k int32 expert ids, k float32 weights, walked as Strata's
  reader walks them (Niko1221/Strata ``tools/make_profile.py`` ``read_trace`` @42bf2ff). A record cut short at the
  end is dropped with a note; format 2's tag records (a negative layer) are stepped over and counted
  (``TraceStats.tags``); anything else malformed is a :class:`RoutingError` naming the file, offset and problem.
- **frequency table** (this panel's own): JSON ``{"format": "dsv41-routing-frequencies", "version": 1, "n_layers",
  "n_experts", "tokens", "sources", "counts"}``: what the monitor saves and ``dsv41 plan --usage`` reads.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from .atomic import atomic_write_bytes
from .errors import UserError

STRP_MAGIC = b"STRP"
STRP_VERSION = 1
STRP_HEADER = struct.Struct("<4s5I")          # 24 bytes
MAX_LAYERS = 4096
MAX_EXPERTS = 65535                            # a uint16 expert id
MAX_K = 4096                                   # experts per token in one trace record
FREQ_FORMAT = "dsv41-routing-frequencies"


class RoutingError(UserError, ValueError):
    """A routing file could not be read. ``str()`` names the file and the problem."""

    def __init__(self, path: os.PathLike | str | None, problem: str, advice: str = ""):
        self.path = str(path) if path is not None else None
        self.problem = problem
        where = f"{self.path}: " if self.path else ""
        super().__init__(f"{where}{problem}" + (f". {advice}" if advice else ""))


# -- STRP profiles ----------------------------------------------------------------------------------------------

@dataclass
class StrpProfile:
    n_layers: int
    n_experts: int
    slots: int
    ranked: np.ndarray                 # (n_ranked, 2) uint16: (layer, expert), most useful first
    ranks: np.ndarray                  # (n_layers, n_experts) int32: rank of each pair, -1 if unranked
    version: int = STRP_VERSION

    @property
    def n_ranked(self) -> int:
        return int(self.ranked.shape[0])

    def pairs(self) -> list[tuple[int, int]]:
        return [(int(a), int(b)) for a, b in self.ranked]


def strp_bytes(ranked: Sequence[tuple[int, int]] | np.ndarray, n_layers: int, n_experts: int, slots: int) -> bytes:
    """The exact bytes of a STRP profile ranking ``ranked`` (validated: in range, no duplicates)."""
    arr = np.asarray(ranked, dtype=np.int64).reshape(-1, 2)
    if not (0 < n_layers <= MAX_LAYERS and 0 < n_experts <= MAX_EXPERTS):
        raise RoutingError(None, f"a profile of {n_layers} layers × {n_experts} experts is out of range")
    if arr.size and (arr.min() < 0 or arr[:, 0].max() >= n_layers or arr[:, 1].max() >= n_experts):
        raise RoutingError(None, f"a ranked pair lies outside {n_layers} layers × {n_experts} experts")
    ranks = np.full((n_layers, n_experts), -1, dtype="<i4")
    flat = arr[:, 0] * n_experts + arr[:, 1]
    if np.unique(flat).size != flat.size:
        raise RoutingError(None, "a (layer, expert) pair is ranked twice")
    ranks.reshape(-1)[flat] = np.arange(arr.shape[0], dtype="<i4")
    if not 0 <= slots <= 0xFFFFFFFF:
        raise RoutingError(None, f"slots {slots} out of range")
    if arr.shape[0] > slots:
        # Strata's read_expert_profile refuses it ("the header claims more ranked pairs than slots",
        # src/core/expert_cache.cpp @2249c24): the engine would not start with such a file
        raise RoutingError(None, f"{arr.shape[0]:,} ranked pairs but {slots:,} slots: a Strata profile ranks at "
                                 "most as many pairs as it has slots")
    head = STRP_HEADER.pack(STRP_MAGIC, STRP_VERSION, n_layers, n_experts, int(slots), arr.shape[0])
    return head + arr.astype("<u2").tobytes() + ranks.tobytes()


def write_strp(path: os.PathLike | str, ranked: Sequence[tuple[int, int]] | np.ndarray, n_layers: int,
               n_experts: int, slots: int) -> Path:
    """Write a STRP profile atomically (0600)."""
    path = Path(path)
    atomic_write_bytes(path, strp_bytes(ranked, n_layers, n_experts, slots))
    return path


def parse_strp(data: bytes, path: os.PathLike | str | None = None) -> StrpProfile:
    if len(data) < STRP_HEADER.size:
        raise RoutingError(path, f"not a Strata profile: {len(data)} bytes, shorter than the 24-byte header")
    magic, version, nl, ne, slots, n = STRP_HEADER.unpack_from(data, 0)
    if magic != STRP_MAGIC:
        raise RoutingError(path, f"not a Strata profile: bad magic {magic!r} (expected b'STRP')")
    if version != STRP_VERSION:
        raise RoutingError(path, f"a version {version} profile; this panel reads version {STRP_VERSION}",
                           "Write the profile again with this panel (dsv41 plan --strp FILE)")
    if not (0 < nl <= MAX_LAYERS and 0 < ne <= MAX_EXPERTS):
        raise RoutingError(path, f"absurd size {nl} layers × {ne} experts")
    if n > slots:
        raise RoutingError(path, f"ranks {n:,} pairs but has {slots:,} slots; Strata refuses such a profile (\"the "
                                 "header claims more ranked pairs than slots\")",
                           "Make the plan again with this panel (Placement tab or `dsv41 plan`)")
    if n > nl * ne:
        raise RoutingError(path, f"ranks {n:,} pairs but the model has only {nl * ne:,}")
    want = STRP_HEADER.size + 4 * n + 4 * nl * ne
    if len(data) != want:
        what = "truncated" if len(data) < want else "has trailing bytes"
        raise RoutingError(path, f"{what}: {len(data):,} bytes, a profile of {n:,} pairs over {nl} × {ne} is "
                                 f"{want:,}")
    ranked = np.frombuffer(data, dtype="<u2", count=2 * n, offset=STRP_HEADER.size).reshape(n, 2)
    ranks = np.frombuffer(data, dtype="<i4", count=nl * ne, offset=STRP_HEADER.size + 4 * n).reshape(nl, ne)
    if n:
        bad = np.flatnonzero((ranked[:, 0] >= nl) | (ranked[:, 1] >= ne))
        if bad.size:
            i = int(bad[0])
            raise RoutingError(path, f"ranked pair {i} (layer {ranked[i, 0]}, expert {ranked[i, 1]}) lies outside "
                                     f"{nl} layers × {ne} experts")
    flat = ranked[:, 0].astype(np.int64) * ne + ranked[:, 1]
    if np.unique(flat).size != flat.size:
        raise RoutingError(path, "a (layer, expert) pair is ranked twice")
    expect = np.full(nl * ne, -1, dtype=np.int64)
    expect[flat] = np.arange(n)
    if not np.array_equal(expect, ranks.reshape(-1)):
        i = int(np.flatnonzero(expect != ranks.reshape(-1))[0])
        raise RoutingError(path, f"the rank table disagrees with the ranked list at layer {i // ne}, expert {i % ne} "
                                 f"(table {int(ranks.reshape(-1)[i])}, list {int(expect[i])})")
    if slots > nl * ne:
        raise RoutingError(path, f"absurd slot count {slots:,} for {nl * ne:,} pairs")
    return StrpProfile(nl, ne, slots, ranked.copy(), ranks.copy(), version)


def profile_shape(path: os.PathLike | str) -> tuple[int, int] | None:
    """A profile's (layers, experts per layer) from its 24-byte header, as Strata reads it before a start
    (serve/server.py ``profile_shape`` @2291cb3): None when the file is missing, is not ``STRP``, or is shorter than
    the ``24 + 4 × n_ranked`` bytes its header promises."""
    try:
        with open(path, "rb") as f:
            head = f.read(STRP_HEADER.size)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return None
    if len(head) < STRP_HEADER.size or head[:4] != STRP_MAGIC:
        return None
    _magic, _version, nl, ne, _slots, n = STRP_HEADER.unpack(head)
    return (nl, ne) if size >= STRP_HEADER.size + 4 * n else None


def check_profile_shape(path: os.PathLike | str, n_layers: int, n_experts: int) -> None:
    """Refuse a profile made for another model shape, as the engine does (its ``read_expert_profile`` takes the
    model's layers × experts; Strata's ``tools/make_profile.py`` ``read_profile`` says ``<nl>x<ne>, not <NL>x<NE>``)."""
    shape = profile_shape(path)
    if shape is None:
        raise RoutingError(path, "not a Strata profile (no STRP header, or shorter than its header says)",
                           "Write the profile again (dsv41 plan --strp FILE)")
    if shape != (n_layers, n_experts):
        raise RoutingError(path, f"a profile of {shape[0]} layers × {shape[1]} experts; the model has {n_layers} × "
                                 f"{n_experts}", "It was written for another model: make the plan again for this one")


def read_strp(path: os.PathLike | str) -> StrpProfile:
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > STRP_HEADER.size + 8 * MAX_LAYERS * 512:
            raise RoutingError(path, f"too large for a profile ({size:,} bytes)")
        data = path.read_bytes()
    except FileNotFoundError:
        raise RoutingError(path, "file not found") from None
    except OSError as exc:
        raise RoutingError(path, f"cannot read: {exc.strerror or exc}") from None
    return parse_strp(data, path)


# -- routing traces -------------------------------------------------------------------------------------------------

@dataclass
class TraceRecord:
    layer: int
    experts: list[int]
    weights: list[float]


def trace_bytes(records: Iterable[tuple[int, Sequence[int], Sequence[float]]]) -> bytes:
    """The exact bytes of a ``--dump-routing`` trace."""
    out = bytearray()
    for layer, experts, weights in records:
        k = len(experts)
        if len(weights) != k:
            raise RoutingError(None, f"record for layer {layer}: {k} experts but {len(weights)} weights")
        out += struct.pack("<ii", int(layer), k)
        out += np.asarray(experts, dtype="<i4").tobytes()
        out += np.asarray(weights, dtype="<f4").tobytes()
    return bytes(out)


def write_trace(path: os.PathLike | str, records: Iterable[tuple[int, Sequence[int], Sequence[float]]]) -> Path:
    path = Path(path)
    atomic_write_bytes(path, trace_bytes(records))
    return path


@dataclass
class TraceStats:
    records: int                                   # routing records counted (tag records not included)
    dropped_tail_bytes: int
    notes: list[str] = field(default_factory=list)
    tags: int = 0                                  # format-2 tag records (negative layer) stepped over
    tag_layers: list[int] = field(default_factory=list)   # their distinct (negative) layer values


def _tag_note(tags: int, tag_layers: Sequence[int]) -> list[str]:
    if not tags:
        return []
    which = ", ".join(str(x) for x in sorted(set(tag_layers)))
    return [f"{tags} tag record{'s' if tags != 1 else ''} (format 2, layer {which}) skipped"]


def iter_trace(data: bytes, path: os.PathLike | str | None = None) -> Iterable[TraceRecord]:
    """Records one by one (tests and tools; :func:`read_trace` is the fast path)."""
    off, i, n = 0, 0, len(data)
    while off + 8 <= n:
        layer, k = struct.unpack_from("<ii", data, off)
        if k < 0 or k > MAX_K:
            raise RoutingError(path, f"record {i} at offset {off:,}: absurd expert count k={k}")
        if off + 8 + 8 * k > n:
            return
        ids = list(struct.unpack_from(f"<{k}i", data, off + 8))
        ws = list(struct.unpack_from(f"<{k}f", data, off + 8 + 4 * k))
        yield TraceRecord(layer, ids, ws)
        off += 8 + 8 * k
        i += 1


def count_trace(data: bytes, n_layers: int, n_experts: int, path: os.PathLike | str | None = None
                ) -> tuple[np.ndarray, TraceStats]:
    """(counts (n_layers × n_experts) float64, stats) from trace bytes. Runs of records with the same k and a
    non-negative layer (what the engine writes) are counted vectorised; tag records (negative layer, format 2) and a
    change of k are walked one by one. Tag records are never checked against the model and never refuse the trace."""
    n = len(data)
    counts = np.zeros((n_layers, n_experts), dtype=np.float64)
    off, i, tags, tag_layers = 0, 0, 0, []
    while off + 8 <= n:
        layer, k = struct.unpack_from("<ii", data, off)
        if k < 0 or k > MAX_K:
            raise RoutingError(path, f"record {i + tags} at offset {off:,}: absurd expert count k={k}")
        rec = 8 + 8 * k
        if off + rec > n:
            break
        if layer < 0:                                   # a tag record: step over it
            tags += 1
            if layer not in tag_layers:
                tag_layers.append(layer)
            off += rec
            continue
        # the run of records from here with the same k and a routing layer
        m = (n - off) // rec
        arr = np.frombuffer(data, dtype="<i4", count=m * rec // 4, offset=off).reshape(m, rec // 4)
        stop = np.flatnonzero((arr[:, 1] != k) | (arr[:, 0] < 0))
        run = int(stop[0]) if stop.size else m
        arr = arr[:run]
        layers, ids = arr[:, 0], arr[:, 2:2 + k]
        _check_ids(path, layers, ids, n_layers, n_experts, rec, i + tags, off)
        if k:       # np.bincount, not np.add.at: 0.46 against 2.3 ms on 20,000 records (read every second)
            flat = np.repeat(layers.astype(np.int64) * n_experts, k) + ids.reshape(-1)
            counts += np.bincount(flat, minlength=n_layers * n_experts).reshape(n_layers, n_experts)
        off += run * rec
        i += run
    tail = n - off
    notes = _tag_note(tags, tag_layers) + ([f"{tail} trailing bytes (a record cut short) ignored"] if tail else [])
    return counts, TraceStats(i, tail, notes, tags, tag_layers)


def _check_ids(path, layers: np.ndarray, ids: np.ndarray, n_layers: int, n_experts: int, rec: int | None,
               first_index: int = 0, first_off: int = 0) -> None:
    bad_l = np.flatnonzero((layers < 0) | (layers >= n_layers))
    if bad_l.size:
        i = int(bad_l[0])
        off = first_off if rec is None else first_off + i * rec
        raise RoutingError(path, f"record {first_index + i} at offset {off:,}: layer {int(layers[i])} outside the "
                                 f"model's {n_layers} layers", "Was this trace written for another model?")
    bad = np.argwhere((ids < 0) | (ids >= n_experts))
    if bad.size:
        i = int(bad[0, 0])
        off = first_off if rec is None else first_off + i * rec
        raise RoutingError(path, f"record {first_index + i} at offset {off:,}: expert id {int(ids[tuple(bad[0])])} "
                                 f"outside the model's {n_experts} experts",
                           "Was this trace written for another model?")


def read_trace(path: os.PathLike | str, n_layers: int, n_experts: int) -> "FrequencyTable":
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise RoutingError(path, "file not found") from None
    except OSError as exc:
        raise RoutingError(path, f"cannot read: {exc.strerror or exc}") from None
    counts, stats = count_trace(data, n_layers, n_experts, path)
    if stats.records == 0:
        tags = f" (only {stats.tags} tag record{'s' if stats.tags != 1 else ''})" if stats.tags else ""
        raise RoutingError(path, f"holds no complete routing record{tags}",
                           "Run the engine with --dump-routing FILE on a typical prompt to make one")
    ft = FrequencyTable(counts, sources=[str(path)])
    ft.notes = [f"{path.name}: {n}" for n in stats.notes]
    return ft


# -- frequency tables -----------------------------------------------------------------------------------------------

@dataclass
class FrequencyTable:
    """How often each (layer, expert) was routed: rows are block indices (dense blocks stay zero)."""

    counts: np.ndarray                               # (n_layers, n_experts) float64
    sources: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        c = np.asarray(self.counts, dtype=np.float64)
        if c.ndim != 2:
            raise RoutingError(None, f"a frequency table must be 2-D (layers × experts), got shape {c.shape}")
        if not np.all(np.isfinite(c)) or (c.size and c.min() < 0):
            raise RoutingError(None, "a frequency table holds negative or non-finite counts")
        self.counts = c

    @classmethod
    def zeros(cls, n_layers: int, n_experts: int) -> "FrequencyTable":
        return cls(np.zeros((n_layers, n_experts)))

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.counts.shape
        return int(rows), int(cols)

    @property
    def total(self) -> float:
        return float(self.counts.sum())

    @property
    def empty(self) -> bool:
        return self.total <= 0

    def merge(self, other: "FrequencyTable", decay: float = 1.0) -> "FrequencyTable":
        """``self × decay + other``: older evidence fades by ``decay`` (0..1) when newer arrives."""
        if other.shape != self.shape:
            raise RoutingError(None, f"cannot merge routing counts of {other.shape[0]} × {other.shape[1]} into "
                                     f"{self.shape[0]} × {self.shape[1]} (different models?)")
        if not 0.0 <= decay <= 1.0:
            raise RoutingError(None, f"decay {decay} must be between 0 and 1")
        return FrequencyTable(self.counts * decay + other.counts, self.sources + other.sources,
                              self.notes + other.notes)

    def decayed(self, factor: float) -> "FrequencyTable":
        if not 0.0 <= factor <= 1.0:
            raise RoutingError(None, f"decay {factor} must be between 0 and 1")
        return FrequencyTable(self.counts * factor, list(self.sources), list(self.notes))

    def add_counts(self, counts: np.ndarray, decay: float = 1.0) -> "FrequencyTable":
        return self.merge(FrequencyTable(np.asarray(counts, dtype=np.float64)), decay)

    def shares(self) -> np.ndarray:
        t = self.total
        return self.counts / t if t > 0 else np.zeros_like(self.counts)

    def hit_rate(self, hot: np.ndarray) -> float | None:
        """Share of routed picks that a hot set (bool mask of the table's shape) would serve; None without data."""
        t = self.total
        if t <= 0:
            return None
        return float(self.counts[np.asarray(hot, dtype=bool)].sum() / t)

    # -- files --------------------------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {"format": FREQ_FORMAT, "version": 1, "n_layers": self.shape[0], "n_experts": self.shape[1],
                "tokens": None, "total": self.total, "sources": self.sources,
                "counts": [[round(float(x), 6) for x in row] for row in self.counts]}

    def save(self, path: os.PathLike | str) -> Path:
        path = Path(path)
        atomic_write_bytes(path, (json.dumps(self.to_json(), separators=(",", ":")) + "\n").encode())
        return path

    @classmethod
    def from_json(cls, d: Any, path: os.PathLike | str | None = None) -> "FrequencyTable":
        if not isinstance(d, dict) or d.get("format") != FREQ_FORMAT:
            raise RoutingError(path, f"not a routing frequency file (no \"format\": \"{FREQ_FORMAT}\")")
        if d.get("version") != 1:
            raise RoutingError(path, f"frequency file version {d.get('version')!r}; this panel reads version 1")
        nl, ne, rows = d.get("n_layers"), d.get("n_experts"), d.get("counts")
        if not (isinstance(nl, int) and isinstance(ne, int) and 0 < nl <= MAX_LAYERS and 0 < ne <= MAX_EXPERTS):
            raise RoutingError(path, f"bad size {nl!r} × {ne!r}")
        if not isinstance(rows, list) or len(rows) != nl or any(not isinstance(r, list) or len(r) != ne for r in rows):
            raise RoutingError(path, f"counts are not {nl} rows of {ne} numbers")
        try:
            arr = np.array(rows, dtype=np.float64)
        except (TypeError, ValueError):
            raise RoutingError(path, "counts hold something that is not a number") from None
        try:
            return cls(arr, sources=[str(s) for s in d.get("sources") or []] or ([str(path)] if path else []))
        except RoutingError as exc:
            raise RoutingError(path, exc.problem) from None

    @classmethod
    def load(cls, path: os.PathLike | str) -> "FrequencyTable":
        path = Path(path)
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise RoutingError(path, "file not found") from None
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise RoutingError(path, f"not a readable JSON frequency file ({exc.__class__.__name__})") from None
        return cls.from_json(d, path)


# -- usage: whatever the user gives the planner ----------------------------------------------------------------

@dataclass
class Usage:
    """What the planner knows about routing: real frequencies (traces, saved tables) and/or a ranking (a STRP
    profile, which orders but cannot predict)."""

    frequencies: FrequencyTable | None = None
    ranking: list[tuple[int, int]] | None = None
    sources: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def has_frequencies(self) -> bool:
        return self.frequencies is not None and not self.frequencies.empty


def sniff(path: os.PathLike | str) -> str:
    """``strp``, ``frequencies`` or ``trace`` from the file's first bytes."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except FileNotFoundError:
        raise RoutingError(path, "file not found") from None
    except OSError as exc:
        raise RoutingError(path, f"cannot read: {exc.strerror or exc}") from None
    if head.startswith(STRP_MAGIC):
        return "strp"
    if head.lstrip()[:1] == b"{":
        return "frequencies"
    return "trace"


def load_usage(paths: Sequence[os.PathLike | str], n_layers: int, n_experts: int, decay: float = 1.0) -> Usage:
    """Read every usage file (traces, frequency tables, STRP profiles) for a model of ``n_layers`` blocks and
    ``n_experts`` experts; frequencies are merged (each earlier file × ``decay``), the last profile is the ranking."""
    u = Usage()
    for p in paths:
        kind = sniff(p)
        if kind == "strp":
            check_profile_shape(p, n_layers, n_experts)
            prof = read_strp(p)
            if (prof.n_layers, prof.n_experts) != (n_layers, n_experts):
                raise RoutingError(p, f"a profile of {prof.n_layers} layers × {prof.n_experts} experts; the model "
                                      f"has {n_layers} × {n_experts}", "It was written for another model")
            u.ranking = prof.pairs()
        else:
            ft = FrequencyTable.load(p) if kind == "frequencies" else read_trace(p, n_layers, n_experts)
            if ft.shape != (n_layers, n_experts):
                raise RoutingError(p, f"routing counts of {ft.shape[0]} layers × {ft.shape[1]} experts; the model "
                                      f"has {n_layers} × {n_experts}", "It was recorded with another model")
            u.frequencies = ft if u.frequencies is None else u.frequencies.merge(ft, decay)
            u.notes += ft.notes
        u.sources.append(str(p))
    return u


# -- the coverage curve ----------------------------------------------------------------------------------------------

def rank_by_density(counts: np.ndarray | None, nbytes: np.ndarray, tie_order: np.ndarray | None = None) -> np.ndarray:
    """Flat indices of ``nbytes`` (same shape as counts) in the order that maximises expected hits per byte: highest
    count / bytes first; ties broken by ``tie_order`` (smaller first), then by index."""
    nb = np.asarray(nbytes, dtype=np.float64).reshape(-1)
    n = nb.size
    tie = np.arange(n) if tie_order is None else np.asarray(tie_order).reshape(-1)
    if counts is None:
        return np.lexsort((np.arange(n), tie, nb))
    c = np.asarray(counts, dtype=np.float64).reshape(-1)
    density = np.divide(c, nb, out=np.zeros_like(c), where=nb > 0)
    return np.lexsort((np.arange(n), tie, -density))


@dataclass
class CoverageCurve:
    """Expected hit rate (share of routed picks served from VRAM) against hot-set size, in the planner's order."""
    n_hot: np.ndarray                  # 0..N
    hot_bytes: np.ndarray              # cumulative bytes
    hit_rate: np.ndarray               # 0..1

    def at(self, n: int) -> float:
        return float(self.hit_rate[max(0, min(n, self.hit_rate.size - 1))])

    def sampled(self, points: int = 256) -> dict[str, list]:
        idx = np.unique(np.linspace(0, self.n_hot.size - 1, num=min(points, self.n_hot.size)).round().astype(int))
        return {"n_hot": self.n_hot[idx].tolist(), "hot_bytes": self.hot_bytes[idx].tolist(),
                "hit_rate": [round(float(x), 6) for x in self.hit_rate[idx]]}


def coverage_curve(counts: np.ndarray, nbytes: np.ndarray, order: np.ndarray | None = None) -> CoverageCurve | None:
    """The curve for ``counts`` over pairs of size ``nbytes`` (same shape), taking pairs in ``order`` (flat indices;
    default: by density). None when there are no counts — a curve needs real frequencies."""
    c = np.asarray(counts, dtype=np.float64).reshape(-1)
    total = c.sum()
    if total <= 0:
        return None
    nb = np.asarray(nbytes, dtype=np.int64).reshape(-1)
    if order is None:
        order = rank_by_density(c, nb)
    hits = np.concatenate(([0.0], np.cumsum(c[order]) / total))
    b = np.concatenate(([0], np.cumsum(nb[order])))
    return CoverageCurve(np.arange(order.size + 1), b, np.minimum(hits, 1.0))
