"""Download throughput against curl, and verification against sha256sum, side by side in one run.

    .venv/bin/python benchmarks/download_speed.py [--mib 128] [--jobs 4] [--rounds 3]

A local hub (``python -m engine_manager.testing.hub --dir``, its own process) serves seven GGUF files of ``--mib`` MiB
each. Each round fetches all seven with ``curl --parallel --parallel-max JOBS -L`` and with
``engine_manager.download.download_model(jobs=JOBS)`` (which also hashes every byte as it arrives, checkpoints
its state, verifies the sha256 and the split metadata, and renames the files into place), alternating, into
fresh folders on the same disk. Then it hashes the seven files with ``sha256sum`` (one process, one file after
the other) and with ``engine_manager.download.check_existing(verify="full", jobs=1)`` (the same work: one
thread), both reading from the page cache. Goals: every ratio ≥ 0.9 (the exit status is 1 when one is missed).
The best round of each side is compared (the machine is shared; the best round is the least disturbed one), and
every round is printed. A quick check that it works: ``--mib 4 --rounds 1 --link-mbps 0``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from engine_manager import download as dl  # noqa: E402
from engine_manager.testing.hub import write_demo_shards  # noqa: E402

REPO = "vcruz305/DeepSeek-V4.1-Flash-GGUF"
GOAL = 0.9


def start_hub(folder: Path) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, "-m", "engine_manager.testing.hub", "--dir", str(folder), "--repo", REPO],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    line = p.stdout.readline().strip()
    if not line.startswith("HF_ENDPOINT="):
        p.kill()
        raise SystemExit(f"the hub did not start: {line} {p.stderr.read()}")
    return p, line.split("=", 1)[1]


def run_curl(url: str, names: list[str], out: Path, jobs: int) -> float:
    out.mkdir(parents=True)
    argv = ["curl", "-s", "-S", "--no-progress-meter", "-f", "-L", "--parallel", "--parallel-max", str(jobs)]
    for n in names:
        argv += ["-o", str(out / n), f"{url}/{REPO}/resolve/main/{n}"]
    t = time.perf_counter()
    subprocess.run(argv, check=True)
    return time.perf_counter() - t


def run_ours(url: str, out: Path, jobs: int) -> float:
    os.environ["DSV41_CACHE_DIR"] = str(out / "cache")
    from engine_manager.settings import load_settings
    s = load_settings(generate_key=False).settings
    t = time.perf_counter()
    last = None
    for ev in dl.download_model(s, target_dir=out, endpoint=url, jobs=jobs):
        last = ev
    dt = time.perf_counter() - t
    assert isinstance(last, dl.Finished), last
    return dt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=float, default=128, help="size of each of the seven files (MiB)")
    ap.add_argument("--jobs", type=int, default=4, help="parallel connections, same for curl and ours")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--link-mbps", type=float, default=1000,
                    help="also compare over a paced link of this many Mbit/s in total (0: skip)")
    ap.add_argument("--dir", type=Path, help="work folder (default: a temp folder under /tmp)")
    a = ap.parse_args(argv)
    if not shutil.which("curl") or not shutil.which("sha256sum"):
        raise SystemExit("needs curl and sha256sum")

    work = Path(tempfile.mkdtemp(prefix="dsv41-bench-", dir=a.dir))
    tmp_home = work / "home"
    os.environ.update(DSV41_CONFIG_DIR=str(tmp_home / "config"), DSV41_DATA_DIR=str(tmp_home / "data"),
                      HF_HOME=str(tmp_home / "hf"), HF_HUB_DISABLE_TELEMETRY="1")
    os.environ.pop("HF_TOKEN", None)
    hub = None
    try:
        src = work / "src"
        print(f"writing 7 × {a.mib:g} MiB of random GGUF shards into {src} …", flush=True)
        files = write_demo_shards(src, bytes_per_shard=int(a.mib * dl.MiB))
        total = sum(f.stat().st_size for f in files)
        names = [f.name for f in files]
        hub, url = start_hub(src)
        print(f"hub {url} ({hub.pid}); {len(files)} files, {total / 1e6:.0f} MB; jobs {a.jobs}; "
              f"{os.cpu_count()} CPUs; load {os.getloadavg()[0]:.2f}", flush=True)

        def rounds(label: str, n_rounds: int) -> tuple[list[float], list[float], Path]:
            curl_t, ours_t = [], []
            keep = work
            for r in range(n_rounds):
                for who in ("curl", "ours") if r % 2 == 0 else ("ours", "curl"):
                    out = work / f"{label}-{who}-{r}"
                    dt = run_curl(url, names, out, a.jobs) if who == "curl" else run_ours(url, out, a.jobs)
                    (curl_t if who == "curl" else ours_t).append(dt)
                    print(f"  {label} round {r + 1} {who:>4}: {dt:6.2f} s  {total / dt / 1e6:7.0f} MB/s", flush=True)
                    if who == "curl":
                        for n, f in zip(names, files):
                            assert (out / n).stat().st_size == f.stat().st_size
                    if keep != work and keep.exists():
                        shutil.rmtree(keep, ignore_errors=True)
                    keep = out
            return curl_t, ours_t, keep

        print("loopback, no limit (CPU-bound: hub, client and hashing share this machine's cores)", flush=True)
        curl_t, ours_t, keep = rounds("open", a.rounds)
        dl_ratio = min(curl_t) / min(ours_t)
        link_ratio = None
        if a.link_mbps > 0:
            per_conn = a.link_mbps * 1e6 / 8 / a.jobs
            with httpx.Client() as c:
                c.post(f"{url}/_hub/faults", json={"kind": "slow", "rate_bps": per_conn, "times": None})
            print(f"a {a.link_mbps:g} Mbit/s link (the hub paces each of the {a.jobs} connections at "
                  f"{per_conn / 1e6:.1f} MB/s)", flush=True)
            lc, lo, keep2 = rounds("link", max(1, a.rounds - 1))
            shutil.rmtree(keep2, ignore_errors=True)
            link_ratio = min(lc) / min(lo)
            with httpx.Client() as c:
                c.delete(f"{url}/_hub/faults")

        # verification: the same seven files, page cache warm for both
        target = keep
        paths = [target / n for n in names]
        for p in paths:
            p.read_bytes()
        sums_t, ver_t = [], []
        expected = [dl.RemoteFile(f.name, f.stat().st_size, dl.sha256_file(f)) for f in files]
        for r in range(a.rounds):
            t = time.perf_counter()
            out = subprocess.run(["sha256sum", *map(str, paths)], check=True, capture_output=True, text=True)
            sums_t.append(time.perf_counter() - t)
            assert len(out.stdout.splitlines()) == len(paths)
            t = time.perf_counter()
            gen = dl.check_existing(expected, target, verify="full", jobs=1)
            try:
                while True:
                    next(gen)
            except StopIteration as stop:
                result = stop.value
            ver_t.append(time.perf_counter() - t)
            assert all(result.values()), result
            print(f"  round {r + 1} sha256sum {sums_t[-1]:6.2f} s ({total / sums_t[-1] / 1e6:5.0f} MB/s)   "
                  f"ours {ver_t[-1]:6.2f} s ({total / ver_t[-1] / 1e6:5.0f} MB/s)", flush=True)
        ver_ratio = min(sums_t) / min(ver_t)

        print()
        print(f"download:     curl best {min(curl_t):.2f} s ({total / min(curl_t) / 1e6:.0f} MB/s), ours best "
              f"{min(ours_t):.2f} s ({total / min(ours_t) / 1e6:.0f} MB/s, hashing + checkpoints + verify "
              f"included) → throughput ratio ours/curl = {dl_ratio:.2f} (goal ≥ {GOAL})")
        if link_ratio is not None:
            print(f"download over a {a.link_mbps:g} Mbit/s link: throughput ratio ours/curl = {link_ratio:.2f} "
                  f"(goal ≥ {GOAL})")
        print(f"verification: sha256sum best {min(sums_t):.2f} s, ours best {min(ver_t):.2f} s "
              f"→ speed ratio ours/sha256sum = {ver_ratio:.2f} (goal ≥ {GOAL})")
        # Not a goal, for context: curl neither hashes nor syncs, so on loopback with two cores its figure is
        # bare transfer. A verified copy with stock tools is curl, then sha256sum over the same files.
        both = min(curl_t) + min(sums_t)
        print(f"verified copy: curl + sha256sum best {both:.2f} s, ours best {min(ours_t):.2f} s "
              f"→ ratio {both / min(ours_t):.2f} (context, not a goal)")
        missed = [name for name, r in (("download", dl_ratio), ("download over the link", link_ratio),
                                       ("verification", ver_ratio)) if r is not None and r < GOAL]
        if missed:
            print(f"goal missed: {', '.join(missed)} (ratio below {GOAL})")
            return 1
        print("all goals met")
        return 0
    finally:
        if hub is not None:
            hub.send_signal(signal.SIGTERM)
            try:
                hub.wait(timeout=10)
            except subprocess.TimeoutExpired:
                hub.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
