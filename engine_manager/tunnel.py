"""An SSH forward to an engine on another machine, with the system ``ssh``.

``Tunnel(host, remote_port).open()`` runs ``ssh -N -L SOCKET:127.0.0.1:RPORT [options] -- host`` as an argv list
(never a shell), SOCKET being a Unix socket in a private folder made fresh for each tunnel (0700): nothing listens on
TCP, so no other local user can connect to the forward, nor bind its address first and receive the engine's key.
:func:`transport_for` gives httpx's Unix-socket transport for a tunnel's URL, whose host (``ssh-tunnel-….invalid``)
never resolves, so a client that forgot the transport fails instead of sending the key anywhere else.
The user's ``~/.ssh/config``, keys and agent decide the login; ``BatchMode=yes`` makes ssh fail rather than ask
(a password, an unknown host key), ``ExitOnForwardFailure=yes`` exit rather than half-work. Nothing secret is on its
command line. ``open()`` returns once the socket accepts connections (ssh creates it after the login), or raises
:class:`TunnelError` with ssh's refusal in plain words. A supervisor thread restarts a dead ssh (back-off, the same
socket path, so the URL does not change); ``close()`` ends it (SIGTERM, then SIGKILL) and removes its folder.
"""

from __future__ import annotations

import functools
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .errors import UserError
from .tls import verify as tls_verify

CONNECT_TIMEOUT_S = 10          # ssh's own ConnectTimeout: an unreachable host fails in this long, not minutes
OPEN_TIMEOUT_S = 30.0
RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)
#: the host part of every tunnel URL ends so: ``.invalid`` never resolves (RFC 6761), so only the Unix-socket
#: transport of :func:`transport_for` can reach it
TUNNEL_DOMAIN = ".ssh-tunnel.invalid"


class TunnelError(UserError):
    """ssh could not set up the forward; ``cause`` is a short id, ``str()`` the plain words with a fix."""

    def __init__(self, cause: str, message: str, stderr: str = ""):
        super().__init__(message)
        self.cause = cause
        self.stderr = stderr


#: an ssh destination: ``host``, ``user@host``, an IPv6 address, ``ssh://user@host:port`` or a Host alias of
#: ~/.ssh/config — never a shell word (``$``, backticks, ``;``, ``|``, ``&``, ``<``, ``>``, quotes, spaces) and
#: never an option (a leading ``-``)
_HOST_RE = re.compile(r"^[A-Za-z0-9_:\[][A-Za-z0-9_.@:%+/\[\]-]{0,254}$")


def valid_host(host: str) -> bool:
    """An ssh destination that cannot be read as an option, hold a second argument or a shell word."""
    return isinstance(host, str) and bool(_HOST_RE.fullmatch(host))


def explain(stderr: str, host: str, returncode: int | None) -> TunnelError:
    """ssh's exit, in plain words with what to do."""
    text = stderr.strip()
    low = text.lower()
    last = text.splitlines()[-1] if text else f"ssh exited with status {returncode}"
    if "remote host identification has changed" in low:
        return TunnelError("host_key_changed", (
            f"The host key of {host} has CHANGED since you last connected: this can be an attack, or the machine was "
            f"reinstalled. Check with its owner; if it was reinstalled, remove the old key with `ssh-keygen -R "
            f"{host}` and connect once with `ssh {host}` to accept the new one."), text)
    if "host key verification failed" in low or "no host key is known" in low or "host key is not known" in low:
        return TunnelError("host_key_unknown", (
            f"ssh does not know the host key of {host}, so it refused to connect (the panel never accepts a key on "
            f"your behalf). Connect once in a terminal with `ssh {host}`, check the fingerprint and accept it, "
            "then try again."), text)
    if "permission denied" in low or "too many authentication failures" in low:
        return TunnelError("auth_refused", (
            f"{host} refused the login ({last}). The panel logs in with your own ssh keys and agent, without "
            f"asking for a password: check that `ssh {host}` works without a prompt (ssh-add your key, or set "
            "User/IdentityFile for this host in ~/.ssh/config)."), text)
    if "could not resolve hostname" in low or "name or service not known" in low:
        return TunnelError("unknown_host", (
            f"The name {host} could not be resolved ({last}). Check the spelling, or add a Host entry for it in "
            "~/.ssh/config."), text)
    if ("connection refused" in low or "no route to host" in low or "connection timed out" in low
            or "network is unreachable" in low or "operation timed out" in low):
        return TunnelError("unreachable", (
            f"{host} cannot be reached over ssh ({last}). Check that the machine is on, that its ssh server runs "
            "and that the port in your ssh config is right."), text)
    if ("address already in use" in low or "cannot listen to" in low or "forwarding failed" in low
            or "unix_listener" in low):
        return TunnelError("forward_failed", (
            f"ssh could not set up the forward ({last}). Try again; if it keeps failing, check that "
            f"`ssh -N -L /tmp/test.sock:127.0.0.1:PORT {host}` works in a terminal."), text)
    return TunnelError("ssh_failed", f"ssh to {host} failed: {last}. Try `ssh {host}` in a terminal to see why.",
                       text)


