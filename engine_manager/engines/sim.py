"""The scripted engine (``engine_manager.sim``) behind the panel's interface: a real separate process and HTTP
server speaking Strata's endpoints, with a modelled offload. Everything it reports is simulated, and the label
says so wherever a user can see it.

Launch: ``<this python> -m engine_manager.sim --plan <workdir>/plan.json --host H --port N --api-key-file
<workdir>/sim-api-key --dump-routing <workdir>/routing.trace --dump-routing-max-mb 64`` plus the settings it models;
extra flags (faults, ``--speed``, ``--skew`` ...) come from ``DSV41_SIM_ARGS``. The key is in a 0600 file, never on
a command line (``ps``; the keeper's command line repeats the engine's). Its endpoints, fields, nulls and log lines
are Strata's (``tests/test_sim_conformance.py`` diffs them against ``tests/data/strata``), so :meth:`SimEngine.poll`
is Strata's code (``strata.poll_metrics``) and swaps are counted from the log (``adapt: ... swapped N experts``); its
only extra is ``"simulated": true`` (``service`` ``strata-sim``). The routing trace feeds the Placement heatmap; it
is capped: moved to ``routing.trace.1`` at start and at 64 MB (the monitor counts across the move; its size per
token: benchmarks/results/design_figures.md).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any, Callable

from ..atomic import atomic_write_bytes, atomic_write_json
from ..errors import EngineSetupError, PlacementRefused
from .base import Engine, Evidence, FailureHint, LaunchSpec, LogEvent, Readiness, Sample
from .strata import (
    FAILURE_PATTERNS,
    check_readiness,
    classify,
    parse_strata_log_line,
    poll_metrics,
)

LABEL = "Scripted engine (SIMULATED — no GPU, modelled speeds)"
# the folder that holds this engine_manager package: the child imports the same code as the panel, whatever
# the interpreter's own site-packages (or the working directory) would resolve
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def sim_env(base: dict[str, str] | None = None, sim_args: str = "") -> dict[str, str]:
    """PYTHONPATH with the panel's own package root first, unbuffered output, and the ``sim_args`` setting
    (``DSV41_SIM_ARGS``: fault switches and other sim flags) for the process to read."""
    import os

    current = (base if base is not None else os.environ).get("PYTHONPATH", "")
    parts = [PACKAGE_ROOT] + [p for p in current.split(os.pathsep) if p and p != PACKAGE_ROOT]
    env = {"PYTHONPATH": os.pathsep.join(parts), "PYTHONUNBUFFERED": "1"}
    if sim_args:
        env["DSV41_SIM_ARGS"] = sim_args
    return env


KEY_FILE = "sim-api-key"
TRACE_FILE = "routing.trace"
TRACE_MAX_MB = 64


def _flag_value(args: list[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def write_key_file(path: Path, api_key: str) -> Path:
    """The key in an owner-only (0600) file, for ``--api-key-file``."""
    atomic_write_bytes(Path(path), (api_key + "\n").encode())
    return Path(path)


def sim_argv(plan_path: str | None, host: str, port: int, key_file: str | None,
             extra: list[str] | None = None) -> list[str]:
    """The sim's command line. The key is never on it: ``key_file`` names the 0600 file that holds it."""
    from ..frozen import module_argv     # in the one-folder bundle: `<bundle>/dsv41 -m engine_manager.sim`
    argv = module_argv("engine_manager.sim")
    if plan_path:
        argv += ["--plan", str(plan_path)]
    argv += ["--host", host, "--port", str(port)]
    if key_file:
        argv += ["--api-key-file", str(key_file)]
    return argv + list(extra or [])


def apply_sim_block(s: Sample, doc: dict[str, Any], previous: Sample | None) -> Sample:
    """Swaps from the ``sim`` block that the scripted engine's first version (``sim-1``) sent on HTTP; kept for
    its recorded captures (``tests/data/sim``). The current sim (``sim-2``) sends none, as Strata sends none: a
    document without the block leaves the sample as it is."""
    raw = doc.get("sim")
    sim: dict[str, Any] = raw if isinstance(raw, dict) else {}
    swaps, sbytes = sim.get("swaps_total"), sim.get("swap_bytes_total")
    if isinstance(swaps, int):
        s.swaps_total = swaps
        s.extra["swap_bytes_total"] = sbytes if isinstance(sbytes, int) else None
        if previous is not None and previous.swaps_total is not None and s.t > previous.t \
                and swaps >= previous.swaps_total:
            dt = s.t - previous.t
            s.swaps_per_s = (swaps - previous.swaps_total) / dt
            pb = previous.extra.get("swap_bytes_total")
            if isinstance(sbytes, int) and isinstance(pb, int) and sbytes >= pb:
                s.swap_mb_s = (sbytes - pb) / dt / 1e6
    for key in ("hit_rate_total", "expected_hit_rate", "speed", "skew", "adapt_rounds"):
        if key in sim:
            s.extra[f"sim_{key}"] = sim[key]
    return s


