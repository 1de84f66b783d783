"""A soak of the panel side against hostile servers and files, on loopback only.

For each round (``--rounds``, bounded by ``--max-seconds`` too), every behaviour of ``tests/hostile_servers.py``
is served on every path of a loopback server and put through what the panel does with a server:

- ``detect``: the connection detection (:func:`engine_manager.connections.detect`), in this process;
- ``connections test``: ``dsv41 connections test NAME`` of a saved connection to it (a child process);
- ``readiness``: the Strata, llama.cpp and scripted-engine adapters' readiness probe;
- ``monitor``: one poll cycle through the hub (:class:`engine_manager.metrics.hub.MetricsHub`) with each adapter
  (strata, sim, llamacpp, vllm, openai_compat), then the source's read must end within its deadline;
- ``overview``: one line of the Watching overview (:meth:`OverviewPoller.poll_one`) for the saved connection;
- ``chat``: ``dsv41 chat --connection NAME --timeout 5 --max-tokens 5`` (a child process);

and each round loads a seeded corpus of damaged plan files (:func:`engine_manager.plans.read_plan_file`) and bench
result files (:func:`engine_manager.bench.results.load`, then what the CLI does with one).

Counted: tracebacks (an exception out of a call that must not raise; ``Traceback`` in a child's output), hangs
past a call's deadline, the peak RSS of this process and of each child (psutil, sampled every 0.05 s), and any
key seen where it must not be: in a request header other than ``Authorization`` or in a request path (the hostile
servers record what they receive), in a child's output, or in any file of the panel's folders other than the
owner-only (0600) key file. Config, data and cache folders are temporary; the OS keyring is not touched.

    .venv/bin/python benchmarks/hostile_soak.py --rounds 3 --max-seconds 600 \
        --out benchmarks/results/hostile_soak.md
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-soak-" + "5f3a9c1e7b2d4068"
MB = 1024 * 1024


def _isolate() -> Path:
    """Temporary config/data/cache folders, no DSV41_* from the caller, no OS keyring (set before any import)."""
    given = os.environ.get("HOSTILE_SOAK_BASE")       # the servers' process shares the panel side's folders
    base = Path(given) if given else Path(tempfile.mkdtemp(prefix="dsv41-soak-"))
    os.environ["HOSTILE_SOAK_BASE"] = str(base)
    for k in [k for k in os.environ if k.startswith("DSV41_")]:
        del os.environ[k]
    os.environ.update(DSV41_CONFIG_DIR=str(base / "config"), DSV41_DATA_DIR=str(base / "data"),
                      DSV41_CACHE_DIR=str(base / "cache"), HF_HOME=str(base / "hf"),
                      PYTHON_KEYRING_BACKEND="keyring.backends.fail.Keyring", NO_COLOR="1")
    return base


BASE = _isolate()
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import psutil  # noqa: E402
from hostile_servers import BEHAVIOURS, HostileServer  # noqa: E402

from engine_manager import connections as C  # noqa: E402
from engine_manager.engines import get_engine  # noqa: E402
from engine_manager.engines._http import PROBE_TIMEOUT_S  # noqa: E402
from engine_manager.metrics.hub import MetricsHub  # noqa: E402
from engine_manager.metrics.sources import EngineSource, spec_for  # noqa: E402

MONITOR_ENGINES = ("strata", "sim", "llamacpp", "vllm", "openai_compat")
READY_ENGINES = ("strata", "sim", "llamacpp")
SOURCE_TIMEOUT_S = 2.0
SLACK_S = 5.0                    # a loaded 2-core box: what a call may take past its own deadline


class Peak:
    """Samples the RSS of this process and of the children it is told about, every 0.05 s."""

    def __init__(self) -> None:
        self.me = psutil.Process()
        self.baseline = self.me.memory_info().rss          # after the imports, before any server is read
        self.self_peak = 0
        self.child_peak = 0
        self.children: list[psutil.Process] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._run, daemon=True).start()

    def watch(self, pid: int) -> None:
        try:
            with self._lock:
                self.children.append(psutil.Process(pid))
        except psutil.Error:
            pass

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.self_peak = max(self.self_peak, self.me.memory_info().rss)
            with self._lock:
                kids = list(self.children)
            for p in kids:
                try:
                    self.child_peak = max(self.child_peak, p.memory_info().rss)
                except psutil.Error:
                    with self._lock:
                        if p in self.children:
                            self.children.remove(p)

    def stop(self) -> None:
        self._stop.set()


class Counts:
    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.tracebacks: list[str] = []
        self.hangs: list[str] = []
        self.leaks: list[str] = []
        self.slowest: dict[str, tuple[float, str]] = {}

    def timed(self, op: str, what: str, deadline_s: float, fn, *a, **kw):
        """Run ``fn``; an exception is a traceback, a run past ``deadline_s`` (plus slack) a hang."""
        self.calls[op] = self.calls.get(op, 0) + 1
        t0 = time.monotonic()
        try:
            return fn(*a, **kw)
        except Exception:  # noqa: BLE001 - the point: count what escapes
            self.tracebacks.append(f"{op} {what}: {traceback.format_exc(limit=3).strip().splitlines()[-1]}")
            print(traceback.format_exc(), file=sys.stderr, flush=True)
            return None
        finally:
            took = time.monotonic() - t0
            if took > self.slowest.get(op, (0.0, ""))[0]:
                self.slowest[op] = (took, what)
            if took > deadline_s + SLACK_S:
                self.hangs.append(f"{op} {what}: {took:.1f} s (deadline {deadline_s:g} s)")


def child(peak: Peak, counts: Counts, op: str, what: str, args: list[str], deadline_s: float) -> str:
    """``dsv41 ARGS`` in a child process; its output checked for tracebacks and the key."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    counts.calls[op] = counts.calls.get(op, 0) + 1
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "engine_manager", *args], cwd=ROOT, env=env,
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    peak.watch(p.pid)
    try:
        out, err = p.communicate(timeout=deadline_s + 60)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    took = time.monotonic() - t0
    if took > self_slowest(counts, op):
        counts.slowest[op] = (took, what)
    if took > deadline_s + SLACK_S:
        counts.hangs.append(f"{op} {what}: {took:.1f} s (deadline {deadline_s:g} s)")
    text = out.decode(errors="replace") + err.decode(errors="replace")
    if "Traceback (most recent call last)" in text:
        counts.tracebacks.append(f"{op} {what}: " + text.strip().splitlines()[-1][:200])
    if KEY in text:
        counts.leaks.append(f"{op} {what}: the key in the program's output")
    return text


