"""tools/strata_tokenizer.py - STAND-IN (dsv41 panel test fixture) for Strata's tokenizer module and exporter.

What Strata does (facts, no code taken):
- `python tools/strata_tokenizer.py --gguf SHARD1 --out PACK` writes PACK/tokenizer/ (Niko1221/Strata tools/iq_pack.py
  @0902837 `main()`: it runs this script when tokenizer/vocab.json or tokenizer/chat_template.jinja is missing).
- The files: vocab.json ({token: id}), merges.txt (one merge a line), token_type.json (the GGUF token types) and
  chat_template.jinja (the model's template) - serve/server.py @2291cb3 `main()` reads vocab.json, merges.txt
  (split on "\\n") and token_type.json into `strata_tokenizer.Tokenizer(tokens, merges, types)`; the template is
  optional (`tpath / "chat_template.jinja"`).

- It needs the third-party package `regex`, which Strata's setup installs into the release's own .venv (setup.py
  @28c47b1 PY_PACKAGES, pip_install): the stand-in imports a module of that NAME at module level (a stub that exists
  only in the stand-in release's .venv, tests/strata_release/venv-site-packages/regex), so this script, the server and
  iq_pack that load it run only under the release's .venv Python, as Strata's do.

This stand-in's Tokenizer is this project's own: the GPT-2 byte-to-unicode mapping, the special tokens (token type 3
"control" and 4 "user defined") matched literally, and a greedy longest match over the vocabulary for the rest.
It really reads the exported files; it is not Strata's BPE (the merges only have to be well-formed).
"""
from __future__ import annotations

import argparse
import codecs
import json
import pathlib
import sys

import regex  # noqa: F401,E402 - the release's .venv package (see the docstring); nothing is used from it

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import gguf_reader as G  # noqa: E402

SPECIAL_TYPES = (3, 4)


def bytes_to_unicode() -> dict:
    """GPT-2's reversible byte -> printable character table (the published algorithm)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


B2U = bytes_to_unicode()
U2B = {v: k for k, v in B2U.items()}


class Tokenizer:
    def __init__(self, tokens: list, merges: list, types: list):
        if len(types) != len(tokens):
            raise ValueError(f"token_type.json has {len(types)} entries for {len(tokens)} tokens")
        if any(t is None for t in tokens):
            raise ValueError("vocab.json does not number its tokens 0..n-1")
        for m in merges:
            if m and len(m.split(" ")) != 2:
                raise ValueError(f"merges.txt: a line that is not two pieces: {m[:40]!r}")
        self.tokens, self.types, self.merges = tokens, types, [m for m in merges if m]
        self.ids = {t: i for i, t in enumerate(tokens)}
        self.special = {t: i for i, t in enumerate(tokens) if types[i] in SPECIAL_TYPES}
        self.max_len = max((len(t) for i, t in enumerate(tokens) if types[i] not in SPECIAL_TYPES), default=1)

    @classmethod
    def from_dir(cls, tdir) -> "Tokenizer":
        tdir = pathlib.Path(tdir)
        vocab = json.loads((tdir / "vocab.json").read_text(encoding="utf-8"))
        tokens = [None] * len(vocab)
        for t, i in vocab.items():
            tokens[i] = t
        merges = (tdir / "merges.txt").read_text(encoding="utf-8").split("\n")
        types = json.loads((tdir / "token_type.json").read_text(encoding="utf-8"))
        return cls(tokens, merges, types)

    def _plain(self, text: str) -> list:
        s = "".join(B2U[b] for b in text.encode("utf-8"))
        out, i = [], 0
        while i < len(s):
            for n in range(min(self.max_len, len(s) - i), 0, -1):
                tid = self.ids.get(s[i:i + n])
                if tid is not None and self.types[tid] not in SPECIAL_TYPES:
                    out.append(tid)
                    i += n
                    break
            else:
                raise ValueError(f"the vocabulary cannot spell {s[i]!r} (byte {U2B.get(s[i])})")
        return out

    def encode(self, text: str, parse_special: bool = True) -> list:
        if not parse_special or not self.special:
            return self._plain(text)
        out, i, start = [], 0, 0
        names = sorted(self.special, key=len, reverse=True)
        while i < len(text):
            hit = next((n for n in names if text.startswith(n, i)), None)
            if hit is None:
                i += 1
                continue
            if start < i:
                out += self._plain(text[start:i])
            out.append(self.special[hit])
            i = start = i + len(hit)
        if start < len(text):
            out += self._plain(text[start:])
        return out

    def piece_bytes(self, tid: int) -> bytes:
        t = self.tokens[tid]
        if self.types[tid] in SPECIAL_TYPES:
            return t.encode("utf-8")
        return bytes(U2B.get(c, 63) for c in t)

    def decode(self, ids) -> str:
        return b"".join(self.piece_bytes(int(t)) for t in ids).decode("utf-8", "replace")

    def is_special(self, tid: int) -> bool:
        return 0 <= tid < len(self.types) and self.types[tid] in SPECIAL_TYPES


class Detokenizer:
    """Token ids in, text out as soon as it is whole UTF-8."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.dec = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, tid: int) -> str:
        return self.dec.decode(self.tok.piece_bytes(tid))


def export(gguf_path, out_dir) -> pathlib.Path:
    g = G.GGUFFile(gguf_path, tensors=False)
    tokens = g.get("tokenizer.ggml.tokens")
    if not tokens:
        raise SystemExit(f"{gguf_path}: the GGUF has no tokenizer.ggml.tokens")
    types = g.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = g.get("tokenizer.ggml.merges") or []
    tdir = pathlib.Path(out_dir) / "tokenizer"
    tdir.mkdir(parents=True, exist_ok=True)
    (tdir / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}, ensure_ascii=False),
                                     encoding="utf-8")
    (tdir / "merges.txt").write_text("\n".join(merges), encoding="utf-8")
    (tdir / "token_type.json").write_text(json.dumps(types), encoding="utf-8")
    tpl = g.get("tokenizer.chat_template")
    if tpl:
        (tdir / "chat_template.jinja").write_text(tpl, encoding="utf-8")
    print(f"tokenizer: {len(tokens)} tokens, {len(merges)} merges -> {tdir}", flush=True)
    return tdir


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    export(a.gguf, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
