"""Attach: saved connections, detection of what answers, the vLLM / SGLang / OpenAI adapters, and the
panel watching and chatting with engines it did not start — all against real servers on loopback:

- the scripted engine, a llama-server and Strata's stand-in server, each started by the test itself (foreign to
  the panel): detected, monitored (a hub tick with the engine's figures), chatted with, never stopped;
- a loopback HTTP server answering with vLLM's and SGLang's documented metric text (``tests/data/vllm``,
  ``tests/data/sglang``, each cited in its SOURCES.md) and an OpenAI event stream: rates and percentiles from two
  scrapes, per-GPU figures, missing figures as None;
- the plain-words problems: nothing listening, TLS to a plain-HTTP server, an untrusted certificate, a refused
  key, a program that is not an LLM server;
- the overview of every saved connection (state, users, tok/s from two polls);
- keys: never in the list file, argv, logs or ``--json`` output; the key file is owner-only.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from attach_support import MODEL

from engine_manager import connections as C
from engine_manager.chat import ChatClient, ContentDelta, StreamDone
from engine_manager.engines import get_engine
from engine_manager.metrics import build_hub
from engine_manager.metrics.sources import EngineSource, spec_for

from conftest import require_or_skip

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).parent / "data"


def chat_text(base_url: str, key: str) -> str:
    with ChatClient(base_url, key) as client:
        parts, done = [], None
        for ev in client.stream([{"role": "user", "content": "Say hello."}]):
            if isinstance(ev, ContentDelta):
                parts.append(ev.text)
            elif isinstance(ev, StreamDone):
                done = ev
    assert done is not None and not done.stats.cancelled
    return "".join(parts)


# -- adapters on the documented text -------------------------------------------------------------------------------
def two_samples(engine: str):
    eng = get_engine(engine)
    s1 = eng.sample_from_text((DATA / engine / "metrics-1.txt").read_text(), 1000.0, None)
    s2 = eng.sample_from_text((DATA / engine / "metrics-2.txt").read_text(), 1010.0, s1)
    return s1, s2


def test_vllm_rates_and_percentiles_from_two_scrapes():
    s1, s2 = two_samples("vllm")
    # one scrape: no rate, no percentile (missing, not 0); gauges are there
    assert s1.decode_tok_s is None and s1.prefill_tok_s is None
    assert s1.extra["ttft_p50_s"] is None and s1.extra["e2e_p90_s"] is None
    assert s1.slots_busy == 1
    # SOURCES.md: +2,500 generated and +5,000 prompt tokens over the 10 s between the scrapes
    assert s2.decode_tok_s == pytest.approx(250.0) and s2.prefill_tok_s == pytest.approx(500.0)
    assert (s2.slots_busy, s2.queued, s2.state) == (5, 1, "generating")
    assert s2.tokens_generated_total == 22500 and s2.requests_total == 32
    assert s2.extra["kv_cache_usage"] == pytest.approx(0.30)          # mean over the two engine cores
    # TTFT between the scrapes: 4 in (.04,.06], 4 in (.06,.08], 2 in (.08,.1] → p50 .065, p90 .09, p99 .099
    assert s2.extra["ttft_count"] == 10
    assert s2.extra["ttft_p50_s"] == pytest.approx(0.065)
    assert s2.extra["ttft_p90_s"] == pytest.approx(0.09)
    assert s2.extra["ttft_p99_s"] == pytest.approx(0.099)
    # end to end: 5 in (1,1.5], 5 in (1.5,2] → p50 1.5, p90 1.9 — not the old requests' 2.0–2.5 s
    assert s2.extra["e2e_p50_s"] == pytest.approx(1.5) and s2.extra["e2e_p90_s"] == pytest.approx(1.9)
    assert s2.extra["per_gpu"] == {"engine=0": {"running": 3.0, "waiting": 1.0, "kv_cache_usage": 0.25},
                                   "engine=1": {"running": 2.0, "waiting": 0.0, "kv_cache_usage": 0.35}}
    # what vLLM does not say is missing, never 0
    assert s2.hit_rate is None and s2.swaps_per_s is None and s2.vram_used_bytes is None and s2.slots_total is None


def test_sglang_rates_and_percentiles_from_two_scrapes():
    s1, s2 = two_samples("sglang")
    assert s1.decode_tok_s is None and s1.extra["e2e_p50_s"] is None
    assert s2.decode_tok_s == pytest.approx(400.0) and s2.prefill_tok_s == pytest.approx(1000.0)
    assert (s2.slots_busy, s2.queued) == (160, 2800)
    assert s2.extra["kv_cache_usage"] == pytest.approx(0.35)
    assert s2.extra["engine_gen_tok_s"] == pytest.approx(401.2)
    assert s2.extra["ttft_p50_s"] == pytest.approx(0.75) and s2.extra["ttft_p90_s"] == pytest.approx(0.95)
    assert s2.extra["e2e_p50_s"] == pytest.approx(7.5) and s2.extra["e2e_p99_s"] == pytest.approx(9.95)
    assert set(s2.extra["per_gpu"]) == {"tp_rank=0", "tp_rank=1"}
    assert s2.extra["per_gpu"]["tp_rank=1"]["running"] == 70.0
    # the fixture has no sglang:num_requests_total: missing, not 0
    assert s2.requests_total is None


def test_counter_reset_gives_no_rate_and_a_window_with_no_finished_request_no_percentile():
    eng = get_engine("vllm")
    s2 = eng.sample_from_text((DATA / "vllm" / "metrics-2.txt").read_text(), 1000.0, None)
    # the server restarted: its counters went down — no rate for that interval (never a negative or a 0)
    s1 = eng.sample_from_text((DATA / "vllm" / "metrics-1.txt").read_text(), 1010.0, s2)
    assert s1.decode_tok_s is None and s1.extra["ttft_p50_s"] is None
    # the same scrape again: nothing finished in between → percentiles missing, the rate a measured 0
    again = eng.sample_from_text((DATA / "vllm" / "metrics-1.txt").read_text(), 1020.0, s1)
    assert again.decode_tok_s == 0.0
    assert again.extra["ttft_count"] == 0 and again.extra["ttft_p50_s"] is None


def test_attach_only_engines_refuse_to_start(tmp_path):
    for name in ("vllm", "sglang", "openai_compat"):
        with pytest.raises(Exception, match="only attaches"):
            get_engine(name).build_launch(None, None, tmp_path)


# -- the loopback vLLM / SGLang / OpenAI servers -------------------------------------------------------------------
@pytest.mark.parametrize("flavour,kind", [("vllm", "vllm"), ("sglang", "sglang"), ("openai", "openai_compat")])
def test_fixture_server_detected_monitored_and_chatted_with(fixture_server, flavour, kind, caplog):
    caplog.set_level(logging.DEBUG)
    srv = fixture_server(flavour)
    C.add_connection("box", srv.base_url, srv.key)
    det = C.check_connection("box")
    assert det.ok and det.kind == kind, det.summary()
    assert MODEL in det.models
    if flavour == "openai":
        assert any("reports none" in m for m in det.missing)
    re = C.resolve_connection("box")
    assert re.engine == kind and re.started_by_panel is False and re.api_key == srv.key
    assert srv.key not in repr(re) and srv.key not in json.dumps(re.to_dict())

    src = EngineSource(get_engine(re.engine), spec_for(get_engine(re.engine), re.base_url, re.api_key))
    try:
        r1 = src.read()
        srv.advance()
        r2 = src.read()
    finally:
        src.close()
    s1, s2 = r1.payload, r2.payload
    if flavour == "openai":
        assert s2.decode_tok_s is None and s2.slots_busy is None and s2.extra.get("kv_cache_usage") is None
        assert r2.values["decode_tok_s"] is None
    else:
        eng = get_engine(kind)
        # the counters' increase over the time the two real scrapes were apart
        before = eng.sample_from_text((DATA / flavour / "metrics-1.txt").read_text(), 0, None)
        after = eng.sample_from_text((DATA / flavour / "metrics-2.txt").read_text(), 1, before)
        dt = s2.t - s1.t
        assert dt > 0
        assert s2.decode_tok_s == pytest.approx((after.tokens_generated_total - before.tokens_generated_total) / dt)
        assert s2.extra["ttft_p50_s"] == pytest.approx(after.extra["ttft_p50_s"])
        assert r2.values["slots_busy"] == s2.slots_busy and r2.values["queued"] == s2.queued
        assert r2.values["hit_rate"] is None                      # no expert offload figure: missing
    assert chat_text(re.base_url, re.api_key) == srv.answer
    assert srv.key not in caplog.text


def test_wrong_key_is_said_in_plain_words(fixture_server):
    srv = fixture_server("vllm")
    C.add_connection("box", srv.base_url, "not-the-key")
    det = C.check_connection("box")
    assert not det.ok and det.problem == "auth"
    assert "refused the API key" in det.message and "--replace" in det.message
    with pytest.raises(C.ConnectionSetupError, match="refused the API key"):
        C.resolve_connection("box")
    C.add_connection("nokey", srv.base_url)
    det = C.check_connection("nokey")
    assert det.problem == "auth" and "none is saved" in det.message


def test_nothing_listening_tls_mismatch_and_not_an_llm_server(free_port, tmp_path, fixture_server):
    det = C.detect(f"http://127.0.0.1:{free_port}", "k")
    assert det.problem == "refused" and "Nothing listens" in det.message and "port" in det.message
    srv = fixture_server("vllm")
    det = C.detect(srv.base_url.replace("http://", "https://"), srv.key)
    assert det.problem == "tls" and "plain HTTP" in det.message and "http://" in det.message
    # a web server that is not an engine: python's own file server over an empty folder
    proc = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "0"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        port = int(line.split(" port ")[1].split(" ")[0])
        det = C.detect(f"http://127.0.0.1:{port}", None)
        assert det.problem == "not_llm" and "not an LLM server" in det.message
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# -- the scripted engine, started by the test (foreign to the panel) -------------------------------------------
def engine_tick(re, limit: int = 40):
    """The first tick with the engine's figures of a hub reading the resolved connection ``re`` (stopped after)."""
    from engine_manager.engine_state import RunningEngine

    hub = build_hub(RunningEngine(re.base_url, re.api_key, engine=re.engine), record=False, use_nvml=False, hz=4)
    try:
        return first_engine_tick(hub, limit)
    finally:
        hub.stop()


