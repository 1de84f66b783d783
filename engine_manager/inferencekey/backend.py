"""``DeepSeekOneGpuBackend``: DeepSeek-V4.1-Flash on one GPU as an InferenceKey custom backend.

The SDK's contract (inferencekey/backend/base.py ``CustomBackend``; serve.py ``serve``, ``main``,
``_handle_process``): the runtime makes the class with no arguments, calls :meth:`~DeepSeekOneGpuBackend.setup` once
(``GET /healthz`` is 503 until it returns; a raising ``setup()`` exits 1), then :meth:`~DeepSeekOneGpuBackend.process`
per ``POST /process`` on its threads (``InvalidInput`` is a 400, any other exception a 500; the server stays up).
``setup()`` is the panel's own path, each step a plain line on stdout: the settings (class attributes named like a
setting of :class:`engine_manager.settings.Settings` are its defaults, ``DSV41_<NAME>`` wins: :func:`backend_settings`);
the machine (:func:`engine_manager.doctor.verdicts`); a first plan from the headers, so a host below the minimum is
refused before 264.5 GB are downloaded; the downloads (``DSV41_MODEL_DIR`` / ``DSV41_ENGINE_DIR`` skip them); the plan
from this worker's VRAM and RAM; the start through :class:`engine_manager.session.EngineSession`.
The engine lives and dies with the backend (the runtime has no teardown hook: serve.py ``_run_until_signalled``):
``atexit``, a SIGTERM/SIGINT during ``setup()``, a ``setup()`` that fails half-way, and
:mod:`engine_manager.inferencekey.watchdog` (a process that stops the engine once this one is gone, SIGKILL
included; the keeper would outlive it) all stop it.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from inferencekey.backend import BackendContext, CustomBackend, InvalidInput, Job, Result

from .. import __version__, paths
from ..atomic import atomic_write_json, ensure_private_dir
from ..engines import find_engine
from ..errors import PlacementRefused, UserError
from ..settings import LoadedSettings, Settings, SettingsError, field_allowed, field_env, load_settings
from . import SLUG, TASK_TYPE

#: the worker allows this long per request (the platform's limit, not a setting): an answer that cannot finish in
#: time is answered before it, with ``finish_reason: "time_limit"``
REQUEST_LIMIT_S = 300.0
#: answered this long before the limit (the answer still has to reach the caller)
LIMIT_MARGIN_S = 10.0
#: keys of a job's input that are not sent to the engine as they are
_NOT_PASSED = frozenset({"prompt", "messages", "max_tokens", "stream", "stream_options", "model"})
_TOOL_KEYS = ("tools", "tool_choice", "functions", "function_call")
MAX_TOKENS_LIMIT = 1_048_576
MIN_RATE_TOKENS = 32          # an answer shorter than this says little about the decode rate
RATE_HEADROOM = 0.8           # a reply is cut to what 80% of the measured rate makes in the time left


def log(text: str) -> None:
    """One plain line on stdout: the worker's log (never a secret: keys are masked by whoever prints them)."""
    try:
        print(f"[dsv41] {text}", flush=True)
    except (OSError, ValueError):
        pass


# -- settings ---------------------------------------------------------------------------------------------------

def class_defaults(cls: type) -> dict[str, Any]:
    """The class attributes of ``cls`` that name a setting: the backend's defaults."""
    return {n: getattr(cls, n) for n in Settings.model_fields if hasattr(cls, n)}


def backend_settings(cls: type, env: Mapping[str, str] | None = None) -> LoadedSettings:
    """The settings the backend runs with: ``DSV41_*`` in ``env`` > the class's attributes > the model's defaults.

    The class's attributes are written (atomically, 0600) as the settings file of the backend's own folder
    (``<data dir>/inferencekey/backend-settings.json``) and read back by :func:`load_settings` with ``env``: the one
    model parses and checks them, environment first, and generates the engine's API key into that file when none is
    set. The desktop panel's own settings file is neither read nor written."""
    env = os.environ if env is None else env
    folder = ensure_private_dir(paths.data_dir() / "inferencekey")
    path = folder / "backend-settings.json"
    defaults = {k: (str(v) if isinstance(v, Path) else v) for k, v in class_defaults(cls).items()}
    atomic_write_json(path, defaults)
    try:
        return load_settings(env=env, path=path)
    except SettingsError as exc:
        if exc.source != "file":
            raise
        raise SettingsError(exc.setting, exc.value, field_allowed(exc.setting), "input",
                            reason=f"the class attribute {cls.__name__}.{exc.setting}; set "
                                   f"{field_env(exc.setting)} in the worker's environment to override it") from None


