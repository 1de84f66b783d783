"""``dsv41 bench``: the guides' experiments on this machine.

``dsv41 bench [--engine sim|llamacpp|strata] [--quick] [--json]`` measures decode at 1/4/8 concurrent users, the
long-prompt pause and the A/B presets, restarting the engine per configuration and putting it back as it was;
the result is saved under the data dir (JSON + CSV). ``--history`` lists saved runs, ``--compare A B`` puts two
side by side, ``--show ID`` prints one. Exit codes: 0 ok, 1 failed (also: no figure measured, or the result could
not be saved where ``--out`` said — it is then saved in the bench folder), 2 bad usage (``--out``, ``--users``, every
``--config`` and ``--plan`` are checked before the engine that runs now is touched), 130 interrupted: Ctrl-C,
SIGTERM or SIGHUP (the engine is put back first and what was measured is saved).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from typing import Any
import threading
from pathlib import Path

from ..cancel import CancelToken
from ..engines import ENGINE_NAMES
from ..errors import UserError
from ..exitcodes import ExitCode


def register(sub) -> None:
    from ..bench import PRESETS
    p = sub.add_parser("bench", help="benchmark the engine against the guides' figures (1/4/8 users, long prompt, "
                                     "settings A/B)",
                       description="Measure decode tok/s at 1, 4 and 8 concurrent users, the pause a ~64K-token "
                                   "prompt causes, and the effect of settings (A/B), beside the guides' figures. "
                                   "The engine is restarted for each configuration and put back as it was.")
    p.add_argument("--engine", choices=ENGINE_NAMES, default=None,
                   help="engine to measure (default: the server_engine setting)")
    p.add_argument("--quick", action="store_true", help="shorter phases (64 tokens per stream): under 3 min on sim")
    p.add_argument("--json", action="store_true", help="print the result document as JSON (progress on stderr)")
    p.add_argument("--users", default="1,4,8", help="concurrent users to measure (default 1,4,8)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per stream in a decode phase")
    p.add_argument("--repeats", type=int, default=None, help="repeats per phase (default 3)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompt length of each decode stream")
    p.add_argument("--long-prompt", type=int, default=65536, metavar="TOKENS",
                   help="length of the long prompt (default 65536; 0 skips the experiment)")
    p.add_argument("--long-users", type=int, default=4, help="users decoding while the long prompt arrives")
    p.add_argument("--preset", action="append", choices=sorted(PRESETS) + ["quality"], default=None,
                   help="A/B preset (repeatable): numerics, numa, hotset, placement (default: numerics on sim "
                        "and strata); quality: the accuracy and determinism check instead of the speed table "
                        "(HumanEval in a sandbox, GSM8K from --gsm8k, alone vs batched answers)")
    q = p.add_argument_group("quality check (--preset quality)")
    q.add_argument("--seed", type=int, default=None, help="the subsets' seed (default 20261201)")
    q.add_argument("--subset", type=int, default=None, metavar="N",
                   help="items per benchmark (default 40 HumanEval tasks and 50 GSM8K items; --quick: 3)")
    q.add_argument("--gsm8k", default=None, metavar="FILE",
                   help="GSM8K test items as JSONL ({\"question\", \"answer\": \"... #### 42\"}, the public "
                        "test split's format)")
    q.add_argument("--batch", type=int, default=None, metavar="N",
                   help="the determinism check's batch of concurrent requests (default 4)")
    p.add_argument("--no-ab", action="store_true", help="measure the baseline only")
    p.add_argument("--config", action="append", default=[], metavar="NAME:key=value,...",
                   help="another configuration, e.g. slots4:slots=4 or gpu:cpu_numerics=gpu")
    p.add_argument("--ab-users", default="1", help="user counts the other configurations measure (default 1)")
    p.add_argument("--plan", default=None, help="a saved plan to start the engine with")
    p.add_argument("--out", default=None, metavar="FOLDER",
                   help="save the result (JSON + CSV) in this folder instead of the data dir's bench folder "
                        "(checked before the run starts)")
    p.add_argument("--history", action="store_true", help="list saved runs")
    p.add_argument("--show", default=None, metavar="ID", help="print a saved run")
    p.add_argument("--compare", nargs=2, default=None, metavar=("A", "B"), help="two saved runs side by side")
    p.set_defaults(func=run)


def _print_event(ev, out) -> None:
    from .. import bench
    if isinstance(ev, bench.BenchProgress):
        eta = f", ETA {ev.eta_s:.0f} s" if ev.eta_s is not None else ""
        print(f"[{ev.fraction * 100:3.0f}%{eta}] {ev.config + ': ' if ev.config else ''}{ev.message}", file=out,
              flush=True)
    elif isinstance(ev, bench.BenchNote):
        print(f"  {ev.text}", file=out, flush=True)
    elif isinstance(ev, bench.BenchPhase):
        f = ev.figures
        if ev.phase.startswith("users_") and f.get("total_tok_s") is not None:
            print(f"    {f['users']} users: {f['total_tok_s']:.1f} tok/s total, slowest {f['slowest_tok_s']:.1f}",
                  file=out, flush=True)
        elif ev.phase == "long_prompt" and f.get("pause_s") is not None:
            print(f"    long prompt: pause {f['pause_s']:.2f} s", file=out, flush=True)


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UserError(f"{what} must be whole numbers separated by commas, e.g. 1,4,8") from None
    if not out or any(not 1 <= x <= 8 for x in out):
        raise UserError(f"{what} must be between 1 and 8 (the engine has at most 8 slots)")
    return out


def _check_out(text: str) -> Path:
    """``--out``, checked before anything starts: a folder that exists or can be made, and can be written. Raises
    :class:`UserError` in words (exit 2)."""
    folder = Path(text).expanduser()
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--out {folder} is a file, not a folder: give the folder the result files (JSON + CSV) go "
                        "into, or leave --out out to save them in the bench folder.")
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise UserError(f"--out {folder} cannot be made ({exc.strerror or exc}): give a folder you can write, or "
                        "leave --out out.") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"--out {folder} cannot be written (no permission): give a folder you can write, or leave "
                        "--out out.")
    return folder


class _Signalled(KeyboardInterrupt):
    """SIGTERM or SIGHUP during a run: taken as Ctrl-C is (the engine put back, the partial result saved)."""


@contextlib.contextmanager
def _signals_as_ctrl_c():
    """While the bench runs, SIGTERM (``kill``, a service manager) and SIGHUP (the terminal closed) raise
    KeyboardInterrupt as Ctrl-C does, so they take the same path: the streams are cut, the bench's engine is
    stopped and the user's is started again, and what was measured is saved. Outside the main thread (where
    Python cannot set handlers) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):  # noqa: ARG001
        raise _Signalled(signal.Signals(signum).name)

    old = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        old[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def _history(args, results) -> int:
    skipped: list[str] = []
    rows = results.history(skipped=skipped)
    for line in skipped:                 # a bad file in the folder is named, never the end of the listing
        print(line, file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=1, default=str))
    elif not rows:
        print(f"No saved benchmarks yet in {results.bench_dir()}. Run `dsv41 bench --quick`.")
    for r in rows if not args.json else []:
        tot = " ".join(f"{u}u {v:.1f}" for u, v in (r.get("totals") or {}).items() if v is not None)
        print(f"{r['id']}  {r.get('engine') or '?':8} {'SIMULATED ' if r.get('simulated') else ''}"
              f"{'quick ' if r.get('quick') else ''}{tot} tok/s")
    return 0


