"""How long planning takes, against the time to merely read the header bytes it needs — in one run.

Writes the sparse DeepSeek-V4.1-Flash Q2_K replica (7 shards, 264.5 GB apparent) into a temp dir, then, side by
side, repeated and interleaved:

  raw   — open each of the 7 shards and read its header bytes (the bytes up to the end of the tensor infos);
  plan  — ``read_layout`` (parse all 7 headers) + ``placement.plan`` on the guides' host (97,887 MiB, 280 GB).

Goals (issue 3): plan ≤ 0.5 s, and ≤ 2× raw. Prints both medians (and best), the ratio, and the verdict.

    .venv/bin/python benchmarks/plan_speed.py [--repeat 30] [--dir DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine_manager.layout import find_shards, read_layout  # noqa: E402
from engine_manager.placement import plan, reference_hardware  # noqa: E402
from engine_manager.replica import ReplicaSpec, write_replica  # noqa: E402


def raw_read(files: list[Path], sizes: list[int]) -> int:
    n = 0
    for f, s in zip(files, sizes):
        with open(f, "rb") as fh:
            n += len(fh.read(s))
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--dir", help="use (or write) the replica here instead of a temp dir")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="plan-speed-") as tmp:
        d = Path(a.dir) if a.dir else Path(tmp)
        if not list(d.glob("*-00001-of-00007.gguf")):
            r = write_replica(d, ReplicaSpec())
            print(f"replica: {len(r.paths)} shards, {r.total_bytes / 1e9:.1f} GB apparent, written in {r.seconds:.2f} s")
        files = find_shards(d)
        lay = read_layout(d)
        sizes = [s.header_bytes for s in lay.shards]
        hw = reference_hardware()
        print(f"headers: {sum(sizes):,} bytes in {len(files)} shards ({', '.join(f'{s:,}' for s in sizes)})")
        raw_t, plan_t = [], []
        for _ in range(3):                       # warm the page cache and the code paths
            raw_read(files, sizes)
            plan(read_layout(d), hw)
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            raw_read(files, sizes)
            t1 = time.perf_counter()
            p = plan(read_layout(d), hw)
            t2 = time.perf_counter()
            raw_t.append(t1 - t0)
            plan_t.append(t2 - t1)
        rm, pm = statistics.median(raw_t), statistics.median(plan_t)
        ratio = pm / rm if rm > 0 else float("inf")
        print(f"raw read of the header bytes : median {rm * 1e3:7.2f} ms  (best {min(raw_t) * 1e3:.2f} ms)")
        print(f"read 7 headers + plan        : median {pm * 1e3:7.2f} ms  (best {min(plan_t) * 1e3:.2f} ms)")
        print(f"ratio plan / raw             : {ratio:.1f}×  (best/best {min(plan_t) / min(raw_t):.1f}×)")
        print(f"plan: {p.n_hot:,} hot experts, {p.hot_expert_bytes / 2**30:.1f} GiB")
        ok_total = pm <= 0.5
        ok_ratio = ratio <= 2.0
        print(f"goal ≤ 0.5 s total: {'met' if ok_total else 'NOT met'}; goal ≤ 2× raw: {'met' if ok_ratio else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
