"""A deterministic mixture-of-experts GGUF that stock llama.cpp really loads and runs.

``write_tinymoe(dir)`` writes a ``qwen3moe`` model (docs/ENGINE_CONTRACT.md §3 records what llama-server accepted)
with seeded random weights and a GPT-2 byte-level BPE tokenizer, split into 2+ shards with the split naming
(``tinymoe-00001-of-0000N.gguf``), so the multi-shard load path is exercised. The default preset is ~1.7 MiB and
serves thousands of tokens per second on a laptop CPU; the ``gpu`` preset (or any size via the keyword
arguments) writes a several-GB model of the same shape for placement runs on a real GPU. Tensors are generated
and written one at a time, so memory stays at one tensor whatever the model size.

Two properties keep replies usable by the panel's tests:

* Replies stay printable ASCII. Random weights otherwise emit bytes >= 0x80 that form invalid UTF-8, and
  llama-server then answers HTTP 400 ``invalid UTF-8 byte``. Embedding dimension 0 is held at a large constant
  (no layer writes to it: the attention output and expert down projections have a zero row there), so after the
  final norm it is a large positive number, and the output weight of every non-printable token (and of the
  special tokens) is strongly negative in that dimension.
* It never emits an end token, so a request must set ``max_tokens``.

Command line: ``python -m engine_manager.testing.tinymoe DIR [--preset tiny|gpu] [--n-layer ...]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Iterator, TypedDict, Unpack

import numpy as np

ARCH = "qwen3moe"
BASENAME = "tinymoe"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# a few GPT-2 style merges (Ġ is the byte-level form of a space); every merge result becomes a token
MERGES = (
    ("Ġ", "t"), ("h", "e"), ("Ġ", "a"), ("i", "n"), ("r", "e"), ("o", "n"), ("Ġt", "he"), ("e", "r"),
    ("Ġ", "s"), ("Ġ", "w"), ("a", "n"), ("o", "r"), ("e", "n"), ("Ġ", "o"), ("i", "s"), ("a", "t"),
)
EMBD_CONST = 8.0        # the value of embedding dimension 0 (kept through every layer)
BLOCK_WEIGHT = -10.0    # x sqrt(n_embd): output weight in dimension 0 of tokens that must never be sampled


@dataclass(frozen=True)
class TinyMoeConfig:
    n_layer: int = 4
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 32
    n_expert: int = 8
    n_expert_used: int = 2
    n_ff_exp: int = 32
    context_length: int = 4096
    seed: int = 1234
    shards: int = 2
    printable_only: bool = True     # False: no output bias, so replies hit llama-server's invalid-UTF-8 400

    def expert_tensor_bytes(self) -> int:
        """Bytes of one layer's gate+up+down expert tensors (F16)."""
        return 3 * self.n_expert * self.n_ff_exp * self.n_embd * 2

    def expert_bytes(self) -> int:
        """Bytes of one routed expert (gate+up+down, F16)."""
        return 3 * self.n_ff_exp * self.n_embd * 2


class TinyMoeOverrides(TypedDict, total=False):
    """The fields of :class:`TinyMoeConfig` as keyword overrides (``write_tinymoe(dir, seed=99)``)."""
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    context_length: int
    seed: int
    shards: int
    printable_only: bool


PRESETS: dict[str, TinyMoeConfig] = {
    # what the tests run: ~1.7 MiB, loads in tens of milliseconds
    "tiny": TinyMoeConfig(),
    # the GPU run: ~7.3 GB of F16 experts (12 layers x 64 experts x 9.4 MiB), Qwen3-30B-A3B-like widths
    "gpu": TinyMoeConfig(n_layer=12, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128, n_expert=64,
                         n_expert_used=8, n_ff_exp=768, context_length=8192, shards=4),
}


# -- the tokenizer ------------------------------------------------------------------------------------------------
def vocabulary() -> tuple[list[str], list[int], list[str], list[bool]]:
    """(tokens, token types, merges, printable-mask). Byte tokens in byte order, then merges, then specials."""
    from gguf.vocab import bytes_to_unicode   # GPT-2's byte → printable character map (the gguf library's)

    b2u = bytes_to_unicode()
    u2b = {u: b for b, u in b2u.items()}
    tokens = [b2u[b] for b in range(256)]
    for a, b in MERGES:
        assert a in tokens and b in tokens, (a, b)
        tokens.append(a + b)
    types = [1] * len(tokens)               # NORMAL
    tokens += list(SPECIAL_TOKENS)
    types += [3] * len(SPECIAL_TOKENS)      # CONTROL
    printable = []
    for tok, typ in zip(tokens, types):
        if typ != 1:
            printable.append(False)
            continue
        raw = bytes(u2b[ch] for ch in tok)
        printable.append(all(0x20 <= c <= 0x7E for c in raw))
    return tokens, types, [f"{a} {b}" for a, b in MERGES], printable


