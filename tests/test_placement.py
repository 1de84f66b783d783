"""engine_manager.placement: terms that add up, the hot set, refusals, calibration against the guides, STRP
artefacts, the llama.cpp per-layer equivalent, and the helpers other parts call."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine_manager import fmt, placement as P, plans
from engine_manager.tensor_layout import read_layout
from engine_manager.replica import ReplicaSpec, write_replica
from engine_manager.expert_routing import FrequencyTable, Usage, read_strp
from engine_manager.settings import Settings

GiB, MiB, GB = fmt.GIB, fmt.MIB, fmt.GB


@pytest.fixture(scope="module")
def lay(tmp_path_factory):
    d = tmp_path_factory.mktemp("replica")
    write_replica(d, ReplicaSpec())
    return read_layout(d)


def _zipf_counts(lay, seed=0, a=1.1, tokens=200_000):
    rng = np.random.default_rng(seed)
    c = np.zeros((lay.n_layers, lay.n_experts))
    for b in lay.moe_layers:
        p = 1.0 / np.arange(1, lay.n_experts + 1) ** a
        p = rng.permutation(p / p.sum())
        c[b] = rng.multinomial(tokens * lay.n_experts_used, p)
    return c


def test_calibration_against_the_guides(lay):
    """Replica + one 96 GB RTX PRO 6000 (97,887 MiB) + 280 GB RAM, default settings: the guides' 5,825 experts /
    69.5 GiB in VRAM, within ±3%. The terms that get there are printed (and documented in placement.py)."""
    p = P.plan(lay, P.reference_hardware(97_887, 280e9), None, Settings())
    print("\nVRAM terms:")
    for t in p.vram.terms:
        print(f"  {t.name:<32} {t.bytes / GiB:7.2f} GiB  {t.note}")
    print("RAM terms:")
    for t in p.ram.terms:
        print(f"  {t.name:<42} {t.bytes / GB:7.1f} GB  {t.note}")
    assert p.refused is None
    assert abs(p.n_hot - 5825) <= 0.03 * 5825
    assert abs(p.hot_expert_bytes / GiB - 69.5) <= 0.03 * 69.5
    assert p.cold_experts == 15_360 - p.n_hot
    assert abs(p.cold_expert_bytes / GiB - 113.9) <= 0.03 * 113.9
    assert p.ram.total_bytes <= 280e9


def test_192_gb_is_refused_with_the_shortfall_in_gb(lay):
    p = P.plan(lay, P.reference_hardware(97_887, 192e9), None, Settings())
    assert p.refused and "RAM" in p.refused and "GB short" in p.refused
    (sf,) = p.shortfalls
    assert sf.resource == "ram" and sf.available_bytes == 192 * GB
    assert sf.missing_bytes == sf.needed_bytes - sf.available_bytes > 10 * GB
    assert f"{sf.missing_bytes / GB:.1f} GB short" in p.refused
    d = p.to_dict()
    assert d["refused"] == p.refused and d["shortfalls"][0]["missing_bytes"] == sf.missing_bytes


def test_terms_add_up(lay):
    p = P.plan(lay, P.reference_hardware(), None, None)
    assert p.vram.total_bytes == sum(t.bytes for t in p.vram.terms)
    assert 0 <= p.vram.free_bytes < int(lay.expert_bytes_matrix().max())     # not even one more expert fits
    assert p.ram.total_bytes == sum(t.bytes for t in p.ram.terms)
    by = {t.name: t.bytes for t in p.vram.terms}
    assert by["hot experts"] == p.hot_expert_bytes
    assert p.hot_expert_bytes + p.cold_expert_bytes == lay.routed_expert_bytes
    rb = {t.name: t.bytes for t in p.ram.terms}
    assert rb["cold experts (pinned)"] == p.cold_expert_bytes
    # every tensor is counted once: GPU non-expert + host lookup tables + routed experts
    assert by["non-expert weights"] + rb["CPU-resident tensors"] + lay.routed_expert_bytes == lay.tensor_bytes
    assert by["reserve (--vram-reserve-mib)"] == 700 * MiB
    d = p.to_dict()
    assert d["vram"]["total_bytes"] == sum(t["bytes"] for t in d["vram"]["terms"])
    assert d["ram"]["total_bytes"] == sum(t["bytes"] for t in d["ram"]["terms"])


def test_plan_dict_shape(lay):
    p = P.plan(lay, P.reference_hardware(), None, Settings())
    d = json.loads(json.dumps(p.to_dict()))
    for k in ("hot_experts", "hot_expert_bytes", "cold_experts", "total_experts", "predicted_hit_rate", "vram",
              "ram", "refused", "strata_args", "llamacpp_cpu_layers", "hot_set", "strp_path", "model", "settings",
              "llamacpp_predicted_hit_rate"):
        assert k in d
    assert d["predicted_hit_rate"] is None
    assert d["predicted_hit_rate_note"] == P.UNKNOWN_HIT_RATE
    assert d["total_experts"] == 15_360 and len(d["hot_set"]) == d["hot_experts"]
    assert d["model"]["moe_layers"] == list(range(3, 43)) and d["model"]["n_experts"] == 384
    assert d["strata_args"] == ["--expert-cache", str(d["hot_experts"]), "--vram-reserve-mib", "700"]
    assert d["hardware"]["hypothetical"] is True and "hypothetical" in d["hardware"]["label"]
    assert d["coverage"] is None


def test_no_data_spreads_the_hot_set_across_layers(lay):
    p = P.plan(lay, P.reference_hardware(), None, None)
    per_layer = p.hot_mask.sum(axis=1)
    assert per_layer.max() - per_layer.min() <= 1
    assert all(b in lay.moe_layers for b, _ in p.hot_set())


def test_frequencies_choose_the_hot_set_and_predict(lay):
    counts = _zipf_counts(lay)
    p = P.plan(lay, P.reference_hardware(), FrequencyTable(counts), None)
    moe = counts[lay.moe_layers]
    # the hot set is the n_hot most routed pairs (equal sizes): nothing cold beats anything hot
    assert moe[p.hot_mask].min() >= moe[~p.hot_mask].max()
    assert p.predicted_hit_rate == pytest.approx(moe[p.hot_mask].sum() / moe.sum())
    assert p.coverage is not None and p.coverage.at(p.n_hot) == pytest.approx(p.predicted_hit_rate)
    assert "routed picks" in p.hit_rate_note
    d = p.to_dict()
    assert d["coverage"]["chosen"]["n_hot"] == p.n_hot
    assert np.array(d["usage"]["counts"]).shape == (40, 384)
    # llama.cpp at the same budget: per layer, so lower than per-expert placement on skewed routing
    assert p.llamacpp_predicted_hit_rate < p.predicted_hit_rate


def test_hits_per_byte_with_unequal_experts(tmp_path):
    """One layer's experts twice as big: with equal frequencies the planner takes the cheaper experts first."""
    write_replica(tmp_path, ReplicaSpec.small())
    lay = read_layout(tmp_path)
    big = lay.expert_layers[0]
    big.part_bytes = {k: v * 2 for k, v in big.part_bytes.items()}
    eb = lay.expert_bytes_matrix()
    counts = np.zeros((lay.n_layers, lay.n_experts))
    counts[lay.moe_layers] = 100.0
    s = P.PlanSettings(context_length=512)
    fixed = P.plan(lay, P.reference_hardware(vram_mib=4096), None, s)
    budget_hot = int(eb[1:].sum())             # room for exactly the three small layers
    vram = fixed.vram.total_bytes - fixed.hot_expert_bytes + budget_hot
    p = P.plan(lay, P.reference_hardware(vram_mib=vram / MiB), FrequencyTable(counts), s)
    assert p.hot_mask[0].sum() == 0 and p.hot_mask[1:].all()


