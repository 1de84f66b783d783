"""The engine adapters behind one interface: launch specs (argv, env, generated files), readiness, the mapping
of metric responses to the common Sample, log lines and failure signatures.

There is no real Strata server on the build machines: the strata adapter's metrics, readiness and log lines are
tested in ``test_strata_adapter.py`` against Strata's answers as its code builds them (``tests/data/strata/``,
sourced in its SOURCES.md), and here against the scripted engine — captured from it (``tests/data/sim/``) and live
as a real subprocess.
(The llama.cpp adapter has its own tests in ``test_llamacpp.py``.)
"""

from __future__ import annotations

import json
import os
import stat
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from engine_manager.engines import get_engine
from engine_manager.engines.base import LaunchSpec, Sample
from engine_manager.engines.strata import (
    parse_prometheus,
    sample_from_metrics,
    sample_from_prometheus,
    write_strp,
)
from engine_manager.errors import PlacementRefused
from engine_manager.settings import load_settings

DATA = Path(__file__).parent / "data"
STRATA = get_engine("strata")
SIM = get_engine("sim")
KEY = "dsv41-test-key-0123456789abcdef"


@pytest.fixture
def settings(tmp_path):
    s = load_settings(env={"DSV41_API_KEY": KEY}, path=tmp_path / "settings.json").settings
    return s.model_copy(update={"slots": 4, "context_length": 16384, "kv_type": "k8v4", "cpu_numerics": "gpu",
                                "vram_reserve_mib": 900, "port": 18090})


def _plan(hot=((3, 17), (3, 250), (4, 1)), **kw):
    plan = {"schema": 1, "refused": None,
            "model": {"name": "DeepSeek-V4.1-Flash", "file": "/models/x-00001-of-00007.gguf", "n_layers": 43,
                      "moe_layers": list(range(3, 43)), "n_experts": 384, "n_experts_used": 6,
                      "expert_bytes": 12792627},
            "hot_experts": len(hot), "hot_set": [list(p) for p in hot],
            "strata_args": ["--expert-cache", str(len(hot)), "--vram-reserve-mib", "700"], "strp_path": None,
            "predicted_hit_rate": None, "settings": {"slots": 4, "context_length": 16384, "kv_type": "k8v4"}}
    plan.update(kw)
    return plan


def _flag(args, flag):
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


