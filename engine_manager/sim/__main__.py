"""``python -m engine_manager.sim``: the scripted engine, a real HTTP server on 127.0.0.1 that speaks Strata's
endpoints and models the expert offload (:mod:`.offload`). Everything it reports is SIMULATED (``service:
strata-sim``).

Its flags (``--help`` lists them) are stable: the supervisor, metrics, chat and bench tests rely on them. They
serve (``--plan``, ``--host/--port``, ``--api-key-file``, ``--slots``), shape the model (``--skew``, ``--seed``,
``--numa``), accept Strata's own engine flags, and switch faults on for test doubles (``--never-ready``,
``--fail-at-load``, ``--sigkill-after-tokens``, ``--stall-after-tokens``, ``--error-after-tokens``…). Extra
arguments may come from ``DSV41_SIM_ARGS`` (split like a shell would), appended after the command line's; there
--host, --port, --api-key, --api-key-file and --plan are refused (exit 2).

Log lines (stdout) are Strata's: ``phase: ...`` while loading, ``INFO key=value ...``, ``READY http://host:port``,
``adapt: ...`` (the adaptive tier's swaps, only in the log) and the per-request ``[strata] done: ...`` line.
Exit codes: 0 after SIGTERM/SIGINT, 2 bad usage / port in use / refused plan, 1 a load failure, -9 SIGKILL faults.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

from .model import Engine, Faults, Options, log
from .offload import N_TOPICS, Layout, OffloadModel, read_strp
from .server import PortInUse, bind, serve

LOAD_FAILURES = {
    "cuda-oom": "CUDA error: out of memory: cudaMalloc failed while allocating the expert cache "
                "({mib} MiB) [simulated]",
    "driver": "CUDA driver version is insufficient for CUDA runtime version: the driver is 535.104.05, "
              "this engine needs 580.65 or newer (CUDA 13) [simulated]",
    "profile": "error: expert profile refused: it ranks 43 x 256 pairs but the model has {layers} x {experts} "
               "[simulated]",
    "crash": "Segmentation fault (core dumped) [simulated]",
}


class _RaisingParser(argparse.ArgumentParser):
    """A parser that raises instead of printing and exiting: for checking flags inside another program."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def build_parser(add_help: bool = True, prog: str = "python -m engine_manager.sim",
                 parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = parser_class(prog=prog, add_help=add_help,
                                description="The scripted engine (simulated): Strata's endpoints, a modelled "
                                            "expert offload, fault switches for tests.")
    a = p.add_argument_group("serving").add_argument
    a("--plan", metavar="FILE", help="the planner's plan JSON (default: the guides' reference layout)")
    a("--host", default="127.0.0.1", metavar="ADDR", help="address to listen on (default 127.0.0.1)")
    a("--port", type=int, default=8090, metavar="N", help="port to listen on (default 8090); in use: exit 2")
    a("--api-key", default="", metavar="KEY",
      help="require this key (Bearer or x-api-key) on all but /health; visible in `ps` - prefer --api-key-file")
    a("--api-key-file", default=None, metavar="FILE",
      help="read the key from FILE (first line; keep it 0600): the key stays off the command line")
    a("--slots", "--batch", dest="slots", type=int, default=None, metavar="N",
      help="concurrent slots 1..8 (default: the plan's, else 1)")
    a("--queue", type=int, default=8, metavar="N",
      help="accepted for compatibility, ignored: chat requests always queue (FIFO), as Strata's do")
    a("--max-context", type=int, default=None, metavar="N", help="context per slot (default: the plan's, else 32768)")
    a("--default-max-tokens", type=int, default=None, metavar="N",
      help="max_tokens when a request gives none (default: $DSV41_DEFAULT_MAX_TOKENS, else 4096)")
    a("--load-time", type=float, default=1.0, metavar="S", help="seconds of loading before the port opens (default 1)")
    a("--speed", type=float, default=1.0, metavar="F",
      help="run F times faster than modelled time (tests); reported figures stay modelled")
    a("--reply-tokens", type=int, default=None, metavar="N",
      help="every reply is exactly N tokens (or max_tokens if smaller): for benchmarks")
    a("--verbose", action="store_true", help="log every HTTP request")
    a = p.add_argument_group("offload model (engine_manager/sim/offload.py)").add_argument
    a("--skew", default="reference", metavar="NAME",
      help="routing skew: reference | mild | steep | flat | zm:S[,Q] (default reference: 0.90 hits at 37.9%% hot)")
    a("--seed", type=int, default=41, metavar="N", help="seed of the routing distribution (default 41)")
    a("--routing-seed", type=int, default=None, metavar="N",
      help="seed of the routing draws (default: fresh each run, like real traffic)")
    a("--initial-hot", choices=("auto", "plan", "ideal", "random"), default="auto",
      help="how the VRAM hot set starts (default auto: the profile, else the plan's, else ideal)")
    a("--numa", choices=("bound", "unbound"), default="bound",
      help="unbound doubles the CPU experts' time (~53 instead of ~63 tok/s for 1 user)")
    a = p.add_argument_group("Strata's engine flags (accepted and modelled)").add_argument
    a("--expert-cache", default="auto", metavar="auto|N", help="VRAM expert slots (default auto: the plan's)")
    a("--expert-profile", default=None, metavar="STRP", help="Strata expert profile that fills the slots")
    a("--vram-reserve-mib", type=int, default=700, metavar="N", help="VRAM kept free, MiB (default 700)")
    a("--kv", choices=("int8", "q4_0", "k8v4", "fp16"), default=None, help="KV cache type (default: the plan's)")
    a("--cpu-numerics", choices=("fork", "gpu"), default="fork",
      help="gpu = bit-identical batched answers, 25.7%% slower for 1 user (default fork)")
    a("--pcie-frac", type=float, default=0.1, metavar="F",
      help="share of the missed experts the GPU reads over PCIe instead of the CPU computing them; they are not "
           "in the hit rate's lookups, as in Strata (default 0.1)")
    a("--adapt-every", type=int, default=4, metavar="N", help="adaptive tier: a swap round every N steps (default 4)")
    a("--adapt-swaps", type=int, default=96, metavar="N", help="adaptive tier: at most N swaps a round (default 96)")
    a("--adapt-decay", type=float, default=0.7, metavar="F", help="adaptive tier: usage decay per round (default 0.7)")
    a("--dump-routing", default=None, metavar="FILE", help="write the routing trace (Strata's format) to FILE")
    a("--dump-routing-max-mb", type=float, default=0.0, metavar="N",
      help="keep the trace bounded: at start and whenever it reaches N MB it moves to FILE.1 (default 0: no cap)")
    a("--gpu", type=int, default=0, metavar="N", help="accepted for Strata compatibility, ignored")
    a("--lazy", action="store_true", help="accepted for Strata compatibility, ignored")
    a("--config", default=None, metavar="FILE", help="accepted for Strata compatibility, ignored")
    a = p.add_argument_group("fault switches (test doubles for the panel's failure paths)").add_argument
    a("--never-ready", action="store_true", help="fault: bind the port but never open it nor print READY")
    a("--fail-bind", action="store_true", help="fault: exit 2 at start as if the port were in use")
    a("--fail-at-load", choices=tuple(LOAD_FAILURES), default=None,
      help="fault: print that failure's log line while loading and exit 1")
    a("--sigkill-at-load", action="store_true", help="fault: SIGKILL itself while loading (as the OOM killer would)")
    a("--sigkill-after-tokens", type=int, default=None, metavar="N",
      help="fault: SIGKILL itself after N generated tokens (all requests together)")
    a("--die-after-tokens", type=int, default=None, metavar="N",
      help="fault: print a fatal line and exit with --die-code after N tokens")
    a("--die-code", type=int, default=1, metavar="N", help="exit code for --die-after-tokens (default 1)")
    a("--stall-after-tokens", type=int, default=None, metavar="N",
      help="fault: stop for --stall-s wall seconds once, mid-stream, after N tokens")
    a("--stall-s", type=float, default=0.0, metavar="S", help="length of the --stall-after-tokens stall")
    a("--error-after-tokens", type=int, default=None, metavar="N",
      help="fault: every reply ends after N tokens with an error frame, then [DONE]")
    a("--admit-experts", type=int, default=None, metavar="N",
      help="fault: the expert cache admits only N experts, fewer than planned")
    a("--file-reads", action="store_true",
      help="fault: no pinned arena; every expert the CPU computes is read from the file")
    return p


