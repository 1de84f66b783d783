"""engine_manager.tensor_layout: split-GGUF headers → per-tensor and per-expert bytes, classification, every error path,
and a fuzz of mutated/truncated headers that must end in clean errors with bounded memory."""

from __future__ import annotations

import io
import random
import shutil
import struct
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest

from engine_manager import fmt, gguf_header, tensor_layout as L
from engine_manager.tensor_layout import LayoutError, classify, is_lookup_table, read_layout, read_shard_header
from engine_manager.replica import ReplicaSpec, write_replica

GiB, MiB, GB = fmt.GIB, fmt.MIB, fmt.GB


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    d = tmp_path_factory.mktemp("replica")
    write_replica(d, ReplicaSpec())
    return d


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    d = tmp_path_factory.mktemp("small")
    write_replica(d, ReplicaSpec.small())
    return d


# -- totals and classification -------------------------------------------------------------------------------------

def test_replica_totals(full):
    lay = read_layout(full)
    assert len(lay.shards) == 7
    assert [s.number for s in lay.shards] == list(range(1, 8))
    assert abs(lay.total_bytes - 264_500_000_000) < 1_000_000           # 264.5 GB
    assert lay.n_layers == 43 and lay.moe_layers == list(range(3, 43))
    assert lay.n_experts == 384 and lay.n_experts_used == 6
    assert lay.n_routed_experts == 15_360
    per = lay.mean_expert_bytes / MiB
    assert 12.15 <= per <= 12.25                                         # ~12.2 MiB
    # the guides' 183.4 GiB is 69.5 + 113.9, each rounded to 0.1: 183.3..183.5
    assert 183.2 <= lay.routed_expert_bytes / GiB <= 183.5
    assert sum(lay.bytes_by_kind().values()) == lay.tensor_bytes
    assert lay.tensor_bytes + sum(s.data_offset for s in lay.shards) <= lay.total_bytes