# ------------------------------------------------------------------------------------------------ strata launch
def test_strata_launch_follows_the_contract(settings, tmp_path):
    edir = tmp_path / "release"
    (edir / "serve").mkdir(parents=True)
    (edir / "serve" / "server.py").write_text("# placeholder\n")
    (edir / "bin").mkdir()
    (edir / "bin" / "strata").write_text("")
    (edir / ".venv" / "bin").mkdir(parents=True)           # the release's own Python (Strata's setup makes .venv)
    (edir / ".venv" / "bin" / "python").write_text("")
    (edir / ".venv" / "bin" / "python").chmod(0o755)
    s = settings.model_copy(update={"engine_dir": edir})
    spec = STRATA.build_launch(s, _plan(), tmp_path / "run")
    # serve/server.py main() (Niko1221/Strata): --engine defaults to "mock", so "--engine strata" is required
    assert spec.argv[1:] == [str(edir / "serve" / "server.py"), "--engine", "strata", "--config", spec.files["config"],
                             "--host", "127.0.0.1", "--port", "18090", "--gpu", "0"]
    assert not spec.simulated and spec.base_url == "http://127.0.0.1:18090" and spec.cwd == str(edir)
    # the key is on no command line (ps shows those to every user): Strata's server reads $STRATA_API_KEY when
    # --api-key is not given; the environment shown anywhere (dry run, state file) is masked
    assert all(KEY not in a for a in spec.argv) and spec.env["STRATA_API_KEY"] == KEY
    assert KEY not in json.dumps(spec.masked_env()) and "(masked)" in spec.masked_env()["STRATA_API_KEY"]
    cfg_path = Path(spec.files["config"])
    cfg = json.loads(cfg_path.read_text())
    assert stat.S_IMODE(cfg_path.stat().st_mode) == 0o600 and KEY not in cfg_path.read_text()
    # generate.cpp wants --pack PACK --native SHARD1 first (a bare model path is "unknown argument")
    assert cfg["exe"] == str(edir / "bin" / "strata") and cfg["args"][:2] == ["--pack", cfg["tokenizer"][:-10]]
    assert cfg["args"][2:4] == ["--native", "/models/x-00001-of-00007.gguf"]
    assert cfg["tokenizer"].endswith("/tokenizer") and cfg["log"] == spec.files["engine_log"]
    args = cfg["args"]
    # each plan- or settings-driven flag exactly once, with the settings' values; the slots are the config's
    # "parallel" (the server appends --batch itself), never --batch in args
    assert _flag(args, "--expert-cache") == ["3"] and _flag(args, "--vram-reserve-mib") == ["900"]
    assert _flag(args, "--batch") == [] and cfg["parallel"] == 4 and _flag(args, "--max-context") == ["16384"]
    assert _flag(args, "--kv") == ["k8v4"] and _flag(args, "--cpu-numerics") == ["gpu"]
    (profile,) = _flag(args, "--expert-profile")
    assert spec.files["profile"] == profile
    # the generated STRP has the contract's exact byte layout
    data = Path(profile).read_bytes()
    assert data[:4] == b"STRP" and struct.unpack_from("<5I", data, 4) == (1, 43, 384, 3, 3)
    assert struct.unpack_from("<6H", data, 24) == (3, 17, 3, 250, 4, 1)
    ranks = struct.unpack_from(f"<{43 * 384}i", data, 24 + 12)
    assert ranks[3 * 384 + 17] == 0 and ranks[3 * 384 + 250] == 1 and ranks[4 * 384 + 1] == 2
    assert sum(r >= 0 for r in ranks) == 3 and len(data) == 24 + 12 + 4 * 43 * 384
    routing = pytest.importorskip("engine_manager.expert_routing")
    prof = routing.read_strp(profile)
    assert [tuple(p) for p in prof.ranked.tolist()] == [(3, 17), (3, 250), (4, 1)]
    # nothing missing: no preflight problem but the model file
    problems = STRATA.preflight(spec)
    assert len(problems) == 1 and "model file" in problems[0]


def test_strata_uses_the_planners_profile_and_says_what_is_missing(settings, tmp_path):
    strp = tmp_path / "planned.strp"
    write_strp(strp, 43, 384, [(5, 5)], 1)
    spec = STRATA.build_launch(settings, _plan(strp_path=str(strp)), tmp_path / "run")
    args = json.loads(Path(spec.files["config"]).read_text())["args"]
    assert _flag(args, "--expert-profile") == [str(strp)]
    # no engine_dir: the release in the cache, by version
    assert spec.argv[1] == str(settings.cache_path / "engine" / "v0.1.0" / "serve" / "server.py")
    problems = " ".join(STRATA.preflight(spec))
    assert "not installed" in problems and "DSV41_ENGINE_DIR" in problems
    # no plan at all: the engine sizes its cache itself
    args = json.loads(Path(STRATA.build_launch(settings, None, tmp_path / "r2").files["config"]).read_text())["args"]
    assert _flag(args, "--expert-cache") == ["auto"] and not _flag(args, "--expert-profile")
    with pytest.raises(PlacementRefused, match="refused"):
        STRATA.build_launch(settings, _plan(refused="RAM too small"), tmp_path / "r3")


# ------------------------------------------------------------------------------------------------ metrics mapping
# Strata's /metrics, Prometheus text, readiness and log lines on its real fields: tests/test_strata_adapter.py
# (fixtures transcribed from Strata's code, tests/data/strata/SOURCES.md).


