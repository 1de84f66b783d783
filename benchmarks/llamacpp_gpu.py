"""llama.cpp placement on a real GPU: decode speed with every expert layer on the GPU vs half (and all) of them
kept in RAM, and NVML's PCIe traffic while it decodes — all through the panel's own code.

What it does, in order (each step's output lands in ``--out``):

1. writes a several-GB MoE GGUF with :mod:`engine_manager.testing.tinymoe` (``--preset gpu``: qwen3moe, 12 MoE layers x
   64 experts x 9.4 MiB F16, ~7.3 GB) unless it is already there;
2. probes the hardware (``engine_manager.hardware.probe``) and runs the panel's planner against the real VRAM
   (``dsv41 plan`` when the CLI has it, else ``engine_manager.placement``), saving the plan;
3. for each placement (the planner's, all experts on the GPU, the first half of the MoE layers' experts in RAM,
   all of them in RAM) builds the llama-server command with ``engines.llamacpp`` (``-ot`` for the RAM layers),
   starts it, waits for ``/health``, then measures
   - 1-user decode: a streamed request of ``--tokens`` tokens; tok/s three ways: the panel's poll
     (``/slots`` n_decoded deltas), llama-server's own ``timings.predicted_per_second``, and our wall clock;
   - N-user decode (``--users``): N concurrent streams, total tok/s;
   - prefill of a ~``--prompt-tokens`` prompt: prompt tok/s from ``timings``;
   - NVML every 20 ms during each phase: PCIe RX/TX (MB/s, NVML's ~20 ms window), GPU utilisation, VRAM used;
   - the placement llama.cpp reports in its log (``PlacementSummary``);
4. writes ``llamacpp_gpu.json`` (everything) and ``llamacpp_gpu.md`` (the table) and copies the logs.

Run on the GPU machine (see ``benchmarks/llamacpp_gpu.sh`` for the build + run as one command):
``python benchmarks/llamacpp_gpu.py --server /path/llama-server --model-dir /tmp/gpumoe --out OUTDIR``.
On a CPU-only machine ``--preset tiny --tokens 64`` runs the same path quickly (it checks the script, nothing more).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine_manager import hardware  # noqa: E402
from engine_manager.testing import tinymoe  # noqa: E402
from engine_manager.engines import get_engine  # noqa: E402
from engine_manager.engines.llamacpp import PlacementSummary  # noqa: E402
from engine_manager.settings import load_settings  # noqa: E402
from engine_manager.sim.launch import free_port  # noqa: E402

ENGINE = get_engine("llamacpp")


class Nvml:
    """Samples PCIe RX/TX, utilisation and memory of one GPU in a thread while a phase runs."""

    def __init__(self, index: int = 0, period_s: float = 0.02):
        self.ok = False
        self.period = period_s
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nv = pynvml
            self.h = pynvml.nvmlDeviceGetHandleByIndex(index)
            self.ok = True
        except Exception as exc:  # no GPU here: the CPU check run
            self.err = f"{type(exc).__name__}: {exc}"
        self._stop = threading.Event()
        self.samples: list[tuple[float, float, float, int, int]] = []

    def __enter__(self):
        self.samples = []
        self._stop.clear()
        if self.ok:
            self._t = threading.Thread(target=self._run, daemon=True)
            self._t.start()
        return self

    def _run(self):
        nv, h = self.nv, self.h
        while not self._stop.is_set():
            try:
                rx = nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_RX_BYTES)   # KB/s, ~20 ms window
                tx = nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_TX_BYTES)
                util = nv.nvmlDeviceGetUtilizationRates(h).gpu
                mem = nv.nvmlDeviceGetMemoryInfo(h).used
                self.samples.append((time.monotonic(), rx / 1000.0, tx / 1000.0, util, mem))
            except Exception:
                pass
            time.sleep(self.period)

    def __exit__(self, *a):
        self._stop.set()
        if self.ok:
            self._t.join(2)

    def summary(self) -> dict | None:
        if not self.ok or not self.samples:
            return None
        rx = [s[1] for s in self.samples]
        tx = [s[2] for s in self.samples]
        util = [s[3] for s in self.samples]
        return {"samples": len(rx), "pcie_rx_mb_s_mean": sum(rx) / len(rx), "pcie_rx_mb_s_max": max(rx),
                "pcie_tx_mb_s_mean": sum(tx) / len(tx), "pcie_tx_mb_s_max": max(tx),
                "gpu_util_pct_mean": sum(util) / len(util), "vram_used_mib_max": max(s[4] for s in self.samples)
                / 2**20}


def stream_request(base: str, key: str, content: str, max_tokens: int, out: dict) -> None:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    first = None
    n = 0
    timings = None
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=600,
                      headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status_code != 200:
            out["error"] = f"HTTP {r.status_code}: {r.read()[:300]!r}"
            return
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if d.get("timings"):
                timings = d["timings"]
            for ch in d.get("choices") or []:
                if (ch.get("delta") or {}).get("content"):
                    n += 1
                    if first is None:
                        first = time.monotonic()
    t1 = time.monotonic()
    out.update({"chunks": n, "wall_s": t1 - t0, "ttft_s": (first - t0) if first else None,
                "wall_decode_tok_s": ((timings or {}).get("predicted_n", n) - 1) / (t1 - first)
                if first and t1 > first else None, "timings": timings})


def poll_during(spec, stop: threading.Event, period: float, rates: list) -> None:
    prev = None
    with httpx.Client() as c:
        while not stop.is_set():
            try:
                s = ENGINE.poll(c, spec, prev)
                if s.decode_tok_s is not None and s.state == "generating":
                    rates.append(s.decode_tok_s)
                prev = s
            except httpx.HTTPError:
                pass
            stop.wait(period)


def measure_decode(spec, users: int, tokens: int, nvml: Nvml) -> dict:
    outs = [dict() for _ in range(users)]
    rates: list[float] = []
    stop = threading.Event()
    poller = threading.Thread(target=poll_during, args=(spec, stop, 0.25, rates), daemon=True)
    ths = [threading.Thread(target=stream_request, args=(spec.base_url, spec.api_key, f"Tell story {i}.",
                                                         tokens, outs[i])) for i in range(users)]
    with nvml:
        t0 = time.monotonic()
        poller.start()
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        wall = time.monotonic() - t0
        stop.set()
        poller.join(5)
    gen = sum((o.get("timings") or {}).get("predicted_n", 0) for o in outs)
    res = {"users": users, "tokens_each": tokens, "wall_s": wall, "total_tok_s_wall": gen / wall if wall else None,
           "engine_tok_s_each": [(o.get("timings") or {}).get("predicted_per_second") for o in outs],
           "wall_decode_tok_s_each": [o.get("wall_decode_tok_s") for o in outs],
           "panel_poll_tok_s": rates, "nvml": nvml.summary(), "errors": [o["error"] for o in outs if "error" in o]}
    # the middle of the poll series is steady decode (the ends straddle start and finish)
    mid = rates[1:-1] if len(rates) > 2 else rates
    res["panel_poll_tok_s_median"] = sorted(mid)[len(mid) // 2] if mid else None
    return res


def measure_prefill(spec, prompt_tokens: int, nvml: Nvml) -> dict:
    words = " ".join(f"w{i % 97} x{i % 13}" for i in range(prompt_tokens // 4))
    out: dict = {}
    with nvml:
        stream_request(spec.base_url, spec.api_key, words, 1, out)
    t = out.get("timings") or {}
    return {"prompt_n": t.get("prompt_n"), "prompt_tok_s": t.get("prompt_per_second"),
            "prompt_ms": t.get("prompt_ms"), "nvml": nvml.summary(), "error": out.get("error")}


class Started:
    """llama-server started the way the panel starts it: ``Supervisor.run`` (keeper, log, state file) on a thread,
    its events collected; ``stop()`` stops it through the supervisor."""

    def __init__(self, settings, plan: dict):
        from engine_manager.supervisor import Supervisor

        self.sup = Supervisor(settings, auto_restart=False, ready_timeout_s=600, grace_s=20)
        self.events: list = []
        self._ready = threading.Event()
        self._t = threading.Thread(target=self._run, args=(plan,), daemon=True)
        self._t.start()

    def _run(self, plan):
        try:
            for ev in self.sup.run("llamacpp", plan):
                self.events.append(ev)
                if ev.kind in ("ready", "failed", "crashed"):
                    self._ready.set()
        finally:
            self._ready.set()

    def wait_ready(self, timeout: float = 600):
        self._ready.wait(timeout)
        ev = next((e for e in self.events if e.kind in ("ready", "failed", "crashed")), None)
        if ev is None or ev.kind != "ready":
            raise RuntimeError(f"not ready: {ev}")
        return ev.elapsed_s, self.sup.status().spec

    def stop(self):
        for ev in self.sup.stop():
            self.events.append(ev)
        self._t.join(60)

    def log_lines(self) -> list[str]:
        return [ln for e in self.events if e.kind == "log" for ln in e.lines]


def run_config(name: str, settings, plan: dict, workdir: Path, args, nvml: Nvml, logs_out: Path) -> dict:
    res: dict = {"config": name, "cpu_layers": plan.get("llamacpp_cpu_layers", [])}
    started = Started(settings, plan)
    try:
        res["ready_s"], spec = started.wait_ready()
        res["argv"], res["env"] = spec.masked_argv(), spec.masked_env()
        stream_request(spec.base_url, spec.api_key, "warm up", 16, {})
        res["decode_1"] = measure_decode(spec, 1, args.tokens, nvml)
        if args.users > 1:
            res[f"decode_{args.users}"] = measure_decode(spec, args.users, args.tokens // 2, nvml)
        res["prefill"] = measure_prefill(spec, args.prompt_tokens, nvml)
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        started.stop()
    crashed = [e.to_dict() for e in started.events if e.kind in ("crashed", "failed")]
    if crashed:
        res["failure"] = crashed
    lines = started.log_lines()
    summary = PlacementSummary().feed(lines)
    res["placement_log"] = summary.to_dict()
    res["placement_text"] = summary.text()
    moe = plan["model"]["moe_layers"]
    on_gpu = summary.expert_layers_on_gpu([x for x in moe if x not in set(plan.get("llamacpp_cpu_layers", []))])
    res["moe_layers_on_gpu"] = None if on_gpu is None else len(on_gpu)
    res["hit_rate"] = None if on_gpu is None else len(on_gpu) / len(moe)
    (logs_out / f"log_{name}.log").write_text("\n".join(lines) + "\n")
    return res


def make_plan(layout, hw, settings, out: Path) -> tuple[dict | None, str]:
    """The panel's planner against the real hardware: the `dsv41 plan` CLI when present, else the module."""
    try:
        from engine_manager import placement
    except ImportError as exc:
        return None, f"engine_manager.placement not importable ({exc})"
    try:
        p = placement.plan(layout, hw, None, settings)
        d = p.to_dict() if hasattr(p, "to_dict") else dict(p)
        (out / "plan.json").write_text(json.dumps(d, indent=1, default=str)[:2_000_000])
        return d, "engine_manager.placement.plan"
    except Exception as exc:
        return None, f"placement.plan failed: {type(exc).__name__}: {exc}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", help="llama-server to run (default: the [llamacpp] extra's)")
    ap.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "gpumoe")
    ap.add_argument("--preset", default="gpu", choices=sorted(tinymoe.PRESETS))
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "llamacpp_gpu")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--configs", default="plan,all_gpu,half_cpu,all_cpu",
                    help="comma list; NAME@MODE runs NAME with llama-server's load mode MODE (mmap, none)")
    ap.add_argument("--context", type=int, default=4096)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    result: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(),
                    "command": [sys.executable, *sys.argv]}

    first = tinymoe.shard_paths(args.model_dir, tinymoe.PRESETS[args.preset].shards)[0]
    if not first.exists():
        t0 = time.monotonic()
        tinymoe.write_tinymoe(args.model_dir, tinymoe.PRESETS[args.preset])
        result["model_write_s"] = time.monotonic() - t0
    result["model"] = {"first_shard": str(first), "bytes": sum(f.stat().st_size for f in args.model_dir.glob("*.gguf")),
                       "config": tinymoe.PRESETS[args.preset].__dict__}

    home = Path(tempfile.mkdtemp(prefix="dsv41-bench-"))
    env = {"DSV41_CONFIG_DIR": str(home / "c"), "DSV41_DATA_DIR": str(home / "d"),
           "DSV41_LLAMACPP_MODEL": str(first), "DSV41_PORT": str(free_port()), "DSV41_NUMA": "off",
           "DSV41_CONTEXT_LENGTH": str(args.context), "DSV41_SLOTS": str(max(1, args.users)),
           "DSV41_KV_TYPE": "int8"}
    if args.server:
        env["DSV41_LLAMA_SERVER"] = args.server
    os.environ.update({k: v for k, v in env.items() if k in ("DSV41_CONFIG_DIR", "DSV41_DATA_DIR")})
    settings = load_settings(env=env).settings

    hw = hardware.probe(args.model_dir)
    result["hardware"] = {"gpu": hw.gpu(0).__dict__ if hw.gpu(0) else None, "gpu_error": hw.gpu_error,
                          "cpus": getattr(hw.host, "cpu_count_logical", None)}
    from engine_manager.tensor_layout import read_layout

    layout = read_layout(first)
    moe = list(layout.moe_layers)
    plan, how = make_plan(layout, hw, settings, args.out)
    result["planner"] = how
    base = {"model": {"file": str(first), "moe_layers": moe, "n_experts": layout.n_experts,
                      "n_experts_used": layout.n_experts_used},
            "settings": {"slots": settings.slots, "context_length": settings.context_length,
                         "kv_type": settings.kv_type}}
    configs = {"all_gpu": [], "half_cpu": moe[: len(moe) // 2], "all_cpu": moe}
    if plan is not None:
        result["plan_summary"] = {k: plan.get(k) for k in ("refused", "llamacpp_cpu_layers",
                                                            "llamacpp_predicted_hit_rate", "hot_experts",
                                                            "cold_experts", "predicted_hit_rate")}
        result["plan_vram"] = plan.get("vram")
    logs_out = args.out
    nvml = Nvml(settings.gpu_index)
    result["nvml"] = "ok" if nvml.ok else getattr(nvml, "err", "unavailable")
    result["runs"] = []
    for name in args.configs.split(","):
        if name == "plan":
            if plan is None or plan.get("refused"):
                result["runs"].append({"config": "plan", "skipped": how if plan is None else plan["refused"]})
                continue
            p = dict(plan)
            p.setdefault("model", base["model"])
            p["model"] = {**base["model"], **(p.get("model") or {}), "file": str(first)}
            p["settings"] = base["settings"]
        else:
            p = {**base, "llamacpp_cpu_layers": configs[name.split("@")[0]]}
        # "half_cpu@none": the same placement with llama-server's -lm (load mode) given through the adapter's knob
        mode = name.split("@")[1] if "@" in name else None
        cfg_settings = settings.model_copy(update={"llamacpp_load_mode": mode or "auto"})
        print(f"== {name}: experts of {len(p.get('llamacpp_cpu_layers') or [])}/{len(moe)} MoE layers in RAM",
              flush=True)
        r = run_config(name.replace("@", "_lm_"), cfg_settings, p, home, args, nvml, logs_out)
        r["load_mode"] = mode or "default (mmap)"
        result["runs"].append(r)
        d1 = r.get("decode_1") or {}
        print(f"   ready {r.get('ready_s', 0):.1f} s; 1 user {d1.get('engine_tok_s_each')} tok/s (engine), "
              f"poll median {d1.get('panel_poll_tok_s_median')}; "
              f"PCIe RX {((d1.get('nvml') or {}).get('pcie_rx_mb_s_mean'))} MB/s;"
              f" error {r.get('error')}", flush=True)
        (args.out / "llamacpp_gpu.json").write_text(json.dumps(result, indent=1, default=str))
    result["elapsed_s"] = time.monotonic() - t_start
    (args.out / "llamacpp_gpu.json").write_text(json.dumps(result, indent=1, default=str))
    (args.out / "llamacpp_gpu.md").write_text(render_md(result, args))
    print((args.out / "llamacpp_gpu.md").read_text())
    return 0


def _f(v, fmt="{:.1f}") -> str:
    return "—" if v is None else fmt.format(v)


def render_md(res: dict, args) -> str:
    gpu = (res.get("hardware") or {}).get("gpu") or {}
    rows = ["| placement | MoE layers' experts in RAM | layers on GPU (log) | model on GPU / host (MiB) | "
            "1-user decode tok/s (engine · panel poll) | "
            f"{args.users}-user total tok/s | prefill tok/s | PCIe RX MB/s during decode (mean / max) | "
            "PCIe RX MB/s during prefill (mean / max) | GPU util % (1 user) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res.get("runs", []):
        if r.get("skipped"):
            rows.append(f"| {r['config']} | skipped: {r['skipped']} |||||||||")
            continue
        d1 = r.get("decode_1") or {}
        dn = r.get(f"decode_{args.users}") or {}
        pf = r.get("prefill") or {}
        n1, npf = d1.get("nvml") or {}, pf.get("nvml") or {}
        pl = r.get("placement_log") or {}
        eng = (d1.get("engine_tok_s_each") or [None])[0]
        rows.append(
            f"| {r['config']} | {len(r.get('cpu_layers') or [])} | {_f(r.get('moe_layers_on_gpu'), '{}')} | "
            f"{_f(pl.get('model_gpu_mib'), '{:,.0f}')} / {_f(pl.get('model_host_mib'), '{:,.0f}')} | "
            f"{_f(eng)} · {_f(d1.get('panel_poll_tok_s_median'))} | {_f(dn.get('total_tok_s_wall'))} | "
            f"{_f(pf.get('prompt_tok_s'))} | {_f(n1.get('pcie_rx_mb_s_mean'))} / {_f(n1.get('pcie_rx_mb_s_max'))} | "
            f"{_f(npf.get('pcie_rx_mb_s_mean'))} / {_f(npf.get('pcie_rx_mb_s_max'))} | "
            f"{_f(n1.get('gpu_util_pct_mean'))} |" + (f" error: {r['error']}" if r.get("error") else ""))
    model = res.get("model") or {}
    head = [f"# llama.cpp placement on {gpu.get('name', 'no GPU')}", "",
            f"Run {res.get('started')} on {res.get('host')}; model {model.get('bytes', 0) / 1e9:.2f} GB "
            f"({model.get('config', {}).get('n_layer')} MoE layers × {model.get('config', {}).get('n_expert')} "
            f"experts, {model.get('config', {}).get('n_expert_used')} used, F16); planner: {res.get('planner')}; "
            f"VRAM {gpu.get('vram_total_bytes', 0) / 2**30:.1f} GiB; decode {args.tokens} tokens (1 user), "
            f"{args.tokens // 2} each ({args.users} users); prefill ~{args.prompt_tokens} tokens.", "",
            f"Command: `{' '.join(res.get('command', []))}`", ""]
    return "\n".join(head + rows) + "\n"


if __name__ == "__main__":
    sys.exit(main())
