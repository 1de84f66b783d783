"""The deepseek-one-gpu guides' published figures, and a comparison of the live numbers against them.

Figures (docs/ENGINE_CONTRACT.md §1; one 96 GB RTX PRO 6000, DeepSeek-V4.1-Flash Q2_K, NUMA-bound):

- 1 user: 63.11 tok/s; 4 users: 127.58 tok/s total, 31.87 tok/s the slowest; 8 users: 152.53 tok/s total,
  about 19 tok/s each;
- about 9 in 10 expert picks hit the GPU;
- NUMA binding took 1 user from about 53 to 63 tok/s.

The guides measured 1, 4 and 8 users only; other counts are interpolated linearly between them and labelled so.

:func:`judge` is what the Monitor's card shows: it judges the *steady* decode rate (see :mod:`.steady`), says
"measuring…" until there is enough of it, and "n/a" for a model that is not the guides' model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .steady import SteadySnapshot

# users → (total tok/s, per-user tok/s: the slowest at 4, "about 19 each" at 8)
GUIDE_TABLE: dict[int, tuple[float, float]] = {1: (63.11, 63.11), 4: (127.58, 31.87), 8: (152.53, 19.0)}
GUIDE_HIT_RATE = 0.9
GUIDE_UNBOUND_1_USER = 53.0
GUIDE_HOST = "one 96 GB RTX PRO 6000, NUMA-bound"
AS_PUBLISHED = 0.90        # at least 90% of the guides' figure counts as "performs as published"
GUIDE_MODEL = "DeepSeek-V4.1-Flash"
_GUIDE_MODEL_RE = re.compile(r"deepseek[-_ .]?v4[-_ .]?1[-_ .]?flash", re.IGNORECASE)


def is_guide_model(name: str | None) -> bool | None:
    """Whether the engine's model is the guides' (DeepSeek-V4.1-Flash, any quantisation, the scripted engine's
    stand-in included); None when the engine did not say which model it runs."""
    if not name:
        return None
    return bool(_GUIDE_MODEL_RE.search(name))


def guide_figures(users: int) -> tuple[float, float, str] | None:
    """(total tok/s, per-user tok/s, 'measured' | 'interpolated') for ``users`` active users, or None."""
    if users in GUIDE_TABLE:
        total, each = GUIDE_TABLE[users]
        return total, each, "measured"
    keys = sorted(GUIDE_TABLE)
    if users < keys[0] or users > keys[-1]:
        return None
    lo = max(k for k in keys if k < users)
    hi = min(k for k in keys if k > users)
    f = (users - lo) / (hi - lo)
    total = GUIDE_TABLE[lo][0] + f * (GUIDE_TABLE[hi][0] - GUIDE_TABLE[lo][0])
    each = GUIDE_TABLE[lo][1] + f * (GUIDE_TABLE[hi][1] - GUIDE_TABLE[lo][1])
    return total, each, "interpolated"


@dataclass
class Comparison:
    users: int | None
    measured_tok_s: float | None
    measured_each_tok_s: float | None
    guide_tok_s: float | None
    guide_each_tok_s: float | None
    guide_kind: str | None                 # measured | interpolated | None
    ratio: float | None                    # measured / guide (total)
    hit_rate: float | None
    guide_hit_rate: float = GUIDE_HIT_RATE
    verdict: str = "unknown"               # idle | measuring | as_published | below | not_comparable | unknown
    headline: str = ""
    hints: list[str] = field(default_factory=list)
    short_hint: str = ""                   # the most relevant hint in a few words (the card's one line)
    simulated: bool = False
    basis: str = ""                        # what the measured figure rests on, in words
    live: bool = True                      # False: the figure is the last steady one (the engine is idle now)
    model: str | None = None


def compare(decode_tok_s: float | None, users: float | None, hit_rate: float | None, *,
            simulated: bool = False, numa_bound: bool | None = None, pcie_gen: float | None = None,
            pcie_width: float | None = None) -> Comparison:
    """Judge the live decode rate (all slots, averaged over a few seconds) and hit rate against the guides'
    figures for the same number of active users. ``numa_bound``: True/False when known, None when not."""
    n = int(round(users)) if users is not None else None
    c = Comparison(users=n, measured_tok_s=decode_tok_s, measured_each_tok_s=None, guide_tok_s=None,
                   guide_each_tok_s=None, guide_kind=None, ratio=None, hit_rate=hit_rate, simulated=simulated)
    if simulated:
        c.hints.append("Simulated: the scripted engine models the guides' table, so this checks the wiring, "
                       "not this host.")
    if n is None or decode_tok_s is None:
        c.verdict = "unknown"
        c.headline = "No live decode rate yet."
        return c
    if n <= 0:
        c.verdict = "idle"
        c.headline = "Idle — start a chat to compare with the guides."
        return c
    c.measured_each_tok_s = decode_tok_s / n
    g = guide_figures(n)
    if g is None:
        c.verdict = "unknown"
        c.headline = f"The guides have no figure for {n} users."
        return c
    c.guide_tok_s, c.guide_each_tok_s, c.guide_kind = g
    c.ratio = decode_tok_s / c.guide_tok_s if c.guide_tok_s else None
    pct = f"{c.ratio * 100:.0f}%" if c.ratio is not None else "?"
    if c.ratio is not None and c.ratio >= AS_PUBLISHED:
        c.verdict = "as_published"
        c.headline = f"Performs as published ({pct} of the guides' figure)."
    else:
        c.verdict = "below"
        c.headline = f"Below the guides: {pct} of their figure."
        # short hints first (the card shows one); the tooltip shows them all
        if numa_bound is False:
            c.hints.append(f"Not bound to the GPU's NUMA node: binding took the guides from ~"
                           f"{GUIDE_UNBOUND_1_USER:.0f} to {GUIDE_TABLE[1][0]:.0f} tok/s at 1 user. Set NUMA "
                           "binding to auto (Settings) and restart the engine.")
        elif numa_bound is None:
            c.hints.append("NUMA binding unknown: binding to the GPU's node took the guides from ~53 to 63 tok/s "
                           "at 1 user; check the engine panel's binding line.")
        if hit_rate is not None and hit_rate < GUIDE_HIT_RATE - 0.05:
            c.hints.append(f"Only {hit_rate * 100:.0f}% of expert picks hit the GPU (guides: ~9 in 10), so more "
                           "experts run on the CPU: re-plan with routing from real traffic, or give the hot set "
                           "more VRAM.")
        if pcie_gen is not None and pcie_width is not None and (pcie_gen < 4 or pcie_width < 16):
            c.hints.append(f"The GPU's PCIe link runs at gen {pcie_gen:.0f} ×{pcie_width:.0f}: swaps and CPU↔GPU "
                           "traffic are slower on a narrow or old link (check the slot and the BIOS).")
        if hit_rate is not None and hit_rate < GUIDE_HIT_RATE - 0.05 and numa_bound is not False:
            # the hit rate explains it better than NUMA when binding is in place or unknown: show it first
            c.hints.sort(key=lambda h: not h.startswith("Only"))
        first = next((h for h in c.hints if not h.startswith("Simulated")), "")
        if first.startswith("Only") and hit_rate is not None:
            c.short_hint = (f"Only {hit_rate * 100:.0f}% of expert picks hit the GPU (guides ~90%): re-plan from "
                            "real traffic or give the hot set more VRAM.")
        elif first.startswith("Not bound"):
            c.short_hint = (f"Not bound to the GPU's NUMA node (binding took the guides from "
                            f"~{GUIDE_UNBOUND_1_USER:.0f} to {GUIDE_TABLE[1][0]:.0f} tok/s): set NUMA to auto.")
        elif first.startswith("NUMA binding unknown"):
            c.short_hint = "NUMA binding unknown (it took the guides from ~53 to 63 tok/s)."
        elif first.startswith("The GPU's PCIe"):
            c.short_hint = f"PCIe link at gen {pcie_gen:.0f} ×{pcie_width:.0f}: check the slot and the BIOS."
    if c.guide_kind == "interpolated":
        c.hints.append(f"The guides measured 1, 4 and 8 users; the figure for {n} is interpolated.")
    return c


def _users(n: int) -> str:
    return f"{n} user{'s' if n != 1 else ''}"


def judge(snap: SteadySnapshot | None, hit_rate: float | None, *, simulated: bool = False,
          numa_bound: bool | None = None, pcie_gen: float | None = None, pcie_width: float | None = None,
          model: str | None = None) -> Comparison:
    """The guides card: the steady decode rate at the current number of users against the guides' figure.

    - the engine runs another model → ``not_comparable`` (the figures are for DeepSeek-V4.1-Flash);
    - idle → ``idle``, with the last steady figure (``live`` False) when there is one;
    - users decoding but not yet enough steady data → ``measuring``;
    - else :func:`compare` on the steady figure."""
    guide_model = is_guide_model(model)
    if snap is None or snap.users_now is None:
        c = compare(None, None, hit_rate, simulated=simulated)
        c.model = model
        if guide_model is False:
            c.verdict = "not_comparable"
            c.headline = f"n/a: the guides' figures are for {GUIDE_MODEL}; this engine runs {model}."
        return c
    n = snap.users_now
    fig = snap.recent() if n >= 1 else snap.latest
    if fig is not None:
        c = compare(fig.total_tok_s, fig.users, hit_rate, simulated=simulated, numa_bound=numa_bound,
                    pcie_gen=pcie_gen, pcie_width=pcie_width)
        c.basis = fig.basis() + (f" (now {_users(n)}; still measuring that)" if n >= 1 and fig.users != n else "")
    else:
        c = Comparison(users=n, measured_tok_s=None, measured_each_tok_s=None, guide_tok_s=None,
                       guide_each_tok_s=None, guide_kind=None, ratio=None, hit_rate=hit_rate, simulated=simulated)
        g = guide_figures(n) if n >= 1 else None
        if g is not None:
            c.guide_tok_s, c.guide_each_tok_s, c.guide_kind = g
    c.model = model
    if guide_model is False:
        c.verdict = "not_comparable"
        c.guide_tok_s = c.guide_each_tok_s = c.guide_kind = c.ratio = None
        c.hints = [h for h in c.hints if h.startswith("Simulated")]
        c.short_hint = ""
        c.live = n >= 1
        c.headline = (f"n/a: the guides' figures are for {GUIDE_MODEL} on {GUIDE_HOST}; this engine runs {model}, "
                      "so there is nothing to compare.")
        return c
    if n <= 0:
        c.live = False
        c.verdict = "idle"
        if fig is None:
            c.headline = "Idle — chat with the engine to compare it with the guides."
        else:
            word = {"as_published": "as published", "below": "below the guides"}.get(
                compare(fig.total_tok_s, fig.users, None).verdict, "")
            pct = f" ({c.ratio * 100:.0f}%)" if c.ratio is not None else ""
            c.headline = (f"Idle. Last steady decode: {fig.total_tok_s:.1f} tok/s at {_users(fig.users)}"
                          f"{' — ' + word + pct if word else ''}.")
            c.hints = [h for h in c.hints if h.startswith("Simulated")]
            c.short_hint = ""
        return c
    if fig is None:
        c.verdict = "measuring"
        c.headline = (f"Measuring… the guides' figures are for a steady decode: {snap.need_s:.0f} s with the same "
                      f"{_users(n)} decoding, or a whole reply of a lone user ({snap.measured_s:.0f} s so far).")
        return c
    return c