def test_profile_orders_but_does_not_predict(lay, tmp_path):
    ranking = [(42, e) for e in range(384)] + [(41, e) for e in range(384)]
    p = P.plan(lay, P.reference_hardware(), Usage(ranking=ranking), None)
    assert p.hot_set()[:768] == ranking
    assert p.predicted_hit_rate is None and "profile" in p.hit_rate_note


def test_strp_artefact_in_the_plans_order(lay, tmp_path):
    counts = _zipf_counts(lay, seed=5)
    path = tmp_path / "plan.strp"
    p = P.plan(lay, P.reference_hardware(), FrequencyTable(counts), None, strp_path=path)
    prof = read_strp(path)
    assert (prof.n_layers, prof.n_experts) == (43, 384)
    # the hot set only: Strata's read_expert_profile refuses more ranked pairs than slots (expert_cache.cpp
    # @2249c24); all 15,360 pairs used to be written and the engine refused every saved plan's profile
    assert prof.slots == p.n_hot and prof.n_ranked == p.n_hot
    assert prof.pairs() == p.hot_set()
    assert p.strata_args()[-2:] == ["--expert-profile", str(path)]
    assert p.to_dict()["strp_path"] == str(path)


def test_llamacpp_per_layer_equivalent(lay):
    p = P.plan(lay, P.reference_hardware(), None, None)
    eb = lay.expert_bytes_matrix()
    gpu_rows = [lay.moe_layers.index(b) for b in p.llamacpp_gpu_layers]
    expert_budget = p.vram.budget_bytes - sum(t.bytes for t in p.vram.terms if t.name != "hot experts")
    assert eb[gpu_rows].sum() <= expert_budget < eb[gpu_rows].sum() + eb[0].sum()
    # --n-cpu-moe style: the first MoE layers stay on the CPU
    assert p.llamacpp_cpu_layers == lay.moe_layers[: len(p.llamacpp_cpu_layers)]
    assert p.llamacpp_predicted_hit_rate == pytest.approx(len(p.llamacpp_gpu_layers) / 40)
    args = p.llamacpp_args()
    assert args[0] == "--override-tensor" and args[1].startswith(r"blk\.(3|4|")
    assert args[1].endswith(r")\.ffn_.*_exps\.=CPU")


