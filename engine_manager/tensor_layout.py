"""The model's layout from its GGUF headers: every tensor's name, type, shape, bytes, shard and offset, classified,
with the bytes of each routed expert — without reading any tensor data.

A split GGUF is ``<stem>-0000N-of-0000M.gguf`` (llama.cpp's ``gguf-split`` and ``gguf.GGUFWriter`` name it so);
every shard carries ``split.no`` (0-based), ``split.count`` and ``split.tensors.count``. Shard 1 carries the model's
metadata (hyperparameters, the tokenizer); the others usually carry only the ``split.*`` keys.

The GGUF header itself is read by :mod:`engine_manager.gguf_header` (a generic reader; its docstring says why it is
hand-written and what it measured), and the split's files are found by :mod:`engine_manager.gguf_split`. This module
is what the headers mean for a DeepSeek-style MoE model: classification, per-expert bytes, the planner's
hyperparameters. ``python -m engine_manager.tensor_layout PATH`` prints a model's layout; the comparison with
``gguf.GGUFReader`` is ``benchmarks/gguf_reader_compare.py``.

Errors are :class:`LayoutError` naming the file and the problem (missing shard, shards of different splits or
models, absurd counts) and what to do.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from . import fmt
from .fmt import GB, GIB
from .gguf_header import (  # noqa: F401 - re-exported: the reader's names, as the planner and tests know them
    DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    MAX_ARRAY,
    MAX_ARRAY_DEPTH,
    MAX_DIMS,
    MAX_HEADER_BYTES,
    MAX_HPARAM,
    MAX_KEPT_BYTES,
    MAX_KV,
    MAX_NAME,
    MAX_NESTED,
    MAX_STRING,
    MAX_STRINGS,
    MAX_STRINGS_TOTAL,
    MAX_TENSORS,
    quant_sizes,
    SMALL_ARRAY,
    SUPPORTED_VERSIONS,
    T_ARRAY,
    T_BOOL,
    T_FLOAT32,
    T_FLOAT64,
    T_INT8,
    T_INT16,
    T_INT32,
    T_INT64,
    T_STRING,
    T_UINT8,
    T_UINT16,
    T_UINT32,
    T_UINT64,
    ArraySummary,
    LayoutError,
    ShardHeader,
    _check_header_keys,
    meta_int,
    meta_str,
    parse_header,
    read_shard_header,
    tensor_nbytes,
)
from .gguf_split import SPLIT_RE, find_shards  # noqa: F401 - re-exported

MAX_LAYERS = 1 << 12                # blocks (real models: < 200)
MAX_EXPERTS = 1 << 12               # routed experts per layer (real models: <= 512)
MAX_EXPERT_CELLS = 1 << 20          # MoE layers x experts (DeepSeek-V3: 58 x 256; the planner's matrices are this big)


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


# Hyperparameters the planner reads (engine_manager.placement._kv_bytes and build_layout): checked as whole numbers
# (head counts may be per-layer lists).
PLANNER_HPARAMS = {
    "block_count": False, "expert_count": False, "expert_used_count": False, "embedding_length": False,
    "attention.head_count": True, "attention.head_count_kv": True, "attention.key_length": False,
    "attention.value_length": False, "attention.kv_lora_rank": False, "rope.dimension_count": False,
}



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
            tensors.append(TensorInfo(name_, gtype, quant_sizes()[gtype][2], shape, nbytes, no, off, kind, layer, part,
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
            key = f"{t.part}" if t.name.endswith(".weight") else f"{t.part}_{t.name.rsplit('.', 1)[1]}"
            parts[key] = parts.get(key, 0) + t.n_bytes // n
            types[key] = t.type_name
        out.append(ExpertLayer(layer, int(n_exp or 0), parts, types))
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m engine_manager.tensor_layout",
                                 description="Print a model's layout from its GGUF headers.")
    ap.add_argument("path", help="model folder or any shard")
    a = ap.parse_args(argv)
    try:
        lay = read_layout(a.path)
    except LayoutError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    s = lay.summary()
    print(f"{s['name']} ({s['arch']}): {s['shards']} shard(s), {s['total_bytes'] / GB:.1f} GB, "
          f"{s['n_tensors']} tensors, {s['n_layers']} layers")
    print(f"routed experts: {len(s['moe_layers'])} layers × {s['n_experts']} = {s['routed_experts']:,}, "
          f"{fmt.gib(s['routed_expert_bytes'])}, {fmt.mib(s['expert_bytes'], 2)} each "
          f"({s['n_experts_used']} used per token)")
    for k, v in s["bytes_by_kind"].items():
        print(f"  {KIND_LABELS[k]:<28} {v / GIB:8.2f} GiB")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