class SimEngine(Engine):
    name = "sim"
    label = LABEL
    simulated = True
    failure_patterns = FAILURE_PATTERNS
    words = "the scripted engine (simulated)"
    kind_label = "scripted engine (simulated)"
    choice_label = "Scripted engine (simulated)"
    plans_reference_host = True
    bench_presets = ("numerics", "numa", "hotset")
    default_bench_presets = ("numerics",)
    cpu_numerics = True
    stops_at_eos = False                     # a scripted reply has the length asked (--reply-tokens caps it)
    bench_long_decode_tokens = 4096

    def bench_settings(self, settings: Any, *, reply_tokens: int, numa_off: bool,
                       expert_cache: Callable[[], int] | None) -> dict[str, Any]:
        """The knobs of its modelled world are flags, added to the ``sim_args`` setting."""
        extra = [f"--reply-tokens {reply_tokens}"]
        if numa_off:
            extra.append("--numa unbound")
        if expert_cache is not None:
            extra.append(f"--expert-cache {expert_cache()}")
        return {"sim_args": " ".join([str(getattr(settings, "sim_args", "") or "")] + extra).strip()}

    def started_by_hand(self, argv: list[str]) -> bool:
        """``python -m engine_manager.sim …``, ``dsv41 sim …`` or ``python -m engine_manager sim …``."""
        if any(a == "engine_manager.sim" or a.endswith("/engine_manager/sim/__main__.py") for a in argv):
            return True
        return any((a == "engine_manager" or a.rsplit("/", 1)[-1] == "dsv41") and argv[i + 1] == "sim"
                   for i, a in enumerate(argv[:-1]))

    def recognise(self, ev: Evidence) -> tuple[list[str], list[str]] | None:
        if not ev.service or ev.service.lower() != "strata-sim":
            return None
        return ["the scripted engine's /api/health (service strata-sim): its figures are simulated"], []

    def build_launch(self, settings: Any, plan: dict[str, Any] | None, workdir: Path) -> LaunchSpec:
        if plan and plan.get("refused"):
            raise PlacementRefused(f"The placement was refused: {plan['refused']}")
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        files: dict[str, str] = {}
        plan_path = None
        if plan:
            plan_path = workdir / "plan.json"
            atomic_write_json(plan_path, plan)
            files["plan"] = str(plan_path)
        extra = ["--slots", str(int(settings.slots)), "--max-context", str(int(settings.context_length)),
                 "--kv", settings.kv_type, "--cpu-numerics", settings.cpu_numerics,
                 "--vram-reserve-mib", str(int(settings.vram_reserve_mib)),
                 "--default-max-tokens", str(int(settings.default_max_tokens))]
        sim_args = getattr(settings, "sim_args", "") or ""
        if sim_args:
            from ..sim.__main__ import env_args_problem   # the sim's own parser: abbreviations count too

            problem = env_args_problem(sim_args)
            if problem:
                raise EngineSetupError(problem)
        try:
            own_trace = _flag_value(shlex.split(sim_args), "--dump-routing")
        except ValueError:
            own_trace = None
        if own_trace:                      # the user's sim_args name a trace (they come last, so theirs is used)
            files["routing_trace"] = str(workdir / own_trace)          # relative: to the sim's cwd, the workdir
        else:
            files["routing_trace"] = str(workdir / TRACE_FILE)
            extra += ["--dump-routing", files["routing_trace"], "--dump-routing-max-mb", str(TRACE_MAX_MB)]
        key_file = None
        if settings.api_key:
            key_file = write_key_file(workdir / KEY_FILE, settings.api_key)
            files["api_key"] = str(key_file)
        argv = sim_argv(str(plan_path) if plan_path else None, settings.host, int(settings.port),
                        str(key_file) if key_file else None, extra)
        return LaunchSpec(engine=self.name, argv=argv, host=settings.host, port=int(settings.port),
                          api_key=settings.api_key, env=sim_env(sim_args=sim_args),
                          cwd=str(workdir),
                          files=files, simulated=True, label=self.label)

    def preflight(self, spec: LaunchSpec) -> list[str]:
        return []

    def readiness(self, client: Any, spec: LaunchSpec) -> Readiness:
        return check_readiness(client, spec, service_hint="strata")

    def poll(self, client: Any, spec: LaunchSpec, previous: Sample | None) -> Sample:
        """The Strata adapter's own poll (the same requests, the same mapping), labelled simulated."""
        return poll_metrics(client, spec, previous, engine=self.name, simulated=self.simulated)

    def parse_log_line(self, line: str) -> LogEvent | None:
        return parse_strata_log_line(line, self.failure_patterns)

    def classify_failure(self, returncode: int | None, log_tail: list[str]) -> FailureHint | None:
        return classify(self.failure_patterns, returncode, log_tail)


ENGINE = SimEngine()
