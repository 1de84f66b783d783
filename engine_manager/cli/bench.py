"""``dsv41 bench``: the guides' experiments on this machine (issue 18).

``dsv41 bench [--engine sim|llamacpp|strata] [--quick] [--json]`` measures decode at 1/4/8 concurrent users, the
long-prompt pause and the A/B presets, restarting the engine per configuration and putting it back as it was;
the result is saved under the data dir (JSON + CSV). ``--history`` lists saved runs, ``--compare A B`` puts two
side by side, ``--show ID`` prints one. Exit codes: 0 ok, 1 failed, 2 bad usage, 130 interrupted (the engine is
put back first).
"""

from __future__ import annotations

import json
import sys
import threading

from ..errors import UserError


def register(sub) -> None:
    from ..bench import PRESETS
    p = sub.add_parser("bench", help="benchmark the engine against the guides' figures (1/4/8 users, long prompt, "
                                     "settings A/B)",
                       description="Measure decode tok/s at 1, 4 and 8 concurrent users, the pause a ~64K-token "
                                   "prompt causes, and the effect of settings (A/B), beside the guides' figures. "
                                   "The engine is restarted for each configuration and put back as it was.")
    p.add_argument("--engine", choices=("sim", "llamacpp", "strata"), default=None,
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
    p.add_argument("--preset", action="append", choices=sorted(PRESETS), default=None,
                   help="A/B preset (repeatable): numerics, numa, hotset, placement (default: numerics on sim "
                        "and strata)")
    p.add_argument("--no-ab", action="store_true", help="measure the baseline only")
    p.add_argument("--config", action="append", default=[], metavar="NAME:key=value,...",
                   help="another configuration, e.g. slots4:slots=4 or gpu:cpu_numerics=gpu")
    p.add_argument("--ab-users", default="1", help="user counts the other configurations measure (default 1)")
    p.add_argument("--plan", default=None, help="a saved plan to start the engine with")
    p.add_argument("--out", default=None, help="save the result here instead of the data dir's bench folder")
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


def run(args, ctx) -> int:
    from .. import bench
    from ..bench import results

    if args.history:
        rows = results.history()
        if args.json:
            print(json.dumps(rows, indent=1, default=str))
        elif not rows:
            print(f"No saved benchmarks yet in {results.bench_dir()}. Run `dsv41 bench --quick`.")
        for r in rows if not args.json else []:
            tot = " ".join(f"{u}u {v:.1f}" for u, v in (r.get("totals") or {}).items() if v is not None)
            print(f"{r['id']}  {r.get('engine') or '?':8} {'SIMULATED ' if r.get('simulated') else ''}"
                  f"{'quick ' if r.get('quick') else ''}{tot} tok/s")
        return 0
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
    plan = None
    if args.plan:
        from .engine import PlanFileError, load_plan_file
        try:
            plan = load_plan_file(args.plan)
        except PlanFileError as exc:
            print(f"dsv41 bench: {exc}", file=sys.stderr)
            return 2
    presets = [] if args.no_ab else args.preset
    kw = {"users": _ints(args.users, "--users"), "ab_users": _ints(args.ab_users, "--ab-users"),
          "prompt_tokens": max(8, args.prompt_tokens), "long_prompt_tokens": max(0, args.long_prompt),
          "long_users": max(1, min(7, args.long_users))}
    if args.tokens:
        kw["tokens"] = max(8, args.tokens)
    if args.repeats:
        kw["repeats"] = max(1, args.repeats)
    spec = bench.BenchSpec.make(engine, quick=args.quick, presets=presets, **kw)
    spec.configs += [bench.parse_config(c) for c in args.config]
    from .. import hardware
    try:
        hw = hardware.probe(None)
    except Exception:  # noqa: BLE001 - the report is saved without it
        hw = None
    stop = threading.Event()
    out = sys.stderr if args.json else sys.stdout
    gen = bench.run_bench(settings, spec, plan=plan, hardware=hw, stop=stop)
    result = None
    interrupted = False
    while True:
        try:                  # Ctrl-C anywhere in here: cut the streams, let the bench put the engine back
            try:
                ev = next(gen)
            except StopIteration as st:
                result = st.value
                break
            _print_event(ev, out)
        except KeyboardInterrupt:
            if interrupted:   # a second Ctrl-C: leave now (the engine may be left running; `dsv41 stop` stops it)
                raise
            interrupted = True
            stop.set()
            print("\ninterrupted: cutting the streams and putting the engine back…", file=sys.stderr, flush=True)
    if result is None:
        return 1
    if args.out:
        from pathlib import Path
        jp, cp = results.save(result, Path(args.out))
    else:
        jp, cp = results.save(result)
    if args.json:
        print(json.dumps(result, indent=1, default=str))
    else:
        print(render(result))
    print(f"saved: {jp} and {cp}", file=out)
    if interrupted or result.get("cancelled"):
        return 130
    return 1 if result.get("error") else 0


from ..bench.results import render, render_compare  # noqa: E402,F401 - the text the CLI prints