def read_key_file(path: str) -> str:
    """The key in ``path`` (its first line, whitespace stripped). Raises ``ValueError`` in plain words."""
    try:
        with open(path, encoding="utf-8") as f:
            key = f.readline().strip()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if not key:
        raise ValueError(f"{path} holds no key (its first line is empty)")
    return key


DEFAULT_MAX_TOKENS_ENV = "DSV41_DEFAULT_MAX_TOKENS"
MAX_TOKENS_LIMIT = 1_048_576


def default_max_tokens(parser: argparse.ArgumentParser) -> int:
    """``$DSV41_DEFAULT_MAX_TOKENS`` (the guides' setting), read only when the sim runs without
    ``--default-max-tokens``: a bad value is a usage error (exit 2) that names the variable. Importing this module
    (every ``dsv41`` command does) never reads it."""
    raw = os.environ.get(DEFAULT_MAX_TOKENS_ENV)
    if raw is None or not raw.strip():
        return 4096
    try:
        value = int(raw.strip())
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_TOKENS_LIMIT:
        shown = raw if len(raw) <= 40 else raw[:40] + "..."
        parser.error(f"{DEFAULT_MAX_TOKENS_ENV}={shown!r} is not allowed: it must be an integer from 1 to "
                     f"{MAX_TOKENS_LIMIT}; fix or unset the variable, or pass --default-max-tokens N")
    return value


