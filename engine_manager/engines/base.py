"""The one small interface every engine sits behind, and the common metric sample.

An engine module turns (settings, plan, binding) into a :class:`LaunchSpec` (argv, environment, generated files),
knows what readiness looks like, maps its metric endpoints and log lines onto :class:`Sample`, and knows its
failure signatures. The supervisor, the metrics collectors, the CLI and the GUI use only this interface.

Units: tok/s, bytes, MB/s (10^6 bytes per second, as NVML reports KB/s ×1000), rates in 0..1, times in seconds.
A field that is ``None`` is *missing* (the source did not say), never zero.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

ReadyState = Literal["loading", "ready", "failed"]


@dataclass
class LaunchSpec:
    """Everything needed to start one engine process. The binding prefix (numactl/taskset) is added by the
    supervisor, in front of ``argv``."""

    engine: str
    argv: list[str]
    host: str
    port: int
    api_key: str = field(repr=False)                     # never in a repr (logs, tracebacks)
    env: dict[str, str] = field(default_factory=dict, repr=False)   # added to the panel's environment (may hold tokens)
    cwd: str | None = None
    health_path: str = "/health"
    files: dict[str, str] = field(default_factory=dict)  # generated files: role -> path (config, profile, plan)
    simulated: bool = False
    label: str = ""

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def secrets(self) -> list[str]:
        return [s for s in (self.api_key, self.env.get("HF_TOKEN"), self.env.get("DSV41_HF_TOKEN")) if s]

    def masked_argv(self, prefix: list[str] | None = None) -> list[str]:
        return [mask_in(a, self.secrets()) for a in [*(prefix or []), *self.argv]]

    def masked_env(self) -> dict[str, str]:
        return {k: mask_in(v, self.secrets()) for k, v in self.env.items()}


def mask_in(text: str, secrets: list[str]) -> str:
    for s in secrets:
        if s and s in text:
            text = text.replace(s, f"{s[:4]}…(masked)")
    return text


@dataclass
class Readiness:
    state: ReadyState
    detail: str = ""          # e.g. "connection refused: still loading", "HTTP 503 loading model"


@dataclass
class Sample:
    """One reading of the engine, in the panel's common terms. ``None`` means missing."""

    t: float                                   # time.time() of the reading
    engine: str
    simulated: bool = False
    state: str | None = None                   # unloaded / idle / reading / generating
    decode_tok_s: float | None = None          # live decode rate, all slots together
    prefill_tok_s: float | None = None         # live (or last request's) prompt processing rate
    decode_tok_s_per_slot: dict[int, float] | None = None
    hit_rate: float | None = None              # the engine's own hit rate: GPU hits / expert lookups (0..1)
    # share of the routed expert picks the GPU read over PCIe (Strata's --pcie-frac: not in ``lookups``), so the
    # share of routed picks served from VRAM is hit_rate × (1 − pcie_share) (:func:`vram_share`)
    pcie_share: float | None = None
    swaps_per_s: float | None = None           # expert swaps host→VRAM per second
    swaps_total: int | None = None             # cumulative since the engine started
    swap_mb_s: float | None = None             # MB/s moved by swaps (when the engine says)
    pcie_rx_mb_s: float | None = None          # host→GPU as the engine or NVML reports
    pcie_tx_mb_s: float | None = None
    vram_used_bytes: int | None = None
    vram_total_bytes: int | None = None
    ram_used_bytes: int | None = None
    ram_total_bytes: int | None = None
    slots_busy: int | None = None
    slots_total: int | None = None
    queued: int | None = None
    requests_total: int | None = None
    tokens_generated_total: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


#: the figures an adapter may export (Engine.exports): every Sample reading, and what an engine's log may report
FIGURES: tuple[str, ...] = (*(f for f in Sample.__dataclass_fields__ if f not in ("t", "engine", "simulated", "extra")),
                            "log_swaps", "log_hits")


def vram_share(hit_rate: float | None, pcie_share: float | None) -> float | None:
    """The share of all routed expert picks served from VRAM. Strata's ``hit_rate`` is hits / lookups and its
    lookups leave out the experts read over PCIe (generate.cpp @2291cb3, the serve loop's DONE: ``[offloaded]``
    "not in [lookups]"), so the VRAM share is ``hit_rate × (1 − pcie_share)``; without a PCIe share it is the hit
    rate itself (an engine that reads no expert over PCIe, or does not say)."""
    if hit_rate is None:
        return None
    return hit_rate * (1.0 - pcie_share) if pcie_share is not None else hit_rate


