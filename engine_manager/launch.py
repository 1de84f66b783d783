"""How a start launches the engine — the one home of what ``dsv41 start`` runs and ``dsv41 start --dry-run`` shows.

- :func:`port_refusal`, :func:`prepare`, :func:`launch_spec` — a start's steps before the engine runs: the port is
  free, the engine's provisioning (Strata's pack) as the supervisor's events, the launch spec checked by the
  engine's own :func:`preflight` (missing binary, model); each refusal a :class:`LaunchRefused` (cause, fix);
- :func:`keeper_argv` — the keeper's command line (:mod:`engine_manager.keeper`: it runs the engine as the leader
  of a new session and process group, writes its output to the size-rotated log and records how it ended);
- :func:`keeper_env` — the keeper's environment and what it reads on its stdin: the secrets to mask, and a secret
  the engine reads from its environment, so that neither is ever in the keeper's own environment;
- :func:`write_run_header` and :func:`start_keeper` — the run's first log line (``[dsv41 …] run ID: starting …``:
  crash causes are read from this run's lines only), then the keeper.

Used by :class:`engine_manager.supervisor.Supervisor` (start) and :mod:`engine_manager.dryrun` alike. This module
never imports Qt.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Generator

from .atomic import open_append_nofollow
from .engines.base import Engine, LaunchSpec
from .eventbase import Event
from .frozen import module_argv  # the keeper's command line, also in the one-folder bundle
from .procs import describe_owner, port_free, port_owner, suggest_port
from .supervisor_events import LogLines, Note, Progress

KEEPER = Path(__file__).with_name("keeper.py")


class LaunchRefused(Exception):
    """A start that cannot go on, with its cause and the fix (the supervisor reports it as ``StartFailed``)."""

    def __init__(self, cause: str, message: str, fix: str, suggested_port: int | None = None) -> None:
        super().__init__(message)
        self.cause, self.message, self.fix, self.suggested_port = cause, message, fix, suggested_port


def port_refusal(host: str, port: int) -> LaunchRefused | None:
    """Why the engine cannot listen on ``host:port`` (who holds it, and a port that is free now); None: free."""
    if port_free(host, port):
        return None
    owner = port_owner(host, port)
    alt = suggest_port(host, port)
    return LaunchRefused(
        "port_in_use", f"Port {port} is in use by {describe_owner(owner)}.",
        "Stop that program, or choose another port: "
        + (f"`dsv41 settings set port {alt}` (or DSV41_PORT={alt}); {alt} is free now."
           if alt else "`dsv41 settings set port <N>` (or DSV41_PORT)."), suggested_port=alt)


def prepare(eng: Engine, settings: Any, plan: dict[str, Any] | None,
            stop_asked: Callable[[], bool]) -> Generator[Event, None, LaunchRefused | None]:
    """Run the engine's provisioning (``eng.prepare``: Strata's pack, :mod:`engine_manager.provision`) when it
    is needed, as Notes, Progress and LogLines; ``stop_asked()`` true stops it. Returns None when done, else
    why the start cannot go on."""
    from .errors import UserError

    run = getattr(eng, "prepare", None)     # only Strata's adapter has one
    if run is None:
        return None
    gen = run(settings, plan)
    t0 = time.monotonic()
    try:
        for ev in gen:
            if stop_asked():
                gen.close()
                return LaunchRefused("stopped", "Stopped while the model was being prepared; it is prepared "
                                     "again at the next start.", "Start again when you want the engine.")
            if ev.phase == "progress":
                yield Progress(time.monotonic() - t0, 0.0, f"preparing the model: {ev.done} of {ev.total}",
                               ev.fraction, ev.eta_s, pid=ev.pid)
            elif ev.phase == "output":
                yield LogLines([f"[dsv41 prepare] {ev.text}"])
            elif ev.phase == "done" and ev.skipped:
                continue
            else:
                yield Note(ev.text)
    except UserError as exc:
        # a known refusal (the release's tool cannot pack this model) carries its own cause and fix
        fix = getattr(exc, "fix", None)
        return LaunchRefused(getattr(exc, "cause", None) or "prepare_failed",
                             getattr(exc, "summary", str(exc)) if fix else str(exc),
                             fix or "Fix what the message names, then start again (or run `dsv41 prepare`).")
    finally:
        gen.close()
    return None


def launch_spec(eng: Engine, settings: Any, plan: dict[str, Any] | None, workdir: Path) -> LaunchSpec:
    """The engine's launch spec for ``plan`` (its generated files written under ``workdir``), checked by its
    :func:`preflight`. Raises :class:`LaunchRefused` with the adapter's words."""
    try:
        spec = eng.build_launch(settings, plan, workdir)
    except Exception as exc:
        raise LaunchRefused("bad_setup", f"The {eng.name} engine cannot be started: {exc}",
                            "Fix what the message names (settings, model folder, engine binary) and start "
                            "again; `dsv41 doctor` checks this machine.") from exc
    problems = preflight(eng, spec)
    if problems:
        raise LaunchRefused("preflight", " ".join(problems),
                            "Fix what the message names and start again; `dsv41 start --dry-run` shows the "
                            "command, `dsv41 doctor` checks this machine.")
    return spec