def first_engine_tick(hub, limit: int = 40):
    for tick in hub.iter_ticks():
        if "engine" not in tick.missing and tick.values.get("slots_busy") is not None:
            return tick
        if tick.seq >= limit:
            raise AssertionError(f"no engine figures in {limit} ticks: {tick.missing}")
    raise AssertionError("the hub stopped")


def test_scripted_engine_attached_monitored_chatted_never_stopped(sim_process, caplog):
    caplog.set_level(logging.DEBUG)
    sim = sim_process().wait_ready()
    C.add_connection("sim", sim.base_url, sim.api_key)
    re = C.resolve_connection("sim")
    assert (re.engine, re.simulated, re.started_by_panel) == ("sim", True, False)
    tick = engine_tick(re)
    assert tick.simulated and tick.values["slots_total"] is not None
    assert chat_text(re.base_url, re.api_key).strip()
    assert sim.proc.poll() is None                       # attached, used, and left running: never stopped
    assert sim.api_key not in caplog.text


# -- a llama-server started by the test (attach_support.foreign_llama) ------------------------------------------
@pytest.mark.llamacpp
@pytest.mark.timeout(240)
def test_foreign_llama_server_detected_monitored_chatted(foreign_llama, caplog):
    caplog.set_level(logging.DEBUG)
    proc, spec = foreign_llama
    assert all(spec.api_key not in a for a in spec.argv)
    C.add_connection("llama", spec.base_url, spec.api_key)
    det = C.check_connection("llama")
    assert det.ok and det.kind == "llamacpp", det.summary()
    assert "llama.cpp metrics (llamacpp:*) on /metrics" in det.found
    re = C.resolve_connection("llama")
    assert re.started_by_panel is False and re.engine == "llamacpp"
    tick = engine_tick(re)
    assert tick.values["slots_total"] == 1 and not tick.simulated
    assert chat_text(re.base_url, re.api_key)
    assert proc.poll() is None                       # never stopped by the panel
    assert spec.api_key not in caplog.text


