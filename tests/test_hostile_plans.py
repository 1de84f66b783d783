"""Plan files are input: a seeded corpus of hostile plans (the flags that make the engine write files, paths outside
the plans folder, wrong types, sizes no model has, deep nesting, a FIFO) is refused in words before anything
starts — ``dsv41 start --plan``, ``dsv41 bench --plan``, ``dsv41 sim --plan``, the saved last plan — never a
traceback, a crash loop or an allocation by the size the plan claims. The planner's own plans still pass."""

from __future__ import annotations

import copy
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from engine_manager import plans as P
from engine_manager import supervisor as sv
from engine_manager.engine_state import STOPPED
from engine_manager.settings import load_settings

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def replica_plan(tmp_path_factory):
    """A real plan of the replica as `dsv41 plan --replica` saves it (its Strata profile in the plans folder), made
    once; each test gets a deep copy (with the profile path moved into that test's plans folder)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("DSV41_DATA_DIR", str(tmp_path_factory.mktemp("plan-data")))
    try:
        out = P.make_plan(load_settings().settings, P.PlanRequest(host="reference", save=False))
        return out.plan.to_dict()
    finally:
        mp.undo()


@pytest.fixture
def good(replica_plan):
    """The replica plan, its profile in this test's plans folder (as the planner writes it)."""
    d = copy.deepcopy(replica_plan)
    strp = P.plans_dir() / "last-plan.strp"
    strp.parent.mkdir(parents=True, exist_ok=True)
    strp.write_bytes(b"STRP")
    d["strp_path"] = str(strp)
    d["strata_args"] = ["--expert-cache", str(d["hot_experts"]), "--vram-reserve-mib", "700",
                        "--expert-profile", str(strp)]
    return d


def write(tmp_path: Path, doc, name: str = "plan.json") -> Path:
    p = tmp_path / name
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return p