def test_vram_refusal_and_no_gpu(lay):
    p = P.plan(lay, P.reference_hardware(vram_mib=16 * 1024), None, None)
    assert p.refused and "VRAM" in p.refused and p.n_hot == 0
    sf = [s for s in p.shortfalls if s.resource == "vram"][0]
    assert sf.missing_bytes > 0 and sf.available_bytes == 16 * GiB
    hw = P.reference_hardware()
    hw.gpus.clear()
    hw.gpu_error = "no NVIDIA driver found"
    p = P.plan(lay, hw, None, None)
    assert p.refused and "no GPU" in p.refused and "--vram-gib" in p.refused


def test_more_context_and_slots_mean_fewer_hot_experts(lay):
    hw = P.reference_hardware()
    a = P.plan(lay, hw, None, P.PlanSettings())
    b = P.plan(lay, hw, None, P.PlanSettings(context_length=131072))
    c = P.plan(lay, hw, None, P.PlanSettings(context_length=131072, slots=8))
    d = P.plan(lay, hw, None, P.PlanSettings(context_length=131072, slots=8, kv_type="q4_0"))
    assert a.n_hot > b.n_hot > c.n_hot and d.n_hot > c.n_hot
    assert c.ram.total_bytes > a.ram.total_bytes          # staging grows with slots


def test_counts_of_the_wrong_model_are_refused(lay):
    with pytest.raises(ValueError, match="experts per layer"):
        P.plan(lay, P.reference_hardware(), np.ones((43, 8)), None)
    with pytest.raises(ValueError, match="layers"):
        P.plan(lay, P.reference_hardware(), np.ones((7, 384)), None)


def test_reference_and_hypothetical_hardware():
    hw = P.reference_hardware()
    assert hw.gpus[0].vram_total_bytes == 97_887 * MiB and hw.host.ram_total_bytes == 280 * GB
    assert P.is_hypothetical(hw)
    h2 = P.hypothetical_hardware(None, None, 192 * GB)
    assert h2.gpus[0].vram_total_bytes == 97_887 * MiB and h2.host.ram_total_bytes == 192 * GB
    h3 = P.hypothetical_hardware(hw, 48 * GiB, None)
    assert h3.gpus[0].vram_total_bytes == 48 * GiB and "48 GiB" in h3.gpus[0].name


def test_default_sim_layout_generates_once_into_the_data_dir(isolated_dirs):
    lay = plans.default_sim_layout()
    assert lay.n_routed_experts == 15_360 and len(lay.shards) == 7
    d = plans.sim_replica_dir()
    assert d.parent == isolated_dirs / "data"
    mtimes = [f.stat().st_mtime_ns for f in sorted(d.iterdir())]
    again = plans.default_sim_layout()
    assert [f.stat().st_mtime_ns for f in sorted(d.iterdir())] == mtimes
    assert again.total_bytes == lay.total_bytes
    from engine_manager.replica import disk_usage_bytes
    assert disk_usage_bytes(list(d.iterdir())) < 16 * MiB


