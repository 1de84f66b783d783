"""Small statistics for repeated measurements: median and spread, ratios with their range."""

from __future__ import annotations

import statistics
from typing import Iterable


def summary(values: Iterable[float | None]) -> dict:
    """``{"median", "min", "max", "spread", "n", "values"}``; ``spread`` is (max − min) / median (0 for one value).
    None values are left out; no values → medians None."""
    v = [float(x) for x in values if x is not None]
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
