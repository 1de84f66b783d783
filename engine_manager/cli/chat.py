"""``dsv41 chat`` (one turn with the running engine, streamed to the terminal; or, with no message at a terminal, a
conversation with /commands) and ``dsv41 history`` (the saved conversations: list, show, export, search, rename,
delete). What an engine sent is printed with its control characters escaped (``fmt.terminal_safe``): a server's words
never set a terminal's title or clear its screen.

The engine's address: the engine the panel started (from the supervisor's state, when it is ready), else the
settings' host, port and api_key; ``--url`` names another one. Before anything is sent, the supervisor's status must
not say that a program the panel did not start holds the port (then: refused, exit 1, nothing sent, the API key
included). Every turn is saved in the chat history as it streams, like the panel's chat pane does; a request the
engine refuses before answering (nothing listens, 401, 409 …) saves nothing.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
from dataclasses import replace
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
from ..fmt import terminal_safe

DIM, RESET = "\x1b[2m", "\x1b[0m"


def register(sub) -> None:
    p = sub.add_parser(
        "chat", help="ask the running engine a question (or, alone at a terminal, hold a conversation); the answer "
                     "streams here and is saved in the history",
        description="Send one message to the running engine and stream the answer (the model's reasoning dimmed, "
                    "then the answer), then print tokens and tok/s. The turn is saved in the chat history; "
                    "--conversation continues a saved conversation. With no message at a terminal: a conversation "
                    "(/help lists its commands; Ctrl+C stops an answer, Ctrl+D leaves). Exit 0 ok, 1 failed, 130 "
                    "stopped with Ctrl+C.")
    p.add_argument("text", nargs="?", help="the message ('-': read it from standard input; nothing: standard input, "
                                           "or a conversation when that is a terminal)")
    p.add_argument("--max-tokens", type=int, metavar="N",
                   help="most tokens to generate (default: the default_max_tokens setting, DSV41_DEFAULT_MAX_TOKENS)")
    p.add_argument("--reasoning-effort", metavar="E",
                   help=f"how hard the model thinks: {', '.join(REASONING_EFFORTS)} (default: the engine's)")
    p.add_argument("--reproducible", action="store_true",
                   help="ask for a bit-identical answer in a batch (Strata's strata_reproducible; slower)")
    p.add_argument("--temperature", type=float, metavar="T", help="sampling temperature (default: the engine's)")
    p.add_argument("--conversation", type=int, metavar="ID", help="continue this saved conversation")
    p.add_argument("--system", metavar="TEXT",
                   help="the conversation's system prompt, kept with it (with --conversation: replaces the one it "
                        "had; \"\" removes it)")
    p.add_argument("--url", metavar="URL",
                   help="talk to the engine at this address (e.g. http://127.0.0.1:8080: one you started by hand) "
                        "instead of the one the panel started; the settings' api_key is sent to it")
    p.add_argument("--connection", metavar="NAME",
                   help="chat with a saved connection (`dsv41 connections list`) instead of the panel's engine")
    p.add_argument("--no-reasoning", action="store_true", help="do not print the model's reasoning")
    p.add_argument("--timeout", type=float, default=120.0, metavar="S",
                   help="give up when the engine sends no token for this many seconds once it answers - its "
                        "keep-alives and empty frames do not count (default 120); before the first token its "
                        "keep-alives count (it is queued or reading the prompt), for at most 10 minutes (or S when "
                        "longer)")
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
    :class:`~engine_manager.engine_state.RunningEngine`, ``.where`` says where the address came from. Raises
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
REPL_HELP = """Commands:
  /new           start a new conversation
  /system TEXT   the system prompt from the next question on (/system alone shows it, /system - removes it)
  /save [FILE]   say where this conversation is saved; with FILE, also write it there as Markdown
  /help          this list
  /quit          leave (Ctrl+D too)
Ctrl+C stops an answer (what arrived is kept). A message that starts with / is sent as //text."""


