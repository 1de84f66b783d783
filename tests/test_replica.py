"""engine_manager.replica: the header-faithful sparse replica of DeepSeek-V4.1-Flash Q2_K."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest

from engine_manager import fmt, replica as R
from engine_manager.tensor_layout import read_layout, read_shard_header
from engine_manager.replica import ReplicaSpec, disk_usage_bytes, write_replica

ROOT = Path(__file__).resolve().parent.parent
GiB, MiB = fmt.GIB, fmt.MIB


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    d = tmp_path_factory.mktemp("replica")
    return write_replica(d, ReplicaSpec())


def test_seven_sparse_shards_of_the_right_names_and_sizes(full):
    names = [p.name for p in full.paths]
    assert names == [f"DeepSeek-V4.1-Flash-Q2_K-{i:05d}-of-00007.gguf" for i in range(1, 8)]
    assert sum(p.stat().st_size for p in full.paths) == full.total_bytes
    assert abs(full.total_bytes - 264_500_000_000) < 1_000_000
    # sparse: only the headers take disk (shard 1 carries ~5 MB of tokenizer)
    assert disk_usage_bytes(full.paths) < 16 * MiB
    sizes = [p.stat().st_size for p in full.paths]
    assert max(sizes) / min(sizes) < 1.1                     # evenly split, like gguf-split by size


def test_shard_one_carries_the_tokenizer_the_others_only_split_keys(full):
    h1 = read_shard_header(full.paths[0])
    assert h1.metadata["tokenizer.ggml.tokens"].count == 163_840
    assert h1.metadata["tokenizer.ggml.merges"].count == 163_328
    assert h1.header_bytes > 4 * MiB
    assert h1.metadata["general.architecture"] == "deepseek2"
    assert h1.metadata["deepseek2.expert_count"] == 384
    assert h1.metadata["deepseek2.expert_used_count"] == 6
    assert "replica" in h1.metadata["general.description"]
    for i, p in enumerate(full.paths[1:], start=1):
        h = read_shard_header(p)
        assert set(h.metadata) == {"split.no", "split.count", "split.tensors.count"}
        assert h.metadata["split.no"] == i and h.metadata["split.count"] == 7
        assert h.data_offset % 32 == 0


def test_the_library_reads_it(full):
    """gguf.GGUFReader (the reference reader) agrees on a small shard's tensors and the split keys."""
    r = gguf.GGUFReader(full.paths[3])
    assert int(r.fields["split.count"].parts[-1][0]) == 7
    lay = read_layout(full.paths[0].parent)
    mine = {t.name: t for t in lay.tensors if t.shard == 4}
    assert {t.name for t in r.tensors} == set(mine)
    for t in r.tensors:
        assert int(t.data_offset) == mine[t.name].offset


def test_hyperparameters_are_the_documented_ones(full):
    s = ReplicaSpec()
    assert s.expert_bytes == 12_810_240
    assert s.expert_bytes * 15_360 / GiB == pytest.approx(183.25, abs=0.01)
    lay = read_layout(full.paths[0])
    assert lay.hparams["embedding_length"] == 7680 and lay.hparams["expert_feed_forward_length"] == 1536
    assert lay.hparams["leading_dense_block_count"] == 3 and lay.hparams["block_count"] == 43
    assert lay.hparams["vocab_size"] == 163_840


def test_fast_writer_writes_the_same_bytes_as_gguf(tmp_path):
    """The one speed-up over gguf.GGUFWriter (packing long arrays in one go) must not change a byte."""
    spec = ReplicaSpec.small(vocab=700, n_merges=300, with_chat_template=True)
    a, b = tmp_path / "a", tmp_path / "b"
    write_replica(a, spec)
    stock = R._fast_writer_class
    try:
        R._fast_writer_class = lambda: gguf.GGUFWriter
        write_replica(b, spec)
    finally:
        R._fast_writer_class = stock
    for fa in sorted(a.iterdir()):
        assert fa.read_bytes() == (b / fa.name).read_bytes()


def test_small_replica_and_variants(tmp_path):
    r = write_replica(tmp_path / "s", ReplicaSpec.small())
    lay = read_layout(tmp_path / "s")
    assert len(r.paths) == 2 and lay.n_routed_experts == 4 * 16
    v = replace(ReplicaSpec(), n_head=64, vocab=129_280, n_merges=127_741, t_attn="Q8_0", t_shared="Q8_0",
                engram_layers=(), target_total_bytes=None)
    write_replica(tmp_path / "v", v)
    lv = read_layout(tmp_path / "v")
    assert lv.n_routed_experts == 15_360 and lv.moe_layers == list(range(3, 43))
    assert lv.bytes_by_kind()["attention"] != read_layout(r.paths[0]).bytes_by_kind()["attention"]
    assert not any("engram" in t.name for t in lv.tensors)


def test_rewriting_replaces_the_old_shards(tmp_path):
    write_replica(tmp_path, ReplicaSpec.small(n_shards=3))
    write_replica(tmp_path, ReplicaSpec.small(n_shards=2))
    assert len(list(tmp_path.glob("*.gguf"))) == 2
    assert len(read_layout(tmp_path).shards) == 2


def test_bad_type_name_is_refused():
    with pytest.raises(ValueError, match="unknown ggml type"):
        R._nbytes("Q9_X", (256,))
    with pytest.raises(ValueError, match="not a multiple"):
        R._nbytes("Q2_K", (100,))


def test_runnable_as_a_module(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "engine_manager.replica", str(tmp_path / "m"), "--small"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "wrote 2 shards" in out.stdout
    assert read_layout(tmp_path / "m").n_routed_experts == 64


def test_synthetic_vocab_is_tokenizer_shaped():
    toks, types, merges = R.synthetic_vocab(163_840, 163_328)
    assert len(toks) == 163_840 == len(types) and len(merges) == 163_328
    assert len(set(toks)) == len(toks)
    assert toks[0] == "Ā" and toks[33] == "!" and types[-1] == 3
    assert np.mean([len(t) for t in toks]) < 8
