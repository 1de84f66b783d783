"""What the Monitor's "now" cards and status line show, and ``dsv41 monitor``'s line: computed from a
:class:`~engine_manager.metrics.hub.Tick` (and the hub that made it), with no Qt, so the GUI cards, the CLI and the
tests read the same words.

Each card is a :class:`CardText`: the big value (with its unit), a line of detail, whether it is simulated, a
tooltip and whether the value is *stale* (not a live reading: the last request's, or the engine stopped). Missing
is "—", never 0.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .columns import MAX_SLOTS, SLOT_COLUMNS
from ..engines import find_engine
from ..fmt import GIB, nice_ceil

if TYPE_CHECKING:
    from .hub import Tick      # annotations only: the hub brings numpy

DASH = "—"

# (key, title) of the cards, in the order the Monitor lays them out
CARDS: tuple[tuple[str, str], ...] = (
    ("decode", "Decode"), ("prefill", "Prefill"), ("hit", "Picks in VRAM"), ("swaps", "Expert swaps"),
    ("pcie", "PCIe"), ("vram", "VRAM"), ("ram", "RAM"), ("cpu", "CPU"), ("gpu", "GPU"),
    ("engine", "Engine process"))

# a card's title in full, where the card says it short (its tooltip)
CARD_TITLES_IN_FULL = {"hit": "Expert picks served from VRAM"}

PREFILL_SLOTS_NOTE = ("All slots together: Strata and the scripted engine report no per-slot prefill, so none is "
                      "drawn.")
STOPPED_TIP = "The engine is not running: no live figures."


# How much time the plots show while the run is younger than their window: the shortest of these spans (seconds)
# longer than the run, each 1.25–1.5× the one before, so after a step the readings fill 2/3 of the width or more.
# The time axis is laid out again at each step, and every plot drawn again (~22 ms of the GUI thread on this
# project's 2-core machine, benchmarks/results/panel_cpu.md): 10 steps in a 10-minute window's first 10 minutes
# and 1 between a run's 5th and 35th second, where rounding the span up to a sixth of the age made 36 and 7.
YOUNG_SPANS_S: tuple[float, ...] = (30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 240.0, 300.0, 450.0, 600.0, 900.0,
                                    1200.0, 1800.0, 2700.0, 3600.0, 5400.0, 7200.0, 10800.0, 14400.0, 21600.0,
                                    43200.0, 86400.0)


def follow_range(first: float, now: float, window_s: float | None) -> tuple[float, float]:
    """The time range (x0, x1) of plots that follow the newest reading, from the times of the oldest (``first``)
    and newest (``now``) readings kept and the window (``window_s``; None: everything). The right edge moves in
    steps, not on every tick, so between steps the axes and the grid stay as painted and only the curves change:

    * a run older than the window: the window, its right edge advancing in steps of 1/30 of it (a chart
      recorder's jump);
    * a younger run: from its first reading over the shortest of :data:`YOUNG_SPANS_S` longer than its age, at
      most the window;
    * everything: from the first reading, the right edge advancing in "nice" steps of about a tenth of the age.
    """
    if window_s is None:
        step = nice_ceil(max(60.0, now - first) / 10.0)
        return first, math.ceil((now + 1e-6) / step) * step
    step = max(1.0, window_s / 30.0)
    x1 = math.ceil((now + 1e-6) / step) * step
    if first <= x1 - window_s:
        return x1 - window_s, x1
    age = now - first
    return first, first + next((s for s in YOUNG_SPANS_S if age < s < window_s), window_s)


@dataclass(frozen=True)
class CardText:
    value: str
    detail: str = ""
    simulated: bool = False
    tip: str = ""
    stale: bool = False                 # not a live reading (the last request's, or the engine stopped): greyed


@dataclass(frozen=True)
class PlacementFeed:
    """What the Monitor tells the Placement tab about the running engine: the plan it runs and its routing trace
    (``counts`` None), or observed routing counts (layers × experts)."""
    plan: Mapping[str, Any] | None = None
    trace: str | None = None
    counts: Any = None


def fmt_value(v: float | None, fmt: str = "{:.1f}", unit: str = "") -> str:
    if v is None or not math.isfinite(v):
        return DASH
    s = fmt.format(v)
    return f"{s} {unit}".strip()


def gib_pair(used: float | None, total: float | None) -> str:
    if used is None:
        return DASH
    if total is None:
        return f"{used / GIB:.1f} GiB"
    return f"{used / GIB:.1f} / {total / GIB:.0f} GiB"


def origin_words(origin: str | None) -> str:
    return {"simulated": "modelled by the scripted engine", "driver": "GPU driver (NVML)",
            "engine": "reported by the engine"}.get(origin or "", "")


def is_idle(values: Mapping[str, float | None]) -> bool:
    """No slot busy: nothing decodes, whatever a window still emptying says."""
    return values.get("slots_busy") == 0


def state_text(tick: Tick) -> str:
    st = tick.sample.state if tick.sample is not None else None
    return f"state: {st}" if st else ""


def decode_tip(tick: Tick, last_reply: float | None) -> str:
    window = find_engine(tick.engine).live_rate_window_s        # 0: the adapter rates over the poll interval
    per = f"{1.0 / tick.hz:g} s poll interval" if window <= 0 else f"last {window:g} s (the engine's window)"
    tip = (f"Tokens generated per second over the {per}, all slots together. A reply shorter than that is "
           "averaged with the idle time around it, so a short burst reads lower than the chat's own figure.")
    if last_reply is not None:
        tip += f" The newest finished reply decoded at {last_reply:,.1f} tok/s by the engine's own timing."
    return tip


def slots_total(tick: Tick) -> int | None:
    """How many slots the engine has (the per-slot plot shows that many curves); None when unknown."""
    total = tick.values.get("slots_total")
    return None if total is None else min(MAX_SLOTS, int(total))


def slot_columns(n: int) -> set[str]:
    return {SLOT_COLUMNS[i] for i in range(min(MAX_SLOTS, int(n)))}


def cards(tick: Tick) -> dict[str, CardText]:
    """Every card's text for one tick."""
    v = tick.values
    sim = tick.simulated
    miss = tick.missing
    out: dict[str, CardText] = {}

    def why(source: str) -> str:
        return f"missing: {miss[source]}" if source in miss else ""

    dec, pre = v.get("decode_tok_s"), v.get("prefill_tok_s")
    busy, total = v.get("slots_busy"), v.get("slots_total")
    slots = (f"{busy:.0f}/{total:.0f} slots busy" if busy is not None and total is not None
             else f"{busy:.0f} slot{'' if busy == 1 else 's'} busy" if busy is not None else "")
    q = v.get("queued")
    if q:
        slots += f" · {q:.0f} queued"
    snap = tick.notes.get("steady")
    last_reply = getattr(snap, "last_reply_tok_s", None)
    idle = is_idle(v)
    if idle:
        slots = f"idle · last reply {last_reply:,.0f} tok/s" if last_reply is not None else "idle"
    # nothing decodes while every slot is idle: no rate, whatever a window still emptying says ("48.1 tok/s
    # · idle" read as a live rate); the last reply's own figure is in the detail line
    out["decode"] = CardText(DASH if idle else fmt_value(dec, "{:.1f}", "tok/s"), slots, sim,
                             why("engine") or decode_tip(tick, last_reply))
    live = tick.notes.get("prefill_live")
    state = state_text(tick)
    # not live: the last request's rate, said in the value itself (the value changes every tick anyway;
    # a title that changed would relay the card out)
    pre_text = fmt_value(pre, "{:.0f}", "tok/s")
    progress = prompt_progress(tick)
    out["prefill"] = CardText(
        pre_text if live is not False or pre is None else f"last {pre_text}",
        progress or (state if live is not False else
                     f"last request · {state.removeprefix('state: ')}".rstrip(" ·")),
        sim,
        why("engine") or ("Prompt tokens read per second, live while a prompt is read: this prompt's own rate "
                          "(— until it is known), never the previous request's. " + PREFILL_SLOTS_NOTE
                          if live is not False else
                          "No prompt is being read now: this is the last request's prompt rate, not a live one; "
                          "the Throughput plot leaves a gap here. " + PREFILL_SLOTS_NOTE),
        stale=live is False)
    out["hit"] = hit_card(tick, why("engine") or why("log"))
    sw, swmb, swt = v.get("swaps_per_s"), v.get("swap_mb_s"), v.get("swaps_total")
    det = fmt_value(swmb, "{:.0f}", "MB/s")
    if swt is not None:
        det += f" · {swt:,.0f} total"
    if "swap_mb_s" in tick.origin and tick.origin["swap_mb_s"].startswith("estimate"):
        det += " (est.)"
    out["swaps"] = CardText(fmt_value(sw, "{:.2f}", "/s"), det,
                            sim and tick.origin.get("swaps_per_s") == "simulated",
                            "; ".join(x for x in (why("engine"), why("log")) if x))
    rx, tx = v.get("pcie_rx_mb_s"), v.get("pcie_tx_mb_s")
    gen_, width = v.get("gpu_pcie_gen"), v.get("gpu_pcie_width")
    link = f" · gen {gen_:.0f} ×{width:.0f}" if gen_ is not None and width is not None else ""
    out["pcie"] = CardText(f"RX {fmt_value(rx, '{:.0f}', 'MB/s')}", f"TX {fmt_value(tx, '{:.0f}', 'MB/s')}{link}",
                           tick.origin.get("pcie_rx_mb_s") == "simulated", why("gpu"))
    vu, vt = v.get("vram_used_bytes"), v.get("vram_total_bytes")
    out["vram"] = CardText(gib_pair(vu, vt), origin_words(tick.origin.get("vram_used_bytes")),
                           tick.origin.get("vram_used_bytes") == "simulated",
                           "; ".join(x for x in (why("gpu"), why("engine")) if x))
    ru, rt = v.get("ram_used_bytes"), v.get("ram_total_bytes")
    out["ram"] = CardText(gib_pair(ru, rt), "host (psutil)", False, why("host"))
    cb, cr, ct = v.get("cpu_bound_pct"), v.get("cpu_rest_pct"), v.get("cpu_total_pct")
    if cb is not None:
        out["cpu"] = CardText(f"bound {fmt_value(cb, '{:.0f}', '%')}",
                              f"rest {fmt_value(cr, '{:.0f}', '%')} · all {fmt_value(ct, '{:.0f}', '%')}",
                              False, why("host"))
    else:
        out["cpu"] = CardText(f"all {fmt_value(ct, '{:.0f}', '%')}", "engine not bound to a node", False,
                              why("host") or "The engine runs without a NUMA binding, so there is no bound/rest "
                              "split.")
    gu, pw, tc = v.get("gpu_util_pct"), v.get("gpu_power_w"), v.get("gpu_temp_c")
    out["gpu"] = CardText(fmt_value(gu, "{:.0f}", "%"),
                          "no NVIDIA GPU" if "gpu" in miss and gu is None
                          else f"{fmt_value(pw, '{:.0f}', 'W')} · {fmt_value(tc, '{:.0f}', '°C')}",
                          False, why("gpu"))
    rss, ecpu = v.get("engine_rss_bytes"), v.get("engine_cpu_pct")
    out["engine"] = CardText(fmt_value(None if rss is None else rss / GIB, "{:.2f}", "GiB"),
                             f"CPU {fmt_value(ecpu, '{:.0f}', '%')} of a core",
                             False, why("host") or str(tick.notes.get("engine_process", "")))
    gone = tick.notes.get("not_exported") or {}
    for key, col in CARD_COLUMNS.items():
        if col in gone:
            out[key] = CardText(DASH, NOT_EXPORTED, False, not_exported_tip(gone[col]))
    return out


NOT_EXPORTED = "not exported by this engine"
#: the figure each card shows first (cards): a card whose figure the engine does not export says so
CARD_COLUMNS = {"decode": "decode_tok_s", "prefill": "prefill_tok_s", "hit": "vram_share", "swaps": "swaps_per_s",
                "pcie": "pcie_rx_mb_s", "vram": "vram_used_bytes"}


def not_exported_tip(why: str) -> str:
    return f"Not exported by this engine ({why}): no figure is shown rather than a 0 or an empty line."


def plot_notes(tick: Tick, plots: Mapping[str, Iterable[str]]) -> dict[str, str]:
    """Plot key → a line saying the engine does not export what the plot draws (with why), for each plot of
    ``plots`` (key → the columns it draws) with no figure now and at least one series the engine does not export
    (the others missing for their own reasons, e.g. no GPU); a plot with a figure gets none."""
    gone = tick.notes.get("not_exported") or {}
    out: dict[str, str] = {}
    for key, cols in plots.items():
        cols = list(cols)
        if any(c in gone for c in cols) and all(c in gone or tick.values.get(c) is None for c in cols):
            whys = list(dict.fromkeys(gone[c] for c in cols if c in gone))
            out[key] = f"{NOT_EXPORTED.capitalize()}: {'; '.join(whys[:2])}."
    return out


def pct(x: float | None) -> str:
    return fmt_value(None if x is None else x * 100, "{:.1f}", "%")


def short_pct(x: float | None) -> str:
    return DASH if x is None or not math.isfinite(x) else f"{x * 100:.1f}%"


# what each hit-rate figure measures, in the words every view uses (the Monitor, the Placement tab, the planner)
PLANNER_MEANS = "predicted on the planning traffic"
OBSERVED_MEANS = "observed VRAM share over the last minute"
PLACEMENT_MEANS = "share of all observed picks that fall in the planned set"
ENGINE_HIT_MEANS = ("the engine's own hit rate: GPU hits / expert lookups, which leave out the experts read over "
                    "PCIe")
SCOPE_WORDS = {"request": "last request", "admission": "last admission", "batch": "last batch, all slots"}


def hit_scope(tick: Tick) -> str | None:
    """What the newest observed figure covers: "request" (one finished request's decode), "batch" (the engine's
    batch windows, all slots together), "admission" (a batched request's own figure: its prompt and first
    token only, Strata's ``requests[].hit_rate`` with 2+ slots), or None (a live figure, or none)."""
    log_hit = tick.notes.get("log_hit")
    if tick.origin.get("vram_share") == "log" and isinstance(log_hit, dict):
        return str(log_hit.get("scope") or "request")
    hx = getattr(tick.sample, "extra", None) or {}
    if tick.values.get("vram_share") is not None and hx.get("hit_rate_scope"):
        return str(hx["hit_rate_scope"])
    return None


def hit_difference_line(tick: Tick) -> str:
    """One line that says why the planner's prediction and the observed VRAM share differ, when they do
    (more than 3 points); "" otherwise."""
    pred = tick.predicted_hit_rate
    obs = tick.values.get("hit_rate_rolling")
    if obs is None:
        obs = tick.values.get("vram_share")
    if pred is None or obs is None or abs(pred - obs) <= 0.03:
        return ""
    return f"Planner {pct(pred)} vs observed {pct(obs)}: other prompts than planned."


def hit_card(tick: Tick, missing_why: str = "") -> CardText:
    """The observed share of routed expert picks served from VRAM — what the planner predicts — beside the
    planner's prediction, the PCIe share and the engine's own hit rate, each said by name."""
    v = tick.values
    vs, roll, ps, pred = v.get("vram_share"), v.get("hit_rate_rolling"), v.get("pcie_share"), tick.predicted_hit_rate
    hx = getattr(tick.sample, "extra", None) or {}
    engine_hr = v.get("log_hit_rate") if tick.origin.get("vram_share") == "log" else None
    if engine_hr is None:
        engine_hr = v.get("hit_rate") if v.get("hit_rate") is not None else hx.get("hit_rate_last")
    scope = hit_scope(tick)
    admission = scope == "admission"
    # a layer-placing engine's figure is its placement's (llama.cpp: the share of MoE layers on the GPU): live,
    # never "last"
    stale = not find_engine(tick.engine).places_layers and vs is not None and (scope is not None
                                                                                or v.get("slots_busy") == 0)
    value = pct(vs)
    if stale and vs is not None:
        value = f"{SCOPE_WORDS.get(scope or 'request', 'last')} {value}"
    # compact: two lines of a card ~140 px wide at the smallest window; each figure is named in full in the tip
    line1 = f"plan {short_pct(pred)} · 1 min {short_pct(roll)}"
    line2 = f"hit rate {short_pct(engine_hr)}" + (" (admission)" if admission else
                                                   f" · PCIe {short_pct(ps)}" if ps is not None else "")
    whose = SCOPE_WORDS.get(scope or "", "now")
    tip = (f"Value: the share of all routed expert picks served from VRAM, observed ({whose}"
           f"; {tick.origin.get('vram_share', 'no figure yet')}). Strata's hit rate leaves the experts read over PCIe "
           "out of its lookups, so this is hit rate × (1 − PCIe share).\n"
           f"planner {pct(pred) if pred is not None else 'unknown'}: {PLANNER_MEANS}. 1 min {pct(roll)}: "
           f"{OBSERVED_MEANS}. hit rate {pct(engine_hr)}: {ENGINE_HIT_MEANS}. PCIe {pct(ps)}: the share of routed "
           "picks the GPU read over PCIe."
           + ("\nWith 2+ slots a finished request's own figures (its hit rate, its PCIe share) cover only its "
              "admission: its prompt and first token; the engine log's batch line covers the decode of all slots."
              if admission else ""))
    diff = hit_difference_line(tick)
    if diff:
        tip += "\n" + diff
    return CardText(value, f"{line1}\n{line2}", tick.simulated, missing_why or tip, stale=stale)


def prompt_progress(tick: Tick) -> str:
    """While a prompt is read: "read 12,288 of 98,179 tokens" (that prompt's, never the previous request's);
    "" otherwise."""
    s = tick.sample
    if s is None or s.state != "reading":
        return ""
    read, total = s.extra.get("prompt_read"), s.extra.get("prompt_total")
    if isinstance(read, int) and isinstance(total, int) and total > 0:
        return f"reading: {read:,} of {total:,} tokens ({100 * read / total:.0f}%)"
    return "reading the prompt"


def engine_notes(tick: Tick | None) -> list[str]:
    """What the engine said the user should know (its log: e.g. "parallel requests: 4 asked, the engine runs
    2")."""
    notes = tick.notes.get("engine_notes") if tick is not None else None
    return [str(n) for n in notes] if isinstance(notes, list) else []


def stopped_cards() -> dict[str, CardText]:
    """Nothing is live any more: every card shows "—" and says so."""
    return {key: CardText(DASH, "engine stopped", False, STOPPED_TIP, stale=True) for key, _ in CARDS}


def status_text(hub: Any, tick: Tick | None, *, compact: bool = False) -> tuple[str, str | None]:
    """The Monitor's status line for a running ``hub`` (engine, rate, recording, what is missing) and its tooltip
    (the whole line and the whole recording path; None when nothing is recorded). ``compact`` (the window, where
    the rate is in its own box beside the line): no rate, and "recording" without the file (in the tooltip)."""
    parts = [f"{hub.engine}" + (" (simulated)" if hub.simulated else "") + ("" if compact else f" · {hub.hz:g} Hz")]
    recording = hub.recorder is not None and not hub.record_error
    if recording:
        # the run's folder and file; the whole path is in the tooltip
        csv = hub.recorder.csv_path
        parts.append("recording" if compact else f"recording to {csv.parent.name}/{csv.name}")
    if hub.record_error:
        parts.append(hub.record_error)
    # a source that cannot work on this machine (no NVIDIA GPU) is said on its card, not here every tick
    never = {s.name for s in hub.sources if s.unavailable}
    missing = {k: v for k, v in (tick.missing.items() if tick is not None else ()) if k not in never}
    parts.extend(f"engine: {n}" for n in engine_notes(tick))
    if missing:
        parts.append("missing: " + "; ".join(f"{k} ({v})" for k, v in sorted(missing.items())))
    text = " · ".join(parts)
    return text, (f"{text}\n\nRecording: {hub.recorder.csv_path}" if recording else None)


def unreachable_words(name: str, state: str, reason: str, last_seen: float | None, *,
                      now: float | None = None) -> tuple[str, str]:
    """A watched saved connection that cannot be used now: (short, whole) — "unreachable, last seen 14:02:11"
    and "gpu-box is unreachable: <reason>. Last seen answering at 14:02:11." ``state`` "unreachable" (nothing
    answered) or "problem" (something answered and said no: "not usable")."""
    word = "unreachable" if state == "unreachable" else "not usable"
    reason = reason.strip().rstrip(".") or "no reason was given"
    if not last_seen:
        return f"{word}, not seen yet", f"{name} is {word}: {reason}. Not seen answering since it was saved."
    when = time.strftime(
        "%H:%M:%S" if (time.time() if now is None else now) - last_seen < 20 * 3600 else "%Y-%m-%d %H:%M",
        time.localtime(last_seen))
    return f"{word}, last seen {when}", f"{name} is {word}: {reason}. Last seen answering at {when}."


def unreachable_cards(name: str, state: str, reason: str, last_seen: float | None) -> dict[str, CardText]:
    """Every card while the watched connection ``name`` cannot be used: "—" (no figure of this engine, and never
    one of another), "unreachable, last seen …" under it, the reason in the tooltip — not "engine stopped"."""
    short, whole = unreachable_words(name, state, reason, last_seen)
    return {key: CardText(DASH, short, False, whole, stale=True) for key, _ in CARDS}


def stopped_status(had_ticks: bool) -> str:
    # short: a longer one fit no status row
    return "Engine stopped. Ctrl+E exports the run." if had_ticks else "Not collecting: no engine is running."


def text_line(tick: Tick) -> str:
    """One line per tick, as ``dsv41 monitor`` prints it."""
    v = tick.values

    def f(name: str, fmt: str = "{:.1f}", scale: float = 1.0, unit: str = "") -> str:
        x = v.get(name)
        if x is None or not math.isfinite(x):
            return DASH
        return fmt.format(x * scale) + unit

    gone = tick.notes.get("not_exported") or {}
    # prefill while no prompt is being read is the last request's, not a live rate: say so
    prefill = "last prefill" if tick.notes.get("prefill_live") is False else "prefill"
    users = f"users {f('slots_busy', '{:.0f}')}"
    idle = is_idle(v)
    if idle:
        users += " (idle)"
    # nothing decodes while every slot is idle: no rate (a window still emptying read "decode 10.1 tok/s … idle")
    decode = DASH if idle else f("decode_tok_s", unit=" tok/s")
    parts = [
        time.strftime("%H:%M:%S", time.localtime(tick.t)),
        f"decode {decode}",
        f"{prefill} {f('prefill_tok_s', '{:.0f}', unit=' tok/s')}" + (f" ({prompt_progress(tick)})"
                                                                        if prompt_progress(tick) else ""),
        users,
        "in VRAM not exported" if "vram_share" in gone else
        f"in VRAM {f('vram_share', '{:.1f}', 100, '%')} (1 min {f('hit_rate_rolling', '{:.1f}', 100, '%')}, "
        f"planner {'—' if tick.predicted_hit_rate is None else f'{tick.predicted_hit_rate * 100:.1f}%'}, "
        f"PCIe {f('pcie_share', '{:.1f}', 100, '%')}, engine hit {f('hit_rate', '{:.1f}', 100, '%')})",
        "swaps not exported" if "swaps_per_s" in gone else
        f"swaps {f('swaps_per_s', '{:.2f}', unit='/s')} {f('swap_mb_s', '{:.0f}', unit=' MB/s')}",
        f"PCIe rx {f('pcie_rx_mb_s', '{:.0f}', unit=' MB/s')}",
        f"VRAM {gib_pair(v.get('vram_used_bytes'), v.get('vram_total_bytes'))}",
        f"RAM {gib_pair(v.get('ram_used_bytes'), v.get('ram_total_bytes'))}",
        (f"CPU bound {f('cpu_bound_pct', '{:.0f}', unit='%')} rest {f('cpu_rest_pct', '{:.0f}', unit='%')}"
         if v.get("cpu_bound_pct") is not None else f"CPU {f('cpu_total_pct', '{:.0f}', unit='%')}"),
        f"GPU {f('gpu_util_pct', '{:.0f}', unit='%')}",
    ]
    if tick.simulated:
        parts.append("[simulated]")
    return "  ".join(parts)
