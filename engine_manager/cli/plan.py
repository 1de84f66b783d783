"""``dsv41 plan``: which experts live in VRAM on this host (or another), or why the host cannot hold the model.

Exit 0 with a plan, 3 when the host is refused, 1 when there is no model to plan (or its headers are unreadable),
2 for bad arguments or an unreadable usage file.

The plan is saved as the Placement tab saves it (``plans.store_plan``): a plan for this machine that is not
refused becomes ``<data dir>/plans/last-plan.json`` (+ ``last-plan.strp``), the plan ``dsv41 start`` uses; a refused
or hypothetical one (``--vram-gib``/``--ram-gib``) goes to ``plans/other-plan.json`` and never replaces it.
``--no-save`` is a dry look: nothing is written but ``--out``/``--strp``. The output says where it went.

Where the model comes from: ``--model-dir DIR``; else ``--replica`` (the header-faithful sparse replica, generated
once into the data dir); else the settings' ``model_dir`` or the download cache. With none of them it says there is
no model and how to get one, and exits 1.
"""

from __future__ import annotations

import json
import re
import sys

from .. import fmt, placement, plans
from .. import hardware as hw
from ..tensor_layout import KIND_LABELS, LayoutError, read_layout
from ..expert_routing import RoutingError, load_usage

from ..exitcodes import ExitCode


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(gib|gb|mib|mb|tib|tb|g|m|t)?\s*$", re.I)
_UNIT = {None: fmt.GIB, "gib": fmt.GIB, "g": fmt.GIB, "gb": fmt.GB, "mib": fmt.MIB, "m": fmt.MIB, "mb": fmt.MB,
         "tib": 1 << 40, "tb": 10**12, "t": 1 << 40}


def parse_size(text: str) -> int:
    """``"95.6"`` (GiB), ``"280GB"``, ``"97887MiB"`` → bytes."""
    import argparse
    m = _SIZE.match(str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 96, 95.6GiB, 280GB, 97887MiB)")
    v = float(m.group(1)) * _UNIT[(m.group(2) or "").lower() or None]
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be positive")
    return int(v)


def register(sub) -> None:
    p = sub.add_parser(
        "plan", help="plan which experts live in VRAM, or refuse a host that cannot hold the model",
        description="Read the model's GGUF headers, the GPU's VRAM and the host's RAM (or the sizes you give) and "
                    "print the placement: itemised VRAM and RAM terms, the hot set, the predicted hit rate (only "
                    "from real routing data), the Strata flags and the stock llama.cpp per-layer equivalent. "
                    "Exit 0 with a plan, 3 when the host is refused, 1 with no model.")
    p.add_argument("--model-dir", metavar="DIR", help="folder (or first shard) of the model's GGUF split "
                                                      "(default: the model_dir setting, then the download cache)")
    p.add_argument("--replica", action="store_true",
                   help="plan the header-faithful sparse replica of DeepSeek-V4.1-Flash Q2_K (no download needed)")
    p.add_argument("--vram-gib", type=parse_size, metavar="N",
                   help="plan for a GPU with this much memory (GiB; or 280GB, 97887MiB) instead of this host's")
    p.add_argument("--ram-gib", type=parse_size, metavar="N",
                   help="plan for a host with this much RAM (GiB; or e.g. 280GB) instead of this host's")
    p.add_argument("--usage", action="append", default=[], metavar="FILE",
                   help="routing data: a --dump-routing trace, a saved frequency table, or a Strata profile "
                        "(repeatable; traces are merged)")
    p.add_argument("--slots", type=int, help="concurrent requests (default: the slots setting)")
    p.add_argument("--context", type=int, metavar="TOKENS", help="context per slot (default: the setting)")
    p.add_argument("--kv-type", choices=["int8", "q4_0", "k8v4"], help="KV cache type (default: the setting)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--out", metavar="FILE", help="also write the plan's JSON to FILE")
    p.add_argument("--strp", metavar="FILE", help="write the Strata expert profile (STRP) in the plan's order "
                                                  "(default: beside the saved plan)")
    p.add_argument("--no-save", action="store_true",
                   help="a dry look: do not save the plan (by default a plan for this machine that is not refused "
                        "becomes <data dir>/plans/last-plan.json, the plan `dsv41 start` uses)")
    p.set_defaults(func=run)


