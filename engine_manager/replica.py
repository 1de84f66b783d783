"""A header-faithful, sparse replica of the DeepSeek-V4.1-Flash Q2_K split, for tests, benchmarks, demos and the
scripted engine: the real header layout (7 shards ``DeepSeek-V4.1-Flash-Q2_K-0000N-of-00007.gguf``, every tensor
with its name, type, shape and offset, shard 1 with a tokenizer-sized metadata block) and files of the real sizes,
but no weights: tensor data is a hole (``os.truncate``), so 264.5 GB take kilobytes of disk. The files are written
with ``gguf.GGUFWriter`` (its split support names the shards and writes the ``split.*`` keys).

The hyperparameters are chosen so the guides' totals come out (``deepseek2`` key names; 43 blocks, the first 3
dense; 384 routed experts per MoE layer, 6 used, 12.22 MiB each; host-resident n-gram tables whose row count is
solved so the files add up to 264.5 GB). The table of choices and the figures they reproduce:
benchmarks/results/replica.md. The real header may differ: the planner relies only on the classification rules of
:mod:`engine_manager.tensor_layout` (``tests/test_plan_cli.py`` checks it with a replica of other shapes).

``python -m engine_manager.replica DIR`` writes it; ``--small`` writes a small one for fast tests.
"""

from __future__ import annotations

import functools
import itertools
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .fmt import GB
from gguf.vocab import bytes_to_unicode


MODEL_NAME = "DeepSeek-V4.1-Flash"
FILE_STEM = "DeepSeek-V4.1-Flash-Q2_K"
TARGET_TOTAL_BYTES = 264_500_000_000
ALIGNMENT = 32


@dataclass(frozen=True)
class ReplicaSpec:
    """Every shape and type of the replica. ``ReplicaSpec()`` is the calibrated DeepSeek-V4.1-Flash Q2_K replica;
    :meth:`small` a tiny one for tests; ``replace(spec, ...)`` varies it (e.g. other non-expert shapes)."""

    name: str = MODEL_NAME
    file_stem: str = FILE_STEM
    n_shards: int = 7
    n_layers: int = 43
    n_dense: int = 3
    n_embd: int = 7680
    n_ff_dense: int = 18432
    n_ff_exp: int = 1536
    n_expert: int = 384
    n_expert_used: int = 6
    n_shared: int = 1
    n_head: int = 128
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope: int = 128
    qk_rope: int = 64
    v_head: int = 128
    vocab: int = 163_840
    n_merges: int = 163_328
    context_length: int = 163_840
    # types (gguf.GGMLQuantizationType names)
    t_exp_gate_up: str = "Q2_K"
    t_exp_down: str = "Q3_K"
    t_attn: str = "BF16"
    t_dense: str = "Q8_0"
    t_shared: str = "BF16"
    t_embd: str = "Q8_0"
    t_output: str = "Q8_0"
    # host-resident n-gram memory (lookup tables) and its GPU projections
    engram_layers: tuple[int, ...] = (1, 22)
    engram_orders: int = 2
    engram_heads: int = 8
    engram_dim: int = 1024
    engram_rows: int | None = None          # None: solved so the files add up to target_total_bytes
    t_engram: str = "Q2_K"
    t_engram_proj: str = "BF16"
    target_total_bytes: int | None = TARGET_TOTAL_BYTES
    with_chat_template: bool = True

    @classmethod
    def small(cls, **kw: Any) -> "ReplicaSpec":
        """A tiny replica (2 shards, 1 dense + 4 MoE layers × 16 experts, 512-token vocabulary) for fast tests."""
        base: dict[str, Any] = dict(
                    n_shards=2, n_layers=5, n_dense=1, n_embd=256, n_ff_dense=512, n_ff_exp=256, n_expert=16,
                    n_expert_used=2, n_head=4, q_lora_rank=256, kv_lora_rank=256, qk_nope=32, qk_rope=32,
                    v_head=32, vocab=512, n_merges=256, context_length=4096, engram_layers=(1,), engram_orders=1,
                    engram_heads=2, engram_dim=256, engram_rows=4096, target_total_bytes=None,
                    with_chat_template=False)
        base.update(kw)
        return cls(**base)

    @property
    def moe_layers(self) -> list[int]:
        return list(range(self.n_dense, self.n_layers))

    @property
    def expert_bytes(self) -> int:
        gu = _nbytes(self.t_exp_gate_up, (self.n_embd, self.n_ff_exp))
        d = _nbytes(self.t_exp_down, (self.n_ff_exp, self.n_embd))
        return 2 * gu + d


