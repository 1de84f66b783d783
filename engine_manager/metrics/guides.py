"""The deepseek-one-gpu guides' published figures, and a comparison of the live numbers against them.

Figures (ENGINE_CONTRACT.md §1; one 96 GB RTX PRO 6000, DeepSeek-V4.1-Flash Q2_K, NUMA-bound):

- 1 user: 63.11 tok/s; 4 users: 127.58 tok/s total, 31.87 tok/s the slowest; 8 users: 152.53 tok/s total,
  about 19 tok/s each;
- about 9 in 10 expert picks hit the GPU;
- NUMA binding took 1 user from about 53 to 63 tok/s.

The guides measured 1, 4 and 8 users only; other counts are interpolated linearly between them and labelled so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# users → (total tok/s, per-user tok/s: the slowest at 4, "about 19 each" at 8)
GUIDE_TABLE: dict[int, tuple[float, float]] = {1: (63.11, 63.11), 4: (127.58, 31.87), 8: (152.53, 19.0)}
GUIDE_HIT_RATE = 0.9
GUIDE_UNBOUND_1_USER = 53.0
GUIDE_HOST = "one 96 GB RTX PRO 6000, NUMA-bound"
AS_PUBLISHED = 0.90        # at least 90% of the guides' figure counts as "performs as published"


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
    verdict: str = "unknown"               # idle | as_published | below | unknown
    headline: str = ""
    hints: list[str] = field(default_factory=list)
    simulated: bool = False


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
    if c.guide_kind == "interpolated":
        c.hints.append(f"The guides measured 1, 4 and 8 users; the figure for {n} is interpolated.")
    return c
