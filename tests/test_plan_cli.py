"""``dsv41 plan``: exit codes, JSON keys, itemised human output, refusals, usage files, the STRP artefact, a
replica with other non-expert shapes (a replica this project did not calibrate against), and a model written by the
test's own GGUF writer (a header this project did not make)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from engine_manager import fmt
from engine_manager.cli import main
from engine_manager.replica import ReplicaSpec, write_replica
from engine_manager.expert_routing import read_strp, write_trace

ROOT = Path(__file__).resolve().parent.parent
GiB, GB = fmt.GIB, fmt.GB
KEYS = ("hot_experts", "hot_expert_bytes", "cold_experts", "total_experts", "predicted_hit_rate", "vram", "ram",
        "refused", "strata_args", "llamacpp_cpu_layers")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    write_replica(d, ReplicaSpec())
    return d


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    """Same 40 × 384 experts, different everything else: 64 heads, Q8_0 attention, a 129,280-token vocabulary,
    no n-gram tables, dense FFN in F16, 5 shards, no size target."""
    d = tmp_path_factory.mktemp("other")
    spec = replace(ReplicaSpec(), file_stem="Other-Q2_K", n_shards=5, n_head=64, q_lora_rank=1024, t_attn="Q8_0",
                   t_dense="F16", t_shared="Q4_K", vocab=129_280, n_merges=127_741, engram_layers=(),
                   target_total_bytes=None, n_ff_dense=16384)
    write_replica(d, spec)
    return d


def _run(capsys, *argv):
    rc = main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_plan_json_on_the_guides_host(model, capsys, tmp_path):
    out_file = tmp_path / "plan.json"
    rc, out, _ = _run(capsys, "--model-dir", str(model), "--vram-gib", "97887MiB", "--ram-gib", "280GB", "--json",
                      "--out", str(out_file))
    assert rc == 0
    d = json.loads(out)
    for k in KEYS:
        assert k in d
    assert abs(d["hot_experts"] - 5825) <= 175 and d["total_experts"] == 15_360
    assert d["predicted_hit_rate"] is None and d["refused"] is None
    assert d["vram"]["terms"] and all(isinstance(t["bytes"], int) for t in d["vram"]["terms"])
    assert d["hardware"]["hypothetical"] is True
    assert json.loads(out_file.read_text())["hot_experts"] == d["hot_experts"]


def test_human_output_itemises_terms(model, capsys):
    rc, out, _ = _run(capsys, "--model-dir", str(model), "--vram-gib", "95.593", "--ram-gib", "280GB")
    assert rc == 0
    for s in ("VRAM  budget", "non-expert weights", "KV cache", "compute buffers", "reserve (--vram-reserve-mib)",
              "hot experts", "RAM   budget", "cold experts (pinned)", "CPU-resident tensors", "pinned staging",
              "OS headroom", "GiB", " GB", "HYPOTHETICAL", "unknown until the engine has seen traffic",
              "Stock llama.cpp", "--expert-cache"):
        assert s in out, s


def test_192_gb_refused_exit_3(model, capsys):
    rc, out, _ = _run(capsys, "--model-dir", str(model), "--vram-gib", "97887MiB", "--ram-gib", "192GB")
    assert rc == 3
    assert "REFUSED" in out and "GiB) missing" in out
    rc, out, _ = _run(capsys, "--model-dir", str(model), "--vram-gib", "97887MiB", "--ram-gib", "192GB", "--json")
    d = json.loads(out)
    assert rc == 3 and d["refused"] and d["shortfalls"][0]["resource"] == "ram"
    assert d["shortfalls"][0]["missing_bytes"] > 10 * GB


def test_vram_too_small_refused(model, capsys):
    rc, out, _ = _run(capsys, "--model-dir", str(model), "--vram-gib", "16", "--ram-gib", "1TB")
    assert rc == 3 and "VRAM: needs" in out and "missing" in out


def test_usage_trace_gives_a_hit_rate_and_strp(model, capsys, tmp_path):
    rng = np.random.default_rng(1)
    recs = [(int(b), rng.choice(64, 6, replace=False).tolist(), [1 / 6] * 6) for b in range(3, 43) for _ in range(50)]
    trace = write_trace(tmp_path / "trace.bin", recs)
    strp = tmp_path / "profile.strp"
    rc, out, _ = _run(capsys, "--model-dir", str(model), "--vram-gib", "97887MiB", "--ram-gib", "280GB",
                      "--usage", str(trace), "--strp", str(strp), "--json")
    assert rc == 0
    d = json.loads(out)
    assert d["predicted_hit_rate"] == pytest.approx(1.0)      # every routed expert (< 64 per layer) fits the hot set
    assert d["strp_path"] == str(strp) and "--expert-profile" in d["strata_args"]
    assert read_strp(strp).slots == d["hot_experts"]
    # Strata's read_expert_profile refuses a profile ranking more pairs than it has slots (expert_cache.cpp
    # @2249c24): a saved plan's profile used to rank every pair, and the engine refused it at every start
    assert read_strp(strp).n_ranked <= read_strp(strp).slots


def test_bad_usage_file_exit_2(model, capsys, tmp_path):
    bad = tmp_path / "bad.strp"
    bad.write_bytes(b"STRP" + b"\0" * 3)
    rc, _, err = _run(capsys, "--model-dir", str(model), "--usage", str(bad), "--vram-gib", "96")
    assert rc == 2 and "bad.strp" in err


def test_no_model_says_how_to_get_one(capsys):
    rc, _, err = _run(capsys)
    assert rc == 1
    assert "no model" in err and "dsv41 download" in err and "--replica" in err and "DSV41_MODEL_DIR" in err


def test_unreadable_model_names_the_file(tmp_path, capsys):
    (tmp_path / "M-00001-of-00001.gguf").write_bytes(b"nope" * 10)
    rc, _, err = _run(capsys, "--model-dir", str(tmp_path))
    assert rc == 1 and "M-00001-of-00001.gguf" in err and "bad magic" in err


def test_model_dir_setting_is_used(model, capsys, monkeypatch):
    monkeypatch.setenv("DSV41_MODEL_DIR", str(model))
    rc, out, _ = _run(capsys, "--vram-gib", "97887MiB", "--ram-gib", "280GB", "--json")
    assert rc == 0 and json.loads(out)["model"]["file"].startswith(str(model))


def test_a_replica_with_other_non_expert_shapes(other_model, capsys):
    """Acceptance: `dsv41 plan` on a replica it did not make (other non-expert shapes, same 40 × 384 experts)."""
    rc, out, _ = _run(capsys, "--model-dir", str(other_model), "--vram-gib", "97887MiB", "--ram-gib", "280GB",
                      "--json")
    assert rc == 0
    d = json.loads(out)
    assert d["total_experts"] == 15_360 and d["model"]["moe_layers"] == list(range(3, 43))
    assert d["model"]["shards"] == 5
    v = {t["name"]: t["bytes"] for t in d["vram"]["terms"]}
    assert v["hot experts"] == d["hot_expert_bytes"] and 0 < d["hot_experts"] < 15_360
    assert d["vram"]["total_bytes"] <= d["vram"]["budget_bytes"]
    # different non-expert part than the calibrated replica → a different hot set size
    assert d["hot_experts"] != 5825
    r = {t["name"]: t["bytes"] for t in d["ram"]["terms"]}
    assert r["CPU-resident tensors"] > 0                       # token_embd is still a lookup table


def test_replica_flag_and_a_real_subprocess(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "engine_manager", "plan", "--replica", "--vram-gib", "97887MiB",
                        "--ram-gib", "280GB", "--json"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["model"]["source"].startswith("the header-faithful replica")
    assert abs(d["hot_experts"] - 5825) <= 175


# -- a model written without this project's code ----------------------------------------------
#
# A tiny GGUF writer of its own (struct only: neither engine_manager.replica nor gguf.GGUFWriter), so the planner
# meets a header nobody here calibrated: a GLM-4.5-style layout (GQA attention with biases and q/k norms, 2 dense
# blocks, shared experts) at n_embd 5,120, another vocabulary, tensors grouped by kind across 3 shards instead of
# llama.cpp's per-block order, and the same 40 MoE layers × 384 routed experts, named as llama.cpp names them
# (``blk.N.ffn_{gate,up,down}_exps.weight``, or fused ``ffn_gate_up_exps``). Tensor data is a hole (truncate).

F32, Q8_0, Q3_K, Q4_K, Q6_K = 0, 8, 11, 12, 14                     # ggml type ids
BLOCK = {F32: (1, 4), Q8_0: (32, 34), Q3_K: (256, 110), Q4_K: (256, 144), Q6_K: (256, 210)}
INDIE = dict(n_embd=5120, n_head=96, n_kv=8, head=128, n_ff=12288, n_ff_exp=1536, n_dense=2, n_layers=42,
             n_exp=384, n_used=8, vocab=151_552)


def _nb(shape, t):
    block, size = BLOCK[t]
    return int(np.prod(shape)) // block * size


def _pad32(n):
    return (n + 31) // 32 * 32


def _str(text):
    b = text.encode()
    return struct.pack("<Q", len(b)) + b


def _val(v):
    if isinstance(v, bytes):                                        # already typed (u16/i32 of the split keys)
        return v
    if isinstance(v, bool):
        return struct.pack("<I?", 7, v)
    if isinstance(v, int):
        return struct.pack("<II", 4, v)
    if isinstance(v, float):
        return struct.pack("<If", 6, v)
    if isinstance(v, str):
        return struct.pack("<I", 8) + _str(v)
    if all(isinstance(x, str) for x in v):
        return struct.pack("<IIQ", 9, 8, len(v)) + b"".join(_str(x) for x in v)
    return struct.pack("<IIQ", 9, 5, len(v)) + struct.pack(f"<{len(v)}i", *v)


def _write_shard(path, kv, tensors):
    head = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv)))
    for k, v in kv.items():
        head += _str(k) + _val(v)
    off = 0
    for name, shape, t in tensors:
        head += _str(name) + struct.pack(f"<I{len(shape)}QIQ", len(shape), *shape, t, off)
        off += _pad32(_nb(shape, t))
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(_pad32(len(head)) + off)


def _indie_tensors(fused):
    m = INDIE
    e, q, kv = m["n_embd"], m["n_head"] * m["head"], m["n_kv"] * m["head"]
    moe = range(m["n_dense"], m["n_layers"])
    attn = []
    for i in reversed(range(m["n_layers"])):
        b = f"blk.{i}."
        attn += [(b + "attn_norm.weight", (e,), F32),
                 (b + "attn_q.weight", (e, q), Q4_K), (b + "attn_q.bias", (q,), F32),
                 (b + "attn_k.weight", (e, kv), Q4_K), (b + "attn_k.bias", (kv,), F32),
                 (b + "attn_v.weight", (e, kv), Q4_K), (b + "attn_v.bias", (kv,), F32),
                 (b + "attn_q_norm.weight", (m["head"],), F32), (b + "attn_k_norm.weight", (m["head"],), F32),
                 (b + "attn_output.weight", (q, e), Q4_K)]
    experts = []
    for i in moe:
        b, f = f"blk.{i}.", m["n_ff_exp"]
        experts.append((b + "ffn_down_exps.weight", (f, e, m["n_exp"]), Q4_K))
        if fused:
            experts.append((b + "ffn_gate_up_exps.weight", (e, 2 * f, m["n_exp"]), Q3_K))
        else:
            experts += [(b + "ffn_up_exps.weight", (e, f, m["n_exp"]), Q3_K),
                        (b + "ffn_gate_exps.weight", (e, f, m["n_exp"]), Q3_K)]
    rest = [("output_norm.weight", (e,), F32), ("output.weight", (e, m["vocab"]), Q6_K)]
    for i in range(m["n_layers"]):
        b = f"blk.{i}."
        rest.append((b + "post_attention_norm.weight", (e,), F32))
        if i < m["n_dense"]:
            rest += [(b + "ffn_gate.weight", (e, m["n_ff"]), Q4_K), (b + "ffn_up.weight", (e, m["n_ff"]), Q4_K),
                     (b + "ffn_down.weight", (m["n_ff"], e), Q6_K)]
        else:
            rest += [(b + "ffn_gate_inp.weight", (e, m["n_exp"]), F32), (b + "exp_probs_b.bias", (m["n_exp"],), F32),
                     (b + "ffn_gate_shexp.weight", (e, m["n_ff_exp"]), Q4_K),
                     (b + "ffn_up_shexp.weight", (e, m["n_ff_exp"]), Q4_K),
                     (b + "ffn_down_shexp.weight", (m["n_ff_exp"], e), Q6_K)]
    return [("token_embd.weight", (e, m["vocab"]), Q4_K)] + attn, experts, rest


def _write_indie_model(d, fused):
    m, a = INDIE, "glm4moe"
    shards = _indie_tensors(fused)
    n_total = sum(len(s) for s in shards)
    meta = {"general.architecture": a, "general.name": "GLM-style 384E (written by a test)",
            f"{a}.block_count": m["n_layers"], f"{a}.context_length": 131_072, f"{a}.embedding_length": m["n_embd"],
            f"{a}.feed_forward_length": m["n_ff"], f"{a}.attention.head_count": m["n_head"],
            f"{a}.attention.head_count_kv": m["n_kv"], f"{a}.attention.key_length": m["head"],
            f"{a}.attention.value_length": m["head"], f"{a}.expert_count": m["n_exp"],
            f"{a}.expert_used_count": m["n_used"], f"{a}.expert_shared_count": 1,
            f"{a}.leading_dense_block_count": m["n_dense"], f"{a}.expert_feed_forward_length": m["n_ff_exp"],
            f"{a}.rope.freq_base": 1e6, f"{a}.expert_weights_norm": True,
            "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": [f"t{i}" for i in range(m["vocab"])],
            "tokenizer.ggml.token_type": [1] * m["vocab"]}
    paths = []
    for no, tensors in enumerate(shards):
        split = {"split.no": struct.pack("<IH", 2, no), "split.count": struct.pack("<IH", 2, len(shards)),
                 "split.tensors.count": struct.pack("<Ii", 5, n_total)}
        p = d / f"GLM-Style-384E-Q3_K_M-{no + 1:05d}-of-{len(shards):05d}.gguf"
        _write_shard(p, {**split, **meta} if no == 0 else split, tensors)
        paths.append(p)
    return paths, [t for s in shards for t in s]


@pytest.mark.parametrize("fused", [False, True], ids=["separate-gate-up", "fused-gate-up"])
def test_plan_on_a_model_this_project_did_not_write(tmp_path, fused):
    paths, tensors = _write_indie_model(tmp_path, fused)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "engine_manager", "plan", "--model-dir", str(tmp_path),
                        "--vram-gib", "95.6", "--ram-gib", "280", "--json"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["refused"] is None and d["shortfalls"] == []

    # the model as its writer knows it
    m = d["model"]
    expert_bytes = [_nb(shp, t) for n, shp, t in tensors if "_exps." in n]
    per_expert = sum(expert_bytes) // (40 * 384)
    assert m["shards"] == 3 and m["total_bytes"] == sum(x.stat().st_size for x in paths)
    assert m["n_layers"] == 42 and m["moe_layers"] == list(range(2, 42))
    assert m["n_experts"] == 384 and m["n_experts_used"] == 8
    assert d["total_experts"] == 40 * 384 == 15_360
    assert m["routed_expert_bytes"] == sum(expert_bytes)
    assert m["expert_bytes_by_layer"] == [per_expert] * 40 and m["expert_bytes"] == per_expert

    # the terms add up, and they are the writer's bytes
    assert d["hot_experts"] + d["cold_experts"] == d["total_experts"] and 0 < d["hot_experts"] < 15_360
    assert d["hot_expert_bytes"] + d["cold_expert_bytes"] == sum(expert_bytes)
    assert d["hot_expert_bytes"] == d["hot_experts"] * per_expert
    for budget in (d["vram"], d["ram"]):
        assert sum(t["bytes"] for t in budget["terms"]) == budget["total_bytes"] <= budget["budget_bytes"]
    assert d["hardware"]["ram_bytes"] == 280 * GiB and abs(d["hardware"]["vram_bytes"] - 95.6 * GiB) < 1 << 20
    v = {t["name"]: t["bytes"] for t in d["vram"]["terms"]}
    r = {t["name"]: t["bytes"] for t in d["ram"]["terms"]}
    embd = next(_nb(shp, t) for n, shp, t in tensors if n == "token_embd.weight")
    others = sum(_nb(shp, t) for n, shp, t in tensors if "_exps." not in n and n != "token_embd.weight")
    assert v["non-expert weights"] == others and r["CPU-resident tensors"] == embd
    assert v["hot experts"] == d["hot_expert_bytes"]
    assert r["cold experts (pinned)"] == d["cold_expert_bytes"]
    # GQA attention (no MLA latent): the KV cache is 8 KV heads × (128 + 128) values per token and layer
    from engine_manager.placement import KV_BYTES_PER_VALUE
    kv = d["settings"]["context_length"] * d["settings"]["slots"] * 42 * 8 * 256 * KV_BYTES_PER_VALUE[
        d["settings"]["kv_type"]]
    assert v["KV cache"] == round(kv)
    assert d["llamacpp_cpu_layers"] and set(d["llamacpp_cpu_layers"]) <= set(range(2, 42))


# -- where the plan is saved (M2), what "free" says when over budget (p11), units (p9) --------------------------------

@pytest.fixture
def workstation(monkeypatch):
    """This machine seen as a GPU workstation (the guides' card and RAM, not marked hypothetical), so `dsv41 plan`
    without --vram-gib/--ram-gib makes a plan `dsv41 start` would use."""
    from engine_manager import hardware, placement
    hw = placement.reference_hardware()
    hw = replace(hw, gpus=[replace(hw.gpus[0], uuid="GPU-5a1e0000-test")], host=replace(hw.host, hostname="ws"))
    monkeypatch.setattr(hardware, "probe", lambda *a, **k: hw)
    return hw


def test_plan_is_saved_as_the_plan_start_uses(model, capsys, tmp_path, workstation):
    from engine_manager import plans
    from engine_manager.settings import load_settings
    from engine_manager.start_plan import default_plan
    rng = np.random.default_rng(3)
    recs = [(int(b), rng.choice(384, 6, replace=False).tolist(), [1 / 6] * 6) for b in range(3, 43) for _ in range(40)]
    trace = write_trace(tmp_path / "trace.bin", recs)
    rc, out, _ = _run(capsys, "--model-dir", str(model), "--usage", str(trace))
    assert rc == 0
    last = plans.last_plan_path()
    strp = last.with_suffix(".strp")
    assert f"Saved as the plan `dsv41 start` uses: {last}" in out and str(strp) in out
    saved = json.loads(last.read_text())
    assert saved["usage"]["sources"] and saved["predicted_hit_rate"] is not None
    assert read_strp(strp).slots == saved["hot_experts"] and saved["strp_path"] == str(strp)
    d, _ = default_plan("strata", load_settings().settings, workstation)
    assert d["created_at"] == saved["created_at"]                  # what `dsv41 start` would start with

    # a hypothetical host and a refused plan are shown, not saved over it
    rc, out, _ = _run(capsys, "--model-dir", str(model), "--vram-gib", "48")
    assert rc == 0 and "not as the plan `dsv41 start` uses" in out and "hypothetical" in out
    assert f"the last plan ({last}) is unchanged" in out
    rc, out, _ = _run(capsys, "--model-dir", str(model), "--ram-gib", "100")
    assert rc == 3 and "it was refused" in out
    assert json.loads(last.read_text())["created_at"] == saved["created_at"]
    assert read_strp(strp).slots == saved["hot_experts"]

    # --no-save: a dry look writes nothing; --json keeps stdout pure JSON (the note goes to stderr)
    other = plans.other_plan_path()
    before = (last.stat().st_mtime_ns, other.stat().st_mtime_ns)
    rc, out, err = _run(capsys, "--model-dir", str(model), "--no-save", "--json")
    assert rc == 0 and json.loads(out)["hardware"]["hypothetical"] is False
    assert "Not saved (--no-save)" in err and str(last) in err
    assert (last.stat().st_mtime_ns, other.stat().st_mtime_ns) == before


def test_vram_over_budget_is_not_a_negative_free(model, capsys):
    rc, out, _ = _run(capsys, "--model-dir", str(model), "--vram-gib", "23", "--ram-gib", "1TB", "--no-save")
    assert rc == 3
    total = next(ln for ln in out.splitlines() if ln.strip().startswith("total"))
    assert "free -" not in out and "OVER BUDGET by 3," in total and "MiB" in total
    rc, out, _ = _run(capsys, "--model-dir", str(model), "--vram-gib", "97887MiB", "--ram-gib", "280GB", "--no-save")
    total = next(ln for ln in out.splitlines() if ln.strip().startswith("total"))
    assert rc == 0 and "free 0." in total                        # within budget: still "free"


def test_ram_shortfall_in_both_units(model, capsys):
    """p9: --ram-gib is GiB; the shortfall names GB and GiB so it reads the same as the Placement tab."""
    rc, out, _ = _run(capsys, "--model-dir", str(model), "--vram-gib", "97887MiB", "--ram-gib", "192", "--no-save")
    assert rc == 3 and "has 206.2 GB (192.0 GiB)" in out and "192 GiB) RAM" in out
