"""The monitor's sources. Each one reads one thing (the engine's endpoints, the GPU driver, the host, the
engine's log) and returns a :class:`Reading` of named values; the hub runs each on its own thread with its own
timeout, so a slow or failing source leaves *its* series missing and never holds up the others.

A value of ``None`` is missing. A source that cannot exist on this machine (no NVIDIA driver) says so once
through ``unavailable`` and is read as missing every tick.
"""

from __future__ import annotations

import os
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import psutil

from .. import nvml
from ..engines._http import AnswerTooLarge, AnswerTooSlow, SMALL_BODY_CAP, bearer_headers, get_capped, json_body
from ..figures import measured
from ..engines.base import Engine, LaunchSpec, LogEvent, Sample
from .columns import ENGINE_COLUMNS, HOST_COLUMNS, LOG_COLUMNS, MAX_SLOTS, NVML_COLUMNS, SLOT_COLUMNS
from ..tls import verify as tls_verify


@dataclass
class Reading:
    values: dict[str, float | None]
    payload: Any = None                 # e.g. the engine's Sample
    notes: dict[str, Any] = field(default_factory=dict)


class SourceMissing(RuntimeError):
    """Raised by a source whose figures are missing for a plain reason (said as is, without a type name)."""


class Source(ABC):
    """One thing to read, once per tick. ``read`` may block; the hub gives it ``timeout_s`` per tick."""

    name: str = "source"
    columns: tuple[str, ...] = ()
    timeout_s: float = 2.0
    unavailable: str | None = None      # set when the source cannot work on this machine (the reason)
    # reads only this machine's files and /proc, never waits on another program: shares the hub's thread with the
    # other local sources (a source that can hang, such as an HTTP poll or NVML, has one of its own)
    local: bool = False

    @abstractmethod
    def read(self) -> Reading:
        """One reading. Raise on failure (the hub shows the series as missing with the error)."""

    def close(self) -> None:  # noqa: B027 - optional: most sources hold nothing to release
        """Release what the source holds."""


# -- the engine's metric endpoints ---------------------------------------------------------------------------
def _rate(v: object) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 <= v <= 1.0 else None


#: the engine column each plain :class:`Sample` figure fills (one home for sample_values and FIGURE_COLUMNS)
FIELD_COLUMN: dict[str, str] = {
    "decode_tok_s": "decode_tok_s", "prefill_tok_s": "prefill_tok_s", "hit_rate": "hit_rate",
    "pcie_share": "engine_pcie_share", "swaps_per_s": "engine_swaps_per_s", "swaps_total": "swaps_total",
    "swap_mb_s": "engine_swap_mb_s", "pcie_rx_mb_s": "engine_pcie_rx_mb_s", "pcie_tx_mb_s": "engine_pcie_tx_mb_s",
    "vram_used_bytes": "engine_vram_used_bytes", "vram_total_bytes": "engine_vram_total_bytes",
    "ram_used_bytes": "engine_ram_used_bytes", "ram_total_bytes": "engine_ram_total_bytes",
    "slots_busy": "slots_busy", "slots_total": "slots_total", "queued": "queued",
    "requests_total": "requests_total", "tokens_generated_total": "tokens_generated_total",
}

#: the columns each figure an adapter may export (engines.base.FIGURES) fills
FIGURE_COLUMNS: dict[str, tuple[str, ...]] = {
    **{f: (c,) for f, c in FIELD_COLUMN.items()},
    "hit_rate": ("hit_rate", "hit_rate_last"),        # the newest finished request's rides in extra
    "decode_tok_s_per_slot": SLOT_COLUMNS,
    "log_swaps": ("log_swaps_per_s", "log_swap_mb_s"), "log_hits": ("log_hit_rate", "log_pcie_share", "log_vram_share"),
}


def unexported_columns(engine: Engine, s: Sample | None) -> dict[str, str]:
    """Column → why ``engine`` does not export it (:meth:`Engine.unexported`, figure by figure)."""
    return {c: why for fig, why in engine.unexported(s).items() for c in FIGURE_COLUMNS.get(fig, ())}