def _qtype(name: str):
    import gguf
    try:
        return gguf.GGMLQuantizationType[name]
    except KeyError:
        raise ValueError(f"unknown ggml type {name!r}") from None


def _nbytes(type_name: str, shape: Sequence[int]) -> int:
    import gguf
    block, size = gguf.GGML_QUANT_SIZES[_qtype(type_name)]
    n = 1
    for d in shape:
        n *= d
    if shape[0] % block:
        raise ValueError(f"row length {shape[0]} is not a multiple of {type_name}'s block of {block}")
    return n // block * size


def _pad(n: int, a: int = ALIGNMENT) -> int:
    return (n + a - 1) // a * a


# -- the tensor list ---------------------------------------------------------------------------------------------

def tensor_list(spec: ReplicaSpec, engram_rows: int | None = None) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, ggml shape (ne0 first), type name) of every tensor, in file order (llama.cpp's order)."""
    s = spec
    rows = engram_rows if engram_rows is not None else (s.engram_rows or 1 << 20)
    out: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (s.n_embd, s.vocab), s.t_embd)]
    d_mem = s.engram_orders * s.engram_heads * s.engram_dim
    for i in range(s.n_layers):
        b = f"blk.{i}."
        out += [
            (b + "attn_norm.weight", (s.n_embd,), "F32"),
            (b + "attn_q_a_norm.weight", (s.q_lora_rank,), "F32"),
            (b + "attn_kv_a_norm.weight", (s.kv_lora_rank,), "F32"),
            (b + "attn_q_a.weight", (s.n_embd, s.q_lora_rank), s.t_attn),
            (b + "attn_q_b.weight", (s.q_lora_rank, s.n_head * (s.qk_nope + s.qk_rope)), s.t_attn),
            (b + "attn_kv_a_mqa.weight", (s.n_embd, s.kv_lora_rank + s.qk_rope), s.t_attn),
            (b + "attn_kv_b.weight", (s.kv_lora_rank, s.n_head * (s.qk_nope + s.v_head)), s.t_attn),
            (b + "attn_output.weight", (s.n_head * s.v_head, s.n_embd), s.t_attn),
            (b + "ffn_norm.weight", (s.n_embd,), "F32"),
        ]
        if i in s.engram_layers:
            for o in range(s.engram_orders):
                for h in range(s.engram_heads):
                    out.append((b + f"engram_embd_{o + 2}_{h}.weight", (s.engram_dim, rows), s.t_engram))
            out += [
                (b + "engram_norm.weight", (s.n_embd,), "F32"),
                (b + "engram_k.weight", (d_mem, s.n_embd), s.t_engram_proj),
                (b + "engram_v.weight", (d_mem, s.n_embd), s.t_engram_proj),
            ]
        if i < s.n_dense:
            out += [
                (b + "ffn_gate.weight", (s.n_embd, s.n_ff_dense), s.t_dense),
                (b + "ffn_up.weight", (s.n_embd, s.n_ff_dense), s.t_dense),
                (b + "ffn_down.weight", (s.n_ff_dense, s.n_embd), s.t_dense),
            ]
        else:
            out += [
                (b + "ffn_gate_inp.weight", (s.n_embd, s.n_expert), "F32"),
                (b + "exp_probs_b.bias", (s.n_expert,), "F32"),
                (b + "ffn_gate_exps.weight", (s.n_embd, s.n_ff_exp, s.n_expert), s.t_exp_gate_up),
                (b + "ffn_up_exps.weight", (s.n_embd, s.n_ff_exp, s.n_expert), s.t_exp_gate_up),
                (b + "ffn_down_exps.weight", (s.n_ff_exp, s.n_embd, s.n_expert), s.t_exp_down),
                (b + "ffn_gate_shexp.weight", (s.n_embd, s.n_ff_exp * s.n_shared), s.t_shared),
                (b + "ffn_up_shexp.weight", (s.n_embd, s.n_ff_exp * s.n_shared), s.t_shared),
                (b + "ffn_down_shexp.weight", (s.n_ff_exp * s.n_shared, s.n_embd), s.t_shared),
            ]
    out += [("output_norm.weight", (s.n_embd,), "F32"), ("output.weight", (s.n_embd, s.vocab), s.t_output)]
    return out