def preflight(eng: Engine, spec: LaunchSpec) -> list[str]:
    """The engine's own plain-words launch problems (missing binary, model), when it offers the check."""
    check = getattr(eng, "preflight", None)
    if check is None:
        return []
    try:
        return [str(p) for p in (check(spec) or [])]
    except Exception:  # a broken check must not block a launch: the engine's own errors will say what is wrong
        return []


def keeper_argv(spec: LaunchSpec, *, log_path: Path, exit_path: Path, max_bytes: int, backups: int) -> list[str]:
    """The keeper's command line up to and including its ``--``: the engine's command (binding prefix first)
    follows it. A log the engine writes itself (Strata's config "log") is followed into the engine log."""
    argv = module_argv("engine_manager.keeper", script=KEEPER) + [
        "--log", str(log_path), "--exit-file", str(exit_path), "--max-bytes", str(max_bytes),
        "--backups", str(backups), "--mask-stdin"]
    if spec.files.get("engine_log"):
        argv += ["--follow", spec.files["engine_log"]]
    return argv + ["--"]


def keeper_env(spec: LaunchSpec, binding: Any) -> tuple[dict[str, str], bytes]:
    """The keeper's environment (this process's, the spec's additions, the binding's strategy) and its stdin
    (read to EOF, then closed): ``MASK <secret>`` lines and ``ENV <name>=<secret>`` for a secret the engine reads
    from its environment (``$STRATA_API_KEY``) — in the engine's environment only, never the keeper's:
    /proc/<pid>/environ stays readable for the keeper's whole life."""
    env = dict(os.environ)
    secret_values = set(spec.secrets())
    secret_env = {k: v for k, v in spec.env.items() if v in secret_values}
    env.update({k: v for k, v in spec.env.items() if k not in secret_env})
    env.pop("DSV41_KEEPER_MASK", None)
    env["DSV41_NUMA_BINDING"] = binding.strategy if binding else "none"   # an engine may report it
    stdin = ("".join(f"MASK {s}\n" for s in secret_values)
             + "".join(f"ENV {k}={v}\n" for k, v in secret_env.items())).encode()
    return env, stdin


def write_run_header(log_path: Path, run_id: str, spec: LaunchSpec, binding: Any) -> int:
    """Mark the start of run ``run_id`` in the engine log (what starts, with which binding); returns the log's
    size before the mark (where this run's lines begin). Raises :class:`LaunchRefused` when the log cannot be
    opened (a link, a wrong file)."""
    try:
        logfd = open_append_nofollow(log_path)
    except OSError as exc:
        raise LaunchRefused("log_refused", f"The engine log cannot be opened: {exc.strerror or exc}.",
                            f"Make {log_path} a plain file the panel can write (remove a link or a "
                            "wrong file there), then start again.") from exc
    with os.fdopen(logfd, "ab") as f:
        offset = os.fstat(f.fileno()).st_size
        f.write((f"[dsv41 {time.strftime('%Y-%m-%d %H:%M:%S')}] run {run_id}: starting "
                 f"{spec.label or spec.engine}: {shlex.join(spec.masked_argv(binding.prefix if binding else []))}\n"
                 f"[dsv41] binding: {binding.summary() if binding else 'none'}\n").encode())
    return offset


def start_keeper(spec: LaunchSpec, binding: Any, *, log_path: Path, exit_path: Path, max_bytes: int,
                 backups: int) -> subprocess.Popen:
    """Start the keeper (and through it the engine, binding prefix first) in a new session and process group,
    its stderr into the engine log, and hand it the secrets on its stdin. Raises :class:`LaunchRefused`."""
    env, secrets_in = keeper_env(spec, binding)
    argv = keeper_argv(spec, log_path=log_path, exit_path=exit_path, max_bytes=max_bytes, backups=backups) + [
        *(binding.prefix if binding else []), *spec.argv]
    try:
        errfd = open_append_nofollow(log_path)
    except OSError as exc:
        raise LaunchRefused("log_refused", f"The engine log cannot be opened: {exc.strerror or exc}.",
                            f"Make {log_path} a plain file the panel can write, then start again.") from exc
    try:
        popen = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=errfd,
                                 env=env, cwd=spec.cwd or None, start_new_session=True, close_fds=True)
    except OSError as exc:
        raise LaunchRefused("spawn_failed", f"Could not start the engine's keeper: {exc}",
                            "Check that Python and the engine files are readable; see the log.") from exc
    finally:
        os.close(errfd)
    try:
        assert popen.stdin is not None
        popen.stdin.write(secrets_in)
        popen.stdin.close()
    except (BrokenPipeError, OSError):
        pass                    # the keeper died at once: the exit file and the log say why
    return popen
