"""The panel's headless path on a real NVIDIA GPU: doctor → plan against the real VRAM → start the scripted engine
under the supervisor (NUMA binding probed) → the metrics hub with its NVML source while 4 chats stream → stop.

It shows that the NVML collectors (VRAM, utilisation, PCIe RX/TX, power, temperature, link) read real values and
that nothing is left running. The scripted engine computes nothing on the GPU, so the GPU figures are the idle
card's; the engine's figures are simulated (labelled so).

    python3 benchmarks/gpu_monitor_probe.py --out DIR [--seconds 12]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seconds", type=float, default=12.0)
    a = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="dsv41-gpu-probe-"))
    os.environ.update(DSV41_CONFIG_DIR=str(home / "config"), DSV41_DATA_DIR=str(home / "data"),
                      DSV41_CACHE_DIR=str(home / "cache"), DSV41_PORT="18911", DSV41_SLOTS="4",
                      DSV41_SIM_ARGS="--reply-tokens 400")
    import httpx
    import psutil

    from engine_manager import doctor, hardware, metrics as M, placement, plans, supervisor as sv
    from engine_manager.engine_state import RunningEngine
    from engine_manager.settings import load_settings

    settings = load_settings().settings
    out: dict = {"when": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    report = hardware.probe(settings.cache_path)
    out["doctor"] = [v.__dict__ for v in doctor.verdicts(report, settings)]
    layout = plans.default_sim_layout()
    p = placement.plan(layout, report, None, settings)
    out["plan_this_gpu"] = {k: p.to_dict().get(k) for k in ("hot_experts", "hot_expert_bytes", "refused",
                                                            "llamacpp_cpu_layers")}
    print("plan on this machine:", out["plan_this_gpu"]["refused"] or f"{p.to_dict()['hot_experts']} hot experts",
          flush=True)

    sup = sv.Supervisor(settings, auto_restart=False, ready_timeout_s=60)
    events = []
    for ev in sup.run("sim", None, watch=False):
        events.append(type(ev).__name__)
        if type(ev).__name__ in ("Ready", "Failed", "Crashed"):
            break
    st = sup.status()
    out["status"] = {k: v for k, v in st.to_dict().items() if k in ("state", "engine", "pid", "keeper_pid", "port",
                                                                    "binding", "binding_note")}
    print("engine:", out["status"], flush=True)
    running = RunningEngine(st.base_url, settings.api_key, engine="sim", spec=st.spec, pid=st.pid, binding=st.binding,
                            log_path=st.log_path or None, argv=tuple(st.argv), gpu_index=0)
    hub = M.build_hub(running, hz=2.0, plan=st.plan(), record=False)
    stop = threading.Event()

    def chat() -> None:
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                try:
                    c.post(st.base_url + "/v1/chat/completions",
                           headers={"Authorization": f"Bearer {settings.api_key}"},
                           json={"messages": [{"role": "user", "content": "expert offload"}], "max_tokens": 200})
                except httpx.HTTPError:
                    return          # the engine is being stopped

    threads = [threading.Thread(target=chat, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    ticks = []
    t_end = time.monotonic() + a.seconds
    for tick in hub.iter_ticks():
        ticks.append({"t": tick.t, "missing": tick.missing, "values": {k: v for k, v in tick.values.items()
                                                                      if v is not None}})
        if time.monotonic() > t_end:
            break
    hub.stop()
    stop.set()
    for _ in sup.stop():
        pass
    for t in threads:
        t.join(timeout=30)
    left = [pid for pid in (st.pid, st.keeper_pid) if pid and psutil.pid_exists(pid)]
    out["ticks"] = ticks
    out["left_running_after_stop"] = left
    last = ticks[-1]["values"] if ticks else {}
    keys = ("nvml_vram_used_bytes", "nvml_vram_total_bytes", "gpu_util_pct", "nvml_pcie_rx_mb_s",
            "nvml_pcie_tx_mb_s", "gpu_power_w", "gpu_temp_c", "gpu_pcie_gen", "gpu_pcie_width", "decode_tok_s",
            "hit_rate", "cpu_bound_pct", "cpu_rest_pct")
    print("last tick:", {k: last.get(k) for k in keys}, flush=True)
    print("missing sources in the last tick:", ticks[-1]["missing"] if ticks else None)
    print("processes left after stop:", left)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "gpu_monitor_probe.json").write_text(json.dumps(out, indent=1, default=str))
    return 0 if not left else 1


if __name__ == "__main__":
    sys.exit(main())