def port_open(port: int) -> bool:
    """Whether something accepts TCP connections on 127.0.0.1:``port`` (tests and sshd's own port)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _private_dir() -> str:
    """A new folder only this user can enter (``mkdtemp`` makes it 0700 and fails rather than reuse one), in
    ``$XDG_RUNTIME_DIR`` when that is this user's private folder, else in the temporary folder. Short, since a
    Unix socket's path is limited to ~100 bytes."""
    base = os.environ.get("XDG_RUNTIME_DIR") or ""
    try:
        st = os.stat(base) if base else None
    except OSError:
        st = None
    if st is None or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077 or len(base) > 60:
        base = tempfile.gettempdir()
        if len(base) > 60:
            base = "/tmp"
    return tempfile.mkdtemp(prefix="dsv41-ssh-", dir=base)


def socket_ready(path: str) -> bool:
    """Whether ``path`` is a Unix socket of this user that accepts a connection."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid():
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        try:
            s.connect(path)
            return True
        except OSError:
            return False


_registry: dict[str, "Tunnel"] = {}        # url host -> the open tunnel it names
_registry_lock = threading.Lock()


def is_tunnel_url(url: Any) -> bool:
    import httpx

    try:
        host = httpx.URL(str(url)).host
    except Exception:  # noqa: BLE001 - not a URL: not a tunnel's
        return False
    return host.endswith(TUNNEL_DOMAIN)


def transport_for(url: Any, *, verify: Any = True, limits: Any = None) -> Any:
    """The httpx transport to reach ``url``: None for an ordinary URL (httpx's default), the Unix-socket transport
    of the open tunnel whose URL it is, or — for a tunnel URL whose forward is closed — a transport that fails
    every request in plain words (nothing is sent anywhere). Pass it as ``httpx.Client(transport=…)``; ``verify``
    and ``limits`` as the client would have had them."""
    import httpx

    try:
        host = httpx.URL(str(url)).host
    except Exception:  # noqa: BLE001 - not a URL: httpx will say so itself
        return None
    if not host.endswith(TUNNEL_DOMAIN):
        return None
    with _registry_lock:
        t = _registry.get(host)
    path = t.socket_path if t is not None else None
    if path is None:
        return _closed_transport_class()()
    kw: dict[str, Any] = {"uds": path, "verify": tls_verify(verify)}
    if limits is not None:
        kw["limits"] = limits
    return httpx.HTTPTransport(**kw)


@functools.lru_cache(maxsize=1)
def _closed_transport_class() -> type:
    import httpx

    class ClosedTunnelTransport(httpx.BaseTransport):
        """Every request fails before anything is sent: the SSH forward this URL named is closed."""

        def handle_request(self, request: httpx.Request) -> httpx.Response:
            raise httpx.ConnectError("the SSH forward of this connection is closed: open the connection again",
                                     request=request)

    return ClosedTunnelTransport


@dataclass
class Tunnel:
    """One supervised ``ssh -N -L`` forward from a Unix socket in a private folder to ``remote_host``:
    ``remote_port`` as seen on ``host`` (the remote engine usually listens on its own loopback). ``options`` are
    extra ssh arguments placed before the destination (e.g. ``["-F", config]`` in tests). Reach it with
    :attr:`base_url` and :meth:`transport` (or :func:`transport_for` on any URL built on :attr:`url_host`)."""

    host: str
    remote_port: int
    options: list[str] = field(default_factory=list)
    remote_host: str = "127.0.0.1"
    ssh: str | None = None
    restarts: int = 0
    last_error: TunnelError | None = None
    socket_path: str | None = None
    url_host: str = field(default_factory=lambda: f"ssh-{secrets.token_hex(6)}{TUNNEL_DOMAIN}")
    _dir: str | None = field(default=None, repr=False)
    _proc: subprocess.Popen | None = field(default=None, repr=False)
    _closing: threading.Event = field(default_factory=threading.Event, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not valid_host(self.host):
            raise TunnelError("bad_host", f"{self.host!r} is not an ssh host name: use a name such as gpu-box, "
                                          "user@gpu-box or a Host from ~/.ssh/config (it may not start with -, or "
                                          "hold spaces, quotes or any of $ ` ; | & < >).")
        if isinstance(self.remote_port, bool) or not (0 < int(self.remote_port) < 65536):
            raise TunnelError("bad_port", f"remote port {self.remote_port} is not a TCP port (1–65535).")

    # -- the command ------------------------------------------------------------------------------------------
    def argv(self) -> list[str]:
        ssh = self.ssh or shutil.which("ssh")
        if not ssh:
            raise TunnelError("no_ssh", "The `ssh` program is not installed: install OpenSSH's client "
                                        "(`sudo apt install openssh-client`) to reach engines on other machines.")
        assert self.socket_path is not None
        remote = f"[{self.remote_host}]" if ":" in self.remote_host else self.remote_host     # an IPv6 address
        return [ssh, "-N", "-L", f"{self.socket_path}:{remote}:{self.remote_port}",
                "-o", "StreamLocalBindUnlink=yes", "-o", "StreamLocalBindMask=0177",
                "-o", "BatchMode=yes", "-o", "ExitOnForwardFailure=yes", "-o", f"ConnectTimeout={CONNECT_TIMEOUT_S}",
                "-o", "ServerAliveInterval=15", "-o", "ServerAliveCountMax=3",
                *self.options, "--", self.host]

    @property
    def pid(self) -> int | None:
        p = self._proc
        return p.pid if p is not None else None

    @property
    def base_url(self) -> str:
        """``http://URL_HOST:REMOTE_PORT``: reached only through :meth:`transport`."""
        return f"http://{self.url_host}:{self.remote_port}"

    def transport(self, **kw: Any) -> Any:
        """httpx's Unix-socket transport to the forward (``verify``, ``limits`` as for :func:`transport_for`)."""
        return transport_for(self.base_url, **kw)

    def client(self, **kw: Any) -> Any:
        """An ``httpx.Client`` through the forward (``kw`` for the client: timeout, headers, ...)."""
        import httpx

        return httpx.Client(transport=self.transport(), trust_env=False, **kw)

    def alive(self) -> bool:
        p = self._proc
        return p is not None and p.poll() is None

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def _spawn(self, timeout_s: float) -> None:
        if self._dir is None:
            self._dir = _private_dir()
            self.socket_path = os.path.join(self._dir, "fwd.sock")
        assert self.socket_path is not None
        try:
            os.unlink(self.socket_path)       # a dead ssh's socket (ssh would refuse to bind over it)
        except FileNotFoundError:
            pass
        env = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_")}   # the agent socket stays
        proc = subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, env=env, start_new_session=True)
        self._proc = proc
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                err = proc.stderr.read().decode("utf-8", "replace") if proc.stderr else ""
                raise explain(err, self.host, proc.returncode)
            if socket_ready(self.socket_path):
                return
            if self._closing.is_set():            # closed while ssh was still logging in
                self._terminate(proc)
                raise TunnelError("closed", f"the tunnel to {self.host} was closed while it was opening.")
            if time.monotonic() > deadline:
                self._terminate(proc)
                raise TunnelError("timeout", f"ssh to {self.host} did not set up the forward within {timeout_s:.0f} s. "
                                             f"Try `ssh {self.host}` in a terminal to see where it stops.")
            time.sleep(0.05)

    def open(self, timeout_s: float = OPEN_TIMEOUT_S) -> "Tunnel":
        """Start ssh and wait for the forward; then supervise it. Raises :class:`TunnelError` (also for a tunnel
        closed before or while it opens: a closed tunnel stays closed)."""
        if self._closing.is_set():
            raise TunnelError("closed", f"the tunnel to {self.host} was closed while it was opening.")
        try:
            with self._lock:
                self._spawn(timeout_s)
        except BaseException:
            self._remove_dir()
            raise
        with _registry_lock:
            _registry[self.url_host] = self
        self._thread = threading.Thread(target=self._supervise, name=f"ssh-tunnel-{self.host}", daemon=True)
        self._thread.start()
        return self
    def _supervise(self) -> None:
        """Restart ssh when it dies while the tunnel is wanted (network blip, server restart), with a back-off;
        the same socket path is kept so the engine's address does not change."""
        attempt = 0
        while not self._closing.is_set():
            p = self._proc
            if p is None:
                return
            try:
                p.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                continue
            if self._closing.is_set():
                return
            err = p.stderr.read().decode("utf-8", "replace") if p.stderr else ""
            self.last_error = explain(err, self.host, p.returncode)
            delay = RESTART_BACKOFF_S[min(attempt, len(RESTART_BACKOFF_S) - 1)]
            if self._closing.wait(delay):
                return
            with self._lock:
                if self._closing.is_set():
                    return
                try:
                    self._spawn(OPEN_TIMEOUT_S)
                    self.restarts += 1
                    attempt = 0
                except TunnelError as exc:
                    self.last_error = exc
                    attempt += 1

    @staticmethod
    def _terminate(proc: subprocess.Popen) -> None:
        if proc.poll() is not None:
            return
        try:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        except ProcessLookupError:
            pass

    def _remove_dir(self) -> None:
        d, self._dir = self._dir, None
        if d is not None:
            shutil.rmtree(d, ignore_errors=True)

    def close(self) -> None:
        """End the forward (and its supervision) and remove its socket's folder. Safe to call twice."""
        self._closing.set()
        with _registry_lock:
            if _registry.get(self.url_host) is self:
                del _registry[self.url_host]
        with self._lock:
            p = self._proc
            if p is not None:
                self._terminate(p)
                if p.stderr:
                    p.stderr.close()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5)
        self._remove_dir()

    def __enter__(self) -> "Tunnel":
        return self if self.alive() else self.open()

    def __exit__(self, *exc) -> None:
        self.close()
