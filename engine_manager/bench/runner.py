"""The benchmark run: for each configuration, (re)start the engine through an engine session, warm it up, measure
decode at 1/4/8 concurrent streams (repeats), the long-prompt experiment, then restore the engine as it was.

:func:`run_bench` is a generator of typed events (:class:`BenchProgress`, :class:`BenchPhase`, :class:`BenchDone`)
that returns the result document (schema: :mod:`.results`); the CLI prints them, the GUI turns them into signals.
``stop`` (a :class:`~engine_manager.cancel.CancelToken`) cancels: open streams are cut, the bench's engine is
stopped and the engine that ran before (if any) is started again with its own settings and plan.

Configurations (:class:`BenchConfig`) are the A/B of settings overrides (``numa_binding``, ``cpu_numerics``,
``slots``, ``vram_reserve_mib``, ``llamacpp_load_mode``), a hot-set size (``expert_cache``) and, for llama.cpp,
which MoE layers keep their experts in RAM (``cpu_layers``). The first is the baseline; the others are ratios to it.
The scripted engine cannot see a NUMA binding, so ``numa_binding`` off also passes it ``--numa unbound``, and
``--reply-tokens`` makes its replies as long as asked (a real engine is asked with ``ignore_eos``).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, ClassVar, Generator, Iterator

import httpx

from ..cancel import Cancelled, CancelToken
from ..chat import ChatClient, ChatOptions
from ..engines import find_engine
from ..engines._http import SMALL_BODY_CAP, bearer_headers, get_capped, json_body
from ..errors import UserError
from ..eventbase import Event
from ..supervisor_events import Crashed, StartFailed
from ..supervisor_events import Progress as EngineProgress
from ..metrics.guides import GUIDE_TABLE, is_guide_model
from ..engine_state import READY, RunningEngine
from . import prompts as P
from .config import BASELINE, PRESET_BASELINE, PRESETS, BenchConfig
from .stats import measured, summary
from .streams import StreamRecord, Streams, decode_figures

SIM_REPLY_TOKENS = 8192
# A stalled engine is given up on from its own measured pace, not after a phase's whole limit (900 s): no token on
# any stream for STALL_GAPS times the gap between tokens it showed in the warm-up (× the users sharing a step), or
# STALL_MIN_S, whichever is longer; before the first token, PREFILL_FACTOR times the time it took to read a prompt
# of that length in the warm-up.
STALL_MIN_S = 30.0
STALL_GAPS = 50.0
PREFILL_FACTOR = 4.0
WARMUP_STALL_S = 120.0             # before the pace is known: the warm-up's requests


@dataclass
class BenchSpec:
    engine: str = "sim"
    users: tuple[int, ...] = (1, 4, 8)
    tokens: int = 256                 # generated per stream in a decode phase
    prompt_tokens: int = 128          # each decode stream's prompt
    repeats: int = 3
    long_prompt_tokens: int = 65536   # the guides' ~64K-token prompt; 0 = skip the experiment
    long_users: int = 4               # streams decoding while it arrives
    ab_users: tuple[int, ...] = (1,)  # what the other configurations measure
    configs: list[BenchConfig] = field(default_factory=list)     # after the baseline
    baseline: BenchConfig = field(default_factory=lambda: BenchConfig(**BASELINE.to_dict()))
    quick: bool = False
    hub_hz: float = 2.0
    timeout_s: float = 900.0          # one phase's limit
    stall_min_s: float = STALL_MIN_S  # the shortest stall deadline (see BenchRun._deadlines)

    @classmethod
    def make(cls, engine: str = "sim", quick: bool = False, presets: list[str] | None = None, **kw) -> "BenchSpec":
        if presets is None:
            presets = list(find_engine(engine).default_bench_presets)
        configs = [BenchConfig(**c.to_dict()) for p in presets for c in PRESETS[p]]
        baseline = BenchConfig(**BASELINE.to_dict())
        for p in presets:
            baseline.settings.update(PRESET_BASELINE[p])
        if baseline.settings:
            baseline.label = "baseline (" + ", ".join(f"{k} {v}" for k, v in baseline.settings.items()) + ")"
        base: dict[str, Any] = dict(engine=engine, quick=quick, configs=configs, baseline=baseline)
        if quick:
            base.update(tokens=64, repeats=3)
        base.update(kw)
        return cls(**base)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["users"], d["ab_users"] = list(self.users), list(self.ab_users)
        return d


# ------------------------------------------------------------------------------------------------ events
@dataclass(frozen=True)
class BenchProgress(Event):
    kind: ClassVar[str] = "progress"
    config: str
    phase: str
    message: str
    fraction: float
    elapsed_s: float
    eta_s: float | None


@dataclass(frozen=True)
class BenchPhase(Event):
    """A phase measured (``figures`` as in the result document); ``timeline`` holds each stream's token times
    (seconds from the phase's start) for the plots."""
    kind: ClassVar[str] = "phase"
    config: str
    phase: str
    figures: dict[str, Any]


@dataclass(frozen=True)
class BenchNote(Event):
    kind: ClassVar[str] = "note"
    text: str


@dataclass(frozen=True)
class BenchDone(Event):
    kind: ClassVar[str] = "done"
    result: dict[str, Any]
    cancelled: bool = False


BenchEvent = BenchProgress | BenchPhase | BenchNote | BenchDone


# ------------------------------------------------------------------------------------------------ engine control
class EngineControl:
    """Start the engine for each configuration through an engine session; put back what ran before.

    ``session_factory(settings)`` makes a :class:`engine_manager.session.EngineSession` (by default one that never
    restarts a crashed engine); only its ``status``, ``start(engine, plan, watch=False)``, ``stop`` and ``close``
    are used."""

    def __init__(self, settings: Any, hardware: Any = None, session_factory: Callable[..., Any] | None = None,
                 on_engine_event: Callable[[Any], None] | None = None):
        from ..session import EngineSession
        self.on_engine_event = on_engine_event    # every supervisor event (the GUI hands them to its EngineSession)
        self.settings = settings
        self.hardware = hardware
        self.factory = session_factory or (lambda s: EngineSession(s, hardware=hardware, auto_restart=False))
        self.current: Any = None          # the session of the engine the bench started
        self.prior: dict[str, Any] | None = None

    def take_over(self) -> Iterator[BenchEvent]:
        """Note what runs now; stop it (it is started again by :meth:`restore`)."""
        session = self.factory(self.settings)
        st = session.status(check_health=False)
        if st.external:
            from ..procs import describe_owner
            raise UserError(f"Port {self.settings.port} is used by a program the panel did not start "
                            f"({describe_owner(st.external)}). Stop it, or set another port in Settings, "
                            "then run the benchmark again.")
        if st.running:
            self.prior = {"engine": st.engine, "plan": st.plan(), "settings": self.settings}
            yield BenchNote(f"Stopping the running {st.engine} engine for the benchmark; it is started again "
                            "with its own settings when the benchmark ends.")
            yield from self._drain(session.stop(), self.on_engine_event)
        session.close()

    def start(self, settings: Any, engine: str, plan: dict[str, Any] | None
              ) -> Generator[BenchEvent, None, RunningEngine]:
        """Start ``engine`` with ``settings``; returns a :class:`RunningEngine` when it is ready."""
        self.stop_current_sync()
        session = self.factory(settings)
        self.current = session
        failure = None
        gen = session.start(engine, plan, watch=False)
        while True:
            try:
                ev = next(gen)
            except StopIteration as stop:
                st = stop.value
                break
            if self.on_engine_event is not None:
                self.on_engine_event(ev)
            match ev:
                case StartFailed(message=message, fix=fix):
                    failure = f"{message} {fix}".strip()
                case Crashed(title=title, fix=fix):
                    failure = f"{title}. {fix}".strip()
                case EngineProgress(phase=phase) if phase:
                    yield BenchNote(f"engine: {phase}")
        st = st or session.status(check_health=False)
        if st is None or st.state != READY:
            raise UserError(f"The {engine} engine did not start for the benchmark: "
                            f"{failure or (st.message if st else 'no status')}. Look at the engine's log "
                            "(`dsv41 logs`), fix the setting it names, then run the benchmark again.")
        base_url = st.base_url or st.spec.base_url
        return RunningEngine.from_status(st, base_url, settings.api_key, engine=engine,
                                         gpu_index=int(getattr(settings, "gpu_index", 0)))

    def stop_current_sync(self) -> None:
        if self.current is not None:
            for ev in self.current.stop():
                if self.on_engine_event is not None:
                    self.on_engine_event(ev)
            self.current.close()
            self.current = None

    def restore(self) -> Iterator[BenchEvent]:
        self.stop_current_sync()
        if self.prior:
            yield BenchNote(f"Starting the {self.prior['engine']} engine again as it was before the benchmark.")
            session = self.factory(self.prior["settings"])
            try:
                yield from self._drain(session.start(self.prior["engine"], self.prior["plan"], watch=False),
                                       self.on_engine_event)
            finally:
                session.close()

    def restore_quietly(self) -> None:
        """:meth:`restore` without yielding, for a run being closed from outside or failing (a closing generator
        must not yield); its own errors give way to the one already under way."""
        try:
            for _ in self.restore():
                pass
        except Exception:  # noqa: BLE001 - the original exception matters more
            pass

    @staticmethod
    def _drain(gen, forward: Callable[[Any], None] | None = None) -> Generator[BenchEvent, None, Any]:
        while True:
            try:
                ev = next(gen)
            except StopIteration as stop:
                return stop.value
            if forward is not None:
                forward(ev)
            match ev:
                case StartFailed(message=text) | Crashed(title=text):
                    yield BenchNote(f"engine: {text}")


# ------------------------------------------------------------------------------------------------ the run
class _Clock:
    """Progress with ETA: every step has a nominal weight (seconds at the guides' speed); the ETA scales what is
    left by how fast the done part went against its nominal weight."""

    def __init__(self, weights: list[tuple[str, float]]):
        self.weights = weights
        self.total = sum(w for _, w in weights) or 1.0
        self.done = 0.0
        self.t0 = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def fraction(self) -> float:
        # rounded: the steps credited in parts (a decode phase repeat by repeat) add up to the total only up to
        # floating-point error, and the end must read exactly 1.0
        return min(1.0, round(self.done / self.total, 9))

    def eta(self) -> float | None:
        if self.done <= 0:
            return None
        return self.elapsed() / self.done * (self.total - self.done)


def _engine_extra(engine: str) -> dict[str, Any]:
    # an engine that stops at its end-of-sequence token is told not to: the bench wants exactly max_tokens tokens
    return {"ignore_eos": True} if find_engine(engine).stops_at_eos else {}


class BenchRun:
    """One benchmark (use :func:`run_bench`)."""

    def __init__(self, settings: Any, spec: BenchSpec, *, plan: dict[str, Any] | None = None, hardware: Any = None,
                 stop: CancelToken | None = None, session_factory: Callable[..., Any] | None = None,
                 on_token: Callable[[str, int, float], None] | None = None,
                 on_engine_event: Callable[[Any], None] | None = None):
        self.settings = settings
        self.spec = spec
        self.plan = plan
        self.hardware = hardware
        self.stop = stop or CancelToken()
        self.control = EngineControl(settings, hardware, session_factory, on_engine_event)
        self.on_token = on_token
        self.ratio = P.TokenRatio()
        self.pace_gap_s: float | None = None            # the warm-up's median time between tokens (one stream)
        self.pace_prefill_tok_s: float | None = None    # the warm-up's prompt tokens / time to the first token
        self.results: list[dict[str, Any]] = []
        self.clock = _Clock(self._weights())
        self.phase_label = ""

    # -- plan of work ----------------------------------------------------------------------------------------
    def _weights(self) -> list[tuple[str, float]]:
        s = self.spec
        w: list[tuple[str, float]] = []
        for ci, cfg in enumerate([s.baseline] + s.configs):
            w.append((f"{cfg.name}:start", 5.0))
            w.append((f"{cfg.name}:warmup", 2.0))
            users = s.users if ci == 0 else s.ab_users
            for u in users:
                g = GUIDE_TABLE.get(u, GUIDE_TABLE[8])[1]
                w.append((f"{cfg.name}:users_{u}", s.repeats * (s.tokens / g + 0.5)))
            if ci == 0 and s.long_prompt_tokens:
                w.append((f"{cfg.name}:long_prompt", 15.0))
        return w

    def _advance(self, key: str, share: float = 1.0) -> None:
        """Credit ``share`` of step ``key``'s weight as done (a decode phase is credited repeat by repeat, so the
        bar and the ETA move within it)."""
        self.clock.done += share * dict(self.clock.weights).get(key, 0.0)

    def _progress(self, cfg: str, phase: str, message: str) -> BenchProgress:
        return BenchProgress(cfg, phase, message, self.clock.fraction(), self.clock.elapsed(), self.clock.eta())

    def _check(self) -> None:
        self.stop.raise_if_cancelled()

    def check(self) -> None:
        """Every configuration's settings, checked before anything is stopped or started: a bad ``--config`` (an
        unknown setting, a value the settings refuse, a hot-set size that is not a number) is refused in words
        before the baseline runs, not after. Raises :class:`UserError`."""
        s = self.spec
        names: set[str] = set()
        for cfg in [s.baseline] + s.configs:
            if cfg.name in names:
                raise UserError(f"Two configurations are named {cfg.name!r}; give each --config its own name.")
            names.add(cfg.name)
            self._settings_for(cfg)
        if s.long_prompt_tokens:
            self._settings_for(s.baseline, long=True)

    def _deadlines(self, users: int, prompt_tokens: int) -> tuple[float, float]:
        """(stall, first token): how long a phase of ``users`` streams, each with a prompt of ``prompt_tokens``,
        may go without a token before the engine is taken as stalled — from the pace the warm-up measured
        (module constants), never more than the phase's limit."""
        s = self.spec
        if self.pace_gap_s is None:
            return min(s.timeout_s, max(s.stall_min_s, WARMUP_STALL_S)), s.timeout_s
        stall = max(s.stall_min_s, STALL_GAPS * self.pace_gap_s * max(1, users))
        first = stall
        if self.pace_prefill_tok_s:
            first = max(stall, PREFILL_FACTOR * prompt_tokens * max(1, users) / self.pace_prefill_tok_s)
        return min(stall, s.timeout_s), min(first, s.timeout_s)

    def _stalled(self, st: Streams, what: str) -> UserError:
        gap = f" (it had sent one every {self.pace_gap_s * 1000:.0f} ms in the warm-up)" if self.pace_gap_s else ""
        return UserError(f"The engine sent no token for {st.stalled_s or 0:.0f} s {what}{gap}: it looks stuck. The "
                         "figures measured so far are kept; look at the engine's log (`dsv41 logs`), then run the "
                         "benchmark again.")

    # -- settings per configuration -----------------------------------------------------------------------------
    def _settings_for(self, cfg: BenchConfig, long: bool = False) -> Any:
        """The engine's settings for a configuration. The KV cache keeps the size the user's settings give it
        (slots × context per slot), split over the slots the phase needs: the decode phases' short requests need
        little context per slot, so the hot set keeps the VRAM the plan gives it; the long-prompt experiment gets
        ``long_users`` + 1 slots with room for the long prompt (a larger KV cache: the plan may hold fewer experts
        in VRAM then, as it would for a user who sets that context)."""
        s = self.spec
        kv_total = int(self.settings.slots) * int(self.settings.context_length)
        if long:
            slots = max(2, min(8, s.long_users + 1))
            need = int(s.long_prompt_tokens * 1.25) + self._long_decode_tokens() + 2048
        else:
            slots = max(s.users) if s.users else 1
            need = int(s.prompt_tokens * 1.5) + max(s.tokens, 64) + 1024
        upd: dict[str, Any] = {"slots": min(8, max(1, slots)),
                               "context_length": max(need, kv_total // max(1, slots))}
        upd.update(cfg.settings)
        upd.update(find_engine(s.engine).bench_settings(
            self.settings, reply_tokens=SIM_REPLY_TOKENS, numa_off=upd.get("numa_binding") == "off",
            expert_cache=(lambda: self._expert_cache(cfg)) if cfg.expert_cache is not None else None))
        cls = type(self.settings)
        unknown = [k for k in upd if k not in getattr(cls, "model_fields", upd)]
        if unknown:
            raise UserError(f"The configuration {cfg.name!r} sets {', '.join(unknown)}, which is not a setting. Use "
                            "the names of `dsv41 settings show`.")
        try:
            return cls.model_validate({**self.settings.model_dump(), **upd})
        except Exception as exc:  # noqa: BLE001 - a bad override is the user's input
            first = str(exc).splitlines()[:3]
            raise UserError(f"The configuration {cfg.name!r} sets a value the settings refuse ({' '.join(first)}). "
                            "Use the values `dsv41 settings show` lists.") from None

    def _expert_cache(self, cfg: BenchConfig) -> int:
        if cfg.expert_cache == "half":
            from ..sim.offload import REF_HOT, Layout
            n = Layout.from_plan(self.plan).n_hot if self.plan else REF_HOT
            return max(1, n // 2)
        return int(str(cfg.expert_cache))

    def _plan_for(self, cfg: BenchConfig, settings: Any) -> dict[str, Any] | None:
        plan = dict(self.plan) if self.plan else None
        eng = find_engine(self.spec.engine)
        if eng.places_layers and cfg.cpu_layers is not None:
            from ..tensor_layout import read_layout
            model = eng.model_path(settings, plan)
            if model is None:
                raise UserError(f"The configuration {cfg.name!r} moves MoE layers, but no model file is known.")
            moe = list(read_layout(model).moe_layers)
            layers = {"half": moe[: len(moe) // 2], "all": moe, "none": []}.get(cfg.cpu_layers, cfg.cpu_layers) \
                if isinstance(cfg.cpu_layers, str) else list(cfg.cpu_layers)
            plan = dict(plan or {})
            plan["model"] = {**(plan.get("model") or {}), "file": str(model), "moe_layers": moe}
            plan["llamacpp_cpu_layers"] = layers
        if plan is not None:
            plan["settings"] = {**(plan.get("settings") or {}), "slots": settings.slots,
                                "context_length": settings.context_length, "kv_type": settings.kv_type}
        return plan

    def _long_decode_tokens(self) -> int:
        return find_engine(self.spec.engine).bench_long_decode_tokens

    # -- the run -----------------------------------------------------------------------------------------------
    def run(self) -> Generator[BenchEvent, None, dict[str, Any]]:
        s = self.spec
        t_start, m_start = time.time(), time.monotonic()    # the duration on the monotonic clock (no clock step)
        doc: dict[str, Any] = {"started_at": t_start, "spec": s.to_dict(), "configs": self.results}
        cancelled = False
        error = None
        yield self._progress("", "prepare", "Checking what runs now…")
        try:
            self.check()                   # every configuration, before the engine that runs now is stopped
            yield from self.control.take_over()
            for ci, cfg in enumerate([s.baseline] + s.configs):
                self._check()
                yield from self._run_config(ci, cfg)
        except (Cancelled, KeyboardInterrupt):      # Ctrl-C in the CLI lands here: restore, then the result
            cancelled = True
        except UserError as exc:
            error = str(exc)
        except BaseException:
            # closed from outside (GeneratorExit: a worker asked to quit, the caller gone) or a bug: put the engine
            # back without yielding, then let it go on
            self.control.restore_quietly()
            raise
        yield self._progress("", "restore", "Putting the engine back as it was…")
        try:
            yield from self.control.restore()
        except Exception as exc:  # noqa: BLE001 - said, and the result is still saved
            yield BenchNote(f"Could not start the previous engine again ({exc}); start it with the panel's Start "
                            "button or with `dsv41 start`.")
        from .results import assemble
        doc.update(finished_at=time.time(), duration_s=time.monotonic() - m_start, cancelled=cancelled, error=error,
                   token_ratio=self.ratio.to_dict())
        result = assemble(doc, self.settings, self.hardware)
        yield BenchDone(result, cancelled=cancelled)
        return result

    def _run_config(self, ci: int, cfg: BenchConfig) -> Iterator[BenchEvent]:
        s = self.spec
        settings = self._settings_for(cfg)
        plan = self._plan_for(cfg, settings)
        out: dict[str, Any] = {"config": cfg.to_dict(), "baseline": ci == 0, "phases": {}, "monitor": {},
                               "settings": _settings_words(settings)}
        self.results.append(out)
        yield self._progress(cfg.name, "start", f"Starting the engine: {cfg.label or cfg.name}")
        eng = yield from self.control.start(settings, s.engine, plan)
        self._advance(f"{cfg.name}:start")
        out["engine"] = {**eng.to_dict(), "model": self._model_name(eng),
                         "llamacpp_cpu_layers": (plan or {}).get("llamacpp_cpu_layers"),
                         **engine_facts(eng, settings)}
        with self._measuring(eng, plan, out) as client:
            self.phase_label = "warmup"
            yield self._progress(cfg.name, "warmup", "Warming up (not counted) and measuring how the engine counts "
                                                      "tokens…")
            out["phases"]["warmup"] = self._warmup(client, s.engine)
            self._advance(f"{cfg.name}:warmup")
            users = s.users if ci == 0 else s.ab_users
            for u in users:
                if u > settings.slots:
                    yield BenchNote(f"{u} users need {u} slots; the engine has {settings.slots}: skipped.")
                    self._advance(f"{cfg.name}:users_{u}")       # nothing left to wait for there
                    continue
                reps = []
                for r in range(s.repeats):
                    self._check()
                    self.phase_label = f"users_{u}"
                    yield self._progress(cfg.name, f"users_{u}",
                                         f"{u} user{'s' if u > 1 else ''} decoding, repeat {r + 1} of {s.repeats}")
                    figs = self._decode(client, u, r, s.engine)
                    reps.append(figs)
                    self._advance(f"{cfg.name}:users_{u}", 1.0 / s.repeats)
                    yield BenchPhase(cfg.name, f"users_{u}", figs)
                out["phases"][f"users_{u}"] = _combine(reps)
        if ci == 0 and s.long_prompt_tokens:
            self._check()
            lsettings = self._settings_for(cfg, long=True)
            lplan = self._plan_for(cfg, lsettings)
            out["long_settings"] = _settings_words(lsettings)
            yield self._progress(cfg.name, "long_prompt", f"Restarting the engine with {lsettings.slots} slots of "
                                                           f"{lsettings.context_length:,} tokens for the long prompt")
            leng = yield from self.control.start(lsettings, s.engine, lplan)
            mon: dict[str, Any] = {"monitor": {}}
            with self._measuring(leng, lplan, mon) as client:
                self.phase_label = "long_warmup"
                self._one(client, P.words(P.TokenRatio().words_for(64), 9), 8, s.engine)
                self.phase_label = "long_prompt"
                n = max(1, min(s.long_users, lsettings.slots - 1))
                yield self._progress(cfg.name, "long_prompt",
                                     f"{n} users decoding while a ~{s.long_prompt_tokens:,}-token prompt arrives")
                figs = self._long_prompt(client, n, s.engine)
                out["phases"]["long_prompt"] = figs
                yield BenchPhase(cfg.name, "long_prompt", figs)
            out["monitor"].update({k: v for k, v in mon["monitor"].items() if k == "long_prompt"})
            self._advance(f"{cfg.name}:long_prompt")

    @contextlib.contextmanager
    def _measuring(self, eng: RunningEngine, plan: dict[str, Any] | None, out: dict[str, Any]):
        """A chat client for the phases, with the monitor's collectors running beside it."""
        hub, ticks = self._start_hub(eng, plan)
        client = ChatClient(eng.base_url, eng.api_key, read_timeout_s=max(120.0, self.spec.timeout_s))
        try:
            yield client
        finally:
            client.close()
            self.phase_label = ""
            if hub is not None:
                try:
                    hub.close()
                except Exception:  # noqa: BLE001
                    pass
            out["monitor"] = {**out.get("monitor", {}), **_monitor_summary(ticks)}

    def _model_name(self, eng: RunningEngine) -> str | None:
        try:
            r = httpx.get(eng.base_url + "/v1/models", headers=bearer_headers(eng.api_key),
                          timeout=5.0, trust_env=False)
            data = r.json().get("data") or []
            return str(data[0].get("id")) if data else None
        except Exception:  # noqa: BLE001 - the name only decides "n/a"
            return None

    # -- monitor ---------------------------------------------------------------------------------------------
    def _start_hub(self, eng: RunningEngine, plan: dict[str, Any] | None):
        ticks: list[tuple[str, dict[str, float | None]]] = []
        try:
            from ..metrics import build_hub
            hub = build_hub(eng, hz=self.spec.hub_hz, plan=plan, record=False, use_nvml=not eng.simulated)

            def listen(tick) -> None:
                if self.phase_label:
                    ticks.append((self.phase_label, dict(tick.values)))
            hub.add_listener(listen)
            hub.start()
            return hub, ticks
        except Exception:  # noqa: BLE001 - the figures stand without the monitor's
            return None, ticks

    # -- phases ----------------------------------------------------------------------------------------------
    def _one(self, client: ChatClient, text: str, max_tokens: int, engine: str) -> StreamRecord:
        st = Streams(client, [P.messages(text)], [ChatOptions(max_tokens=max_tokens, temperature=0.0, seed=1,
                                                              extra=_engine_extra(engine))]).start()
        stall, first = self._deadlines(1, self.ratio.expected(len(text.split())))
        if not st.wait(self.spec.timeout_s, self.stop, stall_s=stall, first_token_s=first):
            self._check()
            if st.stalled_s is not None:
                raise self._stalled(st, "to a warm-up request")
            raise UserError(f"A warm-up request did not finish within {self.spec.timeout_s:.0f} s; the engine may "
                            "be stuck.")
        return st.records[0]

    def _warmup(self, client: ChatClient, engine: str) -> dict[str, Any]:
        short = self._one(client, P.words(1, 7), 8, engine)
        n_words = 256
        long = self._one(client, P.words(n_words, 8), 16, engine)
        for r in (short, long):
            if r.error:
                raise UserError(f"The engine failed the warm-up request: {r.error}")
        self.ratio = P.calibrate(short.prompt_tokens, long.prompt_tokens, n_words)
        gaps = sorted(b - a for a, b in zip(long.token_times, long.token_times[1:]))
        self.pace_gap_s = gaps[len(gaps) // 2] if gaps else None
        ttft = long.ttft_s
        self.pace_prefill_tok_s = (long.prompt_tokens / ttft) if long.prompt_tokens and ttft and ttft > 0 else None
        return {"excluded": True, "prompt_tokens": [short.prompt_tokens, long.prompt_tokens],
                "token_ratio": self.ratio.to_dict(), "ttft_s": long.ttft_s}

    def _token_cb(self, phase: str) -> Callable[[int, float], None] | None:
        on_token = self.on_token
        if on_token is None:
            return None
        return lambda i, t: on_token(phase, i, t)

    def _decode(self, client: ChatClient, users: int, rep: int, engine: str) -> dict[str, Any]:
        s = self.spec
        n_words = self.ratio.words_for(s.prompt_tokens)
        texts = [P.words(n_words, 1000 * users + 100 * rep + i) for i in range(users)]
        opts = [ChatOptions(max_tokens=s.tokens, temperature=0.0, seed=i, extra=_engine_extra(engine))
                for i in range(users)]
        cb = self._token_cb(f"users_{users}")
        st = Streams(client, [P.messages(t) for t in texts], opts, on_token=cb)
        t0 = time.perf_counter()
        st.start()
        stall, first = self._deadlines(users, s.prompt_tokens)
        if not st.wait(s.timeout_s, self.stop, stall_s=stall, first_token_s=first):
            self._check()
            if st.stalled_s is not None:
                raise self._stalled(st, f"at {users} user{'s' if users > 1 else ''}")
            raise UserError(f"{users} streams did not finish within {s.timeout_s:.0f} s; the engine may be stuck.")
        figs = decode_figures(st.records)
        if figs["errors"]:
            raise UserError(f"The engine failed a request at {users} users: {figs['errors'][0]}")
        figs["repeat"] = rep
        figs["prompt_check"] = [P.length_check(s.prompt_tokens, r.prompt_tokens) for r in st.records]
        figs["timeline"] = [[round(t - t0, 4) for t in r.token_times] for r in st.records]
        return figs

    def _long_prompt(self, client: ChatClient, n: int, engine: str) -> dict[str, Any]:
        s = self.spec
        n_words = self.ratio.words_for(s.prompt_tokens)
        dec_opts = [ChatOptions(max_tokens=self._long_decode_tokens(), temperature=0.0, seed=i,
                                extra=_engine_extra(engine)) for i in range(n)]
        cb = self._token_cb("long_prompt")
        dec = Streams(client, [P.messages(P.words(n_words, 5000 + i)) for i in range(n)], dec_opts, on_token=cb)
        t0 = time.perf_counter()
        dec.start()
        # every stream decoding for a few tokens first
        end = time.monotonic() + self._deadlines(n, s.prompt_tokens)[1]
        while not all(len(r.token_times) >= 8 for r in dec.records):
            if self.stop.cancelled or time.monotonic() > end or dec.alive() < n:
                dec.cancel()
                dec.wait(10)
                self._check()
                errs = [r.error for r in dec.records if r.error]
                raise UserError("The long-prompt experiment's decoding streams did not start"
                                + (f": {errs[0]}" if errs else "."))
            time.sleep(0.02)
        long_words = self.ratio.words_for(s.long_prompt_tokens)
        long_text = P.words(long_words, 64)
        lp = Streams(client, [P.messages(long_text)], [ChatOptions(max_tokens=4, temperature=0.0, seed=99,
                                                                   extra=_engine_extra(engine))])
        lp.start()
        stall_s, first_s = self._deadlines(1, s.long_prompt_tokens)
        ok = lp.wait(s.timeout_s, self.stop, stall_s=stall_s, first_token_s=first_s)
        long_rec = lp.records[0]
        if not ok and lp.stalled_s is not None and not self.stop.cancelled:
            dec.cancel()
            dec.wait(30)
            raise self._stalled(lp, f"to the ~{s.long_prompt_tokens:,}-token prompt")
        # a little decoding after the prompt was read, then the decoders are cut
        if ok and long_rec.token_times:
            after = long_rec.token_times[0]
            until = time.monotonic() + 10.0
            while time.monotonic() < until and not self.stop.cancelled and \
                    not all(sum(t > after for t in r.token_times) >= 8 for r in dec.records):
                time.sleep(0.02)
        dec.cancel()
        dec.wait(30)
        self._check()
        if long_rec.error:
            raise UserError(f"The engine failed the long prompt: {long_rec.error}. A context of "
                            f"{s.long_prompt_tokens:,} tokens per slot may be more than it can hold; run with a "
                            "smaller --long-prompt.")
        sent = long_rec.sent_at
        first = long_rec.token_times[0] if long_rec.token_times else None
        gaps = [r.max_gap(after=sent, before=(first + 1.0) if first else None) for r in dec.records]
        before = [r.max_gap(before=sent) for r in dec.records]
        ttft = long_rec.ttft_s
        return {
            "users_decoding": n,
            "prompt_check": P.length_check(s.long_prompt_tokens, long_rec.prompt_tokens),
            "prompt_tokens": long_rec.prompt_tokens,
            "max_gap_s": gaps,
            "pause_s": max((g for g in gaps if g is not None), default=None),
            "max_gap_before_s": before,
            "ttft_s": ttft,
            "prefill_tok_s_client": (long_rec.prompt_tokens / ttft) if long_rec.prompt_tokens and ttft else None,
            "prefill_tok_s_engine": long_rec.engine_prompt_tok_s,
            "prompt_ms_engine": long_rec.engine_prompt_ms,
            "sent_at_s": round(sent - t0, 4),
            "first_token_s": round(first - t0, 4) if first else None,
            "timeline": [[round(t - t0, 4) for t in r.token_times] for r in dec.records],
            "client_cpu_s": sum(r.client_cpu_s for r in dec.records) + long_rec.client_cpu_s,
        }


def _json_at(client: httpx.Client, url: str, api_key: str, cap: int) -> dict[str, Any]:
    try:
        r = get_capped(client, url, headers={**bearer_headers(api_key), "Accept": "application/json"}, cap=cap,
                       deadline_s=5.0)
        doc = json_body(r) if r.status_code == 200 else None
    except Exception:  # noqa: BLE001 - an engine without this endpoint: the fact stays unknown
        return {}
    return doc if isinstance(doc, dict) else {}


def _text(v: Any) -> str | None:
    return v.strip() if isinstance(v, str) and v.strip() else None


def engine_facts(eng: RunningEngine, settings: Any) -> dict[str, Any]:
    """What the result records of the engine measured, each None when unknown (never guessed):

    - ``engine_version``: what the engine says of itself — Strata's JSON ``/metrics`` ``engine.version`` (the
      version its server reads from engine/BUILD.json; the scripted engine's own, e.g. ``sim-2``), else
      llama-server's ``/props`` ``build_info`` (the build its ``--version`` prints);
    - ``engine_build``: the release the panel started — :func:`engine_manager.release_check.engine_release_facts`
      (Strata's engine/BUILD.json: version, CUDA, architectures), else ``/props`` ``build_info``;
    - ``engine_args``: the launch argv with the key masked (``LaunchSpec.masked_argv``; else the status's argv,
      masked there)."""
    from ..engines.strata import STRATA_JSON_CAP
    from ..release_check import engine_release_facts

    with httpx.Client(trust_env=False, follow_redirects=False) as client:
        metrics = _json_at(client, eng.base_url + "/metrics", eng.api_key, STRATA_JSON_CAP)
        props = _json_at(client, eng.base_url + "/props", eng.api_key, SMALL_BODY_CAP)
    found = metrics.get("engine")
    reported: dict[str, Any] = found if isinstance(found, dict) else {}
    build_info = _text(props.get("build_info"))
    spec = eng.spec
    if spec is not None and hasattr(spec, "masked_argv"):
        args: list[str] | None = spec.masked_argv()
    else:
        args = list(eng.argv) if eng.argv is not None else None
    return {"engine_version": _text(reported.get("version")) or build_info,
            "engine_build": _text(engine_release_facts(eng.engine, settings)) or build_info,
            "engine_args": args}


def _settings_words(settings: Any) -> dict[str, Any]:
    return {k: getattr(settings, k) for k in ("numa_binding", "cpu_numerics", "slots", "vram_reserve_mib",
                                              "context_length", "kv_type", "sim_args") if hasattr(settings, k)}


def _combine(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """A decode phase's repeats: median and spread of each figure, every repeat kept, the last one's timeline."""
    per_stream = [x for r in reps for x in r["per_stream_tok_s"] if x is not None]
    ttft = [x for r in reps for x in r["ttft_s"] if x is not None]
    checks = [c for r in reps for c in r.get("prompt_check", [])]
    return {
        "users": reps[0]["users"] if reps else None,
        "total_tok_s": summary(r["total_tok_s"] for r in reps),
        "slowest_tok_s": summary(r["slowest_tok_s"] for r in reps),
        "per_stream_tok_s": summary(per_stream),
        "ttft_s": summary(ttft),
        "engine_total_tok_s": summary(r["engine_total_tok_s"] for r in reps),
        "client_cpu_share": summary(r["client_cpu_share"] for r in reps),
        "client_cpu_per_stream_s": summary(r["client_cpu_per_stream_s"] for r in reps),
        # False: a prompt the engine counted more than 10% off its size; None: the engine did not say (unconfirmed)
        "prompt_ok": _prompt_ok([c.get("ok") for c in checks]),
        "prompt_ratio": summary(c["ratio"] for c in checks),
        "repeats": [{k: v for k, v in r.items() if k != "timeline"} for r in reps],
        "timeline": reps[-1]["timeline"] if reps else [],
    }


def _prompt_ok(oks: list[Any]) -> bool | None:
    if any(ok is False for ok in oks):
        return False
    if not oks or any(ok is None for ok in oks):
        return None
    return True


def _monitor_summary(ticks: list[tuple[str, dict[str, float | None]]]) -> dict[str, Any]:
    """Mean hit rate, PCIe host→GPU, swap rate and decode rate per phase, from the monitor's collectors."""
    out: dict[str, Any] = {}
    for phase in dict.fromkeys(p for p, _ in ticks):
        rows = [v for p, v in ticks if p == phase]
        d: dict[str, Any] = {}
        # the live hit rate where the engine gives one, else its newest finished request's (Strata, the sim)
        # a reading that is not a figure (inf, NaN, a negative rate, a hit rate above 1) is missing, never averaged
        picked = [next((h for h in (measured(r.get(c), hi=1.0) for c in ("hit_rate", "hit_rate_last"))
                        if h is not None), None) for r in rows]
        hits = [h for h in picked if h is not None]
        d["hit_rate"] = sum(hits) / len(hits) if hits else None
        for col, hi in (("pcie_rx_mb_s", None), ("swaps_per_s", None), ("decode_tok_s", None),
                        ("gpu_util_pct", 100.0), ("cpu_bound_pct", None)):
            xs = [x for x in (measured(r.get(col), hi=hi) for r in rows) if x is not None]
            d[col] = sum(xs) / len(xs) if xs else None
        d["ticks"] = len(rows)
        out[phase] = d
    return out


def run_bench(settings: Any, spec: BenchSpec, **kw) -> Generator[BenchEvent, None, dict[str, Any]]:
    """Run the benchmark (see the module docstring); returns the result document (also in :class:`BenchDone`)."""
    return (yield from BenchRun(settings, spec, **kw).run())


def run_and_save(settings: Any, spec: BenchSpec, folder: Any = None, **kw
                 ) -> Generator[BenchEvent, None, dict[str, Any]]:
    """:func:`run_bench`, then the result saved (JSON + CSV, :func:`.results.save`) on the same thread; the result
    gains ``saved`` (the two paths, or ``error``: why it could not be written)."""
    from .results import save
    result = yield from run_bench(settings, spec, **kw)
    try:
        jp, cp = save(result, folder)
        result["saved"] = {"json": str(jp), "csv": str(cp)}
    except OSError as exc:
        result["saved"] = {"error": f"{exc}"}
    return result


def is_guides_model(name: str | None) -> bool | None:
    return is_guide_model(name)