# -- the saved list and the keys -------------------------------------------------------------------------------------
def test_list_file_holds_no_key_and_the_key_file_is_owner_only():
    key = "secret-" + secrets.token_urlsafe(16)
    conn = C.add_connection("a", "http://127.0.0.1:9/", key)
    assert conn.key_store == "file"                      # no OS keyring on this box: the owner-only file
    assert conn.base_url == "http://127.0.0.1:9"
    assert key not in C.connections_file().read_text()
    assert key in C.keys_file().read_text()
    assert stat.S_IMODE(C.keys_file().stat().st_mode) == 0o600
    assert stat.S_IMODE(C.connections_file().stat().st_mode) == 0o600
    assert C.connection_key("a") == key
    with pytest.raises(C.ConnectionSetupError, match="exists already"):
        C.add_connection("a", "http://127.0.0.1:9", key)
    C.remove_connection("a")
    assert key not in C.keys_file().read_text() and C.load_connections() == []


def test_a_symlinked_key_file_is_refused(tmp_path):
    C.add_connection("a", "http://127.0.0.1:9", "k1")
    target = tmp_path / "elsewhere.json"
    target.write_text("{}")
    C.keys_file().unlink()
    C.keys_file().symlink_to(target)
    with pytest.raises(C.ConnectionSetupError, match="symbolic link"):
        C.connection_key("a")


