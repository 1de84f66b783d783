"""Saved connections against hostile input: servers that answer endlessly, drip, lie about their length,
nest JSON 100,000 deep, echo the key, put terminal escapes in model ids or impossible numbers in their metrics
(:mod:`hostile_servers`); connection and key files of every wrong shape (seeded corpora below); concurrent adds;
a key "file" that is a named pipe. Every case ends within its deadline, in plain words, with no traceback, and no
key outside its owner-only file and the ``Authorization`` header to the saved URL.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from hostile_servers import BAD_METRICS, ESCAPES, HostileServer

from engine_manager import connections as C
from engine_manager.engines import get_engine, prometheus_text
from engine_manager.engines._http import AnswerTooLarge, AnswerTooSlow, get_capped

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-hostile-0123456789abcdef"

pytestmark = pytest.mark.timeout(120)


def dsv41(*args: str, stdin: str | None = None, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine_manager", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, cwd=str(ROOT), env=dict(os.environ))


@pytest.fixture
def hostile():
    started: list[HostileServer] = []

    def start(routes: dict[str, str] | None = None, default: str = "openai") -> HostileServer:
        s = HostileServer(routes, default)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


# -- the capped read -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("behaviour,error", [("endless", AnswerTooLarge), ("huge_length", AnswerTooLarge),
                                             ("drip", AnswerTooSlow), ("stall", AnswerTooSlow)])
def test_a_capped_read_ends_in_words(hostile, behaviour, error):
    srv = hostile({"/x": behaviour})
    with httpx.Client(trust_env=False, timeout=30) as client:      # a per-read timeout far past the deadline
        with pytest.raises(error) as ei:
            get_capped(client, srv.base_url + "/x", deadline_s=1.5)
    assert srv.base_url + "/x" in str(ei.value)
    assert ("larger than 1 MB" if error is AnswerTooLarge else "did not arrive within 1.5 s") in str(ei.value)


# -- detection -------------------------------------------------------------------------------------------------------
def test_an_endless_health_answer_costs_that_answer_only(hostile):
    srv = hostile({"/api/health": "endless", "/metrics": "endless"})
    det = C.detect(srv.base_url, KEY)
    assert det.ok and det.kind == "openai_compat", det.summary()
    assert any(m.startswith("/api/health: ") and "larger than 1 MB" in m for m in det.missing)
    assert any(m.startswith("/metrics: ") and "larger than 16 MB" in m for m in det.missing)


def test_a_model_list_of_10_mb_is_refused_in_words(hostile):
    srv = hostile({"/v1/models": "huge_models"})
    det = C.detect(srv.base_url, KEY)
    assert not det.ok and det.problem == "not_llm"
    assert "/v1/models too large" in det.message
    assert any("larger than 1 MB" in m for m in det.missing)


def test_a_long_model_list_is_summarised(hostile):
    srv = hostile({"/v1/models": "many_models"})
    C.add_connection("many", srv.base_url, KEY)
    det = C.check_connection("many")
    assert det.ok and det.models_total == 20_000 and len(det.models) == C.MODELS_KEPT
    assert any(f.endswith("m19 and 19,980 more") for f in det.found)
    r = dsv41("connections", "test", "many")
    assert r.returncode == 0 and "and 19,980 more" in r.stdout
    assert len(r.stdout) < 4000


@pytest.mark.parametrize("where", ["/api/health", "/v1/models", "/metrics"])
def test_a_dripping_server_ends_detection_at_its_deadline(hostile, where):
    srv = hostile({where: "drip"})
    det = C.detect(srv.base_url, KEY, deadline_s=2)
    assert not det.ok and det.problem == "slow" and C.state_of(det) == "unreachable"
    assert "too slow" in det.message and "within 2 s" in det.message


@pytest.mark.parametrize("routes", [
    {"/api/health": "deep_json", "/v1/models": "deep_json", "/props": "deep_json"},
    {"/api/health": "garbage_json", "/v1/models": "garbage_json", "/props": "garbage_json"},
])
def test_json_that_is_not_or_nests_too_deep_is_not_an_engine(hostile, routes):
    srv = hostile(routes, default="not_found")
    det = C.detect(srv.base_url, KEY)
    assert not det.ok and det.problem == "not_llm" and "not an LLM server" in det.message


def test_a_key_the_server_echoes_is_masked_everywhere(hostile):
    srv = hostile({"/v1/models": "echo_key_models"})
    r = dsv41("connections", "add", "echo", srv.base_url, "--api-key-stdin", stdin=KEY + "\n")
    assert r.returncode == 0, r.stderr
    assert srv.sent_to(KEY)                                   # the server got it (in the header, as it must)
    assert "echo Bearer sk-h…(masked)" in r.stdout
    for args in (("connections", "test", "echo"), ("connections", "test", "echo", "--json"),
                 ("connections", "list"), ("connections", "list", "--json")):
        out = dsv41(*args)
        assert KEY not in out.stdout + out.stderr, args
    assert KEY not in C.connections_file().read_text()


def test_terminal_escapes_in_model_ids_never_reach_the_terminal(hostile):
    srv = hostile({"/v1/models": "escape_models"})
    r = dsv41("connections", "add", "esc", srv.base_url, "--no-key")
    assert r.returncode == 0, r.stderr
    r2 = dsv41("connections", "test", "esc")
    for out in (r.stdout, r2.stdout):
        assert not any(c in out for c in "\x1b\x07\x9b\r"), out
        assert "\\x1b]0;pwned\\x07title" in out                # shown, escaped
        assert out.count("\n") < 12                             # no fake line
    js = json.loads(dsv41("connections", "test", "esc", "--json").stdout)
    assert js["models"] == ESCAPES                              # JSON keeps them exactly, escaped by JSON itself


# -- impossible figures ----------------------------------------------------------------------------------------------
def test_negative_and_non_finite_metrics_are_missing():
    eng = get_engine("vllm")
    s1 = eng.sample_from_text(BAD_METRICS.decode(), 1000.0, None)
    s2 = eng.sample_from_text(BAD_METRICS.decode(), 1010.0, s1)
    for s in (s1, s2):
        assert s.slots_busy is None                  # -7 requests running: impossible, so missing
        assert s.queued is None                      # NaN
        assert s.extra["kv_cache_usage"] is None     # +Inf
        assert s.tokens_generated_total is None      # 1e308 + 1e308 overflows: missing, not inf
        assert s.requests_total == 12                # the one sane figure survives
    assert s2.decode_tok_s is None and s2.prefill_tok_s is None
    summed = prometheus_text.summed(BAD_METRICS.decode())
    assert "vllm:generation_tokens_total" not in summed and summed["vllm:request_success_total"] == 12
    assert all(v == v and abs(v) != float("inf") for v in summed.values())


def test_an_attached_server_with_impossible_metrics_is_polled_without_figures(hostile):
    srv = hostile({"/metrics": "bad_metrics"})
    C.add_connection("bad", srv.base_url, KEY)
    poller = C.OverviewPoller()
    first = poller.poll_one(C.get_connection("bad"))
    second = poller.poll_one(C.get_connection("bad"))
    assert first.kind == "vllm" and first.state == second.state == "ok", second.message
    assert second.users is None and second.queued is None and second.decode_tok_s is None


# -- the overview: unreachable is its own state ---------------------------------------------------------------------
def test_a_stalled_connection_is_unreachable_within_the_overview_deadline(hostile):
    srv = hostile({"/api/health": "stall"})
    C.add_connection("stalled", srv.base_url, KEY)
    line = C.OverviewPoller(timeout_s=1.5).poll_one(C.get_connection("stalled"))
    assert line.state == "unreachable" and "too slow" in line.message
    assert line.users is None and line.decode_tok_s is None


def test_an_engine_that_stops_answering_is_unreachable_with_when_it_was_last_seen(fixture_server):
    srv = fixture_server("vllm")
    C.add_connection("vl", srv.base_url, srv.key)
    poller = C.OverviewPoller()
    ok = poller.poll_one(C.get_connection("vl"))
    assert ok.state == "ok" and ok.users == 1 and ok.last_seen == ok.t
    srv.stop()
    gone = poller.poll_one(C.get_connection("vl"))
    assert gone.state == "unreachable" and "connection refused" in gone.message
    assert gone.last_seen == ok.t
    assert (gone.users, gone.queued, gone.decode_tok_s) == (None, None, None)   # nothing carried over
    # the one record of the last test, shared with the CLI
    lt = C.get_connection("vl").last_test
    assert lt.state == "unreachable" and lt.last_ok == ok.t and "connection refused" in lt.message
    r = dsv41("connections", "list")
    assert "unreachable" in r.stdout and "last seen" in r.stdout and "connection refused" in r.stdout
    assert srv.key not in r.stdout


# -- connections add: saved-but-unreachable, or refused -------------------------------------------------------------
def test_add_saves_an_unreachable_engine_and_says_so(free_port):
    r = dsv41("connections", "add", "later", f"http://127.0.0.1:{free_port}", "--no-key")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Saved later" in r.stdout and "cannot be reached now" in r.stdout
    assert [c.name for c in C.load_connections()] == ["later"]
    assert C.get_connection("later").last_test.state == "unreachable"


def test_add_refuses_a_server_that_refuses_the_key_and_saves_nothing(fixture_server):
    srv = fixture_server("vllm")
    r = dsv41("connections", "add", "wrong", srv.base_url, "--api-key-stdin", stdin="not-the-key\n")
    assert r.returncode == 1 and "refused the API key" in r.stdout and "Nothing was saved" in r.stdout
    assert C.load_connections() == []
    assert not C.keys_file().exists() or "not-the-key" not in C.keys_file().read_text()


def test_list_shows_the_test_the_window_ran(fixture_server):
    """What the window does when a connection is chosen (resolve) is the same one record the CLI lists."""
    srv = fixture_server("sglang")
    C.add_connection("sg", srv.base_url, srv.key)
    assert "not tested yet" in dsv41("connections", "list").stdout
    C.resolve_connection("sg")
    r = dsv41("connections", "list")
    assert "last test: ok: SGLang (tested " in r.stdout, r.stdout
    listed = json.loads(dsv41("connections", "list", "--json").stdout)["connections"][0]
    assert listed["last_test"]["state"] == "ok" and listed["last_test"]["kind"] == "sglang"


# -- inputs ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("url", ["http://127.0.0.1:0", "http://127.0.0.1:-1", "http://127.0.0.1:65536",
                                 "http://127.0.0.1:99999", "https://box:0/v1"])
@pytest.mark.parametrize("ssh", [None, "gpu-box"])
def test_a_port_outside_1_to_65535_is_refused(url, ssh):
    with pytest.raises(C.ConnectionSetupError, match="port|not an engine address"):
        C.add_connection("p", url, None, ssh)
    assert C.load_connections() == []


def test_a_key_file_that_is_a_named_pipe_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "key.fifo"
    os.mkfifo(fifo)
    r = dsv41("connections", "add", "p", "http://127.0.0.1:9", "--api-key-file", str(fifo), "--no-test",
              timeout=60)
    assert r.returncode == 1 and "not a regular file" in r.stderr and "Traceback" not in r.stderr
    assert C.load_connections() == []


# -- the files: seeded corpora of wrong shapes -----------------------------------------------------------------------
def _rec(**kw) -> dict:
    return {"name": "a", "base_url": "http://127.0.0.1:8000", **kw}


BAD_LISTS: list[tuple[str, bytes]] = [
    ("connections-null", b'{"schema": 1, "connections": null}'),
    ("connections-object", b'{"schema": 1, "connections": {"a": 1}}'),
    ("record-null", b'{"schema": 1, "connections": [null]}'),
    ("name-int", json.dumps({"schema": 1, "connections": [_rec(name=1)]}).encode()),
    ("name-newline", json.dumps({"schema": 1, "connections": [_rec(name="a\n")]}).encode()),
    ("no-url", json.dumps({"schema": 1, "connections": [{"name": "a"}]}).encode()),
    ("url-ftp", json.dumps({"schema": 1, "connections": [_rec(base_url="ftp://x")]}).encode()),
    ("url-port-0", json.dumps({"schema": 1, "connections": [_rec(base_url="http://x:0")]}).encode()),
    ("date-string", json.dumps({"schema": 1, "connections": [_rec(added_at="yesterday")]}).encode()),
    ("date-inf", b'{"schema": 1, "connections": [{"name": "a", "base_url": "http://x:1", "added_at": 1e999}]}'),
    ("date-negative", json.dumps({"schema": 1, "connections": [_rec(added_at=-5)]}).encode()),
    ("ssh-option", json.dumps({"schema": 1, "connections": [_rec(ssh_host="-oProxyCommand=x")]}).encode()),
    ("ssh-shell", json.dumps({"schema": 1, "connections": [_rec(ssh_host="box;id")]}).encode()),
    ("store-unknown", json.dumps({"schema": 1, "connections": [_rec(key_store="vault")]}).encode()),
    ("kind-unknown", json.dumps({"schema": 1, "connections": [_rec(kind="evil")]}).encode()),
    ("last-test-bad", json.dumps({"schema": 1, "connections": [_rec(last_test={"t": "x"})]}).encode()),
    ("duplicate", json.dumps({"schema": 1, "connections": [_rec(), _rec()]}).encode()),
    ("schema-string", json.dumps({"schema": "1", "connections": []}).encode()),
    ("top-list", b"[]"),
    ("top-string", b'"connections"'),
    ("not-json", b"{connections: [}"),
    ("not-utf8", b"\xff\xfe{}"),
    ("deep", b"[" * 100_000 + b"]" * 100_000),
    ("deep-inside", b'{"schema": 1, "connections": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ("too-large", b'{"schema": 1, "connections": []' + b" " * (C.FILE_CAP + 1) + b"}"),
]


@pytest.mark.parametrize("name,raw", BAD_LISTS, ids=[n for n, _ in BAD_LISTS])
def test_a_list_file_of_the_wrong_shape_is_set_aside_never_half_used(name, raw):
    path = C.connections_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(raw)
    with pytest.raises(C.ConnectionSetupError, match="kept as") as ei:
        C.load_connections()
    aside = [p for p in path.parent.iterdir() if p.name.startswith(C.CONNECTIONS_FILE + ".invalid-")]
    assert len(aside) == 1 and aside[0].read_bytes() == raw and str(aside[0]) in str(ei.value)
    assert C.load_connections() == []                           # a new list; the old one kept aside
    C.add_connection("fresh", "http://127.0.0.1:8000")          # and usable at once
    assert [c.name for c in C.load_connections()] == ["fresh"]


@pytest.mark.parametrize("name,raw", [BAD_LISTS[0], BAD_LISTS[-3]], ids=["null", "deep"])
def test_the_cli_lists_after_a_bad_file_with_a_note_and_no_traceback(name, raw):
    path = C.connections_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(raw)
    r = dsv41("connections", "list")
    assert r.returncode == 0 and "kept as" in r.stderr and "No saved connections" in r.stdout
    assert "Traceback" not in r.stderr
    assert dsv41("connections", "list").stderr == ""            # said once: the file was set aside


def test_a_list_file_that_is_a_named_pipe_does_not_block():
    path = C.connections_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    with pytest.raises(C.ConnectionSetupError, match="not a regular file"):
        C.load_connections()
    assert C.load_connections() == []


@pytest.mark.parametrize("raw", [b'{"a": 1}', b"[]", b"null", b'{"a": "k\\u0000"}', b"[" * 100_000, b"{"])
def test_a_key_file_of_the_wrong_shape_is_set_aside(raw):
    C.add_connection("a", "http://127.0.0.1:9", "k1")
    C.keys_file().write_bytes(raw)
    with pytest.raises(C.ConnectionSetupError, match="kept as"):
        C.connection_key("a")
    # the key is gone from use (never half-used): said in words, with what to do
    with pytest.raises(C.ConnectionSetupError, match="no longer in"):
        C.connection_key("a")


# -- concurrent adds -------------------------------------------------------------------------------------------------
ADDER = """
import os, sys, time
from pathlib import Path
from engine_manager import connections as C
go = Path(sys.argv[1])
while not go.exists():
    time.sleep(0.005)