# -- the tensors --------------------------------------------------------------------------------------------------
def _rng(cfg: TinyMoeConfig, name: str) -> np.random.Generator:
    digest = hashlib.sha256(f"{cfg.seed}:{name}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def _normal(cfg: TinyMoeConfig, name: str, shape: tuple[int, ...], scale: float) -> np.ndarray:
    """Seeded N(0, scale) in F16. Large tensors repeat a seeded 4M-value block (the content is irrelevant for
    speed runs and this keeps a several-GB model's generation disk-bound)."""
    rng = _rng(cfg, name)
    n = int(np.prod(shape))
    block = min(n, 1 << 22)
    base = (rng.standard_normal(block, dtype=np.float32) * scale).astype(np.float16)
    if block == n:
        return base.reshape(shape)
    reps = -(-n // block)
    return np.tile(base, reps)[:n].reshape(shape)


def tensor_specs(cfg: TinyMoeConfig, n_vocab: int) -> list[tuple[str, tuple[int, ...], type]]:
    """(name, numpy shape, dtype) of every tensor, in file order. Numpy shapes are ggml's reversed."""
    e, q, kv = cfg.n_embd, cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    specs: list[tuple[str, tuple[int, ...], type]] = [("token_embd.weight", (n_vocab, e), np.float16)]
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        specs += [
            (p + "attn_norm.weight", (e,), np.float32),
            (p + "attn_q.weight", (q, e), np.float16),
            (p + "attn_k.weight", (kv, e), np.float16),
            (p + "attn_v.weight", (kv, e), np.float16),
            (p + "attn_q_norm.weight", (cfg.head_dim,), np.float32),
            (p + "attn_k_norm.weight", (cfg.head_dim,), np.float32),
            (p + "attn_output.weight", (e, q), np.float16),
            (p + "ffn_norm.weight", (e,), np.float32),
            (p + "ffn_gate_inp.weight", (cfg.n_expert, e), np.float32),
            (p + "ffn_gate_exps.weight", (cfg.n_expert, cfg.n_ff_exp, e), np.float16),
            (p + "ffn_up_exps.weight", (cfg.n_expert, cfg.n_ff_exp, e), np.float16),
            (p + "ffn_down_exps.weight", (cfg.n_expert, e, cfg.n_ff_exp), np.float16),
        ]
    specs += [("output_norm.weight", (e,), np.float32), ("output.weight", (n_vocab, e), np.float16)]
    return specs


def make_tensor(cfg: TinyMoeConfig, name: str, shape: tuple[int, ...], dtype: type,
                printable: list[bool]) -> np.ndarray:
    if name.endswith("norm.weight"):
        return np.ones(shape, dtype=np.float32)
    if name == "token_embd.weight":
        t = _normal(cfg, name, shape, 1.0)
        t[:, 0] = EMBD_CONST
        return t
    if name == "output.weight":
        t = _normal(cfg, name, shape, 1.0)
        t[:, 0] = 0.0
        if cfg.printable_only:
            t[~np.asarray(printable), 0] = BLOCK_WEIGHT * np.sqrt(cfg.n_embd)
        else:   # still never sample the special tokens, so the reply runs into the raw bytes
            t[np.asarray([i >= len(printable) - len(SPECIAL_TOKENS) for i in range(len(printable))]), 0] = \
                BLOCK_WEIGHT * np.sqrt(cfg.n_embd)
        return t
    if name.endswith("ffn_gate_inp.weight"):
        return _normal(cfg, name, shape, 1.0).astype(np.float32)
    fan_in = shape[-1]
    t = _normal(cfg, name, shape, 1.0 / np.sqrt(fan_in))
    if name.endswith("attn_output.weight"):
        t[0, :] = 0.0                   # nothing writes to dimension 0
    elif name.endswith("ffn_down_exps.weight"):
        t[:, 0, :] = 0.0
    return t.astype(dtype, copy=False)


# -- writing ------------------------------------------------------------------------------------------------------
@dataclass
class WriteProgress:
    tensor: str
    done_bytes: int
    total_bytes: int
    elapsed_s: float


def shard_paths(out_dir: Path, shards: int) -> list[Path]:
    if shards <= 1:
        return [Path(out_dir) / f"{BASENAME}.gguf"]
    return [Path(out_dir) / f"{BASENAME}-{i:05d}-of-{shards:05d}.gguf" for i in range(1, shards + 1)]


def iter_write(out_dir: Path | str, cfg: TinyMoeConfig | None = None) -> Iterator[WriteProgress]:
    """Write the model into ``out_dir``, yielding progress after each tensor. The first shard is
    ``shard_paths(out_dir, cfg.shards)[0]``; a ``tinymoe.json`` beside it records the config."""
    import gguf  # the writer library; imported here so `import engine_manager.testing.tinymoe` stays cheap

    cfg = cfg or PRESETS["tiny"]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokens, types, merges, printable = vocabulary()
    n_vocab = len(tokens)
    specs = tensor_specs(cfg, n_vocab)
    per_shard = -(-len(specs) // max(1, cfg.shards))
    w = gguf.GGUFWriter(out_dir / f"{BASENAME}.gguf", ARCH,
                        split_max_tensors=per_shard if cfg.shards > 1 else 0)
    w.add_name(f"tinymoe {cfg.n_layer}L {cfg.n_expert}x{cfg.n_expert_used} e{cfg.n_embd} (random weights)")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_context_length(cfg.context_length)
    w.add_embedding_length(cfg.n_embd)
    w.add_block_count(cfg.n_layer)
    w.add_feed_forward_length(cfg.n_ff_exp)
    w.add_expert_feed_forward_length(cfg.n_ff_exp)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_head_kv)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(cfg.n_expert)
    w.add_expert_used_count(cfg.n_expert_used)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for name, shape, dtype in specs:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        w.add_tensor_info(name, shape, np.dtype(dtype), nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    total = sum(int(np.prod(s)) * np.dtype(d).itemsize for _, s, d in specs)
    done = 0
    t0 = time.monotonic()
    for name, shape, dtype in specs:
        t = make_tensor(cfg, name, shape, dtype, printable)
        w.write_tensor_data(t)
        done += t.nbytes
        del t
        yield WriteProgress(name, done, total, time.monotonic() - t0)
    w.close()
    (out_dir / f"{BASENAME}.json").write_text(json.dumps(
        {"config": asdict(cfg), "files": [p.name for p in shard_paths(out_dir, cfg.shards)],
         "n_vocab": n_vocab, "expert_bytes": cfg.expert_bytes()}, indent=1))


def write_tinymoe(out_dir: Path | str, cfg: TinyMoeConfig | None = None,
                  **overrides: Unpack[TinyMoeOverrides]) -> Path:
    """Write the model and return the path of its first shard. ``overrides`` replace config fields."""
    cfg = replace(cfg or PRESETS["tiny"], **overrides)
    for _ in iter_write(out_dir, cfg):
        pass
    return shard_paths(Path(out_dir), cfg.shards)[0]


def main(argv: list[str] | None = None, out: Callable[[str], None] = print) -> int:
    p = argparse.ArgumentParser(prog="python -m engine_manager.testing.tinymoe",
                                description="Write a deterministic random-weight qwen3moe GGUF that llama-server runs.")
    p.add_argument("dir", type=Path, help="output folder")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    for f in ("n_layer", "n_embd", "n_head", "n_head_kv", "head_dim", "n_expert", "n_expert_used", "n_ff_exp",
              "context_length", "seed", "shards"):
        p.add_argument("--" + f.replace("_", "-"), type=int, default=None, dest=f)
    p.add_argument("--any-bytes", action="store_true",
                   help="no printable-only output bias (replies then contain invalid UTF-8: for error tests)")
    args = p.parse_args(argv)
    cfg = replace(PRESETS[args.preset], **{k: v for k, v in vars(args).items()
                                             if k in TinyMoeConfig.__dataclass_fields__ and v is not None})
    if args.any_bytes:
        cfg = replace(cfg, printable_only=False)
    if cfg.n_expert_used > cfg.n_expert or cfg.shards < 1 or cfg.n_head % cfg.n_head_kv:
        p.error("need n_expert_used <= n_expert, shards >= 1 and n_head a multiple of n_head_kv")
    last = 0.0
    prog = None
    for prog in iter_write(args.dir, cfg):
        if prog.elapsed_s - last >= 2.0:
            last = prog.elapsed_s
            rate = prog.done_bytes / max(prog.elapsed_s, 1e-6)
            eta = (prog.total_bytes - prog.done_bytes) / max(rate, 1.0)
            out(f"  {prog.done_bytes / 1e9:.2f}/{prog.total_bytes / 1e9:.2f} GB  {rate / 1e6:.0f} MB/s  "
                f"ETA {eta:.0f} s", )
    first = shard_paths(args.dir, cfg.shards)[0]
    total = prog.total_bytes if prog else 0
    out(f"wrote {first} ({cfg.shards} shard(s), {total / 1e6:.1f} MB of tensors, {cfg.n_layer} MoE layers, "
        f"{cfg.n_expert} experts / {cfg.n_expert_used} used)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
