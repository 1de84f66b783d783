"""Saved connections to engines the panel did not start — on this machine or another one.

A connection is a name, a base URL (http or https, as the engine answers it on *its* machine) and, for an engine on
another machine, an SSH host: the panel then reaches it through an ``ssh -L`` forward (:mod:`.tunnel`), the URL's
host and port being where the engine listens over there. The list is ``connections.json`` in the config folder
(atomic, 0600, never through a symbolic link); the API key is kept apart, in the OS keyring (``keyring``) when one
is usable, else in ``connection-keys.json`` (0600) — never on a command line, in a log, in ``--json`` or the list.

:func:`detect` tells what runs behind a URL from what it answers: ``/api/health`` ``service`` ``strata`` (Strata) or
``strata-sim`` (the scripted engine); ``/props`` or ``llamacpp:*`` metrics (llama.cpp); ``vllm:*`` metrics or
``owned_by: vllm`` in ``/v1/models`` (vLLM); ``sglang:*`` (SGLang); a ``/v1/models`` list alone (a plain
OpenAI-compatible server). It never raises for what the server does: a refused connection, a TLS failure, a refused
key or a program that is not an LLM server come back as a :class:`Detection` with ``problem`` set, in plain words.
This module never imports Qt.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import math
import os
import re
import threading
import time
import urllib.parse
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Literal

from . import atomic, paths
from .engines import find_engine, get_engine
from .engines.base import Evidence, mask_in
from .engines.registry import DETECTION_ORDER
from .errors import UserError
from .fmt import MB
from .engine_state import RunningEngine
from .detection import DETECT_DEADLINE_S, DETECT_TIMEOUT_S, KIND_LABELS, Detection, transport_problem
from .tls import verify as tls_verify

if TYPE_CHECKING:
    import ssl

SCHEMA = 1
KEYRING_SERVICE = "dsv41-panel"
CONNECTIONS_FILE = "connections.json"
KEYS_FILE = "connection-keys.json"
LOCK_FILE = ".connections.lock"
FILE_CAP = 4 * MB                   # the list and the key file: a few kB each in real use
MAX_CONNECTIONS = 1000
LOCK_WAIT_S = 30.0
MODELS_KEPT = 20                    # model ids kept (and printed) of a server's list; the count says the rest
MODEL_ID_CHARS = 200
MESSAGE_CHARS = 1000
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

#: each kind of engine (its adapter in ``engine_manager.engines``) → its name in the list (``Engine.kind_label``)

#: a detection's ``problem`` that means the engine could not be reached at all (it may be down, or the network);
#: the others (a refused key, not an LLM server, TLS, an answer too large) mean something answered and said no
UNREACHABLE_PROBLEMS = frozenset({"refused", "timeout", "dns", "slow", "http", "unreachable", "unknown_host",
                                  "closed", "forward_failed", "ssh_failed", "no_ssh", "host_key_unknown",
                                  "host_key_changed", "auth_refused", "bad_host", "bad_port"})


class ConnectionSetupError(UserError):
    """A connection cannot be saved, found or reached; the message says what to do. ``str(exc)`` names the
    ``dsv41`` commands that fix it; ``gui`` says the same in the window's words (the buttons and fields there)."""

    def __init__(self, message: str, *, gui: str | None = None):
        super().__init__(message)
        self.gui = gui or message


def gui_words(exc: BaseException) -> str:
    """What to show a user of the window for ``exc``: its ``gui`` words when it has them, else its message."""
    gui = getattr(exc, "gui", None)
    return gui if isinstance(gui, str) and gui else str(exc)


#: what to do about a connection's key, in the window's words (the CLI says `dsv41 connections add … --replace`)
GUI_KEY_FIX = ("type the engine's key in the API key field of Attach to… (a saved connection: Remove it, then "
               "attach to it again with the key). The key of this panel's own engine: Copy API key, beside "
               "its address.")


# -- the saved list -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LastTest:
    """The one record of a connection's last test — by ``dsv41 connections test/add``, by watching it in the
    window, or by the window's overview when its state changed: what answered, and when it was last seen."""

    t: float                            # when it was tested
    state: str                          # "ok" | "unreachable" | "problem"
    kind: str | None = None             # what answered (when it did)
    message: str = ""                   # in plain words (the key masked)
    last_ok: float | None = None        # when it last answered (None: never, as far as this machine knows)
    gui_message: str = ""               # ``message`` in the window's words, where they differ

    def words(self, gui: bool = False) -> str:
        return (self.gui_message or self.message) if gui else self.message

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Connection:
    name: str
    base_url: str                       # as the engine answers on its own machine
    ssh_host: str | None = None         # reach it through `ssh -L` to this host (the user's ssh config applies)
    kind: str | None = None             # last detected kind (a hint for lists; detection runs again on use)
    key_store: str | None = None        # "keyring" | "file" | None (no key)
    added_at: float = field(default_factory=time.time)
    last_test: LastTest | None = None

    def to_dict(self) -> dict[str, Any]:
        """For the list file and ``--json``: no key in it, ever (it is not a field)."""
        return asdict(self)

    @property
    def remote(self) -> bool:
        return bool(self.ssh_host)


def connections_file() -> Path:
    return paths.config_dir() / CONNECTIONS_FILE


def keys_file() -> Path:
    return paths.config_dir() / KEYS_FILE


# -- the files, validated ------------------------------------------------------------------------------------------
def _finite(v: float | None) -> float | None:
    if v is not None and not math.isfinite(v):
        raise ValueError("not a finite number")
    return v


_FILE_MODEL: Any = None


