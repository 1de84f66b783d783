"""``dsv41 doctor [--json]``: probe the machine and judge it against the model's needs (a report: exit 0)."""

from __future__ import annotations

import json
import sys

from .. import doctor, hardware


def register(sub) -> None:
    p = sub.add_parser("doctor", help="check this machine against what the model needs",
                       description="Probe the GPU(s) and host and say, per requirement, pass / warn / fail with the "
                                   "figure and what to do. Always exits 0 (it is a report); 2 on bad settings.")
    p.add_argument("--json", action="store_true", help="print the probe and the verdicts as JSON")
    p.add_argument("--from-json", metavar="FILE",
                   help="judge a probe saved earlier with --json (e.g. from another machine) instead of this one")
    p.set_defaults(func=run)


def run(args, ctx) -> int:
    settings = ctx.settings
    if args.from_json:
        with open(args.from_json, encoding="utf-8") as f:
            report = hardware.HardwareReport.from_dict(json.load(f)["hardware"])
    else:
        report = hardware.probe(settings.cache_path)
    vs = doctor.verdicts(report, settings)
    if args.json:
        json.dump(doctor.report_dict(report, settings, vs), sys.stdout, indent=2, default=str)
        print()
    else:
        print(doctor.render_text(report, vs))
    return 0