@pytest.mark.parametrize("name,url,ssh,why", [
    ("bad name", "http://127.0.0.1:1", None, "cannot name"),
    ("ok", "ftp://127.0.0.1:1", None, "not an engine address"),
    ("ok", "http://user:pw@127.0.0.1:1", None, "no user name"),
    ("ok", "http://127.0.0.1:1", "-oProxyCommand=touch /tmp/x", "not an ssh host"),
    ("ok", "http://127.0.0.1:1", "box two", "not an ssh host"),
])
def test_bad_input_is_refused_in_plain_words(name, url, ssh, why):
    with pytest.raises(C.ConnectionSetupError, match=why):
        C.add_connection(name, url, None, ssh)


def test_a_usable_keyring_keeps_the_key():
    """With an OS keyring the key goes there, not into the file (a real ``keyring`` backend kept in memory)."""
    import keyring
    from keyring.backend import KeyringBackend

    class MemoryKeyring(KeyringBackend):
        priority = 1
        store: dict = {}

        def set_password(self, service, username, password):
            self.store[(service, username)] = password

        def get_password(self, service, username):
            return self.store.get((service, username))

        def delete_password(self, service, username):
            self.store.pop((service, username), None)

    before = keyring.get_keyring()
    keyring.set_keyring(MemoryKeyring())
    try:
        conn = C.add_connection("kr", "http://127.0.0.1:9", "kr-secret")
        assert conn.key_store == "keyring"
        assert not C.keys_file().exists() or "kr-secret" not in C.keys_file().read_text()
        assert C.connection_key("kr") == "kr-secret"
        assert MemoryKeyring.store[(C.KEYRING_SERVICE, "connection:kr")] == "kr-secret"
        C.remove_connection("kr")
        assert MemoryKeyring.store == {}
    finally:
        keyring.set_keyring(before)


def dsv41(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine_manager", *args], input=stdin, capture_output=True,
                          text=True, timeout=60, cwd=str(ROOT), env=dict(os.environ))