def _file_model() -> Any:
    """The list file's shape as pydantic models, built on first use: the engine column imports this module in the
    window's first step, and pydantic's import alone is 0.11–0.16 s (benchmarks/results/startup.md, eleventh
    pass); the window reads the list itself a step later."""
    global _FILE_MODEL
    if _FILE_MODEL is not None:
        return _FILE_MODEL
    from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

    class _LastTestRecord(BaseModel):
        model_config = ConfigDict(extra="ignore", strict=True)

        t: float = Field(ge=0)
        state: Literal["ok", "unreachable", "problem"]
        kind: str | None = Field(None, max_length=40)
        message: str = Field("", max_length=4 * MESSAGE_CHARS)
        last_ok: float | None = Field(None, ge=0)
        gui_message: str = Field("", max_length=4 * MESSAGE_CHARS)

        _check_t = field_validator("t", "last_ok")(_finite)

    class _ConnectionRecord(BaseModel):
        """One saved connection as the list file must hold it: every field typed, the URL and host as
        :func:`add_connection` would accept them."""

        model_config = ConfigDict(extra="ignore", strict=True)

        name: str = Field(pattern=_NAME_RE.pattern)
        base_url: str = Field(max_length=2048)
        ssh_host: str | None = None
        kind: str | None = None
        key_store: Literal["keyring", "file"] | None = None
        added_at: float = Field(0.0, ge=0)
        last_test: _LastTestRecord | None = None

        _check_added = field_validator("added_at")(_finite)

        @field_validator("base_url")
        @classmethod
        def _url(cls, v: str) -> str:
            try:
                return check_url(v)
            except ConnectionSetupError as exc:
                raise ValueError(str(exc)) from None

        @field_validator("ssh_host")
        @classmethod
        def _host(cls, v: str | None) -> str | None:
            from .tunnel import valid_host

            if v is not None and not valid_host(v):
                raise ValueError("not an ssh host")
            return v or None

        @field_validator("kind")
        @classmethod
        def _kind(cls, v: str | None) -> str | None:
            if v is not None and v not in KIND_LABELS:
                raise ValueError(f"not a kind of engine the panel knows ({', '.join(KIND_LABELS)})")
            return v

    class _ConnectionsFile(BaseModel):
        model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

        schema_version: int = Field(SCHEMA, alias="schema", ge=1)
        connections: list[_ConnectionRecord] = Field(max_length=MAX_CONNECTIONS)

        @model_validator(mode="after")
        def _unique(self) -> "_ConnectionsFile":
            names = [c.name for c in self.connections]
            if len(set(names)) != len(names):
                raise ValueError("a name is saved twice")
            return self

        def to_connections(self) -> list[Connection]:
            out = []
            for r in self.connections:
                lt = r.last_test
                out.append(Connection(name=r.name, base_url=r.base_url, ssh_host=r.ssh_host, kind=r.kind,
                                      key_store=r.key_store, added_at=r.added_at,
                                      last_test=LastTest(lt.t, lt.state, lt.kind, lt.message, lt.last_ok,
                                                         lt.gui_message)
                                      if lt is not None else None))
            return out

    _FILE_MODEL = _ConnectionsFile
    return _FILE_MODEL


_lock = threading.RLock()
_flock_depth = 0


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """Hold the list and the key file for a read-modify-write: a thread lock in this process and an ``fcntl``
    lock on ``.connections.lock`` between processes (two ``dsv41 connections add`` at once, the window and the
    CLI). Re-entrant within a thread. The kernel drops the lock when its holder dies, so a stale one cannot
    block."""
    global _flock_depth
    with _lock:
        fd = None
        if _flock_depth == 0:
            path = paths.config_dir() / LOCK_FILE
            atomic.ensure_private_dir(path.parent)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, atomic.OWNER_ONLY)
            except OSError as exc:
                raise ConnectionSetupError(f"Cannot open the lock of the saved connections ({path}): "
                                           f"{exc.strerror or exc}. Remove it if it is a link or a folder.") from None
            deadline = time.monotonic() + LOCK_WAIT_S
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                        os.close(fd)
                        raise
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise ConnectionSetupError(f"Another dsv41 has held the saved connections for "
                                               f"{LOCK_WAIT_S:.0f} s ({path}); wait for it to finish, then try "
                                               "again.")
                time.sleep(0.02)
        _flock_depth += 1
        try:
            yield
        finally:
            _flock_depth -= 1
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)


def _set_aside(path: Path, why: str, what: str, redo: str) -> ConnectionSetupError:
    """Move a file that cannot be used out of the way (never deleted, never half-used) and say so."""
    try:
        moved: Path | str = atomic.move_aside(path, "invalid")
        kept = f"it was kept as {moved}"
    except FileNotFoundError:
        kept = "another dsv41 has already set it aside"
    except OSError as exc:
        return ConnectionSetupError(f"{path} cannot be used ({why}) and could not be moved aside ({exc}): move it "
                                    "away yourself, then try again.")
    return ConnectionSetupError(f"{path} could not be used as {what} ({why}); {kept}, and a new one is started. "
                                f"{redo}")


_ABSENT = object()


def _read_file(path: Path) -> Any:
    """The JSON of one of the two files; :data:`_ABSENT` when it is not there. Raises :class:`ConnectionSetupError`
    for a link, and ``ValueError`` (why) for anything else that is not a JSON document of at most
    :data:`FILE_CAP`."""
    try:
        return atomic.read_json_capped(path, FILE_CAP)
    except FileNotFoundError:
        return _ABSENT
    except atomic.LinkRefused as exc:
        raise ConnectionSetupError(str(exc)) from None
    except atomic.NotARegularFile:
        raise ValueError("it is not a regular file") from None
    except PermissionError as exc:
        raise ConnectionSetupError(f"{path} cannot be read ({exc.strerror}): it should belong to you with mode "
                                   f"0600 (`chmod 600 {path}`).") from None