# -- the tokenizer (synthetic, of the real size) ---------------------------------------------------------------

def _byte_chars() -> list[str]:
    """GPT-2's byte → printable character map (the byte-level BPE alphabet), in byte order."""
    b2u = bytes_to_unicode()
    return [b2u[b] for b in range(256)]


_LETTERS = "etaoinshrdlucmfwypvbgkqjxz"


@functools.lru_cache(maxsize=4)
def synthetic_vocab(vocab: int, n_merges: int) -> tuple[list[str], list[int], list[str]]:
    """Tokens, token types and merges shaped like a byte-level BPE tokenizer's (deterministic, no real text)."""
    base = _byte_chars()
    tokens = list(base[: min(256, vocab)])
    n_special = 3 if vocab > 300 else 0
    n_words = max(0, vocab - len(tokens) - n_special)
    words: list[str] = []
    for size in range(2, 9):
        if len(words) >= n_words:
            break
        words.extend(itertools.islice(("".join(p) for p in itertools.product(_LETTERS, repeat=size)),
                                      n_words - len(words)))
    words = [w if i % 3 == 0 else "Ġ" + w for i, w in enumerate(words)]
    tokens += words
    if n_special:
        tokens += ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"]
    types = [6] * min(256, len(tokens)) + [1] * (len(tokens) - min(256, len(tokens)) - n_special) + [3] * n_special
    nw = len(words) or 1
    merges = [f"{words[i % nw] if words else 'a'} {_LETTERS[i % 26]}" for i in range(n_merges)]
    return tokens, types, merges


CHAT_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}"
)


