"""tools/iq_pack.py - STAND-IN (dsv41 panel test fixture) for Strata's native-pack tool. No Strata code is in it.

    python tools/iq_pack.py --gguf <model>-00001-of-0000N.gguf --out <data>/packs/<model>

What it copies from Strata (facts, each from Niko1221/Strata tools/iq_pack.py @0902837, `main()` unless said):
- the arguments: --gguf (required, shard 1), --out (required), --base, --skip-experts, --compat-bf16, --experts-bin;
- every shard of the model is found BY NAME beside --gguf (`Model.__init__`: <name>-0000N-of-0000M.gguf), a missing
  one is `FileNotFoundError("missing model shards (wait for the download): ...")`; a name without that pattern is
  read as a one-file model;
- the order of the writes: dense.bin and index.txt first (`index_standalone`, `write_index`; both written in place,
  NOT atomically), then tokenizer/ through `tools/strata_tokenizer.py --gguf SRC --out OUT` when vocab.json or
  chat_template.jinja is missing, then native_experts.txt - written to `native_experts.txt.tmp` and renamed only when
  every layer is in (the completion marker: "a stop part-way ... left a partial native_experts.txt that the next setup
  run took as a finished pack (#172)");
- its lines: "model shards: a, b", "index.txt: %d tensors, %d served natively, %d in extra.bin, arena %.2f GiB";
  with --experts-bin, after the marker, experts.bin with "  layer %2d  %-8s/%-7s blob %8d  at %.2f GiB" every 8th
  layer and "experts.bin: %d layers, %.2f GiB" (written here as a sparse file of the right size);
- the header of native_experts.txt ("# strata native experts v3: ... (n_expert %d, total %d; ...)") and one line per
  expert layer: layer gu_type d_type offset blob_bytes gate_off up_off down_off [shard name when not shard 1].

Stand-in liberties (said, not hidden):
- dense.bin gets the size Strata's would have (the float tensors, 64-byte aligned) but zero bytes (a sparse file):
  the replica's shards hold no weights, and copying tens of GB of zeros helps no test;
- conversions.json is written (docs/ENGINE_CONTRACT.md §2 lists it; the iq_pack.py read at @0902837 writes
  compat-bf16.json only with --compat-bf16 and no conversions.json - that version difference is not settled);
- the expert count comes from the first router tensor found (Strata reads blk.0.ffn_gate_inp, which a DeepSeek model
  with leading dense layers does not have);
- a split model (split.count > 1) whose shard 1 is not named <name>-00001-of-0000N.gguf is refused in words: Strata
  would read shard 1 alone and write a pack without the other shards' layers.
- SPLIT_LAYERS: Strata @0902837 refuses a layer whose gate/up/down expert tensors lie in different shards ("layer %d:
  its gate/up/down tensors are in different shards", exit 1). The DeepSeek-V4.1-Flash split (and this project's
  replica of it, engine_manager.replica) puts several layers across two shards, and deepseek-one-gpu runs those
  files, so the fork must take them: by default the stand-in does, naming the three shards ("gate,up,down") at the end
  of that layer's line - a format of its own. STRATA_STANDIN_STRICT_SHARDS=1 gives Strata's refusal.

Architecture: upstream @d4e6823 refuses any model that is not qwen4exp or glm5-next with "unsupported architecture
'X'" (stdout), exit 1. The stand-in also takes deepseek2 (the fork's, which this project's replica is), unless
STRATA_STANDIN_UPSTREAM_ARCHES=1 gives upstream's refusal (the tiny test model's qwen3moe is taken too).

Fault switch (for "a killed step leaves a file that merely exists" tests):
  STRATA_STANDIN_PACK_FAIL=after-dense   die (exit 1) after writing half of dense.bin: no index.txt, tokenizer/ or
                                         native_experts.txt
  STRATA_STANDIN_PACK_FAIL=after-index   die after index.txt and dense.bin, before tokenizer/ and the marker
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

import numpy  # noqa: F401,E402 - iq_pack.py @d4e6823 imports numpy at its top: only the release's .venv has it

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import gguf_reader as G  # noqa: E402

FLOAT = {"BF16", "F32", "F16"}
# the architectures upstream packs (tools/iq_pack.py @d4e6823: qwen4exp and GLM_ARCHES); the deepseek-one-gpu fork must
# add DeepSeek's (its code is not readable here). The stand-in also takes the replica's deepseek2 and the tiny test
# model's qwen3moe (engine_manager.testing.tinymoe) - a liberty - unless STRATA_STANDIN_UPSTREAM_ARCHES=1
UPSTREAM_ARCHES = ("qwen4exp", "glm5-next", "glm5next")
FORK_ARCHES = ("deepseek2", "qwen3moe")
ALIGN = 64
ROLES = ("gate", "up", "down")


def die(where: str) -> None:
    if os.environ.get("STRATA_STANDIN_PACK_FAIL") == where:
        print(f"[stand-in] STRATA_STANDIN_PACK_FAIL={where}: stopping here", file=sys.stderr, flush=True)
        os._exit(1)


class Model:
    def __init__(self, first: pathlib.Path):
        paths = G.split_paths(first)
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise FileNotFoundError("missing model shards (wait for the download): " + ", ".join(missing))
        self.paths = paths
        self.where = {}
        self.files = []
        for p in paths:
            g = G.GGUFFile(p)
            self.files.append(g)
            size = p.stat().st_size
            for t in g.tensors:
                n = t.expected_bytes()
                if n is None or g.data_start + t.offset + n > size:
                    raise ValueError(f"{p.name}: unsupported or truncated tensor {t.name}")
                if t.name in self.where:
                    raise ValueError(f"{p.name}: duplicate tensor {t.name}")
                self.where[t.name] = (g, t, p)
        count = int(self.files[0].get("split.count", 1) or 1)
        if count > 1 and len(paths) == 1:
            raise SystemExit(f"{first.name}: the model is split into {count} files (split.count) but this name is not "
                             "<name>-00001-of-0000N.gguf, so its other shards cannot be found beside it (Strata finds "
                             "them by name); give the shards their split names")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True, help="the model's shard 1")
    ap.add_argument("--base", help="optional: a Q2_0 canonical pack whose dense.bin holds the shared float tensors")
    ap.add_argument("--out", required=True)
    ap.add_argument("--skip-experts", action="store_true", help="rewrite the index only")
    ap.add_argument("--compat-bf16", action="store_true")
    ap.add_argument("--experts-bin", action="store_true")
    a = ap.parse_args()
    if a.compat_bf16 and a.base:
        ap.error("--compat-bf16 cannot reuse --base dense weights")
    if a.base:
        ap.error("--base: not modelled by the stand-in")
    src = pathlib.Path(a.gguf).absolute()
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    # tools/iq_pack.py @d4e6823 main(): `if arch not in ("qwen4exp", *GLM_ARCHES): print(f"unsupported architecture
    # {arch!r}"); return 1` - before any file of the pack is written
    arch = str(G.GGUFFile(src, tensors=False).get("general.architecture", "") or "")
    allowed = UPSTREAM_ARCHES + (() if os.environ.get("STRATA_STANDIN_UPSTREAM_ARCHES") == "1" else FORK_ARCHES)
    if arch not in allowed:
        print(f"unsupported architecture {arch!r}", flush=True)
        return 1
    model = Model(src)
    if len(model.paths) > 1:
        print("model shards: " + ", ".join(p.name for p in model.paths), flush=True)

    # ---- dense.bin + index.txt (in place, as Strata writes them)
    rows, at, served = [], 0, 0
    for name, (_g, t, _p) in model.where.items():
        if name.startswith("blk.") and name.endswith("_exps.weight"):
            continue
        ne0 = t.shape[0]
        ne1 = t.shape[1] if len(t.shape) > 1 else 0
        if t.type_name in FLOAT:
            n = t.expected_bytes()
            kind = {"BF16": "4", "F16": "5", "F32": "2"}[t.type_name]
            rows.append([name, "0", kind, str(at), str(n), "0", str(n), str(ne0), str(ne1), "0", "0", "1"] + ["0"] * 7)
            at += n + (-n) % ALIGN
        else:
            served += 1
            rows.append([name, "0", "0", "0", "0", "0", "0", str(ne0), str(ne1), "8", "0", "32"] + ["0"] * 7)
    with open(out / "dense.bin", "wb") as fo:
        if os.environ.get("STRATA_STANDIN_PACK_FAIL") == "after-dense":
            fo.truncate(at // 2)
            fo.flush()
            die("after-dense")
        fo.truncate(at)
    pool = 0
    for r in rows:
        r[5] = str(pool)
        pool += (int(r[6]) + ALIGN - 1) // ALIGN * ALIGN
    with open(out / "index.txt", "w", encoding="utf-8", newline="\n") as fo:
        fo.write("# strata pack index v3 -- generated by tools/iq_pack.py (native experts) from %s\n" % src.name)
        fo.write("# align %d pool %d tensors %d\n" % (ALIGN, pool, len(rows)))
        for r in rows:
            fo.write(" ".join(r) + "\n")
    print("index.txt: %d tensors, %d served natively, %d in extra.bin, arena %.2f GiB"
          % (len(rows), served, 0, pool / 2**30), flush=True)
    (out / "conversions.json").write_text(json.dumps({"source": str(src), "tensors": []}, indent=2) + "\n",
                                          encoding="utf-8")
    die("after-index")

    # ---- tokenizer/ through the tokenizer tool, as Strata does
    if not (out / "tokenizer" / "vocab.json").exists() or not (out / "tokenizer" / "chat_template.jinja").exists():
        subprocess.run([sys.executable, str(HERE / "strata_tokenizer.py"), "--gguf", str(src), "--out", str(out)],
                       check=True)

    # ---- the experts: native_experts.txt through a temporary name (the completion marker)
    T = {n: w[1] for n, w in model.where.items()}
    layers = sorted({int(n.split(".")[1]) for n in T if n.startswith("blk.") and n.endswith("_exps.weight")})
    if not layers:
        print("the model has no expert tensors (blk.N.ffn_*_exps.weight)")
        return 1
    router = next((T[f"blk.{l}.ffn_gate_inp.weight"] for l in layers if f"blk.{l}.ffn_gate_inp.weight" in T), None)
    if router is None:
        print("the model has no router tensor (blk.N.ffn_gate_inp.weight)")
        return 1
    n_expert = int(router.shape[1])
    layout, offset = [], 0
    for l in layers:
        ts = [T.get("blk.%d.ffn_%s_exps.weight" % (l, r)) for r in ROLES]
        if any(t is None for t in ts):
            print("layer %d: gate, up and down experts are not all there" % l)
            return 1
        per = [t.expected_bytes() // n_expert for t in ts]
        if per[0] != per[1] or ts[0].type_id != ts[1].type_id:
            print("layer %d: gate and up differ in type" % l)
            return 1
        blob = sum(per)
        layout.append((l, ts[0].type_id, ts[2].type_id, offset, blob, ts))
        offset += blob * n_expert
    tmp = out / "native_experts.txt.tmp"
    with open(tmp, "w", encoding="utf-8", newline="\n") as fo:
        fo.write("# strata native experts v3: layer gu_type d_type offset blob_bytes gate_off up_off down_off [shard] "
                 "(n_expert %d, total %d; absolute offsets in %s, or in the named shard beside it)\n"
                 % (n_expert, offset, src.name))
        for l, gt, dt, off, blob, ts in layout:
            ws = [model.where[t.name] for t in ts]
            if len({w[2] for w in ws}) != 1 and os.environ.get("STRATA_STANDIN_STRICT_SHARDS") == "1":
                print("layer %d: its gate/up/down tensors are in different shards" % l)
                fo.close()
                tmp.unlink()
                return 1
            offs = [w[0].data_start + t.offset for w, t in zip(ws, ts)]
            line = "%d %d %d %d %d %d %d %d" % (l, gt, dt, off, blob, *offs)
            names = [w[2].name for w in ws]
            if len(set(names)) > 1:                       # the fork's case, see SPLIT_LAYERS above
                line += " " + ",".join(names)
            elif ws[0][2] != src:
                line += " " + names[0]
            fo.write(line + "\n")
    tmp.replace(out / "native_experts.txt")
    if a.skip_experts or not a.experts_bin:
        if (out / "experts.bin").exists() and not a.experts_bin:
            print("note: %s/experts.bin exists; the engine reads it instead of the GGUF" % out)
        return 0
    # --experts-bin: the experts in the pack's own file, after the marker (as Strata orders it), with its progress
    # lines every 8 layers; the stand-in writes the size, not the bytes (a sparse file)
    path = out / "experts.bin"
    if path.exists() and path.stat().st_size == offset:
        print("experts.bin exists with the right size; not rewritten")
        return 0
    with open(path, "wb") as fo:
        for l, _gt, _dt, off, blob, ts in layout:
            fo.truncate(off + blob * n_expert)
            if l % 8 == 0:
                print("  layer %2d  %-8s/%-7s blob %8d  at %.2f GiB" % (l, ts[0].type_name, ts[2].type_name, blob,
                                                                        off / 2**30), flush=True)
    print("experts.bin: %d layers, %.2f GiB" % (len(layout), offset / 2**30))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