# Flags DSV41_SIM_ARGS may not give: where the sim listens and with which key are the panel's to say (every engine
# it starts listens on 127.0.0.1 with a generated key); the extra flags come last, so one of these would win.
PANEL_ONLY_FLAGS = ("host", "port", "api_key", "api_key_file", "plan")


def env_args_problem(text: str) -> str | None:
    """Why the extra flags ``text`` (``DSV41_SIM_ARGS``) cannot be used, in words, or None. Parsed with the sim's own
    parser, so an abbreviation (``--ho 0.0.0.0``) or ``--host=…`` is caught as ``--host`` is."""
    try:
        words = shlex.split(text)
    except ValueError as exc:
        return f"DSV41_SIM_ARGS cannot be split into flags ({exc})"
    if not words:
        return None
    parser = build_parser(add_help=False, parser_class=_RaisingParser)
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    try:
        given, _rest = parser.parse_known_args(words)
    except ValueError as exc:               # a bad value: the sim's own parsing says it, naming the flag
        return f"DSV41_SIM_ARGS: {exc}"
    taken = [f"--{d.replace('_', '-')}" for d in PANEL_ONLY_FLAGS if d in vars(given)]
    if taken:
        return (f"DSV41_SIM_ARGS gives {', '.join(taken)}, which only the panel sets (the engine listens on "
                "127.0.0.1 with a generated key). Remove it from DSV41_SIM_ARGS (`dsv41 settings set sim_args "
                "...`); change the port with `dsv41 settings set port N`")
    return None


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    extra = os.environ.get("DSV41_SIM_ARGS", "").strip()
    if extra:
        problem = env_args_problem(extra)
        if problem:
            parser.error(problem)
        argv += shlex.split(extra)
    args = parser.parse_args(argv)
    if args.slots is not None and not 1 <= args.slots <= 8:
        parser.error(f"argument --slots: {args.slots} is not in 1..8")
    if args.speed <= 0:
        parser.error("argument --speed: must be > 0")
    if args.default_max_tokens is None:
        args.default_max_tokens = default_max_tokens(parser)
    elif not 1 <= args.default_max_tokens <= MAX_TOKENS_LIMIT:
        parser.error(f"argument --default-max-tokens: {args.default_max_tokens} is not in 1..{MAX_TOKENS_LIMIT}")
    if args.api_key_file:
        if args.api_key:
            parser.error("argument --api-key-file: give either --api-key or --api-key-file, not both")
        try:
            args.api_key = read_key_file(args.api_key_file)
        except ValueError as exc:
            parser.error(f"argument --api-key-file: {exc}")
    args._parser = parser
    return args


