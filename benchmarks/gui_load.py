"""What the Monitor tab costs, measured side by side in one run.

1. **Event-loop stall**: the Monitor view with 24 h of history at 10 Hz already loaded (864,000 rows × every column;
   labelled synthetic rows — this measures drawing, not an engine) while all six plots update at 10 Hz for
   ``--seconds`` (60 by default). The updates come the way the app's do: a ``MetricsHub`` at 10 Hz ticking on a
   worker thread (``app.workers.run_generator``), each tick reaching the view through the worker's signal, into
   the same store; only its source is synthetic (a labelled stand-in for the engine, no HTTP). A 1 ms probe timer
   records every gap in the event loop; the longest gap beyond its interval is the longest stall. Goal: ≤ 16 ms.
   The time spent in one redraw is printed beside it (the part the view itself owns; a stall may also come from
   the OS on a shared machine). Meanwhile the engine column's overview strip polls ``--overview``
   saved connections to a scripted engine every second on a worker (``--overview 0``: without it, as before).
2. **The panel's own CPU** at the default rate (1 Hz): the Monitor view collecting from a real scripted engine
   under 4 streaming chats (the chats run in another process), against the same view not collecting, in this
   process. Goal: ≤ 2% of one core.
3. **Engine speed with the panel polling vs not**: the scripted engine's tokens per second (its own counter)
   in alternating phases — not polled, polled at 1 Hz — in one run, ratio of the means. Goal: ≥ 0.99. A pair at
   10 Hz is printed as a stress figure. The counter (Strata's ``totals.output_tokens``, as the scripted engine
   keeps it) grows when a request ends, so a phase must hold several requests' ends: with 3-s phases two runs
   read 0.3996 and 0.3988 (56.9 tok/s "polled" both times), with 10-s phases 1.14.

Run: ``xvfb-run -a -s "-screen 0 1600x1000x24" .venv/bin/python benchmarks/gui_load.py [--seconds 60]``
(``--seconds 10`` for a quick look; ``--seconds 3 --cpu-seconds 3 --phase-seconds 2 --pairs 1
--history-hours 1`` only checks that it runs). Prints the figures; exit 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="length of the 10 Hz stall run (default 60)")
    p.add_argument("--cpu-seconds", type=float, default=None, help="length of each CPU phase (default seconds/2)")
    p.add_argument("--phase-seconds", type=float, default=10.0,
                   help="length of each on/off speed phase (at least 10 s: the engine's counter moves when a request "
                   "ends)")
    p.add_argument("--pairs", type=int, default=3, help="off/on pairs at 1 Hz (default 3)")
    p.add_argument("--users", type=int, default=4, help="concurrent streaming chats (default 4)")
    p.add_argument("--history-hours", type=float, default=24.0,
                   help="history loaded before the stall run (default 24; less only to check the script runs)")
    p.add_argument("--part", choices=("all", "stall", "engine"), default="all",
                   help="run one part in this process (all: each part in a fresh process, one after the other)")
    p.add_argument("--overview", type=int, default=3, metavar="N",
                   help="during the stall run, the engine column's overview strip polls N saved "
                        "connections to a scripted engine every second (5× the panel's rate) beside the view; 0: "
                        "no overview (as the panel was before the overview strip, app.connections_view.OverviewStrip)")
    p.add_argument("--no-gc-freeze", dest="gc_freeze", action="store_false",
                   help="skip the gc.freeze() that app/main.py does once the window is built (a full collection "
                        "of the main window's ~120,000 objects takes ~90 ms): to see what it buys")
    return p.parse_args()


def main() -> int:
    args = parse()
    if args.part == "all":
        # each part in a fresh process, so what one leaves behind (objects, threads) does not bill the other
        base = [sys.executable, __file__, *[a for a in sys.argv[1:] if not a.startswith("--part")]]
        print(f"host: {psutil.cpu_count()} CPUs, load average "
              f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
        rc = 0
        for part in ("stall", "engine"):
            rc |= subprocess.call([*base, "--part", part])
        print(f"\nload average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
        return rc
    tmp = Path(tempfile.mkdtemp(prefix="dsv41-guiload-"))
    os.environ["DSV41_CONFIG_DIR"] = str(tmp / "config")
    os.environ["DSV41_DATA_DIR"] = str(tmp / "data")
    for k in [k for k in os.environ if k.startswith("DSV41_") and k not in ("DSV41_CONFIG_DIR", "DSV41_DATA_DIR")]:
        del os.environ[k]

    from PySide6.QtCore import QEventLoop, QTimer
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance() or QApplication([sys.argv[0]])

    def wait(ms: float) -> None:
        loop = QEventLoop()
        QTimer.singleShot(int(ms), loop.quit)
        loop.exec()

    print(f"[part {args.part}] Qt platform {app.platformName()}", flush=True)

    if args.part == "stall":
        return part_stall(args, app, wait)
    return part_engine(args, app, wait)


class SyntheticSource:
    """TEST DATA for the stall run: a stand-in for the engine that answers at once with levels near ``fill``
    (the raw columns the hub derives the plotted ones from), half of every 2 s reading a prompt."""

    name = "bench"
    timeout_s = 1.0
    unavailable = None

    def __init__(self, fill: dict[str, float], seed: int = 41):
        self.fill = fill
        self.columns = (*fill, "slots_busy", "slots_total")
        self.rng = np.random.default_rng(seed)
        self.n = 0

    def read(self):
        from engine_manager.engines.base import Sample
        from engine_manager.metrics import Reading

        self.n += 1
        level = np.fromiter(self.fill.values(), dtype=float)
        row = dict(zip(self.fill, level * (1 + 0.05 * self.rng.standard_normal(level.size))))
        row["slots_busy"], row["slots_total"] = 4.0, 4.0
        state = "reading" if self.n % 20 < 10 else "generating"       # the prefill card: live / last request
        return Reading(row, payload=Sample(t=time.time(), engine="bench", state=state))

    def close(self) -> None:
        pass


def part_stall(args, app, wait) -> int:
    from PySide6.QtCore import QElapsedTimer, Qt, QTimer

    from app.context import AppContext
    from app.monitor_view import MonitorView
    from engine_manager import metrics as M
    from engine_manager.settings import load_settings
    from engine_manager.engine_state import RunningEngine

    # -- 1. stall --------------------------------------------------------------------------------------------------
    ctx = AppContext(load_settings())
    view = MonitorView(ctx)
    view.resize(1100, 760)          # the Monitor tab's share of a 1600 × 1000 window
    view.show()
    overview = overview_sim = None
    if args.overview > 0:
        overview, overview_sim = start_overview(args.overview, wait)
    wait(300)
    hz = 10.0
    store = M.RingStore(M.COLUMN_NAMES, hz=hz)
    now = time.time()
    n = int(args.history_hours * 3600 * hz)
    t = now - (n - 1) / hz + np.arange(n) / hz
    rng = np.random.default_rng(41)
    base = np.full(len(M.COLUMN_NAMES), np.nan, dtype=np.float32)
    ix = store.index
    # the plotted columns, as the history holds them (the hub derives them from the raw ones below)
    fill = {"decode_tok_s": 120, "prefill_tok_s": 400, "prefill_live_tok_s": 400, "slot0_tok_s": 30,
            "slot1_tok_s": 30, "slot2_tok_s": 30, "slot3_tok_s": 30, "hit_rate": 0.9, "hit_rate_rolling": 0.9,
            "swaps_per_s": 2, "swap_mb_s": 25, "pcie_rx_mb_s": 800, "vram_used_bytes": 95e9,
            "vram_total_bytes": 96e9, "ram_used_bytes": 200e9, "ram_total_bytes": 280e9,
            "engine_ram_used_bytes": 190e9, "engine_rss_bytes": 180e9, "cpu_bound_pct": 85, "cpu_rest_pct": 5,
            "cpu_total_pct": 45, "gpu_util_pct": 95, "slots_busy": 4, "slots_total": 4}
    cols = [ix[c] for c in fill]
    level = np.array(list(fill.values()), dtype=np.float32)
    t0 = time.perf_counter()
    chunk = 86_400
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        vals = np.tile(base, (b - a, 1))
        vals[:, cols] = level * (1 + 0.05 * rng.standard_normal((b - a, len(cols))).astype(np.float32))
        vals[(np.arange(a, b) % 20) >= 10, ix["prefill_live_tok_s"]] = np.nan    # prefill live half the time
        store.extend(t[a:b], vals)
    load_s = time.perf_counter() - t0
    print(f"\n1. history: {args.history_hours:g} h at {hz:g} Hz = {n:,} rows × {len(M.COLUMN_NAMES)} columns loaded "
          f"in {load_s:.1f} s ({store.nbytes / 2**20:.0f} MiB in the ring buffers) — labelled synthetic rows")

    raw = {"decode_tok_s": 120, "prefill_tok_s": 400, "slot0_tok_s": 30, "slot1_tok_s": 30, "slot2_tok_s": 30,
           "slot3_tok_s": 30, "hit_rate": 0.9, "engine_swaps_per_s": 2, "engine_swap_mb_s": 25,
           "engine_pcie_rx_mb_s": 800, "engine_vram_used_bytes": 95e9, "engine_vram_total_bytes": 96e9,
           "ram_used_bytes": 200e9, "ram_total_bytes": 280e9, "engine_ram_used_bytes": 190e9,
           "engine_rss_bytes": 180e9, "cpu_bound_pct": 85, "cpu_rest_pct": 5, "cpu_total_pct": 45,
           "gpu_util_pct": 95}
    if args.gc_freeze:
        import gc
        gc.collect()
        gc.freeze()
        print("   gc.freeze() after the build, as app/main.py does (--no-gc-freeze to leave it out)")

    def start_hub() -> None:
        """The app's path from here on: MonitorView._hub_made starts the hub's generator on a worker thread and
        takes every tick through the worker's signal (MonitorView._on_tick)."""
        hub = M.MetricsHub([SyntheticSource(raw)], hz, store=store, engine="bench", simulated=False)
        info = RunningEngine("synthetic (no engine)", "", engine="bench", label="synthetic", numa_bound=True,
                             started_by_panel=False)
        view._hub_made((hub, store, info, n))

    print("   updates: a MetricsHub at 10 Hz on a worker thread (run_generator), ticks through its signal to the "
          "view — the app's path; the hub's source is synthetic")

    redraw_ms: list[float] = []
    orig_step = view._redraw_step

    def timed_step():
        s = time.perf_counter()
        orig_step()
        redraw_ms.append((time.perf_counter() - s) * 1000)

    view._step_timer.timeout.disconnect()
    view._step_timer.timeout.connect(timed_step)

    def measure(seconds: float) -> dict[str, float]:
        """Probe the event loop every 1 ms: per gap, the wall time (what a user feels) and this thread's CPU time
        within it (the work the panel did; wall − CPU is time the OS gave to other processes)."""
        gaps: list[tuple[float, float]] = []
        clock = QElapsedTimer()
        clock.start()
        last = [clock.nsecsElapsed(), time.thread_time()]

        def probe() -> None:
            nowns, cpu = clock.nsecsElapsed(), time.thread_time()
            gaps.append(((nowns - last[0]) / 1e6, (cpu - last[1]) * 1000))
            last[0], last[1] = nowns, cpu

        probe_t = QTimer()
        probe_t.setTimerType(Qt.TimerType.PreciseTimer)
        probe_t.setInterval(1)
        probe_t.timeout.connect(probe)
        redraw_ms.clear()
        probe_t.start()
        wait(seconds * 1000)
        probe_t.stop()
        g = np.asarray(gaps[50:])                 # skip the first 50 ms
        wall = g[:, 0] - 1.0
        return {"stall": float(wall.max()), "p999": float(np.percentile(wall, 99.9)),
                "p99": float(np.percentile(wall, 99)), "busy": float(g[:, 1].max()),
                "busy_p999": float(np.percentile(g[:, 1], 99.9))}

    def step_ms() -> str:
        return f"{statistics.mean(redraw_ms):.1f} ms mean over {len(redraw_ms)} steps" if redraw_ms else "no steps"

    view.store = store
    view.set_window_index(1)                  # the default window, 10 min
    wait(500)
    quiet = min(10.0, args.seconds)
    floor = measure(quiet)
    print(f"   noise floor (same view, no updates, {quiet:g} s): longest stall {floor['stall']:.1f} ms "
          f"(99.9th pct {floor['p999']:.1f} ms) — what this machine's other load does to an idle event loop")
    start_hub()
    ticks0 = view.last_tick.seq if view.last_tick else 0
    m = measure(args.seconds)
    ticks = (view.last_tick.seq if view.last_tick else 0) - ticks0
    print(f"   window 10 min, 6 plots at {hz:g} Hz for {args.seconds:g} s ({ticks} ticks arrived): longest "
          f"event-loop stall {m['stall']:.1f} ms wall (goal ≤ 16 ms; 99.9th pct {m['p999']:.1f} ms, 99th "
          f"{m['p99']:.1f} ms); longest stretch of the panel's own work (CPU time within one stall) "
          f"{m['busy']:.1f} ms (99.9th pct {m['busy_p999']:.1f} ms); one plot's step {step_ms()} "
          f"({view._redraws} full redraws)")
    for i, label in ((2, "1 h"), (3, f"all ({args.history_hours:g} h)")):
        view.set_window_index(i)
        wait(300)
        m = measure(max(min(5.0, args.seconds), args.seconds / 6))
        print(f"   window {label}: longest stall {m['stall']:.1f} ms wall (99.9th pct {m['p999']:.1f} ms); own work "
              f"{m['busy']:.1f} ms CPU (99.9th pct {m['busy_p999']:.1f} ms); one plot's step {step_ms()}")
    view.shutdown()
    view.close()
    view.deleteLater()
    view.store = None
    if overview is not None:
        print(f"   the overview strip beside it: {overview.polls} polls of {args.overview} connection(s) shown "
              "(each on a worker thread, its lines updated on the GUI thread)")
        overview.shutdown()
        overview_sim.stop()
    wait(200)

    return 0


