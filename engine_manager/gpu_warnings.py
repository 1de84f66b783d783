"""Calm GPU warnings: heat, power and clock slowdowns, judged against the card's own limits, that never flap.

Each :class:`Rule` compares a :class:`GpuReading` with a limit NVML reports for that card (the slowdown temperature,
the enforced power limit, the clocks-event reasons) and has two thresholds: ``over`` raises a warning after
``raise_after`` readings over it in a row; ``under`` (a lower one) clears it after ``clear_after`` readings in a
row. A reading between the two, or one with the figure missing, moves neither way. :class:`GpuWarnings` keeps that
state per GPU and rule: pure logic fed readings; :func:`read_gpus` reads them through :mod:`engine_manager.nvml`
(no GPU is a reason in plain words, never a warning). A warning says what it means and what to do; nothing here
stops or kills anything.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

from . import nvml

# NVML clocks-event reasons (nvml.h: nvmlClocksEventReason*), the bits a warning reads
SW_POWER_CAP = 0x4
HW_SLOWDOWN = 0x8
SW_THERMAL = 0x20
HW_THERMAL = 0x40
HW_POWER_BRAKE = 0x80
THERMAL_BITS = SW_THERMAL | HW_THERMAL

TEMP_MARGIN_C = 5.0          # raised at the slowdown temperature − 5 °C …
TEMP_CLEAR_C = 8.0           # … cleared below the slowdown temperature − 8 °C
POWER_OVER = 0.98            # raised at ≥ 98 % of the enforced power limit …
POWER_UNDER = 0.93           # … cleared below 93 %


@dataclass(frozen=True)
class GpuReading:
    """One GPU's figures for the rules; None where NVML did not answer."""
    index: int
    temp_c: float | None = None
    slowdown_c: float | None = None      # NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: the card slows its clocks here
    shutdown_c: float | None = None      # NVML_TEMPERATURE_THRESHOLD_SHUTDOWN
    max_operating_c: float | None = None  # NVML_TEMPERATURE_THRESHOLD_GPU_MAX: top of normal operation
    power_w: float | None = None
    power_limit_w: float | None = None   # the enforced limit (nvmlDeviceGetEnforcedPowerLimit)
    reasons: int | None = None           # clocks-event reasons bitmask
    name: str = ""


@dataclass(frozen=True)
class GpuWarning:
    key: str                 # the rule's key ("temperature", "power", "thermal_slowdown", "power_brake")
    gpu: int
    title: str               # one short line: the status bar's words
    meaning: str             # what it means
    fix: str                 # what to do
    since: float             # when it was raised (the feed's clock)

    def line(self) -> str:
        return f"{self.title}: {self.meaning} {self.fix}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Rule:
    """``over``/``under`` answer True, False or None (the figure is missing) for one reading; ``words`` gives the
    (title, meaning, fix) of the warning from the reading that raised it."""
    key: str
    over: Callable[[GpuReading], bool | None]
    under: Callable[[GpuReading], bool | None]
    words: Callable[[GpuReading], tuple[str, str, str]]
    raise_after: int = 3
    clear_after: int = 5


def temp_limit(r: GpuReading) -> tuple[float, str] | None:
    """The card's own temperature limit the rule works from, and its name: the slowdown threshold, else the top of
    normal operation; None when NVML gives neither."""
    if r.slowdown_c is not None:
        return r.slowdown_c, "slows itself down"
    if r.max_operating_c is not None:
        return r.max_operating_c, "leaves its normal operating range"
    return None


def _temp_over(r: GpuReading) -> bool | None:
    lim = temp_limit(r)
    return None if lim is None or r.temp_c is None else r.temp_c >= lim[0] - TEMP_MARGIN_C


def _temp_under(r: GpuReading) -> bool | None:
    lim = temp_limit(r)
    return None if lim is None or r.temp_c is None else r.temp_c < lim[0] - TEMP_CLEAR_C


def _temp_words(r: GpuReading) -> tuple[str, str, str]:
    lim, where = temp_limit(r) or (0.0, "")
    shut = f"; it shuts down at {r.shutdown_c:.0f} °C" if r.shutdown_c is not None else ""
    return (f"GPU {r.index} is hot ({r.temp_c:.0f} °C)",
            f"it is within {max(0.0, lim - (r.temp_c or 0.0)):.0f} °C of {lim:.0f} °C, where it {where}{shut}; "
            "tokens/s drop if it gets hotter.",
            "Check its fans and the airflow through the case; nothing is stopped.")


def _power_over(r: GpuReading) -> bool | None:
    if r.power_w is None or not r.power_limit_w:
        return None
    return r.power_w >= POWER_OVER * r.power_limit_w


