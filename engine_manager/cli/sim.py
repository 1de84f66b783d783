"""``dsv41 sim [--plan FILE] [--port N] [sim flags...]``: run the scripted engine (simulated) in the foreground.

Every flag of ``python -m engine_manager.sim`` is accepted (fault switches included; see that module's
docstring). Host, port and API key default to the panel's settings, so the panel's chat and monitor can talk to
it. Ctrl-C stops it.
"""

from __future__ import annotations

import argparse

from ..settings import mask_secret
from ..sim.__main__ import build_parser, main as sim_main

_SKIP = {"help", "func", "command"}


def register(sub) -> None:
    parent = build_parser(add_help=False)
    for action in parent._actions:          # host/port/key default to the settings (filled in run())
        if action.dest in ("host", "port", "api_key"):
            action.default = None
    p = sub.add_parser("sim", parents=[parent], help="run the scripted engine (simulated) in the foreground",
                       description="Run the scripted engine: Strata's HTTP endpoints on 127.0.0.1 with a modelled "
                                   "expert offload (every figure it reports is SIMULATED). Host, port and API key "
                                   "default to the panel's settings. Ctrl-C stops it.")
    p.set_defaults(func=run, _sim_actions=[a for a in parent._actions if a.dest not in _SKIP])


def to_argv(args: argparse.Namespace) -> list[str]:
    """The namespace back into the sim's own command line (only what differs from its defaults)."""
    out: list[str] = []
    for action in args._sim_actions:
        value = getattr(args, action.dest, None)
        if value is None or value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction):
            if value:
                out.append(flag)
        else:
            out += [flag, str(value)]
    return out


def run(args, ctx) -> int:
    s = ctx.settings
    if args.host is None:
        args.host = s.host
    if args.port is None:
        args.port = s.port
    if args.api_key is None:
        args.api_key = s.api_key
    argv = to_argv(args)
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"dsv41 sim: the scripted engine (SIMULATED) on http://{host}:{args.port} "
          f"with API key {mask_secret(args.api_key) or '(none)'}; Ctrl-C stops it.", flush=True)
    try:
        return int(sim_main(argv) or 0)
    except SystemExit as exc:       # argparse errors (port in use, bad flag) keep their exit code
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