def test_sim_captures_map_to_samples():
    doc = json.loads((DATA / "sim" / "metrics_generating.json").read_text())
    from engine_manager.engines.sim import apply_sim_block

    prev = apply_sim_block(sample_from_metrics(doc, "sim", None, t=1.0, simulated=True), doc, None)
    later = json.loads(json.dumps(doc))
    later["sim"]["swaps_total"] += 30
    later["sim"]["swap_bytes_total"] += 30 * 12_792_627
    s = apply_sim_block(sample_from_metrics(later, "sim", prev, t=3.0, simulated=True), later, prev)
    live = doc["live"]
    assert s.simulated and s.state == "generating" and s.decode_tok_s == live["tok_s"]
    # Strata's fields (serve/server.py @2291cb3 StrataEngine.slots_view): busy = state != "idle", per-slot rates
    # from the decoding slots' tok_s, and no hit rate while a request runs (only finished requests carry one)
    assert s.slots_busy == sum(1 for x in live["slots"] if x["state"] != "idle") and s.slots_total == 4
    assert s.decode_tok_s_per_slot == {x["slot"]: x["tok_s"] for x in live["slots"]
                                       if x["state"] == "decoding" and x.get("tok_s") is not None}
    assert s.hit_rate is None
    assert s.swaps_total == doc["sim"]["swaps_total"] + 30 and s.swaps_per_s == pytest.approx(15.0)
    assert s.swap_mb_s == pytest.approx(15 * 12.792627)
    assert s.tokens_generated_total == doc["totals"]["output_tokens"]
    text = (DATA / "sim" / "metrics_generating.prom").read_text()    # captured a moment after the JSON
    p = sample_from_prometheus(text, "sim", simulated=True)
    assert p.decode_tok_s == parse_prometheus(text)["strata:live_tok_s"] > 0 and p.slots_busy == 4
    assert p.tokens_generated_total == parse_prometheus(text)["vllm:generation_tokens_total"] and p.simulated


# ------------------------------------------------------------------------------------------------ log lines
def test_log_lines_from_the_sims_capture_and_the_contract():
    events = [SIM.parse_log_line(x) for x in (DATA / "sim" / "engine.log").read_text().splitlines()]
    kinds = [e.kind for e in events if e]
    assert kinds.count("ready") == 1 and kinds.count("phase") >= 5 and "placement" in kinds
    swaps = [e for e in events if e and e.kind == "swap"]
    assert swaps and all(e.swaps > 0 and e.swap_bytes >= e.swaps * 12_000_000 for e in swaps)
    hits = [e.data["hit_rate"] for e in events if e and e.kind == "info" and "hit_rate" in e.data]
    assert hits and all(0 < h < 1 for h in hits)
    assert STRATA.parse_log_line("") is None and STRATA.parse_log_line("some chatter") is None
    ev = STRATA.parse_log_line("[adapt] round 12: 37 swaps (451.4 MiB)")
    assert ev.kind == "swap" and ev.swaps == 37 and ev.swap_bytes == int(451.4 * 2**20)


@pytest.mark.parametrize("line,rc,cause", [
    ("CUDA error: out of memory at expert_cache.cu:88", 1, "cuda_oom"),
    ("cudaMalloc failed: 2 (cudaErrorMemoryAllocation)", 1, "cuda_oom"),
    ("CUDA driver version is insufficient for CUDA runtime version", 1, "driver_too_old"),
    ("server.py: error: port 8090 is already in use", 2, "port_in_use"),
    ("OSError: [Errno 98] Address already in use", 1, "port_in_use"),
    ("error: expert profile refused: 43 x 256 vs 43 x 384", 2, "placement_refused"),
    ("server.py: error: unrecognized arguments: --cpu-numerics gpu", 2, "bad_engine_flag"),
    ("failed to open /models/DeepSeek-V4.1-Flash-Q2_K-00001-of-00007.gguf", 1, "model_missing"),
    ("Segmentation fault (core dumped)", -11, "engine_crash"),
])
def test_failure_signatures(line, rc, cause):
    tail = ["phase: filling the expert cache (40%)", line, "exiting"]
    assert STRATA.classify_failure(rc, tail).cause == cause
    assert SIM.classify_failure(rc, tail).cause == cause
    assert STRATA.parse_log_line(line).kind in ("error", "phase")


