"""Which plan the engine starts with: the one on screen when usable, else the saved one, else a fresh plan.

(The supervisor's part; the plan store itself is :mod:`engine_manager.plans`.) Never imports Qt.
"""

from __future__ import annotations

import time
from typing import Any

from .engines import find_engine

def _hardware(plan: dict[str, Any]) -> dict[str, Any]:
    hw = plan.get("hardware")
    return hw if isinstance(hw, dict) else {}


def usable_plan(engine_name: str, plan: dict[str, Any] | None) -> dict[str, Any] | None:
    """The plan on screen (the Placement tab's), if ``engine_name`` should start with it; else None, and the start
    falls back to :func:`default_plan`. Never a refused plan; a real engine only one made for this machine (not
    for a hypothetical host); an engine that models the reference host (``Engine.plans_reference_host``: the
    scripted engine) may model any host, that is what it is for."""
    if not plan or plan.get("refused"):
        return None
    if not find_engine(engine_name).plans_reference_host and _hardware(plan).get("hypothetical"):
        return None
    return plan


def plan_host_warning(plan: dict[str, Any] | None, hardware: Any = None) -> str | None:
    """For a plan the user chose to start with (``dsv41 start --plan FILE``, the Placement tab's "Start with this
    plan"): a warning naming the host it was made for when that is not this machine (a hypothetical host, or
    another host name); None when it was made here."""
    if not plan:
        return None
    hwd = _hardware(plan)
    label = str(hwd.get("label") or "an unknown host")[:200]
    here = getattr(getattr(hardware, "host", None), "hostname", None)
    if not hwd.get("hypothetical") and here and f"({here})" in label:
        return None
    return (f"this plan was made for {label}, not for this machine" + (f" ({here})" if here else "")
            + "; starting with it as asked — the engine may not fit here.")


def default_plan(engine_name: str, settings: Any, hardware: Any = None) -> tuple[dict[str, Any] | None, list[str]]:
    """The plan to start ``engine_name`` with when the caller has none, and notes saying what was chosen.

    - an engine that ``plans_reference_host`` (the scripted engine): the reference placement (the guides' RTX PRO
      6000, 280 GB RAM) on the replica layout of the model — what it models without a GPU;
    - one that runs on the CPU alone without a GPU (``cpu_without_gpu``, llama.cpp), on a host without one: none;
    - else: the plan saved by the Placement tab or ``dsv41 plan`` for this machine, else a fresh plan
      for this machine from the model's headers (the planner refuses a host that cannot hold the model)."""
    notes: list[str] = []
    try:
        from . import placement, plans
    except ImportError:
        notes.append("The placement planner is not available; the engine sizes its expert cache itself.")
        return None, notes
    try:
        eng = find_engine(engine_name)
        if eng.plans_reference_host:
            from .sim.offload import expected_frequencies

            layout = plans.default_sim_layout()
            # The scripted engine's routing distribution is the truth of its simulated world, so the plan ranks
            # by it and its predicted hit rate is the expected one for that distribution (labelled simulated).
            pi = expected_frequencies(len(layout.moe_layers), layout.n_experts, layout.n_experts_used)
            p = placement.plan(layout, placement.reference_hardware(), pi, settings)
            d = p.to_dict()
            d["usage_note"] = "the scripted engine's own routing distribution (simulated)"
            rate = d.get("predicted_hit_rate")
            notes.append(f"The scripted engine (simulated) runs the reference placement — {d.get('hot_experts'):,} "
                         "hot experts in VRAM of the guides' 96 GB RTX PRO 6000 — on the replica layout of "
                         "DeepSeek-V4.1-Flash Q2_K" + (f"; predicted hit rate {rate:.1%} from its routing "
                                                       "distribution." if rate is not None else "."))
            return d, notes
        has_gpu = bool(hardware is not None and getattr(hardware, "has_gpu", False))
        if eng.cpu_without_gpu and not has_gpu:
            notes.append("No GPU here: llama.cpp runs every layer on the CPU, so there is no placement to plan.")
            return None, notes
        last = plans.load_last_plan()
        if last and not last.get("refused") and not _hardware(last).get("hypothetical"):
            made = last.get("created_at")
            when = time.strftime(" (made %Y-%m-%d %H:%M)", time.localtime(made)) if isinstance(made, (int, float)) \
                else ""
            notes.append(f"Using the plan saved by the Placement tab / `dsv41 plan`{when}.")
            return last, notes
        model = getattr(settings, eng.model_setting, None) if eng.model_setting else None
        req = plans.PlanRequest(host="this", save=False, model_path=str(model) if model else None)
        out = plans.make_plan(settings, req, hardware)
        notes.append(f"Planned for this machine from {out.model_source}.")
        return out.plan_dict, notes
    except Exception as exc:  # an unreadable model folder must not hide the engine's own, clearer error
        notes.append(f"Could not make a plan ({exc}); the engine sizes its expert cache itself.")
        return None, notes