def _power_under(r: GpuReading) -> bool | None:
    if r.power_w is None or not r.power_limit_w:
        return None
    return r.power_w < POWER_UNDER * r.power_limit_w


def _power_words(r: GpuReading) -> tuple[str, str, str]:
    lim = r.power_limit_w or 0.0
    return (f"GPU {r.index} at its power limit ({r.power_w:.0f} of {lim:.0f} W)",
            "it has drawn 98 % or more of its enforced power limit for a while, so the driver holds its clocks down "
            "and tokens/s can stay below the plan.",
            "Normal under a full load now and then; if it lasts, check the limit (`nvidia-smi -q -d POWER`) and "
            "the cooling. Nothing is stopped.")


def _bits(mask: int) -> Callable[[GpuReading], bool | None]:
    return lambda r: None if r.reasons is None else bool(r.reasons & mask)


def _clear(mask: int) -> Callable[[GpuReading], bool | None]:
    return lambda r: None if r.reasons is None else not r.reasons & mask


def _brake(r: GpuReading) -> bool | None:
    """A hardware slowdown that is not the thermal one: the power brake, or HW slowdown without a thermal bit."""
    if r.reasons is None:
        return None
    return bool(r.reasons & HW_POWER_BRAKE) or bool(r.reasons & HW_SLOWDOWN and not r.reasons & THERMAL_BITS)


def _thermal_words(r: GpuReading) -> tuple[str, str, str]:
    return (f"GPU {r.index} slows down: too hot",
            "the GPU is lowering its clocks to cool down (thermal slowdown), so tokens/s drop until it cools.",
            "Improve its cooling (fans, airflow, dust); the engine keeps running.")


def _brake_words(r: GpuReading) -> tuple[str, str, str]:
    return (f"GPU {r.index} slows down: power brake",
            "the board or the power supply told the GPU to slow down (hardware slowdown / power brake), so "
            "tokens/s drop while it lasts.",
            "Check the GPU's power cables and that the power supply can carry the load; the engine keeps running.")


# the most pressing first (a slowdown under way, then heat, then the power limit): the status bar shows the first
RULES: tuple[Rule, ...] = (
    Rule("thermal_slowdown", _bits(THERMAL_BITS), _clear(THERMAL_BITS), _thermal_words, raise_after=3,
         clear_after=5),
    Rule("power_brake", _brake, lambda r: None if r.reasons is None else not _brake(r), _brake_words,
         raise_after=3, clear_after=5),
    Rule("temperature", _temp_over, _temp_under, _temp_words, raise_after=3, clear_after=5),
    # at the cap for 30 s of the status bar's 2-s readings: a compute-bound H200 sits at 98-99 % of its 700 W and
    # says so (SW power cap) every second, so a shorter spell is no news
    Rule("power", _power_over, _power_under, _power_words, raise_after=15, clear_after=5),
)


@dataclass
class _State:
    active: GpuWarning | None = None
    over: int = 0
    under: int = 0


class GpuWarnings:
    """The hysteresis over successive readings: :meth:`feed` one reading per GPU each time; it returns the warnings
    active now."""

    def __init__(self, rules: tuple[Rule, ...] = RULES):
        self.rules = rules
        self._states: dict[tuple[int, str], _State] = {}

    def feed(self, readings: list[GpuReading], t: float | None = None) -> list[GpuWarning]:
        now = time.time() if t is None else t
        for r in readings:
            for rule in self.rules:
                st = self._states.setdefault((r.index, rule.key), _State())
                if st.active is None:
                    o = rule.over(r)
                    if o is None:
                        continue                 # a missing figure: no step either way
                    st.over = st.over + 1 if o else 0
                    if st.over >= rule.raise_after:
                        title, meaning, fix = rule.words(r)
                        st.active, st.under = GpuWarning(rule.key, r.index, title, meaning, fix, now), 0
                else:
                    u = rule.under(r)
                    if u is None:
                        continue
                    st.under = st.under + 1 if u else 0
                    if st.under >= rule.clear_after:
                        st.active, st.over = None, 0
        return self.active

    @property
    def active(self) -> list[GpuWarning]:
        """The warnings raised now, by GPU, the most pressing first (the order of ``rules``)."""
        order = {rule.key: i for i, rule in enumerate(self.rules)}
        keys = sorted(self._states, key=lambda k: (k[0], order[k[1]]))       # (GPU, rule)
        return [w for k in keys if (w := self._states[k].active) is not None]

    @property
    def readings_to_raise(self) -> int:
        """The most readings in a row any rule needs before it raises."""
        return max((r.raise_after for r in self.rules), default=1)


# -- reading the GPUs ----------------------------------------------------------------------------------------

