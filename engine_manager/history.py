"""Chat history: conversations and their messages in SQLite (WAL), owner-only, safe to kill at any moment.

One file, ``chat_history.sqlite3`` in the data dir (:func:`engine_manager.paths.data_dir`), mode 0600 (its ``-wal``
/ ``-shm`` files too). Every call opens its own short connection, so any thread may use a :class:`HistoryStore`; the
GUI runs them on worker threads. An answer is written as it streams (:class:`AnswerRecorder`, about twice a second),
each write its own committed transaction, so a killed panel loses at most the last half second. A streaming row
carries its writer's pid and start time; a later opener marks it ``interrupted`` once that writer is gone (a row of a
live writer, e.g. a ``dsv41 chat`` beside the panel, is left alone).
Statuses: ``complete``; ``streaming``; ``stopped`` (Stop pressed); ``interrupted`` (engine died, connection lost,
error frame mid-answer, panel closed or killed); ``error`` (a regenerate / edit accepted, then failed before any
token). A request the engine refuses (nothing listens, HTTP 401 / 409 / 503 …) is never written, and a new question
whose answer fails before its first token is taken back out (:func:`engine_manager.chat_turn.run_turn`), so
failures leave no empty conversations.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from contextlib import closing, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

from . import paths
from .atomic import ensure_private_dir, move_aside
from .chat_events import (
    StreamStats,  # the stats type only: the history never imports the chat client (httpx)
)
from .errors import UserError
from .procs import BOOT_ID, alive, ctime_of

DB_NAME = "chat_history.sqlite3"
SCHEMA_VERSION = 1

STATUS_COMPLETE = "complete"
STATUS_STREAMING = "streaming"
STATUS_STOPPED = "stopped"
STATUS_INTERRUPTED = "interrupted"
STATUS_ERROR = "error"
STATUSES = (STATUS_COMPLETE, STATUS_STREAMING, STATUS_STOPPED, STATUS_INTERRUPTED, STATUS_ERROR)

DEFAULT_TITLE = "New conversation"
TITLE_CHARS = 60

_SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    title       TEXT NOT NULL,
    titled      INTEGER NOT NULL DEFAULT 0,     -- 1 once a person (or the first message) named it
    created_at  REAL NOT NULL,
    updated_at  REAL NOT NULL,
    options     TEXT NOT NULL DEFAULT '{}'      -- the last request options used (JSON)
);
CREATE TABLE IF NOT EXISTS messages (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role            TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
    content         TEXT NOT NULL DEFAULT '',
    reasoning       TEXT NOT NULL DEFAULT '',
    status          TEXT NOT NULL DEFAULT 'complete',
    error           TEXT,
    options         TEXT,                       -- request options of an answer (JSON)
    stats           TEXT,                       -- chat.StreamStats of an answer (JSON)
    model           TEXT,
    writer_pid      INTEGER,                    -- who streams it (status 'streaming' only)
    writer_started  REAL,                       -- that process's start (guards against pid reuse): seconds
                                                -- since boot (older panels: a wall-clock time)
    writer_boot     TEXT,                       -- the boot it counts from (NULL: written by an older panel)
    created_at      REAL NOT NULL,
    updated_at      REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
CREATE INDEX IF NOT EXISTS messages_streaming ON messages(status) WHERE status = 'streaming';
"""


class HistoryError(UserError):
    """The history store could not do what was asked; ``str()`` says why in plain words."""


@dataclass
class Message:
    id: int
    conversation_id: int
    role: str
    content: str
    reasoning: str = ""
    status: str = STATUS_COMPLETE
    error: str | None = None
    options: dict[str, Any] | None = None
    stats: dict[str, Any] | None = None
    model: str | None = None
    created_at: float = 0.0
    updated_at: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ConversationInfo:
    id: int
    title: str
    created_at: float
    updated_at: float
    message_count: int = 0
    last_status: str | None = None
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class Conversation(ConversationInfo):
    messages: list[Message] = field(default_factory=list)