def self_slowest(counts: Counts, op: str) -> float:
    return counts.slowest.get(op, (0.0, ""))[0]


# -- what the panel does with a server -----------------------------------------------------------------------------
def monitor_cycle(engine: str, url: str) -> str:
    """One tick through the hub, then the source's read must end (its deadline) before the hub closes."""
    eng = get_engine(engine)
    src = EngineSource(eng, spec_for(eng, url, KEY), timeout_s=SOURCE_TIMEOUT_S)
    hub = MetricsHub([src], hz=1.0, engine=engine)
    try:
        tick = hub.tick_once()
        end = time.monotonic() + 2 * SOURCE_TIMEOUT_S + SLACK_S
        runners = hub._runners or []
        while any(r.busy for r in runners) and time.monotonic() < end:
            time.sleep(0.05)
        if any(r.busy for r in runners):
            raise TimeoutError(f"the {engine} source's read outlived its deadline")
        return tick.missing.get("engine", "ok")
    finally:
        hub.close()


def readiness(engine: str, url: str) -> str:
    import httpx

    eng = get_engine(engine)
    with httpx.Client(trust_env=False, timeout=30) as client:     # a per-read timeout far past the probe's deadline
        return eng.readiness(client, spec_for(eng, url, KEY)).state


def serve(out: Path) -> None:
    """The servers' side, in a process of its own (so the panel side's memory is its own): one server a behaviour,
    their URLs as one JSON line; at a line on stdin (or its end), what each received is written to ``out``."""
    servers = {b: HostileServer(default=b) for b in sorted(BEHAVIOURS)}
    print(json.dumps({b: s.base_url for b, s in servers.items()}), flush=True)
    try:        # the planner's own plan, the seed of the damaged plan files (made here: the planner is no panel part)
        print(json.dumps(good_plan()), flush=True)
    except Exception:  # noqa: BLE001 - no plan: the plan files are left out, said in the counts
        traceback.print_exc()
        print("null", flush=True)
    sys.stdin.readline()
    got = {b: [[m, p, h] for m, p, h in s.requests] for b, s in servers.items()}
    out.write_text(json.dumps(got))
    for s in servers.values():
        s.stop()


