"""Saved connections to engines the panel did not start — on this machine or another one (issue 19).

A connection is a name, a base URL (http or https, as the engine answers it on *its* machine) and, for an engine
on another machine, an SSH host: then the panel reaches it through an ``ssh -L`` forward (:mod:`.tunnel`) and the
URL's host and port are where the engine listens over there (usually ``http://127.0.0.1:PORT``).

The list lives in ``connections.json`` in the config folder (atomic, 0600, never through a symbolic link). The API
key is kept apart: in the OS keyring (the ``keyring`` library: Secret Service, KWallet, macOS Keychain, Windows
Credential Locker) when one is usable, else in ``connection-keys.json`` beside the list (0600, atomic). It is never
put on a command line, in a log, in ``--json`` output or in the list file.

What runs behind a URL is **detected** from what it answers (:func:`detect`):

- ``/api/health`` with ``service`` ``strata`` → Strata; ``strata-sim`` → the scripted engine (simulated);
- ``/props`` (llama-server's own) or ``llamacpp:*`` Prometheus names on ``/metrics`` → llama.cpp;
- ``vllm:*`` on ``/metrics`` (or ``owned_by: vllm`` in ``/v1/models``) → vLLM;
- ``sglang:*`` on ``/metrics`` → SGLang;
- a ``/v1/models`` list and nothing else → a plain OpenAI-compatible server.

:func:`detect` never raises for what the server does: a refused connection, a TLS failure, a refused key or a
program that is not an LLM server come back as a :class:`Detection` with ``problem`` set and plain words.

This module never imports Qt.
"""

from __future__ import annotations

import atexit
import json
import re
import ssl
import threading
import time
import urllib.parse
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from . import atomic, paths
from .errors import UserError
from .session import RunningEngine

SCHEMA = 1
KEYRING_SERVICE = "dsv41-panel"
CONNECTIONS_FILE = "connections.json"
KEYS_FILE = "connection-keys.json"
DETECT_TIMEOUT_S = 5.0
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

#: the engine adapter (``engine_manager.engines``) for each detected kind
KIND_LABELS = {
    "strata": "Strata", "sim": "scripted engine (simulated)", "llamacpp": "llama.cpp (llama-server)",
    "vllm": "vLLM", "sglang": "SGLang", "openai_compat": "OpenAI-compatible server",
}


class ConnectionSetupError(UserError):
    """A connection cannot be saved, found or reached; the message says what to do."""


# -- the saved list -----------------------------------------------------------------------------------------------
@dataclass
class Connection:
    name: str
    base_url: str                       # as the engine answers on its own machine
    ssh_host: str | None = None         # reach it through `ssh -L` to this host (the user's ssh config applies)
    kind: str | None = None             # last detected kind (a hint for lists; detection runs again on use)
    key_store: str | None = None        # "keyring" | "file" | None (no key)
    added_at: float = field(default_factory=time.time)

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


_lock = threading.RLock()


def _read_json(path: Path) -> Any:
    try:
        raw = atomic.read_bytes_nofollow(path)
    except FileNotFoundError:
        return None
    except atomic.LinkRefused as exc:
        raise ConnectionSetupError(str(exc)) from None
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        moved = atomic.move_aside(path)
        raise ConnectionSetupError(f"{path} was not readable JSON; it was kept as {moved}. The panel starts a new one: "
                               "add your connections again (their keys are still in the keyring or key file)."
                               ) from None


def load_connections() -> list[Connection]:
    with _lock:
        d = _read_json(connections_file())
    out: list[Connection] = []
    for e in (d or {}).get("connections", []) if isinstance(d, dict) else []:
        if not isinstance(e, dict) or not isinstance(e.get("name"), str) or not isinstance(e.get("base_url"), str):
            continue
        out.append(Connection(name=e["name"], base_url=e["base_url"], ssh_host=e.get("ssh_host") or None,
                              kind=e.get("kind"), key_store=e.get("key_store"),
                              added_at=float(e.get("added_at") or 0.0)))
    return out


def _save(conns: Iterable[Connection]) -> None:
    atomic.atomic_write_json(connections_file(), {"schema": SCHEMA, "connections": [c.to_dict() for c in conns]})