def _metadata(spec: ReplicaSpec, writer) -> None:
    import gguf
    s = spec
    a = "deepseek2"
    writer.add_type("model")
    writer.add_name(s.name)
    writer.add_basename(s.name)
    writer.add_size_label("763B")
    writer.add_description("header-faithful sparse replica written by dsv41 panel (engine_manager.replica): the "
                           "real header layout and file sizes, no weights; for planning tests, not for inference")
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q2_K))
    writer.add_quantization_version(2)
    writer.add_uint32(f"{a}.block_count", s.n_layers)
    writer.add_uint32(f"{a}.context_length", s.context_length)
    writer.add_uint32(f"{a}.embedding_length", s.n_embd)
    writer.add_uint32(f"{a}.feed_forward_length", s.n_ff_dense)
    writer.add_uint32(f"{a}.attention.head_count", s.n_head)
    writer.add_uint32(f"{a}.attention.head_count_kv", s.n_head)
    writer.add_float32(f"{a}.rope.freq_base", 10000.0)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_uint32(f"{a}.expert_used_count", s.n_expert_used)
    writer.add_uint32(f"{a}.leading_dense_block_count", s.n_dense)
    writer.add_uint32(f"{a}.vocab_size", s.vocab)
    writer.add_uint32(f"{a}.attention.q_lora_rank", s.q_lora_rank)
    writer.add_uint32(f"{a}.attention.kv_lora_rank", s.kv_lora_rank)
    writer.add_uint32(f"{a}.attention.key_length", s.qk_nope + s.qk_rope)
    writer.add_uint32(f"{a}.attention.value_length", s.v_head)
    writer.add_uint32(f"{a}.expert_feed_forward_length", s.n_ff_exp)
    writer.add_uint32(f"{a}.expert_count", s.n_expert)
    writer.add_uint32(f"{a}.expert_shared_count", s.n_shared)
    writer.add_float32(f"{a}.expert_weights_scale", 2.5)
    writer.add_bool(f"{a}.expert_weights_norm", True)
    writer.add_uint32(f"{a}.expert_gating_func", 2)
    writer.add_uint32(f"{a}.rope.dimension_count", s.qk_rope)
    writer.add_string(f"{a}.rope.scaling.type", "yarn")
    writer.add_float32(f"{a}.rope.scaling.factor", 40.0)
    writer.add_uint32(f"{a}.rope.scaling.original_context_length", 4096)
    if s.engram_layers:
        writer.add_array(f"{a}.engram.block_indices", [int(x) for x in s.engram_layers])
        writer.add_uint32(f"{a}.engram.ngram_orders", s.engram_orders)
        writer.add_uint32(f"{a}.engram.head_count", s.engram_heads)
        writer.add_uint32(f"{a}.engram.embedding_length", s.engram_dim)
    tokens, types, merges = synthetic_vocab(s.vocab, s.n_merges)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", "deepseek-v3")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", types)
    if merges:
        writer.add_array("tokenizer.ggml.merges", merges)
    writer.add_uint32("tokenizer.ggml.bos_token_id", max(0, s.vocab - 3))
    writer.add_uint32("tokenizer.ggml.eos_token_id", max(0, s.vocab - 2))
    writer.add_uint32("tokenizer.ggml.padding_token_id", max(0, s.vocab - 1))
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_bool("tokenizer.ggml.add_eos_token", False)
    if s.with_chat_template:
        writer.add_string("tokenizer.chat_template", CHAT_TEMPLATE)


def _fast_writer_class():
    """``gguf.GGUFWriter`` with one speed-up: long homogeneous arrays (the tokenizer's 163,840 tokens, 163,328
    merges and token types) are packed in one go instead of one ``_pack_val`` call per element. Measured here:
    the stock per-element packing takes ~1.3 s for shard 1's 327k strings, this ~0.1 s; the bytes are identical
    (``tests/test_replica.py`` compares them)."""
    import struct

    import gguf
    from gguf import GGUFValueType as VT

    class FastWriter(gguf.GGUFWriter):
        def _pack_val(self, val, vtype, add_vtype, sub_type=None):
            if (vtype == VT.ARRAY and isinstance(val, (list, tuple)) and len(val) > 64
                    and self.endianess == gguf.GGUFEndian.LITTLE):
                first = val[0]
                if isinstance(first, str) and all(type(v) is str for v in val):
                    enc = [v.encode("utf-8") for v in val]
                    parts = [struct.pack("<IIQ", VT.ARRAY, VT.STRING, len(enc)) if add_vtype
                             else struct.pack("<IQ", VT.STRING, len(enc))]
                    body = b"".join([x for e in enc for x in (len(e).to_bytes(8, "little"), e)])
                    return parts[0] + body
                if type(first) is int and all(type(v) is int for v in val):
                    arr = np.asarray(val, dtype="<i4")
                    head = (struct.pack("<I", VT.ARRAY) if add_vtype else b"") + struct.pack("<IQ", VT.INT32, len(val))
                    return head + arr.tobytes()
            return super()._pack_val(val, vtype, add_vtype, sub_type)

    return FastWriter


