"""The SSH port forward against a real OpenSSH server (Debian's ``openssh-server``) on 127.0.0.1 with
throwaway keys: its own host key, port, authorized_keys and config (``sshd -D -e -f CONFIG``), and an ssh client
config given with ``-F`` so the user's own ~/.ssh is never read or changed.

- the tunnel is opened, used (the scripted engine, reached through it: detected, monitored and chatted with),
  restarted when ssh dies, and closed (the ssh process gone, its socket and private folder removed);
- the forward is a Unix socket in a 0700 folder, never a TCP port: a local listener that took the port the old
  forward would have used receives nothing, and a client that forgets the socket's transport cannot send the key
  anywhere (the URL's host never resolves);
- an unknown host key, a changed host key, a refused login and a closed port give their plain-words errors;
- the engine's key is never on ssh's command line (``/proc/PID/cmdline``).

Skipped (failed under CI) only when sshd is not installed (scripts/_setup.sh installs openssh-server).
"""

from __future__ import annotations

import getpass
import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path

import socket
import stat
import threading

import httpx
import pytest

from engine_manager import connections as C
from engine_manager import procs
from engine_manager.chat import ChatClient, ChatError, ContentDelta
from engine_manager.metrics import build_hub
from engine_manager.sim.launch import free_port
from engine_manager.tunnel import TUNNEL_DOMAIN, Tunnel, TunnelError, port_open, socket_ready

from conftest import require_or_skip

pytestmark = pytest.mark.timeout(120)

SSHD = shutil.which("sshd") or ("/usr/sbin/sshd" if os.path.exists("/usr/sbin/sshd") else None)


def _keygen(path: Path) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "dsv41-test", "-f", str(path)],
                   check=True, capture_output=True, timeout=30)
    return path.with_suffix(".pub").read_text().strip()


class SshServer:
    def __init__(self, root: Path):
        self.root = root
        self.port = free_port()
        self.user = getpass.getuser()
        self.host_pub = _keygen(root / "host_key")
        self.user_pub = _keygen(root / "user_key")
        _keygen(root / "stranger_key")                     # a key the server does not accept
        self.other_host_pub = _keygen(root / "other_host_key")
        (root / "authorized_keys").write_text(self.user_pub + "\n")
        os.chmod(root / "authorized_keys", 0o600)
        cfg = root / "sshd_config"
        cfg.write_text("\n".join([
            f"Port {self.port}", "ListenAddress 127.0.0.1", f"HostKey {root / 'host_key'}",
            f"PidFile {root / 'sshd.pid'}", f"AuthorizedKeysFile {root / 'authorized_keys'}",
            "PubkeyAuthentication yes", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
            "UsePAM no", "StrictModes no", "AllowTcpForwarding local", "PermitRootLogin prohibit-password",
            "LogLevel VERBOSE", "",
        ]))
        self.log = open(root / "sshd.log", "w")
        self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(cfg)], stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + 20
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError("sshd exited: " + (root / "sshd.log").read_text())
            if port_open(self.port):
                break
            if time.monotonic() > deadline:
                raise RuntimeError("sshd did not listen: " + (root / "sshd.log").read_text())
            time.sleep(0.05)

    def client_config(self, name: str, *, identity: str = "user_key", known: str | None = "host",
                      port: int | None = None) -> Path:
        """An ssh client config for Host ``testbox``: which key it logs in with, which host key it trusts
        (``host`` the real one, ``other`` a different one, None: none)."""
        kh = self.root / f"known_hosts-{name}"
        line = {"host": self.host_pub, "other": self.other_host_pub}.get(known or "")
        kh.write_text(f"testbox {line}\n" if line else "")
        cfg = self.root / f"ssh_config-{name}"
        cfg.write_text("\n".join([
            "Host testbox", "  HostName 127.0.0.1", f"  Port {port or self.port}", f"  User {self.user}",
            f"  IdentityFile {self.root / identity}", "  IdentitiesOnly yes", "  IdentityAgent none",
            "  HostKeyAlias testbox", f"  UserKnownHostsFile {kh}", "  GlobalKnownHostsFile /dev/null",
            "  StrictHostKeyChecking yes", "  PasswordAuthentication no", "",
        ]))
        return cfg

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    if SSHD is None or shutil.which("ssh") is None:
        require_or_skip("OpenSSH's sshd/ssh are not installed (apt install openssh-server openssh-client; "
                        "scripts/_setup.sh installs them)")
    if os.geteuid() == 0 and not os.path.isdir("/run/sshd"):
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)    # sshd's privilege-separation folder
    srv = SshServer(tmp_path_factory.mktemp("sshd"))
    yield srv
    srv.stop()


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().rstrip("\0").split("\0")


