"""``dsv41 start | stop | status | logs | binding``: run the engine from a terminal.

- ``dsv41 start [--engine sim|strata|llamacpp] [--plan FILE] [--dry-run] [--foreground]``: start the engine and
  return once it is ready (it keeps running in its own session; ``dsv41 stop`` stops it). ``--foreground`` stays,
  prints the engine's log, restarts it after a crash (auto_restart) and stops it on Ctrl+C. ``--dry-run`` prints
  every command it would run here. ``--plan FILE`` starts with a saved plan (``dsv41 plan --out FILE``), even one
  made for another host (a warning names it). Without a GPU the scripted engine (simulated) is the default, and
  it says so. The Strata engine's model pack is prepared first when it is needed (see ``dsv41 prepare``).
- ``dsv41 prepare [--plan FILE] [--force]``: prepare the model for the Strata engine with the release's own
  ``tools/iq_pack.py`` (once; the panel records its completion and redoes an unfinished or changed pack).
- ``dsv41 stop [--force]``: SIGTERM to the engine's process group, grace period, SIGKILL (``--force``: at once).
- ``dsv41 status [--json]``: state, engine, pid, port, base_url, binding, uptime, last failure; for llama.cpp
  also where llama-server put each buffer, read from its log; the GPU warnings (``gpu_warnings.status_report``).
- ``dsv41 logs [-f] [-n N]``: the engine log (rotated, secrets masked); ``-f`` follows it.
- ``dsv41 binding [--json]``: the NUMA binding the engine would get here, each strategy probed.
"""

from __future__ import annotations

import json
import sys
import time

from .. import fmt, hardware
from ..engine_state import READY, STOPPED, EngineStatus
from ..logtail import LogTail, read_log_tail
from ..session import EngineSession
from ..start_plan import plan_host_warning
from ..supervisor_events import (Attached, Crashed, Event, GaveUp, LogLines, Note, Progress, Ready, Restarting,
                                 StartFailed, StateChanged, Stopped, Stopping)
from ..engines import ALIASES, ENGINE_NAMES, canonical, find_engine
from ..numa import choose_binding
from ..errors import UserError
from ..exitcodes import ExitCode
from ..settings import resolve_engine



class PlanFileError(UserError):
    """A ``--plan FILE`` that is missing or not a plan: a usage error (exit 2), said in plain words."""


def register(sub) -> None:
    p = sub.add_parser("start", help="start the engine and wait until it is ready",
                       description="Start the engine (bound to the GPU's NUMA node), wait until it answers, then "
                                   "return and leave it running; `dsv41 stop` stops it. Without a GPU the scripted "
                                   "engine (simulated) is started. Starting the engine that already runs "
                                   "re-attaches to it; another engine running is refused (stop it first). Exit 0 "
                                   "ready (or already running), 1 failed (or another engine runs), 3 placement "
                                   "refused, 130 interrupted (the engine is then stopped).")
    p.add_argument("--engine", choices=ENGINE_NAMES + tuple(ALIASES),
                   help="which engine (default: the engine setting; auto = strata with a GPU, else sim)")
    p.add_argument("--dry-run", action="store_true",
                   help="print every command that would run (binding probes, engine command, environment with "
                        "the key masked) and start nothing; exit 3 when the plan is refused (said at the top)")
    p.add_argument("--foreground", action="store_true",
                   help="stay attached: print the engine log, restart after crashes, stop on Ctrl+C")
    p.add_argument("--plan", metavar="FILE",
                   help="start with this saved plan (`dsv41 plan --out FILE`), even one made for another host "
                        "(a warning names the host it was made for); a refused plan is not started (exit 3)")
    p.add_argument("--json", action="store_true", help="print the events as JSON lines")
    p.set_defaults(func=run_start)

    p = sub.add_parser("prepare", help="prepare the model for the Strata engine (its pack, once)",
                       description="Run the engine release's own tools/iq_pack.py on the model's shard 1 (found "
                                   "from the split metadata) into <data dir>/packs/<model>, printing its progress. "
                                   "Done once: the panel records its own completion (file sizes) and makes the "
                                   "pack again only when that record is missing or the files changed. "
                                   "`dsv41 start --engine strata` does this itself when needed. Exit 0 ready, "
                                   "1 failed, 130 interrupted.")
    p.add_argument("--plan", metavar="FILE", help="the plan whose model to prepare (default: DSV41_MODEL_DIR, "
                                                  "else the downloaded model)")
    p.add_argument("--force", action="store_true", help="make the pack again even when it is complete")
    p.add_argument("--json", action="store_true", help="print the events as JSON lines")
    p.set_defaults(func=run_prepare)

    p = sub.add_parser("stop", help="stop the engine this panel started",
                       description="SIGTERM to the engine's process group, a grace period, then SIGKILL; checks that "
                                   "no process of the group is left. An engine the panel did not start is never "
                                   "stopped.")
    p.add_argument("--force", action="store_true", help="SIGKILL at once")
    p.add_argument("--grace", type=float, default=20.0, help="seconds between SIGTERM and SIGKILL (default 20)")
    p.set_defaults(func=run_stop)

    p = sub.add_parser("status", help="is the engine running? where? how was it bound?",
                       description="State (stopped/starting/ready/stopping/crashed/restarting), engine, pid, port, "
                                   "base_url, binding, uptime and the last failure; for llama.cpp, where "
                                   "llama-server put each buffer (from its log). Always exit 0.")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_status)

    p = sub.add_parser("logs", help="print (or follow) the engine log",
                       description="The engine's log (size-rotated: engine.log, engine.log.1 …; secrets masked).")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until Ctrl+C (exit 130)")
    p.add_argument("-n", "--lines", type=int, default=200, help="how many of the last lines (default 200; 0 = all "
                                                                 "of the current file)")
    p.add_argument("--path", action="store_true", help="print the log file's path only")
    p.set_defaults(func=run_logs)

    p = sub.add_parser("binding", help="probe the NUMA binding the engine would get here",
                       description="Try numactl --cpunodebind=N --preferred=N, numactl --cpunodebind=N, taskset, "
                                   "none — each by really running `<prefix> true` — and print the choice and why.")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_binding)


