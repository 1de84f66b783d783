"""Stops the engine an InferenceKey backend started once that backend's process is gone, however it ended.

    python -m engine_manager.inferencekey.watchdog --fd N --backend-pid PID

The backend (:mod:`engine_manager.inferencekey.backend`) starts this in a session of its own with the read end of
a pipe (``--fd``) whose write end only the backend holds. The kernel closes that end when the backend ends —
``exit``, an exception, SIGTERM, SIGKILL, the OOM killer — and the read here returns end-of-file. Then, if the
state file still names a live engine that this backend started (``supervisor_pid`` = ``--backend-pid``), it is
stopped the way ``dsv41 stop`` stops it (:meth:`engine_manager.session.EngineSession.stop`: SIGTERM to its group,
the grace period, SIGKILL). An engine someone else started, or one already stopped, is left alone.

Why not the engine's keeper: the keeper (:mod:`engine_manager.keeper`) is built to outlive whoever started the
engine (``dsv41 start`` returns and leaves the engine running; a panel that closes can leave it running), so it
does not watch its parent.
"""

from __future__ import annotations

import argparse
import os
import sys


def _say(text: str) -> None:
    try:
        print(f"[dsv41 watchdog] {text}", flush=True)
    except (OSError, ValueError):
        pass


def _wait_eof(fd: int) -> None:
    while True:
        try:
            if not os.read(fd, 4096):
                return
        except InterruptedError:
            continue
        except OSError:
            return


def stop_if_ours(backend_pid: int) -> bool:
    """Stop the engine the state file names when the backend ``backend_pid`` started it and it still runs.
    Returns True when it stopped one."""
    from .. import paths
    from ..atomic import read_bytes_nofollow
    from ..engine_record import EngineRecord
    from ..engine_state import STATE_FILE
    from ..session import EngineSession
    from ..settings import load_settings

    try:
        rec = EngineRecord.from_json(read_bytes_nofollow(paths.data_dir() / STATE_FILE, 1 << 20))
    except Exception:  # no state file, or one the supervisor would move aside: nothing of ours to stop
        return False
    if rec.supervisor_pid != backend_pid or not rec.alive():
        return False
    folder = paths.data_dir() / "inferencekey"
    loaded = load_settings(path=folder / "backend-settings.json", generate_key=False, lenient=True)
    _say(f"the backend (pid {backend_pid}) is gone: stopping the engine it started (pid {rec.pid})")
    session = EngineSession(loaded.settings)
    try:
        for ev in session.stop():
            msg = getattr(ev, "message", None)
            if ev.kind in ("stopped", "note") and msg:
                _say(msg)
    finally:
        session.close()
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine_manager.inferencekey.watchdog")
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--backend-pid", type=int, required=True)
    args = ap.parse_args(argv)
    import signal

    for sig in (signal.SIGINT, signal.SIGHUP):   # a Ctrl+C meant for the backend's terminal is not for this
        signal.signal(sig, signal.SIG_IGN)
    _wait_eof(args.fd)
    os.close(args.fd)
    try:
        stop_if_ours(args.backend_pid)
    except Exception as exc:  # said in plain words; nothing else can be done from here
        _say(f"could not stop the engine: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