def get_connection(name: str) -> Connection:
    for c in load_connections():
        if c.name == name:
            return c
    known = ", ".join(c.name for c in load_connections()) or "none yet"
    raise ConnectionSetupError(f"There is no saved connection named {name!r} (saved: {known}). Add it with "
                           f"`dsv41 connections add {name} URL`.")


def check_url(url: str) -> str:
    """A base URL as saved: http/https, a host, no credentials, no query; trailing slash dropped."""
    import httpx

    try:
        u = httpx.URL(url.strip())
    except Exception:  # noqa: BLE001 - any parse failure is a bad URL
        u = None
    if u is None or u.scheme not in ("http", "https") or not u.host:
        raise ConnectionSetupError(f"{url!r} is not an engine address: give its base URL, such as "
                               "http://127.0.0.1:8000 or https://gpu-box.example:8443.")
    if u.userinfo:
        raise ConnectionSetupError("Put no user name or password in the URL: the API key is asked for separately and "
                               "kept in the keyring (or an owner-only file).")
    if u.query or u.fragment:
        raise ConnectionSetupError(f"{url!r} has a query or fragment: give only the base URL, such as "
                               "http://127.0.0.1:8000.")
    return str(u).rstrip("/")


def add_connection(name: str, base_url: str, api_key: str | None = None, ssh_host: str | None = None, *,
                   replace: bool = False) -> Connection:
    """Save a connection (and its key, apart from it). Raises :class:`ConnectionSetupError` on a bad name, URL or
    host, or an existing name without ``replace``."""
    from .tunnel import valid_host

    if not _NAME_RE.match(name or ""):
        raise ConnectionSetupError(f"{name!r} cannot name a connection: use letters, digits, '.', '_' or '-' "
                               "(up to 64, starting with a letter or digit).")
    url = check_url(base_url)
    if ssh_host is not None:
        ssh_host = ssh_host.strip() or None
    if ssh_host is not None and not valid_host(ssh_host):
        raise ConnectionSetupError(f"{ssh_host!r} is not an ssh host: use a name such as gpu-box, user@gpu-box or a "
                               "Host from ~/.ssh/config (it may not start with '-' or hold spaces).")
    if api_key is not None:
        api_key = api_key.strip() or None
    if api_key is not None and any(c in api_key for c in "\r\n\0"):
        raise ConnectionSetupError("The API key holds a line break: paste just the key.")
    with _lock:
        conns = load_connections()
        if any(c.name == name for c in conns) and not replace:
            raise ConnectionSetupError(f"A connection named {name!r} exists already: remove it first "
                                   f"(`dsv41 connections remove {name}`) or pick another name.")
        conns = [c for c in conns if c.name != name]
        conn = Connection(name=name, base_url=url, ssh_host=ssh_host)
        _forget_key(name)
        conn.key_store = _store_key(name, api_key) if api_key else None
        conns.append(conn)
        _save(conns)
    return conn


def remove_connection(name: str) -> Connection:
    with _lock:
        conns = load_connections()
        gone = [c for c in conns if c.name == name]
        if not gone:
            get_connection(name)          # raises the plain-words "no such connection"
        _save([c for c in conns if c.name != name])
        _forget_key(name)
    close_tunnel(name)
    return gone[0]


def set_kind(name: str, kind: str | None) -> None:
    """Remember the last detected kind (a hint for lists)."""
    with _lock:
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
    d = _read_json(keys_file())
    return {k: v for k, v in d.items() if isinstance(k, str) and isinstance(v, str)} if isinstance(d, dict) else {}


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
                                       f"again (`dsv41 connections add {c.name} {c.base_url} --replace`).")
        return key
    if c.key_store == "file":
        return _file_keys().get(c.name)
    return None