# -- rendering ---------------------------------------------------------------------------------------------

_fmt_s = fmt.duration


class Printer:
    """Prints supervisor events for a person (or as JSON lines)."""

    def __init__(self, out=None, json_lines: bool = False, show_log: bool = False):
        self.out = out or sys.stdout
        self.json = json_lines
        self.show_log = show_log
        self.tty = hasattr(self.out, "isatty") and self.out.isatty()
        self._last_progress = 0.0
        self._progress_shown = False

    def _line(self, text: str) -> None:
        if self._progress_shown and self.tty:
            self.out.write("\r\033[K")
            self._progress_shown = False
        print(text, file=self.out, flush=True)

    def __call__(self, ev: Event) -> None:
        if self.json:
            if isinstance(ev, LogLines) and not self.show_log:
                return
            print(json.dumps(ev.to_dict(), default=str), file=self.out, flush=True)
            return
        match ev:
            case Progress(phase=phase) if phase.startswith("preparing"):
                eta = f", about {_fmt_s(ev.eta_s)} left" if ev.eta_s else ""
                frac = f" ({ev.fraction:.0%})" if ev.fraction is not None else ""
                self._line(f"{phase}{frac}{eta}")
            case LogLines(lines=lines):
                if self.show_log:
                    for ln in lines:
                        self._line(f"  | {ln}")
            case Progress():
                eta = f", about {_fmt_s(ev.eta_s)} left" if ev.eta_s else ""
                text = (f"waiting for the engine: {_fmt_s(ev.elapsed_s)} of {_fmt_s(ev.timeout_s)} — "
                        f"{ev.phase}{eta}")
                if self.tty:
                    self.out.write("\r\033[K" + text[:200])
                    self.out.flush()
                    self._progress_shown = True
                elif time.monotonic() - self._last_progress >= 5.0:
                    self._last_progress = time.monotonic()
                    self._line(text)
            case Note(text=text, level=level):
                self._line(("warning: " if level == "warning" else "") + text)
            case StateChanged(state=state, message=message):
                if state in ("ready", "stopped", "crashed"):
                    return                     # the ready / stopped / crashed event that follows says it better
                self._line(f"[{state}] {message}" if message else f"[{state}]")
            case Ready():
                self._line(f"ready: {ev.base_url} "
                           f"({'re-attached' if ev.attached else f'after {_fmt_s(ev.elapsed_s)}'})"
                           f"{' — simulated' if ev.simulated else ''}")
            case Crashed():
                self._line(f"CRASHED: {ev.title}")
                self._line(f"  what to do: {ev.fix}")   # (for an unknown cause the fix carries the last lines)
                if ev.will_restart:
                    self._line(f"  restarting in {ev.restart_in_s:.1f} s (crash {ev.crashes_in_window})")
            case Restarting():
                pass
            case GaveUp(message=message):
                self._line(f"gave up: {message}")
            case StartFailed():
                self._line(f"error: {ev.message}")
                self._line(f"  what to do: {ev.fix}")
                for ln in ev.log_tail:
                    self._line(f"  | {ln}")
            case Stopping():
                if time.monotonic() - self._last_progress >= 1.0:
                    self._last_progress = time.monotonic()
                    self._line(f"stopping: {ev.signal_name} sent {_fmt_s(ev.elapsed_s)} ago, {ev.remaining} "
                               f"process(es) left ("
                               + ("the whole process group" if "server" in ev.signal_name else "SIGKILL")
                               + f" after {_fmt_s(ev.grace_s)})")
            case Stopped(message=message) | Attached(message=message):
                self._line(message)