for j in range(4):
    C.add_connection(f"c{sys.argv[2]}-{j}", "http://127.0.0.1:9", f"key-{sys.argv[2]}-{j}")
"""


def test_concurrent_adds_keep_every_connection_and_its_key(tmp_path):
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", ADDER, str(go), str(i)], cwd=str(ROOT), env=dict(os.environ),
                              stderr=subprocess.PIPE, text=True) for i in range(8)]
    threading.Timer(3.0, go.touch).start()       # every adder imported and waiting: they start together
    for p in procs:
        _out, err = p.communicate(timeout=90)
        assert p.returncode == 0, err
    conns = C.load_connections()
    names = sorted(c.name for c in conns)
    assert names == sorted(f"c{i}-{j}" for i in range(8) for j in range(4))
    for c in conns:
        i, j = c.name[1:].split("-")
        assert C.connection_key(c) == f"key-{i}-{j}"


# -- every JSON file the panel reads: 100,000 nested brackets are a bad file, never a crash ---------------------------
DEEP = "[" * 100_000 + "]" * 100_000


def test_the_ui_state_is_read_capped_and_never_through_a_link(tmp_path):
    """The window's small state file: one larger than its cap, or a link to another file, is not read — the window
    starts from its defaults, and the link's target is left as it was."""
    from engine_manager import paths, uistate

    paths.config_dir().mkdir(parents=True, exist_ok=True)
    f = uistate.state_file()
    f.write_text('{"main_tab": "Log", "pad": "' + "x" * uistate.MAX_BYTES + '"}')
    assert uistate.load() == {}
    assert not f.exists()                                   # set aside: the next save starts a new one
    other = tmp_path / "elsewhere.json"
    other.write_text('{"main_tab": "Log"}')
    f.symlink_to(other)
    assert uistate.load() == {}
    assert other.read_text() == '{"main_tab": "Log"}'
    f.unlink(missing_ok=True)
    f.write_text('{"main_tab": "Log"}')
    assert uistate.load() == {"main_tab": "Log"}