def sample_values(s: Sample) -> dict[str, float | None]:
    """Map the adapters' common :class:`Sample` onto the engine columns (``None`` stays missing)."""
    v: dict[str, float | None] = {c: getattr(s, f) for f, c in FIELD_COLUMN.items()}
    v["engine_pcie_share"] = _rate(s.pcie_share)
    # Strata reports a hit rate only when a request finishes (requests[].hit_rate): while requests run back to
    # back, hit_rate is missing and this is the figure there is
    v["hit_rate_last"] = _rate(s.extra.get("hit_rate_last")) if isinstance(s.extra, dict) else None
    per_slot = s.decode_tok_s_per_slot
    for c in SLOT_COLUMNS:
        v[c] = None
    if per_slot is not None:
        # the engine listed its decoding slots: a slot it has but did not list is idle — a measured 0
        if s.slots_total:
            for i in range(min(int(s.slots_total), MAX_SLOTS)):
                v[f"slot{i}_tok_s"] = 0.0
        for k, rate in per_slot.items():
            try:
                i = int(k)
            except (TypeError, ValueError):
                continue
            if 0 <= i < MAX_SLOTS and rate is not None:
                v[f"slot{i}_tok_s"] = rate
    # every engine column is a rate, a count, a size or a share: one that is not finite (NaN, 1e999, an integer past
    # what a float holds) or negative ("-7 users") is impossible, so missing — never shown as measured
    return {k: measured(x) for k, x in v.items()}


class EngineSource(Source):
    """Polls the engine through its adapter: ``Engine.poll(client, spec, previous) -> Sample``. Failures are said
    in plain words (:func:`plain_engine_error`), never as a raw HTTP library message. Once, it also asks the
    engine which model it serves (``/v1/models``): ``notes["model"]``."""

    name = "engine"
    columns = tuple(c.name for c in ENGINE_COLUMNS)
    MODEL_TRIES = 3

    def __init__(self, engine: Engine, spec: LaunchSpec, timeout_s: float = 2.0):
        import httpx

        self.engine = engine
        self.spec = spec
        self.timeout_s = timeout_s
        headers = bearer_headers(spec.api_key)
        from ..tunnel import transport_for      # an SSH forward's URL: reached only through its Unix socket

        self.client = httpx.Client(timeout=httpx.Timeout(timeout_s), headers=headers, trust_env=False,
                                   verify=tls_verify(), transport=transport_for(spec.base_url))
        self.previous: Sample | None = None
        self.model: str | None = None
        self._model_tries = 0

    def read(self) -> Reading:
        try:
            s = self.engine.poll(self.client, self.spec, self.previous)
        except Exception as exc:
            raise SourceMissing(plain_engine_error(exc, self.spec.base_url, self.timeout_s)) from exc
        self.previous = s
        if self.model is None and self._model_tries < self.MODEL_TRIES:
            self._model_tries += 1
            self.model = served_model(self.client, self.spec)
        notes = {"simulated": bool(s.simulated or self.spec.simulated or self.engine.simulated), "state": s.state,
                 "unexported": unexported_columns(self.engine, s)}
        if self.model:
            notes["model"] = self.model
        return Reading(sample_values(s), payload=s, notes=notes)

    def close(self) -> None:
        self.client.close()


def served_model(client: Any, spec: LaunchSpec) -> str | None:
    """The model the engine serves, from its OpenAI ``/v1/models`` (a path is reduced to its file name); None
    when it does not say."""
    try:
        r = get_capped(client, spec.base_url + "/v1/models", cap=SMALL_BODY_CAP, deadline_s=2.0)
        if r.status_code != 200:
            return None
        data = json_body(r).get("data") or []
        mid = data[0].get("id") if data and isinstance(data[0], dict) else None
    except Exception:  # optional: an engine without the endpoint simply does not say
        return None
    if not isinstance(mid, str) or not mid.strip():
        return None
    return Path(mid.strip()).name if "/" in mid else mid.strip()


