"""What supervising costs, measured side by side in one run on this machine, with the scripted engine.

- start → ready: the sim started bare (the same argv, plan file, environment; Popen + /health polled every 10 ms)
  beside the same sim started by the Supervisor (binding probe cached, keeper, numactl prefix, state file,
  readiness polled every 100 ms);
- crash notice: SIGKILL of the engine → the supervisor's ``crashed`` state event (goal: < 1 s);
- stop: bare SIGTERM + wait beside ``Supervisor.stop()`` (SIGTERM to the group, leftover scan, state file);
- log throughput: 200,000 lines written by a child straight to a file beside the same lines through the keeper
  (line splitting, key masking, size rotation).

    .venv/bin/python benchmarks/supervisor_overhead.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
_TMP = tempfile.mkdtemp(prefix="dsv41-supbench-")
os.environ["DSV41_CONFIG_DIR"] = os.path.join(_TMP, "config")
os.environ["DSV41_DATA_DIR"] = os.path.join(_TMP, "data")
os.environ["DSV41_SIM_ARGS"] = "--load-time 0"

import httpx  # noqa: E402

from engine_manager import supervisor as sv  # noqa: E402
from engine_manager.launch import KEEPER  # noqa: E402
from engine_manager.engines import get_engine  # noqa: E402
from engine_manager.settings import load_settings  # noqa: E402
from engine_manager.sim.launch import free_port  # noqa: E402


def bare_start_stop(spec) -> tuple[float, float]:
    """The same command line, environment and working directory as the supervised start, without supervision."""
    port = spec.port
    env = dict(os.environ, **spec.env)
    t0 = time.perf_counter()
    p = subprocess.Popen(spec.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=spec.cwd, env=env,
                         start_new_session=True)
    with httpx.Client(timeout=1.0, trust_env=False) as c:
        while True:
            try:
                if c.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.01)
    ready = time.perf_counter() - t0
    t1 = time.perf_counter()
    p.send_signal(signal.SIGTERM)
    p.wait()
    return ready, time.perf_counter() - t1


def supervised_start_stop(sup: sv.Supervisor) -> tuple[float, float]:
    t0 = time.perf_counter()
    for _ in sup.run(get_engine("sim"), watch=False):
        pass
    ready = time.perf_counter() - t0
    t1 = time.perf_counter()
    for _ in sup.stop():
        pass
    return ready, time.perf_counter() - t1


def crash_notice(sup: sv.Supervisor) -> float:
    gen = sup.run(get_engine("sim"))
    t_kill = None
    for ev in gen:
        if ev.kind == "ready":
            t_kill = time.time()
            os.kill(ev.pid, signal.SIGKILL)
        elif ev.kind == "state" and ev.state == "crashed":
            took = ev.t - t_kill
            sup.cancel()
            for _ in gen:
                pass
            return took
    raise RuntimeError("no crash seen")


def log_throughput(lines: int) -> tuple[float, float]:
    d = Path(_TMP)
    script = (f"import sys\nw=sys.stdout.write\n"
              f"for i in range({lines}): w('line %d some engine output key=sk-XYZ\\n' % i)")
    t0 = time.perf_counter()
    with open(d / "direct.log", "wb") as f:
        subprocess.run([sys.executable, "-c", script], stdout=f, check=True)
    direct = time.perf_counter() - t0
    env = dict(os.environ, DSV41_KEEPER_MASK="sk-XYZ")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-I", "-S", str(KEEPER), "--log", str(d / "kept.log"), "--exit-file",
                    str(d / "exit.json"), "--max-bytes", str(10 * 2**20), "--backups", "3", "--", sys.executable,
                    "-c", script], env=env, check=True)
    kept = time.perf_counter() - t0
    return direct, kept


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    port = free_port()
    os.environ["DSV41_PORT"] = str(port)
    sup = sv.Supervisor(load_settings().settings, auto_restart=False, poll_s=0.05)
    supervised_start_stop(sup)                      # warm-up: binding probe, default plan, imports
    plan, _ = sup._default_plan("sim")
    spec = get_engine("sim").build_launch(sup.settings, plan, Path(_TMP) / "bare")
    bare_start_stop(spec)
    rows = []
    for _ in range(args.rounds):
        b = bare_start_stop(spec)
        s = supervised_start_stop(sup)
        rows.append((b, s))
    med = statistics.median
    b_ready, s_ready = med(r[0][0] for r in rows), med(r[1][0] for r in rows)
    b_stop, s_stop = med(r[0][1] for r in rows), med(r[1][1] for r in rows)
    print(f"start → ready   bare sim {b_ready * 1000:7.0f} ms   supervised {s_ready * 1000:7.0f} ms   "
          f"ratio {s_ready / b_ready:.2f}   (median of {args.rounds})")
    print(f"stop            bare sim {b_stop * 1000:7.0f} ms   supervised {s_stop * 1000:7.0f} ms   "
          f"ratio {s_stop / b_stop:.2f}")
    notices = [crash_notice(sup) for _ in range(args.rounds)]
    print(f"SIGKILL → crashed event: median {med(notices) * 1000:.0f} ms, max {max(notices) * 1000:.0f} ms "
          f"(goal < 1000 ms; {args.rounds} kills)")
    direct, kept = log_throughput(200_000)
    print(f"200,000 log lines: straight to a file {direct * 1000:.0f} ms, through the keeper {kept * 1000:.0f} ms, "
          f"ratio {kept / direct:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