# -- writing ---------------------------------------------------------------------------------------------------

@dataclass
class ReplicaResult:
    paths: list[Path]
    total_bytes: int
    seconds: float
    engram_rows: int
    spec: ReplicaSpec = field(repr=False, default_factory=ReplicaSpec)

    @property
    def first_shard(self) -> Path:
        return self.paths[0]


def _split_max_size(sizes: list[int], n_shards: int) -> int:
    """The smallest ``split_max_size`` for which GGUFWriter's greedy split makes at most ``n_shards`` files."""
    def count(limit: int) -> int:
        n, cur, cur_n = 1, 0, 0
        for s in sizes:
            if cur_n > 0 and cur + s > limit:
                n, cur, cur_n = n + 1, 0, 0
            cur += s
            cur_n += 1
        return n
    lo, hi = max(sizes), sum(sizes)
    while lo < hi:
        mid = (lo + hi) // 2
        if count(mid) <= n_shards:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _layout_total(spec: ReplicaSpec, rows: int, header_sizes: list[int] | None) -> tuple[int, list[list[int]]]:
    tl = tensor_list(spec, rows)
    sizes = [_nbytes(t, shp) for _, shp, t in tl]
    limit = _split_max_size(sizes, spec.n_shards) if spec.n_shards > 1 else 0
    groups: list[list[int]] = [[]]
    cur = 0
    for s in sizes:
        if limit and groups[-1] and cur + s > limit:
            groups.append([])
            cur = 0
        groups[-1].append(s)
        cur += s
    heads = header_sizes or [0] * len(groups)
    total = sum(_pad(h) + sum(_pad(x) for x in g) for h, g in zip(heads, groups))
    return total, groups


def _solve_rows(spec: ReplicaSpec) -> int:
    if spec.engram_rows is not None or spec.target_total_bytes is None or not spec.engram_layers:
        return spec.engram_rows or 1 << 20
    n_tables = len(spec.engram_layers) * spec.engram_orders * spec.engram_heads
    row_bytes = _nbytes(spec.t_engram, (spec.engram_dim, 1))
    # headers: shard 1 carries the tokenizer (estimated from its strings), the others a few keys and tensor infos
    tokens, _, merges = synthetic_vocab(spec.vocab, spec.n_merges)
    est_head = sum(8 + len(t.encode()) for t in tokens) + sum(8 + len(m.encode()) for m in merges) + 4 * spec.vocab
    tl = tensor_list(spec, 1)
    est_head += sum(8 + len(n) + 4 + 8 * len(shp) + 4 + 8 for n, shp, _ in tl) + 4096 + 64 * spec.n_shards
    base, _ = _layout_total(spec, 0 + 1, None)
    rows = 1 + (spec.target_total_bytes - base - est_head) // (n_tables * row_bytes)
    return max(1, int(rows))


def write_replica(directory: os.PathLike | str, spec: ReplicaSpec | None = None, *,
                  progress: Any = None) -> ReplicaResult:
    """Write the sparse replica's shards into ``directory`` (created) and return their paths and total size.

    With ``spec.target_total_bytes`` set the n-gram table rows are solved (once, then corrected from the written
    headers) so the files add up to that many bytes (±1 row × tables)."""
    spec = spec or ReplicaSpec()
    directory = Path(directory).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = _solve_rows(spec)
    paths, total, header_sizes = _write(directory, spec, rows)
    if spec.target_total_bytes is not None and spec.engram_layers and spec.engram_rows is None:
        n_tables = len(spec.engram_layers) * spec.engram_orders * spec.engram_heads
        row_bytes = _nbytes(spec.t_engram, (spec.engram_dim, 1))
        fix = (spec.target_total_bytes - total) // (n_tables * row_bytes)
        if fix:
            rows += int(fix)
            paths, total, header_sizes = _write(directory, spec, rows)
    return ReplicaResult(paths, total, time.perf_counter() - t0, rows, spec)