def server_round(name: str, behaviour: str, url: str, counts: Counts, peak: Peak, poller: C.OverviewPoller,
                 cli: bool, startup_s: float) -> None:
    counts.timed("detect", behaviour, C.DETECT_DEADLINE_S, C.detect, url, KEY)
    C.add_connection(name, url, KEY, replace=True)
    for eng in READY_ENGINES:
        counts.timed("readiness", f"{behaviour}/{eng}", PROBE_TIMEOUT_S, readiness, eng, url)
    for eng in MONITOR_ENGINES:
        counts.timed("monitor", f"{behaviour}/{eng}", 2 * SOURCE_TIMEOUT_S, monitor_cycle, eng, url)
    conn = C.get_connection(name)
    counts.timed("overview", behaviour, C.DETECT_DEADLINE_S + poller.timeout_s, poller.poll_one, conn)
    if cli:
        child(peak, counts, "connections test", behaviour, ["connections", "test", name],
              startup_s + C.DETECT_DEADLINE_S)
        child(peak, counts, "chat", behaviour,      # detection, then the chat's own 5-s pace and its first token
              ["chat", "--connection", name, "--timeout", "5", "--max-tokens", "5", "hello"],
              startup_s + C.DETECT_DEADLINE_S + 30)


def check_requests(received: dict[str, list], counts: Counts) -> int:
    """The key only ever in the ``Authorization`` header (every server is at the saved URL); the requests seen."""
    n = 0
    for behaviour, reqs in received.items():
        for method, path, headers in reqs:
            n += 1
            if KEY in path:
                counts.leaks.append(f"{behaviour}: the key in the path of {method} {path[:60]}")
            for k, v in headers.items():
                if KEY in v and k.lower() != "authorization":
                    counts.leaks.append(f"{behaviour}: the key in request header {k}")
    return n


# -- files ---------------------------------------------------------------------------------------------------------
HOSTILE_VALUES = [None, "x", "", -7, 0, 10**12, 10**400, 1.5, float("inf"), float("nan"), True, [], {}, [[0, "x"]],
                  [None], {"a": 1}, "../../etc/passwd", ["--dump-routing", "x"], "\x1b]0;title\x07", [[["deep"]]]]


def _paths(d, prefix=()):
    if isinstance(d, dict):
        for k, v in d.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))
    elif isinstance(d, list) and d:
        yield prefix + (0,)
        yield from _paths(d[0], prefix + (0,))


def _mutants(good: dict, n: int, seed: int, skip: tuple[str, ...] = ()):
    paths = [p for p in _paths(good) if p[0] not in skip]
    rng = random.Random(seed)
    for _ in range(n):
        doc = copy.deepcopy(good)
        path = rng.choice(paths)
        target = doc
        for k in path[:-1]:
            target = target[k]
        target[path[-1]] = copy.deepcopy(rng.choice(HOSTILE_VALUES))
        yield doc