def _save(result, folder, results) -> tuple[str, int]:
    """Save the result; on failure say where it could not be written and save it in the bench folder instead.
    Returns (the line to print, exit code: 0 saved where asked, 1 not)."""
    try:
        jp, cp = results.save(result, folder)
        return f"saved: {jp} and {cp}", 0
    except OSError as exc:
        failed = (f"The result could not be written to {folder or results.bench_dir()} "
                  f"({exc.strerror or exc}).")
    if folder is None:
        return failed + " The table above is all there is of it.", 1
    try:
        jp, cp = results.save(result)
        return failed + f" Saved in the bench folder instead: {jp} and {cp}", 1
    except OSError as exc:
        return (failed + f" Nor in the bench folder {results.bench_dir()} ({exc.strerror or exc}); the table "
                "above is all there is of it."), 1


def run(args, ctx) -> int:
    from .. import bench
    from ..bench import results

    if args.history:
        return _history(args, results)
    if args.show:
        r = results.load(args.show)
        print(json.dumps(r, indent=1, default=str) if args.json else render(r))
        return 0
    if args.compare:
        c = results.compare(results.load(args.compare[0]), results.load(args.compare[1]))
        print(json.dumps(c, indent=1, default=str) if args.json else render_compare(c))
        return 0

    settings = ctx.settings
    engine = args.engine or settings.server_engine
    if args.preset and "quality" in args.preset:
        return _quality(args, settings, engine)
    plan = None
    if args.plan:
        from .engine import PlanFileError, load_plan_file
        try:
            plan = load_plan_file(args.plan)
        except PlanFileError as exc:
            print(f"dsv41 bench: {exc}", file=sys.stderr)
            return ExitCode.USAGE
    presets = [] if args.no_ab else args.preset
    # everything the user gave is checked before the engine that runs now is touched: --out, --users, every
    # --config (an unknown setting, a value the settings refuse), so a bad one never costs a measured baseline
    try:
        folder = _check_out(args.out) if args.out else None
        kw = {"users": _ints(args.users, "--users"), "ab_users": _ints(args.ab_users, "--ab-users"),
              "prompt_tokens": max(8, args.prompt_tokens), "long_prompt_tokens": max(0, args.long_prompt),
              "long_users": max(1, min(7, args.long_users))}
        if args.tokens:
            kw["tokens"] = max(8, args.tokens)
        if args.repeats:
            kw["repeats"] = max(1, args.repeats)
        spec = bench.BenchSpec.make(engine, quick=args.quick, presets=presets, **kw)
        spec.configs += [bench.parse_config(c) for c in args.config]
        bench.runner.BenchRun(settings, spec, plan=plan).check()
    except UserError as exc:
        print(f"dsv41 bench: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    from .. import hardware
    try:
        hw = hardware.probe(None)
    except Exception:  # noqa: BLE001 - the report is saved without it
        hw = None
    stop = CancelToken()
    out = sys.stderr if args.json else sys.stdout
    gen = bench.run_bench(settings, spec, plan=plan, hardware=hw, stop=stop)
    result, interrupted = _drive(gen, stop, out, "cutting the streams and putting the engine back")
    if result is None:
        return ExitCode.FAIL
    if args.json:
        from ..bench.stats import finite_json
        print(json.dumps(finite_json(result), indent=1, default=str, allow_nan=False))
    else:
        print(render(result))
    line, save_rc = _save(result, folder, results)
    print(line, file=out if save_rc == 0 else sys.stderr)
    return exit_code(result, interrupted, save_rc)


def _drive(gen, stop: CancelToken, out, doing: str) -> tuple[Any, bool]:
    """Run a bench generator to its end, printing its events: (its result, whether it was interrupted). Ctrl-C (or
    SIGTERM / SIGHUP) anywhere in here cancels ``stop`` once and lets the run put the engine back; a second one
    leaves at once (the engine may be left running; `dsv41 stop` stops it)."""
    result = None
    interrupted = False
    with _signals_as_ctrl_c():
        while True:
            try:
                try:
                    ev = next(gen)
                except StopIteration as st:
                    result = st.value
                    break
                _print_event(ev, out)
            except KeyboardInterrupt as exc:
                if interrupted:
                    raise
                interrupted = True
                stop.cancel("interrupted")
                why = f"{exc.args[0]} received" if isinstance(exc, _Signalled) and exc.args else "interrupted"
                print(f"\n{why}: {doing}…", file=sys.stderr, flush=True)
    return result, interrupted


def _quality(args, settings, engine: str) -> int:
    """``--preset quality``: the accuracy and determinism check (engine_manager/bench/quality.py), run, printed and
    saved as the speed benchmark is (the same signals, the engine put back, --out checked first)."""
    from ..bench import quality, results
    plan = None
    try:
        if len(args.preset) > 1:
            raise UserError("--preset quality runs on its own: leave the other presets out (run them separately).")
        if args.plan:
            from .engine import PlanFileError, load_plan_file
            try:
                plan = load_plan_file(args.plan)
            except PlanFileError as exc:
                raise UserError(str(exc)) from None
        folder = _check_out(args.out) if args.out else None
        spec = quality.QualitySpec.make(engine, quick=args.quick, seed=args.seed, humaneval_n=args.subset,
                                        gsm8k_n=args.subset, gsm8k_file=args.gsm8k, determinism_users=args.batch)
        if spec.gsm8k_file:
            quality.load_gsm8k(spec.gsm8k_file)       # its format, before the engine that runs now is touched
    except UserError as exc:
        print(f"dsv41 bench: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    stop = CancelToken()
    out = sys.stderr if args.json else sys.stdout
    gen = quality.run_quality(settings, spec, plan=plan, stop=stop)
    result, interrupted = _drive(gen, stop, out, "stopping and putting the engine back")
    if result is None:
        return ExitCode.FAIL
    if args.json:
        from ..bench.stats import finite_json
        print(json.dumps(finite_json(result), indent=1, default=str, allow_nan=False))
    else:
        print(quality.render(result))

    class _Saver:                 # _save's fallback (the bench folder) with the quality files' own writer
        bench_dir = staticmethod(results.bench_dir)
        save = staticmethod(quality.save)
    line, save_rc = _save(result, folder, _Saver)
    print(line, file=out if save_rc == 0 else sys.stderr)
    if interrupted or result.get("cancelled"):
        return ExitCode.INTERRUPTED
    if result.get("error") or save_rc:
        return ExitCode.FAIL
    return ExitCode.OK


def exit_code(result: dict, interrupted: bool = False, save_rc: int = 0) -> ExitCode:
    """130 interrupted (Ctrl-C, SIGTERM, SIGHUP) or cancelled; 1 when the run stopped on an error, the result could
    not be saved where asked, or no figure was measured ("No figures were measured." is a failure, not a result);
    else 0."""
    if interrupted or result.get("cancelled"):
        return ExitCode.INTERRUPTED
    if result.get("error") or save_rc:
        return ExitCode.FAIL
    if not any(x.get("total_tok_s") is not None for x in result.get("table") or []):
        return ExitCode.FAIL
    return ExitCode.OK


from ..bench.results import render, render_compare  # noqa: E402,F401 - the text the CLI prints
