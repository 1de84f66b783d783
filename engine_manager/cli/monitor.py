"""``dsv41 monitor [--once] [--json] [--csv FILE] [--hz N] [--seconds S]``: live samples from the running engine.

Finds the engine the way ``dsv41 status`` does (the supervisor's state file), else ``--url``/``--engine`` or the
settings' address. Prints one line per tick (or one JSON object per line with ``--json``); ``--csv FILE`` also
writes every tick to FILE (header + rows, flushed each tick). Missing figures print as ``—`` (``null`` in JSON,
an empty cell in CSV), never 0; prefill while no prompt is being read prints as "last prefill" (the last
request's). Exit 0; 1 when no engine answers (or something that is not an engine answers, said in plain words);
130 on Ctrl+C.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from .. import metrics as M
from ..metrics.record import _fmt, fmt_t, iso

GiB = float(1024**3)


def register(sub) -> None:
    p = sub.add_parser("monitor", help="print live samples from the running engine",
                       description="Poll the running engine, the GPU driver and the host at the monitor's rate and "
                                   "print one line per sample: decode/prefill tok/s, GPU hit rate, expert swaps, "
                                   "PCIe, VRAM, RAM, CPU, GPU. Missing figures print as —.")
    p.add_argument("--once", action="store_true", help="print one sample and exit")
    p.add_argument("--json", action="store_true", help="one JSON object per line instead of text")
    p.add_argument("--csv", metavar="FILE", help="also write every sample to FILE as CSV (all columns)")
    p.add_argument("--hz", type=float, default=None,
                   help="samples per second, 0.25 to 10 (default: the metrics_hz setting)")
    p.add_argument("--seconds", type=float, default=None, metavar="S", help="stop after S seconds")
    p.add_argument("--url", help="the engine's base URL (default: the running engine, else the settings' address)")
    p.add_argument("--engine", choices=("strata", "llamacpp", "sim"),
                   help="which adapter reads it (default: the running engine's, else the settings')")
    p.set_defaults(func=run)


def _engine_status(settings) -> Any:
    try:
        from ..supervisor import Supervisor
    except ImportError:
        return None
    try:
        st = Supervisor(settings).status()
    except Exception:
        return None
    return st if getattr(st, "base_url", None) and getattr(st, "state", None) in ("ready", "starting") else None


def fmt_line(tick: M.Tick) -> str:
    v = tick.values

    def f(name: str, fmt: str = "{:.1f}", scale: float = 1.0, unit: str = "") -> str:
        x = v.get(name)
        if x is None or not math.isfinite(x):
            return "—"
        return (fmt.format(x * scale) + unit)

    def pair(a: str, b: str) -> str:
        if v.get(a) is None:
            return "—"
        tot = f" / {v[b] / GiB:.0f}" if v.get(b) is not None else ""
        return f"{v[a] / GiB:.1f}{tot} GiB"

    # prefill while no prompt is being read is the last request's, not a live rate: say so
    prefill = "last prefill" if tick.notes.get("prefill_live") is False else "prefill"
    users = f"users {f('slots_busy', '{:.0f}')}"
    idle = v.get("slots_busy") == 0
    if idle:
        users += " (idle)"
    # nothing decodes while every slot is idle: no rate (a window still emptying read "decode 10.1 tok/s … idle")
    decode = "—" if idle else f('decode_tok_s', unit=' tok/s')
    parts = [
        time.strftime("%H:%M:%S", time.localtime(tick.t)),
        f"decode {decode}",
        f"{prefill} {f('prefill_tok_s', '{:.0f}', unit=' tok/s')}",
        users,
        f"hit {f('hit_rate', '{:.1f}', 100, '%')} (rolling {f('hit_rate_rolling', '{:.1f}', 100, '%')})",
        f"swaps {f('swaps_per_s', '{:.2f}', unit='/s')} {f('swap_mb_s', '{:.0f}', unit=' MB/s')}",
        f"PCIe rx {f('pcie_rx_mb_s', '{:.0f}', unit=' MB/s')}",
        f"VRAM {pair('vram_used_bytes', 'vram_total_bytes')}",
        f"RAM {pair('ram_used_bytes', 'ram_total_bytes')}",
        (f"CPU bound {f('cpu_bound_pct', '{:.0f}', unit='%')} rest {f('cpu_rest_pct', '{:.0f}', unit='%')}"
         if v.get("cpu_bound_pct") is not None else f"CPU {f('cpu_total_pct', '{:.0f}', unit='%')}"),
        f"GPU {f('gpu_util_pct', '{:.0f}', unit='%')}",
    ]
    if tick.simulated:
        parts.append("[simulated]")
    return "  ".join(parts)


def tick_json(tick: M.Tick) -> dict[str, Any]:
    snap = tick.notes.get("steady")
    cur = getattr(snap, "current", None)
    steady = None if cur is None else {"users": cur.users, "total_tok_s": round(cur.total_tok_s, 3),
                                       "each_tok_s": round(cur.each_tok_s, 3), "basis": cur.basis()}
    return {"t": round(tick.t, 3), "time": iso(tick.t), "engine": tick.engine, "simulated": tick.simulated,
            "state": tick.notes.get("state"), "model": tick.notes.get("model"),
            "prefill_live": tick.notes.get("prefill_live"), "steady_decode": steady,
            "last_reply_tok_s": getattr(snap, "last_reply_tok_s", None),
            "predicted_hit_rate": tick.predicted_hit_rate, "missing": tick.missing,
            "values": {k: (None if x is None or not math.isfinite(x) else x) for k, x in tick.values.items()}}


class _CsvOut:
    def __init__(self, path: Path):
        self.f: TextIO = open(path, "w", encoding="utf-8", newline="")
        self.f.write(",".join(("t", "time", *M.COLUMN_NAMES)) + "\n")

    def write(self, tick: M.Tick) -> None:
        self.f.write(",".join((fmt_t(tick.t), iso(tick.t),
                               *(_fmt(tick.values.get(c)) for c in M.COLUMN_NAMES))) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def run(args, ctx) -> int:
    settings = ctx.settings
    st = None if args.url else _engine_status(settings)
    base_url = args.url or (st.base_url if st is not None else settings.base_url)
    engine = args.engine or (st.engine if st is not None and st.engine else None)
    if engine is None:
        from ..hardware import probe
        try:
            from ..settings import resolve_engine
            engine = resolve_engine(settings, probe(settings.cache_path).has_gpu)
        except Exception:
            engine = "sim"
    hz = M.clamp_hz(args.hz if args.hz is not None else settings.metrics_hz)
    if args.hz is not None and not (0.25 <= args.hz <= 10):
        print(f"dsv41 monitor: --hz {args.hz} is outside 0.25–10; use a rate in that range.", file=sys.stderr)
        return 2
    if not args.url:
        # the monitor's requests carry the API key: only to the engine the panel started (or `dsv41 sim`), never
        # to a program that took the port after that engine died (--url is the user's own call)
        from ..chat import ChatError, check_target
        try:
            check_target(settings, base_url, settings.api_key)
        except ChatError as exc:
            print(f"dsv41 monitor: {exc}", file=sys.stderr)
            return 1
    hub = M.build_hub(engine, base_url, settings.api_key, spec=getattr(st, "spec", None),
                      pid=getattr(st, "pid", None), binding=getattr(st, "binding", None),
                      log_path=getattr(st, "log_path", None) or None, gpu_index=settings.gpu_index, hz=hz,
                      record=False, argv=getattr(st, "argv", None),
                      plan=st.plan() if st is not None and hasattr(st, "plan") else None)
    csv_out = _CsvOut(Path(args.csv)) if args.csv else None
    deadline = time.monotonic() + args.seconds if args.seconds else None
    printed = 0
    try:
        for tick in hub.iter_ticks():
            if "engine" in tick.missing and printed == 0 and tick.seq >= 2:
                why = tick.missing["engine"]
                if why.startswith("nothing answers"):
                    print(f"dsv41 monitor: no engine answers at {base_url} (connection refused). Start one with "
                          "`dsv41 start`, or pass --url.", file=sys.stderr)
                else:
                    print(f"dsv41 monitor: cannot read an engine: {why}.", file=sys.stderr)
                return 1
            if args.once and tick.seq == 1:
                continue            # rates need two readings: the first one only primes them
            if args.json:
                print(json.dumps(tick_json(tick)), flush=True)
            else:
                print(fmt_line(tick), flush=True)
            if csv_out is not None:
                csv_out.write(tick)
            printed += 1
            if args.once or (deadline is not None and time.monotonic() >= deadline):
                break
    finally:
        hub.stop()
        if csv_out is not None:
            csv_out.close()
    return 0
