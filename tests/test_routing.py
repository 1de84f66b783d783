"""engine_manager.expert_routing: STRP profiles and --dump-routing traces byte for byte (docs/ENGINE_CONTRACT.md
§2), frequency tables (merge, decay, files), the coverage curve, and clear errors for malformed files."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from engine_manager import expert_routing as R
from engine_manager.expert_routing import FrequencyTable, RoutingError


def _manual_strp(ranked, nl, ne, slots) -> bytes:
    """The contract's layout written out by hand, independently of the module."""
    out = b"STRP" + struct.pack("<5I", 1, nl, ne, slots, len(ranked))
    for layer, e in ranked:
        out += struct.pack("<HH", layer, e)
    table = [[-1] * ne for _ in range(nl)]
    for i, (layer, e) in enumerate(ranked):
        table[layer][e] = i
    for row in table:
        out += struct.pack(f"<{ne}i", *row)
    return out


def test_strp_exact_bytes_and_round_trip(tmp_path):
    ranked = [(3, 17), (3, 250), (5, 0), (42, 383), (4, 1)]
    want = _manual_strp(ranked, 43, 384, 6)
    assert R.strp_bytes(ranked, 43, 384, 6) == want
    p = R.write_strp(tmp_path / "p.strp", ranked, 43, 384, 6)
    assert p.read_bytes() == want
    assert (p.stat().st_mode & 0o777) == 0o600
    prof = R.read_strp(p)
    assert (prof.n_layers, prof.n_experts, prof.slots, prof.n_ranked) == (43, 384, 6, 5)
    assert prof.pairs() == ranked
    assert prof.ranks[42, 383] == 3 and prof.ranks[0, 0] == -1
    assert len(want) == 24 + 4 * 5 + 4 * 43 * 384


def test_strp_empty_ranking(tmp_path):
    p = R.write_strp(tmp_path / "e.strp", [], 2, 4, 0)
    assert p.read_bytes() == _manual_strp([], 2, 4, 0)
    assert R.read_strp(p).n_ranked == 0


def _blob(**kw) -> bytes:
    b = bytearray(_manual_strp([(0, 1), (1, 2)], 2, 4, 2))
    if "magic" in kw:
        b[0:4] = kw["magic"]
    if "version" in kw:
        b[4:8] = struct.pack("<I", kw["version"])
    if "dims" in kw:
        b[8:16] = struct.pack("<II", *kw["dims"])
    if "n" in kw:
        b[20:24] = struct.pack("<I", kw["n"])
    if "slots" in kw:
        b[16:20] = struct.pack("<I", kw["slots"])
    if "pair0" in kw:
        b[24:28] = struct.pack("<HH", *kw["pair0"])
    if "rank" in kw:
        b[32:36] = struct.pack("<i", kw["rank"])
    if kw.get("cut"):
        b = b[: -kw["cut"]]
    if kw.get("extra"):
        b += b"\0" * kw["extra"]
    return bytes(b)


@pytest.mark.parametrize("blob,match", [
    (b"STR", "shorter than the 24-byte header"),
    (_blob(magic=b"PRTS"), "bad magic"),
    (_blob(version=2), "version 2"),
    (_blob(dims=(0, 4)), "absurd size"),
    (_blob(dims=(5000, 4)), "absurd size"),
    (_blob(n=9), "ranks 9 pairs"),
    (_blob(cut=4), "truncated"),
    (_blob(extra=4), "trailing bytes"),
    (_blob(pair0=(7, 1)), "outside 2 layers"),
    (_blob(pair0=(1, 2)), "ranked twice"),
    (_blob(rank=5), "disagrees"),
    (_blob(slots=99), "absurd slot count"),
])
def test_strp_malformed(tmp_path, blob, match):
    p = tmp_path / "bad.strp"
    p.write_bytes(blob)
    with pytest.raises(RoutingError, match=match) as ei:
        R.read_strp(p)
    assert str(p) in str(ei.value)