@dataclass
class SearchHit:
    conversation_id: int
    title: str
    message_id: int | None
    role: str | None
    snippet: str


def default_path() -> Path:
    return paths.data_dir() / DB_NAME


def _loads(text: str | None) -> Any:
    if not text:
        return None
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _dumps(obj: Any) -> str | None:
    return None if obj is None else json.dumps(obj, sort_keys=True, default=str)


def title_from(text: str) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "").lstrip("#>*- ").strip()
    if not line:
        return DEFAULT_TITLE
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1].rstrip() + "…"


# who writes an answer: this process, named by its start since boot and the boot's id (``procs.ctime_of``: a
# clock step leaves them alone, where psutil's create_time() moves by whole seconds); a row of an older panel holds
# a wall-clock start and no boot, and is compared the old way (``procs.alive``)
_ME_STARTED = ctime_of(os.getpid())


def _writer_alive(pid: Any, started: Any, boot: Any = None) -> bool:
    """The process a streaming row names still runs (values as read from the file: a damaged one names nobody)."""
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return False
    return alive(pid, started, boot)        # a boot that is not this one's id (text or not) names nobody


def _new_id(cur: sqlite3.Cursor) -> int:
    """The id of the row the INSERT on ``cur`` just added (``lastrowid`` is None only when it added none)."""
    rowid = cur.lastrowid
    if rowid is None:
        raise sqlite3.DatabaseError("the INSERT added no row")
    return rowid


def _message(row: sqlite3.Row) -> Message:
    return Message(id=row["id"], conversation_id=row["conversation_id"], role=row["role"], content=row["content"],
                   reasoning=row["reasoning"], status=row["status"], error=row["error"],
                   options=_loads(row["options"]), stats=_loads(row["stats"]), model=row["model"],
                   created_at=row["created_at"], updated_at=row["updated_at"])