def load_connections() -> list[Connection]:
    """The saved list, every record validated. A file that does not fit (a wrong type, a bad date, a record
    without its URL, 100,000 nested brackets, not JSON at all) is moved aside and :class:`ConnectionSetupError`
    says where; the next call starts from an empty list. Never a half-used file."""
    path = connections_file()
    redo = ("Add your connections again with `dsv41 connections add` (their keys are still in the keyring or "
            "the key file).")
    try:
        d = _read_file(path)
        if d is _ABSENT:
            return []
        if not isinstance(d, dict):
            raise ValueError(f"it holds a JSON {type(d).__name__}, not the list's object")
        return _file_model().model_validate(d).to_connections()
    except ValueError as exc:       # pydantic's ValidationError is one
        if hasattr(exc, "errors"):
            from .engine_record import why_invalid
            raise _set_aside(path, why_invalid(exc), "the list of saved connections", redo) from None
        raise _set_aside(path, str(exc), "the list of saved connections", redo) from None


def _save(conns: Iterable[Connection]) -> None:
    atomic.atomic_write_json(connections_file(), {"schema": SCHEMA, "connections": [c.to_dict() for c in conns]})


def get_connection(name: str) -> Connection:
    conns = load_connections()
    for c in conns:
        if c.name == name:
            return c
    known = ", ".join(c.name for c in conns) or "none yet"
    raise ConnectionSetupError(f"There is no saved connection named {name!r} (saved: {known}). Add it with "
                               f"`dsv41 connections add {name} URL`.")


def check_url(url: str) -> str:
    """A base URL as saved: http/https, a host, a port in 1–65535 when one is given, no credentials, no query;
    trailing slash dropped."""
    import httpx

    text = url.strip() if isinstance(url, str) else ""
    try:
        u = httpx.URL(text)
        port = urllib.parse.urlsplit(text).port        # raises for a port out of 0–65535 or not a number
    except Exception:  # noqa: BLE001 - any parse failure is a bad URL
        u, port = None, None
    if u is None or u.scheme not in ("http", "https") or not u.host:
        raise ConnectionSetupError(f"{url!r} is not an engine address: give its base URL, such as "
                                   "http://127.0.0.1:8000 or https://gpu-box.example:8443 (a port from 1 to "
                                   "65535).")
    if port is not None and not 1 <= port <= 65535 or (u.port is not None and not 1 <= u.port <= 65535):
        raise ConnectionSetupError(f"{url!r} names port {port if port is not None else u.port}: a TCP port is 1 to "
                                   "65535. Give the port the engine listens on.")
    if u.userinfo:
        raise ConnectionSetupError("Put no user name or password in the URL: the API key is asked for separately and "
                                   "kept in the keyring (or an owner-only file).")
    if u.query or u.fragment:
        raise ConnectionSetupError(f"{url!r} has a query or fragment: give only the base URL, such as "
                                   "http://127.0.0.1:8000.")
    return str(u).rstrip("/")


def check_new(name: str, base_url: str, api_key: str | None, ssh_host: str | None
             ) -> tuple[str, str | None, str | None]:
    """What :func:`add_connection` would save, checked (nothing is saved): (url, ssh host, key). Raises
    :class:`ConnectionSetupError` in plain words."""
    from .tunnel import valid_host

    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ConnectionSetupError(f"{name!r} cannot name a connection: use letters, digits, '.', '_' or '-' "
                                   "(up to 64, starting with a letter or digit).")
    url = check_url(base_url)
    if ssh_host is not None:
        ssh_host = ssh_host.strip() or None
    if ssh_host is not None and not valid_host(ssh_host):
        raise ConnectionSetupError(f"{ssh_host!r} is not an ssh host: use a name such as gpu-box, user@gpu-box or a "
                                   "Host from ~/.ssh/config (it may not start with '-', or hold spaces, quotes or "
                                   "any of $ ` ; | & < >).")
    if api_key is not None:
        api_key = api_key.strip() or None
    if api_key is not None and (any(c in api_key for c in "\r\n\0") or not api_key.isprintable()):
        raise ConnectionSetupError("The API key holds a line break or a control character: paste just the key.")
    from .inferencekey.endpoint import endpoint_ref, key_problem

    if endpoint_ref(url) is not None and key_problem(api_key) is not None:     # an InferenceKey endpoint's key
        raise ConnectionSetupError(str(key_problem(api_key)))
    return url, ssh_host, api_key


def add_connection(name: str, base_url: str, api_key: str | None = None, ssh_host: str | None = None, *,
                   replace: bool = False, tested: "Detection | None" = None) -> Connection:
    """Save a connection (and its key, apart from it), under the lock between processes. Raises
    :class:`ConnectionSetupError` on a bad name, URL or host, or an existing name without ``replace``.
    ``tested``: the detection just run on these very values — kept as the connection's last test."""
    url, ssh_host, api_key = check_new(name, base_url, api_key, ssh_host)
    with _locked():
        conns = load_connections()
        if any(c.name == name for c in conns) and not replace:
            raise ConnectionSetupError(f"A connection named {name!r} exists already: remove it first "
                                       f"(`dsv41 connections remove {name}`) or pick another name.")
        conns = [c for c in conns if c.name != name]
        conn = Connection(name=name, base_url=url, ssh_host=ssh_host)
        _forget_key(name)
        conn.key_store = _store_key(name, api_key) if api_key else None
        if tested is not None:
            conn.last_test = _last_test_of(tested, None, api_key)
            if tested.ok:
                conn.kind = tested.kind
        conns.append(conn)
        _save(conns)
    return conn