def test_tunnel_opened_used_restarted_and_closed(sshd, sim_process):
    sim = sim_process().wait_ready()
    cfg = sshd.client_config("ok")
    t = Tunnel("testbox", sim.port, options=["-F", str(cfg)]).open(timeout_s=30)
    try:
        argv = _cmdline(t.pid)
        assert argv[-2:] == ["--", "testbox"] and "BatchMode=yes" in argv and "ExitOnForwardFailure=yes" in argv
        assert sim.api_key not in "\0".join(argv)
        # the local end is a Unix socket in a folder only this user can enter: no TCP port at all
        forward = argv[argv.index("-L") + 1]
        assert forward == f"{t.socket_path}:127.0.0.1:{sim.port}"
        folder = os.path.dirname(t.socket_path)
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700 and os.stat(folder).st_uid == os.getuid()
        assert stat.S_ISSOCK(os.lstat(t.socket_path).st_mode)
        assert t.base_url.split("//")[1].split(":")[0].endswith(TUNNEL_DOMAIN)
        with t.client(timeout=10) as client:
            r = client.get(t.base_url + "/health")
        assert r.status_code == 200 and r.json()["service"] == "strata-sim"
        # ssh dies (network blip): the supervisor starts it again on the same socket
        first_pid = t.pid
        os.kill(first_pid, 9)
        deadline = time.monotonic() + 60
        while not (t.restarts >= 1 and t.alive() and socket_ready(t.socket_path)):
            assert time.monotonic() < deadline, f"the tunnel was not restarted: {t.last_error}"
            time.sleep(0.1)
        assert t.pid != first_pid
        with t.client(timeout=10) as client:
            assert client.get(t.base_url + "/health").status_code == 200
    finally:
        pid, path = t.pid, t.socket_path
        t.close()
    assert not os.path.exists(f"/proc/{pid}") or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    assert not os.path.exists(os.path.dirname(path))
    assert sim.proc.poll() is None