def dsv41(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine_manager", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ))


# ------------------------------------------------------------------------------------------------ what passes
def test_the_planners_own_plans_pass(good, tmp_path):
    assert P.check_plan(copy.deepcopy(good)) == good
    assert P.read_plan_file(write(tmp_path, good)) == good
    from engine_manager.start_plan import default_plan
    sim_plan, _ = default_plan("sim", load_settings().settings)
    assert sim_plan is not None and P.check_plan(sim_plan) is sim_plan
    no_profile = dict(good, strp_path=None, strata_args=good["strata_args"][:4])
    assert P.check_plan(no_profile) is no_profile
    # a profile in the engine's run folder (written there from the hot set) is the panel's own too
    from engine_manager import paths
    run_strp = paths.runs_dir() / "strata" / "expert-profile.strp"
    assert P.check_strata_args(["--expert-profile", str(run_strp)]) == ["--expert-profile", str(run_strp)]


def test_dsv41_plan_out_then_start_plan_dry_run_still_works(tmp_path):
    out = tmp_path / "p.json"
    r = dsv41("plan", "--replica", "--no-save", "--out", str(out))
    assert r.returncode in (0, 3), r.stderr
    r = dsv41("start", "--engine", "sim", "--plan", str(out), "--dry-run")
    assert r.returncode in (0, 3), r.stderr[-2000:]
    assert "Traceback" not in r.stderr


# ------------------------------------------------------------------------------------------------ what is refused
WRITERS = [
    ("dump_routing", ["--dump-routing", "~/victim.txt"], "--dump-routing"),
    ("profile_save", ["--expert-profile-save", "/tmp/victim.strp"], "--expert-profile-save"),
    ("unknown_flag", ["--mmap-experts"], "--mmap-experts"),
    ("equals_form", ["--expert-cache=5"], "--expert-cache=5"),
    ("cache_not_a_number", ["--expert-cache", "lots"], "--expert-cache"),
    ("reserve_negative", ["--vram-reserve-mib", "-5"], "--vram-reserve-mib"),
    ("twice", ["--expert-cache", "5", "--expert-cache", "6"], "twice"),
    ("no_value", ["--vram-reserve-mib"], "no value"),
    ("profile_elsewhere", ["--expert-profile", "/etc/passwd"], "outside"),
    ("profile_dotdot", ["--expert-profile", "PLANS/../../victim.strp"], "outside"),
]


@pytest.mark.parametrize("name,args,words", WRITERS, ids=[w[0] for w in WRITERS])
def test_a_plan_carries_only_the_planners_flags(good, tmp_path, name, args, words):
    bad = dict(good, strata_args=[a.replace("PLANS", str(P.plans_dir())) for a in args], strp_path=None)
    with pytest.raises(P.PlanError, match="cannot be started") as e:
        P.read_plan_file(write(tmp_path, bad))
    assert words in str(e.value) and "dsv41 plan" in str(e.value)


def test_a_profile_path_outside_the_plans_folder_is_refused(good, tmp_path):
    outside = tmp_path / "elsewhere.strp"
    outside.write_bytes(b"STRP")
    with pytest.raises(P.PlanError, match="strp_path .* outside the panel's plans folder"):
        P.check_plan(dict(good, strp_path=str(outside)))
    link = P.plans_dir() / "link.strp"            # a link in the plans folder that leads out of it
    link.symlink_to(outside)
    with pytest.raises(P.PlanError, match="outside"):
        P.check_plan(dict(good, strp_path=str(link)))


FIELDS = [
    ("hardware_str", {"hardware": "x"}, "hardware"),
    ("hot_set_str", {"hot_set": [[0, "x"]]}, "hot_set.0.1"),
    ("hot_set_short", {"hot_set": [[3]]}, "hot_set.0"),
    ("hot_set_layer", {"hot_set": [[5000, 1]]}, "hot_set"),
    ("hot_set_expert", {"hot_set": [[3, 384]]}, "hot_set[0]"),
    ("hot_set_negative", {"hot_set": [[-1, 0]]}, "hot_set"),
    ("hot_set_bool", {"hot_set": [[True, 1]]}, "hot_set"),
    ("n_layers_huge", {"model": {"n_layers": 10**9}}, "model.n_layers"),
    ("n_experts_huge", {"model": {"n_experts": 10**9}}, "model.n_experts"),
    ("pairs_huge", {"model": {"n_layers": 1000, "n_experts": 60000}}, "more than any real model"),
    ("n_layers_str", {"model": {"n_layers": "43"}}, "model.n_layers"),
    ("n_layers_float", {"model": {"n_layers": 43.5}}, "model.n_layers"),
    ("moe_layer_out", {"model": {"n_layers": 43, "moe_layers": [3, 99]}}, "moe_layers names layer 99"),
    ("used_over", {"model": {"n_experts": 8, "n_experts_used": 9}}, "n_experts_used"),
    ("refused_int", {"refused": 5}, "refused"),
    ("rate_over", {"predicted_hit_rate": 2.5}, "predicted_hit_rate"),
    ("rate_nan", {"predicted_hit_rate": float("nan")}, "predicted_hit_rate"),
    ("slots_zero", {"settings": {"slots": 0}}, "settings.slots"),
    ("kv_bogus", {"settings": {"kv_type": "bogus"}}, "settings.kv_type"),
    ("cpu_layers_str", {"llamacpp_cpu_layers": ["a"]}, "llamacpp_cpu_layers"),
    ("cpu_layers_out", {"llamacpp_cpu_layers": [500]}, "llamacpp_cpu_layers"),
    ("hot_experts_neg", {"hot_experts": -1}, "hot_experts"),
    ("strata_args_str", {"strata_args": "--dump-routing x"}, "strata_args"),
    ("llamacpp_flag", {"llamacpp_args": ["--log-file", "/tmp/x"]}, "llamacpp_args"),
    ("vram_terms", {"vram": {"terms": "x"}}, "vram.terms"),
    ("usage_counts", {"usage": {"counts": [["x"]]}}, "usage.counts"),
    ("model_list", {"model": [1, 2]}, "no schema"),
    ("schema_2", {"schema": 2}, "no schema"),
]


@pytest.mark.parametrize("name,change,words", FIELDS, ids=[f[0] for f in FIELDS])
def test_every_field_an_engine_reads_is_checked(good, tmp_path, name, change, words):
    bad = copy.deepcopy(good)
    for k, v in change.items():
        if isinstance(v, dict) and isinstance(bad.get(k), dict):
            bad[k].update(v)
        else:
            bad[k] = v
    with pytest.raises(P.PlanError) as e:
        P.read_plan_file(write(tmp_path, bad))
    assert words in str(e.value), str(e.value)
    assert "Traceback" not in str(e.value) and len(str(e.value)) < 2000


def test_files_that_are_not_plans_are_refused_in_words(tmp_path):
    deep = write(tmp_path, "[" * 100_000 + "]" * 100_000, "deep.json")
    with pytest.raises(P.PlanError, match="cannot be read as JSON"):
        P.read_plan_file(deep)
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(P.PLAN_MAX_BYTES + 10)
    with pytest.raises(P.PlanError, match="larger than"):
        P.read_plan_file(big)
    with pytest.raises(P.PlanError, match="Is a directory|not a regular file"):
        P.read_plan_file(tmp_path)
    fifo = tmp_path / "plan.fifo"
    os.mkfifo(fifo)                                 # nobody writes: a blocking open would wait forever
    with pytest.raises(P.PlanError, match="not a regular file"):
        P.read_plan_file(fifo)
    with pytest.raises(P.PlanError, match="does not exist"):
        P.read_plan_file(tmp_path / "nope.json")


def test_a_seeded_corpus_of_mutated_plans_gives_a_plan_or_words_never_a_traceback(good):
    """~600 plans, each the planner's with one field (at any depth) replaced by a hostile value."""
    hostile = [None, "x", "", -1, 0, 10**12, 10**30, 1.5, float("inf"), True, [], {}, [[0, "x"]], [None],
               {"a": 1}, "../../etc/passwd", ["--dump-routing", "x"], "\x1b]0;title\x07", [-1, -1]]

    def paths_of(d, prefix=()):
        if isinstance(d, dict):
            for k, v in d.items():
                yield prefix + (k,)
                yield from paths_of(v, prefix + (k,))
        elif isinstance(d, list) and d:
            yield prefix + (0,)
            yield from paths_of(d[0], prefix + (0,))

    small = copy.deepcopy(good)
    small["usage"]["counts"] = (small["usage"]["counts"] or [[1.0]])[:2]     # keep the corpus fast
    small["hot_set"] = small["hot_set"][:50]
    all_paths = [p for p in paths_of(small) if p[0] != "coverage"]
    rng = random.Random(26)
    outcomes = {"ok": 0, "refused": 0}
    for _ in range(600):
        doc = copy.deepcopy(small)
        path = rng.choice(all_paths)
        target = doc
        for k in path[:-1]:
            target = target[k]
        target[path[-1]] = copy.deepcopy(rng.choice(hostile))
        try:
            P.check_plan(doc)
            outcomes["ok"] += 1
        except P.PlanError as exc:
            assert str(exc) and "Traceback" not in str(exc)
            outcomes["refused"] += 1
    assert outcomes["refused"] > 100 and outcomes["ok"] > 0, outcomes   # many mutations break a field that is read


# ------------------------------------------------------------------------------------------------ where plans enter
@pytest.fixture
def port(monkeypatch, free_port):
    monkeypatch.setenv("DSV41_PORT", str(free_port))
    yield free_port
    for _ in sv.Supervisor(load_settings().settings).stop(force=True):
        pass


@pytest.mark.parametrize("cmd", [["start", "--engine", "sim"], ["start", "--engine", "strata", "--dry-run"],
                                 ["bench", "--engine", "sim", "--quick"], ["prepare"]])
def test_the_cli_refuses_a_hostile_plan_before_anything_starts(good, tmp_path, port, cmd):
    bad = write(tmp_path, dict(good, strata_args=["--dump-routing", str(tmp_path / "victim.txt")]))
    r = dsv41(*cmd, "--plan", str(bad))
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "--dump-routing" in r.stderr and "dsv41 plan" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "victim.txt").exists()
    assert sv.Supervisor(load_settings().settings).status(check_health=False).state == STOPPED


