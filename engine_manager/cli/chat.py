"""``dsv41 chat`` (one turn with the running engine, streamed to the terminal) and ``dsv41 history`` (the saved
conversations: list, show, export, search, rename, delete).

The engine's address: the engine the panel started (from the supervisor's state, when it is ready), else the
settings' host, port and api_key; ``--url`` names another one. Before anything is sent, the supervisor's status must
not say that a program the panel did not start holds the port (then: refused, exit 1, nothing sent, the API key
included). Every turn is saved in the chat history as it streams, like the panel's chat pane does; a request the
engine refuses before answering (nothing listens, 401, 409 …) saves nothing.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from .. import history as hist
from ..chat import (
    REASONING_EFFORTS,
    CancelToken,
    ChatError,
    ChatOptions,
    ContentDelta,
    EngineTarget,
    ReasoningDelta,
    engine_target,
)
from ..chat_turn import TurnEnded, run_turn

DIM, RESET = "\x1b[2m", "\x1b[0m"


def register(sub) -> None:
    p = sub.add_parser(
        "chat", help="ask the running engine one question; the answer streams here and is saved in the history",
        description="Send one message to the running engine and stream the answer (the model's reasoning dimmed, "
                    "then the answer), then print tokens and tok/s. The turn is saved in the chat history; "
                    "--conversation continues a saved conversation. Exit 0 ok, 1 failed, 130 stopped with Ctrl+C.")
    p.add_argument("text", nargs="?", help="the message ('-' or nothing: read it from standard input)")
    p.add_argument("--max-tokens", type=int, metavar="N",
                   help="most tokens to generate (default: the default_max_tokens setting, DSV41_DEFAULT_MAX_TOKENS)")
    p.add_argument("--reasoning-effort", metavar="E",
                   help=f"how hard the model thinks: {', '.join(REASONING_EFFORTS)} (default: the engine's)")
    p.add_argument("--reproducible", action="store_true",
                   help="ask for a bit-identical answer in a batch (Strata's strata_reproducible; slower)")
    p.add_argument("--temperature", type=float, metavar="T", help="sampling temperature (default: the engine's)")
    p.add_argument("--conversation", type=int, metavar="ID", help="continue this saved conversation")
    p.add_argument("--system", metavar="TEXT", help="a system prompt for this turn (not saved)")
    p.add_argument("--url", metavar="URL",
                   help="talk to the engine at this address (e.g. http://127.0.0.1:8080: one you started by hand) "
                        "instead of the one the panel started; the settings' api_key is sent to it")
    p.add_argument("--connection", metavar="NAME",
                   help="chat with a saved connection (`dsv41 connections list`) instead of the panel's engine")
    p.add_argument("--no-reasoning", action="store_true", help="do not print the model's reasoning")
    p.add_argument("--timeout", type=float, default=120.0, metavar="S",
                   help="give up when the engine sends nothing for this many seconds (default 120)")
    p.add_argument("--json", action="store_true",
                   help="print only the saved answer, with its stats, as JSON when it is complete")
    p.set_defaults(func=run)

    h = sub.add_parser("history", help="the saved chat conversations: list, show, export, search, rename, delete",
                       description="The chat history kept in the data dir (chat_history.sqlite3).")
    hs = h.add_subparsers(dest="history_cmd", metavar="ACTION")
    hl = hs.add_parser("list", help="the conversations, newest first")
    hl.add_argument("--limit", type=int, default=50)
    hl.add_argument("--json", action="store_true")
    sh = hs.add_parser("show", help="print one conversation as Markdown")
    sh.add_argument("id", type=int)
    ex = hs.add_parser("export", help="export one conversation as Markdown or JSON")
    ex.add_argument("id", type=int)
    ex.add_argument("--format", choices=("md", "json"), default="md")
    ex.add_argument("-o", "--output", metavar="FILE", help="write to FILE (default: standard output)")
    se = hs.add_parser("search", help="conversations whose text contains TEXT")
    se.add_argument("text")
    se.add_argument("--json", action="store_true")
    rn = hs.add_parser("rename", help="give a conversation a new title")
    rn.add_argument("id", type=int)
    rn.add_argument("title")
    de = hs.add_parser("delete", help="delete a conversation")
    de.add_argument("id", type=int)
    de.add_argument("--yes", action="store_true", help="do not ask")
    h.set_defaults(func=run_history)


# ------------------------------------------------------------------------------------------------ engine address
def engine_address(settings, url: str | None = None) -> EngineTarget:
    """The engine to talk to (:func:`engine_manager.chat.engine_target`): ``.running()`` is its
    :class:`~engine_manager.session.RunningEngine`, ``.where`` says where the address came from. Raises
    :class:`ChatError` when the port is held by a program the panel did not start, or its engine is not ready."""
    return engine_target(settings, url)


def _valid_url(url: str) -> bool:
    try:
        import httpx
        u = httpx.URL(url)
    except Exception:  # noqa: BLE001 - any parse failure is a bad --url
        return False
    return u.scheme in ("http", "https") and bool(u.host)


def _arrived(stats) -> str:
    """``212 tokens arrived · 61.8 tok/s · first token 0.40 s``: an answer that did not finish."""
    first, _, rest = stats.summary().partition(" · ")
    return f"{first} arrived" + (f" · {rest}" if rest else "")


def _read_text(args) -> str | None:
    if args.text and args.text != "-":
        return args.text
    if sys.stdin is None or sys.stdin.isatty():
        return None
    return sys.stdin.read()


# ------------------------------------------------------------------------------------------------ dsv41 chat
def run(args, ctx) -> int:
    text = _read_text(args)
    if not text or not text.strip():
        print("dsv41 chat: nothing to send: give the message as an argument or on standard input.", file=sys.stderr)
        return 2
    settings = ctx.settings
    max_tokens = args.max_tokens if args.max_tokens is not None else settings.default_max_tokens
    if max_tokens < 1:
        print("dsv41 chat: --max-tokens must be 1 or more.", file=sys.stderr)
        return 2
    if args.reasoning_effort is not None and args.reasoning_effort not in REASONING_EFFORTS:
        print(f"dsv41 chat: --reasoning-effort must be one of {', '.join(REASONING_EFFORTS)}.", file=sys.stderr)
        return 2
    if args.url is not None and not _valid_url(args.url):
        print(f"dsv41 chat: --url must be an http:// address such as http://127.0.0.1:8080 (got {args.url!r}).",
              file=sys.stderr)
        return 2
    options = ChatOptions(max_tokens=max_tokens, temperature=args.temperature,
                          reasoning_effort=args.reasoning_effort, reproducible=args.reproducible)
    store = hist.HistoryStore()
    for n in store.notices:
        print(f"note: {n}", file=sys.stderr)
    if args.conversation is not None:
        try:
            store.get_conversation(args.conversation)
        except hist.HistoryError as exc:
            print(f"dsv41 chat: {exc}", file=sys.stderr)
            return 1
    if args.connection:
        from .connections import attached_engine
        attached, rc = attached_engine("dsv41 chat", args.connection, args.url)
        if attached is None:
            return rc
        running, where = attached, f"connection {args.connection}"
    else:
        try:
            target = engine_address(settings, args.url)
        except ChatError as exc:
            print(f"dsv41 chat: {exc}", file=sys.stderr)
            if exc.kind == "not_ours":
                print(f"  To talk to that program anyway (it is then sent your API key): "
                      f"dsv41 chat --url {settings.base_url} \"…\"", file=sys.stderr)
            return 1
        running, where = target.running(), target.where
    base_url = running.base_url
    out = open(os.devnull, "w") if args.json else sys.stdout     # --json: only the JSON on stdout
    tty = out.isatty()
    cancel = CancelToken()
    state: dict[str, str | None] = {"in": None}         # which part is being printed: None, "reasoning", "content"
    ended: TurnEnded | None = None

    def switch(to: str) -> None:
        if state["in"] == to:
            return
        if state["in"] == "reasoning":
            out.write(RESET + "\n\n" if tty else "\n[answer]\n")
        elif to == "reasoning":
            out.write(DIM if tty else "[reasoning]\n")
        state["in"] = to

    gen = run_turn(store, args.conversation, engine=running, options=options, user_text=text,
                   cancel=cancel, read_timeout_s=args.timeout, system_prompt=args.system)

    def on_sigint(_signum, _frame):
        # The first Ctrl+C stops the answer cleanly (it is saved, marked stopped); a second one aborts.
        if cancel.cancelled:
            raise KeyboardInterrupt
        cancel.cancel("stopped")

    old_handler = None
    if threading.current_thread() is threading.main_thread():
        old_handler = signal.signal(signal.SIGINT, on_sigint)
    try:
        for ev in gen:
            if isinstance(ev, ReasoningDelta):
                if not args.no_reasoning:
                    switch("reasoning")
                    out.write(ev.text)
                    out.flush()
            elif isinstance(ev, ContentDelta):
                switch("content")
                out.write(ev.text)
                out.flush()
            elif isinstance(ev, TurnEnded):
                ended = ev
    finally:
        if old_handler is not None:
            signal.signal(signal.SIGINT, old_handler)
        if tty and state["in"] == "reasoning":
            out.write(RESET)
        if state["in"] is not None:
            out.write("\n")
        out.flush()
        if out is not sys.stdout:
            out.close()

    if ended is None:   # pragma: no cover - run_turn always ends with TurnEnded
        return 1
    stats = ended.stats
    err = sys.stderr
    conv = ended.conversation_id
    again = ("run the same command again" if conv is None or args.conversation == conv else
             f"run the same command again, or `dsv41 chat --conversation {conv} \"…\"` to continue")
    if not ended.saved:
        if ended.status == hist.STATUS_STOPPED:
            print("[stopped before the engine answered; nothing was saved]", file=err)
        else:
            print(f"dsv41 chat: {ended.error}", file=err)
            if ended.error_kind in ("unreachable", "auth"):
                print(f"  (engine address from {where}: {base_url})", file=err)
            print(f"  Nothing was saved in the history; {again} once that is fixed.", file=err)
    elif ended.status == hist.STATUS_COMPLETE:
        line = stats.summary()
        if stats.finish_reason == "length":
            line += f" · stopped at --max-tokens {max_tokens}: raise it for a longer answer"
        print(f"[{line} · saved as conversation {conv}; continue with --conversation {conv}]", file=err)
    elif ended.status == hist.STATUS_STOPPED:
        print(f"[stopped: {_arrived(stats)} · the partial answer is saved in conversation {conv}; "
              f"continue with --conversation {conv}]", file=err)
    else:
        print(f"dsv41 chat: {ended.error}", file=err)
        if ended.error_kind in ("unreachable", "auth"):
            print(f"  (engine address from {where}: {base_url})", file=err)
        if ended.content or ended.reasoning:
            print(f"  [{_arrived(stats)} · the partial answer is saved in conversation {conv}; "
                  f"{again}]", file=err)
        else:
            print(f"  [the question is saved in conversation {conv}; {again}]", file=err)
    if args.json:
        msg = store.message(ended.assistant_message_id) if ended.assistant_message_id is not None else None
        json.dump({"conversation_id": conv, "message": msg.to_dict() if msg else None,
                   "status": ended.status, "error": ended.error, "saved": ended.saved},
                  sys.stdout, indent=2, default=str)
        print()
    if ended.status == hist.STATUS_COMPLETE:
        return 0
    if ended.status == hist.STATUS_STOPPED:
        return 130
    return 1


# ------------------------------------------------------------------------------------------------ dsv41 history
def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def run_history(args, ctx) -> int:
    cmd = args.history_cmd or "list"
    store = hist.HistoryStore()
    for n in store.notices:
        print(f"note: {n}", file=sys.stderr)
    try:
        if cmd == "list":
            convs = store.list_conversations(limit=getattr(args, "limit", 50))
            if getattr(args, "json", False):
                json.dump([c.__dict__ for c in convs], sys.stdout, indent=2, default=str)
                print()
                return 0
            if not convs:
                print("No saved conversations yet. Start one with: dsv41 chat \"your question\"")
                return 0
            for c in convs:
                status = "" if c.last_status in (None, hist.STATUS_COMPLETE) else f"  [{c.last_status}]"
                print(f"{c.id:>5}  {_when(c.updated_at)}  {c.message_count:>3} msgs  {c.title}{status}")
            return 0
        if cmd == "show":
            sys.stdout.write(store.export_markdown(args.id))
            return 0
        if cmd == "export":
            if args.format == "json":
                text = json.dumps(store.export_json(args.id), indent=2, ensure_ascii=False, default=str) + "\n"
            else:
                text = store.export_markdown(args.id)
            if args.output:
                from ..atomic import atomic_write_text
                atomic_write_text(Path(args.output), text)
                print(f"wrote {args.output}", file=sys.stderr)
            else:
                sys.stdout.write(text)
            return 0
        if cmd == "search":
            hits = store.search(args.text)
            if args.json:
                json.dump([h.__dict__ for h in hits], sys.stdout, indent=2, default=str)
                print()
                return 0
            if not hits:
                print(f"Nothing in the history contains {args.text!r}.")
                return 1
            for h in hits:
                who = f" {h.role}:" if h.role else " title:"
                print(f"{h.conversation_id:>5}  {h.title}\n       {who} {h.snippet}")
            return 0
        if cmd == "rename":
            if not args.title.strip():
                print("dsv41 history rename: the new title is empty.", file=sys.stderr)
                return 2
            store.rename(args.id, args.title)
            print(f"conversation {args.id} is now {args.title.strip()!r}")
            return 0
        if cmd == "delete":
            conv = store.get_conversation(args.id)
            if not args.yes:
                what = f"conversation {conv.id} {conv.title!r} ({conv.message_count} messages)"
                if sys.stdin is None or not sys.stdin.isatty():
                    print(f"dsv41 history delete: standard input is not a terminal, so there is no one to ask; "
                          f"to delete {what}, add --yes.", file=sys.stderr)
                    return 2
                try:
                    answer = input(f"Delete {what}? This cannot be undone. [y/N] ")
                except (EOFError, KeyboardInterrupt):
                    answer = ""
                    print()
                if answer.strip().lower() not in ("y", "yes"):
                    print(f"kept conversation {conv.id}")
                    return 1
            store.delete(args.id)
            print(f"deleted conversation {args.id}")
            return 0
    except hist.HistoryError as exc:        # e.g. no such conversation: the command failed (usage errors exit 2)
        print(f"dsv41 history: {exc}", file=sys.stderr)
        return 1
    return 2
