"""The engine's keeper: a tiny process that starts the engine, owns its output and records how it ended.

    python -I -S keeper.py --log FILE --exit-file FILE [--max-bytes N] [--backups K] -- ENGINE ARGV...

The supervisor starts the keeper as the leader of a new session and process group; the keeper starts the engine
(behind its NUMA binding prefix) in that same group, so ``kill -TERM -<pgid>`` reaches both. Why a keeper rather
than the engine writing its own file:

- the log is **size-rotated** (``FILE``, ``FILE.1`` … ``FILE.K``) even when no panel is running (after
  ``dsv41 start`` returns, or after the panel was killed);
- **how the engine ended** (exit code, or the signal that killed it — SIGKILL usually means the OOM killer) is
  written atomically to ``--exit-file`` (0600), so a panel that re-attaches later can still explain a crash;
- the API key (passed in ``DSV41_KEEPER_MASK``, removed from the engine's environment) is masked out of every
  line the engine prints, so the log never holds the secret.

The keeper ignores SIGTERM/SIGINT/SIGHUP (with a Python handler, which ``exec`` resets for the engine): it keeps
copying output until the engine's end of file, so the last lines the engine prints while shutting down are kept.
SIGKILL of the group ends it with the engine. Stdlib only, so it starts in ~20 ms with ``-I -S``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

MASK_ENV = "DSV41_KEEPER_MASK"


def _mask(data: bytes, secrets: list[bytes]) -> bytes:
    for s in secrets:
        if s and s in data:
            data = data.replace(s, s[:4] + "\u2026(masked)".encode())
    return data


class RotatingLog:
    def __init__(self, path: str, max_bytes: int, backups: int):
        self.path, self.max_bytes, self.backups = path, max_bytes, backups
        self.f = self._open()

    def _open(self):
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        return os.fdopen(fd, "ab", buffering=0)

    def write(self, data: bytes) -> None:
        """Append ``data`` (whole lines), rotating so that no file grows past ``max_bytes`` (a single longer
        line gets a file of its own)."""
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
        print("keeper: usage: keeper.py --log FILE --exit-file FILE [--max-bytes N] [--backups K] -- ARGV...",
              file=sys.stderr)
        return 2
    i = argv.index("--")
    opts, cmd = argv[:i], argv[i + 1:]
    conf = {"--log": None, "--exit-file": None, "--max-bytes": "10485760", "--backups": "3"}
    it = iter(opts)
    for k in it:
        if k not in conf:
            print(f"keeper: unknown option {k}", file=sys.stderr)
            return 2
        conf[k] = next(it, None)
    if not conf["--log"] or not conf["--exit-file"] or not cmd:
        print("keeper: --log, --exit-file and a command are required", file=sys.stderr)
        return 2
    log = RotatingLog(conf["--log"], int(conf["--max-bytes"]), int(conf["--backups"]))
    exit_file = conf["--exit-file"]
    env = dict(os.environ)
    secrets = [s.encode() for s in env.pop(MASK_ENV, "").split("\n") if s]

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_a: None)

    try:
        child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 env=env, close_fds=True)
    except OSError as exc:
        log.write(f"[dsv41 keeper {_stamp()}] could not start the engine: {exc}\n".encode())
        _write_exit(exit_file, {"engine_pid": None, "returncode": 127, "signal": None, "signal_name": None,
                                "ended_at": time.time(), "keeper_pid": os.getpid(), "spawn_error": str(exc)})
        return 127

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