def _interactive(args) -> bool:
    """No message on the command line and a person at a terminal: a conversation (see :func:`_repl`)."""
    return (args.text is None and sys.stdin is not None and sys.stdin.isatty()
            and sys.stdout is not None and sys.stdout.isatty())


class _Session:
    """What ``dsv41 chat`` talks to and how it prints: one or more turns (one, or a conversation at a terminal)."""

    def __init__(self, args, store: hist.HistoryStore, running, where: str, options: ChatOptions):
        self.args, self.store, self.running, self.where, self.options = args, store, running, where, options
        self.base_url = running.base_url

    def turn(self, conversation_id: int | None, text: str, out) -> TurnEnded | None:
        """Stream one turn to ``out``; Ctrl+C stops the answer (a second one raises KeyboardInterrupt)."""
        tty = out.isatty()
        cancel = CancelToken()
        state: dict[str, str | None] = {"in": None}     # which part is being printed: None, "reasoning", "content"
        ended: TurnEnded | None = None

        def switch(to: str) -> None:
            if state["in"] == to:
                return
            if state["in"] == "reasoning":
                out.write(RESET + "\n\n" if tty else "\n[answer]\n")
            elif to == "reasoning":
                out.write(DIM if tty else "[reasoning]\n")
            state["in"] = to

        gen = run_turn(self.store, conversation_id, engine=self.running, options=self.options, user_text=text,
                       cancel=cancel, read_timeout_s=self.args.timeout)

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
                    if not self.args.no_reasoning:
                        switch("reasoning")
                        out.write(terminal_safe(ev.text))
                        out.flush()
                elif isinstance(ev, ContentDelta):
                    switch("content")
                    out.write(terminal_safe(ev.text))
                    out.flush()
                elif isinstance(ev, TurnEnded):
                    ended = ev
        finally:
            gen.close()
            if old_handler is not None:
                signal.signal(signal.SIGINT, old_handler)
            if tty and state["in"] == "reasoning":
                out.write(RESET)
            if state["in"] is not None:
                out.write("\n")
            out.flush()
        return ended

    def report(self, ended: TurnEnded, interactive: bool = False) -> int:
        """Say how the turn ended (on stderr) and return the exit code: 0 complete, 130 stopped, 1 failed."""
        args, err = self.args, sys.stderr
        stats = ended.stats
        conv = ended.conversation_id
        if interactive:
            again = "ask again"
        else:
            again = ("run the same command again" if conv is None or args.conversation == conv else
                     f"run the same command again, or `dsv41 chat --conversation {conv} \"…\"` to continue")
        error = terminal_safe(ended.error or "", keep_newlines=False)
        if not ended.saved:
            if ended.status == hist.STATUS_STOPPED:
                print("[stopped before the engine answered; nothing was saved]", file=err)
            else:
                print(f"dsv41 chat: {error}", file=err)
                if ended.error_kind in ("unreachable", "auth"):
                    print(f"  (engine address from {self.where}: {terminal_safe(self.base_url)})", file=err)
                print(f"  Nothing was saved in the history; {again} once that is fixed.", file=err)
        elif ended.status == hist.STATUS_COMPLETE:
            line = stats.summary()
            note = stats.end_note(self.options.max_tokens)
            if note:
                line += " · " + note
            where = (f"conversation {conv}" if interactive else
                     f"saved as conversation {conv}; continue with --conversation {conv}")
            print(f"[{line} · {where}]", file=err)
        elif ended.status == hist.STATUS_STOPPED:
            tail = "" if interactive else f"; continue with --conversation {conv}"
            print(f"[stopped: {_arrived(stats)} · the partial answer is saved in conversation {conv}{tail}]", file=err)
        else:
            print(f"dsv41 chat: {error}", file=err)
            if ended.error_kind in ("unreachable", "auth"):
                print(f"  (engine address from {self.where}: {terminal_safe(self.base_url)})", file=err)
            if ended.content or ended.reasoning:
                print(f"  [{_arrived(stats)} · the partial answer is saved in conversation {conv}; "
                      f"{again}]", file=err)
            else:
                print(f"  [the question is saved in conversation {conv}; {again}]", file=err)
        if ended.status == hist.STATUS_COMPLETE:
            return 0
        if ended.status == hist.STATUS_STOPPED:
            return 130
        return 1