def _write(directory: Path, spec: ReplicaSpec, rows: int) -> tuple[list[Path], int, list[int]]:
    tl = tensor_list(spec, rows)
    sizes = [_nbytes(t, shp) for _, shp, t in tl]
    limit = _split_max_size(sizes, spec.n_shards) if spec.n_shards > 1 else 0
    Writer = _fast_writer_class()
    # remove an older replica's shards of the same stem so a folder never mixes two
    for old in directory.glob(f"{spec.file_stem}-*-of-*.gguf"):
        old.unlink()
    single = directory / f"{spec.file_stem}.gguf"
    if single.exists():
        single.unlink()
    w = Writer(directory / f"{spec.file_stem}.gguf", "deepseek2", split_max_size=limit)
    _metadata(spec, w)
    f32 = np.float32
    for (name, shape, tname), nb in zip(tl, sizes):
        w.add_tensor_info(name, tuple(reversed(shape)), np.dtype(f32), nb, raw_dtype=_qtype(tname))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    assert w.fout is not None
    paths: list[Path] = []
    header_sizes: list[int] = []
    total = 0
    names = w.format_shard_names(directory / f"{spec.file_stem}.gguf")
    for fout, tensors, path in zip(w.fout, w.tensors, names):
        head = fout.tell()
        w.write_padding(fout, head)
        fout.flush()
        data = sum(_pad(ti.nbytes) for ti in tensors.values())
        end = _pad(head) + data
        fout.truncate(end)          # a hole: the data takes no disk
        header_sizes.append(head)
        paths.append(Path(path))
        total += end
    w.close()
    if len(paths) != spec.n_shards:
        raise RuntimeError(f"replica came out as {len(paths)} shards, not {spec.n_shards}")
    return paths, total, header_sizes


def disk_usage_bytes(paths: Sequence[os.PathLike | str]) -> int:
    """Bytes actually allocated on disk (st_blocks × 512): kilobytes for a sparse replica."""
    return sum(os.stat(p).st_blocks * 512 for p in paths)


def main(argv: list[str] | None = None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m engine_manager.replica",
                                 description="Write the header-faithful sparse replica of DeepSeek-V4.1-Flash Q2_K "
                                             "(7 shards, 264.5 GB apparent, kilobytes on disk).")
    ap.add_argument("dir", help="folder to write the shards into")
    ap.add_argument("--small", action="store_true", help="a tiny replica for fast tests")
    ap.add_argument("--n-head", type=int, help="attention heads (vary the non-expert shapes)")
    ap.add_argument("--vocab", type=int, help="vocabulary size (vary the non-expert shapes)")
    ap.add_argument("--attn-type", help="ggml type of the attention tensors, e.g. Q8_0")
    ap.add_argument("--no-engram", action="store_true", help="leave out the n-gram memory tables")
    a = ap.parse_args(argv)
    spec = ReplicaSpec.small() if a.small else ReplicaSpec()
    kw: dict[str, Any] = {}
    if a.n_head:
        kw["n_head"] = a.n_head
    if a.vocab:
        kw["vocab"] = a.vocab
        kw["n_merges"] = min(spec.n_merges, max(0, a.vocab - 512))
    if a.attn_type:
        kw["t_attn"] = a.attn_type
    if a.no_engram:
        kw["engram_layers"] = ()
    if kw:
        kw.setdefault("target_total_bytes", None)
        spec = replace(spec, **kw)
    r = write_replica(a.dir, spec)
    print(f"wrote {len(r.paths)} shards to {Path(a.dir)} in {r.seconds:.2f} s: {r.total_bytes / GB:.2f} GB apparent, "
          f"{disk_usage_bytes(r.paths) / 1024:.0f} KiB on disk")
    for p in r.paths:
        print(f"  {p.name}  {p.stat().st_size / GB:8.2f} GB")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
