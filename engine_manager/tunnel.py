"""An SSH port forward to an engine on another machine, with the system ``ssh`` (issue 19).

``Tunnel(host, remote_port).open()`` runs ``ssh -N -L 127.0.0.1:LPORT:127.0.0.1:RPORT [options] -- host`` as an
argv list (never a shell): the user's own ``~/.ssh/config``, keys and agent decide how to log in; ``BatchMode=yes``
makes ssh fail instead of asking anything (no password prompt, no "trust this host key?" question, which the panel
could not answer), ``ExitOnForwardFailure=yes`` makes a forward that cannot be set up an exit instead of a silent
half-working tunnel. Nothing secret is on its command line: the engine's API key never goes near ssh.

``open()`` returns once the local port accepts connections (ssh binds it only after the login succeeded), or
raises :class:`TunnelError` with ssh's refusal in plain words (unknown or changed host key, login refused, host
unreachable, port taken). Afterwards a supervisor thread restarts ssh if it dies (with a back-off), and
``close()`` ends it (SIGTERM to the ssh process the tunnel started, then SIGKILL).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field

from .errors import UserError
from .procs import free_port

CONNECT_TIMEOUT_S = 10          # ssh's own ConnectTimeout: an unreachable host fails in this long, not minutes
OPEN_TIMEOUT_S = 30.0
RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0)


class TunnelError(UserError):
    """ssh could not set up the forward; ``cause`` is a short id, ``str()`` the plain words with a fix."""

    def __init__(self, cause: str, message: str, stderr: str = ""):
        super().__init__(message)
        self.cause = cause
        self.stderr = stderr


def valid_host(host: str) -> bool:
    """An ssh destination that cannot be read as an option or hold a second argument."""
    return bool(host) and not host.startswith("-") and not any(c.isspace() or c == "\0" for c in host)


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
    if "address already in use" in low or "cannot listen to port" in low or "port forwarding failed" in low:
        return TunnelError("forward_failed", (
            f"ssh could not set up the port forward ({last}). Another program may hold the local port; try again "
            "(a new port is picked each time)."), text)
    return TunnelError("ssh_failed", f"ssh to {host} failed: {last}. Try `ssh {host}` in a terminal to see why.",
                       text)


def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


@dataclass
class Tunnel:
    """One supervised ``ssh -N -L`` forward from 127.0.0.1:``local_port`` to 127.0.0.1:``remote_port`` on
    ``host`` (the remote engine listens on its own loopback). ``options`` are extra ssh arguments placed before
    the destination (e.g. ``["-F", config]`` in tests); ``remote_host`` is where the remote side connects."""

    host: str
    remote_port: int
    local_port: int | None = None
    options: list[str] = field(default_factory=list)
    remote_host: str = "127.0.0.1"
    ssh: str | None = None
    restarts: int = 0
    last_error: TunnelError | None = None
    _proc: subprocess.Popen | None = field(default=None, repr=False)
    _closing: threading.Event = field(default_factory=threading.Event, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not valid_host(self.host):
            raise TunnelError("bad_host", f"{self.host!r} is not an ssh host name: use a name such as gpu-box, "
                                          "user@gpu-box or a Host from ~/.ssh/config (it may not start with -).")
        if not (0 < int(self.remote_port) < 65536):
            raise TunnelError("bad_port", f"remote port {self.remote_port} is not a TCP port (1–65535).")

    # -- the command ------------------------------------------------------------------------------------------
    def argv(self) -> list[str]:
        ssh = self.ssh or shutil.which("ssh")
        if not ssh:
            raise TunnelError("no_ssh", "The `ssh` program is not installed: install OpenSSH's client "
                                        "(`sudo apt install openssh-client`) to reach engines on other machines.")
        assert self.local_port is not None
        remote = f"[{self.remote_host}]" if ":" in self.remote_host else self.remote_host     # an IPv6 address
        return [ssh, "-N", "-L", f"127.0.0.1:{self.local_port}:{remote}:{self.remote_port}",
                "-o", "BatchMode=yes", "-o", "ExitOnForwardFailure=yes", "-o", f"ConnectTimeout={CONNECT_TIMEOUT_S}",
                "-o", "ServerAliveInterval=15", "-o", "ServerAliveCountMax=3",
                *self.options, "--", self.host]

    @property
    def pid(self) -> int | None:
        p = self._proc
        return p.pid if p is not None else None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.local_port}"

    def alive(self) -> bool:
        p = self._proc
        return p is not None and p.poll() is None

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def _spawn(self, timeout_s: float) -> None:
        if self.local_port is None:
            self.local_port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_")}   # the agent socket stays
        proc = subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, env=env, start_new_session=True)
        self._proc = proc
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                err = proc.stderr.read().decode("utf-8", "replace") if proc.stderr else ""
                raise explain(err, self.host, proc.returncode)
            if port_open(self.local_port):
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
        """Start ssh and wait for the forward; then supervise it. Raises :class:`TunnelError`."""
        self._closing.clear()
        with self._lock:
            self._spawn(timeout_s)
        self._thread = threading.Thread(target=self._supervise, name=f"ssh-tunnel-{self.host}", daemon=True)
        self._thread.start()
        return self

    def _supervise(self) -> None:
        """Restart ssh when it dies while the tunnel is wanted (network blip, server restart), with a back-off;
        the same local port is kept so the engine's address does not change."""
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

    def close(self) -> None:
        """End the forward (and its supervision). Safe to call twice."""
        self._closing.set()
        with self._lock:
            p = self._proc
            if p is not None:
                self._terminate(p)
                if p.stderr:
                    p.stderr.close()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5)

    def __enter__(self) -> "Tunnel":
        return self if self.alive() else self.open()

    def __exit__(self, *exc) -> None:
        self.close()
