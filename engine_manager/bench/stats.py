"""Small statistics for repeated measurements: median and spread, ratios with their range."""

from __future__ import annotations

import math
import statistics
from typing import Any, Iterable


def summary(values: Iterable[float | None]) -> dict:
    """``{"median", "min", "max", "spread", "n", "values"}``; ``spread`` is (max − min) / median (0 for one value).
    None values are left out; no values → medians None."""
    v = [f for f in (measured(x, lo=None) for x in values) if f is not None]
    if not v:
        return {"median": None, "min": None, "max": None, "spread": None, "n": 0, "values": []}
    med = statistics.median(v)
    return {"median": med, "min": min(v), "max": max(v),
            "spread": (max(v) - min(v)) / med if med else None, "n": len(v), "values": v}


def ratio(a: dict, b: dict) -> dict:
    """``a`` against ``b`` (two :func:`summary` dicts): the ratio of the medians and the widest range the repeats
    allow (min a / max b .. max a / min b)."""
    if not a.get("median") or not b.get("median"):
        return {"ratio": None, "low": None, "high": None}
    return {"ratio": a["median"] / b["median"],
            "low": a["min"] / b["max"] if b["max"] else None,
            "high": a["max"] / b["min"] if b["min"] else None}


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


def finite_json(obj: Any, _depth: int = 0) -> Any:
    """``obj`` with every non-finite float replaced by None (missing), so the document can be written with
    ``allow_nan=False`` (strict JSON: no ``Infinity`` / ``NaN`` that other readers refuse). Nesting deeper than 200
    levels is cut to None (no result document is that deep)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if _depth > 200:
        return None
    if isinstance(obj, dict):
        return {k: finite_json(v, _depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v, _depth + 1) for v in obj]
    return obj
