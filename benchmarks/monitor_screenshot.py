"""A picture of the main window with the scripted engine under load from 4 concurrent streaming chats (the
Monitor's acceptance screenshot): every Monitor plot should be moving with sensible values.

It runs the real flow: the engine panel plans and starts the scripted engine through the supervisor (4 slots;
the engine fills its hot set from the plan, which was made from the engine's own routing distribution, so the
observed hit rate sits by the planner's predicted line), the Monitor tab starts collecting when the engine is
ready, 4 chats stream through httpx (replies of different lengths, users pausing between questions, so the busy
slots vary), and after ``--seconds`` the window is grabbed to a PNG. Every third question of the first user carries
a document of about ``--long-prompt-tokens`` tokens (default 2,000; the sim reads it in ~3 s, pausing the others'
decoding as the engine does, so the prefill curve — drawn only while a prompt is read — shows at the 1 Hz rate;
short questions are read between two polls).
``--cold`` starts the hot set random instead (``--initial-hot random``): the adaptive tier then swaps experts
while you watch (the PCIe swaps plot moves) and the hit rate climbs, for minutes, towards the prediction; without
it the warm hot set swaps little. Everything runs in temporary config/data folders; the engine is stopped at the
end. What moved is printed (how many ticks had decode, prefill, swaps), and the guides card's verdict.

Run: ``xvfb-run -a -s "-screen 0 1600x1000x24" .venv/bin/python benchmarks/monitor_screenshot.py
[--seconds 45] [--cold] [--long-prompt-tokens 2000] [--out monitor.png]``
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine_manager.sim.launch import free_port  # noqa: E402


TOPIC_QUESTIONS = (
    ("How does expert offload work between the GPU and RAM?", "Why do some experts stay in VRAM?",
     "What happens on a miss in the expert cache?"),
    ("How should I bind the engine to the GPU's NUMA node?", "How much host RAM does this machine need?",
     "Which CPU threads should the engine use on this host?"),
)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=45.0, help="how long the load runs before the picture")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "monitor_4_chats.png"))
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--hz", type=float, default=1.0, help="the monitor's rate (the metrics_hz setting)")
    p.add_argument("--cold", action="store_true", help="start with a random hot set (swaps while you watch)")
    p.add_argument("--size", default="1600x1000", help="window size WxH (default 1600x1000)")
    p.add_argument("--long-prompt-tokens", type=int, default=2000,
                   help="every third question of the first user carries a document this long (0: none)")
    p.add_argument("--topics", action="store_true",
                   help="the adaptive tier's demo: users ask about two topics (expert offload, then the host's NUMA "
                        "setup), switching together every --topic-every seconds, so the adaptive hot set swaps")
    p.add_argument("--topic-every", type=float, default=60.0)
    p.add_argument("--placement-out", default=None, help="also grab the Placement tab to this PNG at the end")
    args = p.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="dsv41-shot-"))
    port = free_port()
    for k in [k for k in os.environ if k.startswith("DSV41_")]:
        del os.environ[k]
    os.environ.update({"DSV41_CONFIG_DIR": str(tmp / "config"), "DSV41_DATA_DIR": str(tmp / "data"),
                       "DSV41_CACHE_DIR": str(tmp / "cache"), "DSV41_PORT": str(port),
                       "DSV41_SLOTS": str(args.users), "DSV41_SERVER_ENGINE": "sim",
                       "DSV41_SIM_ARGS": "--initial-hot random" if args.cold else ""})

    import httpx
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication

    app = QApplication([sys.argv[0]])
    from app.context import AppContext
    from app.main_window import MainWindow
    from engine_manager.settings import load_settings

    loaded = load_settings()
    ctx = AppContext(loaded)
    ctx.update_settings({"metrics_hz": args.hz})
    win = MainWindow(ctx)
    w, h = (int(x) for x in args.size.lower().split("x"))
    win.resize(w, h)
    win.show()
    win.show_tab("Monitor")
    stop = threading.Event()
    tokens = [0]
    from engine_manager.sim.corpus import count_tokens

    sentence = "The expert cache keeps the most used experts of every layer in VRAM and streams the rest. "
    document = ""
    while args.long_prompt_tokens > 0 and count_tokens(document) < args.long_prompt_tokens:
        document += sentence * 50
    moved = {"decode": 0, "prefill": 0, "swaps": 0, "ticks": 0}

    def count_moved(tick) -> None:
        v = tick.values
        moved["ticks"] += 1
        for key, col in (("decode", "decode_tok_s"), ("prefill", "prefill_live_tok_s"), ("swaps", "swaps_per_s")):
            if (v.get(col) or 0) > 0:
                moved[key] += 1

    win.monitor_view.tickShown.connect(count_moved)

    def chat(i: int, base: str, key: str) -> None:
        turn = 0
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                turn += 1
                question = f"Explain topic {i} briefly."
                if args.topics:
                    phase = int((time.monotonic() - t_start[0]) // args.topic_every) % 2
                    question = TOPIC_QUESTIONS[phase][(turn + i) % len(TOPIC_QUESTIONS[phase])]
                if document and i == 0 and turn % 3 == 1:
                    question = f"Summarise this document for topic {i}:\n\n{document}"
                try:
                    with c.stream("POST", base + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                  json={"messages": [{"role": "user", "content": question}],
                                        "stream": True, "max_tokens": 120 + 60 * i}) as r:
                        for line in r.iter_lines():
                            if stop.is_set():
                                break
                            if line.startswith("data: {"):
                                tokens[0] += 1
                except httpx.HTTPError:
                    time.sleep(0.2)
                time.sleep(0.3 * i)          # users pause between questions: busy slots vary

    started = [False]
    t_start = [time.monotonic()]

    def on_ready(base: str, key: str) -> None:
        if started[0]:
            return
        started[0] = True
        t_start[0] = time.monotonic()
        print(f"engine ready at {base}; {args.users} chats start", flush=True)
        for i in range(args.users):
            threading.Thread(target=chat, args=(i, base, key), daemon=True).start()
        QTimer.singleShot(int(args.seconds * 1000), shoot)

    def shoot() -> None:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        win.grab().save(str(out))
        if args.placement_out:
            win.show_tab("Placement")
            QTimer.singleShot(1500, lambda: (win.grab().save(str(args.placement_out)),
                                             print(f"saved {args.placement_out}", flush=True)))
        t = win.monitor_view.last_tick
        print(f"saved {out} ({win.width()}×{win.height()}); {tokens[0]} streamed chunks; last tick: "
              f"decode {t.values['decode_tok_s'] if t else None} tok/s, hit {t.values['hit_rate'] if t else None}",
              flush=True)
        print(f"ticks with a value above 0: decode {moved['decode']}, prefill (live) {moved['prefill']}, "
              f"swaps {moved['swaps']} of {moved['ticks']}", flush=True)
        c = getattr(win.monitor_view, "last_comparison", None)
        if c is not None:
            print(f"guides card: {c.verdict} — {c.headline} [{c.basis}]", flush=True)
        stop.set()
        QTimer.singleShot(2500 if args.placement_out else 100, finish)

    def finish() -> None:
        t0 = time.monotonic()
        win.monitor_view.shutdown()
        sup = ctx.supervisor
        if sup is not None:
            for _ev in sup.stop():
                pass
        print(f"engine stopped in {time.monotonic() - t0:.1f} s", flush=True)
        # let the workers whose generators just ended report back, then leave; exit(), not quit(): quit() first
        # asks the window to close (and the engine panel to confirm)
        QTimer.singleShot(800, lambda: app.exit(0))

    ctx.ownEngineChanged.connect(lambda r: r is not None and on_ready(r.base_url, r.api_key))
    QTimer.singleShot(500, ctx.requestStart.emit)
    QTimer.singleShot(int((args.seconds + 120) * 1000), finish)      # never hang
    app.exec()
    # The picture is saved and the engine stopped: leave without Python's teardown, in which the window's
    # wrappers go in no set order — a pyqtgraph GraphicsView then got a resizeEvent after its scene was gone and the
    # process died with SIGSEGV (3 runs in 8, faulthandler: GraphicsView.setRange from resizeEvent).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