# -- detection ----------------------------------------------------------------------------------------------------
@dataclass
class Detection:
    """What answers at a URL, in plain words. ``ok``: an LLM server answered and accepted the key."""

    base_url: str
    ok: bool = False
    kind: str | None = None            # engine adapter name (engine_manager.engines), when recognised
    problem: str | None = None         # refused | tls | timeout | dns | auth | not_llm | http
    message: str = ""
    found: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    models: list[str] = field(default_factory=list)
    simulated: bool = False

    @property
    def label(self) -> str:
        return KIND_LABELS.get(self.kind or "", "unknown")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["label"] = self.label
        return d

    def summary(self) -> str:
        lines = [self.message]
        if self.found:
            lines.append("found: " + "; ".join(self.found))
        if self.missing:
            lines.append("missing: " + "; ".join(self.missing))
        return "\n".join(lines)


def _transport_problem(exc: BaseException, url: str) -> tuple[str, str]:
    import httpx

    text = str(exc)
    chain: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and len(chain) < 6:
        chain.append(e)
        e = e.__cause__ or e.__context__
    if any(isinstance(x, ssl.SSLError) for x in chain) or "SSL" in text or "certificate" in text.lower():
        if "WRONG_VERSION_NUMBER" in text or "record layer failure" in text.lower():
            return "tls", (f"TLS failed at {url}: the server there speaks plain HTTP. Use http:// instead of "
                           "https:// in the connection.")
        if "CERTIFICATE_VERIFY_FAILED" in text or "certificate" in text.lower():
            return "tls", (f"TLS failed at {url}: the server's certificate is not trusted ({text}). Give the "
                           "server a certificate your system trusts, or reach it over SSH (`--ssh HOST`) with "
                           "http:// on its loopback.")
        return "tls", f"TLS failed at {url} ({text}). Check that the server really serves https on that port."
    if isinstance(exc, httpx.TimeoutException):
        return "timeout", (f"{url} did not answer within {DETECT_TIMEOUT_S:.0f} s: a firewall may drop the "
                           "connection, or the server is overloaded. Check the address and port.")
    low = text.lower()
    if "name or service not known" in low or "nodename nor servname" in low or "no address associated" in low \
            or "temporary failure in name resolution" in low:
        return "dns", f"The host name in {url} could not be resolved: check its spelling."
    if isinstance(exc, httpx.ConnectError) or "connection refused" in low:
        return "refused", (f"Nothing listens at {url} (connection refused): wrong port, or the engine is not "
                           "running. Check the port the engine was started with.")
    if isinstance(exc, httpx.RemoteProtocolError):
        return "not_llm", (f"The program at {url} does not speak HTTP ({text}): wrong port? If it speaks https, "
                           "use https:// in the connection.")
    return "http", f"Could not talk to {url}: {text}."