@dataclass
class LogEvent:
    """Something an engine's log line says that the panel shows or counts."""

    kind: Literal["phase", "ready", "swap", "placement", "error", "info"]
    text: str
    swaps: int = 0              # for kind == "swap": how many swaps this line reports
    swap_bytes: int = 0
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class FailureHint:
    """A crash cause in plain words with a fix."""

    cause: str                 # short id: oom_killed, port_in_use, driver_too_old, cuda_oom, placement_refused, ...
    title: str                 # plain words
    fix: str                   # what to do


@dataclass
class LogPattern:
    regex: re.Pattern[str]
    hint: FailureHint


@dataclass(frozen=True)
class Evidence:
    """What a server showed :func:`engine_manager.connections.detect`, for :meth:`Engine.recognise`."""

    service: str | None = None                         # /api/health's ``service``, as the server wrote it
    metric_names: frozenset[str] = frozenset()         # the series on /metrics (Prometheus text); empty: none
    owned_by: frozenset[str] = frozenset()             # /v1/models' ``owned_by`` values, lower case
    props: bool = False                                # /props answered with llama-server's fields
    models: bool = False                               # /v1/models answered a model list

    def has_prefix(self, prefix: str) -> bool:
        return any(n.startswith(prefix) for n in self.metric_names)