class HistoryStore:
    """The chat history. ``HistoryStore()`` opens (creating if needed) the file in the data dir."""

    def __init__(self, path: Path | str | None = None):
        self.path = Path(path) if path else default_path()
        self.notices: list[str] = []
        self._open()
        self.recovered = self.recover_interrupted()

    # -- connections -------------------------------------------------------------------------------------
    def _raw_connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=10.0, isolation_level=None)
        conn.row_factory = sqlite3.Row
        conn.execute("PRAGMA foreign_keys = ON")
        conn.execute("PRAGMA busy_timeout = 10000")
        conn.execute("PRAGMA synchronous = NORMAL")     # WAL + NORMAL: a commit survives the process being killed
        return conn

    @contextmanager
    def connect(self) -> Iterator[sqlite3.Connection]:
        """A connection for one unit of work (autocommit; use ``with conn:``-less explicit BEGIN for more)."""
        with closing(self._raw_connect()) as conn:
            yield conn

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        with self.connect() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    def _open(self) -> None:
        ensure_private_dir(self.path.parent)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        os.close(fd)
        try:
            os.chmod(self.path, 0o600)
        except OSError:
            pass
        try:
            self._init_schema()
        except sqlite3.DatabaseError as exc:
            moved = move_aside(self.path, "corrupt")
            for suffix in ("-wal", "-shm"):
                side = Path(str(self.path) + suffix)
                if side.exists():
                    os.replace(side, Path(str(moved) + suffix))
            self.notices.append(
                f"The chat history {self.path} could not be read ({exc}); it was moved to {moved} and a new, empty "
                f"history was started.")
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            os.close(fd)
            self._init_schema()

    def _init_schema(self) -> None:
        with self.connect() as conn:
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                self.notices.append(f"The chat history could not use WAL mode (got {mode}); it still works.")
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise HistoryError(f"The chat history {self.path} was written by a newer dsv41 panel (schema "
                                   f"{version}); update the panel or move the file away.")
            conn.executescript(_SCHEMA)
            # a column added since schema 1 was first written (NULL where an older panel wrote the row, which it
            # may still do: it names its columns, so the schema's number stays)
            have = {r[1] for r in conn.execute("PRAGMA table_info(messages)").fetchall()}
            if "writer_boot" not in have:
                conn.execute("ALTER TABLE messages ADD COLUMN writer_boot TEXT")
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    # -- recovery ----------------------------------------------------------------------------------------
    def recover_interrupted(self) -> int:
        """Mark answers left ``streaming`` by a process that is gone as ``interrupted``; returns how many."""
        with self.connect() as conn:
            rows = conn.execute("SELECT id, writer_pid, writer_started, writer_boot FROM messages WHERE status = ?",
                                (STATUS_STREAMING,)).fetchall()
            dead = [r["id"] for r in rows
                    if not _writer_alive(r["writer_pid"], r["writer_started"], r["writer_boot"])]
            now = time.time()
            for mid in dead:
                conn.execute("UPDATE messages SET status = ?, error = ?, writer_pid = NULL, updated_at = ? "
                             "WHERE id = ? AND status = ?",
                             (STATUS_INTERRUPTED, "The program writing this answer ended before it was complete "
                              "(killed or crashed); what had arrived is kept.", now, mid, STATUS_STREAMING))
        return len(dead)

    # -- conversations -----------------------------------------------------------------------------------
    def create_conversation(self, title: str | None = None, options: dict[str, Any] | None = None) -> int:
        now = time.time()
        with self.connect() as conn:
            cur = conn.execute(
                "INSERT INTO conversations (title, titled, created_at, updated_at, options) VALUES (?, ?, ?, ?, ?)",
                (title.strip() if title and title.strip() else DEFAULT_TITLE, 1 if title and title.strip() else 0,
                 now, now, _dumps(options or {})))
            return _new_id(cur)

    def _check_conversation(self, conn: sqlite3.Connection, cid: int) -> sqlite3.Row:
        row = conn.execute("SELECT * FROM conversations WHERE id = ?", (int(cid),)).fetchone()
        if row is None:
            raise HistoryError(f"There is no conversation {cid} in the chat history (see `dsv41 history list`).")
        return row

    def list_conversations(self, limit: int | None = None) -> list[ConversationInfo]:
        sql = ("SELECT c.*, (SELECT COUNT(*) FROM messages m WHERE m.conversation_id = c.id) AS n, "
               "(SELECT m.status FROM messages m WHERE m.conversation_id = c.id ORDER BY m.id DESC LIMIT 1) AS last "
               "FROM conversations c ORDER BY c.updated_at DESC, c.id DESC")
        if limit:
            sql += f" LIMIT {int(limit)}"
        with self.connect() as conn:
            return [ConversationInfo(r["id"], r["title"], r["created_at"], r["updated_at"], r["n"], r["last"],
                                     _loads(r["options"]) or {}) for r in conn.execute(sql)]

    def get_conversation(self, cid: int) -> Conversation:
        with self.connect() as conn:
            r = self._check_conversation(conn, cid)
            msgs = [_message(m) for m in conn.execute(
                "SELECT * FROM messages WHERE conversation_id = ? ORDER BY id", (int(cid),))]
        return Conversation(r["id"], r["title"], r["created_at"], r["updated_at"], len(msgs),
                            msgs[-1].status if msgs else None, _loads(r["options"]) or {}, msgs)

    def messages(self, cid: int) -> list[Message]:
        with self.connect() as conn:
            return [_message(m) for m in conn.execute(
                "SELECT * FROM messages WHERE conversation_id = ? ORDER BY id", (int(cid),))]

    def message(self, mid: int) -> Message:
        with self.connect() as conn:
            row = conn.execute("SELECT * FROM messages WHERE id = ?", (int(mid),)).fetchone()
        if row is None:
            raise HistoryError(f"There is no message {mid} in the chat history.")
        return _message(row)

    def rename(self, cid: int, title: str) -> None:
        title = (title or "").strip()
        if not title:
            raise HistoryError("A conversation's title cannot be empty.")
        with self.connect() as conn:
            self._check_conversation(conn, cid)
            conn.execute("UPDATE conversations SET title = ?, titled = 1, updated_at = ? WHERE id = ?",
                         (title, time.time(), int(cid)))

    def delete(self, cid: int) -> None:
        with self.transaction() as conn:
            self._check_conversation(conn, cid)
            conn.execute("DELETE FROM messages WHERE conversation_id = ?", (int(cid),))
            conn.execute("DELETE FROM conversations WHERE id = ?", (int(cid),))

    def set_conversation_options(self, cid: int, options: dict[str, Any]) -> None:
        with self.connect() as conn:
            conn.execute("UPDATE conversations SET options = ? WHERE id = ?", (_dumps(options or {}), int(cid)))

    # -- messages ----------------------------------------------------------------------------------------
    def add_message(self, cid: int, role: str, content: str, *, reasoning: str = "",
                    status: str = STATUS_COMPLETE) -> int:
        now = time.time()
        with self.transaction() as conn:
            conv = self._check_conversation(conn, cid)
            cur = conn.execute(
                "INSERT INTO messages (conversation_id, role, content, reasoning, status, created_at, updated_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)", (int(cid), role, content, reasoning, status, now, now))
            if role == "user" and not conv["titled"]:
                conn.execute("UPDATE conversations SET title = ?, titled = 1 WHERE id = ?",
                             (title_from(content), int(cid)))
            conn.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, int(cid)))
            return _new_id(cur)

    def edit_message(self, cid: int, mid: int, content: str) -> None:
        """Replace a user message's text and drop every message after it (they answered the old text)."""
        with self.transaction() as conn:
            self._check_conversation(conn, cid)
            row = conn.execute("SELECT role, status FROM messages WHERE id = ? AND conversation_id = ?",
                               (int(mid), int(cid))).fetchone()
            if row is None:
                raise HistoryError(f"Message {mid} is not in conversation {cid}.")
            if row["role"] != "user":
                raise HistoryError("Only your own messages can be edited and sent again.")
            self._refuse_if_streaming(conn, cid, after=mid)
            now = time.time()
            conn.execute("UPDATE messages SET content = ?, updated_at = ? WHERE id = ?", (content, now, int(mid)))
            conn.execute("DELETE FROM messages WHERE conversation_id = ? AND id > ?", (int(cid), int(mid)))
            conn.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, int(cid)))

    def refuse_if_streaming(self, cid: int, after: int = 0) -> None:
        """Raise :class:`HistoryError` if an answer after message ``after`` is still being written by a live
        process (a regenerate or edit would delete it under its writer)."""
        with self.connect() as conn:
            self._check_conversation(conn, cid)
            self._refuse_if_streaming(conn, cid, after=after)

    def delete_messages(self, cid: int, ids: list[int]) -> None:
        """Delete these messages of conversation ``cid`` (a question taken back when its answer never began)."""
        if not ids:
            return
        with self.transaction() as conn:
            self._check_conversation(conn, cid)
            conn.executemany("DELETE FROM messages WHERE conversation_id = ? AND id = ?",
                             [(int(cid), int(m)) for m in ids])
            last = conn.execute("SELECT MAX(updated_at) AS t FROM messages WHERE conversation_id = ?",
                                (int(cid),)).fetchone()["t"]
            if last is not None:
                conn.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (last, int(cid)))

    def _refuse_if_streaming(self, conn: sqlite3.Connection, cid: int, after: int = 0) -> None:
        rows = conn.execute("SELECT writer_pid, writer_started, writer_boot FROM messages WHERE conversation_id = ? "
                            "AND id > ? AND status = ?", (int(cid), int(after), STATUS_STREAMING)).fetchall()
        if any(_writer_alive(r["writer_pid"], r["writer_started"], r["writer_boot"]) for r in rows):
            raise HistoryError("An answer in this conversation is still streaming; stop it first.")

    def drop_trailing_answers(self, cid: int) -> int | None:
        """For Regenerate: delete the assistant messages after the last user message; return that message's id
        (None if the conversation has no user message)."""
        with self.transaction() as conn:
            self._check_conversation(conn, cid)
            row = conn.execute("SELECT MAX(id) AS id FROM messages WHERE conversation_id = ? AND role = 'user'",
                               (int(cid),)).fetchone()
            last_user = row["id"] if row else None
            if last_user is None:
                return None
            self._refuse_if_streaming(conn, cid, after=last_user)
            conn.execute("DELETE FROM messages WHERE conversation_id = ? AND id > ?", (int(cid), int(last_user)))
            return int(last_user)

    def context_messages(self, cid: int, through_id: int | None = None) -> list[dict[str, str]]:
        """The conversation as OpenAI ``messages``: user and assistant texts (an answer's reasoning is not sent
        back; answers that produced no text are left out); with ``through_id``, only up to that message."""
        out: list[dict[str, str]] = []
        for m in self.messages(cid):
            if through_id is not None and m.id > through_id:
                break
            if m.role == "assistant" and not m.content.strip():
                continue
            out.append({"role": m.role, "content": m.content})
        return out

    def begin_answer(self, cid: int, *, options: dict[str, Any] | None = None,
                     model: str | None = None) -> "AnswerRecorder":
        now = time.time()
        with self.transaction() as conn:
            self._check_conversation(conn, cid)
            cur = conn.execute(
                "INSERT INTO messages (conversation_id, role, status, options, model, writer_pid, writer_started, "
                "writer_boot, created_at, updated_at) VALUES (?, 'assistant', ?, ?, ?, ?, ?, ?, ?, ?)",
                (int(cid), STATUS_STREAMING, _dumps(options), model, os.getpid(), _ME_STARTED, BOOT_ID, now, now))
            conn.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, int(cid)))
            mid = _new_id(cur)
        return AnswerRecorder(self, cid, mid)

    def mark_interrupted(self, mid: int, error: str) -> None:
        with self.connect() as conn:
            conn.execute("UPDATE messages SET status = ?, error = ?, writer_pid = NULL, updated_at = ? "
                         "WHERE id = ? AND status = ?", (STATUS_INTERRUPTED, error, time.time(), int(mid),
                                                         STATUS_STREAMING))

    # -- search and export -------------------------------------------------------------------------------
    def search(self, text: str, limit: int = 50) -> list[SearchHit]:
        """Conversations whose title or messages contain ``text`` (case-insensitive), newest first."""
        text = (text or "").strip()
        if not text:
            return []
        pat = "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        by_conv: dict[int, SearchHit] = {}
        order: list[tuple[float, int]] = []
        with self.connect() as conn:
            for r in conn.execute(
                    "SELECT m.id, m.conversation_id, m.role, m.content, m.reasoning, c.title, c.updated_at "
                    "FROM messages m JOIN conversations c ON c.id = m.conversation_id "
                    "WHERE m.content LIKE ? ESCAPE '\\' OR m.reasoning LIKE ? ESCAPE '\\' ORDER BY m.id",
                    (pat, pat)):
                if r["conversation_id"] in by_conv:
                    continue
                body = r["content"] if text.lower() in r["content"].lower() else r["reasoning"]
                by_conv[r["conversation_id"]] = SearchHit(r["conversation_id"], r["title"], r["id"], r["role"],
                                                          _snippet(body, text))
                order.append((r["updated_at"], r["conversation_id"]))
            for r in conn.execute("SELECT id, title, updated_at FROM conversations WHERE title LIKE ? ESCAPE '\\'",
                                  (pat,)):
                if r["id"] not in by_conv:
                    by_conv[r["id"]] = SearchHit(r["id"], r["title"], None, None, r["title"])
                    order.append((r["updated_at"], r["id"]))
        hits = [by_conv[cid] for _t, cid in sorted(order, key=lambda x: (-x[0], -x[1]))]
        return hits[:limit]

    def export_json(self, cid: int) -> dict[str, Any]:
        conv = self.get_conversation(cid)
        return {
            "schema": 1, "app": "dsv41-panel",
            "id": conv.id, "title": conv.title, "created_at": conv.created_at, "updated_at": conv.updated_at,
            "options": conv.options,
            "messages": [m.to_dict() for m in conv.messages],
        }

    def export_markdown(self, cid: int) -> str:
        conv = self.get_conversation(cid)
        out = [f"# {conv.title}", "",
               f"_Conversation {conv.id}, started {_when(conv.created_at)}, exported from dsv41 panel._", ""]
        system = (conv.options or {}).get("system")
        if isinstance(system, str) and system.strip():
            out += ["## System prompt", "", system.rstrip(), ""]
        for m in conv.messages:
            who = {"user": "You", "assistant": "Assistant", "system": "System"}.get(m.role, m.role)
            out.append(f"## {who}")
            out.append("")
            if m.reasoning.strip():
                out.append("<details><summary>Reasoning</summary>")
                out.append("")
                out.append(m.reasoning.strip())
                out.append("")
                out.append("</details>")
                out.append("")
            if m.content:
                out.append(m.content.rstrip())
                out.append("")
            note = _status_note(m)
            if note:
                out.append(f"_{note}_")
                out.append("")
        return "\n".join(out).rstrip() + "\n"


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def _status_note(m: Message) -> str:
    parts: list[str] = []
    if m.role == "assistant":
        stats = m.stats or {}
        if stats:
            parts.append(StreamStats.from_dict(stats).summary())
        if m.status != STATUS_COMPLETE:
            parts.append(m.status + (f": {m.error}" if m.error else ""))
    return " · ".join(parts)