def test_per_expert_parts(full):
    lay = read_layout(full)
    for e in lay.expert_layers:
        assert e.n_experts == 384
        assert e.part_bytes == {"gate": 7680 * 1536 // 256 * 84, "up": 7680 * 1536 // 256 * 84,
                                "down": 1536 * 7680 // 256 * 110}
        assert e.types == {"gate": "Q2_K", "up": "Q2_K", "down": "Q3_K"}
    m = lay.expert_bytes_matrix()
    assert m.shape == (40, 384) and int(m.sum()) == lay.routed_expert_bytes


def test_tensor_offsets_are_faithful(small):
    lay = read_layout(small)
    by_shard: dict[int, list] = {}
    for t in lay.tensors:
        by_shard.setdefault(t.shard, []).append(t)
    for s in lay.shards:
        ts = sorted(by_shard[s.number], key=lambda t: t.offset)
        assert ts[0].offset == s.data_offset and s.data_offset % 32 == 0
        for a, b in zip(ts, ts[1:]):
            assert a.offset + a.n_bytes <= b.offset and b.offset % 32 == 0
        assert ts[-1].offset + ts[-1].n_bytes <= s.file_size


def test_matches_gguf_reader(small):
    """The library reader is the oracle for names, shapes, types and absolute offsets."""
    lay = read_layout(small)
    mine = {t.name: t for t in lay.tensors}
    for s in lay.shards:
        r = gguf.GGUFReader(s.path)
        assert len(r.tensors) == s.n_tensors
        for rt in r.tensors:
            t = mine[rt.name]
            assert t.shard == s.number
            assert list(t.shape) == [int(x) for x in rt.shape]
            assert t.ggml_type == int(rt.tensor_type)
            assert t.offset == int(rt.data_offset)
            assert t.n_bytes == int(rt.n_bytes)
        fields = r.fields
        assert int(fields["split.no"].parts[-1][0]) == s.number - 1


@pytest.mark.parametrize("name,kind,layer,part", [
    ("blk.7.ffn_gate_exps.weight", "routed_experts", 7, "gate"),
    ("blk.7.ffn_up_exps.weight", "routed_experts", 7, "up"),
    ("blk.7.ffn_down_exps.weight", "routed_experts", 7, "down"),
    ("blk.9.ffn_gate_up_exps.weight", "routed_experts", 9, "gate_up"),
    ("blk.7.ffn_down_shexp.weight", "shared_experts", 7, None),
    ("blk.0.attn_kv_b.weight", "attention", 0, None),
    ("blk.0.attn_norm.weight", "attention", 0, None),
    ("blk.1.ffn_up.weight", "dense_ffn", 1, None),
    ("blk.1.ffn_norm.weight", "dense_ffn", 1, None),
    ("token_embd.weight", "embeddings_output", None, None),
    ("output.weight", "embeddings_output", None, None),
    ("output_norm.weight", "embeddings_output", None, None),
    ("blk.1.engram_embd_2_0.weight", "embeddings_output", 1, None),
    ("blk.5.ffn_gate_inp.weight", "other", 5, None),
    ("blk.5.exp_probs_b.bias", "other", 5, None),
    ("rope_freqs.weight", "other", None, None),
])
def test_classify(name, kind, layer, part):
    assert classify(name) == (kind, layer, part)


def test_lookup_tables():
    assert is_lookup_table("token_embd.weight")
    assert is_lookup_table("blk.1.engram_embd_2_3.weight")
    assert not is_lookup_table("output.weight")
    assert not is_lookup_table("output_norm.weight")
    assert not is_lookup_table("blk.3.ffn_up_exps.weight")


def test_struct_reader_is_fast_and_small_on_a_tokenizer_header(full):
    """Not a timing assertion: it checks the work done — shard 1's 163,840 tokens and merges are skipped without
    keeping them (arrays are summarised) and without a large allocation."""
    first = sorted(full.glob("*-00001-of-00007.gguf"))[0]
    tracemalloc.start()
    h = read_shard_header(first)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    toks = h.metadata["tokenizer.ggml.tokens"]
    assert isinstance(toks, L.ArraySummary) and toks.count == 163_840
    assert h.metadata["tokenizer.ggml.merges"].count == 163_328
    assert peak < 8 * h.header_bytes + (32 << 20)


def test_string_arrays_fall_back_when_the_fast_path_cannot_prove_the_chain(tmp_path):
    """Strings with NUL bytes and strings ≥ 64 KiB defeat the vectorised skip; the plain loop must still be right."""
    p = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(p, "llama")
    w.add_array("odd.nul", [f"a\x00b{i}" for i in range(300)])
    w.add_array("odd.long", ["x" * 70_000] + [f"t{i}" for i in range(400)])
    w.add_array("odd.empty", [""] * 10 + ["z"] * 300)
    w.add_uint32("after", 7)
    w.add_tensor("t", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    h = read_shard_header(p)
    assert h.metadata["odd.nul"].count == 300
    assert h.metadata["odd.long"].count == 401
    assert h.metadata["odd.empty"].count == 310
    assert h.metadata["after"] == 7
    assert h.tensors[0][0] == "t"


def _adversarial_strings(n: int, rng: random.Random) -> list[str]:
    """Strings that defeat the candidate test one way or another, among ordinary tokens."""
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.70:
            out.append("".join(rng.choice("abcdefghij Ġ▁é中") for _ in range(rng.randint(1, 12))))
        elif r < 0.76:
            out.append("")                                              # empty: its +8 is the next length
        elif r < 0.82:
            out.append("x" + "\x00" * rng.randint(1, 9))                 # text ending in zeros
        elif r < 0.88:
            out.append("a\x05" + "\x00" * 7 + "b")                       # a fake length prefix inside the text
        elif r < 0.94:
            out.append("\x00" * rng.randint(1, 20))
        else:
            out.append("L" * rng.choice([255, 256, 257, 300, 1000, 10_000, 70_000]))   # past one length byte / chunk
    return out


@pytest.mark.parametrize("chunk", [4096, 1 << 18])
def test_streamed_string_skip_agrees_with_gguf_reader(tmp_path, monkeypatch, chunk):
    """The streaming skip of long string arrays ends exactly where gguf.GGUFReader's per-string walk ends: same
    metadata after the arrays, same tensor infos, same data offset — with strings straddling chunk boundaries,
    strings longer than a chunk, empty strings, fake length prefixes inside text, and text ending in zeros."""
    monkeypatch.setattr(gguf_header, "STRING_CHUNK", chunk)
    rng = random.Random(chunk)
    p = tmp_path / "adversarial.gguf"
    w = gguf.GGUFWriter(p, "llama")
    first = _adversarial_strings(6000, rng)
    second = _adversarial_strings(3000, rng)
    w.add_array("t.first", first)
    w.add_array("t.ints", list(range(5000)))
    w.add_array("t.second", second)
    w.add_uint32("t.after", 4242)
    w.add_tensor("blk.0.attn_q.weight", np.zeros((4, 32), dtype=np.float32))
    w.add_tensor("blk.0.ffn_up_exps.weight", np.zeros((2, 4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    h = read_shard_header(p)
    r = gguf.GGUFReader(p)
    assert h.metadata["t.first"].count == len(first) and h.metadata["t.second"].count == len(second)
    assert h.metadata["t.after"] == 4242 == int(r.fields["t.after"].parts[-1][0])
    assert h.data_offset == r.data_offset
    assert [(n, tuple(s)) for n, _, s, _ in h.tensors] == [(t.name, tuple(int(x) for x in t.shape)) for t in r.tensors]
    assert [h.data_offset + off for *_, off in h.tensors] == [t.data_offset for t in r.tensors]
    # cut anywhere inside the arrays: a clean "truncated" error naming the file, never another exception
    data = p.read_bytes()
    start = data.index(b"t.first")
    for cut in sorted(rng.sample(range(start, h.header_bytes), 60)):
        c = tmp_path / f"cut-{cut}.gguf"
        c.write_bytes(data[:cut])
        with pytest.raises(LayoutError, match="truncated|past the end") as exc:
            read_shard_header(c)
        assert c.name in str(exc.value)


# -- error paths ---------------------------------------------------------------------------------------------------

def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        shutil.copy(f, dst / f.name)
    return dst


def test_missing_shard(small, tmp_path):
    d = _copy(small, tmp_path / "m")
    (d / "DeepSeek-V4.1-Flash-Q2_K-00002-of-00002.gguf").unlink()
    with pytest.raises(LayoutError, match=r"shard 2 of 2 is missing") as ei:
        read_layout(d)
    assert "00002-of-00002.gguf" in str(ei.value)


def test_missing_first_shard(small, tmp_path):
    d = _copy(small, tmp_path / "m1")
    (d / "DeepSeek-V4.1-Flash-Q2_K-00001-of-00002.gguf").unlink()
    with pytest.raises(LayoutError, match="shard 1 of 2 is missing"):
        read_layout(d)


def test_shards_of_different_splits(small, tmp_path):
    other = tmp_path / "other"
    write_replica(other, ReplicaSpec.small(n_layers=6))
    d = _copy(small, tmp_path / "mix")
    name = "DeepSeek-V4.1-Flash-Q2_K-00002-of-00002.gguf"
    shutil.copy(other / name, d / name)
    with pytest.raises(LayoutError, match="different splits"):
        read_layout(d)


def test_several_models_in_one_folder(small, tmp_path):
    d = _copy(small, tmp_path / "two")
    write_replica(d, ReplicaSpec.small(file_stem="Other-Model"))
    with pytest.raises(LayoutError, match="several models"):
        read_layout(d)
    # pointing at one first shard works
    assert read_layout(d / "Other-Model-00001-of-00002.gguf").n_routed_experts == 64


def _tiny(path: Path, kv: dict | None = None, arch: str = "llama", tensors: int = 1) -> Path:
    w = gguf.GGUFWriter(path, arch)
    for k, (fn, v) in (kv or {}).items():
        getattr(w, fn)(k, v)
    for i in range(tensors):
        w.add_tensor(f"blk.{i}.attn_q.weight", np.zeros((2, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_shards_of_different_models(tmp_path):
    split = {"split.count": ("add_uint16", 2), "split.tensors.count": ("add_int32", 2)}
    _tiny(tmp_path / "m-00001-of-00002.gguf", {**split, "split.no": ("add_uint16", 0)}, arch="llama")
    _tiny(tmp_path / "m-00002-of-00002.gguf", {**split, "split.no": ("add_uint16", 1)}, arch="qwen3moe")
    with pytest.raises(LayoutError, match="different model") as ei:
        read_layout(tmp_path)
    assert "m-00002-of-00002.gguf" in str(ei.value)


def test_split_number_disagrees_with_name(tmp_path):
    split = {"split.count": ("add_uint16", 2), "split.tensors.count": ("add_int32", 2)}
    _tiny(tmp_path / "m-00001-of-00002.gguf", {**split, "split.no": ("add_uint16", 0)})
    _tiny(tmp_path / "m-00002-of-00002.gguf", {**split, "split.no": ("add_uint16", 0)})
    with pytest.raises(LayoutError, match="says it is shard 1"):
        read_layout(tmp_path)


def test_duplicate_tensor_across_shards(tmp_path):
    split = {"split.count": ("add_uint16", 2), "split.tensors.count": ("add_int32", 2)}
    _tiny(tmp_path / "m-00001-of-00002.gguf", {**split, "split.no": ("add_uint16", 0)})
    _tiny(tmp_path / "m-00002-of-00002.gguf", {**split, "split.no": ("add_uint16", 1)})
    with pytest.raises(LayoutError, match="appears twice"):
        read_layout(tmp_path)


def test_no_split_keys_in_a_shard(tmp_path):
    _tiny(tmp_path / "m-00001-of-00002.gguf")
    _tiny(tmp_path / "m-00002-of-00002.gguf")
    with pytest.raises(LayoutError, match="no split.no"):
        read_layout(tmp_path)


def test_bad_magic(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"GGML" + b"\0" * 64)
    with pytest.raises(LayoutError, match="bad magic") as ei:
        read_layout(p)
    assert str(p) in str(ei.value)


def test_bad_version(tmp_path):
    p = _tiny(tmp_path / "v.gguf")
    b = bytearray(p.read_bytes())
    b[4:8] = struct.pack("<I", 7)
    p.write_bytes(bytes(b))
    with pytest.raises(LayoutError, match="unsupported GGUF version 7"):
        read_layout(p)


def test_truncated_header(small, tmp_path):
    src = sorted(small.glob("*-00001-*"))[0]
    h = read_shard_header(src)
    for cut in (3, 10, 30, h.header_bytes // 2, h.header_bytes - 3):
        p = tmp_path / f"t{cut}.gguf"
        with open(src, "rb") as f:
            p.write_bytes(f.read(cut))
        with pytest.raises(LayoutError) as ei:
            read_shard_header(p)
        assert str(p) in str(ei.value)
        assert "truncated" in str(ei.value) or "too short" in str(ei.value) or "cannot fit" in str(ei.value)


def test_data_past_end_of_file(small, tmp_path):
    d = _copy(small, tmp_path / "short")
    f = d / "DeepSeek-V4.1-Flash-Q2_K-00002-of-00002.gguf"
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 1000)
    with pytest.raises(LayoutError, match="shorter than its header says") as ei:
        read_layout(d)
    assert "download" in str(ei.value)


def _header(n_tensors: int, n_kv: int, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<I", vtype) + payload


@pytest.mark.parametrize("blob,match", [
    (_header(1 << 40, 0), "absurd tensor count"),
    (_header(0, 1 << 40), "absurd metadata count"),
    (_header(5, 5) + b"\0" * 40, "cannot fit"),
    (_header(0, 1) + struct.pack("<Q", 1 << 50) + b"k" * 64, "absurd length"),
    (_header(0, 1) + _kv("a", L.T_ARRAY, struct.pack("<IQ", L.T_UINT32, 1 << 40)) + b"\0" * 64, "absurd array"),
    (_header(0, 1) + _kv("a", L.T_ARRAY, struct.pack("<IQ", L.T_UINT32, 1000)) + b"\0" * 64, "runs past the end"),
    (_header(0, 1) + _kv("a", L.T_ARRAY, struct.pack("<IQ", L.T_STRING, 1000)) + b"\0" * 64, "runs past the end"),
    (_header(0, 1) + _kv("a", 99, b"\0" * 64), "unknown value type 99"),
    (_header(0, 1) + _kv("a", L.T_ARRAY, struct.pack("<IQ", 77, 2)) + b"\0" * 64, "unknown item type 77"),
    (_header(0, 1) + _kv("general.alignment", L.T_UINT32, struct.pack("<I", 48)) + b"\0" * 64, "alignment"),
    (_header(0, 1) + _kv("a", L.T_STRING, struct.pack("<Q", 2) + b"\xff\xfe") + b"\0" * 64, "not UTF-8"),
])
def test_absurd_or_broken_metadata(tmp_path, blob, match):
    p = tmp_path / "bad.gguf"
    p.write_bytes(blob)
    with pytest.raises(LayoutError, match=match):
        read_shard_header(p)


def test_arrays_nested_too_deep_are_a_clean_error(tmp_path):
    """~3,000 nested arrays in a 36 KB header: a LayoutError naming the file, not a RecursionError."""
    deep = struct.pack("<IQ", L.T_ARRAY, 1) * 3000 + struct.pack("<IQ", L.T_UINT8, 0)
    p = tmp_path / "deep.gguf"
    p.write_bytes(_header(0, 1) + _kv("a", L.T_ARRAY, deep) + b"\0" * 64)
    assert 36_000 <= p.stat().st_size <= 37_000
    with pytest.raises(LayoutError, match=f"nested more than {L.MAX_ARRAY_DEPTH} deep") as ei:
        read_shard_header(p)
    assert str(p) in str(ei.value) and "download" in str(ei.value)
    # the deepest nesting allowed still parses, and so does the key after it
    ok = struct.pack("<IQ", L.T_ARRAY, 1) * (L.MAX_ARRAY_DEPTH - 1) + struct.pack("<IQ", L.T_UINT8, 1) + b"\x05"
    after = _kv("b", L.T_UINT32, struct.pack("<I", 7))
    p.write_bytes(_header(0, 2) + _kv("a", L.T_ARRAY, ok) + after + b"\0" * 64)
    h = read_shard_header(p)
    assert h.metadata["a"] == L.ArraySummary(L.T_ARRAY, 1) and h.metadata["b"] == 7
    one_more = struct.pack("<IQ", L.T_ARRAY, 1) * L.MAX_ARRAY_DEPTH + struct.pack("<IQ", L.T_UINT8, 1) + b"\x05"
    p.write_bytes(_header(0, 2) + _kv("a", L.T_ARRAY, one_more) + after + b"\0" * 64)
    with pytest.raises(LayoutError, match="nested more than"):
        read_shard_header(p)


def test_nested_arrays_written_by_gguf_are_read(tmp_path):
    seed = _fuzz_seed_header(tmp_path)
    p = tmp_path / "seed-only.gguf"
    p.write_bytes(seed)
    md = L.parse_header(io.BytesIO(seed), p, len(seed)).metadata
    assert md["test.nested"] == L.ArraySummary(L.T_ARRAY, 3)
    assert md["f"] == 1.5                                      # the keys after it are still in step


def _ti(name: str, dims: list[int], gtype: int, off: int) -> bytes:
    n = name.encode()
    return (struct.pack("<Q", len(n)) + n + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
            + struct.pack("<IQ", gtype, off))


def _arch_kv() -> bytes:
    return _kv("general.architecture", L.T_STRING, struct.pack("<Q", 5) + b"llama")


@pytest.mark.parametrize("ti,match", [
    (_ti("t", [], 0, 0), "0 dimensions"),
    (_ti("t", [1, 1, 1, 1, 1], 0, 0), "5 dimensions"),
    (_ti("t", [32], 250, 0), "unknown ggml type 250"),
    (_ti("t", [32], 0, 7), "not aligned"),
    (_ti("t", [100], 10, 0), "not a multiple"),
    (_ti("t", [1 << 41, 4], 0, 0), "absurd"),
    (_ti("t", [1 << 30], 0, 0), "shorter than its header says"),
])
def test_bad_tensor_infos(tmp_path, ti, match):
    p = tmp_path / "bad.gguf"
    p.write_bytes(_header(1, 1) + _arch_kv() + ti + b"\0" * 256)
    with pytest.raises(LayoutError, match=match):
        read_layout(p)


def test_no_architecture(tmp_path):
    p = tmp_path / "noarch.gguf"
    p.write_bytes(_header(0, 0) + b"\0" * 64)
    with pytest.raises(LayoutError, match="no general.architecture"):
        read_layout(p)


def test_not_found_and_empty_folder(tmp_path):
    with pytest.raises(LayoutError, match="file not found"):
        read_layout(tmp_path / "nothing.gguf")
    with pytest.raises(LayoutError, match="no .gguf files"):
        read_layout(tmp_path)


def test_errors_name_the_file_and_say_what_to_do(small, tmp_path):
    d = _copy(small, tmp_path / "adv")
    (d / "DeepSeek-V4.1-Flash-Q2_K-00002-of-00002.gguf").unlink()
    with pytest.raises(LayoutError) as ei:
        read_layout(d)
    e = ei.value
    assert e.path and e.path.endswith(".gguf") and e.advice


# -- fuzz -----------------------------------------------------------------------------------------------------------

def _fuzz_seed_header(tmp: Path) -> bytes:
    """A small real GGUF header (written with gguf): a 300-token string array (the vectorised path), scalars, an
    int array, arrays of arrays (nested 3 deep), and tensor infos of several types incl. experts."""
    p = tmp / "seed.gguf"
    w = gguf.GGUFWriter(p, "deepseek2")
    w.add_uint32("deepseek2.block_count", 2)
    w.add_uint32("deepseek2.expert_count", 4)
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(300)])
    w.add_array("tokenizer.ggml.token_type", [1] * 300)
    w.add_string("tokenizer.chat_template", "{{ x }}")
    w.add_array("test.nested", [[1, 2], [3, 4, 5], [[6], [7, 8]]])
    w.add_float32("f", 1.5)
    for i in range(2):
        w.add_tensor_info(f"blk.{i}.ffn_up_exps.weight", (4, 8, 256), np.dtype(np.float32), 4 * 8 * 256 // 256 * 84,
                          raw_dtype=gguf.GGMLQuantizationType.Q2_K)
        w.add_tensor_info(f"blk.{i}.attn_q.weight", (8, 32), np.dtype(np.float32), 8 * 32 * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    head = w.fout[0].tell()
    w.close()
    return p.read_bytes()[:head]


def _mutants(seed: bytes, n: int, rng: random.Random):
    for i in range(n):
        b = bytearray(seed)
        how = i % 5
        if how == 0:                                   # truncate
            b = b[: rng.randrange(len(b))]
        elif how == 1:                                 # flip a few bytes
            for _ in range(rng.randint(1, 8)):
                b[rng.randrange(len(b))] = rng.randrange(256)
        elif how == 2:                                 # an absurd 64-bit value somewhere
            pos = rng.randrange(len(b) - 8)
            b[pos:pos + 8] = struct.pack("<Q", rng.choice([1 << 63, 1 << 40, 0xFFFFFFFFFFFFFFFF, 1 << 32]))
        elif how == 3:                                 # a 32-bit value (types, dims, counts)
            pos = rng.randrange(len(b) - 4)
            b[pos:pos + 4] = struct.pack("<I", rng.choice([0, 5, 99, 1 << 31, 0xFFFFFFFF, 3]))
        else:                                          # splice: drop or duplicate a chunk
            a, c = sorted(rng.randrange(len(b)) for _ in range(2))
            b = b[:a] + b[c:] if rng.random() < 0.5 else b[:c] + b[a:c] + b[c:]
        yield i, bytes(b) + b"\0" * rng.choice([0, 0, 64, 4096])


def _parse(i: int, data: bytes) -> bool:
    try:
        h = L.parse_header(io.BytesIO(data), Path(f"fuzz-{i}.gguf"), len(data))
        L.build_layout([h])
        return True
    except LayoutError as exc:
        assert f"fuzz-{i}.gguf" in str(exc)
        return False


def test_fuzz_10000_mutated_headers_end_in_clean_errors(tmp_path):
    """10,000 mutants of a real header: each parses or raises LayoutError naming the file — never another exception
    — and memory stays bounded: the process's peak RSS grows < 64 MiB over the run, and the first 500 mutants run
    under tracemalloc with a peak below 16 MiB (an allocation sized by a corrupt count would blow both)."""
    import resource
    seed = _fuzz_seed_header(tmp_path)
    tracemalloc.start()
    try:
        for i, data in _mutants(seed, 500, random.Random(7)):
            _parse(i, data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * MiB, f"peak traced allocation {peak / MiB:.1f} MiB"
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ok = errors = 0
    for i, data in _mutants(seed, 10_000, random.Random(20261130)):
        if _parse(i, data):
            ok += 1
        else:
            errors += 1
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert ok + errors == 10_000 and errors > 5_000
    assert (rss1 - rss0) * 1024 < 64 * MiB


def test_shard_names_have_one_home():
    """engine_manager.gguf_split is where shard names are made and read; the CLI and the Downloads tab show its
    short names."""
    from engine_manager import gguf_split as G
    name = G.shard_name("DeepSeek-V4.1-Flash-Q2_K", 3, 7)
    assert name == "DeepSeek-V4.1-Flash-Q2_K-00003-of-00007.gguf"
    assert G.parse_shard_name(name) == ("DeepSeek-V4.1-Flash-Q2_K", 3, 7)
    assert G.parse_shard_name("model.gguf") is None and G.parse_shard_name("x-3-of-7.gguf") is None
    assert G.short_name(name) == "shard 3 of 7" and G.short_name("engine.tar.gz") == "engine.tar.gz"
    assert G.first_shard_name(name) == "DeepSeek-V4.1-Flash-Q2_K-00001-of-00007.gguf"
    assert G.strip_shard_suffix("DeepSeek-V4.1-Flash-Q2_K-00001-of-00007") == "DeepSeek-V4.1-Flash-Q2_K"


def test_names_and_split_metadata_agree_on_the_replica(small, tmp_path):
    """The layout reader finds the shards by name, Strata's path by split.no: on a real split both name the same
    first shard and the same files, from the folder and from any shard; the model is found below a cache folder."""
    from engine_manager import gguf_split as G
    by_name = L.find_shards(small)
    split = G.find_split(small)
    assert list(split.shards) == by_name and split.first == by_name[0] and split.count == len(by_name) == 2
    assert L.find_shards(by_name[1]) == by_name and G.find_split(by_name[1]).first == by_name[0]
    assert G.split_problems(by_name) == []
    assert G.first_shard_files(small, max_depth=0) == [by_name[0]]
    deep = tmp_path / "cache" / "models" / "m"
    deep.mkdir(parents=True)
    for n in (1, 2):
        (deep / G.shard_name("M", n, 2)).write_bytes(b"")
    assert G.first_shard_files(tmp_path, max_depth=1) == []
    assert G.first_shard_files(tmp_path, max_depth=3) == [deep / "M-00001-of-00002.gguf"]
    swapped = [by_name[1], by_name[0], *by_name[2:]]
    assert any("split.no is 1" in p for p in G.split_problems(swapped))
