"""``dsv41 doctor [--json] [--from-json FILE]``: probe the machine and judge it against the model's needs (a report:
exit 0 whatever the verdicts; 2 on bad settings, 1 on an unreadable --from-json file)."""

from __future__ import annotations

import json
import sys

from .. import doctor, hardware
from ..errors import UserError


def register(sub) -> None:
    p = sub.add_parser("doctor", help="check this machine against what the model needs",
                       description="Probe the GPU(s) and host and say, per requirement, pass / warn / fail with the "
                                   "figure and what to do. Exits 0 whatever the verdicts (it is a report); 2 on bad "
                                   "settings, 1 on an unreadable --from-json file.")
    p.add_argument("--json", action="store_true", help="print the probe and the verdicts as JSON")
    p.add_argument("--from-json", metavar="FILE",
                   help="judge a probe saved earlier with --json (e.g. from another machine) instead of this one")
    p.set_defaults(func=run)


def load_saved_probe(path: str) -> hardware.HardwareReport:
    """The probe in a file written by ``dsv41 doctor --json``; a missing, unreadable or malformed file is a
    :class:`UserError` naming the file and the problem."""
    advice = "Save one with: dsv41 doctor --json > FILE"
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    except FileNotFoundError:
        raise UserError(f"{path}: file not found. {advice}") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read it ({exc.strerror or exc}). {advice}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: not a JSON file ({exc}). {advice}") from None
    raw = saved.get("hardware") if isinstance(saved, dict) else None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: no \"hardware\" object in it, so it is not a probe saved by dsv41 doctor --json. "
                        f"{advice}")
    try:
        return hardware.HardwareReport.from_dict(raw)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        why = f"no {exc.args[0]!r} in it" if isinstance(exc, KeyError) and exc.args else f"{type(exc).__name__}: {exc}"
        raise UserError(f"{path}: the saved probe is incomplete or damaged ({why}). {advice}") from None


def run(args, ctx) -> int:
    settings = ctx.settings
    if args.from_json:
        report = load_saved_probe(args.from_json)
    else:
        report = hardware.probe(settings.cache_path)
    vs = doctor.verdicts(report, settings)
    if not args.from_json:              # the release is this machine's files, not part of a saved probe
        vs += doctor.release_verdicts(report, settings)
    if args.json:
        json.dump(doctor.report_dict(report, settings, vs), sys.stdout, indent=2, default=str)
        print()
    else:
        print(doctor.render_text(report, vs))
    return 0