def test_strp_write_refuses_bad_input():
    with pytest.raises(RoutingError, match="ranked twice"):
        R.strp_bytes([(0, 1), (0, 1)], 2, 4, 1)
    with pytest.raises(RoutingError, match="outside"):
        R.strp_bytes([(2, 1)], 2, 4, 1)
    # Strata's read_expert_profile: "the header claims more ranked pairs than slots" (src/core/expert_cache.cpp
    # @2249c24) — the engine refuses such a file, so the panel never writes one and never reads one as valid
    with pytest.raises(RoutingError, match="slots"):
        R.strp_bytes([(0, 1), (0, 2)], 2, 4, 1)
    with pytest.raises(RoutingError, match="more ranked pairs than slots"):
        R.parse_strp(_manual_strp([(0, 1), (0, 2)], 2, 4, 1))


# -- traces --------------------------------------------------------------------------------------------------------

def _manual_trace(records) -> bytes:
    out = b""
    for layer, ids, ws in records:
        out += struct.pack("<ii", layer, len(ids)) + struct.pack(f"<{len(ids)}i", *ids)
        out += struct.pack(f"<{len(ws)}f", *ws)
    return out


def test_trace_exact_bytes_and_round_trip(tmp_path):
    recs = [(3, [1, 2, 3, 4, 5, 6], [0.5, 0.1, 0.1, 0.1, 0.1, 0.1]), (4, [6, 5, 4, 3, 2, 1], [0.25] * 6)]
    want = _manual_trace(recs)
    assert R.trace_bytes(recs) == want
    p = R.write_trace(tmp_path / "t.bin", recs)
    assert p.read_bytes() == want
    back = list(R.iter_trace(want))
    assert [(r.layer, r.experts) for r in back] == [(3, [1, 2, 3, 4, 5, 6]), (4, [6, 5, 4, 3, 2, 1])]
    assert back[0].weights[0] == pytest.approx(0.5)
    ft = R.read_trace(p, 43, 384)
    assert ft.counts[3, 1] == 1 and ft.counts[4, 6] == 1 and ft.total == 12


def test_trace_mixed_k_and_cut_short_tail(tmp_path):
    recs = [(0, [1, 2], [0.5, 0.5]), (1, [3], [1.0]), (1, [3, 3, 0], [0.2, 0.2, 0.6])]
    data = _manual_trace(recs) + struct.pack("<ii", 1, 6) + b"\1\0\0\0"      # engine stopped mid-record
    p = tmp_path / "t.bin"
    p.write_bytes(data)
    ft = R.read_trace(p, 2, 4)
    assert ft.counts.tolist() == [[0, 1, 1, 0], [1, 0, 0, 3]]
    assert any("cut short" in n for n in ft.notes)


def test_trace_vectorised_matches_walk():
    rng = np.random.default_rng(3)
    recs = [(int(rng.integers(0, 5)), rng.integers(0, 16, 6).tolist(), [1 / 6] * 6) for _ in range(500)]
    data = R.trace_bytes(recs)
    fast, _ = R.count_trace(data, 5, 16)
    slow = np.zeros((5, 16))
    for r in R.iter_trace(data):
        for e in r.experts:
            slow[r.layer, e] += 1
    assert np.array_equal(fast, slow)


@pytest.mark.parametrize("data,match", [
    (struct.pack("<ii", 0, -3), "absurd expert count"),
    (struct.pack("<ii", 0, 100000), "absurd expert count"),
    (_manual_trace([(9, [1], [1.0])]), "layer 9 outside"),
    (_manual_trace([(0, [1], [1.0]), (0, [77], [1.0])]), "expert id 77 outside"),
    (_manual_trace([(0, [1, 2], [1.0, 1.0]), (0, [-1, 2], [1.0, 1.0])]), "expert id -1"),
    (b"", "no complete routing record"),
    (b"\1\2\3", "no complete routing record"),
])
def test_trace_malformed(tmp_path, data, match):
    p = tmp_path / "bad.bin"
    p.write_bytes(data)
    with pytest.raises(RoutingError, match=match) as ei:
        R.read_trace(p, 2, 4)
    assert str(p) in str(ei.value)


# -- frequency tables -------------------------------------------------------------------------------------------------

