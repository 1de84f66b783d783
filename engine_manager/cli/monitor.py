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
from ..engines import ENGINE_NAMES
from ..metrics import presenter
from ..metrics.record import _fmt, fmt_t, iso
from ..engine_state import RunningEngine


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
    p.add_argument("--connection", metavar="NAME",
                   help="watch a saved connection (`dsv41 connections list`) instead of the panel's engine")
    p.add_argument("--engine", choices=ENGINE_NAMES,
                   help="which adapter reads it (default: the running engine's, else the settings')")
    p.set_defaults(func=run)


def _engine_status(settings) -> Any:
    try:
        from ..session import EngineSession

        st = EngineSession(settings).status()
    except Exception:  # (an ImportError too: no status to show)
        return None
    return st if getattr(st, "base_url", None) and getattr(st, "state", None) in ("ready", "starting") else None


def fmt_line(tick: M.Tick) -> str:
    """One line per tick: the Monitor's words (:func:`engine_manager.metrics.presenter.text_line`)."""
    return presenter.text_line(tick)


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
            "engine_notes": presenter.engine_notes(tick),
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
    attached = None
    if args.connection:
        from .connections import attached_engine
        attached, rc = attached_engine("dsv41 monitor", args.connection, args.url)
        if attached is None:
            return rc
        args.url = attached.base_url
        args.engine = args.engine or attached.engine
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
    # one handle for the engine read: the supervisor's status of it (pid, launch spec, binding, log, the plan it
    # runs with) when it is the engine at that address, else the address and key alone (--url)
    running = attached or RunningEngine.from_status(st, base_url, settings.api_key, engine=engine,
                                                    gpu_index=settings.gpu_index)
    if args.engine and running.engine != args.engine:
        running = running.with_(engine=args.engine)         # --engine is the user's own call
    hub = M.build_hub(running, hz=hz, record=False)
    csv_out = _CsvOut(Path(args.csv)) if args.csv else None
    deadline = time.monotonic() + args.seconds if args.seconds else None
    printed = 0
    said: set[str] = set()
    from ..checks import pid_alive
    from ..watchdog import Watchdog
    watchdog, was = Watchdog(), None          # stalled / unavailable while the process lives (engine_manager.watchdog)
    try:
        for tick in hub.iter_ticks():
            live = watchdog.feed_tick(tick, alive=pid_alive(running.pid) if running.on_this_machine else None)
            if live.state != was and live.alarming and not args.json:
                print(f"engine {live.line()}", flush=True)
            was = live.state
            for note in presenter.engine_notes(tick):
                if note not in said and not args.json:    # the engine's own notes, once each
                    said.add(note)
                    print(f"engine: {note}", flush=True)
            if "engine" in tick.missing and printed == 0 and tick.seq >= 2:
                why = tick.missing["engine"]
                if attached is not None:            # a saved connection (maybe through an SSH forward's socket)
                    print(f"dsv41 monitor: the connection {args.connection!r} stopped answering: {why}. "
                          f"`dsv41 connections test {args.connection}` says more.", file=sys.stderr)
                elif why.startswith("nothing answers"):
                    print(f"dsv41 monitor: no engine answers at {base_url} (connection refused). Start one with "
                          "`dsv41 start`, or pass --url.", file=sys.stderr)
                else:
                    print(f"dsv41 monitor: cannot read an engine: {why}.", file=sys.stderr)
                return 1
            if args.once and tick.seq == 1:
                continue            # rates need two readings: the first one only primes them
            if args.json:
                print(json.dumps({**tick_json(tick), "liveness": live.to_dict()}), flush=True)
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