def _num(fn: Callable[..., Any], *args: Any, scale: float = 1.0) -> float | None:
    v = nvml.attempt(fn, *args)
    try:
        return float(v) * scale if v is not None else None
    except (TypeError, ValueError):
        return None


def read_gpu(n: Any, index: int) -> GpuReading:
    """One GPU's :class:`GpuReading` through the ``pynvml`` module ``n``; every figure read on its own (a refused
    query is None)."""
    h = nvml.handle(n, index)
    thr = getattr(n, "nvmlDeviceGetTemperatureThreshold", None)

    def threshold(name: str) -> float | None:
        which = getattr(n, name, None)
        return _num(thr, h, which) if thr is not None and which is not None else None

    reasons_fn = (getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None)
                  or getattr(n, "nvmlDeviceGetCurrentClocksThrottleReasons", None))
    reasons = nvml.attempt(reasons_fn, h) if reasons_fn is not None else None
    return GpuReading(
        index=index,
        temp_c=_num(n.nvmlDeviceGetTemperature, h, n.NVML_TEMPERATURE_GPU),
        slowdown_c=threshold("NVML_TEMPERATURE_THRESHOLD_SLOWDOWN"),
        shutdown_c=threshold("NVML_TEMPERATURE_THRESHOLD_SHUTDOWN"),
        max_operating_c=threshold("NVML_TEMPERATURE_THRESHOLD_GPU_MAX"),
        power_w=_num(n.nvmlDeviceGetPowerUsage, h, scale=1e-3),                 # mW → W
        power_limit_w=_num(n.nvmlDeviceGetEnforcedPowerLimit, h, scale=1e-3),
        reasons=int(reasons) if isinstance(reasons, int) else None,
        name=nvml.text(nvml.attempt(n.nvmlDeviceGetName, h) or ""),
    )


def read_gpus() -> tuple[list[GpuReading], str | None]:
    """Every GPU's reading, and why there is none (or some are missing) in plain words — "no NVIDIA GPU: …" on a
    machine without one. NVML stays initialised for the process (:func:`engine_manager.nvml.shared`)."""
    n, why = nvml.shared()
    if n is None:
        return [], f"no NVIDIA GPU: {why}"
    out: list[GpuReading] = []
    try:
        for i in range(nvml.device_count(n)):
            out.append(read_gpu(n, i))
    except Exception as exc:  # noqa: BLE001 - a GPU lost between count and read: said, not raised
        return out, nvml.nvml_reason(exc, "reading the GPUs")
    return out, None if out else "the NVIDIA driver is loaded but reports no GPU"


@dataclass(frozen=True)
class WarningReport:
    warnings: list[GpuWarning]
    note: str | None = None          # why some or all GPUs could not be read ("no NVIDIA GPU: …")

    def to_dict(self) -> dict[str, Any]:
        return {"warnings": [w.to_dict() for w in self.warnings], "note": self.note}


class GpuWatch:
    """The live views' watcher (the status bar): :meth:`poll` reads every GPU and feeds the hysteresis. ``read``
    is the reader (default :func:`read_gpus`)."""

    def __init__(self, read: Callable[[], tuple[list[GpuReading], str | None]] = read_gpus,
                 warnings: GpuWarnings | None = None):
        self.read = read
        self.warnings = warnings if warnings is not None else GpuWarnings()

    def poll(self, t: float | None = None) -> WarningReport:
        readings, note = self.read()
        return WarningReport(self.warnings.feed(readings, t), note)


STATUS_READINGS = 5         # `dsv41 status` reads this many times …
STATUS_INTERVAL_S = 0.2     # … this far apart (about a second in all)


def status_report(readings: int = STATUS_READINGS, interval_s: float = STATUS_INTERVAL_S,
                  sleep: Callable[[float], None] = time.sleep,
                  read: Callable[[], tuple[list[GpuReading], str | None]] = read_gpus) -> WarningReport:
    """``dsv41 status``: the warnings a burst of ``readings`` readings ``interval_s`` apart raises — a rule that
    needs more in a row needs every one of them, so a one-off spike raises nothing; no GPU answers at once with its
    reason."""
    got, note = read()
    if not got:
        return WarningReport([], note)
    hysteresis = GpuWarnings(tuple(replace(r, raise_after=min(r.raise_after, readings)) for r in RULES))
    hysteresis.feed(got)
    for _ in range(hysteresis.readings_to_raise - 1):
        sleep(interval_s)
        got, note = read()
        hysteresis.feed(got)
    return WarningReport(hysteresis.active, note)


__all__ = ["GpuReading", "GpuWarning", "GpuWarnings", "GpuWatch", "RULES", "Rule", "WarningReport", "read_gpu",
           "read_gpus", "status_report", "temp_limit"]