def test_merge_decay_and_hit_rate():
    a = FrequencyTable(np.array([[4.0, 0, 0, 0], [0, 2, 2, 0]]))
    b = FrequencyTable(np.array([[0.0, 1, 0, 0], [0, 0, 0, 1]]))
    m = a.merge(b, decay=0.5)
    assert m.counts.tolist() == [[2, 1, 0, 0], [0, 1, 1, 1]]
    assert a.decayed(0.25).total == 2.0
    hot = np.zeros((2, 4), dtype=bool)
    hot[0, 0] = hot[1, 1] = True
    assert a.hit_rate(hot) == pytest.approx(6 / 8)
    assert FrequencyTable.zeros(2, 4).hit_rate(hot) is None
    with pytest.raises(RoutingError, match="different models"):
        a.merge(FrequencyTable.zeros(3, 4))
    with pytest.raises(RoutingError, match="between 0 and 1"):
        a.decayed(1.5)
    with pytest.raises(RoutingError, match="negative"):
        FrequencyTable(np.array([[-1.0]]))


def test_frequency_file_round_trip_and_errors(tmp_path):
    a = FrequencyTable(np.arange(8, dtype=float).reshape(2, 4), sources=["x"])
    p = a.save(tmp_path / "f.json")
    b = FrequencyTable.load(p)
    assert np.array_equal(a.counts, b.counts) and b.sources == ["x"]
    for bad, match in [({"format": "nope"}, "not a routing frequency file"),
                       ({"format": R.FREQ_FORMAT, "version": 2}, "version 2"),
                       ({"format": R.FREQ_FORMAT, "version": 1, "n_layers": 2, "n_experts": 4, "counts": [[1]]},
                        "not 2 rows of 4"),
                       ({"format": R.FREQ_FORMAT, "version": 1, "n_layers": 1, "n_experts": 1, "counts": [["a"]]},
                        "not a number"),
                       ({"format": R.FREQ_FORMAT, "version": 1, "n_layers": 1, "n_experts": 1, "counts": [[-2]]},
                        "negative")]:
        q = tmp_path / "bad.json"
        q.write_text(json.dumps(bad))
        with pytest.raises(RoutingError, match=match):
            FrequencyTable.load(q)
    q = tmp_path / "junk.json"
    q.write_text("{not json")
    with pytest.raises(RoutingError, match="not a readable JSON"):
        FrequencyTable.load(q)


def test_load_usage_sniffs_and_checks_the_model(tmp_path):
    t = R.write_trace(tmp_path / "t.bin", [(1, [0, 1], [0.5, 0.5])])
    f = FrequencyTable(np.ones((2, 4))).save(tmp_path / "f.json")
    s = R.write_strp(tmp_path / "p.strp", [(1, 3), (1, 2)], 2, 4, 2)
    assert [R.sniff(x) for x in (t, f, s)] == ["trace", "frequencies", "strp"]
    u = R.load_usage([t, f, s], 2, 4)
    assert u.has_frequencies and u.frequencies.total == 10 and u.ranking == [(1, 3), (1, 2)]
    with pytest.raises(RoutingError, match="another model"):
        R.load_usage([s], 3, 4)
    with pytest.raises(RoutingError, match="another model"):
        R.load_usage([f], 2, 8)
    with pytest.raises(RoutingError, match="file not found"):
        R.load_usage([tmp_path / "missing"], 2, 4)


# -- coverage ---------------------------------------------------------------------------------------------------------

def test_coverage_curve():
    counts = np.array([[10.0, 0, 5, 1], [0, 20, 0, 4]])
    nbytes = np.full((2, 4), 100)
    cov = R.coverage_curve(counts, nbytes)
    assert cov.at(0) == 0.0 and cov.at(8) == pytest.approx(1.0)
    assert cov.at(1) == pytest.approx(20 / 40) and cov.at(2) == pytest.approx(30 / 40)
    assert np.all(np.diff(cov.hit_rate) >= 0)
    assert cov.hot_bytes[3] == 300
    s = cov.sampled(4)
    assert s["n_hot"][0] == 0 and s["n_hot"][-1] == 8
    assert R.coverage_curve(np.zeros((2, 4)), nbytes) is None