class Engine(ABC):
    """One engine kind. Stateless: every method takes what it needs."""

    name: str = ""
    label: str = ""
    simulated: bool = False
    #: log-line signatures of known failures, checked newest line first
    failure_patterns: list[LogPattern] = []
    #: > 0: the engine's top process stops its own children in its own order when it alone gets one SIGTERM (a
    #: server that sends its native engine a QUIT first); the supervisor then signals only that process and waits up
    #: to this many seconds before it signals the whole process group
    stop_leader_grace_s: float = 0.0
    #: seconds the supervisor waits past its ready timeout: an engine given that timeout as a deadline of its own
    #: (Strata's STRATA_ENGINE_READY_S) then reports its own words before the panel gives up
    ready_margin_s: float = 0.0

    # -- what it is, in words (the registry, engines.registry, lists the names) ------------------------------------
    #: attached to, never started by the panel (engines.registry.ATTACH_ONLY lists the same names)
    attach_only: bool = False
    #: how a sentence names it (events.engine_words); "" → its name
    words: str = ""
    #: its kind in the connections list (connections.KIND_LABELS)
    kind_label: str = ""
    #: its line in the engine chooser (the engine panel, startable engines only)
    choice_label: str = ""

    # -- starting it (start_plan, the InferenceKey backend) --------------------------------------------------------
    #: it models the guides' reference host: its default plan is the reference placement on the replica layout
    #: (start_plan.default_plan), and a plan made for a hypothetical host suits it (start_plan.usable_plan)
    plans_reference_host: bool = False
    #: without a GPU it runs every layer on the CPU, so there is no placement to plan
    cpu_without_gpu: bool = False
    #: the setting naming its model file, when it has its own (llama.cpp's ``llamacpp_model``); None: the plan's
    model_setting: str | None = None
    #: a failing ``driver`` verdict of the doctor stops its start on a GPU host (a CUDA build needing a recent driver)
    needs_recent_driver: bool = False
    #: what must be downloaded before it starts (download.download_model / download_engine): "model", "engine"
    downloads: tuple[str, ...] = ()

    # -- its figures (engine_manager.metrics) ----------------------------------------------------------------------
    #: seconds over which the engine's own live decode rate is taken; 0: the adapter rates the engine's token
    #: counters over the poll interval (metrics.steady.SteadyTracker, the Monitor's tok/s tip)
    live_rate_window_s: float = 2.0
    #: ``Sample.prefill_tok_s`` is a live rate at every poll (0 when idle); else only while a prompt is read, and the
    #: last request's otherwise (metrics.hub.prefill_is_live)
    prefill_rate_live: bool = False
    #: it places whole MoE layers (GPU or RAM), not experts: its hit rate is its placement's — live, never a past
    #: request's — and the bench's ``cpu_layers`` configurations apply
    places_layers: bool = False
    #: the plan's key holding this engine's predicted hit rate (metrics.predicted_hit_rate)
    plan_hit_rate_key: str = "predicted_hit_rate"
    #: the sample's ``extra`` key with the decode rate of the replies finished since the previous poll, for an
    #: engine that lists no finished requests (metrics.steady.last_reply); None: it lists them
    reply_rate_extra: str | None = None
    #: its own log says where it put each buffer (engines.llamacpp.placement_from_log)
    placement_in_log: bool = False
    #: the :class:`Sample` figures its adapter fills, and ``"log_swaps"`` / ``"log_hits"`` when its log reports
    #: expert swaps / a decode hit rate; None: it may fill any. A Monitor plot or card drawing only others says "not
    #: exported by this engine" (metrics.hub.not_exported), never a flat 0 or an empty plot
    exports: frozenset[str] | None = None

    # -- chatting with it ------------------------------------------------------------------------------------------
    #: it answers a health route (the chat asks it for the model's name)
    answers_health: bool = True
    #: a line the chat shows about its answers; "" none
    chat_note: str = ""

    # -- benchmarking it (engine_manager.bench) --------------------------------------------------------------------
    #: the bench's A/B presets (bench.PRESETS) that apply to it
    bench_presets: tuple[str, ...] = ("numa",)
    #: the presets the bench runs when none is chosen
    default_bench_presets: tuple[str, ...] = ()
    #: it has the ``--cpu-numerics`` setting and honours ``strata_reproducible`` (the quality run's determinism)
    cpu_numerics: bool = False
    #: a reply ends at the model's end-of-sequence token, so the bench sends ``ignore_eos`` for exact lengths
    stops_at_eos: bool = True
    #: tokens each stream decodes while the bench's long prompt arrives
    bench_long_decode_tokens: int = 16384

    def unexported(self, sample: Sample | None) -> dict[str, str]:
        """Figure (a :class:`Sample` field, ``log_swaps`` or ``log_hits``) → why this engine does not export it: its
        adapter never fills it (:attr:`exports`), or the metric it is read from is absent from this answer (the
        adapter lists those in ``sample.extra["absent"]``: field → metric name)."""
        who = self.kind_label or self.words or self.label or self.name
        out = {f: f"{who} has no such figure" for f in FIGURES if self.exports is not None and f not in self.exports}
        absent = sample.extra.get("absent") if sample is not None else None
        if isinstance(absent, dict):
            out.update({str(f): f"{name} is not on its /metrics" for f, name in absent.items()})
        return out

    def launch_hit_rate(self, spec: LaunchSpec) -> float | None:
        """The hit rate its launch fixes whatever the plan predicts (a build that cannot use the GPU: 0), or None."""
        return None

    def model_path(self, settings: Any, plan: dict[str, Any] | None) -> Path | None:
        """The model file it runs: the plan's, or None when the plan names none."""
        f = ((plan or {}).get("model") or {}).get("file")
        return Path(str(f)) if f else None

    def bench_settings(self, settings: Any, *, reply_tokens: int, numa_off: bool,
                       expert_cache: Callable[[], int] | None) -> dict[str, Any]:
        """Settings that carry the bench's own knobs for one configuration (reply length, NUMA off, an expert
        cache size) when the engine takes them as flags; {} when its settings alone say it."""
        return {}

    def started_by_hand(self, argv: list[str]) -> bool:
        """Whether ``argv`` (a process's command line) is this engine run in the foreground by hand with a
        command of this panel that gives it the settings' key (``dsv41 sim``)."""
        return False

    def chat_base(self, url: str) -> str:
        """The URL the chat appends ``/v1/chat/completions`` to, for a server at ``url``."""
        return url

    def recognise(self, ev: Evidence) -> tuple[list[str], list[str]] | None:
        """(what was found, what is missing), in words, when ``ev`` shows a server of this kind; else None."""
        return None

    @abstractmethod
    def build_launch(self, settings: Any, plan: dict[str, Any] | None, workdir: Path) -> LaunchSpec:
        """argv, env and generated files for (settings, plan). ``plan`` is the planner's plan as a JSON dict
        (see ``engine_manager.placement``); ``workdir`` is where generated files may be written."""

    @abstractmethod
    def readiness(self, client: Any, spec: LaunchSpec) -> Readiness:
        """One readiness check with an ``httpx.Client``; connection refused → loading."""

    @abstractmethod
    def poll(self, client: Any, spec: LaunchSpec, previous: Sample | None) -> Sample:
        """Read the engine's metric endpoints once and map them to a :class:`Sample`. ``previous`` lets an
        adapter turn counters into rates."""

    def parse_log_line(self, line: str) -> LogEvent | None:
        """Map one engine log line to an event (phase, ready, swaps, placement), or None."""
        return None

    def classify_failure(self, returncode: int | None, log_tail: list[str]) -> FailureHint | None:
        """Engine-specific cause of an exit, from the log tail; None when nothing matches."""
        for line in reversed(log_tail):
            for pat in self.failure_patterns:
                if pat.regex.search(line):
                    return pat.hint
        return None