def test_cli_add_list_test_remove_never_shows_the_key(fixture_server):
    srv = fixture_server("sglang")
    r = dsv41("connections", "add", "sg", srv.base_url, "--api-key-stdin", "--json", stdin=srv.key + "\n")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["kind"] == "sglang"
    r2 = dsv41("connections", "list", "--json")
    listed = json.loads(r2.stdout)["connections"]
    assert [(c["name"], c["kind"], c["key_store"]) for c in listed] == [("sg", "sglang", "file")]
    r3 = dsv41("connections", "test", "sg")
    assert r3.returncode == 0 and "SGLang" in r3.stdout and "found:" in r3.stdout
    srv.stop()
    r4 = dsv41("connections", "test", "sg", "--json")
    assert r4.returncode == 1 and json.loads(r4.stdout)["problem"] == "refused"
    r5 = dsv41("connections", "remove", "sg")
    assert r5.returncode == 0
    r6 = dsv41("connections", "test", "sg")
    assert r6.returncode == 1 and "no saved connection named 'sg'" in r6.stderr
    for out in (r, r2, r3, r4, r5, r6):
        assert srv.key not in out.stdout and srv.key not in out.stderr


def test_overview_lists_every_connection_with_state_users_and_rate(fixture_server, sim_process, free_port):
    vl = fixture_server("vllm")
    sim = sim_process().wait_ready()
    C.add_connection("vl", vl.base_url, vl.key)
    C.add_connection("sim", sim.base_url, sim.api_key)
    C.add_connection("gone", f"http://127.0.0.1:{free_port}", "k")
    poller = C.OverviewPoller()
    first = {s.name: s for s in poller.poll()}
    assert list(first) == ["vl", "sim", "gone"]
    assert first["vl"].state == "ok" and first["vl"].users == 1 and first["vl"].decode_tok_s is None
    assert first["sim"].state == "ok" and first["sim"].simulated and first["sim"].users is not None
    # nothing answers: its own state, with the reason (and no figure)
    assert first["gone"].state == "unreachable" and "Nothing listens" in first["gone"].message
    assert first["gone"].users is None and first["gone"].decode_tok_s is None
    vl.advance()
    second = {s.name: s for s in poller.poll()}
    dt = second["vl"].t - first["vl"].t
    assert second["vl"].users == 5 and second["vl"].decode_tok_s == pytest.approx(2500 / dt)
    assert vl.key not in json.dumps([s.to_dict() for s in second.values()])


def test_an_untrusted_certificate_is_a_tls_problem_in_plain_words(tmp_path, fixture_server):
    """A real TLS server (python's ssl over the vLLM fixture server) with a self-signed certificate made by openssl:
    not trusted, said so, with what to do."""
    import shutil
    import ssl

    if shutil.which("openssl") is None:
        require_or_skip("openssl is not installed (apt install openssl)")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1"], check=True, capture_output=True, timeout=60)
    srv = fixture_server("vllm")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    srv.server.socket = ctx.wrap_socket(srv.server.socket, server_side=True)
    url = srv.base_url.replace("http://", "https://")
    det = C.detect(url, srv.key)
    assert det.problem == "tls" and "not trusted" in det.message and "--ssh" in det.message
    # the same server, its certificate trusted: detected
    trusted = ssl.create_default_context(cafile=str(cert))
    trusted.check_hostname = False
    det = C.detect(url, srv.key, verify=trusted)
    assert det.ok and det.kind == "vllm", det.summary()


