"""The scripted engine's own cost and its modelled figures, measured side by side in one run.

    .venv/bin/python benchmarks/sim_cpu.py [--seconds 8]

1. CPU of the sim process (psutil, % of one core) idle, and while serving 8 concurrent streams in real time
   (speed 1: ~19 tok/s each, the guides' 8-user rate). Goal: idle ≈ 0%, 8 streams ≤ 15% of one core.
2. The 1/4/8-user throughput the sim reports (modelled) beside the guides' table, with ratios.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_manager.sim.launch import SimProcess  # noqa: E402
from engine_manager.sim.offload import GUIDE_TABLE  # noqa: E402


def streams(sp: SimProcess, users: int, tokens: int) -> list[dict]:
    out: list[dict] = []
    barrier = threading.Barrier(users)

    def one(i: int) -> None:
        with httpx.Client(timeout=600) as c:
            c.get(sp.url("/health"))
            barrier.wait()
            with c.stream("POST", sp.url("/v1/chat/completions"), headers=sp.headers,
                          json={"messages": [{"role": "user", "content": f"user {i}"}], "max_tokens": tokens,
                                "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {") and '"timings"' in line:
                        out.append(json.loads(line[6:])["timings"])

    ts = [threading.Thread(target=one, args=(i,)) for i in range(users)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=8.0, help="length of the real-time 8-stream run")
    a = ap.parse_args()
    tokens = int(19 * a.seconds)
    with SimProcess(["--slots", "8", "--reply-tokens", str(tokens)]) as sp:
        sp.wait_ready()
        proc = psutil.Process(sp.proc.pid)
        time.sleep(1.0)
        proc.cpu_percent()
        time.sleep(3.0)
        idle = proc.cpu_percent()
        proc.cpu_percent()
        t0 = time.monotonic()
        res = streams(sp, 8, tokens)
        wall = time.monotonic() - t0
        busy = proc.cpu_percent()
    print(f"sim CPU idle (3 s):                      {idle:5.1f} % of one core")
    print(f"sim CPU serving 8 streams ({wall:4.1f} s wall): {busy:5.1f} % of one core "
          f"({sum(t['predicted_n'] for t in res)} tokens)")
    with SimProcess(["--slots", "8", "--speed", "10", "--reply-tokens", "200"]) as sp:
        sp.wait_ready()
        print("\nusers  total tok/s (guides, ratio)   slowest tok/s (guides, ratio)   [modelled by the sim]")
        for users in (1, 4, 8):
            rates = [t["predicted_per_second"] for t in streams(sp, users, 200)]
            ref = GUIDE_TABLE[users]
            tot, slow = sum(rates), min(rates)
            print(f"{users:5d}  {tot:7.2f} ({ref['total_tok_s']:6.2f}, {tot / ref['total_tok_s']:.3f})"
                  f"        {slow:6.2f} ({ref['slowest_tok_s']:6.2f}, {slow / ref['slowest_tok_s']:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