def run(args, ctx) -> int:
    interactive = _interactive(args)
    text = None if interactive else _read_text(args)
    if not interactive and (not text or not text.strip()):
        print("dsv41 chat: nothing to send: give the message as an argument or on standard input (or run "
              "`dsv41 chat` alone at a terminal for a conversation).", file=sys.stderr)
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
    if not (args.timeout > 0 and math.isfinite(args.timeout)):
        print("dsv41 chat: --timeout must be a number of seconds, more than 0.", file=sys.stderr)
        return 2
    if interactive and args.json:
        print("dsv41 chat: --json prints one answer: give the message as an argument or on standard input.",
              file=sys.stderr)
        return 2
    store = hist.HistoryStore()
    for n in store.notices:
        print(f"note: {terminal_safe(n, keep_newlines=False)}", file=sys.stderr)
    system = args.system
    if args.conversation is not None:
        try:
            conv = store.get_conversation(args.conversation)
        except hist.HistoryError as exc:
            print(f"dsv41 chat: {exc}", file=sys.stderr)
            return 1
        if system is None:                      # the conversation keeps the system prompt it was given
            system = ChatOptions.from_dict(conv.options).system
    options = ChatOptions(max_tokens=max_tokens, temperature=args.temperature,
                          reasoning_effort=args.reasoning_effort, reproducible=args.reproducible,
                          system=system if system and system.strip() else None)
    if args.connection:
        from .connections import attached_engine
        attached, rc = attached_engine("dsv41 chat", args.connection, args.url)
        if attached is None:
            return rc
        running, where = attached, f"connection {args.connection}"
        from ..engines import find_engine
        note = find_engine(running.engine).chat_note         # InferenceKey: answered whole, not streamed
        if note:
            print(f"note: {note}", file=sys.stderr)
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
    session = _Session(args, store, running, where, options)
    if interactive:
        return _repl(session, args.conversation)

    out = open(os.devnull, "w") if args.json else sys.stdout     # --json: only the JSON on stdout
    try:
        ended = session.turn(args.conversation, text or "", out)
    finally:
        if out is not sys.stdout:
            out.close()
    if ended is None:   # pragma: no cover - run_turn always ends with TurnEnded
        return 1
    rc = session.report(ended)
    if args.json:
        msg = store.message(ended.assistant_message_id) if ended.assistant_message_id is not None else None
        json.dump({"conversation_id": ended.conversation_id, "message": msg.to_dict() if msg else None,
                   "status": ended.status, "error": ended.error, "saved": ended.saved},
                  sys.stdout, indent=2, default=str)
        print()
    return rc


