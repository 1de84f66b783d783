"""``dsv41 sim [--plan FILE] [--port N] [sim flags...]``: run the scripted engine (simulated) in the foreground.

Every flag of ``python -m engine_manager.sim`` is accepted (fault switches included; see that module's
docstring). Host, port, API key and the default max_tokens default to the panel's settings, so the panel's chat
and monitor can talk to it. Ctrl-C stops it. Nothing here reads the environment at import: a bad
``DSV41_DEFAULT_MAX_TOKENS`` stops only this command (exit 2, naming it), never ``dsv41 --version`` or ``stop``.
"""

from __future__ import annotations

import argparse

from ..sim.__main__ import build_parser, main as sim_main

_SKIP = {"help", "func", "command"}


def register(sub) -> None:
    parent = build_parser(add_help=False)
    panel_default = {"host": "address to listen on (default: the panel's host setting)",
                     "port": "port to listen on (default: the panel's port setting); in use: exit 2",
                     "api_key": "require this key on all but /health (default: the panel's api_key setting, so "
                                "the panel's chat and monitor can talk to it)"}
    for action in parent._actions:          # host/port/key default to the settings (filled in run())
        if action.dest in panel_default:
            action.default = None
            action.help = panel_default[action.dest]
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


def _key_words(args: argparse.Namespace, settings) -> str:
    if args.api_key_file:
        return f"the API key in {args.api_key_file}"
    if not args.api_key:
        return "no API key"
    if args.api_key == settings.api_key:
        return "the panel's API key (the api_key setting)"
    return "the API key given with --api-key"


def run(args, ctx) -> int:
    from ..procs import describe_owner, port_free, port_owner, suggest_port

    s = ctx.settings
    if args.host is None:
        args.host = s.host
    if args.port is None:
        args.port = s.port
    if args.api_key is None and not args.api_key_file:
        args.api_key = s.api_key        # in-process argv below: never on a command line `ps` shows
    if args.default_max_tokens is None:     # the setting (DSV41_DEFAULT_MAX_TOKENS, validated where it is loaded)
        args.default_max_tokens = s.default_max_tokens
    host = f"[{args.host}]" if ":" in args.host else args.host
    if args.port and not port_free(args.host, args.port):
        alt = suggest_port(args.host, args.port)
        print(f"dsv41 sim: port {args.port} on {args.host} is in use by "
              f"{describe_owner(port_owner(args.host, args.port))}.", flush=True)
        print("  what to do: stop that program, or use another port: "
              + (f"`dsv41 sim --port {alt}` ({alt} is free now)" if alt else "`dsv41 sim --port <N>`")
              + " — the panel talks to the port in its settings (`dsv41 settings set port <N>`).", flush=True)
        return 2
    argv = to_argv(args)
    print(f"dsv41 sim: the scripted engine (SIMULATED) on http://{host}:{args.port} with "
          f"{_key_words(args, s)}; Ctrl-C stops it.", flush=True)
    try:
        return int(sim_main(argv) or 0)
    except SystemExit as exc:       # argparse errors (port in use, bad flag) keep their exit code
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