def plain_engine_error(exc: BaseException, base_url: str, timeout_s: float | None = None) -> str:
    """An engine poll's failure in plain words: what answered (or did not) at ``base_url`` and what to do."""
    import httpx

    if isinstance(exc, (AnswerTooLarge, AnswerTooSlow)) or (isinstance(exc, httpx.DecodingError)
                                                             and "compressed but is not" in str(exc)):
        return str(exc)                     # already plain words (engines._http.get_capped), the URL named
    if isinstance(exc, httpx.ConnectError):
        return f"nothing answers at {base_url} (connection refused): the engine is not running, or still loading"
    if isinstance(exc, httpx.TimeoutException):
        within = f" within {timeout_s:.2g} s" if timeout_s else ""
        return f"the engine at {base_url} did not answer{within} (busy or stuck)"
    if isinstance(exc, httpx.HTTPStatusError):
        r = exc.response
        code = r.status_code
        if code in (401, 403):
            return (f"the program at {base_url} refused this panel's API key (HTTP {code}): it is not the engine this "
                    "panel started, or it was started with another key — see `dsv41 status`")
        if code == 503:
            return f"the engine at {base_url} is starting or unavailable (HTTP 503)"
        ctype = r.headers.get("content-type", "")
        path = r.request.url.path if r.request is not None else "/metrics"
        if "json" not in ctype or code in (404, 405, 501):
            return (f"something else answers at {base_url} (HTTP {code} to {path}): not an engine this panel can "
                    "read — stop that program or choose another port (setting port / DSV41_PORT); `dsv41 status` "
                    "shows what the panel started")
        return f"the engine at {base_url} answered HTTP {code} to {path}"
    if isinstance(exc, ValueError):         # 200 but not the engine's JSON (a web page, another service)
        return (f"something else answers at {base_url}: its /metrics is not an engine's — stop that program or "
                "choose another port (setting port / DSV41_PORT)")
    if isinstance(exc, httpx.HTTPError):
        return f"the engine at {base_url} could not be read ({type(exc).__name__})"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def spec_for(engine: Engine, base_url: str, api_key: str) -> LaunchSpec:
    """A minimal :class:`LaunchSpec` for polling an engine known only by URL and key (re-attach, CLI)."""
    import httpx

    url = httpx.URL(base_url)
    return LaunchSpec(engine=engine.name, argv=[], host=url.host or "127.0.0.1", port=url.port or 80,
                      api_key=api_key, simulated=engine.simulated, label=engine.label)


# -- the GPU driver (NVML) ------------------------------------------------------------------------------------
# the Monitor's column for each of engine_manager.nvml's live readings
_NVML_TO_COLUMN = {"vram_used_bytes": "nvml_vram_used_bytes", "vram_total_bytes": "nvml_vram_total_bytes",
                   "util_pct": "gpu_util_pct", "pcie_rx_mb_s": "nvml_pcie_rx_mb_s",
                   "pcie_tx_mb_s": "nvml_pcie_tx_mb_s", "power_w": "gpu_power_w", "temp_c": "gpu_temp_c",
                   "pcie_gen": "gpu_pcie_gen", "pcie_width": "gpu_pcie_width"}


class NvmlSource(Source):
    """VRAM, utilisation, PCIe RX/TX (``nvmlDeviceGetPcieThroughput``: KB/s over ~20 ms), power, temperature,
    PCIe generation and width of one GPU (:func:`engine_manager.nvml.live_readings`). Each figure is read on its
    own: one the driver refuses is missing. NVML is held (:func:`engine_manager.nvml.acquire`) until
    :meth:`close`."""

    name = "gpu"
    columns = tuple(c.name for c in NVML_COLUMNS)

    def __init__(self, gpu_index: int = 0, timeout_s: float = 1.0):
        self.timeout_s = timeout_s
        self.gpu_index = gpu_index
        self.handle = None
        self.nvml = None
        try:
            self.nvml = nvml.acquire()
        except nvml.NvmlUnavailable as exc:   # no driver or library: a normal answer on a machine without the GPU
            self.unavailable = f"no NVIDIA GPU: {exc}"
            return
        try:
            n = nvml.device_count(self.nvml)
            if gpu_index >= n:
                self.unavailable = f"GPU {gpu_index} not found (NVML sees {n})"
            else:
                self.handle = nvml.handle(self.nvml, gpu_index)
        except Exception as exc:  # noqa: BLE001 - a GPU NVML cannot open is missing, with the reason
            self.unavailable = nvml.nvml_reason(exc, f"GPU {gpu_index}")

    def read(self) -> Reading:
        if self.unavailable:
            raise SourceMissing(self.unavailable)
        v: dict[str, float | None] = {c: None for c in self.columns}
        for key, value in nvml.live_readings(self.nvml, self.handle).items():
            if _NVML_TO_COLUMN[key] in v:
                v[_NVML_TO_COLUMN[key]] = value
        return Reading(v)

    def close(self) -> None:
        n, self.nvml = self.nvml, None
        nvml.release(n)                      # reference-counted by the driver library