def test_sigkill_without_a_log_reason_is_the_oom_killer():
    assert STRATA.classify_failure(-9, ["phase: warming up (100%)"]).cause == "oom_killed"
    assert STRATA.classify_failure(137, []).cause == "oom_killed"
    assert STRATA.classify_failure(1, ["something odd"]) is None


# ------------------------------------------------------------------------------------------------ readiness
class _Fixed(BaseHTTPRequestHandler):
    code, body = 404, b'{"error": "no"}'

    def do_GET(self):  # noqa: N802
        self.send_response(self.code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *a):
        pass


@pytest.mark.parametrize("code,body,state", [
    (404, b'{"error": "no"}', "failed"),
    (503, b'{"status": "loading"}', "loading"),
    (200, b'{"status": "loading", "loaded": false, "service": "strata"}', "loading"),
    (200, b'{"status": "ok", "loaded": true, "model": "m", "max_context": 1, "service": "strata"}', "ready"),
    (200, b"<html>", "failed"),
])
def test_readiness_against_real_servers(code, body, state):
    handler = type("H", (_Fixed,), {"code": code, "body": body})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        spec = LaunchSpec("strata", [], "127.0.0.1", srv.server_address[1], KEY)
        with httpx.Client() as c:
            assert STRATA.readiness(c, spec).state == state
    finally:
        srv.shutdown()
        srv.server_close()
    with httpx.Client() as c:      # nothing listening any more: still loading
        assert STRATA.readiness(c, spec).state == "loading"


@pytest.mark.parametrize("code,body,strata,llamacpp,words", [
    # llama-server while it loads: 503 with its error body; Strata's rule and llama.cpp's agree
    (503, b'{"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}', "loading", "loading",
     "Loading model"),
    # llama-server's 200 has no "loaded" flag: ready for llama.cpp, never for Strata's rule (which names the port)
    (200, b'{"status": "ok"}', "failed", "ready", "names no service"),
    # another program: failed for both, with the port named so the user knows where to look
    (404, b"<html>not here</html>", "failed", "failed", "is another server on port"),
    (500, b'{"error": "boom"}', "failed", "failed", "boom"),
])
def test_one_probe_for_every_engine(code, body, strata, llamacpp, words):
    """engines._http.probe_health is the one readiness probe: the Strata, llama.cpp and scripted-engine adapters
    all answer through it, each with its own rule, against the same real loopback server."""
    from engine_manager.engines._http import probe_health

    handler = type("H", (_Fixed,), {"code": code, "body": body})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    try:
        with httpx.Client() as c:
            s = STRATA.readiness(c, LaunchSpec("strata", [], "127.0.0.1", port, KEY))
            ll = get_engine("llamacpp").readiness(c, LaunchSpec("llamacpp", [], "127.0.0.1", port, KEY))
            sim = SIM.readiness(c, LaunchSpec("sim", [], "127.0.0.1", port, KEY))
            direct = probe_health(c, f"http://127.0.0.1:{port}", port=port)
    finally:
        srv.shutdown()
        srv.server_close()
    assert (s.state, ll.state, direct.state) == (strata, llamacpp, llamacpp)
    assert sim.state == ("loading" if code == 200 else strata)     # the sim: loaded flag needed, any service
    said = s.detail if strata != "ready" else ll.detail
    assert words in said and (str(port) in said or words in ("Loading model", "boom"))