def _workstation():
    """A HardwareReport of a real-looking GPU host (not the hypothetical reference): what `dsv41 start` plans for."""
    from dataclasses import replace
    hw = P.reference_hardware()
    return replace(hw, gpus=[replace(hw.gpus[0], uuid="GPU-5a1e0000-test")],
                   host=replace(hw.host, hostname="workstation"))


def test_make_plan_keeps_hypothetical_plans_out_of_the_last_plan(isolated_dirs):
    out = plans.make_plan(Settings(), plans.PlanRequest(host="reference"))
    assert out.model_source == "replica"
    # the guides' workstation is hypothetical: shown again by the Placement tab, never what `dsv41 start` uses
    assert out.saved_to == plans.other_plan_path() and not out.startable
    assert plans.load_last_plan() is None and plans.load_shown_plan()["hot_experts"] == out.plan.n_hot
    assert "not as the plan `dsv41 start` uses" in out.saved_note and "hypothetical" in out.saved_note
    assert read_strp(out.plan_dict["strp_path"]).slots == out.plan.n_hot
    assert out.plan_dict["strp_path"].endswith("other-plan.strp")
    custom = plans.make_plan(Settings(), plans.PlanRequest(host="custom", vram_bytes=48 * GiB, ram_bytes=512 * GB,
                                                   save=False))
    assert custom.plan.n_hot < out.plan.n_hot and custom.saved_to is None


def test_only_a_startable_plan_becomes_the_plan_start_uses(isolated_dirs):
    """M2: the saved last plan is the one supervisor.default_plan starts with; a refused or hypothetical plan made
    afterwards must not replace it (nor its Strata profile)."""
    from engine_manager.start_plan import default_plan
    ws = _workstation()
    assert not P.is_hypothetical(ws)
    good = plans.make_plan(Settings(), plans.PlanRequest(host="this"), ws)
    assert good.startable and good.saved_to == plans.last_plan_path() and "`dsv41 start` uses" in good.saved_note
    strp = plans.plans_dir() / "last-plan.strp"
    assert good.plan_dict["strp_path"] == str(strp) and read_strp(strp).slots == good.plan.n_hot
    profile = strp.read_bytes()
    d, notes = default_plan("strata", Settings(), ws)
    assert d["created_at"] == good.plan_dict["created_at"] and any("saved" in n for n in notes)

    hyp = plans.make_plan(Settings(), plans.PlanRequest(host="custom", vram_bytes=48 * GiB, ram_bytes=512 * GB), ws)
    refused = plans.make_plan(Settings(), plans.PlanRequest(host="custom", ram_bytes=100 * GB), ws)
    assert refused.plan.refused and not refused.startable and "refused" in refused.saved_note
    assert hyp.saved_to == refused.saved_to == plans.other_plan_path()
    assert plans.load_last_plan()["created_at"] == good.plan_dict["created_at"]
    assert strp.read_bytes() == profile                             # the profile the saved plan names is intact
    assert plans.load_shown_plan()["created_at"] == refused.plan_dict["created_at"]   # the tab shows the newest
    d, _ = default_plan("strata", Settings(), ws)
    assert d["created_at"] == good.plan_dict["created_at"]


def test_hardware_label_gives_ram_in_both_units(lay):
    p = P.plan(lay, P.hypothetical_hardware(None, None, 192 * GiB), None, None)
    assert "206 GB (192 GiB) RAM" in p.hardware_label
    assert "206.2 GB (192.0 GiB)" in p.refused


def test_the_plan_store_is_its_own_module():
    """The planner (placement) and the plan store (plans) are split: the store's names live in plans only, and the
    planner does not forward them."""
    for name in ("load_last_plan", "save_plan", "store_plan", "make_plan", "find_model", "default_sim_layout",
                 "PlanRequest", "last_plan_path"):
        assert callable(getattr(plans, name)) and not hasattr(P, name), name
    with pytest.raises(AttributeError):
        P.no_such_name  # noqa: B018
