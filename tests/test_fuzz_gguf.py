"""Hostile GGUF headers: every case ends in a valid layout (planned without error) or a
plain LayoutError naming the file, never another exception; the hostile shapes are refused within bounded memory.

The corpus is ``benchmarks/fuzz_gguf.py``'s (seeded; a real two-shard model written with ``gguf`` and damaged);
the benchmark runs a longer corpus with time and memory per case.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tracemalloc
from collections import Counter
from pathlib import Path

import pytest

from engine_manager import tensor_layout as L
from engine_manager.tensor_layout import LayoutError, read_layout

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("fuzz_gguf", ROOT / "benchmarks" / "fuzz_gguf.py")
fz = sys.modules.setdefault("fuzz_gguf", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(fz)

SEED, CASES = 15, 420
MiB = 1 << 20
B = fz.bounds()


def test_the_seeded_corpus_ends_in_layouts_or_plain_refusals(tmp_path):
    """~300 deterministic cases (every key the planner reads × 17 wrong values, split inconsistencies, hostile
    shapes at and past each bound) and seeded byte mutations of the gguf-written model."""
    outcomes: Counter[tuple[str, str]] = Counter()
    crashes = []
    n = 0
    for case in fz.corpus(SEED, CASES, tmp_path / "cache"):
        d = tmp_path / f"c{case.id}"
        outcome, detail = fz.run_case(case.build(d))
        shutil.rmtree(d, ignore_errors=True)
        outcomes[case.kind, outcome] += 1
        n += 1
        if outcome == "crash":
            crashes.append(f"case {case.id} ({case.kind}: {case.what}):\n{detail}")
    assert not crashes, f"{len(crashes)} of {n} cases raised something else than a plain refusal:\n" + \
        "\n".join(crashes[:5])
    assert n >= CASES
    # the corpus reaches both ends: valid models are planned, damaged ones refused, in every family
    assert outcomes["split", "ok"] >= 2 and outcomes["keytype", "refused"] >= 150
    for kind in ("keytype", "split", "hostile", "trunc", "flip"):
        assert outcomes[kind, "refused"] > 0, outcomes


def _model(tmp_path: Path, **kw) -> Path:
    return fz.write_model(tmp_path / "m", **kw)


@pytest.mark.parametrize("key,value,vtype,shard", [
    ("split.no", "abc", "STRING", 2),
    ("split.no", [1, 2], "ARRAY", 1),
    ("split.count", 2.0, "FLOAT32", 2),
    ("split.tensors.count", -1, "INT32", 2),
    ("deepseek2.expert_count", "abc", "STRING", 1),
    ("deepseek2.embedding_length", float("inf"), "FLOAT32", 1),
    ("deepseek2.embedding_length", [64, 64], "ARRAY", 1),
    ("deepseek2.attention.head_count", float("inf"), "FLOAT32", 1),
    ("deepseek2.attention.head_count", float("nan"), "FLOAT64", 1),
    ("deepseek2.block_count", True, "BOOL", 1),
    ("deepseek2.expert_used_count", 1 << 40, "UINT64", 1),
    ("general.architecture", 7, "INT32", 1),
])
def test_a_key_of_the_wrong_type_is_refused_naming_the_key_and_the_file(tmp_path, key, value, vtype, shard):
    """Before the fix: TypeError (``no + 1`` on a string, ``sorted`` of None and an int), ValueError (``int('abc')``,
    ``int(nan)``) or OverflowError (``int(inf)``) from build_layout or the planner."""
    over = {key: (value, vtype)}
    d = _model(tmp_path, **({"kv_over": over} if shard == 1 else {"shard2_over": over}))
    with pytest.raises(LayoutError) as ei:
        lay = read_layout(d)
        fz.run_case(d)
        pytest.fail(f"planned {lay.name}")
    msg = str(ei.value)
    assert key in msg and fz.shard_name(shard, 2) in msg and "download" in msg.lower(), msg


def test_split_keys_present_in_one_shard_only(tmp_path):
    """``split.tensors.count`` in shard 1 only: sorting {N, None} raised TypeError before."""
    d = _model(tmp_path, shard2_over={"split.tensors.count": None})
    with pytest.raises(LayoutError, match=r"split.tensors.count \(\d+, absent\)"):
        read_layout(d)
    d2 = fz.write_model(tmp_path / "m2", split_in=(True, False))
    with pytest.raises(LayoutError, match="no split.no / split.count"):
        read_layout(d2)


def test_a_per_layer_head_count_list_is_still_a_model(tmp_path):
    d = _model(tmp_path, kv_over={"deepseek2.attention.head_count": ([4, 4], "ARRAY")})
    assert fz.run_case(d)[0] == "ok"


@pytest.mark.parametrize("what,make", [
    ("nested arrays", lambda: fz.hostile_nested(B.MAX_NESTED + 1)),
    ("empty strings", lambda: fz.hostile_empty_strings(B.MAX_STRINGS + 1)),
    ("strings in all arrays", lambda: fz.hostile_string_arrays(3, B.MAX_STRINGS_TOTAL // 3 + 1, b"ab")),
    ("tiny tensors", lambda: fz.hostile_tensors(B.MAX_TENSORS + 1)),
    ("keys", lambda: fz.hostile_many_keys(B.MAX_KV + 1)),
    ("a long string", lambda: fz.hostile_long_strings(1, B.MAX_STRING + 1)),
    ("kept text", lambda: fz.hostile_long_strings(40, B.MAX_STRING)),
    ("a long tensor name", lambda: fz.hostile_long_name(B.MAX_NAME + 1)),
    ("experts", lambda: fz.hostile_experts(1, B.MAX_EXPERTS + 1)),
    ("expert cells", lambda: fz.hostile_experts(B.MAX_EXPERT_CELLS // 2048 + 1, 2048)),
])
def test_hostile_shapes_past_a_bound_are_refused_in_little_memory(tmp_path, what, make):
    """Item 8: counts beyond what a real model has are refused in plain words, and reading up to the refusal stays
    small (tracemalloc peak < 64 MiB; before, 2^20 tiny tensors took 491 MB, and 16 M empty strings 31 s)."""
    data = make()
    p = tmp_path / "h.gguf"
    p.write_bytes(data)
    del data
    tracemalloc.start()
    try:
        with pytest.raises(LayoutError) as ei:
            read_layout(p)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert str(p) in str(ei.value)
    assert peak < 64 * MiB, f"{what}: peak {peak / MiB:.0f} MiB"


def test_many_strings_the_fast_skip_cannot_chain_are_walked_exactly(tmp_path):
    """The plain walk that takes over after many misses agrees with gguf's reader: the key after 200,000 one-NUL
    strings is read in step."""
    import gguf
    p = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(p, "llama")
    w.add_array("tokenizer.ggml.tokens", ["\0"] * 3000 + ["", "ab"] * 2000 + ["x" * 300] * 500)
    w.add_uint32("after", 77)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    h = L.read_shard_header(p)
    assert h.metadata["after"] == 77
    assert h.metadata["tokenizer.ggml.tokens"] == L.ArraySummary(L.T_STRING, 7500)


def test_plan_cli_names_the_key_and_the_file_without_a_traceback(tmp_path):
    d = _model(tmp_path, kv_over={"deepseek2.expert_count": ("abc", "STRING")})
    env = dict(os.environ, HOME=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "engine_manager", "plan", "--model-dir", str(d), "--no-save"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode in (1, 2) and "deepseek2.expert_count" in r.stderr and "fuzz-00001-of-00002.gguf" in r.stderr