def start_overview(n: int, wait, period_s: float = 1.0):
    """The engine column's overview strip, polling ``n`` saved connections (all to one scripted engine started
    here) every second: what watching several boxes adds to the GUI thread."""
    from app.connections_view import OverviewStrip
    from engine_manager import connections as C
    from engine_manager.sim.launch import SimProcess

    sim = SimProcess(["--slots", "4"]).start()
    sim.wait_ready()
    for i in range(n):
        C.add_connection(f"box{i}", sim.base_url, sim.api_key)
    strip = OverviewStrip(period_s=period_s)
    conns = C.load_connections()
    strip.set_names([c.name for c in conns], conns)      # the records too: a line without one is never polled
    strip.resize(300, 200)
    strip.show()
    strip.poll()
    for _ in range(100):
        if strip.polls:
            break
        wait(50)
    print(f"   overview: {n} saved connection(s) to a scripted engine, polled every {period_s:g} s on a worker "
          f"(the panel: every {C.OVERVIEW_PERIOD_S:g} s); first poll shown: {strip.polls > 0}")
    return strip, sim


def part_engine(args, app, wait) -> int:
    from app.context import AppContext
    from app.monitor_view import MonitorView
    from engine_manager import metrics as M
    from engine_manager.engines import get_engine
    from engine_manager.engine_state import RunningEngine
    from engine_manager.settings import load_settings
    from engine_manager.sim.launch import SimProcess

    # -- 2 and 3: a real scripted engine -------------------------------------------------------------------------
    sim = SimProcess(["--slots", str(max(1, args.users))]).start()
    load = None
    try:
        sim.wait_ready()
        load_code = textwrap.dedent(f"""
            import threading, httpx, time
            def run(i):
                with httpx.Client(timeout=60) as c:
                    while True:
                        try:
                            with c.stream("POST", {sim.url('/v1/chat/completions')!r},
                                          headers={{"Authorization": "Bearer {sim.api_key}"}},
                                          json={{"messages": [{{"role": "user", "content": "topic %d" % i}}],
                                                "stream": True, "max_tokens": 400}}) as r:
                                for _ in r.iter_lines():
                                    pass
                        except httpx.HTTPError:
                            time.sleep(0.2)
            for i in range({args.users}):
                threading.Thread(target=run, args=(i,), daemon=True).start()
            while True:
                time.sleep(3600)
        """)
        load = subprocess.Popen([sys.executable, "-c", load_code], start_new_session=True)
        eng = get_engine("sim")
        spec = M.spec_for(eng, sim.base_url, sim.api_key)
        import httpx

        client = httpx.Client(timeout=5)

        def tokens() -> tuple[float, int]:
            s = eng.poll(client, spec, None)
            return time.monotonic(), int(s.tokens_generated_total or 0)

        # the engine column's overview strip is on, as in the panel: N saved connections at the panel's own rate
        overview = overview_sim = None
        if args.overview > 0:
            from engine_manager import connections as C
            overview, overview_sim = start_overview(args.overview, wait, C.OVERVIEW_PERIOD_S)
        ctx2 = AppContext(load_settings())
        ctx2.update_settings({"metrics_hz": 1.0})
        view2 = MonitorView(ctx2)
        view2.resize(1100, 760)
        view2.show()
        me = psutil.Process()
        wait(3000)                              # the chats reach steady state

        import threading

        main_tid = threading.main_thread().native_id

        def thread_cpu() -> dict[int, float]:
            return {t.id: t.user_time + t.system_time for t in me.threads()}

        def cpu_phase(seconds: float) -> tuple[float, float]:
            """(% of one core for the whole process, of which the GUI thread) over ``seconds``."""
            a, ta = me.cpu_times(), thread_cpu()
            w = time.monotonic()
            wait(seconds * 1000)
            b, tb = me.cpu_times(), thread_cpu()
            dt = time.monotonic() - w
            gui = (tb.get(main_tid, 0.0) - ta.get(main_tid, 0.0)) / dt * 100.0
            return 100.0 * ((b.user - a.user) + (b.system - a.system)) / dt, gui

        def start_polling(rate: float) -> None:
            if abs(ctx2.settings.metrics_hz - rate) > 1e-9:
                ctx2.update_settings({"metrics_hz": rate})
            ctx2.set_running(RunningEngine.from_status(None, sim.base_url, sim.api_key, engine="sim"))
            for _ in range(100):
                if view2.hub is not None:
                    break
                wait(50)

        def stop_polling() -> None:
            ctx2.set_running(None)
            for _ in range(100):
                if not view2._stopping:
                    break
                wait(50)

        cpu_s = args.cpu_seconds or max(10.0, args.seconds / 2)
        idle, idle_gui = cpu_phase(cpu_s)
        start_polling(1.0)
        wait(5000)                              # first ticks, hub threads up, first full redraws
        busy, busy_gui = cpu_phase(cpu_s)
        ticks = view2.last_tick.seq if view2.last_tick else 0
        stop_polling()
        print(f"\n2. panel CPU at the default rate (1 Hz), the Monitor collecting from the scripted engine under "
              f"{args.users} chats for {cpu_s:g} s: {busy:.2f}% of one core (goal ≤ 2%) — GUI thread "
              f"{busy_gui:.2f}%, collector threads {busy - busy_gui:.2f}%; the same view not collecting: "
              f"{idle:.2f}% ({ticks} ticks)" + (f"; the overview strip polling {args.overview} connection(s) "
                                                f"beside it ({overview.polls} lines shown)" if overview else ""))
        if overview is not None:
            overview.shutdown()
            overview_sim.stop()

        def speed_phase(seconds: float) -> float:
            t1, n1 = tokens()
            wait(seconds * 1000)
            t2, n2 = tokens()
            return (n2 - n1) / (t2 - t1)

        offs, ons = [], []
        for _ in range(max(1, args.pairs)):
            offs.append(speed_phase(args.phase_seconds))
            start_polling(1.0)
            ons.append(speed_phase(args.phase_seconds))
            stop_polling()
        ratio = statistics.mean(ons) / statistics.mean(offs)
        print(f"\n3. scripted engine, {args.users} users, {len(offs)} × ({args.phase_seconds:g} s not polled, "
              f"{args.phase_seconds:g} s polled at 1 Hz):")
        print(f"   not polled {', '.join(f'{x:.1f}' for x in offs)} tok/s; polled "
              f"{', '.join(f'{x:.1f}' for x in ons)} tok/s → ratio {ratio:.4f} (goal ≥ 0.99)")
        off10 = speed_phase(args.phase_seconds)
        start_polling(10.0)
        on10 = speed_phase(args.phase_seconds)
        stop_polling()
        print(f"   stress: not polled {off10:.1f} tok/s, polled at 10 Hz {on10:.1f} tok/s → ratio "
              f"{on10 / off10:.4f}")
        view2.shutdown()
        client.close()
    finally:
        if load is not None:
            try:
                os.killpg(load.pid, 9)
            except ProcessLookupError:
                pass
            load.wait(5)
        sim.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