def detect(base_url: str, api_key: str | None, *, timeout_s: float = DETECT_TIMEOUT_S,
           verify: bool | ssl.SSLContext = True) -> Detection:
    """Ask ``base_url`` what it is (see the module docstring). Sends ``api_key`` (as ``Authorization: Bearer``)
    only to ``base_url``, the address the user saved."""
    import httpx

    from .engines import prom

    det = Detection(base_url=base_url.rstrip("/"))
    url = det.base_url
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    auth_refused: list[str] = []
    with httpx.Client(timeout=httpx.Timeout(timeout_s), headers=headers, trust_env=False, verify=verify,
                      follow_redirects=False) as client:
        def get(path: str) -> httpx.Response:
            r = client.get(url + path)
            if r.status_code in (401, 403):
                auth_refused.append(f"{path} (HTTP {r.status_code})")
            return r

        try:
            health = get("/api/health")
        except (httpx.HTTPError, OSError) as exc:
            det.problem, det.message = _transport_problem(exc, url)
            return det
        try:
            models_r = get("/v1/models")
            metrics_r = get("/metrics")
            props_r = get("/props")
        except (httpx.HTTPError, OSError) as exc:
            det.problem, det.message = _transport_problem(exc, url)
            return det

    service = None
    if health.status_code == 200:
        try:
            hj = health.json()
            service = hj.get("service") if isinstance(hj, dict) else None
        except ValueError:
            pass
    owned_by: set[str] = set()
    models_ok = False
    if models_r.status_code == 200:
        try:
            data = models_r.json().get("data")
            if isinstance(data, list):
                models_ok = True
                for m in data:
                    if isinstance(m, dict):
                        if isinstance(m.get("id"), str):
                            det.models.append(m["id"])
                        if isinstance(m.get("owned_by"), str):
                            owned_by.add(m["owned_by"].lower())
        except (ValueError, AttributeError):
            pass
    prefixes: set[str] = set()
    if metrics_r.status_code == 200:
        try:
            scrape = prom.parse(metrics_r.text, time.time())
            for p in ("llamacpp:", "vllm:", "sglang:", "strata"):
                if scrape.has_prefix(p):
                    prefixes.add(p)
        except Exception:  # noqa: BLE001 - /metrics that is not Prometheus text says nothing about the kind
            pass
    props_ok = False
    if props_r.status_code == 200:
        try:
            pj = props_r.json()
            props_ok = isinstance(pj, dict) and bool({"default_generation_settings", "total_slots", "build_info"}
                                                     & set(pj))
        except ValueError:
            pass

    if isinstance(service, str) and service.lower() == "strata-sim":
        det.kind, det.simulated = "sim", True
        det.found.append("the scripted engine's /api/health (service strata-sim): its figures are simulated")
    elif isinstance(service, str) and "strata" in service.lower():
        det.kind = "strata"
        det.found.append(f"Strata's /api/health (service {service})")
    elif props_ok or "llamacpp:" in prefixes:
        det.kind = "llamacpp"
        if props_ok:
            det.found.append("llama-server's /props")
        if "llamacpp:" in prefixes:
            det.found.append("llama.cpp metrics (llamacpp:*) on /metrics")
        else:
            det.missing.append("llama-server's /metrics (start it with --metrics): token rates are missing")
    elif "vllm:" in prefixes or "vllm" in owned_by:
        det.kind = "vllm"
        if "vllm:" in prefixes:
            det.found.append("vLLM metrics (vllm:*) on /metrics")
        else:
            det.found.append("vLLM's model list (owned_by vllm)")
            det.missing.append("vLLM's /metrics: load, token rates and latencies are missing")
    elif "sglang:" in prefixes or "sglang" in owned_by:
        det.kind = "sglang"
        if "sglang:" in prefixes:
            det.found.append("SGLang metrics (sglang:*) on /metrics")
        else:
            det.found.append("SGLang's model list")
            det.missing.append("SGLang's /metrics (start it with --enable-metrics): load and latencies are missing")
    elif models_ok:
        det.kind = "openai_compat"
        det.missing.append("load figures: a plain OpenAI-compatible server reports none (users, tok/s, KV cache "
                           "show as missing)")
    if models_ok:
        det.found.append("models: " + (", ".join(det.models) if det.models else "(an empty list)"))
    elif det.kind is not None and not auth_refused:
        det.missing.append(f"the model list (/v1/models answered HTTP {models_r.status_code})")

    if auth_refused:
        det.problem = "auth"
        what = f"a {det.label} server" if det.kind else "a server"
        if api_key:
            det.message = (f"{what} at {url} refused the API key ({', '.join(auth_refused)}). Check the key: "
                           "add the connection again with the right one (`dsv41 connections add NAME URL "
                           "--replace`).")
        else:
            det.message = (f"{what} at {url} asks for an API key ({', '.join(auth_refused)}) and none is saved: add "
                           "the connection again with --api-key-file or --api-key-stdin.")
        return det
    if det.kind is None:
        det.problem = "not_llm"
        seen = f"/api/health HTTP {health.status_code}, /v1/models HTTP {models_r.status_code}, /metrics HTTP " \
               f"{metrics_r.status_code}"
        det.message = (f"Something answers at {url}, but not an LLM server the panel knows ({seen}). Wrong port? "
                       "An engine answers /v1/models (OpenAI API).")
        return det
    det.ok = True
    det.message = f"{det.label} at {url}" + (" (simulated)" if det.simulated else "")
    return det


def check_connection(name: str, *, ssh_options: list[str] | None = None) -> Detection:
    """Reach a saved connection (through its SSH forward when it names a host) and detect what answers; the
    detected kind is remembered. Tunnel failures come back as a Detection with ``problem`` = the ssh cause."""
    from .tunnel import TunnelError

    conn = get_connection(name)
    key = connection_key(conn)
    try:
        url = _local_url(conn, ssh_options)
    except TunnelError as exc:
        return Detection(base_url=conn.base_url, problem=exc.cause, message=str(exc))
    det = detect(url, key)
    if conn.remote:
        det.found.insert(0, f"SSH forward through {conn.ssh_host} to {conn.base_url}")
    if det.ok:
        set_kind(name, det.kind)
    return det


