"""``dsv41 connections [list|add|test|remove]``: engines the panel did not start, saved by name (issue 19).

- ``list [--json]``: the saved connections (name, URL, SSH host, last detected kind, where the key is kept);
- ``add NAME URL [--ssh HOST] [--api-key-file FILE | --api-key-stdin] [--replace] [--no-test]``: save one, then
  test it. The key is never an argument (a command line is visible to every user of the machine in ``ps``): it is
  read from a file, from standard input, or asked for without echo on a terminal;
- ``test NAME [--json]``: reach it (through its SSH forward) and say in plain words what answers and what is
  missing; exit 1 when it is not a usable LLM server;
- ``remove NAME``: forget it and its key.

Then ``dsv41 monitor --connection NAME`` and ``dsv41 chat --connection NAME`` work on it. ``--json`` output never
holds a key.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from .. import connections as C
from ..atomic import LinkRefused, read_bytes_nofollow
from ..errors import UserError
from ..exitcodes import ExitCode
from ..session import RunningEngine


def register(sub) -> None:
    p = sub.add_parser("connections", help="saved engines the panel did not start (list, add, test, remove)",
                       description="Save engines the panel did not start — on this machine or, through ssh, on "
                                   "another — and detect what they are (Strata, llama.cpp, vLLM, SGLang, OpenAI).")
    csub = p.add_subparsers(dest="connections_command", metavar="ACTION")
    pl = csub.add_parser("list", help="list the saved connections")
    pl.add_argument("--json", action="store_true", help="one JSON document (never with a key)")
    pa = csub.add_parser("add", help="save a connection (the key is read from a file, stdin or a prompt)")
    pa.add_argument("name", help="a short name: letters, digits, '.', '_' or '-'")
    pa.add_argument("url", help="the engine's base URL as it answers on its machine, e.g. http://127.0.0.1:8000")
    pa.add_argument("--ssh", metavar="HOST", help="reach it through an ssh port forward to HOST (your ssh config, "
                                                  "keys and agent apply)")
    g = pa.add_mutually_exclusive_group()
    g.add_argument("--api-key-file", metavar="FILE", help="read the engine's API key from FILE")
    g.add_argument("--api-key-stdin", action="store_true", help="read the engine's API key from standard input")
    g.add_argument("--no-key", action="store_true", help="the engine needs no API key")
    pa.add_argument("--replace", action="store_true", help="replace a connection of the same name")
    pa.add_argument("--no-test", action="store_true", help="save without testing it")
    pa.add_argument("--json", action="store_true", help="print the result as JSON (never with a key)")
    pt = csub.add_parser("test", help="reach a saved connection and say what answers")
    pt.add_argument("name")
    pt.add_argument("--json", action="store_true", help="one JSON document (never with a key)")
    pr = csub.add_parser("remove", help="forget a saved connection and its key")
    pr.add_argument("name")
    p.set_defaults(func=run)


def _read_key(args) -> str | None:
    if args.no_key:
        return None
    if args.api_key_file:
        try:
            raw = read_bytes_nofollow(Path(args.api_key_file), max_bytes=65536)
        except (OSError, LinkRefused) as exc:
            raise C.ConnectionSetupError(f"Cannot read the key file {args.api_key_file}: {exc}. Give a readable "
                                         "file that holds just the key.") from None
        return raw.decode("utf-8", "replace").strip() or None
    if args.api_key_stdin:
        return sys.stdin.readline().strip() or None
    if sys.stdin.isatty():
        import getpass

        return getpass.getpass("API key of the engine (empty: none): ").strip() or None
    return None


def _print_detection(det: C.Detection, as_json: bool, name: str) -> None:
    if as_json:
        print(json.dumps({"name": name, **det.to_dict()}))
        return
    head = "ok" if det.ok else "PROBLEM"
    print(f"{name}: {head}: {det.message}")
    for f in det.found:
        print(f"  found: {f}")
    for m in det.missing:
        print(f"  missing: {m}")


def run(args, ctx) -> int:
    action = getattr(args, "connections_command", None) or "list"
    if action == "list":
        conns = C.load_connections()
        if getattr(args, "json", False):
            print(json.dumps({"connections": [c.to_dict() for c in conns]}))
            return 0
        if not conns:
            print("No saved connections. Add one with `dsv41 connections add NAME URL` "
                  "(--ssh HOST for an engine on another machine).")
            return 0
        for c in conns:
            via = f" via ssh {c.ssh_host}" if c.ssh_host else ""
            kind = C.KIND_LABELS.get(c.kind or "", "not tested yet")
            kept = {"keyring": "key in the OS keyring", "file": "key in an owner-only file"}.get(c.key_store or "",
                                                                                               "no key")
            added = time.strftime("%Y-%m-%d", time.localtime(c.added_at)) if c.added_at else "?"
            print(f"{c.name}  {c.base_url}{via}  {kind}  ({kept}; added {added})")
        return 0
    if action == "add":
        key = _read_key(args)
        conn = C.add_connection(args.name, args.url, key, args.ssh, replace=args.replace)
        store = {"keyring": "in the OS keyring", "file": f"in {C.keys_file()} (owner-only; no OS keyring here)"}
        if not args.json:
            print(f"Saved {conn.name}: {conn.base_url}" + (f" via ssh {conn.ssh_host}" if conn.ssh_host else "")
                  + (f"; key kept {store[conn.key_store]}" if conn.key_store else "; no key"))
        if args.no_test:
            if args.json:
                print(json.dumps({"name": conn.name, "saved": conn.to_dict()}))
            return 0
        det = C.check_connection(conn.name)
        C.close_tunnel(conn.name)
        _print_detection(det, args.json, conn.name)
        return 0 if det.ok else 1
    if action == "test":
        det = C.check_connection(args.name)
        _print_detection(det, args.json, args.name)
        C.close_tunnel(args.name)
        return 0 if det.ok else 1
    if action == "remove":
        c = C.remove_connection(args.name)
        print(f"Removed {c.name} ({c.base_url}) and its key.")
        return 0
    return 2


def attached_engine(prog: str, name: str, url: str | None) -> tuple[RunningEngine | None, int]:
    """``--connection NAME`` of ``dsv41 monitor`` and ``dsv41 chat``: the saved connection as the one handle (its
    key from the keyring or the 0600 file, never from the command line), or ``(None, exit code)`` after saying in
    plain words why not (``--url`` too, an unknown name, nothing usable answering)."""
    if url:
        print(f"{prog}: give --connection or --url, not both.", file=sys.stderr)
        return None, ExitCode.USAGE
    try:
        return C.resolve_connection(name), ExitCode.OK
    except UserError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return None, ExitCode.FAIL
