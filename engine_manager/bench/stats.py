"""Small statistics for repeated measurements: median and spread, ratios with their range."""

from __future__ import annotations

import math
import statistics
from typing import Any, Iterable

from ..figures import measured, measured_int  # noqa: F401 - their one home; re-exported for the bench


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