def check_unsaved(base_url: str, api_key: str | None, ssh_host: str | None = None, *,
                  ssh_options: list[str] | None = None) -> Detection:
    """"Test connection" before it is saved (the GUI's Add dialog): :func:`detect`, through a throwaway SSH forward
    when ``ssh_host`` is given (closed before returning). A bad URL raises :class:`ConnectionSetupError`."""
    import httpx

    from .tunnel import Tunnel, TunnelError

    url = check_url(base_url)
    host = (ssh_host or "").strip()
    if not host:
        return detect(url, api_key)
    u = httpx.URL(url)
    try:
        with Tunnel(host, u.port or (443 if u.scheme == "https" else 80), remote_host=u.host,
                    options=list(ssh_options or [])) as t:
            det = detect(f"{u.scheme}://127.0.0.1:{t.local_port}{u.raw_path.decode('ascii').rstrip('/')}", api_key)
    except TunnelError as exc:
        return Detection(base_url=url, problem=exc.cause, message=str(exc))
    det.found.insert(0, f"SSH forward through {host} to {url}")
    return det


# -- attaching: tunnels and the RunningEngine ---------------------------------------------------------------------
_tunnels: dict[str, Any] = {}
_tunnels_lock = threading.Lock()


def _local_url(conn: Connection, ssh_options: list[str] | None = None) -> str:
    """The URL to use from this machine: the saved one, or the local end of an SSH forward (opened once and
    kept until :func:`close_tunnel`)."""
    import httpx

    if not conn.remote:
        return conn.base_url
    from .tunnel import Tunnel

    u = httpx.URL(conn.base_url)
    port = u.port or (443 if u.scheme == "https" else 80)
    with _tunnels_lock:
        t = _tunnels.get(conn.name)
        if t is None or not t.alive() or t.host != conn.ssh_host:
            if t is not None:
                t.close()
            t = Tunnel(conn.ssh_host or "", port, remote_host=u.host, options=list(ssh_options or [])).open()
            _tunnels[conn.name] = t
    path = u.raw_path.decode("ascii").rstrip("/")
    return f"{u.scheme}://127.0.0.1:{t.local_port}{path}"


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
    with _tunnels_lock:
        ts = list(_tunnels.values())
        _tunnels.clear()
    for t in ts:
        t.close()


atexit.register(close_all_tunnels)


def resolve_connection(name: str, *, ssh_options: list[str] | None = None) -> RunningEngine:
    """The running engine a saved connection reaches, as the one typed handle the monitor and the chat use
    (``started_by_panel=False``: no Stop is ever offered or sent). Opens the SSH forward when the connection
    names a host (closed by :func:`close_tunnel` or at exit). Raises :class:`ConnectionSetupError` in plain words
    when nothing usable answers."""
    from .tunnel import TunnelError

    conn = get_connection(name)
    key = connection_key(conn)
    try:
        url = _local_url(conn, ssh_options)
    except TunnelError as exc:
        raise ConnectionSetupError(f"Connection {name!r}: {exc}") from None
    det = detect(url, key)
    if not det.ok:
        raise ConnectionSetupError(f"Connection {name!r}: {det.message}")
    set_kind(name, det.kind)
    where = f" via {conn.ssh_host}" if conn.remote else ""
    host = (urllib.parse.urlsplit(conn.base_url).hostname or "").lower()
    here = not conn.remote and (host in ("localhost", "::1") or host.startswith("127."))
    return RunningEngine(base_url=url, api_key=key or "", engine=det.kind or "openai_compat",
                         label=f"{name}: {det.label}{where}", simulated=det.simulated, started_by_panel=False,
                         on_this_machine=here)


# -- the overview: every saved connection, polled at a low rate ----------------------------------------------------
OVERVIEW_PERIOD_S = 5.0