def test_dsv41_start_refuses_a_plan_of_a_billion_layers_at_once(good, tmp_path, port):
    bad = copy.deepcopy(good)
    bad["model"]["n_layers"] = 10**9
    bad["strp_path"] = None
    bad["strata_args"] = bad["strata_args"][:4]
    r = dsv41("start", "--engine", "sim", "--plan", str(write(tmp_path, bad)))
    assert r.returncode == 2 and "model.n_layers" in r.stderr and "1024" in r.stderr, r.stderr[-2000:]


def test_the_scripted_engine_refuses_a_hostile_plan_in_words(sim_process, good, tmp_path):
    bad = copy.deepcopy(good)
    bad["hot_set"] = [[0, "x"]]
    sp = sim_process("--plan", str(write(tmp_path, bad)))
    assert sp.proc.wait(60) == 2
    out = "\n".join(sp.lines)
    assert "hot_set" in out and "Traceback" not in out


def test_a_hostile_saved_plan_is_not_used(good):
    bad = copy.deepcopy(good)
    bad["hardware"] = "x"
    P.save_plan(bad)
    assert P.load_last_plan() is None and P.load_shown_plan() is None
    # and the words that name a plan's host never fail on one
    from engine_manager.start_plan import plan_host_warning, usable_plan
    assert "an unknown host" in plan_host_warning(bad)
    assert usable_plan("strata", bad) is bad
    assert P.why_not_startable(bad) is None