# -- the host (psutil) ----------------------------------------------------------------------------------------
def _busy_idle(ct) -> tuple[float, float]:
    """(busy, total) seconds of one ``cpu_times`` entry the way psutil.cpu_percent counts them: iowait is
    idle; guest time is already inside user time on Linux, so it is not counted twice."""
    total = sum(ct)
    total -= getattr(ct, "guest", 0.0) + getattr(ct, "guest_nice", 0.0)
    idle = ct.idle + getattr(ct, "iowait", 0.0)
    return total - idle, total


class HostSource(Source):
    """Host RAM; CPU on the engine's bound cores vs the rest; the engine process tree's RSS and CPU.

    CPU figures come from this source's own ``cpu_times`` deltas (not ``psutil.cpu_percent``, whose module-wide
    state the status bar also uses). ``bound_cpus`` is the binding's CPU list; without one, the engine
    process's affinity is used when it is narrower than the machine, else the bound/rest split is missing
    (the engine is not bound, so there is nothing to compare)."""

    name = "host"
    local = True
    columns = tuple(c.name for c in HOST_COLUMNS)

    def __init__(self, pid: int | None = None, bound_cpus: list[int] | None = None, timeout_s: float = 1.0):
        self.timeout_s = timeout_s
        self.pid = pid
        self.ncpu = psutil.cpu_count() or 1
        self.bound_cpus = self._resolve_bound(bound_cpus)
        self._prev_cpu = psutil.cpu_times(percpu=True)
        self._prev_wall = time.monotonic()
        self._procs: dict[tuple[int, float], tuple[psutil.Process, float, float]] = {}
        self._prime_tree()

    def _resolve_bound(self, bound: list[int] | None) -> list[int] | None:
        if bound:
            return sorted({c for c in bound if 0 <= c < self.ncpu}) or None
        if self.pid:
            try:
                aff = psutil.Process(self.pid).cpu_affinity()
                if aff and len(set(aff)) < self.ncpu:
                    return sorted(set(aff))
            except (psutil.Error, AttributeError, OSError):
                pass
        return None

    TREE_EVERY_S = 5.0

    def _tree(self) -> list[psutil.Process]:
        """The engine and its descendants. Finding descendants scans every process on the machine, so the list
        is refreshed every ``TREE_EVERY_S`` seconds (and whenever the engine itself changed)."""
        now = time.monotonic()
        cached = getattr(self, "_tree_cache", None)
        if cached is not None and now - cached[0] < self.TREE_EVERY_S and cached[1][0].is_running():
            return cached[1]
        root = psutil.Process(self.pid)
        try:
            kids = root.children(recursive=True)
        except psutil.Error:
            kids = []
        self._tree_cache = (now, [root, *kids])
        return self._tree_cache[1]

    def _prime_tree(self) -> None:
        if not self.pid:
            return
        try:
            self._tree_reading()
        except psutil.Error:
            pass

    def _tree_reading(self) -> tuple[float, float | None]:
        """(rss bytes, cpu % of one core since the previous reading or None on the first) of the tree."""
        now = time.monotonic()
        rss = 0.0
        cpu = 0.0
        have_rate = False
        seen: dict[tuple[int, float], tuple[psutil.Process, float, float]] = {}
        for p in self._tree():
            try:
                with p.oneshot():
                    key = (p.pid, p.create_time())
                    mem = p.memory_info().rss
                    ct = p.cpu_times()
            except psutil.Error:
                continue
            used = ct.user + ct.system
            rss += mem
            prev = self._procs.get(key)
            if prev is not None and now > prev[2]:
                cpu += max(0.0, used - prev[1]) / (now - prev[2]) * 100.0
                have_rate = True
            seen[key] = (p, used, now)
        self._procs = seen
        return rss, (cpu if have_rate else None)

    def read(self) -> Reading:
        v: dict[str, float | None] = {c: None for c in self.columns}
        vm = psutil.virtual_memory()
        v["ram_total_bytes"] = float(vm.total)
        v["ram_used_bytes"] = float(vm.total - vm.available)
        cur = psutil.cpu_times(percpu=True)
        busy = [0.0] * len(cur)
        tot = [0.0] * len(cur)
        for i, (a, b) in enumerate(zip(self._prev_cpu, cur)):
            b1, t1 = _busy_idle(a)
            b2, t2 = _busy_idle(b)
            busy[i], tot[i] = max(0.0, b2 - b1), max(0.0, t2 - t1)
        self._prev_cpu = cur

        def pct(idx: list[int]) -> float | None:
            t = sum(tot[i] for i in idx if i < len(tot))
            return None if t <= 0 else min(100.0, 100.0 * sum(busy[i] for i in idx if i < len(busy)) / t)

        every = list(range(len(cur)))
        v["cpu_total_pct"] = pct(every)
        if self.bound_cpus:
            rest = [i for i in every if i not in set(self.bound_cpus)]
            v["cpu_bound_pct"] = pct(self.bound_cpus)
            v["cpu_rest_pct"] = pct(rest) if rest else None
        notes: dict[str, Any] = {"bound_cpus": self.bound_cpus}
        if self.pid:
            try:
                rss, cpu = self._tree_reading()
                v["engine_rss_bytes"], v["engine_cpu_pct"] = rss, cpu
            except psutil.NoSuchProcess:
                notes["engine_process"] = f"process {self.pid} has exited"
            except psutil.Error as exc:
                notes["engine_process"] = f"cannot read process {self.pid}: {exc}"
        return Reading(v, notes=notes)