def test_rank_by_density_prefers_hits_per_byte():
    counts = np.array([[10.0, 6.0]])
    nbytes = np.array([[200, 100]])          # 0.05 vs 0.06 hits per byte: the small one first
    assert R.rank_by_density(counts, nbytes).tolist() == [1, 0]
    # without counts: smaller first, then the tie order
    assert R.rank_by_density(None, np.array([[5, 5, 1]]), np.array([2, 1, 0])).tolist() == [2, 1, 0]


# -- format 2 (tag records) and Strata's profile reader ---------------------------------------------------------------

def test_format2_tag_records_are_skipped_and_counted(tmp_path):
    """A ``--dump-routing`` trace of format 2 starts with a tag record: a negative layer (−2) in the ordinary record
    shape — int32 layer, int32 k, k int32, k float32 — which is how Niko1221/Strata's own reader walks every record
    (``tools/make_profile.py`` ``read_trace`` @42bf2ff: ``8 + 8k`` bytes, only ``0 <= layer`` counted). Tags may
    carry any k and any ids; they never refuse the trace and are counted in the notes."""
    data_recs = [(1, [0, 1], [0.5, 0.5]), (1, [3, 3], [0.5, 0.5]), (0, [2, 1], [0.5, 0.5])]
    tag_start = (-2, [2, 99999], [0.0, 0.0])          # ids out of any model's range: a tag is never checked
    tag_mid = (-3, [7], [1.5])                        # another k in the middle of a run
    data = _manual_trace([tag_start] + data_recs[:2] + [tag_mid] + data_recs[2:])
    counts, stats = R.count_trace(data, 2, 4)
    assert counts.tolist() == [[0, 1, 1, 0], [1, 1, 0, 2]]
    assert (stats.records, stats.tags, sorted(stats.tag_layers)) == (3, 2, [-3, -2])
    p = tmp_path / "v2.trace"
    p.write_bytes(data)
    ft = R.read_trace(p, 2, 4)
    assert ft.total == 6 and any("2 tag records (format 2, layer -3, -2) skipped" in n for n in ft.notes)
    # the same trace without its tags counts the same
    assert np.array_equal(R.count_trace(_manual_trace(data_recs), 2, 4)[0], counts)
    only_tags = tmp_path / "tags.trace"
    only_tags.write_bytes(_manual_trace([tag_start]))
    with pytest.raises(RoutingError, match=r"no complete routing record \(only 1 tag record\)"):
        R.read_trace(only_tags, 2, 4)


def test_format2_vectorised_runs_match_the_walk():
    """Runs between tag records are counted vectorised; the result equals a record-by-record walk."""
    rng = np.random.default_rng(7)
    recs = [(-2, [0] * 6, [0.0] * 6)]
    for i in range(400):
        recs.append((int(rng.integers(0, 5)), rng.integers(0, 16, 6).tolist(), [1 / 6] * 6))
        if i % 97 == 0:
            recs.append((-5, [1, 2], [0.0, 0.0]))
    data = _manual_trace(recs)
    fast, stats = R.count_trace(data, 5, 16)
    slow = np.zeros((5, 16))
    for layer, ids, _ in recs:
        if layer >= 0:
            for e in ids:
                slow[layer, e] += 1
    assert np.array_equal(fast, slow) and stats.records == 400 and stats.tags == 1 + 5


def _strata_profile_shape(path):
    """Strata's ``profile_shape`` (serve/server.py @2291cb3) as its docstring and code read: (layers, experts) from
    the 24-byte header, None when missing, not STRP, or shorter than ``24 + 4 × n_ranked`` bytes. Written here from
    that reading, independently of engine_manager.expert_routing."""
    try:
        with open(path, "rb") as f:
            head = f.read(24)
            f.seek(0, 2)
            size = f.tell()
    except OSError:
        return None
    if len(head) < 24 or head[:4] != b"STRP":
        return None
    _, nl, ne, _, n = struct.unpack("<5I", head[4:])
    return (nl, ne) if size >= 24 + 4 * n else None


def _strata_read_profile(blob):
    """``tools/make_profile.py`` ``read_profile``'s layout: ``<5I`` at 4, then ``<HH`` pairs from 24; and
    ``write_profile``'s rank table of ``<i`` per (layer, expert), −1 unranked."""
    ver, nl, ne, slots, n = struct.unpack_from("<5I", blob, 4)
    pairs = [struct.unpack_from("<HH", blob, 24 + 4 * i) for i in range(n)]
    ranks = struct.unpack_from(f"<{nl * ne}i", blob, 24 + 4 * n)
    return ver, nl, ne, slots, pairs, ranks