def load_layout(args: argparse.Namespace) -> Layout:
    if not args.plan:
        return Layout.reference()
    from ..plans import PlanError, read_plan_file
    try:
        # checked field by field as every plan is (engine_manager/plans.py): a hostile plan is refused in words
        # here, never a traceback, a crash loop or an allocation by the size it claims
        plan = read_plan_file(args.plan, check_paths=False, require_model=False)
    except PlanError as exc:
        args._parser.error(f"argument --plan: {exc}")
    return Layout.from_plan(plan)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    parser = args._parser
    layout = load_layout(args)
    if layout.refused:
        log(f"error: placement refused: {layout.refused}")
        return 2
    # Strata's words (serve/server.py main() / listen_problem): "port N is already in use - is Strata (or another
    # server) already running? Close it, or start this one with a different --port", exit 2
    if args.fail_bind:
        parser.error(f"port {args.port} is already in use - is Strata (or another server) already running? "
                     "Close it, or start this one with a different --port (fault switch --fail-bind) [simulated]")
    try:
        srv = bind(args.host, args.port)
    except PortInUse as exc:
        parser.error(f"port {args.port} is already in use - is Strata (or another server) already running? "
                     f"Close it, or start this one with a different --port ({args.host}: {exc})")

    stop = threading.Event()

    def on_signal(signum, frame):  # noqa: ARG001
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    if args.expert_cache not in ("auto", None):
        try:
            layout.n_hot = int(args.expert_cache)
        except ValueError:
            parser.error(f"argument --expert-cache: {args.expert_cache!r} is not auto or a number")
    if args.admit_experts is not None and 0 <= args.admit_experts < layout.n_hot:
        # as an engine whose cache allocation came up short: it runs on with fewer experts in VRAM than asked for
        log(f"expert cache: only {args.admit_experts} of the {layout.n_hot} expert slots asked for could be "
            "allocated (fault switch --admit-experts) [simulated]")
        layout.n_hot = args.admit_experts
    if args.file_reads:
        log("expert arena: the pinned host arena could not be allocated; cold experts are read from the model "
            "file (fault switch --file-reads) [simulated]")
    slots = args.slots or max(1, min(8, layout.slots))
    max_context = args.max_context or layout.max_context
    faults = Faults(never_ready=args.never_ready, die_after_tokens=args.die_after_tokens, die_code=args.die_code,
                    sigkill_after_tokens=args.sigkill_after_tokens, sigkill_at_load=args.sigkill_at_load,
                    stall_after_tokens=args.stall_after_tokens, stall_s=args.stall_s,
                    error_after_tokens=args.error_after_tokens, fail_at_load=args.fail_at_load,
                    admit_experts=args.admit_experts, file_reads=args.file_reads)
    opts = Options(host=args.host, port=srv.server_address[1], api_key=args.api_key, slots=slots,
                   queue_limit=max(0, args.queue), max_context=max_context,
                   default_max_tokens=args.default_max_tokens, load_time_s=max(0.0, args.load_time),
                   speed=args.speed, reply_tokens=args.reply_tokens, dump_routing=args.dump_routing,
                   dump_routing_max_bytes=max(0, int(args.dump_routing_max_mb * 1e6)),
                   vram_reserve_mib=args.vram_reserve_mib, kv=args.kv or layout.kv_type,
                   cpu_numerics=args.cpu_numerics, adapt_every=args.adapt_every, adapt_swaps=args.adapt_swaps,
                   adapt_decay=args.adapt_decay, skew=args.skew, seed=args.seed, verbose=args.verbose,
                   pcie_frac=min(1.0, max(0.0, args.pcie_frac)),
                   faults=faults)

    log(f"strata-sim {opts.host}:{opts.port}: SIMULATED engine - no GPU is used; every speed, hit rate and "
        "swap comes from the offload model in engine_manager/sim/offload.py")
    t0 = time.monotonic()
    log(f"phase: reading model headers: {layout.model_name}, {layout.n_layers_total} layers, "
        f"{layout.n_moe} MoE layers x {layout.n_experts} experts, {layout.k} used per token")
    profile_pairs = None
    if args.expert_profile:
        try:
            nl, ne, _, profile_pairs = read_strp(args.expert_profile)
        except (OSError, ValueError) as exc:
            log(f"error: expert profile refused: {exc}")
            return 2
        if ne != layout.n_experts or nl not in (layout.n_moe, layout.n_layers_total):
            log(f"error: expert profile refused: it is {nl} x {ne} but the model has "
                f"{layout.n_layers_total} x {layout.n_experts}")
            return 2
        if nl == layout.n_moe and layout.moe_layers and layout.moe_layers[0] != 0:
            profile_pairs = [(layout.moe_layers[l], e) for l, e in profile_pairs if 0 <= l < layout.n_moe]
    try:
        model = OffloadModel(layout, skew=args.skew, seed=args.seed, initial_hot=args.initial_hot,
                             profile_pairs=profile_pairs, adapt_every=args.adapt_every,
                             adapt_swaps=args.adapt_swaps, adapt_decay=args.adapt_decay,
                             cpu_numerics=args.cpu_numerics, numa_bound=args.numa == "bound",
                             routing_seed=args.routing_seed, topics=N_TOPICS)
    except ValueError as exc:
        parser.error(str(exc))
    hot_mib = int(model.hot.sum()) * layout.expert_bytes / (1 << 20)
    log(f"INFO expert cache filled from {model.initial_hot_source} [simulated]")
    log(f"INFO expert_slots={int(model.hot.sum())} expert_cache_mib={hot_mib:.0f} batch_slots={slots} "
        f"max_context={max_context} kv={opts.kv} vram_reserve_mib={opts.vram_reserve_mib} "
        f"cpu_numerics={opts.cpu_numerics} skew={model.dist.skew.name} exponent={model.dist.exponent:.3f} "
        f"expected_hit_rate={model.expected_hit_rate():.4f} simulated=1")

    phases = ["mapping the model's 7 shards", "filling the expert cache", "pinning cold experts in RAM",
              "allocating the KV cache", "warming up"]
    budget = opts.load_time_s
    for i, name in enumerate(phases):
        pct = int(100 * (i + 1) / len(phases))
        extra = f" {int(model.hot.sum())} experts ({hot_mib / 1024:.1f} GiB)" if "expert cache" in name else ""
        log(f"phase: {name}{extra} ({pct}%)")
        if i == 1 and args.sigkill_at_load:
            os.kill(os.getpid(), signal.SIGKILL)
        if i == 1 and args.fail_at_load:
            log(LOAD_FAILURES[args.fail_at_load].format(mib=int(hot_mib), layers=layout.n_moe,
                                                        experts=layout.n_experts))
            return 1
        wait = t0 + budget * (i + 1) / len(phases) - time.monotonic()
        if wait > 0 and stop.wait(wait):
            log("interrupted while loading")
            return 0
    if args.never_ready:
        log("phase: waiting for the engine (fault switch --never-ready: this never finishes) [simulated]")
        stop.wait()
        srv.server_close()
        return 0
    if args.dump_routing:
        Path(args.dump_routing).parent.mkdir(parents=True, exist_ok=True)
    engine = Engine(opts, model, layout)
    if args.dump_routing:
        log(f"INFO dump_routing={args.dump_routing}")
    return serve(srv, engine, opts, stop)


if __name__ == "__main__":
    sys.exit(main())