def _repl(session: _Session, conversation_id: int | None) -> int:
    """``dsv41 chat`` at a terminal with no message: a conversation. Each question is one turn, saved in the history
    as it streams (the same turn as a one-shot ``dsv41 chat``); /commands as in :data:`REPL_HELP`. Ctrl+C stops an
    answer (a second one during the same answer leaves), Ctrl+C at the prompt clears the line, Ctrl+D leaves.
    Returns 0 (or 130 when left with Ctrl+C during an answer)."""
    try:
        import readline  # noqa: F401 - line editing and recall for input()
    except ImportError:                 # pragma: no cover - every Linux Python has it
        pass
    err = sys.stderr
    first_system = session.options.system
    conv = conversation_id
    print(f"dsv41 chat: talking to {session.where} ({terminal_safe(session.base_url)}). Type a question; /help "
          f"lists the commands. Ctrl+C stops an answer, Ctrl+D leaves.", file=err)
    if conv is not None:
        print(f"(continuing conversation {conv})", file=err)
    if session.options.system:
        print(f"(system prompt: {terminal_safe(session.options.system, keep_newlines=False)})", file=err)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print(file=err)
            return 0
        except KeyboardInterrupt:
            print("\n(Ctrl+D or /quit leaves)", file=err)
            continue
        text = line.strip()
        if not text:
            continue
        if text.startswith("/") and not text.startswith("//"):
            cmd, _, rest = text.partition(" ")
            rest = rest.strip()
            if cmd in ("/quit", "/exit", "/q"):
                return 0
            if cmd in ("/help", "/?"):
                print(REPL_HELP, file=err)
            elif cmd == "/new":
                conv = None
                session.options = replace(session.options, system=first_system)
                print("(a new conversation: it is saved once the engine answers)", file=err)
            elif cmd == "/system":
                if not rest:
                    now = session.options.system
                    print(f"(system prompt: {terminal_safe(now, keep_newlines=False)})" if now else
                          "(no system prompt; /system TEXT sets one)", file=err)
                elif rest == "-":
                    session.options = replace(session.options, system=None)
                    print("(system prompt removed from the next question on)", file=err)
                else:
                    session.options = replace(session.options, system=rest)
                    print("(system prompt set: it goes with every question from the next one on, and is kept "
                          "with the conversation)", file=err)
            elif cmd == "/save":
                if conv is None:
                    print("(nothing to save yet: ask something first)", file=err)
                    continue
                print(f"(conversation {conv} is saved in the history as it streams: `dsv41 history show {conv}`; "
                      f"continue it later with `dsv41 chat --conversation {conv}`)", file=err)
                if rest:
                    from ..atomic import atomic_write_text
                    target = Path(rest).expanduser()
                    try:
                        atomic_write_text(target, session.store.export_markdown(conv))
                    except (OSError, hist.HistoryError) as exc:
                        print(f"(could not write {terminal_safe(str(target))}: {exc}; the conversation is still "
                              f"in the history)", file=err)
                    else:
                        print(f"(wrote {terminal_safe(str(target))})", file=err)
            else:
                print(f"(no command {terminal_safe(cmd)}: /help lists them; //text sends a message that starts "
                      f"with /)", file=err)
            continue
        if text.startswith("//"):
            text = text[1:]
        try:
            ended = session.turn(conv, text, sys.stdout)
        except KeyboardInterrupt:
            print("\n[left with Ctrl+C; what arrived is saved]", file=err)
            return 130
        if ended is None:   # pragma: no cover - run_turn always ends with TurnEnded
            return 1
        if ended.conversation_id is not None:
            conv = ended.conversation_id
        session.report(ended, interactive=True)


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
                print(f"{c.id:>5}  {_when(c.updated_at)}  {c.message_count:>3} msgs  "
                      f"{terminal_safe(c.title, keep_newlines=False)}{status}")
            return 0
        if cmd == "show":
            sys.stdout.write(terminal_safe(store.export_markdown(args.id)))   # an engine's words: no escapes
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
                # to a terminal, an engine's control characters are shown escaped; redirected, the text is as saved
                sys.stdout.write(terminal_safe(text) if sys.stdout.isatty() else text)
            return 0
        if cmd == "search":
            hits = store.search(args.text)
            if args.json:
                json.dump([h.__dict__ for h in hits], sys.stdout, indent=2, default=str)
                print()
                return 0
            if not hits:
                print(f"Nothing in the history contains {terminal_safe(repr(args.text))}.")
                return 1
            for h in hits:
                who = f" {h.role}:" if h.role else " title:"
                print(f"{h.conversation_id:>5}  {terminal_safe(h.title, keep_newlines=False)}\n       {who} "
                      f"{terminal_safe(h.snippet, keep_newlines=False)}")
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