# -- the engine's log: expert swaps, decode hit lines, notes ---------------------------------------------------
class LogSwapSource(Source):
    """Expert swaps from the engine's log (Strata reports its adaptive tier's swaps only there), the newest decode
    hit line (``log_hit_rate``/``log_pcie_share``/``log_vram_share``; ``notes["log_hit"]`` says whether it was one
    request's or the batch windows' of all slots) and the engine's notes (``notes["engine_notes"]``: e.g. the
    server's "parallel requests: N asked, the engine runs …"). Attached to a log that already has lines, the
    current run's newest decode line and notes are read from its tail (they are printed before the Monitor starts).

    Two ways in: tail ``log_path`` itself (follows size rotation), or take lines/events pushed by whoever tails
    the log already (``push_line`` / ``push_event``) — one or the other, never both, so nothing is counted
    twice. Until a log is attached the series are missing; once attached, a tick without swaps is a real 0."""

    name = "log"
    local = True
    columns = tuple(c.name for c in LOG_COLUMNS)
    MAX_READ = 4 * 1024 * 1024

    def __init__(self, engine: Engine, log_path: str | Path | None = None, timeout_s: float = 1.0,
                 expected: bool = True):
        self.engine = engine
        self.timeout_s = timeout_s
        # False for an engine the panel did not start (attached): no log of it will come, so until a line is
        # pushed the swap figures are simply None, not a "missing: log" the status line would show for ever
        self.expected = expected
        self.log_path = Path(log_path) if log_path else None
        self._lock = threading.Lock()
        self._swaps = 0
        self._bytes = 0
        self._bytes_known = False
        self.swaps_total = 0
        self._cumulative: int | None = None
        self._swap_lines = False
        self._attached = False
        self._last = time.monotonic()
        self._f: BinaryIO | None = None
        self._ino: int | None = None
        self._partial = b""
        self.last_hit: dict[str, Any] | None = None     # the newest decode hit line's figures (+ "t", "scope")
        self.engine_notes: list[str] = []
        if self.log_path is not None:
            self._open(self.log_path, at_end=True)
            self._read_run_tail(self.log_path)

    # -- push API -------------------------------------------------------------------------------------------
    def push_line(self, line: str) -> LogEvent | None:
        if self.log_path is not None:
            return None          # this source tails the file itself
        ev = self.engine.parse_log_line(line)
        if ev is not None:
            self.push_event(ev)
        else:
            with self._lock:
                self._attached = True
        return ev

    TAIL_BYTES = 1 << 20

    def _read_run_tail(self, path: Path) -> None:
        """The current run's lines already in the log (its last MiB, from the run's start line on): its newest
        decode hit line and its notes — never swaps, which count only from now on."""
        from ..logtail import read_log_tail, run_lines

        try:
            lines = run_lines(read_log_tail(path, self.TAIL_BYTES), None)
        except (OSError, ValueError):
            return
        for ln in lines:
            ev = self.engine.parse_log_line(ln)
            if ev is not None and ev.kind == "info":
                self._note_info(ev, t=None)

    def _note_info(self, ev: LogEvent, t: float | None) -> None:
        d = ev.data if isinstance(ev.data, dict) else {}
        note = d.get("note")
        if isinstance(note, str) and note not in self.engine_notes:
            self.engine_notes = [*self.engine_notes[-4:], note]
        if isinstance(d.get("generated"), int):            # the request summary printed right before its hit line
            self._generated = d["generated"]
        vs = _rate(d.get("vram_share"))
        hr = _rate(d.get("hit_rate"))
        scope = d.get("decode_scope")
        if scope not in ("request", "batch") or (vs is None and hr is None):
            return
        if scope == "request" and getattr(self, "_generated", None) == 1:
            # a batch admission's DONE (prompt + first token): the batch windows' line says the decode; a lone
            # one-token reply is the same line and is said as an admission too
            scope = "admission"
            if self.last_hit is not None and self.last_hit.get("scope") == "batch":
                return
        self.last_hit = {"hit_rate": hr, "pcie_share": _rate(d.get("pcie_share")),
                         "vram_share": vs if vs is not None else hr, "scope": scope, "t": t}

    def push_event(self, ev: LogEvent) -> None:
        with self._lock:
            self._attached = True
            if ev.kind == "info":
                self._note_info(ev, t=time.time())
            if ev.kind == "swap":
                self._swap_lines = True
                self._add_swaps(int(ev.swaps), int(ev.swap_bytes or 0))
                return
            cum = ev.data.get("swaps_cumulative") if isinstance(ev.data, dict) else None
            if isinstance(cum, int) and not isinstance(cum, bool) and cum >= 0 and not self._swap_lines:
                # Strata prints no line per swap: its resident mode repeats a cumulative "N exchanged with the
                # VRAM tier" after each request (tests/data/strata/SOURCES.md). Count the growth between two such
                # lines; the first one seen is the baseline; a smaller value means the engine started again.
                # A log that also has per-swap lines (the scripted engine's "adapt:") is counted from those only.
                prev = self._cumulative
                self._cumulative = cum
                if prev is not None:
                    self._add_swaps(cum - prev if cum >= prev else cum, 0)

    def _add_swaps(self, n: int, nbytes: int) -> None:
        self._swaps += n
        self.swaps_total += n
        if nbytes:
            self._bytes += nbytes
            self._bytes_known = True

    # -- file tail ------------------------------------------------------------------------------------------
    def _open(self, path: Path, at_end: bool) -> None:
        try:
            f = open(path, "rb")
        except OSError:
            self._f = None
            return
        st = os.fstat(f.fileno())
        if at_end:
            f.seek(0, os.SEEK_END)
        if self._f is not None:
            self._f.close()
        self._f, self._ino, self._partial = f, st.st_ino, b""
        with self._lock:
            self._attached = True

    def _tail(self) -> None:
        path = self.log_path
        if path is None:
            return
        if self._f is None:
            self._open(path, at_end=False)
        f = self._f
        if f is None:
            return
        try:
            st = os.stat(path)
            if st.st_ino != self._ino or st.st_size < f.tell():
                # rotated: finish the old file, then read the new one from its start
                self._drain()
                self._open(path, at_end=False)
        except FileNotFoundError:
            pass
        self._drain()

    def _drain(self) -> None:
        if self._f is None:
            return
        data = self._f.read(self.MAX_READ)
        if not data:
            return
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        for raw in lines:
            ev = self.engine.parse_log_line(raw.decode("utf-8", "replace").rstrip("\r"))
            if ev is not None:
                self.push_event(ev)

    def read(self) -> Reading:
        self._tail()
        now = time.monotonic()
        with self._lock:
            dt = max(1e-6, now - self._last)
            swaps, nbytes, known, attached = self._swaps, self._bytes, self._bytes_known, self._attached
            self._swaps = self._bytes = 0
            self._last = now
            hit, notes = (dict(self.last_hit) if self.last_hit else None), list(self.engine_notes)
        hv = {"log_hit_rate": hit["hit_rate"] if hit else None, "log_pcie_share": hit["pcie_share"] if hit else None,
              "log_vram_share": hit["vram_share"] if hit else None}
        extra: dict[str, Any] = {"log_hit": hit} if hit else {}
        if notes:
            extra["engine_notes"] = notes
        if not attached:
            if not self.expected:
                return Reading({"log_swaps_per_s": None, "log_swap_mb_s": None, **hv}, notes=extra)
            raise SourceMissing("no engine log attached yet")
        return Reading({"log_swaps_per_s": swaps / dt,
                        "log_swap_mb_s": (nbytes / dt / 1e6) if known else None, **hv},
                       notes={"log_swaps_total": self.swaps_total, **extra})

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