def remove_connection(name: str) -> Connection:
    with _locked():
        conns = load_connections()
        gone = [c for c in conns if c.name == name]
        if not gone:
            get_connection(name)          # raises the plain-words "no such connection"
        _save([c for c in conns if c.name != name])
        _forget_key(name)
    close_tunnel(name)
    return gone[0]


def state_of(det: "Detection") -> str:
    """``ok``, ``unreachable`` (nothing answered: down, or the network) or ``problem`` (something answered and
    said no: a refused key, not an LLM server, TLS)."""
    if det.ok:
        return "ok"
    return "unreachable" if (det.problem or "") in UNREACHABLE_PROBLEMS else "problem"


def _last_test_of(det: "Detection", previous: LastTest | None, api_key: str | None,
                  t: float | None = None) -> LastTest:
    now = time.time() if t is None else t
    state = state_of(det)
    last_ok = now if state == "ok" else (previous.last_ok if previous is not None else None)
    message = mask_in(det.message, [api_key] if api_key else [])[:MESSAGE_CHARS]
    gui = mask_in(det.gui_message, [api_key] if api_key else [])[:MESSAGE_CHARS]
    return LastTest(t=now, state=state, kind=det.kind if det.ok else None, message=message, last_ok=last_ok,
                    gui_message=gui)


def record_test(name: str, det: "Detection", api_key: str | None = None, *, t: float | None = None
                ) -> LastTest | None:
    """Keep ``det`` as the connection's one record of its last test (and its kind when it answered); None when
    no connection of that name is saved (removed meanwhile). Read by ``dsv41 connections list`` and the window
    alike. ``t``: when it was seen (default: now)."""
    with _locked():
        conns = load_connections()
        for c in conns:
            if c.name == name:
                c.last_test = _last_test_of(det, c.last_test, api_key, t)
                if det.ok:
                    c.kind = det.kind
                _save(conns)
                return c.last_test
    return None


def set_kind(name: str, kind: str | None) -> None:
    """Remember the last detected kind (a hint for lists)."""
    with _locked():
        conns = load_connections()
        for c in conns:
            if c.name == name and c.kind != kind:
                c.kind = kind
                _save(conns)
                return


# -- the key: keyring, else an owner-only file ------------------------------------------------------------------
def usable_keyring() -> Any | None:
    """The OS keyring backend, when one that can store secrets is there; None otherwise (a headless box, no D-Bus
    session, keyring not installed: the ``fail`` backend or priority 0)."""
    try:
        import keyring
        from keyring.backends import fail
    except ImportError:
        return None
    try:
        kr = keyring.get_keyring()
        if isinstance(kr, fail.Keyring) or float(getattr(kr, "priority", 0) or 0) <= 0:
            return None
        return kr
    except Exception:  # noqa: BLE001 - any failure of the backend lookup means: no keyring
        return None


def _file_keys() -> dict[str, str]:
    """The owner-only key file: ``{name: key}``. One that does not fit (not an object of strings) is moved aside
    and :class:`ConnectionSetupError` says so; its keys are kept there, never half-used."""
    path = keys_file()
    try:
        d = _read_file(path)
        if d is _ABSENT:
            return {}
        if not isinstance(d, dict) or not all(isinstance(k, str) and isinstance(v, str) and v.isprintable()
                                              for k, v in d.items()):
            raise ValueError("it is not an object of names and keys")
        return d
    except ValueError as exc:
        raise _set_aside(path, str(exc), "the connections' key file",
                         "Give each connection its key again: `dsv41 connections add NAME URL --replace`.") from None


def _store_key(name: str, key: str) -> str:
    kr = usable_keyring()
    if kr is not None:
        try:
            kr.set_password(KEYRING_SERVICE, f"connection:{name}", key)
            return "keyring"
        except Exception:  # noqa: BLE001 - a locked or broken keyring: the owner-only file keeps the key
            pass
    keys = _file_keys()
    keys[name] = key
    atomic.atomic_write_json(keys_file(), keys)
    return "file"


def _forget_key(name: str) -> None:
    kr = usable_keyring()
    if kr is not None:
        try:
            kr.delete_password(KEYRING_SERVICE, f"connection:{name}")
        except Exception:  # noqa: BLE001 - nothing stored there
            pass
    keys = _file_keys()
    if name in keys:
        del keys[name]
        atomic.atomic_write_json(keys_file(), keys)


def connection_key(conn: Connection | str) -> str | None:
    """The connection's API key (None when it has none). Raises :class:`ConnectionSetupError` when the keyring that
    holds it cannot be read."""
    c = conn if isinstance(conn, Connection) else get_connection(conn)
    if c.key_store == "keyring":
        kr = usable_keyring()
        try:
            key = kr.get_password(KEYRING_SERVICE, f"connection:{c.name}") if kr is not None else None
        except Exception as exc:  # noqa: BLE001
            raise ConnectionSetupError(f"The OS keyring did not give the key of {c.name!r} ({type(exc).__name__}): "
                                   "unlock your keyring (log in to the desktop session) and try again.") from None
        if key is None:
            raise ConnectionSetupError(f"The key of {c.name!r} is no longer in the OS keyring: add the connection "
                                       f"again (`dsv41 connections add {c.name} {c.base_url} --replace`).",
                                       gui=f"The key of {c.name!r} is no longer in the OS keyring: "
                                       + GUI_KEY_FIX)
        return key
    if c.key_store == "file":
        key = _file_keys().get(c.name)
        if key is None:
            raise ConnectionSetupError(f"The key of {c.name!r} is no longer in {keys_file()}: add the connection "
                                       f"again (`dsv41 connections add {c.name} {c.base_url} --replace`).",
                                       gui=f"The key of {c.name!r} is no longer in {keys_file()}: " + GUI_KEY_FIX)
        return key
    return None


