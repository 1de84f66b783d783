"""The engine's keeper: a tiny process that starts the engine, owns its output and records how it ended.

    python -I -S keeper.py --log FILE --exit-file FILE [--max-bytes N] [--backups K] [--mask-stdin]
                           [--follow FILE [--follow-prefix TEXT]] -- ENGINE ARGV...

The supervisor starts it as the leader of a new session and process group; it starts the engine in that group, so
``kill -TERM -<pgid>`` reaches both. It keeps the size-rotated log (``FILE``, ``FILE.1`` … ``FILE.K``) while no panel
runs; writes how the engine ended (exit code or signal) atomically to ``--exit-file`` (0600); masks the secrets out
of every line (``--mask-stdin``: ``MASK <secret>`` and ``ENV NAME=VALUE`` lines read from stdin until end of file,
never from its own environment, which ``/proc/<pid>/environ`` shows; ``DSV41_KEEPER_MASK`` is still honoured);
follows a log the engine writes itself into the rotated one (``--follow``: emptied at launch, masked, prefixed);
and opens every log with ``O_NOFOLLOW``. It ignores SIGTERM/SIGINT/SIGHUP so the engine's last lines are kept;
SIGKILL of the group ends it. Stdlib only, run with ``-I -S``. Why each of these:
benchmarks/results/design_rationale.md.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

MASK_ENV = "DSV41_KEEPER_MASK"
FOLLOW_PREFIX = "[engine] "


class LinkRefused(OSError):
    """A log path is a symbolic link."""


def open_nofollow(path: str, flags: int, mode: int = 0o600) -> int:
    """``os.open`` that refuses a symbolic link at ``path`` (``O_NOFOLLOW``) with :class:`LinkRefused`."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), mode)
    except OSError as exc:
        if exc.errno == 40 or os.path.islink(path):      # ELOOP: the last component is a symbolic link
            raise LinkRefused(exc.errno, f"{path} is a symbolic link; the panel does not write through links. "
                                         "Remove the link (or move it away) and start again") from None
        raise


def _mask(data: bytes, secrets: list[bytes]) -> bytes:
    for s in secrets:
        if s and s in data:
            data = data.replace(s, s[:4] + "\u2026(masked)".encode())
    return data