# -- observed routing (the heatmap) ---------------------------------------------------------------------------
def trace_path_from_argv(argv: list[str] | None) -> str | None:
    """The ``--dump-routing FILE`` of an engine command line (Strata's flag; the scripted engine has it too)."""
    argv = list(argv or [])
    for i, a in enumerate(argv):
        if a == "--dump-routing" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--dump-routing="):
            return a.split("=", 1)[1]
    return None


class RoutingSource(Source):
    """Counts (layer, expert) picks from the engine's ``--dump-routing`` trace as it grows, with
    :func:`engine_manager.expert_routing.count_trace` on the new complete records. Its reading carries no series; the
    cumulative counts (n_layers × n_experts) ride in ``notes['routing_counts']`` when new records arrived.

    The file stays open between reads, as the log tail does: when the trace is moved aside (the scripted engine
    moves a capped trace to ``FILE.1``), the rest of the old file is counted before the new one is read from its
    start; a trace cut short in place is read again from its start. Counts go on adding up across both."""

    name = "routing"
    local = True
    columns = ()
    MAX_READ = 16 * 1024 * 1024

    def __init__(self, trace_path: str | Path, n_layers: int, n_experts: int, timeout_s: float = 1.0):
        import numpy as np

        self.path = Path(trace_path)
        self.n_layers, self.n_experts = int(n_layers), int(n_experts)
        self.timeout_s = timeout_s
        self.counts = np.zeros((self.n_layers, self.n_experts), dtype=np.float64)
        self.records = 0
        self.rotations = 0
        self._f: BinaryIO | None = None
        self._ino: int | None = None
        self._pending = b""

    def _open(self) -> BinaryIO | None:
        """Open the trace (closing the one open before); the file, or None when there is no trace."""
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            return None
        if self._f is not None:
            self._f.close()
        self._f, self._ino, self._pending = f, os.fstat(f.fileno()).st_ino, b""
        return f

    def _count(self, limit: int) -> int:
        """Count what the open file has past the last read (at most ``limit`` bytes); the bytes read."""
        from ..expert_routing import count_trace

        if self._f is None:
            return 0
        data = self._f.read(limit)
        if not data:
            return 0
        buf = self._pending + data
        counts, stats = count_trace(buf, self.n_layers, self.n_experts, self.path)
        keep = stats.dropped_tail_bytes
        self._pending = buf[len(buf) - keep:] if keep else b""
        self.counts += counts
        self.records += stats.records
        return len(data)

    def read(self) -> Reading:
        f = self._f if self._f is not None else self._open()
        if f is None:
            raise SourceMissing(f"no routing trace at {self.path} yet")
        before = self.records
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            st = None                      # moved aside, the new one not there yet: finish the old one
        if st is not None and st.st_ino != self._ino:
            while self._count(self.MAX_READ):       # the rest of the old trace, then the new one from its start
                pass
            self.rotations += 1
            self._open()
        elif st is not None and st.st_size < f.tell():
            f.seek(0)                      # cut short in place: a new trace in the same file
            self._pending = b""
            self.rotations += 1
        self._count(self.MAX_READ)
        notes: dict[str, Any] = {"routing_records": self.records}
        if self.records != before:
            notes["routing_counts"] = self.counts.copy()
        return Reading({}, notes=notes)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