def good_plan() -> dict:
    from engine_manager import plans as P
    from engine_manager.settings import load_settings

    req = P.PlanRequest(host="reference", save=False)
    d = P.make_plan(load_settings().settings, req).plan.to_dict()
    d["usage"]["counts"] = (d["usage"]["counts"] or [[1.0]])[:2]
    d["hot_set"] = d["hot_set"][:50]
    strp = P.plans_dir() / "last-plan.strp"
    strp.parent.mkdir(parents=True, exist_ok=True)
    strp.write_bytes(b"STRP")
    d["strp_path"] = str(strp)
    d["strata_args"] = ["--expert-cache", str(d["hot_experts"]), "--vram-reserve-mib", "700", "--expert-profile",
                        str(strp)]
    return d


def plan_files(good: dict, n: int, seed: int, folder: Path) -> dict[str, int]:
    from engine_manager import plans as P

    out = {"read": 0, "refused": 0}
    folder.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(_mutants(good, n, seed, skip=("coverage",))):
        f = folder / f"plan-{i}.json"
        f.write_text(json.dumps(doc))
        try:
            P.read_plan_file(f)
            out["read"] += 1
        except P.PlanError:
            out["refused"] += 1
    deep = folder / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    try:
        P.read_plan_file(deep)
    except P.PlanError:
        out["refused"] += 1
    return out


def bench_files(n: int, seed: int, folder: Path) -> dict[str, int]:
    from test_hostile_bench import fake_result, use_everything

    from engine_manager.bench import results
    from engine_manager.errors import UserError

    good = fake_result()
    folder.mkdir(parents=True, exist_ok=True)
    results.save(copy.deepcopy(good), folder)
    out = {"read": 0, "refused": 0}
    for i, doc in enumerate(_mutants(json.loads(json.dumps(good)), n, seed, skip=("schema",))):
        f = folder / f"bench_20260101T0000{i:02d}Z_{i}.json"
        f.write_text(json.dumps(doc))
        try:
            d = results.load(f)
        except UserError:
            out["refused"] += 1
            continue
        use_everything(d)
        out["read"] += 1
    skipped: list[str] = []
    results.history(folder, skipped=skipped)
    return out