def _layout(args, settings):
    if args.model_dir:
        return read_layout(args.model_dir), None
    if args.replica:
        return plans.default_sim_layout(), "the header-faithful replica (sparse files, no weights)"
    first = plans.find_model(settings)
    if first is None:
        return None, None
    return read_layout(first), None


def run(args, ctx) -> int:
    settings = ctx.settings
    try:
        layout, what = _layout(args, settings)
    except LayoutError as exc:
        print(f"dsv41 plan: cannot read the model: {exc}", file=sys.stderr)
        return ExitCode.FAIL
    if layout is None:
        where = [f"model_dir ({settings.model_dir})" if settings.model_dir else "model_dir is not set",
                 f"the download cache ({settings.cache_path}) holds no shards"]
        print("dsv41 plan: there is no model to plan: " + "; ".join(where) + ".\n"
              "Get it with `dsv41 download`, or set DSV41_MODEL_DIR to a folder that holds the seven "
              "DeepSeek-V4.1-Flash-Q2_K-0000N-of-00007.gguf shards, or pass --model-dir DIR.\n"
              "To see a plan without the 264.5 GB download, plan the header-faithful replica: "
              "`dsv41 plan --replica`.", file=sys.stderr)
        return ExitCode.FAIL

    if args.vram_gib is not None or args.ram_gib is not None:
        base = hw.probe(settings.cache_path)
        hardware = placement.hypothetical_hardware(base, args.vram_gib, args.ram_gib)
    else:
        hardware = hw.probe(settings.cache_path)

    overrides = {k: v for k, v in (("slots", args.slots), ("context_length", args.context),
                                   ("kv_type", args.kv_type)) if v is not None}
    ps = placement.PlanSettings.from_settings(settings, **overrides)
    try:
        usage = load_usage(args.usage, layout.n_layers, layout.n_experts) if args.usage else None
    except RoutingError as exc:
        print(f"dsv41 plan: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    try:
        p = placement.plan(layout, hardware, usage, ps)
    except ValueError as exc:
        print(f"dsv41 plan: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    try:
        stored = plans.store_plan(p, save=not args.no_save, strp_path=args.strp, source=what)
        d = stored.plan_dict
        if args.out:
            plans.save_plan(d, args.out)
    except OSError as exc:
        print(f"dsv41 plan: could not write the plan: {exc}", file=sys.stderr)
        return ExitCode.FAIL
    # with --json, stdout carries only the JSON: the notes go to stderr
    notes = sys.stderr if args.json else sys.stdout
    if args.json:
        json.dump(d, sys.stdout, indent=1)
        print()
    else:
        print(render(p, what))
        print()
    if args.strp and p.strp_path:
        print(f"Wrote the Strata profile to {p.strp_path}", file=notes)
    elif args.strp:
        print("No Strata profile written: the plan was refused.", file=notes)
    if args.out:
        print(f"Wrote the plan to {args.out}", file=notes)
    print(stored.describe(), file=notes)
    return ExitCode.REFUSED if p.refused else ExitCode.OK


def _g(n: int) -> str:
    return f"{n / fmt.GIB:9.2f} GiB"


def _both(n: int) -> str:
    """RAM in GB (how it is sold) with GiB beside it (what --ram-gib takes)."""
    return f"{n / fmt.GB:.1f} GB ({n / fmt.GIB:.1f} GiB)"


def _left(free_bytes: int) -> str:
    """What is left of a VRAM budget: free, or how far the terms are over it (never a negative "free")."""
    if free_bytes >= 0:
        return f"free {free_bytes / fmt.MIB:,.1f} MiB"
    return f"OVER BUDGET by {-free_bytes / fmt.MIB:,.1f} MiB ({-free_bytes / fmt.GIB:.2f} GiB)"


def _gb(n: int) -> str:
    return f"{n / fmt.GB:8.1f} GB ({n / fmt.GIB:6.1f} GiB)"


_ranges = fmt.ranges


def render(p: placement.Plan, what: str | None = None) -> str:
    lay, s = p.layout, p.settings
    L = []
    L.append(f"Plan for {lay.name}: {len(lay.shards)} shard(s), {lay.total_bytes / fmt.GB:.1f} GB"
             + (f" — {what}" if what else ""))
    L.append(f"Host: {p.hardware_label}" + ("  [HYPOTHETICAL: not this machine]" if p.hypothetical else ""))
    L.append(f"Settings: {s.slots} slot(s), {s.context_length:,}-token context, {s.kv_type} KV cache, "
             f"{s.vram_reserve_mib} MiB VRAM reserve")
    kinds = lay.bytes_by_kind()
    L.append("Model: " + ", ".join(f"{KIND_LABELS[k]} {v / fmt.GIB:.1f} GiB" for k, v in kinds.items() if v))
    L.append("")
    if p.gpu_name is None:
        L.append("VRAM  budget: no GPU (the terms below are what a GPU would need to hold)")
    else:
        L.append(f"VRAM  budget {p.vram.budget_bytes / fmt.GIB:.2f} GiB ({p.vram.budget_bytes / fmt.MIB:,.0f} MiB)")
    w = max(len(t.name) for t in p.vram.terms + p.ram.terms)
    for t in p.vram.terms:
        L.append(f"  {t.name:<{w}} {_g(t.bytes)}   {t.note}")
    L.append(f"  {'total':<{w}} {_g(p.vram.total_bytes)}   " + _left(p.vram.free_bytes))
    L.append(f"RAM   budget {p.ram.budget_bytes / fmt.GB:.1f} GB ({p.ram.budget_bytes / fmt.GIB:.1f} GiB)")
    for t in p.ram.terms:
        L.append(f"  {t.name:<{w}} {_gb(t.bytes)}   {t.note}")
    L.append(f"  {'total':<{w}} {_gb(p.ram.total_bytes)}   "
             + (f"free {p.ram.free_bytes / fmt.GB:.1f} GB" if p.ram.free_bytes >= 0
                else f"SHORT {-p.ram.free_bytes / fmt.GB:.1f} GB"))
    L.append("")
    if p.refused:
        L.append("REFUSED — this host cannot hold the model's minimum layout:")
        for sf in p.shortfalls:
            if sf.resource == "gpu":
                L.append("  GPU: none found")
            elif sf.resource == "vram":
                L.append(f"  VRAM: needs {sf.needed_bytes / fmt.GIB:.1f} GiB before any expert, has "
                         f"{sf.available_bytes / fmt.GIB:.1f} GiB → {sf.missing_bytes / fmt.GIB:.1f} GiB "
                         f"({sf.missing_bytes / fmt.GB:.1f} GB) missing")
            else:
                L.append(f"  RAM: needs {_both(sf.needed_bytes)}, has {_both(sf.available_bytes)} → "
                         f"{_both(sf.missing_bytes)} missing")
        L.append(f"  {p.refused}.")
        return "\n".join(L)
    L.append(f"Hot set: {p.n_hot:,} of {p.total_experts:,} experts in VRAM ({p.hot_expert_bytes / fmt.GIB:.1f} GiB); "
             f"{p.cold_experts:,} in RAM ({p.cold_expert_bytes / fmt.GIB:.1f} GiB)")
    if p.predicted_hit_rate is not None:
        L.append(f"Predicted hit rate: {p.predicted_hit_rate:.1%} ({p.hit_rate_note})")
    else:
        L.append(f"Predicted hit rate: {p.hit_rate_note}")
    lh = p.llamacpp_predicted_hit_rate
    L.append(f"Stock llama.cpp at the same budget: experts of {len(p.llamacpp_gpu_layers)} of {len(p.moe_layers)} "
             f"MoE layers on the GPU; layers {_ranges(p.llamacpp_cpu_layers)} stay on the CPU → hit rate "
             + (f"{lh:.1%}" if lh is not None else "unknown") + f" ({p.llamacpp_note})")
    L.append("Strata flags: " + " ".join(p.strata_args()))
    if p.llamacpp_args():
        L.append("llama.cpp flags: " + " ".join(f"'{a}'" if "\\" in a else a for a in p.llamacpp_args()))
    for n in p.notes:
        L.append(f"note: {n}")
    return "\n".join(L)
