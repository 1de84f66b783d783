"""What a number read from a server or a file may be before it is shown as measured: finite, and within what the
quantity can be (a rate, a count, a size or a duration is never negative). A server's impossible number
(``1e999``, NaN, ``-7`` users, an integer past what a float holds) is *missing*, never a figure and never a crash.

The one home of these checks: the bench's statistics (:mod:`engine_manager.bench.stats`), the engine adapters'
parsers (:mod:`engine_manager.engines`) and the Monitor's sample mapping (:mod:`engine_manager.metrics.sources`).
"""

from __future__ import annotations

import math
from typing import Any


def measured(x: Any, lo: float | None = 0.0, hi: float | None = None) -> float | None:
    """``x`` as a figure, or None (missing) when it is not one: not a number, not finite (``1e999``, NaN), or
    outside what the quantity can be (``lo``/``hi``; a rate, a count or a duration is never negative). A server's
    impossible number is missing, never shown as measured."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    try:
        v = float(x)
    except (OverflowError, ValueError):
        return None
    if not math.isfinite(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
        return None
    return v


def measured_int(x: Any, lo: int = 0, hi: int = 1 << 40) -> int | None:
    """A count (tokens, …) as an int, or None when it is not a whole number within ``lo``..``hi``."""
    if isinstance(x, bool):
        return None
    if isinstance(x, float):
        if not math.isfinite(x) or x != int(x):
            return None
        x = int(x)
    if not isinstance(x, int) or not lo <= x <= hi:
        return None
    return x


__all__ = ["measured", "measured_int"]