def test_strp_matches_stratas_reader_byte_for_byte(tmp_path):
    """The panel's profile read back with Strata's documented layout: same header, pairs and rank table, and the
    file is exactly as long as that layout says; Strata's ``profile_shape`` reads the same shape."""
    ranked = [(3, 17), (40, 383), (3, 0), (7, 5)]
    p = R.write_strp(tmp_path / "p.strp", ranked, 43, 384, 4)
    blob = p.read_bytes()
    ver, nl, ne, slots, pairs, ranks = _strata_read_profile(blob)
    assert (ver, nl, ne, slots, pairs) == (1, 43, 384, 4, ranked)
    assert len(pairs) <= slots             # read_expert_profile refuses more ranked pairs than slots
    assert len(blob) == 24 + 4 * len(ranked) + 4 * nl * ne
    assert [ranks[layer * ne + e] for layer, e in ranked] == [0, 1, 2, 3] and sum(r >= 0 for r in ranks) == 4
    assert R.profile_shape(p) == _strata_profile_shape(p) == (43, 384)
    for name, data in [("short.strp", blob[:24 + 4 * len(ranked) - 1]), ("magic.strp", b"PRTS" + blob[4:]),
                       ("tiny.strp", blob[:10])]:
        q = tmp_path / name
        q.write_bytes(data)
        assert R.profile_shape(q) is None and _strata_profile_shape(q) is None
    assert R.profile_shape(tmp_path / "missing.strp") is None


def test_a_profile_of_another_shape_is_refused_as_the_engine_does(tmp_path):
    """The engine reads ``--expert-profile`` for the model's layers × experts (generate.cpp @0083bb7
    ``read_expert_profile(o.expert_profile, g.n_layers, g.n_expert, …)``; its error ends the start) and Strata's
    ``read_profile`` refuses ``<nl>x<ne>, not <NL>x<NE>``. The panel refuses the same before a start or a plan —
    by the header, even when the rest of the file is damaged."""
    p = R.write_strp(tmp_path / "p.strp", [(3, 1)], 43, 384, 1)
    R.check_profile_shape(p, 43, 384)
    with pytest.raises(RoutingError, match=r"43 layers × 384 experts; the model has 40 × 384.*another model"):
        R.check_profile_shape(p, 40, 384)
    damaged = tmp_path / "damaged.strp"
    damaged.write_bytes(p.read_bytes()[:-100])          # the rank table cut short, the header intact
    with pytest.raises(RoutingError, match="another model"):
        R.load_usage([damaged], 40, 384)
    with pytest.raises(RoutingError, match="not a Strata profile"):
        R.check_profile_shape(tmp_path / "nothing.strp", 43, 384)


def test_plan_usage_takes_a_format2_trace_through_the_cli(tmp_path):
    """``dsv41 plan --usage TRACE`` (the real command, a subprocess) plans from a format-2 trace: the tag record is
    skipped and said in the plan's notes."""
    import os
    import subprocess
    import sys

    from engine_manager.replica import ReplicaSpec, write_replica

    model = tmp_path / "model"
    write_replica(model, ReplicaSpec())
    rng = np.random.default_rng(2)
    recs = [(-2, [1, 0], [0.0, 0.0])]
    recs += [(int(b), rng.choice(64, 6, replace=False).tolist(), [1 / 6] * 6) for b in range(3, 43) for _ in range(20)]
    trace = tmp_path / "routing.trace"
    trace.write_bytes(_manual_trace(recs))
    r = subprocess.run([sys.executable, "-m", "engine_manager", "plan", "--model-dir", str(model),
                        "--vram-gib", "97887MiB", "--ram-gib", "280GB", "--usage", str(trace), "--json",
                        "--no-save"], capture_output=True, text=True, timeout=300, env=dict(os.environ),
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["predicted_hit_rate"] == pytest.approx(1.0) and d["usage"]["sources"] == [str(trace)]
    assert any("1 tag record (format 2, layer -2) skipped" in n for n in d["notes"])