def test_the_probe_says_loading_while_nothing_listens_and_ready_once_the_sim_is(sim_process):
    """A real scripted engine: refused while it loads (the port opens after the engine's READY), then ready."""
    from engine_manager.engines._http import probe_health

    sp = sim_process("--slots", "1", load_time=1.0)
    with httpx.Client() as c:
        sp.wait_for_line(r"^phase: ")
        first = probe_health(c, sp.base_url, needs_loaded=True)
        sp.wait_ready()
        ready = probe_health(c, sp.base_url, needs_loaded=True, service_hint="strata")
        wrong = probe_health(c, sp.base_url, needs_loaded=True, expect_service="strata")
    assert first.state == "loading" and "refused" in first.detail
    assert ready.state == "ready" and "strata-sim" in ready.detail and "simulated" in ready.detail
    # the scripted engine says "strata-sim": a caller that insists on Strata itself is told it is something else
    assert wrong.state == "failed" and "not a Strata server" in wrong.detail and str(sp.port) in wrong.detail


# ------------------------------------------------------------------------------------------------ Prometheus
def test_prometheus_pages_are_read_by_prometheus_clients_parser():
    """engines.prometheus_text is the one reader (prometheus_client's parser): Strata's page through the strata
    adapter, llama-server's through the llama.cpp adapter, the same samples either way."""
    from engine_manager.engines import prometheus_text as P
    from engine_manager.engines import llamacpp

    strata_page = (DATA / "strata" / "prometheus.txt").read_text()
    rows = P.read_samples(strata_page)
    assert rows and parse_prometheus(strata_page) == P.summed(strata_page)
    # every sample line of the page is one sample (comments and blank lines are not)
    lines = [ln for ln in strata_page.splitlines() if ln.strip() and not ln.startswith("#")]
    assert len(rows) == len([ln for ln in lines if not ln.split()[-1].lower() == "nan"])
    llama_page = (DATA / "llamacpp" / "metrics_busy.txt").read_text()
    m = llamacpp.parse_prometheus(llama_page)
    # llama-server writes a counter without "_total" (llamacpp:n_tokens_max): its name stays as written
    assert "llamacpp:n_tokens_max" in m and "llamacpp:n_tokens_max_total" not in m
    assert m["llamacpp:n_tokens_max"] == float(next(ln.split()[-1] for ln in llama_page.splitlines()
                                                    if ln.startswith("llamacpp:n_tokens_max ")))


def test_prometheus_label_values_may_hold_braces_commas_and_quotes():
    """What a line regex got wrong: a label value with ``}``, ``,`` or an escaped quote is one label; a broken
    line costs only itself."""
    from engine_manager.engines import prometheus_text as P

    page = ('# TYPE x gauge\n'
            'x{model_name="a}b,c",q="say \\"hi\\""} 2\n'
            'this line is not prometheus\n'
            'y 3\n')
    rows = P.read_samples(page)
    assert ("x", {"model_name": "a}b,c", "q": 'say "hi"'}, 2.0) in rows and ("y", {}, 3.0) in rows
    assert len(rows) == 2
    assert P.by_series(page)[P.series_key("x", {"model_name": "a}b,c", "q": 'say "hi"'})] == 2.0