@pytest.mark.parametrize("kept, sane", [
    ({"banner": 84, "watching": 146}, {"banner": 84, "watching": 146}),
    ({"banner": 10**9, "watching": 0}, {}), ({"banner": True}, {}), ({"banner": -5}, {}), ({"banner": "84"}, {}),
    ({"banner": 84.5, "other": 30}, {}), ([84], {}), ("84", {}),
])
def test_kept_column_heights_from_the_ui_state_are_only_sane_ones(kept, sane):
    """The heights the window keeps for its next start come from a file: only a known part with a whole number of
    pixels in bounds is used; huge, zero, negative, true/false, text, fractions, unknown parts and other shapes
    are left out."""
    from engine_manager import uistate

    assert uistate.column_heights({"column_heights": kept}) == sane
    assert uistate.column_heights({}) == {}


def test_deep_nesting_in_any_file_the_panel_reads_is_a_bad_file(tmp_path):
    from engine_manager import paths, settings, uistate
    from engine_manager.atomic import read_json_capped
    from engine_manager.engine_record import EngineRecord
    from engine_manager.engine_state import read_plan_file

    paths.config_dir().mkdir(parents=True, exist_ok=True)
    uistate.state_file().write_text(DEEP)
    assert uistate.load() == {}
    paths.settings_file().write_text(DEEP)
    loaded = settings.load_settings()
    assert any("could not be read" in n for n in loaded.notices)
    with pytest.raises(ValueError, match="too deeply"):
        EngineRecord.from_json(DEEP.encode())
    plan = tmp_path / "plan.json"
    plan.write_text(DEEP)
    assert read_plan_file(plan) is None
    with pytest.raises(ValueError, match="too deeply"):
        read_json_capped(plan, 10**6)