# -- detection ----------------------------------------------------------------------------------------------------
def _clip(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def detect(base_url: str, api_key: str | None, *, timeout_s: float = DETECT_TIMEOUT_S,
           deadline_s: float = DETECT_DEADLINE_S, verify: bool | ssl.SSLContext = True) -> Detection:
    """Ask ``base_url`` what it is (see the module docstring). Sends ``api_key`` (as ``Authorization: Bearer``)
    only to ``base_url``, the address the user saved (through its SSH forward's own socket for a tunnel URL).
    Every answer is read with a size cap (1 MB; 16 MB for ``/metrics``) and the whole detection ends within
    ``deadline_s``, however slowly the server drips; the key is masked in every word it returns."""
    import httpx

    from .engines import prometheus_text as prom
    from .engines._http import (
        METRICS_BODY_CAP,
        SMALL_BODY_CAP,
        AnswerTooLarge,
        AnswerTooSlow,
        bearer_headers,
        get_capped,
        json_body,
    )
    from .tunnel import transport_for

    from .inferencekey.endpoint import detect_endpoint, endpoint_ref

    if endpoint_ref(base_url) is not None:       # …/endpoint/<project>/<workload>/v1: its own routes and key
        return detect_endpoint(base_url, api_key, timeout_s=timeout_s, deadline_s=deadline_s, verify=verify)
    det = Detection(base_url=base_url.rstrip("/"))
    url = det.base_url
    secrets = [api_key] if api_key else []
    auth_refused: list[str] = []
    too_large: dict[str, str] = {}
    end = time.monotonic() + deadline_s
    with httpx.Client(timeout=httpx.Timeout(timeout_s), headers=bearer_headers(api_key), trust_env=False,
                      verify=tls_verify(verify), follow_redirects=False,
                      transport=transport_for(url, verify=verify)) as client:
        def get(path: str, cap: int = SMALL_BODY_CAP) -> httpx.Response | None:
            rest = end - time.monotonic()
            if rest <= 0:
                raise AnswerTooSlow(f"the answers at {url} did not arrive within {deadline_s:g} s")
            try:
                r = get_capped(client, url + path, cap=cap, deadline_s=rest)
            except AnswerTooLarge as exc:
                too_large[path] = str(exc)
                return None
            if r.status_code in (401, 403):
                auth_refused.append(f"{path} (HTTP {r.status_code})")
            return r

        try:
            health = get("/api/health")
            models_r = get("/v1/models")
            metrics_r = get("/metrics", METRICS_BODY_CAP)
            props_r = get("/props")
        except (httpx.HTTPError, OSError, AnswerTooSlow) as exc:
            det.problem, det.message = transport_problem(exc, url, timeout_s, deadline_s)
            return det.masked(secrets)

    def code(r: httpx.Response | None) -> str:
        return "too large" if r is None else f"HTTP {r.status_code}"

    def body(r: httpx.Response | None) -> Any:
        if r is None or r.status_code != 200:
            return None
        try:
            return json_body(r)
        except ValueError:
            return None

    hj = body(health)
    service = hj.get("service") if isinstance(hj, dict) and isinstance(hj.get("service"), str) else None
    owned_by: set[str] = set()
    models_ok = False
    mj = body(models_r)
    data = mj.get("data") if isinstance(mj, dict) else None
    if isinstance(data, list):
        models_ok = True
        for m in data:
            if not isinstance(m, dict):
                continue
            mid, owner = m.get("id"), m.get("owned_by")
            if isinstance(mid, str):
                det.models_total += 1
                if len(det.models) < MODELS_KEPT:
                    det.models.append(_clip(mid, MODEL_ID_CHARS))
            if isinstance(owner, str) and len(owned_by) < 16:
                owned_by.add(owner.lower()[:40])
    metric_names: frozenset[str] = frozenset()
    if metrics_r is not None and metrics_r.status_code == 200:
        try:
            metric_names = frozenset(prom.parse(metrics_r.text, time.time()).names())
        except Exception:  # noqa: BLE001 - /metrics that is not Prometheus text says nothing about the kind
            pass
    pj = body(props_r)
    props_ok = isinstance(pj, dict) and bool({"default_generation_settings", "total_slots", "build_info"} & set(pj))

    # each adapter says whether the answers are its kind's (Engine.recognise), the specific before the generic
    evidence = Evidence(service=service, metric_names=metric_names, owned_by=frozenset(owned_by), props=props_ok,
                        models=models_ok)
    for kind in DETECTION_ORDER:
        eng = get_engine(kind)
        said = eng.recognise(evidence)
        if said is not None:
            det.kind, det.simulated = eng.name, eng.simulated
            det.found += said[0]
            det.missing += said[1]
            break
    if models_ok:
        shown = ", ".join(det.models) if det.models else "(an empty list)"
        more = det.models_total - len(det.models)
        det.found.append("models: " + shown + (f" and {more:,} more" if more > 0 else ""))
    elif det.kind is not None and not auth_refused:
        det.missing.append(f"the model list (/v1/models answered {code(models_r)})")
    for path, why in too_large.items():
        det.missing.append(f"{path}: {why}")

    if auth_refused:
        det.problem = "auth"
        what = f"a {det.label} server" if det.kind else "a server"
        if api_key:
            det.message = (f"{what} at {url} refused the API key ({', '.join(auth_refused)}). Check the key: "
                           "add the connection again with the right one (`dsv41 connections add NAME URL "
                           "--replace`).")
            det.gui_message = (f"{what} at {url} refused the API key ({', '.join(auth_refused)}). Check the key: "
                               "type the right one in the API key field of Attach to… (a saved connection: Remove "
                               "it, then attach to it again with the right key). The key of this panel's own "
                               "engine: Copy API key, beside its address.")
        else:
            det.message = (f"{what} at {url} asks for an API key ({', '.join(auth_refused)}) and none is saved: add "
                           "the connection again with --api-key-file or --api-key-stdin.")
            det.gui_message = (f"{what} at {url} asks for an API key ({', '.join(auth_refused)}) and none was "
                               "given: " + GUI_KEY_FIX)
        return det.masked(secrets)
    if det.kind is None:
        det.problem = "not_llm"
        seen = f"/api/health {code(health)}, /v1/models {code(models_r)}, /metrics {code(metrics_r)}"
        det.message = (f"Something answers at {url}, but not an LLM server the panel knows ({seen}). Wrong port? "
                       "An engine answers /v1/models (OpenAI API).")
        return det.masked(secrets)
    det.ok = True
    det.message = f"{det.label} at {url}" + (" (simulated)" if det.simulated else "")
    return det.masked(secrets)


def _tunnel_url(conn_url: str, t: Any) -> str:
    """The URL that reaches ``conn_url`` through the open tunnel ``t`` (its host names the tunnel)."""
    import httpx

    u = httpx.URL(conn_url)
    path = u.raw_path.decode("ascii").rstrip("/")
    return f"{u.scheme}://{t.url_host}:{t.remote_port}{path}"


def _forward_target(conn_url: str) -> tuple[str, int]:
    import httpx

    u = httpx.URL(conn_url)
    return u.host, u.port or (443 if u.scheme == "https" else 80)


def check_connection(name: str, *, ssh_options: list[str] | None = None) -> Detection:
    """Reach a saved connection (through its SSH forward when it names a host) and detect what answers; the
    result is kept as its last test (:func:`record_test`). Tunnel failures come back as a Detection with
    ``problem`` = the ssh cause."""
    from .tunnel import TunnelError

    conn = get_connection(name)
    key = connection_key(conn)
    try:
        url = _local_url(conn, ssh_options)
    except TunnelError as exc:
        det = Detection(base_url=conn.base_url, problem=exc.cause, message=str(exc))
    else:
        det = detect(url, key)
        det.base_url = conn.base_url
        if conn.remote:
            det.found.insert(0, f"SSH forward through {conn.ssh_host} to {conn.base_url}")
    record_test(name, det, key)
    return det


def check_unsaved(base_url: str, api_key: str | None, ssh_host: str | None = None, *,
                  ssh_options: list[str] | None = None) -> Detection:
    """"Test connection" before it is saved (the GUI's Add dialog, ``dsv41 connections add``): :func:`detect`,
    through a throwaway SSH forward when ``ssh_host`` is given (closed before returning). A bad URL or host
    raises :class:`ConnectionSetupError`."""
    from .tunnel import Tunnel, TunnelError, valid_host

    url = check_url(base_url)
    host = (ssh_host or "").strip()
    if not host:
        return detect(url, api_key)
    if not valid_host(host):
        raise ConnectionSetupError(f"{host!r} is not an ssh host: use a name such as gpu-box or user@gpu-box.")
    rhost, rport = _forward_target(url)
    try:
        with Tunnel(host, rport, remote_host=rhost, options=list(ssh_options or [])) as t:
            det = detect(_tunnel_url(url, t), api_key)
    except TunnelError as exc:
        return Detection(base_url=url, problem=exc.cause, message=str(exc))
    det.base_url = url
    det.found.insert(0, f"SSH forward through {host} to {url}")
    return det


# -- attaching: tunnels and the RunningEngine ---------------------------------------------------------------------
_tunnels: dict[str, Any] = {}
_tunnels_lock = threading.Lock()
_opening: dict[str, threading.Lock] = {}          # one opening at a time per connection


def _local_url(conn: Connection, ssh_options: list[str] | None = None) -> str:
    """The URL to use from this machine: the saved one, or one that reaches it through the connection's SSH
    forward (a Unix socket; opened once and kept until :func:`close_tunnel`). Raises ``TunnelError``."""
    if not conn.remote:
        return conn.base_url
    from .tunnel import Tunnel

    rhost, rport = _forward_target(conn.base_url)
    with _tunnels_lock:
        opening = _opening.setdefault(conn.name, threading.Lock())
    with opening:
        with _tunnels_lock:
            t = _tunnels.get(conn.name)
            stale = t is not None and (not t.alive() or t.host != conn.ssh_host or t.remote_port != rport
                                       or t.remote_host != rhost)
            if stale:
                _tunnels.pop(conn.name, None)
        if stale and t is not None:
            t.close()
            t = None
        if t is None:
            t = Tunnel(conn.ssh_host or "", rport, remote_host=rhost, options=list(ssh_options or []))
            with _tunnels_lock:
                _tunnels[conn.name] = t            # closable (close_all_tunnels) while ssh is still logging in
            try:
                t.open()
            except BaseException:
                with _tunnels_lock:
                    if _tunnels.get(conn.name) is t:
                        del _tunnels[conn.name]
                raise
    return _tunnel_url(conn.base_url, t)


def tunnel_for(name: str) -> Any | None:
    with _tunnels_lock:
        return _tunnels.get(name)


def close_tunnel(name: str) -> None:
    """Close the SSH forward of ``name`` (when the connection is closed or removed)."""
    with _tunnels_lock:
        t = _tunnels.pop(name, None)
    if t is not None:
        t.close()


def close_all_tunnels() -> None:
    """Close every SSH forward — those still opening too (their ssh is ended at once)."""
    with _tunnels_lock:
        ts = list(_tunnels.values())
        _tunnels.clear()
    for t in ts:
        t.close()


atexit.register(close_all_tunnels)


def resolve_connection(name: str, *, ssh_options: list[str] | None = None) -> RunningEngine:
    """The running engine a saved connection reaches, as the one typed handle the monitor and the chat use
    (``started_by_panel=False``: no Stop is ever offered or sent). Opens the SSH forward when the connection
    names a host (closed by :func:`close_tunnel` or at exit); its ``base_url`` is then the forward's URL, which
    only the forward's transport reaches (:func:`engine_manager.tunnel.transport_for`). The result is kept as the
    connection's last test. Raises :class:`ConnectionSetupError` in plain words when nothing usable answers."""
    from .tunnel import TunnelError

    conn = get_connection(name)
    key = connection_key(conn)
    try:
        url = _local_url(conn, ssh_options)
    except TunnelError as exc:
        record_test(name, Detection(base_url=conn.base_url, problem=exc.cause, message=str(exc)), key)
        raise ConnectionSetupError(f"Connection {name!r}: {exc}") from None
    det = detect(url, key)
    record_test(name, det, key)
    if not det.ok:
        raise ConnectionSetupError(f"Connection {name!r}: {det.message}",
                                   gui=f"Connection {name!r}: {det.words(gui=True)}")
    where = f" via {conn.ssh_host}" if conn.remote else ""
    host = (urllib.parse.urlsplit(conn.base_url).hostname or "").lower()
    here = not conn.remote and (host in ("localhost", "::1") or host.startswith("127."))
    url = find_engine(det.kind).chat_base(url)     # the URL the chat appends /v1/chat/completions to
    return RunningEngine(base_url=url, api_key=key or "", engine=det.kind or "openai_compat",
                         label=f"{name}: {det.label}{where}", simulated=det.simulated, started_by_panel=False,
                         on_this_machine=here)


# -- the overview: every saved connection, polled at a low rate ----------------------------------------------------
OVERVIEW_PERIOD_S = 5.0
OVERVIEW_TIMEOUT_S = 3.0            # one line's whole poll (detection included): its deadline


@dataclass
class ConnectionStatus:
    """One line of the overview: what a saved connection is doing now. Missing figures are None, never 0.
    ``unreachable`` is its own state: nothing answered (with the reason and when it was last seen), and no figure
    is shown for it — never one carried over from an earlier reading or another engine."""

    name: str
    t: float
    state: str                           # "ok" | "unreachable" | "problem"
    kind: str | None = None
    label: str = ""
    users: int | None = None             # requests running (slots busy)
    queued: int | None = None
    decode_tok_s: float | None = None
    simulated: bool = False
    message: str = ""                    # the reason in plain words, when state is not "ok"
    last_seen: float | None = None       # when it last answered (None: not since this machine knows it)
    gui_message: str = ""                # ``message`` in the window's words, where they differ

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _poll_failure_state(exc: BaseException) -> str:
    """A poll's failure: ``unreachable`` when nothing answered in time, ``problem`` when something answered."""
    import httpx

    from .engines._http import AnswerTooSlow

    return "unreachable" if isinstance(exc, (httpx.TransportError, AnswerTooSlow, OSError)) else "problem"


class OverviewPoller:
    """Polls saved connections: detection the first time (and after a problem), then the engine adapter's
    ``poll`` with the previous sample of *that same engine* (kind, address and process), so rates come from two
    readings of one engine. Every request has a size cap and an overall deadline (``timeout_s``), so a line is
    never held up longer than that. Thread-safe: the window polls each connection on its own worker
    (:meth:`poll_one`), so one slow connection holds up neither the others nor the panel's own engine
    (:meth:`poll_running`). A connection whose state changes (it stops or starts answering, or says no) has that
    kept as its last test (:func:`record_test`), so ``dsv41 connections list`` says what the window saw."""

    def __init__(self, *, timeout_s: float | None = None, ssh_options: list[str] | None = None,
                 record: bool = True):
        self.timeout_s = OVERVIEW_TIMEOUT_S if timeout_s is None else timeout_s
        self.ssh_options = ssh_options
        self.record = record
        self._lock = threading.Lock()
        self._prev: dict[str, tuple[tuple[Any, ...], Any]] = {}      # name -> (which engine, its previous Sample)
        self._kind: dict[str, tuple[str, str, bool]] = {}           # name -> (kind, url, simulated)
        self._last_ok: dict[str, float] = {}
        self._state: dict[str, str] = {}                            # name -> the state last recorded

    def poll(self) -> list[ConnectionStatus]:
        """Every saved connection, one after the other (the CLI; the window polls each on its own)."""
        try:
            conns = load_connections()
        except ConnectionSetupError:
            return []
        return [self.poll_one(c) for c in conns]

    def _previous(self, name: str, ident: tuple[Any, ...]) -> Any:
        with self._lock:
            got = self._prev.get(name)
        return got[1] if got is not None and got[0] == ident else None

    def _forget(self, name: str) -> None:
        with self._lock:
            self._prev.pop(name, None)
            self._kind.pop(name, None)

    def poll_running(self, name: str, running: RunningEngine) -> ConnectionStatus:
        """A line for an engine known by its handle (the GUI's own engine, not a saved connection): its adapter's
        poll with the previous sample, no detection. ``name`` must not be a saved connection's name."""
        import httpx

        from .engines import get_engine
        from .metrics.sources import plain_engine_error, spec_for
        from .tunnel import transport_for

        ident = (running.engine, running.base_url, running.pid)
        try:
            eng = get_engine(running.engine)
            with httpx.Client(timeout=httpx.Timeout(self.timeout_s), trust_env=False, verify=tls_verify(),
                              transport=transport_for(running.base_url)) as client:
                s = eng.poll(client, spec_for(eng, running.base_url, running.api_key), self._previous(name, ident))
        except Exception as exc:  # noqa: BLE001 - a failing engine is a line of the overview, never a crash
            self._forget(name)
            seen = self._last_ok.get(name)
            return ConnectionStatus(name, time.time(), _poll_failure_state(exc), running.engine, running.label,
                                    message=mask_in(plain_engine_error(exc, running.base_url, self.timeout_s),
                                                    [running.api_key]), last_seen=seen)
        with self._lock:
            self._prev[name] = (ident, s)
            self._last_ok[name] = s.t
        return ConnectionStatus(name, s.t, "ok", running.engine, running.label, users=_count(s.slots_busy),
                                queued=_count(s.queued), decode_tok_s=_rate(s.decode_tok_s),
                                simulated=running.simulated or s.simulated, last_seen=s.t)

    def poll_one(self, conn: Connection) -> ConnectionStatus:
        """One line for ``conn`` (never raises): ``ok`` with its figures, or ``unreachable``/``problem`` with the
        reason and when it was last seen, and no figures."""
        st = self._poll_one(conn)
        if st.state == "ok":
            with self._lock:
                self._last_ok[conn.name] = st.t
        else:
            self._forget(conn.name)
            seen = self._last_ok.get(conn.name)
            if seen is None and conn.last_test is not None:
                seen = conn.last_test.last_ok
            st.last_seen = seen
        self._record(conn, st)
        return st

    def _record(self, conn: Connection, st: ConnectionStatus) -> None:
        """Keep a change of state as the connection's last test (the file is written on changes only)."""
        if not self.record:
            return
        with self._lock:
            before = self._state.get(conn.name) or (conn.last_test.state if conn.last_test is not None else None)
            self._state[conn.name] = st.state
        if before == st.state and not (st.state == "ok" and conn.last_test is not None
                                       and conn.last_test.kind != st.kind):
            return
        det = Detection(base_url=conn.base_url, ok=st.state == "ok", kind=st.kind,
                        problem=None if st.state == "ok" else ("refused" if st.state == "unreachable" else "http"),
                        message=st.message or f"{st.label} at {conn.base_url}", gui_message=st.gui_message)
        try:
            record_test(conn.name, det, t=st.t)
        except (ConnectionSetupError, OSError):
            pass                     # a list that cannot be written now: the line is still shown

    def _poll_one(self, conn: Connection) -> ConnectionStatus:
        import httpx

        from .engines import get_engine
        from .metrics.sources import plain_engine_error, spec_for
        from .tunnel import TunnelError, transport_for

        now = time.time()
        key: str | None = None
        try:
            key = connection_key(conn)
            with self._lock:
                known = self._kind.get(conn.name)
            if known is None:
                url = _local_url(conn, self.ssh_options)
                det = detect(url, key, timeout_s=self.timeout_s, deadline_s=self.timeout_s)
                if not det.ok:
                    return ConnectionStatus(conn.name, now, state_of(det), det.kind, det.label,
                                            message=det.message, gui_message=det.gui_message)
                known = (det.kind or "openai_compat", url, det.simulated)
                with self._lock:
                    self._kind[conn.name] = known
            kind, url, simulated = known
            eng = get_engine(kind)
            ident = (kind, url)
            with httpx.Client(timeout=httpx.Timeout(self.timeout_s), trust_env=False, verify=tls_verify(),
                              transport=transport_for(url)) as client:
                s = eng.poll(client, spec_for(eng, url, key or ""), self._previous(conn.name, ident))
        except TunnelError as exc:
            return ConnectionStatus(conn.name, now, "unreachable", message=str(exc))
        except ConnectionSetupError as exc:
            return ConnectionStatus(conn.name, now, "problem", message=str(exc), gui_message=gui_words(exc))
        except Exception as exc:  # noqa: BLE001 - a failing engine is a line of the overview, never a crash
            why = plain_engine_error(exc, conn.base_url, self.timeout_s)
            return ConnectionStatus(conn.name, now, _poll_failure_state(exc), conn.kind,
                                    KIND_LABELS.get(conn.kind or "", ""),
                                    message=mask_in(why, [key] if key else []))
        with self._lock:
            self._prev[conn.name] = (ident, s)
        return ConnectionStatus(conn.name, s.t, "ok", kind, KIND_LABELS.get(kind, kind), users=_count(s.slots_busy),
                                queued=_count(s.queued), decode_tok_s=_rate(s.decode_tok_s),
                                simulated=simulated or s.simulated, last_seen=s.t)


def _count(v: Any) -> int | None:
    """A number of requests as shown: None (missing) unless a whole number ≥ 0."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        return None
    return int(v)


def _rate(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        return None
    return float(v)