# -- commands ------------------------------------------------------------------------------------------------

def _probe(settings):
    return hardware.probe(settings.cache_path)


def _choose_engine(args, settings, hw, say) -> str:
    if args.engine:
        return canonical(args.engine)
    name = resolve_engine(settings, hw.has_gpu)
    if find_engine(name).simulated and not hw.has_gpu:
        say(f"No NVIDIA GPU here ({hw.gpu_error}), so the engine is the scripted engine (simulated), with the "
            "replica layout of DeepSeek-V4.1-Flash; every figure it reports is simulated. Choose another engine "
            "with --engine or DSV41_SERVER_ENGINE.")
    return name


def run_start(args, ctx) -> int:
    settings = ctx.settings
    hw = _probe(settings)
    out = sys.stderr if args.json else sys.stdout

    def say(text: str) -> None:
        print(text, file=out, flush=True)

    engine = _choose_engine(args, settings, hw, say)
    plan = None
    if getattr(args, "plan", None):
        try:
            plan = load_plan_file(args.plan)
        except PlanFileError as exc:
            print(f"dsv41 start: {exc}", file=sys.stderr)
            return ExitCode.USAGE
        warning = plan_host_warning(plan, hw)
        if warning:
            say(f"warning: {warning}")
    session = EngineSession(settings, hardware=hw, started_by="cli")
    if args.dry_run:
        dr = session.dry_run(engine, plan)
        if args.json:
            print(json.dumps(dr.to_dict(), indent=2, default=str))
        else:
            print(dr.render(), end="")
        return ExitCode.REFUSED if dr.refused else ExitCode.OK
    printer = Printer(json_lines=args.json, show_log=args.foreground)
    result = None
    failed: StartFailed | None = None
    gave_up = False
    gen = session.start(engine, plan, watch=args.foreground)
    try:
        while True:
            try:
                ev = next(gen)
            except StopIteration as stop:
                result = stop.value
                break
            printer(ev)
            match ev:
                case StartFailed():
                    failed = ev
                case GaveUp():
                    gave_up = True
    except KeyboardInterrupt:
        gen.close()
        say("\ninterrupted: stopping the engine…")
        for ev in session.stop():
            printer(ev)
        return ExitCode.INTERRUPTED
    if failed is not None:
        return ExitCode.REFUSED if failed.cause == "placement_refused" else ExitCode.FAIL
    st = result or session.status(check_health=False)
    if st.state == READY:
        if not args.foreground:
            say(f"The engine runs in the background (pid {st.pid}, {st.base_url}). `dsv41 status` shows it, "
                "`dsv41 logs -f` follows its log, `dsv41 stop` stops it.")
        return ExitCode.OK
    if st.state == STOPPED and args.foreground and not gave_up:
        return ExitCode.OK
    return ExitCode.FAIL


def load_plan_file(path: str) -> dict:
    """A saved plan (``dsv41 plan --out FILE``, the Placement tab's save) as a dict, checked field by field
    (:func:`engine_manager.plans.read_plan_file`); ``PlanFileError`` in plain words when the file is missing, is
    not a plan, or holds what the planner never writes."""
    from ..plans import PlanError, read_plan_file

    try:
        return read_plan_file(path)
    except PlanError as exc:
        raise PlanFileError(str(exc)) from None