# ------------------------------------------------------------------------------------------------ the sim, live
def test_sim_launch_spec_runs_as_is_and_polls(settings, tmp_path, free_port):
    placement = pytest.importorskip("engine_manager.placement")
    from engine_manager import plans
    plan = placement.plan(plans.default_sim_layout(tmp_path / "replica"), placement.reference_hardware(),
                          None, None).to_dict()
    s = settings.model_copy(update={"port": free_port, "slots": 2})
    spec = SIM.build_launch(s, plan, tmp_path / "run")
    assert spec.simulated and "SIMULATED" in spec.label and spec.argv[:3] == [sys.executable, "-m",
                                                                              "engine_manager.sim"]
    assert _flag(spec.argv, "--plan") == [spec.files["plan"]] and _flag(spec.argv, "--slots") == ["2"]
    assert KEY not in " ".join(spec.masked_argv())
    import subprocess

    import re

    from engine_manager.metrics.sources import LogSwapSource

    env = {**os.environ, **spec.env, "DSV41_SIM_ARGS": "--load-time 0.3 --speed 10"}
    proc = subprocess.Popen(spec.argv, cwd=spec.cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, text=True)
    lines: list[str] = []             # the engine's log (its stdout), read as the supervisor would tail it
    reader = threading.Thread(target=lambda: lines.extend(ln.rstrip("\n") for ln in proc.stdout), daemon=True)
    reader.start()

    def exchanged() -> int | None:
        """The resident tier's cumulative exchange count from the newest such line (generate.cpp's words)."""
        got = [int(m.group(1)) for ln in list(lines) if (m := re.search(r"(\d+) exchanged with the VRAM tier", ln))]
        return got[-1] if got else None

    def log_swaps() -> int:
        src = LogSwapSource(SIM)              # fed the log's lines, as the hub's log source is
        for ln in list(lines):
            src.push_line(ln)
        return src.read().notes["log_swaps_total"]
    try:
        with httpx.Client() as c:
            deadline = time.monotonic() + 30
            states = []
            while time.monotonic() < deadline:
                r = SIM.readiness(c, spec)
                states.append(r.state)
                if r.state == "ready":
                    break
                time.sleep(0.05)
            assert states[0] == "loading" and states[-1] == "ready"
            r = c.post(spec.base_url + "/v1/chat/completions", headers={"x-api-key": KEY},
                       json={"messages": [{"role": "user", "content": "How are the experts cached on the GPU?"}],
                             "max_tokens": 40})
            assert r.status_code == 200
            s1 = SIM.poll(c, spec, None)
            s2 = SIM.poll(c, spec, s1)
        assert isinstance(s2, Sample) and s2.simulated and s2.engine == "sim"
        assert s2.state == "idle" and s2.slots_total == 2 and s2.slots_busy == 0
        # idle: the hit rate is the finished request's (Strata has no live one: requests[].hit_rate from DONE);
        # an offload question routes partly away from the profile's hot set (corpus.Topic.routing): below ~0.9
        assert 0.5 < s2.hit_rate < 1.0 and s2.extra["hit_rate_last"] == s2.hit_rate
        assert s2.tokens_generated_total == 40 and s2.requests_total == 1
        assert s2.vram_total_bytes == plan["vram"]["budget_bytes"] and s2.prefill_tok_s and s2.prefill_tok_s > 0
        # swaps are not on HTTP (as in Strata): they come from the engine's log, where the per-round "adapt:" lines
        # add up to the cumulative "exchanged with the VRAM tier" count printed after the request
        assert s2.swaps_total is None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (exchanged() is None or log_swaps() != exchanged()):
            time.sleep(0.05)
        assert exchanged() is not None and log_swaps() == exchanged() > 0
    finally:
        proc.terminate()
        assert proc.wait(10) == 0
        reader.join(10)
        proc.stdout.close()


# ------------------------------------------------------------------------------------------------ the registry
ROOT = Path(__file__).resolve().parents[1]