class RotatingLog:
    def __init__(self, path: str, max_bytes: int, backups: int):
        self.path, self.max_bytes, self.backups = path, max_bytes, backups
        self.lock = threading.Lock()       # the engine's output and a followed log are written from two threads
        self.f = self._open()

    def _open(self):
        fd = open_nofollow(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        return os.fdopen(fd, "ab", buffering=0)

    def write(self, data: bytes) -> None:
        """Append ``data`` (whole lines), rotating so that no file grows past ``max_bytes`` (a single longer
        line gets a file of its own)."""
        with self.lock:
            self._write(data)

    def _write(self, data: bytes) -> None:
        while data:
            try:
                size = os.fstat(self.f.fileno()).st_size
            except OSError:
                size = 0
            room = self.max_bytes - size if self.max_bytes > 0 else len(data)
            if len(data) <= room:
                self.f.write(data)
                return
            cut = data.rfind(b"\n", 0, max(room, 0)) + 1 if room > 0 else 0
            if cut == 0 and size == 0:      # one line longer than a whole file: keep it whole
                cut = data.find(b"\n") + 1 or len(data)
            if cut:
                self.f.write(data[:cut])
                data = data[cut:]
            if data:
                self.rotate()

    def rotate(self) -> None:
        self.f.close()
        for i in range(self.backups - 1, 0, -1):
            src = f"{self.path}.{i}"
            if os.path.exists(src):
                os.replace(src, f"{self.path}.{i + 1}")
        if self.backups > 0:
            os.replace(self.path, f"{self.path}.1")
        else:
            os.unlink(self.path)
        self.f = self._open()

    def close(self) -> None:
        self.f.close()


class Follower:
    """Follows a log file the engine writes itself into the rotated log: masked, prefixed, whole lines."""

    def __init__(self, path: str, log: RotatingLog, secrets: list[bytes], prefix: bytes):
        # this run's lines only: the file is emptied (or created, 0600) before the engine starts
        os.close(open_nofollow(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC))
        self.fd = open_nofollow(path, os.O_RDONLY)
        self.log, self.secrets, self.prefix = log, secrets, prefix
        self.pending = b""
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _pump(self, final: bool = False) -> bool:
        got = False
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except InterruptedError:
                continue
            if not chunk:
                break
            got = True
            self.pending += chunk
            cut = self.pending.rfind(b"\n")
            if cut >= 0:
                self._emit(self.pending[:cut + 1])
                self.pending = self.pending[cut + 1:]
            elif len(self.pending) >= 65536:
                self._emit(self.pending + b"\n")
                self.pending = b""
        if final and self.pending:
            self._emit(self.pending + b"\n")
            self.pending = b""
        return got

    def _emit(self, data: bytes) -> None:
        lines = data.split(b"\n")[:-1]
        self.log.write(_mask(b"".join(self.prefix + ln + b"\n" for ln in lines), self.secrets))

    def _run(self) -> None:
        while not self.done.is_set():
            if not self._pump():
                self.done.wait(0.1)

    def finish(self) -> None:
        self.done.set()
        self.thread.join(timeout=5)
        self._pump(final=True)
        os.close(self.fd)


def _write_exit(path: str, record: dict) -> None:
    d = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=".exit.", dir=d)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _stamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print("keeper: usage: keeper.py --log FILE --exit-file FILE [--max-bytes N] [--backups K] [--mask-stdin] "
              "[--follow FILE [--follow-prefix TEXT]] -- ARGV...", file=sys.stderr)
        return 2
    i = argv.index("--")
    opts, cmd = argv[:i], argv[i + 1:]
    conf: dict[str, str | None] = {"--log": None, "--exit-file": None, "--max-bytes": "10485760", "--backups": "3",
                                   "--follow": None, "--follow-prefix": FOLLOW_PREFIX}
    flags = {"--mask-stdin": False}
    it = iter(opts)
    for k in it:
        if k in flags:
            flags[k] = True
            continue
        if k not in conf:
            print(f"keeper: unknown option {k}", file=sys.stderr)
            return 2
        conf[k] = next(it, None)
    if not conf["--log"] or not conf["--exit-file"] or not cmd:
        print("keeper: --log, --exit-file and a command are required", file=sys.stderr)
        return 2
    try:
        max_bytes, backups = int(conf["--max-bytes"] or ""), int(conf["--backups"] or "")
    except ValueError:
        print("keeper: --max-bytes and --backups take a whole number", file=sys.stderr)
        return 2
    env = dict(os.environ)
    secrets = [s.encode() for s in env.pop(MASK_ENV, "").split("\n") if s]
    if flags["--mask-stdin"]:               # the supervisor writes the secrets into a pipe and closes it
        try:
            data = sys.stdin.buffer.read()
        except (OSError, ValueError):
            data = b""
        for line in data.split(b"\n"):
            if line.startswith(b"ENV ") and b"=" in line:      # a secret variable for the engine's environment only
                name, _, value = line[4:].partition(b"=")
                env[name.decode()] = value.decode()
                if value:
                    secrets.append(value)
            elif line.startswith(b"MASK "):
                if line[5:]:
                    secrets.append(line[5:])
            elif line:
                secrets.append(line)
    try:
        log = RotatingLog(conf["--log"], max_bytes, backups)
    except OSError as exc:
        print(f"keeper: cannot open the engine log: {exc.strerror if isinstance(exc, LinkRefused) else exc}",
              file=sys.stderr)
        return 2
    exit_file = conf["--exit-file"]
    follower = None
    if conf["--follow"]:
        try:
            follower = Follower(conf["--follow"], log, secrets, str(conf["--follow-prefix"]).encode())
        except OSError as exc:
            msg = exc.strerror if isinstance(exc, LinkRefused) else str(exc)
            log.write(f"[dsv41 keeper {_stamp()}] cannot follow the engine's own log: {msg}\n".encode())
            print(f"keeper: cannot follow the engine's own log: {msg}", file=sys.stderr)
            return 2

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda *_a: None)

    try:
        child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 env=env, close_fds=True)
    except OSError as exc:
        if follower is not None:
            follower.finish()
        log.write(f"[dsv41 keeper {_stamp()}] could not start the engine: {exc}\n".encode())
        _write_exit(exit_file, {"engine_pid": None, "returncode": 127, "signal": None, "signal_name": None,
                                "ended_at": time.time(), "keeper_pid": os.getpid(), "spawn_error": str(exc)})
        return 127

    assert child.stdout is not None                 # stdout=PIPE
    fd = child.stdout.fileno()
    pending = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except InterruptedError:
            continue
        if not chunk:
            break
        pending += chunk
        cut = pending.rfind(b"\n")
        if cut < 0 and len(pending) < 65536:
            continue                      # wait for the line's end so a secret is never split across writes
        if cut < 0:
            cut = len(pending) - 1
        log.write(_mask(pending[:cut + 1], secrets))
        pending = pending[cut + 1:]
    if pending:
        log.write(_mask(pending + b"\n", secrets))
    while True:
        try:
            rc = child.wait()
            break
        except InterruptedError:
            continue
    if follower is not None:            # the engine's own last words (e.g. "unknown argument: X") before the exit
        follower.finish()
    sig = -rc if rc < 0 else None
    name = signal.Signals(sig).name if sig else None
    record = {"engine_pid": child.pid, "returncode": rc, "signal": sig, "signal_name": name,
              "ended_at": time.time(), "keeper_pid": os.getpid()}
    _write_exit(exit_file, record)
    how = f"killed by signal {sig} ({name})" if sig else f"exit code {rc}"
    log.write(f"[dsv41 keeper {_stamp()}] engine (pid {child.pid}) ended: {how}\n".encode())
    log.close()
    return 128 + sig if sig else rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