def run_prepare(args, ctx) -> int:
    from .. import provision
    from ..engines import get_engine
    from ..engines.strata import StrataEngine

    settings = ctx.settings
    try:
        plan = load_plan_file(args.plan) if args.plan else None
    except PlanFileError as exc:
        print(f"dsv41 prepare: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    eng = get_engine("strata")
    assert isinstance(eng, StrataEngine)               # the one engine with a model to prepare
    gen = eng.prepare(settings, plan, force=args.force)
    try:
        while True:
            try:
                ev = next(gen)
            except StopIteration as stop:
                pack = stop.value
                break
            if args.json:
                print(json.dumps(ev.to_dict(), default=str), flush=True)
            else:
                text = provision.describe(ev)
                if text:
                    print(text, flush=True)
    except KeyboardInterrupt:
        gen.close()
        print("\ninterrupted: the pack is not finished; `dsv41 prepare` makes it again", file=sys.stderr)
        return ExitCode.INTERRUPTED
    if not args.json:
        print(f"pack: {pack}")
    return ExitCode.OK


def run_stop(args, ctx) -> int:
    # an unrelated bad setting must not block stopping: Context.settings_for_stop
    session = EngineSession(getattr(ctx, "settings_for_stop", None) or ctx.settings, grace_s=args.grace)
    printer = Printer()
    external = False
    for ev in session.stop(force=args.force):
        if isinstance(ev, Note) and ev.cause == "external_engine":
            external = True
        printer(ev)
    return ExitCode.FAIL if external else ExitCode.OK


def engine_build(name: str | None, settings) -> str | None:
    """The engine release's own facts (Strata: engine/BUILD.json), when the engine's adapter reports them."""
    from ..release_check import engine_release_facts

    return engine_release_facts(name or resolve_engine(settings, True), settings)


def run_status(args, ctx) -> int:
    session = EngineSession(ctx.settings)
    st = session.status()
    placed = _llamacpp_placement(st, session)
    build = engine_build(st.engine, ctx.settings)
    from ..checks import checks_for_status
    report = checks_for_status(st, ctx.settings, placed)      # planned vs measured, while the engine is ready
    from ..gpu_warnings import status_report
    gpu = status_report()                                    # heat, power, slowdowns (no GPU: a note, no warning)
    if args.json:
        d = st.to_dict()
        d["engine_build"] = build
        d["checks"] = [c.to_dict() for c in report.checks] if report else []
        d["warnings"] = [w.to_dict() for w in gpu.warnings]
        d["warnings_note"] = gpu.note
        if placed is not None:
            d["llamacpp_placement"] = {**placed.to_dict(), "text": placed.text(),
                                       "has_placement": placed.has_placement}
        print(json.dumps(d, indent=2, default=str))
        return ExitCode.OK
    name = st.label or st.engine or "—"
    if st.simulated and "simulated" not in name.lower():
        name += " (simulated)"
    if st.started_by_words:
        name += f", {st.started_by_words}"
    rows = [("state", st.state), ("engine", name)] + ([("engine build", build)] if build else []) + [
            ("pid", st.pid), ("process group", st.pgid), ("port", st.port), ("base_url", st.base_url),
            ("binding", st.binding)]
    up = st.uptime_s()
    if up is not None:
        rows.append(("uptime", _fmt_s(up)))
    rows.append(("log", st.log_path))
    for k, v in rows:
        print(f"{k:<14} {v if v not in (None, '') else '—'}")
    if st.key_matches is False:
        print("warning: the engine was started with another API key than the one in the settings now")
    if st.message and st.message.strip(".").lower() != st.state:
        print(st.message)
    if st.last_failure:
        lf = st.last_failure
        print(f"last failure:  {lf.get('title')}")
        print(f"what to do:    {lf.get('fix')}")
    if placed is not None:
        if placed.has_placement:
            print("Placement (from llama-server's log):")
            for ln in placed.text().splitlines():
                print(f"  {ln}")
        else:
            print("Placement (from llama-server's log): none yet (llama-server prints it while it loads the model)")
    if report is not None:
        from ..checks import summary
        print(f"Planned vs measured: {summary(report.checks)}")
        for c in report.checks:
            print(f"  {c.line()}")
    for w in gpu.warnings:
        print(f"warning: {w.line()}")
    return ExitCode.OK


def _llamacpp_placement(st: EngineStatus, session: EngineSession):
    """What llama-server's own log says about where it put each buffer: for a llama.cpp engine that runs (or
    crashed: where it had put things may explain why), else None. A stopped engine's log is history."""
    if not find_engine(st.engine).placement_in_log or st.state == STOPPED:
        return None
    from ..engines.llamacpp import placement_from_log

    return placement_from_log(st.log_path or session.log_path)


def run_logs(args, ctx) -> int:
    session = EngineSession(ctx.settings)
    path = session.log_path
    if args.path:
        print(path)
        return ExitCode.OK
    if not path.exists():
        print(f"No engine log yet ({path}); it appears once the engine was started.", file=sys.stderr)
        if not args.follow:
            return ExitCode.OK
    # following: start at the end *before* printing the tail, so a line written meanwhile is not lost
    tail = LogTail(path, None) if args.follow else None
    lines = read_log_tail(path)
    if args.lines > 0:
        lines = lines[-args.lines:]
    for ln in lines:
        print(ln)
    if tail is None:
        # why the last run ended, classified from its own lines (cause and fix, the engine's words quoted)
        lf = session.status(check_health=False).last_failure
        if lf:
            print(f"\nlast failure:  {lf.get('title')}")
            print(f"what to do:    {lf.get('fix')}")
    sys.stdout.flush()
    if tail is None:
        return ExitCode.OK
    try:
        while True:
            for ln in tail.read():
                print(ln, flush=True)
            time.sleep(0.2)
    except KeyboardInterrupt:
        return ExitCode.INTERRUPTED
    finally:
        tail.close()


def run_binding(args, ctx) -> int:
    settings = ctx.settings
    b = choose_binding(_probe(settings), settings.gpu_index, settings.numa_binding)
    if args.json:
        print(json.dumps(b.to_dict(), indent=2))
    else:
        print("\n".join(b.describe()))
    return ExitCode.OK
