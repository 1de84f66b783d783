"""Chat pane rendering with 8 conversations streaming at once from the scripted engine (a real process).

Measures the time from a chunk's arrival (parsed off the socket on the stream's worker thread) to its text being in
its conversation's QTextDocument (GUI thread), for all 8 conversations: median, p99 and max. Goal:
median ≤ 10 ms. The pane shows one conversation at a time and draws a hidden one when it is shown (a document that
is not shown still lays out every insert), so the shown conversation changes every ``--switch-s`` seconds, round
the 8, as a user clicking through them would: every conversation is on screen for part of its answer, and its
chunks that arrive then are measured into its document. Chunks that arrive while their conversation is hidden are
reported apart, as arrival → held by the pane (they reach the document when it is shown).

Side by side in one run, same engine, same load:

  incremental — what the pane does: append each chunk with one insertText; re-render the on-screen streaming
                message as Markdown at most every 0.3 s (and never more often than 20× its own cost);
  naive       — re-render the streaming message's Markdown on every chunk (what "just call setHtml on update"
                costs).

Also: the SSE parser's cost per event (httpx-sse, kept) beside a bare ``split`` of the same bytes.

    .venv/bin/python benchmarks/chat_latency.py [--streams 8] [--tokens 300] [--speed 1.0] [--switch-s 1.0]
    .venv/bin/python benchmarks/chat_latency.py --quick      # a few seconds: does it run (figures not meaningful)

``--speed 1`` is the sim's modelled speed (8 users share ~152 tok/s, as the guides measured); higher values
stress the pane with more chunks per second. Runs under Xvfb or with QT_QPA_PLATFORM=offscreen (set when there
is no DISPLAY). Exit status: 0 goal met, 1 goal missed, 2 a conversation got no measured chunk (raise --tokens or
lower --switch-s).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

_TMP = tempfile.mkdtemp(prefix="dsv41-chatbench-")
os.environ["DSV41_CONFIG_DIR"] = os.path.join(_TMP, "config")
os.environ["DSV41_DATA_DIR"] = os.path.join(_TMP, "data")
for _k in [k for k in os.environ if k.startswith("DSV41_") and k not in ("DSV41_CONFIG_DIR", "DSV41_DATA_DIR")]:
    del os.environ[_k]
if not os.environ.get("DISPLAY"):
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import QTimer  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    i = min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))
    return s[i]


def summary(ms: list[float]) -> str:
    if not ms:
        return "no samples"
    return (f"median {statistics.median(ms):6.2f} ms   p99 {pct(ms, 0.99):6.2f} ms   max {max(ms):7.2f} ms   "
            f"n={len(ms)}")


def run_pane(app, sim, streams: int, tokens: int, naive: bool, switch_s: float) -> dict:
    from app import chat_pane
    from app.context import AppContext
    from engine_manager.engine_state import RunningEngine
    from engine_manager.settings import load_settings

    original = chat_pane.ConversationDoc.append
    if naive:
        def append_naive(self, live, kind, text, t_arrival):
            if self.stream_start is not None:
                self._pending.append((text, t_arrival))
                self.rerender_tail(live)
        chat_pane.ConversationDoc.append = append_naive
    try:
        os.environ["DSV41_DATA_DIR"] = os.path.join(_TMP, "data-" + ("naive" if naive else "incremental"))
        ctx = AppContext(load_settings())
        pane = chat_pane.ChatPane(ctx)
        pane.resize(520, 900)
        pane.show()
        in_doc: list[list[float]] = [[] for _ in range(streams)]   # per conversation, arrival -> in its document
        hidden: list[float] = []                                     # arrival -> held, while not on screen
        visits = [0] * streams
        convs: list = []                                             # the pane's ConvState of each, in send order
        pane.on_delta_rendered = lambda s, shown: None if shown else hidden.append(s * 1000)
        state = {"t0": None, "t1": None, "phase": "wait-store", "shown": streams - 1, "next_switch": 0.0}

        def switch() -> None:
            for step in range(1, streams + 1):
                i = (state["shown"] + step) % streams
                st = convs[i]
                if st.id is not None and st.stream is not None:
                    if i != state["shown"]:
                        pane.open_conversation(st.id)
                        state["shown"] = i
                        visits[i] += 1
                    return

        def tick():
            now = time.perf_counter()
            if state["phase"] == "wait-store":
                if pane.store is not None:
                    ctx.set_running(RunningEngine.from_status(None, sim.base_url, sim.api_key, engine="sim"))
                    pane.max_tokens.setValue(tokens)
                    for i in range(streams):
                        if i:
                            pane.new_conversation()
                        pane.send(f"Question {i}: explain expert offload, NUMA and PCIe for user {i}")
                        st = pane._current
                        # each conversation's document reports into its own list
                        st.view.probe = lambda s, i=i: in_doc[i].append(s * 1000)
                        convs.append(st)
                    visits[streams - 1] = 1
                    state["t0"] = now
                    state["next_switch"] = now + switch_s
                    state["phase"] = "streaming"
            elif state["phase"] == "streaming":
                if pane.streaming_count() == 0:
                    state["t1"] = now
                    state["phase"] = "done"
                    app.quit()
                    return
                if now >= state["next_switch"]:
                    switch()
                    state["next_switch"] = now + switch_s
            QTimer.singleShot(20, tick)

        QTimer.singleShot(0, tick)
        app.exec()
        stored = pane.store.list_conversations()
        statuses = [pane.store.messages(c.id)[-1].status for c in stored]
        tokens_total = sum((pane.store.messages(c.id)[-1].stats or {}).get("completion_tokens") or 0
                           for c in stored)
        renders = sum(st.view.tail_renders for st in convs)
        render_s = sum(st.view.tail_render_s for st in convs)
        pane.shutdown()
        pane.deleteLater()
        wall = state["t1"] - state["t0"]
        return {"in_doc": in_doc, "hidden": hidden, "visits": visits, "wall_s": wall, "tokens": tokens_total,
                "statuses": statuses, "renders": renders,
                "render_ms_mean": 1000 * render_s / renders if renders else 0}
    finally:
        chat_pane.ConversationDoc.append = original


def sse_parse_cost(n: int = 20000) -> tuple[float, float]:
    import httpx
    from httpx_sse import EventSource

    frame = ("data: " + json.dumps({"id": "chatcmpl-x", "object": "chat.completion.chunk", "model": "m",
                                    "choices": [{"index": 0, "delta": {"content": "word "},
                                                 "finish_reason": None}]}) + "\n\n").encode()
    data = frame * n
    chunks = [data[i:i + 4096] for i in range(0, len(data), 4096)]
    best_lib = best_split = float("inf")
    for _ in range(3):
        resp = httpx.Response(200, headers={"content-type": "text/event-stream"}, content=iter(chunks))
        t = time.perf_counter()
        k = sum(1 for sse in EventSource(resp).iter_sse() if json.loads(sse.data))
        best_lib = min(best_lib, (time.perf_counter() - t) / k)
        t = time.perf_counter()
        k = sum(1 for part in data.split(b"\n\n") if part and json.loads(part[6:]))
        best_split = min(best_split, (time.perf_counter() - t) / k)
    return best_lib * 1e6, best_split * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=300, help="tokens per answer")
    ap.add_argument("--speed", type=float, default=1.0, help="the sim's --speed (1 = modelled speed)")
    ap.add_argument("--switch-s", type=float, default=1.0,
                    help="show the next conversation this often (seconds), so all of them are measured")
    ap.add_argument("--quick", action="store_true",
                    help="a short run to check that it works: 160 tokens, --speed 2, --switch-s 0.15")
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.speed, args.switch_s = 160, 2.0, 0.15

    from chat_support import launch_sim

    app = QApplication.instance() or QApplication([])
    sim = launch_sim("--reply-tokens", str(args.tokens), "--queue", "16", speed=args.speed,
                     slots=min(8, args.streams))
    try:
        print(f"chat_latency: {args.streams} conversations streaming {args.tokens} tokens each from the scripted "
              f"engine (simulated, --speed {args.speed}), pane 520x900, platform {app.platformName()}; the shown "
              f"conversation changes every {args.switch_s:g} s")
        results = {}
        for mode in ("incremental", "naive"):
            r = run_pane(app, sim, args.streams, args.tokens, naive=(mode == "naive"), switch_s=args.switch_s)
            results[mode] = r
            r["all"] = [x for conv in r["in_doc"] for x in conv]
            print(f"\n[{mode}] {r['tokens']} tokens in {r['wall_s']:.1f} s = {r['tokens'] / r['wall_s']:.0f} tok/s "
                  f"across all streams; answers: {', '.join(sorted(set(r['statuses'])))}")
            for i, ms in enumerate(r["in_doc"]):
                print(f"  conversation {i + 1} (on screen {r['visits'][i]}x), arrival -> in its document  "
                      f"{summary(ms)}")
            print(f"  all {args.streams} conversations, arrival -> in the document   {summary(r['all'])}")
            print(f"  while hidden, arrival -> held by the pane (not in a document until shown)  "
                  f"{summary(r['hidden'])}")
            print(f"  Markdown re-renders of on-screen streaming answers: {r['renders']}, "
                  f"mean {r['render_ms_mean']:.2f} ms each")
        inc, nai = results["incremental"]["all"], results["naive"]["all"]
        if inc and nai:
            print(f"\nnaive / incremental, arrival -> in the document, all {args.streams} conversations: "
                  f"median {statistics.median(nai) / statistics.median(inc):.1f}x, "
                  f"p99 {pct(nai, .99) / pct(inc, .99):.1f}x")
        lib_us, split_us = sse_parse_cost(2000 if args.quick else 20000)
        print(f"SSE parse + JSON per event: httpx-sse {lib_us:.1f} µs, bare split {split_us:.1f} µs "
              f"(ratio {lib_us / split_us:.1f}x; a token arrives every ~16 ms at 63 tok/s) -> httpx-sse kept")
        unmeasured = [i + 1 for i, ms in enumerate(results["incremental"]["in_doc"]) if not ms]
        if unmeasured or not inc:
            print(f"\ngoal median <= 10 ms: NOT MEASURED: conversation(s) {unmeasured} got no chunk while on screen "
                  f"(raise --tokens or lower --switch-s)")
            return 2
        med, p99 = statistics.median(inc), pct(inc, 0.99)
        ok = med <= 10.0
        print(f"\ngoal median <= 10 ms (arrival -> in the document, all {args.streams} conversations, incremental): "
              f"{'MET' if ok else 'NOT MET'} (median {med:.2f} ms, p99 {p99:.2f} ms)")
        return 0 if ok else 1
    finally:
        sim.stop()


if __name__ == "__main__":
    sys.exit(main())