def test_strata_stand_in_detected_monitored_chatted(tmp_path, free_port, caplog):
    """Strata's server (the stand-in release, its mock engine), started by the test with the key in
    STRATA_API_KEY: detected by ``/api/health`` ``service: strata``, monitored, chatted with, never stopped."""
    from strata_support import make_strata_release, release_python, stop, wait_port

    caplog.set_level(logging.DEBUG)
    release = make_strata_release(tmp_path / "strata-release")
    key = "strata-" + secrets.token_urlsafe(16)
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
    env["STRATA_API_KEY"] = key
    proc = subprocess.Popen([str(release_python(release)), str(release / "serve" / "server.py"), "--host", "127.0.0.1",
                             "--port",
                             str(free_port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL)
    try:
        wait_port(free_port, proc)
        C.add_connection("strata", f"http://127.0.0.1:{free_port}", key)
        re = C.resolve_connection("strata")
        assert (re.engine, re.simulated, re.started_by_panel) == ("strata", False, False)
        tick = engine_tick(re)
        assert not tick.simulated and tick.values["slots_total"] is not None
        assert "Hello from the mock engine." in chat_text(re.base_url, re.api_key)
        assert proc.poll() is None
        assert key not in caplog.text
    finally:
        stop(proc)


def test_cli_monitor_and_chat_reach_a_saved_connection_by_name(sim_process):
    """`dsv41 monitor --connection NAME` and `dsv41 chat --connection NAME`: the engine is
    reached through the saved URL and key (never given on the command line), answers, and is left running."""
    sim = sim_process().wait_ready()
    r = dsv41("connections", "add", "box2", sim.base_url, "--api-key-stdin", stdin=sim.api_key + "\n")
    assert r.returncode == 0, r.stderr
    mon = dsv41("monitor", "--connection", "box2", "--once", "--json")
    assert mon.returncode == 0, mon.stderr
    tick = json.loads(mon.stdout.strip().splitlines()[-1])
    assert tick["simulated"] is True and tick["values"]["slots_total"] is not None
    chat = dsv41("chat", "--connection", "box2", "--max-tokens", "8", "--json", "Say hi.")
    assert chat.returncode == 0, chat.stderr
    answer = json.loads(chat.stdout)
    msg = answer["message"]      # 8 tokens may all go to the model's reasoning
    assert answer["status"] == "complete" and (msg["content"] + (msg.get("reasoning") or "")).strip()
    missing = dsv41("chat", "--connection", "nope", "hi")
    assert missing.returncode == 1 and "no saved connection named 'nope'" in missing.stderr
    both = dsv41("monitor", "--connection", "box2", "--url", sim.base_url, "--once")
    assert both.returncode == 2
    for out in (r, mon, chat, missing, both):
        assert sim.api_key not in out.stdout + out.stderr
    assert sim.proc.poll() is None
    dsv41("connections", "remove", "box2")


def test_an_engine_on_another_machine_gets_no_figures_from_this_one(sim_process):
    """An engine reached through SSH or a remote URL runs on another box: this machine's RAM/CPU/GPU say nothing
    about it, so those figures are missing (no source), never this box's."""
    from engine_manager.engine_state import RunningEngine
    sim = sim_process().wait_ready()
    here = RunningEngine(sim.base_url, sim.api_key, engine="sim", started_by_panel=False)
    away = here.with_(on_this_machine=False)
    ticks = {}
    for name, running in (("here", here), ("away", away)):
        hub = build_hub(running, record=False, use_nvml=False, hz=4)
        try:
            ticks[name] = first_engine_tick(hub)
        finally:
            hub.stop()
    assert ticks["here"].values["ram_used_bytes"] is not None
    assert ticks["away"].values["ram_used_bytes"] is None and ticks["away"].values["cpu_total_pct"] is None
    assert ticks["away"].values["slots_total"] is not None           # the engine's own figures still arrive
    assert "host" not in ticks["away"].missing          # no source at all, so nothing to call missing
    for t in ticks.values():                             # an attached engine has no log of ours: not "missing"
        assert "log" not in t.missing and t.values["swaps_per_s"] is None
    C.add_connection("far", "http://10.255.255.1:8080", None)
    C.add_connection("near", sim.base_url, sim.api_key)
    assert C.resolve_connection("near").on_this_machine is True
    with pytest.raises(C.ConnectionSetupError):
        C.resolve_connection("far")          # nothing answers there (a non-routable address): refused in words
