"""Hostile GGUF headers against the planner's reader: a bounded, seeded corpus, and counts.

Every case is a model folder: a real small MoE model written with ``gguf.GGUFWriter`` (two shards with
``split.*`` keys, a 300-token tokenizer, experts), then damaged —

  keytype   a key the planner reads given a wrong type or value with gguf itself (``split.no`` a string,
            ``expert_count`` inf, ``head_count`` a list of strings, ``split.tensors.count`` -1 ...), in shard 1 or 2;
  split     split keys inconsistent across the shards (present in one only, disagreeing, duplicated, another model);
  typeswap  the GGUF type field of one key rewritten in the bytes (the value is then read as another type);
  count     a tensor count, metadata count, array length or string length rewritten huge;
  trunc     a shard cut at a random offset;
  flip      1-8 random bytes, or one 8-byte word, overwritten in a header;
  inf       a float key set to inf/NaN in the bytes;
  hostile   headers built to be slow or big: arrays of arrays, arrays of empty strings, masses of tiny tensors,
            long strings, many keys — just past each bound (``--full``: also the sizes slow before the bounds:
            2 M nested empty arrays, 16 M empty strings, 2^20 tensors).

Each case must end in a valid layout (then ``placement.plan`` runs on it, and its plan is serialised) or a
``LayoutError``/plain refusal — never another exception. The corpus is a pure function of ``--seed``.

Run (prints counts: tracebacks, cases over 2 s, cases over 200 MB):

    .venv/bin/python benchmarks/fuzz_gguf.py [--cases 3000] [--seed 15] [--full] [--workers 1]

How it measures: cases run in worker processes (restarted if one dies). Before a case, its files are written and
the worker's peak-RSS mark is reset (``/proc/self/clear_refs`` = 5, Linux ≥ 4.0); after it, ``VmHWM`` − the RSS
before is the case's peak memory, and ``time.perf_counter`` its time (parse + plan, not the writing of the files).
Where clear_refs cannot be written, tracemalloc's peak is used instead (and says so). A worker that dies counts its
case as a traceback and a new worker takes the rest.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ARCH = "deepseek2"
STEM = "fuzz"
N_EMBD, N_FF, N_EXP, N_VOCAB, N_LAYER = 32, 16, 4, 300, 2

# GGUF value types (the file format's numbering)
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)


@dataclass(frozen=True)
class Case:
    id: int
    kind: str
    what: str
    build: Callable[[Path], Path]        # writes the model into a folder; returns the path to read


# -- the real model, written with gguf ---------------------------------------------------------------------------

def _base_kvs() -> list[tuple[str, object, str]]:
    """(key, value, gguf type name) of shard 1, in order (general.architecture is the writer's own)."""
    a = ARCH
    return [
        ("general.name", "fuzz moe", "STRING"),
        (f"{a}.block_count", N_LAYER, "UINT32"),
        (f"{a}.context_length", 4096, "UINT32"),
        (f"{a}.embedding_length", N_EMBD, "UINT32"),
        (f"{a}.feed_forward_length", N_FF, "UINT32"),
        (f"{a}.attention.head_count", 4, "UINT32"),
        (f"{a}.attention.head_count_kv", 4, "UINT32"),
        (f"{a}.attention.key_length", 8, "UINT32"),
        (f"{a}.attention.value_length", 8, "UINT32"),
        (f"{a}.rope.dimension_count", 8, "UINT32"),
        (f"{a}.expert_count", N_EXP, "UINT32"),
        (f"{a}.expert_used_count", 2, "UINT32"),
        (f"{a}.rope.freq_base", 10000.0, "FLOAT32"),
        (f"{a}.attention.layer_norm_rms_epsilon", 1e-6, "FLOAT32"),
        ("tokenizer.ggml.model", "gpt2", "STRING"),
        ("tokenizer.ggml.tokens", [f"tok{i}" for i in range(N_VOCAB)], "ARRAY"),
        ("tokenizer.ggml.token_type", [1] * N_VOCAB, "ARRAY"),
        ("tokenizer.ggml.merges", [f"t o{i}" for i in range(N_VOCAB)], "ARRAY"),
        ("tokenizer.chat_template", "{% for m in messages %}{{ m.content }}{% endfor %}", "STRING"),
    ]


def _base_tensors() -> list[tuple[str, tuple[int, ...]]]:
    """(name, numpy shape) of the model's tensors (numpy order: the file stores them reversed)."""
    out = [("token_embd.weight", (N_VOCAB, N_EMBD))]
    for i in range(N_LAYER):
        out += [(f"blk.{i}.attn_norm.weight", (N_EMBD,)), (f"blk.{i}.attn_q.weight", (N_EMBD, N_EMBD)),
                (f"blk.{i}.attn_kv.weight", (N_EMBD, N_EMBD)), (f"blk.{i}.ffn_norm.weight", (N_EMBD,))]
        if i == 0:
            out += [(f"blk.{i}.ffn_up.weight", (N_FF, N_EMBD)), (f"blk.{i}.ffn_down.weight", (N_EMBD, N_FF))]
        else:
            out += [(f"blk.{i}.ffn_gate_inp.weight", (N_EXP, N_EMBD)),
                    (f"blk.{i}.ffn_gate_exps.weight", (N_EXP, N_FF, N_EMBD)),
                    (f"blk.{i}.ffn_up_exps.weight", (N_EXP, N_FF, N_EMBD)),
                    (f"blk.{i}.ffn_down_exps.weight", (N_EXP, N_EMBD, N_FF)),
                    (f"blk.{i}.ffn_up_shexp.weight", (N_FF, N_EMBD))]
    out += [("output_norm.weight", (N_EMBD,)), ("output.weight", (N_VOCAB, N_EMBD))]
    return out


def shard_name(i: int, n: int) -> str:
    return f"{STEM}-{i:05d}-of-{n:05d}.gguf" if n > 1 else f"{STEM}.gguf"


def write_shard(path: Path, kvs: list[tuple[str, object, str]], tensors: list[tuple[str, tuple[int, ...]]],
                arch: object = ARCH) -> None:
    """One GGUF file written by gguf.GGUFWriter with exactly these key-values (``arch`` None: no
    general.architecture; another type: that value with gguf's inferred type)."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(path, ARCH)
    if arch != ARCH:
        w.kv_data[0].pop("general.architecture", None)
        if arch is not None:
            _add(w, "general.architecture", arch, None)
    for key, value, vtype in kvs:
        _add(w, key, value, vtype)
    for name, shape in tensors:
        w.add_tensor(name, np.zeros(shape, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _add(w, key: str, value: object, vtype: str | None) -> None:
    import gguf

    if isinstance(value, list):
        w.add_array(key, value)
        return
    if vtype is None:
        if isinstance(value, bool):
            vtype = "BOOL"
        elif isinstance(value, int):
            vtype = "UINT64" if value >= 0 else "INT64"
        else:
            vtype = "FLOAT64" if isinstance(value, float) else "STRING"
    w.add_key_value(key, value, gguf.GGUFValueType[vtype])


def write_model(folder: Path, kv_over: dict[str, tuple[object, str] | None] | None = None,
                shard2_over: dict[str, tuple[object, str] | None] | None = None, shards: int = 2,
                split_in: tuple[bool, ...] | None = None, arch2: object = None) -> Path:
    """The base model, in ``shards`` files (1 or 2), with keys replaced (value, type) or removed (None): ``kv_over``
    in shard 1, ``shard2_over`` in shard 2 (split keys included). ``split_in``: which shards carry split keys."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = _base_tensors()
    parts = [tensors] if shards == 1 else [tensors[: len(tensors) // 2], tensors[len(tensors) // 2:]]
    split_in = split_in or (True,) * shards
    for i, part in enumerate(parts):
        kvs: list[tuple[str, object, str]] = []
        if shards > 1 and split_in[i]:
            kvs += [("split.no", i, "UINT16"), ("split.count", shards, "UINT16"),
                    ("split.tensors.count", len(tensors), "INT32")]
        if i == 0:
            kvs += _base_kvs()
        over = (kv_over if i == 0 else shard2_over) or {}
        keys = [k for k, _, _ in kvs]
        kvs = [(k, *over[k]) if k in over and over[k] is not None else (k, v, t)
               for k, v, t in kvs if not (k in over and over[k] is None)]
        kvs += [(k, *vt) for k, vt in over.items() if vt is not None and k not in keys]
        write_shard(folder / shard_name(i + 1, shards), kvs, part, arch=ARCH if i == 0 else arch2)
    return folder


# -- byte-level helpers ------------------------------------------------------------------------------------------

def _header_end(data: bytes) -> int:
    """End of the tensor infos (where the padding before the data begins), by the planner's own reader."""
    from engine_manager.tensor_layout import parse_header
    return parse_header(io.BytesIO(data), Path("base.gguf"), len(data)).header_bytes


def _key_type_offsets(data: bytes) -> dict[str, int]:
    """Offset of each metadata key's type field in a GGUF file's bytes (walking the keys with the real reader)."""
    out: dict[str, int] = {}
    n_kv = struct.unpack_from("<Q", data, 16)[0]
    pos = 24
    from engine_manager import gguf_header as L
    for _ in range(n_kv):
        (n,) = struct.unpack_from("<Q", data, pos)
        key = data[pos + 8: pos + 8 + n].decode()
        tpos = pos + 8 + n
        out[key] = tpos
        # step over the value with the reader's own code
        buf = L._Buf(io.BytesIO(data), Path("x"), len(data))
        buf.skip(tpos + 4, "to value")
        L._read_value(buf, struct.unpack_from("<I", data, tpos)[0], key)
        pos = buf.at
    return out


def _patched(src: Path, dst: Path, edit: Callable[[bytearray], bytearray]) -> None:
    dst.write_bytes(bytes(edit(bytearray(src.read_bytes()))))


# -- hostile headers built from bytes ----------------------------------------------------------------------------

def _gstr(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    return _gstr(key.encode()) + struct.pack("<I", vtype) + payload


def _head(n_tensors: int, n_kv: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv)


def _arch() -> bytes:
    return _kv("general.architecture", STR, _gstr(ARCH.encode()))


def hostile_nested(n: int) -> bytes:
    """An array of ``n`` empty arrays (12 bytes each)."""
    return _head(0, 2) + _arch() + _kv("x.nested", ARR, struct.pack("<IQ", ARR, n) + struct.pack("<IQ", U8, 0) * n)


def hostile_empty_strings(n: int) -> bytes:
    return _head(0, 2) + _arch() + _kv("tokenizer.ggml.tokens", ARR, struct.pack("<IQ", STR, n) + b"\0" * (8 * n))


def hostile_string_arrays(arrays: int, n: int, text: bytes = b"") -> bytes:
    """``arrays`` arrays of ``n`` strings each, all ``text`` (empty by default)."""
    one = struct.pack("<IQ", STR, n) + _gstr(text) * n
    return _head(0, arrays + 1) + _arch() + b"".join(_kv(f"a{i}", ARR, one) for i in range(arrays))


def hostile_odd_strings(n: int, arrays: int = 1) -> bytes:
    """Strings the vectorised skip cannot chain: one zero byte each (length 1, text NUL), in ``arrays`` arrays."""
    one = struct.pack("<IQ", STR, n) + (struct.pack("<Q", 1) + b"\0") * n
    return _head(0, arrays + 1) + _arch() + b"".join(_kv(f"tokens{i}", ARR, one) for i in range(arrays))


def hostile_tensors(n: int) -> bytes:
    """``n`` one-element F32 tensors, all at offset 0 (a 4-byte data section)."""
    infos = b"".join(_gstr(f"t{i}".encode()) + struct.pack("<IQIQ", 1, 1, 0, 0) for i in range(n))
    h = _head(n, 1) + _arch() + infos
    return h + b"\0" * (-len(h) % 32) + b"\0" * 32


def hostile_many_keys(n: int) -> bytes:
    return _head(0, n + 1) + _arch() + b"".join(_kv(f"k{i}", U8, b"\1") for i in range(n))


def hostile_long_strings(n: int, size: int) -> bytes:
    return _head(0, n + 1) + _arch() + b"".join(_kv(f"s{i}", STR, _gstr(b"x" * size)) for i in range(n))


def hostile_long_key(size: int) -> bytes:
    return _head(0, 2) + _arch() + _kv("k" * size, U8, b"\1")


def hostile_long_name(size: int) -> bytes:
    h = _head(1, 1) + _arch() + _gstr(b"t" * size) + struct.pack("<IQIQ", 1, 1, 0, 0)
    return h + b"\0" * (-len(h) % 32) + b"\0" * 32


def hostile_experts(layers: int, experts: int) -> bytes:
    """``layers`` MoE layers of ``experts`` one-float experts each, every tensor at offset 0."""
    infos = b"".join(_gstr(f"blk.{i}.ffn_up_exps.weight".encode()) + struct.pack("<IQQIQ", 2, 1, experts, 0, 0)
                     for i in range(layers))
    h = _head(layers, 1) + _arch() + infos
    return h + b"\0" * (-len(h) % 32) + b"\0" * (4 * experts + 32)


def _raw(name: str, data: bytes) -> Callable[[Path], Path]:
    def build(folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        p = folder / name
        p.write_bytes(data)
        return p
    return build


def _raw_lazy(name: str, make: Callable[[], bytes]) -> Callable[[Path], Path]:
    def build(folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        p = folder / name
        p.write_bytes(make())
        return p
    return build


# -- the corpus --------------------------------------------------------------------------------------------------

WRONG_VALUES: list[tuple[str, object, str]] = [
    ("a string", "abc", "STRING"), ("a numeric string", "12", "STRING"), ("an empty string", "", "STRING"),
    ("inf", math.inf, "FLOAT32"), ("-inf", -math.inf, "FLOAT64"), ("NaN", math.nan, "FLOAT64"),
    ("a fraction", 2.5, "FLOAT32"), ("-1", -1, "INT32"), ("2^40", 1 << 40, "UINT64"), ("2^63", (1 << 63), "UINT64"),
    ("a boolean", True, "BOOL"), ("0", 0, "UINT32"), ("a list of ints", [1, 2], "ARRAY"),
    ("a list of strings", ["a", "b"], "ARRAY"), ("a nested list", [[1], [2, 3]], "ARRAY"),
    ("a long list", list(range(100)), "ARRAY"), ("a list of floats", [math.inf, 1.0], "ARRAY"),
]
SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")
PLANNER_KEYS = tuple(f"{ARCH}.{k}" for k in (
    "block_count", "expert_count", "expert_used_count", "embedding_length", "attention.head_count",
    "attention.head_count_kv", "attention.key_length", "attention.value_length", "attention.kv_lora_rank",
    "rope.dimension_count")) + ("general.name", "general.alignment")


def _deterministic_cases() -> Iterator[tuple[str, str, Callable[[Path], Path]]]:
    # a key the planner reads, of a wrong type or value, written by gguf
    for key in PLANNER_KEYS + SPLIT_KEYS:
        for label, value, vtype in WRONG_VALUES:
            yield "keytype", f"{key} = {label} (shard 1)", \
                (lambda k, v, t: lambda d: write_model(d, kv_over={k: (v, t)}))(key, value, vtype)
    for key in SPLIT_KEYS:
        for label, value, vtype in WRONG_VALUES:
            yield "keytype", f"{key} = {label} (shard 2)", \
                (lambda k, v, t: lambda d: write_model(d, shard2_over={k: (v, t)}))(key, value, vtype)
    for label, value, _vtype in WRONG_VALUES[:12]:
        yield "keytype", f"general.architecture = {label}", \
            (lambda v: lambda d: _arch_as(d, v))(value)
    # split keys inconsistent across the shards
    yield "split", "split keys in shard 1 only", lambda d: write_model(d, split_in=(True, False))
    yield "split", "split keys in shard 2 only", lambda d: write_model(d, split_in=(False, True))
    for key in SPLIT_KEYS:
        yield "split", f"{key} missing from shard 2", lambda d, k=key: write_model(d, shard2_over={k: None})
        yield "split", f"{key} missing from shard 1", lambda d, k=key: write_model(d, kv_over={k: None})
    yield "split", "both shards say split.no 0", lambda d: write_model(d, shard2_over={"split.no": (0, "UINT16")})
    yield "split", "split.count 3 in shard 2", lambda d: write_model(d, shard2_over={"split.count": (3, "UINT16")})
    yield "split", "split.tensors.count disagrees", \
        lambda d: write_model(d, shard2_over={"split.tensors.count": (5, "INT32")})
    yield "split", "split.no of a single file is 4", \
        lambda d: write_model(d, shards=1, kv_over={"split.no": (4, "UINT16")})
    yield "split", "a single file says split.count 2", \
        lambda d: write_model(d, shards=1, kv_over={"split.count": (2, "UINT16")})
    yield "split", "shard 2 of another architecture", lambda d: write_model(d, arch2="llama")
    yield "split", "shard 2's general.architecture is a number", lambda d: write_model(d, arch2=7)
    yield "split", "valid (the base model)", lambda d: write_model(d)
    yield "split", "valid single file", lambda d: write_model(d, shards=1)
    # hostile headers just past each bound, and just within
    L = bounds()
    for n, tag in ((L.MAX_NESTED + 1, "past"), (L.MAX_NESTED, "at")):
        yield "hostile", f"{n:,} nested empty arrays ({tag} the bound)", _raw("h.gguf", hostile_nested(n))
    for n, tag in ((L.MAX_STRINGS + 1, "past"), (200_000, "within")):
        yield "hostile", f"{n:,} empty strings ({tag} the bound)", \
            _raw_lazy("h.gguf", lambda n=n: hostile_empty_strings(n))
    yield "hostile", "200,000 one-NUL strings", _raw_lazy("h.gguf", lambda: hostile_odd_strings(200_000))
    yield "hostile", f"3 arrays of {L.MAX_STRINGS_TOTAL // 3 + 1:,} empty strings (past the header's total)", \
        _raw_lazy("h.gguf", lambda: hostile_string_arrays(3, L.MAX_STRINGS_TOTAL // 3 + 1))
    yield "hostile", f"{L.MAX_STRINGS_TOTAL:,} one-NUL strings in 2 arrays (the slowest header within the bounds)", \
        _raw_lazy("h.gguf", lambda: hostile_odd_strings(L.MAX_STRINGS_TOTAL // 2, arrays=2))
    for n, tag in ((L.MAX_TENSORS + 1, "past"), (L.MAX_TENSORS, "at")):
        yield "hostile", f"{n:,} tiny tensors ({tag} the bound)", _raw_lazy("h.gguf", lambda n=n: hostile_tensors(n))
    yield "hostile", f"{L.MAX_KV + 1:,} keys", _raw("h.gguf", hostile_many_keys(L.MAX_KV + 1))
    yield "hostile", "a string past the bound", _raw("h.gguf", hostile_long_strings(1, L.MAX_STRING + 1))
    yield "hostile", "40 strings of 1 MiB (past the kept-text bound)", \
        _raw_lazy("h.gguf", lambda: hostile_long_strings(40, L.MAX_STRING))
    yield "hostile", "a 70,000-byte key", _raw("h.gguf", hostile_long_key(70_000))
    yield "hostile", "a 300-byte tensor name", _raw("h.gguf", hostile_long_name(300))
    yield "hostile", "4,096 MoE layers x 4,096 experts", _raw_lazy("h.gguf", lambda: hostile_experts(4096, 4096))
    yield "hostile", "a MoE layer of 5,000 experts", _raw_lazy("h.gguf", lambda: hostile_experts(1, 5000))
    yield "hostile", "layer 5,000", _raw("h.gguf", _head(1, 1) + _arch() + _gstr(b"blk.5000.attn_q.weight")
                                         + struct.pack("<IQIQ", 1, 32, 0, 0) + b"\0" * 256)


def bounds():
    """The reader's bounds (engine_manager.tensor_layout.MAX_*), with their first values where a version of
    the reader has none, so that the corpus also runs against the reader before the fix (to count what it did)."""
    from types import SimpleNamespace

    from engine_manager import tensor_layout as layout
    defaults = {"MAX_NESTED": 1 << 12, "MAX_STRINGS": 1 << 20, "MAX_STRINGS_TOTAL": 1 << 20, "MAX_TENSORS": 1 << 15,
                "MAX_KV": 1 << 12, "MAX_STRING": 1 << 20, "MAX_NAME": 256, "MAX_EXPERTS": 1 << 12,
                "MAX_EXPERT_CELLS": 1 << 20}
    fixed = hasattr(layout, "MAX_NESTED")
    return SimpleNamespace(**{k: getattr(layout, k) if fixed else v for k, v in defaults.items()})


def full_size_cases() -> Iterator[tuple[str, str, Callable[[Path], Path]]]:
    """The sizes that were slow before the bounds (tens to hundreds of MB each): only with --full."""
    yield "hostile", "2 M nested empty arrays (35 MB)", _raw_lazy("h.gguf", lambda: hostile_nested(2_000_000))
    yield "hostile", "16 M empty strings (128 MB)", _raw_lazy("h.gguf", lambda: hostile_empty_strings(16 << 20))
    yield "hostile", "2^20 tiny tensors", _raw_lazy("h.gguf", lambda: hostile_tensors(1 << 20))
    yield "hostile", "2^20 empty strings in 2 arrays (within the bounds)", \
        _raw_lazy("h.gguf", lambda: hostile_string_arrays(2, 1 << 19))


def _arch_as(folder: Path, value: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    kvs = _base_kvs()
    write_shard(folder / shard_name(1, 1), kvs, _base_tensors(), arch=value)
    return folder


_BASE_CACHE: dict[str, Path] = {}


def base_files(cache_dir: Path) -> list[Path]:
    """The base model's two shards, written once per cache folder."""
    key = str(cache_dir)
    if key not in _BASE_CACHE:
        d = cache_dir / "base"
        if not (d / shard_name(2, 2)).exists():
            write_model(d)
        _BASE_CACHE[key] = d
    return [_BASE_CACHE[key] / shard_name(i, 2) for i in (1, 2)]


def _mutant(rng: random.Random, cache_dir: Path) -> tuple[str, str, Callable[[Path], Path]]:
    """One byte-level mutation of the base model (a pure function of the rng's state)."""
    files = base_files(cache_dir)
    which = rng.randrange(2)
    src = files[which]
    data = src.read_bytes()
    end = _header_end(data)
    kind = rng.choice(["typeswap", "count", "trunc", "flip", "flip", "inf"])
    b = bytearray(data)
    what = ""
    if kind == "typeswap":
        offs = _key_type_offsets(data)
        key = rng.choice(sorted(offs))
        new = rng.choice([U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64, 13, 99, 0xFFFFFFFF])
        b[offs[key]:offs[key] + 4] = struct.pack("<I", new)
        what = f"type of {key} -> {new}"
    elif kind == "count":
        offs = _key_type_offsets(data)
        big = rng.choice([1 << 16, 1 << 20, 1 << 24, 1 << 32, 1 << 40, 1 << 63, 0xFFFFFFFFFFFFFFFF, 0])
        target = rng.choice(["tensors", "kvs", "key"])
        if target == "tensors":
            b[8:16] = struct.pack("<Q", big)
        elif target == "kvs":
            b[16:24] = struct.pack("<Q", big)
        else:
            key = rng.choice(sorted(offs))
            t = struct.unpack_from("<I", data, offs[key])[0]
            at = offs[key] + 4 + (4 if t == ARR else 0)      # an array's length, or a string's length
            if t in (ARR, STR):
                b[at:at + 8] = struct.pack("<Q", big)
            else:                                               # the key's own length
                n = len(key.encode())
                b[offs[key] - n - 8: offs[key] - n] = struct.pack("<Q", big)
            target = key
        what = f"{target} count -> {big}"
    elif kind == "trunc":
        cut = rng.randrange(end + 64) if rng.random() < 0.8 else rng.randrange(len(b))
        b = b[:cut]
        what = f"cut at {cut}"
    elif kind == "flip":
        if rng.random() < 0.5:
            for _ in range(rng.randint(1, 8)):
                b[rng.randrange(end)] = rng.randrange(256)
            what = "random bytes"
        else:
            pos = rng.randrange(end - 8)
            b[pos:pos + 8] = struct.pack("<Q", rng.choice([1 << 63, 1 << 40, 0xFFFFFFFFFFFFFFFF, 1 << 32, 0, 7]))
            what = f"8 bytes at {pos}"
    else:  # inf / NaN into a numeric key, with the key's type made a float
        offs = _key_type_offsets(data)
        nums = [k for k in offs if struct.unpack_from("<I", data, offs[k])[0] in (U32, F32)]
        key = rng.choice(sorted(nums)) if nums else sorted(offs)[0]
        v = rng.choice([math.inf, -math.inf, math.nan])
        b[offs[key]:offs[key] + 8] = struct.pack("<If", F32, v)
        what = f"{key} = {v} (float32)"
    data2 = bytes(b)
    name = src.name
    other = files[1 - which]

    def build(folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data2)
        shutil.copyfile(other, folder / other.name)
        return folder
    return kind, f"shard {which + 1}: {what}", build


def corpus(seed: int, n: int, cache_dir: Path, full: bool = False) -> Iterator[Case]:
    """``n`` cases (at least the deterministic ones): the deterministic cases first, then seeded mutants."""
    i = 0
    fixed = list(_deterministic_cases()) + (list(full_size_cases()) if full else [])
    for kind, what, build in fixed:
        yield Case(i, kind, what, build)
        i += 1
    rng = random.Random(seed)
    while i < n:
        kind, what, build = _mutant(rng, cache_dir)
        yield Case(i, kind, what, build)
        i += 1


# -- running one case --------------------------------------------------------------------------------------------

def run_case(path: Path) -> tuple[str, str]:
    """("ok" | "refused" | "crash", detail): read the layout, and plan on it when it is valid."""
    from engine_manager.errors import UserError
    from engine_manager.tensor_layout import LayoutError, read_layout
    from engine_manager.placement import plan, reference_hardware

    try:
        lay = read_layout(path)
        json.dumps(lay.summary(), default=str)
        p = plan(lay, reference_hardware())
        json.dumps(p.to_dict(), default=str)
        return "ok", lay.name
    except LayoutError as exc:
        if exc.path is None or not str(exc).startswith(exc.path):
            return "crash", f"LayoutError without the file: {exc}"
        return "refused", str(exc)
    except UserError as exc:
        return "refused", str(exc)
    except Exception:  # noqa: BLE001 - the point: anything else is a finding
        return "crash", traceback.format_exc()


# -- the benchmark -----------------------------------------------------------------------------------------------

def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _can_reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def worker(seed: int, n: int, cache_dir: Path, full: bool, start: int, stop: int) -> None:
    """Run cases start..stop-1, one JSON line each on stdout."""
    import tracemalloc
    import numpy  # noqa: F401 - imported before any measurement
    from engine_manager import placement  # noqa: F401
    reset = _can_reset_peak()
    work = Path(tempfile.mkdtemp(prefix="fuzzw-", dir=cache_dir))
    for case in corpus(seed, n, cache_dir, full):
        if case.id < start:
            continue
        if case.id >= stop:
            break
        d = work / f"c{case.id}"
        path = case.build(d)
        if reset:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            rss0 = _status_kb("VmRSS")
        else:
            tracemalloc.start()
        t0 = time.perf_counter()
        outcome, detail = run_case(path)
        dt = time.perf_counter() - t0
        if reset:
            peak = max(0, _status_kb("VmHWM") - rss0) * 1024
        else:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        shutil.rmtree(d, ignore_errors=True)
        print(json.dumps({"id": case.id, "kind": case.kind, "what": case.what, "outcome": outcome,
                          "detail": detail[-2000:], "s": dt, "peak": peak,
                          "how": "VmHWM" if reset else "tracemalloc"}), flush=True)
    shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=15)
    ap.add_argument("--full", action="store_true", help="also the full-size cases (slow before the bounds)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--worker", nargs=3, type=int, metavar=("START", "STOP", "_"), help=argparse.SUPPRESS)
    ap.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--time-limit", type=float, default=2.0)
    ap.add_argument("--mem-limit-mb", type=float, default=200.0)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a.seed, a.cases, a.cache, a.full, a.worker[0], a.worker[1])
        return 0
    cache = Path(tempfile.mkdtemp(prefix="fuzz-gguf-"))
    t_start = time.monotonic()
    try:
        base_files(cache)
        total = a.cases + (4 if a.full else 0)
        total = max(total, len(list(_deterministic_cases())) + (4 if a.full else 0))
        results: dict[int, dict] = {}
        # cases in slices; a worker that dies leaves the rest of its slice to a new one (its case counted a crash)
        per = -(-total // a.workers)
        pending = [(k, min(total, k + per)) for k in range(0, total, per)]
        procs: list[tuple[subprocess.Popen, int, int]] = []
        while pending or procs:
            while pending and len(procs) < a.workers:
                s0, s1 = pending.pop(0)
                cmd = [sys.executable, __file__, "--seed", str(a.seed), "--cases", str(total),
                       "--worker", str(s0), str(s1), "0", "--cache", str(cache)] + (["--full"] if a.full else [])
                procs.append((subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True), s0, s1))
            p, s0, s1 = procs.pop(0)
            last = s0 - 1
            for line in p.stdout:
                r = json.loads(line)
                results[r["id"]] = r
                last = r["id"]
            rc = p.wait()
            if rc != 0 and last + 1 < s1:
                results[last + 1] = {"id": last + 1, "kind": "?", "what": "worker died", "outcome": "crash",
                                     "detail": f"worker exit code {rc}", "s": float("nan"), "peak": 0, "how": "-"}
                if last + 2 < s1:
                    pending.append((last + 2, s1))
        rows = [results[k] for k in sorted(results)]
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    crashes = [r for r in rows if r["outcome"] == "crash"]
    slow = [r for r in rows if not r["s"] <= a.time_limit]
    big = [r for r in rows if r["peak"] > a.mem_limit_mb * 1e6]
    by_kind: dict[str, dict[str, int]] = {}
    for r in rows:
        by_kind.setdefault(r["kind"], {"ok": 0, "refused": 0, "crash": 0})[r["outcome"]] += 1
    print(f"fuzz_gguf: {len(rows)} cases, seed {a.seed}{', with the full-size cases' if a.full else ''}, "
          f"{a.workers} worker(s), {time.monotonic() - t_start:.0f} s wall; memory by "
          f"{rows[0]['how'] if rows else '-'} (peak over the RSS before each case)")
    for k, c in sorted(by_kind.items()):
        print(f"  {k:<9} ok {c['ok']:>5}  refused {c['refused']:>5}  traceback {c['crash']:>3}")
    slowest = sorted(rows, key=lambda r: -r["s"] if r["s"] == r["s"] else 0)[:5]
    biggest = sorted(rows, key=lambda r: -r["peak"])[:5]
    print(f"tracebacks: {len(crashes)}")
    print(f"cases over {a.time_limit:g} s: {len(slow)}")
    print(f"cases over {a.mem_limit_mb:g} MB: {len(big)}")
    print("slowest: " + "; ".join(f"{r['what']} {r['s']:.3f} s" for r in slowest))
    print("largest: " + "; ".join(f"{r['what']} {r['peak'] / 1e6:.1f} MB" for r in biggest))
    for r in crashes[:10]:
        print(f"--- traceback in case {r['id']} ({r['kind']}: {r['what']}):\n{r['detail']}")
    return 1 if crashes or slow or big else 0


if __name__ == "__main__":
    sys.exit(main())