def _engine_name_compares(tree, names: set[str]) -> list[tuple[int, str]]:
    """(line, source) of each comparison (``==``, ``!=``, ``in`` …) or ``case`` pattern against a constant in
    ``names`` — alone or in a tuple, list or set — in a parsed module."""
    import ast

    def consts(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            for e in node.elts:
                yield from consts(e)

    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif isinstance(node, ast.MatchValue):
            operands = [node.value]
        else:
            continue
        if any(c in names for op in operands for c in consts(op)):
            hits.append((node.lineno, ast.unparse(node)))
    return hits


def test_no_code_outside_the_engines_package_compares_an_engine_name():
    """An engine's facts are its adapter's traits (engines.base.Engine): code outside engine_manager/engines/ reads
    them through engines.find_engine / get_engine and never asks ``engine == "llamacpp"``."""
    import ast

    from engine_manager.engines import registry

    names = set(registry.ALL) | set(registry.ALIASES)
    # the scan sees what it must: a comparison, a membership test, a case pattern
    probe = ast.parse('if e == "llamacpp" or e in ("sim", "x") or "vllm" != e:\n    pass\n'
                      'match e:\n    case "strata":\n        pass\n')
    assert [ln for ln, _ in _engine_name_compares(probe, names)] == [1, 1, 1, 4]
    assert _engine_name_compares(ast.parse('e = "sim"\nf(engine="sim")\nif e == "sims":\n    pass'), names) == []

    engines_dir = ROOT / "engine_manager" / "engines"
    files = [p for top in ("engine_manager", "app") for p in sorted((ROOT / top).rglob("*.py"))
             if engines_dir not in p.parents]
    assert len(files) > 50
    found = [f"{p.relative_to(ROOT)}:{ln}: {src}" for p in files
             for ln, src in _engine_name_compares(ast.parse(p.read_text(), str(p)), names)]
    assert found == [], "compare a trait of the engine instead (engines.find_engine(name).…):\n" + "\n".join(found)


def test_the_registry_and_the_adapters_agree():
    """engines.registry lists every adapter module once, each adapter says the name it is listed under and whether
    it is attach-only, and the tables that other modules keep of engine names read the registry."""
    from typing import get_args

    from engine_manager.bench.config import PRESETS
    from engine_manager.connections import KIND_LABELS
    from engine_manager.engines import registry
    from engine_manager.engines.base import Engine, Evidence
    from engine_manager.settings import EngineName

    modules = {p.stem for p in (ROOT / "engine_manager" / "engines").glob("*.py")
               if "\nENGINE = " in p.read_text()}
    assert modules == set(registry.ALL) and len(registry.ALL) == len(set(registry.ALL))
    assert set(registry.STARTABLE).isdisjoint(registry.ATTACH_ONLY)
    assert set(get_args(EngineName)) == {"auto", *registry.STARTABLE}
    assert all(target in registry.STARTABLE for target in registry.ALIASES.values())
    assert set(registry.ALIASES).isdisjoint(registry.ALL)
    for name in registry.ALL:
        eng = get_engine(name)
        assert isinstance(eng, Engine) and eng.name == name and eng.attach_only == (name in registry.ATTACH_ONLY)
        assert eng.words and eng.kind_label and KIND_LABELS[name] == eng.kind_label
        assert (name in registry.STARTABLE) == bool(eng.choice_label)
        assert set(eng.default_bench_presets) <= set(eng.bench_presets) <= set(PRESETS)
        assert ("numerics" in eng.bench_presets) == eng.cpu_numerics
        # every trait the base class declares keeps its type on the adapter
        for trait, default in vars(Engine).items():
            if not trait.startswith("_") and isinstance(default, (bool, int, float, str, tuple)):
                assert isinstance(getattr(eng, trait), type(default)), (name, trait)
    assert get_engine("mock") is get_engine("sim")
    with pytest.raises(ValueError):
        get_engine("unknown")
    assert registry.find_engine("unknown") is registry.find_engine(None) is registry.UNKNOWN
    assert registry.UNKNOWN.words == "" and not registry.UNKNOWN.simulated

    # detection asks every adapter but InferenceKey's (told by its URL), the specific before the generic: each
    # kind's own answers are recognised as that kind
    assert set(registry.DETECTION_ORDER) == set(registry.ALL) - {"inferencekey"}
    seen = {"sim": Evidence(service="strata-sim", models=True),
            "strata": Evidence(service="strata", models=True),
            "llamacpp": Evidence(props=True, metric_names=frozenset({"llamacpp:tokens_predicted_total"}), models=True),
            "vllm": Evidence(metric_names=frozenset({"vllm:num_requests_running"}), models=True),
            "sglang": Evidence(owned_by=frozenset({"sglang"}), models=True),
            "openai_compat": Evidence(models=True)}
    for kind, ev in seen.items():
        first = next(n for n in registry.DETECTION_ORDER if get_engine(n).recognise(ev) is not None)
        assert first == kind
    assert all(get_engine(n).recognise(Evidence()) is None for n in registry.ALL)
