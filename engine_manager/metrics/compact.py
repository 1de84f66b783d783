"""The compact view's lines (``app/compact_view.py``): the engine's state, decode tok/s, the share of expert picks
served from VRAM, swaps/s and VRAM, from the Monitor's :class:`~engine_manager.metrics.hub.Tick` — the values of
the Monitor's own cards (:func:`engine_manager.metrics.presenter.cards`), so the two never disagree; a missing
figure is "—", never 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .presenter import DASH, cards, is_idle

if TYPE_CHECKING:
    from .hub import Tick      # annotations only: the hub brings numpy

# (key, label) in the order the view shows them
ROWS: tuple[tuple[str, str], ...] = (("state", "Engine"), ("decode", "Decode"), ("hit", "Picks in VRAM"),
                                     ("swaps", "Expert swaps"), ("vram", "VRAM"))


def empty_figures(state_words: str | None = None) -> dict[str, str]:
    """No live figures (no engine, or it stopped): every line "—" but the state."""
    return {key: (state_words or DASH) if key == "state" else DASH for key, _ in ROWS}


def compact_figures(tick: Tick | None, state_words: str | None = None) -> dict[str, str]:
    """Each row's text for one tick (None: no live figures); ``state_words``: the engine's state as the engine
    column's badge says it."""
    if tick is None:
        return empty_figures(state_words)
    card = cards(tick)
    parts = [state_words] if state_words else []
    if "engine" in tick.missing:
        parts.append("no figures")
    elif tick.sample is not None and tick.sample.state:
        parts.append(str(tick.sample.state))
    if tick.simulated:
        parts.append("simulated")
    decode = card["decode"].value
    return {
        "state": " · ".join(parts) or DASH,
        "decode": f"{DASH} (idle)" if decode == DASH and is_idle(tick.values) else decode,
        "hit": card["hit"].value,
        "swaps": card["swaps"].value,
        "vram": card["vram"].value,
    }


__all__ = ["ROWS", "compact_figures", "empty_figures"]
