"""tools/gguf_reader.py - STAND-IN (dsv41 panel test fixture): a small, stdlib-only GGUF header reader.

Strata's release has a `tools/gguf_reader.py` that `tools/iq_pack.py` imports (Niko1221/Strata tools/iq_pack.py
@0902837, `import gguf_reader as G`, `G.GGUFFile(path)`). This file only shares the name and the role; it is this
project's own code. It reads what the stand-ins need: the key/value metadata, the tensor infos and the data offset.
The `gguf` package is not used on purpose: `gguf.GGUFReader` takes ~7.5 s on a 163,840-token tokenizer header, this
reader well under a second.

GGUF layout (the GGUF specification): b"GGUF", uint32 version, uint64 n_tensors, uint64 n_kv; n_kv times (string key,
uint32 type, value); n_tensors times (string name, uint32 n_dims, n_dims uint64, uint32 type, uint64 offset); the data
starts at the next multiple of general.alignment (32 by default).
"""
from __future__ import annotations

import mmap
import os
import re
import struct

# GGML tensor types: id -> (name, elements per block, bytes per block) - facts of ggml's type table
TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2),
}
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
SPLIT_NAME = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


class GGUFError(ValueError):
    pass


class TensorInfo:
    __slots__ = ("name", "shape", "type_id", "offset")

    def __init__(self, name, shape, type_id, offset):
        self.name, self.shape, self.type_id, self.offset = name, shape, type_id, offset

    @property
    def type_name(self) -> str:
        return TYPES.get(self.type_id, (f"type{self.type_id}", 0, 0))[0]

    def expected_bytes(self):
        """The tensor's size in bytes, None for a type this reader does not know."""
        t = TYPES.get(self.type_id)
        if t is None:
            return None
        n = 1
        for d in self.shape:
            n *= int(d)
        if n % t[1]:
            return None
        return n // t[1] * t[2]


class GGUFFile:
    """One GGUF file's header: .kv (dict), .tensors (list of TensorInfo), .data_start, .path."""

    def __init__(self, path, tensors: bool = True):
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise GGUFError(f"{self.path}: not a GGUF file ({size} bytes)")
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self._parse(mm, tensors)
        except (struct.error, IndexError, UnicodeDecodeError) as e:
            raise GGUFError(f"{self.path}: a truncated or malformed GGUF header ({e})") from None
        finally:
            mm.close()

    def _parse(self, mm, want_tensors):
        if mm[:4] != b"GGUF":
            raise GGUFError(f"{self.path}: not a GGUF file (magic {bytes(mm[:4])!r})")
        self.version, n_tensors, n_kv = struct.unpack_from("<IQQ", mm, 4)
        pos = 24
        u64 = struct.Struct("<Q")
        u32 = struct.Struct("<I")

        def string(pos):
            n = u64.unpack_from(mm, pos)[0]
            return mm[pos + 8:pos + 8 + n].decode("utf-8"), pos + 8 + n

        def value(vt, pos):
            if vt == 8:
                return string(pos)
            if vt == 9:
                it, n = struct.unpack_from("<IQ", mm, pos)
                pos += 12
                if it == 8:
                    out = []
                    for _ in range(n):
                        s, pos = string(pos)
                        out.append(s)
                    return out, pos
                if it in _SCALAR:
                    fmt = _SCALAR[it]
                    sz = struct.calcsize(fmt)
                    return list(struct.unpack_from("<%d%s" % (n, fmt[1]), mm, pos)), pos + sz * n
                out = []
                for _ in range(n):
                    v, pos = value(it, pos)
                    out.append(v)
                return out, pos
            fmt = _SCALAR.get(vt)
            if fmt is None:
                raise GGUFError(f"{self.path}: unknown value type {vt}")
            return struct.unpack_from(fmt, mm, pos)[0], pos + struct.calcsize(fmt)

        self.kv = {}
        for _ in range(n_kv):
            key, pos = string(pos)
            vt = u32.unpack_from(mm, pos)[0]
            self.kv[key], pos = value(vt, pos + 4)
        self.tensors = []
        if not want_tensors:
            self.data_start = None
            return
        for _ in range(n_tensors):
            name, pos = string(pos)
            nd = u32.unpack_from(mm, pos)[0]
            dims = struct.unpack_from("<%dQ" % nd, mm, pos + 4)
            pos += 4 + 8 * nd
            tid, off = struct.unpack_from("<IQ", mm, pos)
            pos += 12
            self.tensors.append(TensorInfo(name, tuple(int(d) for d in dims), tid, off))
        align = int(self.kv.get("general.alignment", 32) or 32)
        self.data_start = (pos + align - 1) // align * align

    @property
    def arch(self) -> str:
        return str(self.kv.get("general.architecture", ""))

    def get(self, key, default=None):
        return self.kv.get(key, default)


def split_paths(first) -> list:
    """Every shard of a split model, found by name beside shard 1 (<name>-0000N-of-0000M.gguf), the way Strata finds
    them (tools/iq_pack.py `Model.__init__` @0902837; generate.cpp's `strata::gguf_split_paths`, "every shard of the
    model (<name>-0000N-of-0000M.gguf beside --native)"). A name without that pattern is one file."""
    import pathlib
    first = pathlib.Path(first)
    m = SPLIT_NAME.search(first.name)
    if not m:
        return [first]
    total = int(m.group(2))
    return [first.with_name(first.name[:m.start()] + "-%05d-of-%05d.gguf" % (i, total)) for i in range(1, total + 1)]