# -- the key outside its file ------------------------------------------------------------------------------------
def key_files(counts: Counts) -> list[str]:
    allowed = C.keys_file()
    seen = []
    for p in BASE.rglob("*"):
        if not p.is_file() or p.is_symlink() or p.stat().st_size > 64 * MB:     # the replica's sparse model files
            continue
        try:
            data = p.read_bytes()
        except OSError:
            continue
        if KEY.encode() not in data:
            continue
        mode = p.stat().st_mode & 0o777
        seen.append(f"{p.relative_to(BASE)} ({mode:o})")
        if p != allowed or mode != 0o600:
            counts.leaks.append(f"the key in {p.relative_to(BASE)} (mode {mode:o})")
    return seen


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-seconds", type=float, default=600.0, help="stop starting rounds after this")
    ap.add_argument("--files", type=int, default=150, help="damaged plan and bench files per round")
    ap.add_argument("--cli-rounds", type=int, default=1, help="rounds that also run the dsv41 child processes")
    ap.add_argument("--out", type=Path, default=None, help="write the counts as Markdown here")
    ap.add_argument("--serve", type=Path, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.serve is not None:
        serve(a.serve)
        return 0
    if not (1 <= a.rounds <= 100 and 10 <= a.max_seconds <= 3600 and 0 <= a.files <= 5000):
        ap.error("--rounds 1..100, --max-seconds 10..3600, --files 0..5000")
    received_file = Path(tempfile.mkdtemp(prefix="dsv41-soak-servers-")) / "received.json"   # not a panel file
    servers = subprocess.Popen([sys.executable, __file__, "--serve", str(received_file)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)     # loopback only
    assert servers.stdout is not None and servers.stdin is not None
    urls: dict[str, str] = json.loads(servers.stdout.readline())
    good = json.loads(servers.stdout.readline())
    counts, peak = Counts(), Peak()
    # a child's deadline counts its start too: this machine's `dsv41` start-up (the slowest of three, now)
    starts = []
    for _ in range(3):
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-m", "engine_manager", "connections", "list"], cwd=ROOT, env=dict(os.environ),
                       capture_output=True, timeout=120)
        starts.append(time.monotonic() - t0)
    startup_s = max(starts)
    poller = C.OverviewPoller(timeout_s=3.0, record=True)
    behaviours = sorted(BEHAVIOURS)
    started = time.monotonic()
    rounds = 0
    files = {"plans read": 0, "plans refused": 0, "bench read": 0, "bench refused": 0}
    if good is None:
        counts.tracebacks.append("plan files: the planner's plan could not be made (see the servers' output)")
    for r in range(a.rounds):
        if time.monotonic() - started > a.max_seconds:
            break
        for i, b in enumerate(behaviours):
            server_round(f"soak-{i}", b, urls[b], counts, peak, poller, cli=r < a.cli_rounds, startup_s=startup_s)
            print(f"round {r + 1} {b}: {len(counts.tracebacks)} tracebacks, {len(counts.hangs)} hangs, "
                  f"{len(counts.leaks)} leaks, peak {peak.self_peak / MB:.0f} MB", flush=True)
        if good is not None and a.files:
            got = counts.timed("plan files", f"round {r + 1}", 120, plan_files, good, a.files, 26 + r,
                               BASE / "plans-corpus" / str(r))
            if got:
                files["plans read"] += got["read"]
                files["plans refused"] += got["refused"]
        if a.files:
            got = counts.timed("bench files", f"round {r + 1}", 120, bench_files, a.files, 10 + r,
                               BASE / "bench-corpus" / str(r))
            if got:
                files["bench read"] += got["read"]
                files["bench refused"] += got["refused"]
        rounds += 1
    servers.stdin.write("stop\n")
    servers.stdin.flush()
    servers.wait(60)
    requests_seen = check_requests(json.loads(received_file.read_text()), counts)
    key_seen = key_files(counts)
    C.close_all_tunnels()
    peak.stop()
    took = time.monotonic() - started
    ok = not counts.tracebacks and not counts.hangs and not counts.leaks and peak.self_peak < 200 * MB \
        and peak.child_peak < 200 * MB
    lines = [
        "# Hostile soak", "",
        "Every behaviour of `tests/hostile_servers.py` on every path of a loopback server, through detection, "
        "`dsv41 connections test`, the readiness probes, one monitor cycle per adapter, the overview and "
        "`dsv41 chat --connection`; seeded damaged plan and bench result files. Loopback only.", "",
        "```", "  ".join(["python benchmarks/hostile_soak.py", *(argv if argv is not None else sys.argv[1:])]), "```",
        "",
        f"- rounds: {rounds} ({a.cli_rounds} with the `dsv41` child processes), {len(behaviours)} behaviours, "
        f"{took:.0f} s; a child's deadline includes `dsv41`'s start-up here ({startup_s:.1f} s, the slowest of 3)",
        "- calls: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.calls.items()))
        + f"; requests the servers received: {requests_seen}",
        "- files: " + ", ".join(f"{k} {v}" for k, v in files.items()),
        f"- **tracebacks: {len(counts.tracebacks)}**",
        f"- **hangs past their deadline (+{SLACK_S:g} s slack): {len(counts.hangs)}**",
        f"- **peak RSS: this process {peak.self_peak / MB:.0f} MB ({peak.baseline / MB:.0f} MB after its imports), "
        f"the largest `dsv41` child {peak.child_peak / MB:.0f} MB** (target < 200 MB)",
        f"- **the key outside its 0600 file / the Authorization header: {len(counts.leaks)}** "
        f"(files holding it: {', '.join(key_seen) or 'none'})",
        "- slowest call of each kind: " + "; ".join(f"{k} {v[0]:.1f} s ({v[1]})"
                                                   for k, v in sorted(counts.slowest.items())),
        "", f"Result: {'PASS' if ok else 'FAIL'}",
    ]
    for title, items in (("Tracebacks", counts.tracebacks), ("Hangs", counts.hangs), ("Key seen", counts.leaks)):
        if items:
            lines += ["", f"## {title}", ""] + [f"- {x}" for x in items[:50]]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