class Listener:
    """A local program that took a TCP port first: it accepts and records every byte sent to it."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.received = b""
        self.connections = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            conn.settimeout(2)
            try:
                while chunk := conn.recv(65536):
                    self.received += chunk
            except OSError:
                pass
            conn.close()

    def close(self) -> None:
        self.sock.close()


def test_a_listener_that_took_the_forward_port_first_receives_nothing(sshd, sim_process, monkeypatch):
    """A local user who binds the port a TCP forward would use (it shows in every user's ``ps``) before ssh does
    must get nothing: the forward is a Unix socket, so the key goes only through ssh. (Before, the tunnel declared
    itself up as soon as anything accepted on its port, and ``connections test`` sent that listener
    ``Authorization: Bearer <key>``.)"""
    sim = sim_process().wait_ready()
    thief = Listener()
    try:
        # the race won: every "free port" the panel could pick is the one the thief holds
        monkeypatch.setattr(procs, "free_port", lambda host="127.0.0.1": thief.port)
        monkeypatch.setattr("engine_manager.tunnel.free_port", lambda host="127.0.0.1": thief.port, raising=False)
        cfg = sshd.client_config("thief")
        C.add_connection("remote", f"http://127.0.0.1:{sim.port}", sim.api_key, ssh_host="testbox")
        det = C.check_connection("remote", ssh_options=["-F", str(cfg)])
        assert det.ok and det.kind == "sim", det.summary()
        C.close_tunnel("remote")
        time.sleep(0.2)                         # (not a timing assertion: lets the thief's thread record)
        assert thief.connections == 0 and thief.received == b""
        assert sim.api_key.encode() not in thief.received
    finally:
        thief.close()


def test_connection_over_ssh_detected_monitored_chatted_and_closed(sshd, sim_process):
    sim = sim_process().wait_ready()
    cfg = sshd.client_config("conn")
    C.add_connection("remote", f"http://127.0.0.1:{sim.port}", sim.api_key, ssh_host="testbox")
    det = C.check_connection("remote", ssh_options=["-F", str(cfg)])
    assert det.ok and det.kind == "sim", det.summary()
    assert det.found[0] == f"SSH forward through testbox to http://127.0.0.1:{sim.port}"
    assert C.get_connection("remote").last_test.state == "ok"
    re = C.resolve_connection("remote", ssh_options=["-F", str(cfg)])
    t = C.tunnel_for("remote")
    assert t is not None and t.alive()
    assert re.base_url == t.base_url and re.started_by_panel is False
    assert re.on_this_machine is False        # reached through ssh: no local GPU/RAM/CPU figures for it
    assert "via testbox" in re.label
    assert sim.api_key not in "\0".join(_cmdline(t.pid))
    # a client that forgets the forward's transport reaches nothing: the URL's host never resolves
    with pytest.raises(httpx.HTTPError):
        httpx.get(re.base_url + "/health", timeout=5, headers={"Authorization": f"Bearer {re.api_key}"})
    # the monitor (its engine source) and the chat go through the forward's socket
    hub = build_hub(re, record=False, use_nvml=False, hz=4)
    try:
        for tick in hub.iter_ticks():
            if "engine" not in tick.missing and tick.values.get("slots_total") is not None:
                break
            assert tick.seq < 40, tick.missing
    finally:
        hub.stop()
    with ChatClient(re.base_url, re.api_key) as client:
        text = "".join(ev.text for ev in client.stream([{"role": "user", "content": "hi"}])
                       if isinstance(ev, ContentDelta))
    assert text.strip()
    # the overview polls it through the same forward
    line = C.OverviewPoller(ssh_options=["-F", str(cfg)]).poll_one(C.get_connection("remote"))
    assert line.state == "ok" and line.users is not None, line.message
    path = t.socket_path
    C.close_tunnel("remote")                    # the connection is closed: so is its forward
    assert not t.alive() and not os.path.exists(path)
    assert C.tunnel_for("remote") is None
    with pytest.raises(ChatError) as ei:            # nothing is sent anywhere once the forward is closed
        with ChatClient(re.base_url, re.api_key) as client:
            client.health()
    assert ei.value.kind == "unreachable"


@pytest.mark.parametrize("name,kw,cause,words", [
    ("unknown", {"known": None}, "host_key_unknown", "does not know the host key"),
    ("changed", {"known": "other"}, "host_key_changed", "CHANGED"),
    ("refused", {"identity": "stranger_key"}, "auth_refused", "refused the login"),
])
def test_plain_words_errors(sshd, name, kw, cause, words):
    cfg = sshd.client_config(name, **kw)
    with pytest.raises(TunnelError) as ei:
        Tunnel("testbox", 9, options=["-F", str(cfg)]).open(timeout_s=30)
    assert ei.value.cause == cause, ei.value.stderr
    assert words in str(ei.value) and "ssh testbox" in str(ei.value)


def test_closed_port_is_unreachable(sshd):
    cfg = sshd.client_config("closed", port=free_port())
    with pytest.raises(TunnelError) as ei:
        Tunnel("testbox", 9, options=["-F", str(cfg)]).open(timeout_s=30)
    assert ei.value.cause == "unreachable" and "cannot be reached" in str(ei.value)


def test_a_host_that_reads_as_an_option_is_refused_before_ssh_runs(tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(TunnelError, match="not an ssh host"):
        Tunnel(f"-oProxyCommand=touch {marker}", 80)
    assert not marker.exists()


@pytest.mark.parametrize("host", ["box$(touch x)", "box`id`", "box;id", "box|id", "box&id", "box<x", "box>x",
                                  "box'x", 'box"x', "box two", "box\\x", "box\nx", "box\n", ""])
def test_a_host_with_a_shell_word_is_refused(host):
    with pytest.raises(TunnelError, match="not an ssh host"):
        Tunnel(host, 80)
    if host and host == host.strip():
        with pytest.raises(C.ConnectionSetupError, match="not an ssh host"):
            C.add_connection("x", "http://127.0.0.1:8000", None, host)


@pytest.mark.parametrize("host", ["gpu-box", "user@gpu-box", "gpu-box.example.org", "10.0.0.7", "u_1@h-2.lan"])
def test_ordinary_hosts_are_accepted(host):
    assert Tunnel(host, 80).host == host


def test_resolve_over_a_refused_tunnel_says_why(sshd):
    cfg = sshd.client_config("refused2", identity="stranger_key")
    C.add_connection("nope", "http://127.0.0.1:9", secrets.token_hex(8), ssh_host="testbox")
    with pytest.raises(C.ConnectionSetupError, match="refused the login"):
        C.resolve_connection("nope", ssh_options=["-F", str(cfg)])
    det = C.check_connection("nope", ssh_options=["-F", str(cfg)])
    assert det.problem == "auth_refused" and not det.ok