def _snippet(body: str, text: str, width: int = 80) -> str:
    i = body.lower().find(text.lower())
    if i < 0:
        return body[:width].replace("\n", " ")
    start = max(0, i - width // 2)
    end = min(len(body), i + len(text) + width // 2)
    s = body[start:end].replace("\n", " ")
    return ("…" if start else "") + s + ("…" if end < len(body) else "")


class AnswerRecorder:
    """Writes one streaming answer: ``add_content`` / ``add_reasoning`` as deltas arrive, ``flush()`` when
    ``due()``, ``finish(status, stats, error)`` at the end. Holds one connection for the answer's life."""

    def __init__(self, store: HistoryStore, conversation_id: int, message_id: int):
        self.store, self.conversation_id, self.message_id = store, conversation_id, message_id
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._dirty = False
        self._last_flush = time.monotonic()
        self._conn: sqlite3.Connection | None = None
        self.flushes = 0
        self.finished = False

    @property
    def content(self) -> str:
        return "".join(self._content)

    @property
    def reasoning(self) -> str:
        return "".join(self._reasoning)

    @property
    def has_text(self) -> bool:
        return bool(self._content or self._reasoning)

    def add_content(self, text: str) -> None:
        self._content.append(text)
        self._dirty = True

    def add_reasoning(self, text: str) -> None:
        self._reasoning.append(text)
        self._dirty = True

    def due(self, interval_s: float) -> bool:
        return self._dirty and time.monotonic() - self._last_flush >= interval_s

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            self._conn = self.store._raw_connect()
        return self._conn

    def flush(self) -> None:
        if not self._dirty or self.finished:
            return
        now = time.time()
        self._connection().execute(
            "UPDATE messages SET content = ?, reasoning = ?, updated_at = ? WHERE id = ?",
            (self.content, self.reasoning, now, self.message_id))
        self._dirty = False
        self._last_flush = time.monotonic()
        self.flushes += 1

    def finish(self, status: str, stats: dict[str, Any] | None, error: str | None = None) -> None:
        if self.finished:
            return
        now = time.time()
        conn = self._connection()
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("UPDATE messages SET content = ?, reasoning = ?, status = ?, error = ?, stats = ?, "
                         "writer_pid = NULL, updated_at = ? WHERE id = ?",
                         (self.content, self.reasoning, status, error, _dumps(stats), now, self.message_id))
            conn.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, self.conversation_id))
            conn.execute("COMMIT")
        finally:
            self.finished = True
            self._conn = None
            conn.close()
