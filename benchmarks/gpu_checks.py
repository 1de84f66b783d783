"""The planned-vs-measured checks' GPU paths on a real NVIDIA GPU (engine_manager.checks: read_gpu, check_vram,
check_gpu_others, read_process), with another process holding VRAM on the card.

    python benchmarks/gpu_checks.py [--hold-gib 40] [--out FILE]

Needs NVML (nvidia-ml-py) and, for the holder process, torch. Prints each reading and check; exits 1 when a check
does not say what the situation is (no other process while one holds VRAM, or a plan that cannot fit judged ok).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_manager import checks as C  # noqa: E402

HOLDER = """
import sys, time, torch
x = torch.empty(int(float(sys.argv[1]) * (1 << 30)), dtype=torch.uint8, device="cuda")
x.fill_(1)
torch.cuda.synchronize()
print("holding", flush=True)
time.sleep(600)
"""


def plan_needing(gib: float) -> dict:
    return {"vram": {"total_bytes": int(gib * (1 << 30))}}


def show(lines: list[str], title: str, obj) -> None:
    text = obj if isinstance(obj, str) else json.dumps(obj, default=str, indent=None)
    lines.append(f"{title}: {text}")
    print(lines[-1], flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hold-gib", type=float, default=40.0)
    ap.add_argument("--out")
    a = ap.parse_args()
    lines: list[str] = []
    bad: list[str] = []
    t0 = time.perf_counter()
    gpu = C.read_gpu(0)
    show(lines, f"read_gpu, nothing else on the card ({time.perf_counter() - t0:.2f} s)", gpu)
    total_gib = (gpu.total_bytes or 0) / (1 << 30)
    for name, check in (("check_gpu_others", C.check_gpu_others(gpu)),
                        ("check_vram, a plan of 100 GiB", C.check_vram(plan_needing(100), gpu))):
        show(lines, name, check.to_dict())
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(a.hold_gib)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        ready = holder.stdout.readline().strip()
        show(lines, f"holder pid {holder.pid}", ready)
        gpu2 = C.read_gpu(0)
        show(lines, f"read_gpu, another process holding {a.hold_gib:g} GiB", gpu2)
        others = C.check_gpu_others(gpu2)
        show(lines, "check_gpu_others", others.to_dict())
        if others.ok is not False or str(holder.pid) not in (others.measured or ""):
            bad.append("the holder was not named as another process on the GPU")
        need = total_gib - a.hold_gib / 2          # fits the card, not beside the holder
        vram = C.check_vram(plan_needing(need), gpu2)
        show(lines, f"check_vram, a plan of {need:.0f} GiB", vram.to_dict())
        if vram.ok is not False:
            bad.append("a plan that cannot fit beside the holder was judged ok")
        mine = C.check_gpu_others(gpu2, pids=[holder.pid])
        show(lines, "check_gpu_others with the holder as the engine's own", mine.to_dict())
        if mine.ok is not True:
            bad.append("the engine's own process was counted as another")
        proc = C.read_process(holder.pid)
        show(lines, "read_process(holder)", proc)
    finally:
        holder.kill()
        holder.wait()
    show(lines, "verdict", "ok" if not bad else "; ".join(bad))
    if a.out:
        Path(a.out).write_text("\n".join(lines) + "\n")
    return 0 if not bad else 1


if __name__ == "__main__":
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    sys.exit(main())
