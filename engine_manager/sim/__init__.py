"""The scripted engine (``sim``; the guides' ``mock``): a separate process and a real HTTP server on 127.0.0.1
that speaks Strata's endpoints and models the expert offload, labelled simulated everywhere.

Run it with ``python -m engine_manager.sim --plan PLAN.json --port N --api-key KEY`` (flags: ``__main__``'s
docstring) or ``dsv41 sim``. The offload model (routing distribution, hot set, adaptive tier, cost of a token)
lives in :mod:`.offload`, the engine loop in :mod:`.model`, the HTTP layer in :mod:`.server`; the planner can
predict the sim's hit rate from :func:`expected_frequencies`.
"""

from .model import MODEL_ID, SERVICE
from .offload import (
    GUIDE_TABLE,
    SKEWS,
    CostModel,
    Layout,
    OffloadModel,
    RoutingDistribution,
    expected_frequencies,
    modelled_throughput,
    parse_skew,
    predicted_hit_rate,
)

__all__ = [
    "CostModel", "GUIDE_TABLE", "Layout", "MODEL_ID", "OffloadModel", "RoutingDistribution", "SERVICE", "SKEWS",
    "expected_frequencies", "modelled_throughput", "parse_skew", "predicted_hit_rate",
]
