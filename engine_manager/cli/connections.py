"""``dsv41 connections [list|add|test|remove]``: engines the panel did not start, saved by name.

- ``add NAME URL [--ssh HOST] [--api-key-file FILE | --api-key-stdin] [--replace] [--no-test]``: test it, then save
  it. One that cannot be reached now is saved all the same and said so (exit 0); one that answers and says no (a
  refused key, not an LLM server) is not saved (exit 1: fix it, or save it as it is with ``--no-test``). The key is
  never an argument (``ps`` shows every command line): it is read from a regular file, from standard input, or
  asked for without echo on a terminal;
- ``list [--json]``: the saved connections (name, URL, SSH host, where the key is kept), each with the one record of
  its last test (by this CLI or the window): when, what answered, or why not and when it was last seen;
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
from ..atomic import LinkRefused, NotARegularFile, read_bytes_nofollow
from ..errors import UserError
from ..exitcodes import ExitCode
from ..fmt import terminal_safe
from ..engine_state import RunningEngine


def _say(text: str = "", file=None) -> None:
    """Print words that may hold what a server or a file said: control characters escaped (no terminal title,
    no cleared screen, no fake line)."""
    print(terminal_safe(text, keep_newlines=False), file=file or sys.stdout)


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
            raw = read_bytes_nofollow(Path(args.api_key_file), max_bytes=65537)
        except (NotARegularFile, LinkRefused) as exc:
            raise C.ConnectionSetupError(f"Cannot read the key file: {exc}. Give a plain file that holds just the "
                                         "key (or use --api-key-stdin).") from None
        except OSError as exc:
            raise C.ConnectionSetupError(f"Cannot read the key file {args.api_key_file}: {exc.strerror or exc}. Give "
                                         "a readable file that holds just the key.") from None
        if len(raw) > 65536:
            raise C.ConnectionSetupError(f"The key file {args.api_key_file} is larger than 64 kB: it does not hold "
                                         "just a key. Give a file with the key alone.")
        return raw.decode("utf-8", "replace").strip() or None
    if args.api_key_stdin:
        return sys.stdin.readline().strip() or None
    if sys.stdin.isatty():
        import getpass

        return getpass.getpass("API key of the engine (empty: none): ").strip() or None
    return None


def _print_detection(det: C.Detection, as_json: bool, name: str, **extra) -> None:
    if as_json:
        print(json.dumps({"name": name, **extra, **det.to_dict()}))
        return
    head = {"ok": "ok", "unreachable": "UNREACHABLE"}.get(C.state_of(det), "PROBLEM")
    _say(f"{name}: {head}: {det.message}")
    for f in det.found:
        _say(f"  found: {f}")
    for m in det.missing:
        _say(f"  missing: {m}")


def _when(t: float | None) -> str:
    if not t:
        return "?"
    fmt = "%H:%M:%S" if time.time() - t < 20 * 3600 else "%Y-%m-%d %H:%M"
    return time.strftime(fmt, time.localtime(t))


def last_test_words(c: C.Connection) -> str:
    """The one record of the connection's last test, in words for ``list``."""
    lt = c.last_test
    if lt is None:
        return "not tested yet"
    if lt.state == "ok":
        return f"ok: {C.KIND_LABELS.get(lt.kind or '', lt.kind or 'an engine')} (tested {_when(lt.t)})"
    seen = f"last seen {_when(lt.last_ok)}" if lt.last_ok else "never seen answering"
    what = "unreachable" if lt.state == "unreachable" else "PROBLEM"
    return f"{what} at {_when(lt.t)}, {seen}: {lt.message}"


def _list(args) -> int:
    try:
        conns = C.load_connections()
    except C.ConnectionSetupError as exc:       # a bad list is moved aside: said, then the (empty) list
        _say(f"dsv41 connections: {exc}", file=sys.stderr)
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
        kept = {"keyring": "key in the OS keyring", "file": "key in an owner-only file"}.get(c.key_store or "",
                                                                                           "no key")
        added = time.strftime("%Y-%m-%d", time.localtime(c.added_at)) if c.added_at else "?"
        _say(f"{c.name}  {c.base_url}{via}  ({kept}; added {added})")
        _say(f"  last test: {last_test_words(c)}")
    return 0


def _add(args) -> int:
    key = _read_key(args)
    C.check_new(args.name, args.url, key, args.ssh)            # a bad name, URL or host: refused before any test
    if not args.replace and any(c.name == args.name for c in C.load_connections()):
        raise C.ConnectionSetupError(f"A connection named {args.name!r} exists already: remove it first "
                                     f"(`dsv41 connections remove {args.name}`), pick another name, or give "
                                     "--replace.")
    store = {"keyring": "in the OS keyring", "file": f"in {C.keys_file()} (owner-only; no OS keyring here)"}

    def saved_words(conn: C.Connection) -> str:
        return (f"Saved {conn.name}: {conn.base_url}" + (f" via ssh {conn.ssh_host}" if conn.ssh_host else "")
                + (f"; key kept {store[conn.key_store]}" if conn.key_store else "; no key"))

    if args.no_test:
        conn = C.add_connection(args.name, args.url, key, args.ssh, replace=args.replace)
        if args.json:
            print(json.dumps({"name": conn.name, "saved": conn.to_dict()}))
        else:
            _say(saved_words(conn) + " (not tested)")
        return 0
    det = C.check_unsaved(args.url, key, args.ssh)
    state = C.state_of(det)
    if state == "problem":
        _print_detection(det, args.json, args.name, saved=False)
        if not args.json:
            _say("Nothing was saved: fix what is said above and add it again, or save it as it is with --no-test.")
        return ExitCode.FAIL
    conn = C.add_connection(args.name, args.url, key, args.ssh, replace=args.replace, tested=det)
    if not args.json:
        _say(saved_words(conn))
    _print_detection(det, args.json, conn.name, saved=True)
    if state == "unreachable" and not args.json:
        _say(f"It is saved, but cannot be reached now; `dsv41 connections test {conn.name}` tries again.")
    return ExitCode.OK


def run(args, ctx) -> int:
    action = getattr(args, "connections_command", None) or "list"
    if action == "list":
        return _list(args)
    if action == "add":
        return _add(args)
    if action == "test":
        try:
            det = C.check_connection(args.name)
        finally:
            C.close_tunnel(args.name)
        _print_detection(det, args.json, args.name)
        return 0 if det.ok else 1
    if action == "remove":
        c = C.remove_connection(args.name)
        _say(f"Removed {c.name} ({c.base_url}) and its key.")
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
        _say(f"{prog}: {exc}", file=sys.stderr)
        return None, ExitCode.FAIL