# -- the backend ------------------------------------------------------------------------------------------------

class DeepSeekOneGpuBackend(CustomBackend):
    """DeepSeek-V4.1-Flash (763B MoE, Q2_K) on one GPU: the Strata engine with the VRAM hot set the panel plans.

    Class attributes named like a setting are this backend's defaults (``DSV41_<NAME>`` overrides each: the names
    of ``dsv41 settings list``). Without an NVIDIA GPU (``server_engine = "auto"``) it runs the scripted engine,
    every figure labelled simulated."""

    # -- the SDK's metadata (GET /meta: inferencekey/backend/base.py CustomBackend.manifest) -----------------
    name = SLUG
    version = __version__
    task_type = TASK_TYPE
    requirements = "requirements.txt"
    requires_python = ">=3.11"

    # -- settings (engine_manager.settings.Settings field names; DSV41_<NAME> overrides) -------------------
    server_engine = "auto"          # strata with an NVIDIA GPU, else the scripted engine
    slots = 8                       # concurrent jobs batched by the engine
    context_length = 32768
    default_max_tokens = 4096
    numa_binding = "auto"
    ready_timeout_s = 7200
    auto_restart = True
    gpu_index = 0

    # -- not settings: the platform's limit per request --------------------------------------------------
    REQUEST_LIMIT_S = REQUEST_LIMIT_S
    LIMIT_MARGIN_S = LIMIT_MARGIN_S

    def __init__(self) -> None:
        self.settings: Settings | None = None
        self.engine_name: str | None = None
        self.session: Any = None                        # engine_manager.session.EngineSession
        self._cond = threading.Condition()
        self._failure: str | None = None               # why the engine cannot come back (gave up, failed)
        self._thread: threading.Thread | None = None
        self._thread_done = False
        self._started_here = False                     # False: attached to an engine started by someone else
        self._shut = False
        self._slots: threading.BoundedSemaphore | None = None
        self._active = 0
        self._rates: dict[int, float] = {}             # measured decode tok/s per stream, by streams at once
        self._ttft_s: float | None = None
        self._watchdog: subprocess.Popen | None = None
        self._watch_w: int | None = None

    # ================================================================================== setup
    def setup(self, ctx: BackendContext) -> None:
        previous = self._catch_signals()
        atexit.register(self.shutdown)
        try:
            self._setup()
        except BaseException:
            self.shutdown()
            raise
        finally:
            self._restore_signals(previous)

    def _setup(self) -> None:
        from .. import doctor, hardware
        from ..settings import resolve_engine

        loaded = backend_settings(type(self))
        for note in loaded.notices:
            log(f"note: {note}")
        settings = self.settings = loaded.settings
        changed = sorted(n for n, src in loaded.sources.items() if src == "env")
        log(f"{SLUG} {self.version}: settings from the class, overridden by the environment for "
            f"{', '.join(field_env(n) for n in changed) or 'none'}")

        log("checking this machine…")
        hw = hardware.probe(settings.cache_path)
        for v in doctor.verdicts(hw, settings):
            log(f"  {v.status:4} {v.title}: {v.figure}" + (f" — {v.advice}" if v.status == "fail" and v.advice
                                                            else ""))
        engine = self.engine_name = resolve_engine(settings, hw.has_gpu)
        eng = find_engine(engine)
        if eng.simulated:
            log("engine: the scripted engine (SIMULATED: every figure it reports is simulated)"
                + ("" if hw.has_gpu else f"; no NVIDIA GPU here ({hw.gpu_error})"))
        else:
            log(f"engine: {engine}")
        if eng.needs_recent_driver and hw.has_gpu:
            bad = [v for v in doctor.verdicts(hw, settings) if v.id == "driver" and v.status == "fail"]
            if bad:
                raise UserError(f"The NVIDIA driver is too old for the {eng.words} engine ({bad[0].figure}). "
                                f"{bad[0].advice}")

        if not eng.simulated:                  # a simulated engine reads no model and has no release
            self._plan(settings, hw, engine, before_download=True)
            self._download(settings, engine)
        plan = self._plan(settings, hw, engine, before_download=False)

        self._start_watchdog()
        self._start_engine(settings, hw, engine, plan)

    # -- plan -----------------------------------------------------------------------------------------------
    def _plan(self, settings: Settings, hw: Any, engine: str, *, before_download: bool) -> dict[str, Any] | None:
        from .. import plans
        from ..start_plan import default_plan

        eng = find_engine(engine)
        if eng.plans_reference_host or (eng.cpu_without_gpu and not hw.has_gpu):
            plan, notes = default_plan(engine, settings, hw)
            for n in notes:
                log(n)
            return plan
        own = getattr(settings, eng.model_setting, None) if eng.model_setting else None
        model = str(own) if own else None
        out = plans.make_plan(settings, plans.PlanRequest(host="this", save=False, model_path=model), hw)
        p = out.plan_dict
        where = "the model's headers (the replica: shards not downloaded yet)" if out.model_source == "replica" \
            else out.model_source
        if p.get("refused"):
            lines = [f"This worker cannot hold the model's minimum layout: {p['refused']}"]
            for s in p.get("shortfalls") or []:
                lines.append(f"  {s.get('resource')}: needs {_gib(s.get('needed_bytes'))}, has "
                             f"{_gib(s.get('available_bytes'))}, missing {_gib(s.get('missing_bytes'))}")
                for t in s.get("terms") or []:
                    lines.append(f"    {t.get('name')}: {_gib(t.get('bytes'))}")
            lines.append("Use a worker with more VRAM/RAM, or fewer slots / a shorter context (DSV41_SLOTS, "
                         "DSV41_CONTEXT_LENGTH).")
            text = "\n".join(lines)
            for ln in lines:
                log(ln)
            raise PlacementRefused(text)
        if before_download:
            log(f"plan from {where}: this worker can hold the model ({p.get('hot_experts')} experts in VRAM)")
        else:
            log(f"plan for this worker from {where}: {p.get('hot_experts')} hot experts in VRAM, "
                f"predicted hit rate {p.get('predicted_hit_rate') or 'unknown until the engine has seen traffic'}")
        return p

    # -- downloads ------------------------------------------------------------------------------------------
    def _download(self, settings: Settings, engine: str) -> None:
        from ..download import download_engine, download_model

        jobs: list[tuple[str, Callable[[], Any]]] = []
        if settings.model_dir:
            log(f"model: DSV41_MODEL_DIR={settings.model_dir} (no download)")
        elif "model" in find_engine(engine).downloads:
            jobs.append(("model", lambda: download_model(settings)))
        if "engine" in find_engine(engine).downloads:
            if settings.engine_dir:
                log(f"engine release: DSV41_ENGINE_DIR={settings.engine_dir} (no download)")
            else:
                jobs.append(("engine", lambda: download_engine(settings)))
        if not jobs:
            return
        errors: dict[str, BaseException] = {}

        def run(what: str, make: Callable[[], Any]) -> None:
            last = 0.0
            try:
                for ev in make():
                    kind = getattr(ev, "kind", "")
                    if kind == "progress" and time.monotonic() - last >= 10.0:
                        last = time.monotonic()
                        log(f"download {what}: {ev.fraction:.1%} of {_gb(ev.total_bytes)}"
                            + (f", {ev.speed_bps / 1e6:.0f} MB/s" if ev.speed_bps else "")
                            + (f", about {ev.eta_s / 60:.0f} min left" if ev.eta_s else ""))
                    elif kind in ("notice", "retrying", "file_corrupt"):
                        log(f"download {what}: {getattr(ev, 'text', None) or ev}")
                    elif kind == "file_verified":
                        log(f"download {what}: {ev.name} verified (sha256)")
                    elif kind == "finished":
                        log(f"download {what}: done in {ev.target_dir}")
            except BaseException as exc:  # reported below, after both ended
                errors[what] = exc

        log(f"downloading at once: {' and '.join(w for w, _ in jobs)}")
        threads = [threading.Thread(target=run, args=job, name=f"dsv41-download-{job[0]}", daemon=True)
                   for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise UserError("; ".join(f"The {w} download failed: {e}" for w, e in errors.items()))

    # -- the engine -----------------------------------------------------------------------------------------
    def _start_engine(self, settings: Settings, hw: Any, engine: str, plan: dict[str, Any] | None) -> None:
        from ..cli.engine import Printer
        from ..session import EngineSession

        # the state file says who started it: the panel and `dsv41 status` on this machine label it so
        self.session = EngineSession(settings, hardware=hw, started_by="inferencekey")
        self._slots = threading.BoundedSemaphore(settings.slots)
        printer = Printer(out=_LogWriter())
        self._thread = threading.Thread(target=self._run_engine, args=(engine, plan, printer),
                                        name="dsv41-engine", daemon=True)
        self._thread.start()
        with self._cond:
            self._cond.wait_for(lambda: self.session.running is not None or self._thread_done)
            running = self.session.running
        if running is None:
            raise UserError(self._failure or "The engine did not start; the lines above say why.")
        log(f"engine ready at {running.base_url} ({running.label}"
            + (", SIMULATED" if running.simulated else "") + f"), {settings.slots} slot(s)")

    def _run_engine(self, engine: str, plan: dict[str, Any] | None, printer: Any) -> None:
        from ..supervisor_events import GaveUp, Ready, StartFailed

        try:
            # fed here, under the condition (feed=False): a waiter sees running and _started_here set together
            for ev in self.session.start(engine, plan, watch=True, feed=False):
                printer(ev)
                with self._cond:
                    self.session.feed(ev)
                    match ev:
                        case Ready(attached=False):
                            self._started_here = True
                        case StartFailed(message=message, fix=fix):
                            self._failure = f"{message} {fix}"
                        case GaveUp(message=message, fix=fix):
                            self._failure = f"{message} {fix}"
                    self._cond.notify_all()
        except Exception as exc:  # the supervisor's own failure: said, and every waiting job answered
            self._failure = f"The engine's supervisor failed: {exc}"
            log(self._failure)
        finally:
            with self._cond:
                self._thread_done = True
                self._cond.notify_all()

    def _start_watchdog(self) -> None:
        """The process that stops the engine once this one is gone (any way, SIGKILL included)."""
        r, w = os.pipe()            # both ends close-on-exec: only the watchdog gets the read end (pass_fds)
        try:
            self._watchdog = subprocess.Popen(
                [sys.executable, "-m", "engine_manager.inferencekey.watchdog", "--fd", str(r),
                 "--backend-pid", str(os.getpid())],
                pass_fds=(r,), stdin=subprocess.DEVNULL, start_new_session=True, close_fds=True)
        finally:
            os.close(r)
        self._watch_w = w           # kept open for this process's life; the kernel closes it when it ends

    # ================================================================================== shutdown
    def shutdown(self) -> None:
        """Stop the engine this backend started (an engine it only attached to is left running) and wait for its
        supervisor thread. Safe to call twice, from atexit, a failed setup or a test."""
        with self._cond:
            if self._shut:
                return
            self._shut = True
        session = self.session
        if session is not None:
            try:
                if self._started_here or not self._thread_done:
                    log("stopping the engine this backend started…")
                    from ..cli.engine import Printer

                    printer = Printer(out=_LogWriter())
                    for ev in session.stop(feed=False):
                        printer(ev)
                else:
                    session.detach()
            except Exception as exc:  # at exit: say it; the watchdog still stops the engine
                log(f"could not stop the engine: {exc}")
            if self._thread is not None:
                self._thread.join(timeout=session.supervisor.grace_s + 30)
            session.close()
        if self._watch_w is not None:
            try:
                os.close(self._watch_w)        # the watchdog finds the engine stopped and ends
            except OSError:
                pass
            self._watch_w = None

    # -- signals during setup ----------------------------------------------------------------------------------
    @staticmethod
    def _catch_signals() -> dict[int, Any]:
        """SIGTERM/SIGINT during ``setup()`` end the process through ``SystemExit`` (so the engine is stopped and
        atexit runs); a signal someone set to be ignored stays ignored. The runtime installs its own handlers
        after ``setup()`` returns (serve.py ``_run_until_signalled``)."""
        previous: dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            return previous

        def leave(signum: int, _frame: Any) -> None:
            log(f"signal {signum} during setup: stopping")
            raise SystemExit(128 + signum)

        for sig in (signal.SIGTERM, signal.SIGINT):
            old = signal.getsignal(sig)
            if old in (signal.SIG_DFL, signal.default_int_handler):
                previous[sig] = old
                signal.signal(sig, leave)
        return previous

    @staticmethod
    def _restore_signals(previous: dict[int, Any]) -> None:
        for sig, old in previous.items():
            try:
                signal.signal(sig, old)
            except (ValueError, OSError):
                pass

    # ================================================================================== process
    def process(self, job: Job) -> Result:
        from ..cancel import CancelToken
        from ..chat import ChatClient, ChatError, ChatOptions

        t0 = time.monotonic()
        deadline = t0 + self.REQUEST_LIMIT_S - self.LIMIT_MARGIN_S
        messages, max_tokens, extra = self._read_job(job)
        assert self.settings is not None and self._slots is not None, "setup() has not run"
        if not self._slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return self._time_limit_result("", "", None, max_tokens, t0, "every slot stayed busy until the limit")
        try:
            running = self._wait_running(deadline)
            with self._cond:
                self._active += 1
                active = self._active
            try:
                rate = self._rate_for(active)
                send_tokens, capped = max_tokens, False
                if rate is not None:
                    room_s = deadline - time.monotonic() - (self._ttft_s or 2.0)
                    affordable = max(1, int(RATE_HEADROOM * rate * room_s))
                    if max_tokens > affordable:
                        send_tokens, capped = affordable, True
                cancel = CancelToken()
                timer = threading.Timer(max(0.0, deadline - time.monotonic()), cancel.cancel)
                timer.daemon = True
                timer.start()
                try:
                    for attempt in (1, 2):
                        client = ChatClient.for_engine(running)
                        try:
                            text, thought, stats = client.complete(
                                messages, ChatOptions(max_tokens=send_tokens, extra=extra), cancel)
                            break
                        except ChatError as exc:
                            if exc.kind == "bad_request":
                                raise InvalidInput(str(exc)) from None
                            # "unreachable" (no connection): nothing reached the engine, it died just before. Its
                            # supervisor looks a few times a second, so it may not have said so yet; once it has,
                            # the request goes once more to the engine it restarts
                            again = self._restarted_after(running, deadline) \
                                if exc.kind == "unreachable" and attempt == 1 else None
                            if again is None:
                                raise RuntimeError(f"The engine failed on this request ({exc.kind}): {exc} The "
                                                   "engine is restarted when it crashed; send the request again.") \
                                    from None
                            running = again
                        finally:
                            client.close()
                finally:
                    timer.cancel()
            finally:
                with self._cond:
                    self._active -= 1
        finally:
            self._slots.release()
        self._learn(stats, active)
        if stats.cancelled:
            return self._time_limit_result(text, thought, stats, max_tokens, t0,
                                           "the answer was still going when the limit came")
        if capped and stats.finish_reason == "length":
            return self._time_limit_result(text, thought, stats, max_tokens, t0,
                                           f"at the measured {rate:.1f} tok/s, max_tokens {max_tokens} could not "
                                           f"finish; it was cut at {send_tokens}")
        return Result(output=self._output(text, thought, stats.finish_reason, stats, t0, running))

    def _read_job(self, job: Job) -> tuple[list[dict[str, Any]], int, dict[str, Any]]:
        """The chat messages, max_tokens and the fields passed through, from a job's input; InvalidInput (400) for
        what this backend does not take."""
        inp = job.input
        for k in _TOOL_KEYS:
            v = inp.get(k)
            if v not in (None, [], {}, "none"):
                raise InvalidInput(f"This backend does not run tools (the request has {k!r}): send it without "
                                   "tools, or use an endpoint that supports function calling.")
        raw = job.messages()
        if raw:
            messages = []
            for i, m in enumerate(raw):
                if not isinstance(m, dict) or not isinstance(m.get("role"), str) or \
                        not isinstance(m.get("content"), str):
                    raise InvalidInput(f"messages[{i}] must be an object with a string 'role' and a string "
                                       "'content'.")
                if m["role"] == "tool" or m.get("tool_calls"):
                    raise InvalidInput(f"messages[{i}] is a tool message; this backend does not run tools.")
                messages.append({"role": m["role"], "content": m["content"]})
        else:
            messages = [{"role": "user", "content": job.text()}]      # InvalidInput when there is no prompt
        assert self.settings is not None
        mt = inp.get("max_tokens", self.settings.default_max_tokens)
        if mt is None:
            mt = self.settings.default_max_tokens
        if isinstance(mt, bool) or not isinstance(mt, int) or not 1 <= mt <= MAX_TOKENS_LIMIT:
            raise InvalidInput(f"max_tokens must be an integer from 1 to {MAX_TOKENS_LIMIT}, not {mt!r}.")
        extra = {k: v for k, v in inp.items() if k not in _NOT_PASSED and k not in _TOOL_KEYS}
        return messages, mt, extra

    NOTICE_S = 5.0      # how long an engine that does not answer may still be "running" to its supervisor

    def _restarted_after(self, running: Any, deadline: float) -> Any:
        """``running`` did not answer: the engine its supervisor restarts in its place, once the supervisor has
        noticed (within :attr:`NOTICE_S`) and the new one is ready (within ``deadline``); None if the supervisor
        still holds ``running`` as the engine, or nothing is ready in time."""
        assert self.session is not None
        with self._cond:
            self._cond.wait_for(lambda: self.session.running is not running or self._thread_done or self._shut,
                                timeout=max(0.0, min(self.NOTICE_S, deadline - time.monotonic())))
            if self.session.running is running:
                return None
        try:
            return self._wait_running(deadline)
        except RuntimeError:
            return None

    def _wait_running(self, deadline: float) -> Any:
        """The engine that is ready; waits while it restarts after a crash (up to ``deadline``)."""
        assert self.session is not None
        with self._cond:
            self._cond.wait_for(lambda: self.session.running is not None or self._thread_done or self._shut,
                                timeout=max(0.0, deadline - time.monotonic()))
            running = self.session.running
        if running is None:
            raise RuntimeError(self._failure or "The engine is not ready (it is restarting after a crash, or "
                               "stopping); send the request again in a moment.")
        return running

    # -- the measured rate and the answer --------------------------------------------------------------------
    def _rate_for(self, active: int) -> float | None:
        with self._cond:
            if active in self._rates:
                return self._rates[active]
            slower = [r for n, r in self._rates.items() if n >= active]
            return min(slower) if slower else (min(self._rates.values()) if self._rates else None)

    def _learn(self, stats: Any, active: int) -> None:
        # the wall-clock rate measured here first (what the limit is counted in), the engine's own timing else
        rate = stats.tok_s or stats.engine_tok_s
        if rate and stats.tokens >= MIN_RATE_TOKENS:
            with self._cond:
                old = self._rates.get(active)
                self._rates[active] = rate if old is None else 0.7 * old + 0.3 * rate
        if stats.ttft_s is not None:
            self._ttft_s = stats.ttft_s if self._ttft_s is None else 0.7 * self._ttft_s + 0.3 * stats.ttft_s

    def _time_limit_result(self, text: str, reasoning: str, stats: Any, max_tokens: int, t0: float,
                           why: str) -> Result:
        out = self._output(text, reasoning, "time_limit", stats, t0, None)
        out["note"] = (f"Answered before the worker's {self.REQUEST_LIMIT_S:.0f} s limit per request: {why}. Ask "
                       f"for fewer tokens (max_tokens {max_tokens}) or continue the conversation.")
        return Result(output=out)

    def _output(self, text: str, reasoning: str, finish_reason: str | None, stats: Any, t0: float,
                running: Any) -> dict[str, Any]:
        prompt = getattr(stats, "prompt_tokens", None)
        completion = getattr(stats, "completion_tokens", None)
        out: dict[str, Any] = {
            "text": text,
            "reasoning": reasoning,
            "finish_reason": finish_reason,
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "total_tokens": prompt + completion if prompt is not None and completion is not None
                      else None},
            "timings": {
                "total_s": round(time.monotonic() - t0, 3),
                "ttft_s": getattr(stats, "ttft_s", None),
                "duration_s": getattr(stats, "duration_s", None),
                "tok_s": getattr(stats, "tok_s", None),
                "engine_tok_s": getattr(stats, "engine_tok_s", None),
                "engine_prompt_tok_s": getattr(stats, "engine_prompt_tok_s", None),
                "engine": getattr(stats, "timings", None),
            },
        }
        if running is not None:
            out["engine"] = running.label
            out["simulated"] = bool(running.simulated)
        return out


class _LogWriter:
    """A file-like object for :class:`engine_manager.cli.engine.Printer`: each line it prints goes to
    :func:`log` (not a terminal: progress comes as a line every few seconds)."""

    def write(self, text: str) -> int:
        for line in text.splitlines():
            if line.strip():
                log(line)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def _gib(n: Any) -> str:
    return f"{n / 2**30:,.1f} GiB" if isinstance(n, (int, float)) else "?"


def _gb(n: Any) -> str:
    return f"{n / 1e9:,.1f} GB" if isinstance(n, (int, float)) else "?"