@dataclass
class ConnectionStatus:
    """One line of the overview: what a saved connection is doing now. Missing figures are None, never 0."""

    name: str
    t: float
    state: str                           # "ok" | "problem"
    kind: str | None = None
    label: str = ""
    users: int | None = None             # requests running (slots busy)
    queued: int | None = None
    decode_tok_s: float | None = None
    simulated: bool = False
    message: str = ""                    # the problem in plain words, when state == "problem"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class OverviewPoller:
    """Polls every saved connection once per :meth:`poll` (the GUI runs it on a worker at
    :data:`OVERVIEW_PERIOD_S`; never on the GUI thread): detection the first time (and after a problem), then the
    engine adapter's ``poll`` with the previous sample, so rates come from two readings. A connection that fails
    is a ``problem`` line with plain words; the others are not held up beyond their own timeout."""

    def __init__(self, *, timeout_s: float = 3.0, ssh_options: list[str] | None = None):
        self.timeout_s = timeout_s
        self.ssh_options = ssh_options
        self._prev: dict[str, Any] = {}          # name -> previous Sample
        self._kind: dict[str, tuple[str, str, bool]] = {}   # name -> (kind, url, simulated)

    def poll(self) -> list[ConnectionStatus]:
        return [self.poll_one(c) for c in load_connections()]

    def poll_running(self, name: str, running: RunningEngine) -> ConnectionStatus:
        """A line for an engine known by its handle (the GUI's own engine, not a saved connection): its adapter's
        poll with the previous sample, no detection. ``name`` must not be a saved connection's name."""
        import httpx

        from .engines import get_engine
        from .metrics.sources import plain_engine_error, spec_for

        try:
            eng = get_engine(running.engine)
            with httpx.Client(timeout=httpx.Timeout(self.timeout_s), trust_env=False) as client:
                s = eng.poll(client, spec_for(eng, running.base_url, running.api_key), self._prev.get(name))
        except Exception as exc:  # noqa: BLE001 - a failing engine is a line of the overview, never a crash
            self._prev.pop(name, None)
            return ConnectionStatus(name, time.time(), "problem", running.engine, running.label,
                                    message=plain_engine_error(exc, running.base_url, self.timeout_s))
        self._prev[name] = s
        return ConnectionStatus(name, s.t, "ok", running.engine, running.label, users=s.slots_busy, queued=s.queued,
                                decode_tok_s=s.decode_tok_s, simulated=running.simulated or s.simulated)

    def poll_one(self, conn: Connection) -> ConnectionStatus:
        import httpx

        from .engines import get_engine
        from .metrics.sources import plain_engine_error, spec_for
        from .tunnel import TunnelError

        now = time.time()
        try:
            key = connection_key(conn)
            known = self._kind.get(conn.name)
            if known is None:
                url = _local_url(conn, self.ssh_options)
                det = detect(url, key, timeout_s=self.timeout_s)
                if not det.ok:
                    return ConnectionStatus(conn.name, now, "problem", det.kind, det.label, message=det.message)
                known = (det.kind or "openai_compat", url, det.simulated)
                self._kind[conn.name] = known
            kind, url, simulated = known
            eng = get_engine(kind)
            with httpx.Client(timeout=httpx.Timeout(self.timeout_s), trust_env=False) as client:
                s = eng.poll(client, spec_for(eng, url, key or ""), self._prev.get(conn.name))
        except (TunnelError, ConnectionSetupError) as exc:
            self._kind.pop(conn.name, None)
            return ConnectionStatus(conn.name, now, "problem", message=str(exc))
        except Exception as exc:  # noqa: BLE001 - a failing engine is a line of the overview, never a crash
            self._kind.pop(conn.name, None)
            self._prev.pop(conn.name, None)
            return ConnectionStatus(conn.name, now, "problem", conn.kind, KIND_LABELS.get(conn.kind or "", ""),
                                    message=plain_engine_error(exc, conn.base_url, self.timeout_s))
        self._prev[conn.name] = s
        return ConnectionStatus(conn.name, s.t, "ok", kind, KIND_LABELS.get(kind, kind), users=s.slots_busy,
                                queued=s.queued, decode_tok_s=s.decode_tok_s, simulated=simulated or s.simulated)
