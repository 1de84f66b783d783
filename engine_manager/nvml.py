"""The one wrapper of NVIDIA's NVML (nvidia-ml-py, imported as ``pynvml``) in the panel.

Three users, three lifetimes: :func:`session` (``nvmlInit`` … ``nvmlShutdown`` around one probe,
:func:`engine_manager.hardware.probe_gpus`); :func:`acquire` / :func:`release` (held while a metrics source lives,
``metrics.sources.NvmlSource``); :func:`shared` (initialised once per process and kept: the status bar's
``sysstat.read``). NVML reference-counts ``nvmlInit``/``nvmlShutdown``, so they can overlap; one lock serialises them.

No library, no driver or no GPU is a normal answer: :class:`NvmlUnavailable` with the reason in plain words
(:func:`start_reason`), never an NVML traceback. A query the driver refuses is ``None`` (:func:`attempt`), and
:func:`nvml_reason` words NVML's error classes (``NVMLError_<Name>``) as what happened and what to do.

Units of :func:`live_readings` (the figures every live view reads): bytes, percent, watts, °C, MB/s (10^6 B/s:
``nvmlDeviceGetPcieThroughput`` answers KB/s, counted over ~20 ms), PCIe generation and lane count.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

_lock = threading.Lock()
_shared: Any = None
_shared_error: str | None = None


class NvmlUnavailable(Exception):
    """NVML cannot start here; ``str(exc)`` says why in plain words."""


# NVML's error classes (pynvml names them NVMLError_<Name>) in plain words: what happened and what to do
_NVML_WORDS = {
    "GpuIsLost": "the GPU has fallen off the bus (NVML: GPU is lost); check its power and seating, look for Xid "
                 "errors in dmesg, then reboot",
    "ResetRequired": "the GPU needs a reset (NVML: reset required); reboot, or run nvidia-smi -r while nothing uses it",
    "NoPermission": "no permission to query it (NVML: insufficient permissions); check the permissions of "
                    "/dev/nvidia*",
    "Timeout": "the driver did not answer in time (NVML: timeout); try again, and look for Xid errors in dmesg",
    "LibRmVersionMismatch": "the NVML library and the loaded kernel driver are of different versions; reboot after "
                            "the driver update",
    "InsufficientPower": "the GPU reports insufficient power; check its power cables",
    "CorruptedInforom": "the GPU's infoROM is corrupted; the GPU needs service",
    "IrqIssue": "the driver reports an interrupt problem with the GPU; look for Xid errors in dmesg, then reboot",
    "Memory": "NVML ran out of host memory",
    "Uninitialized": "NVML is not initialised",
    "DriverNotLoaded": "the NVIDIA driver is not loaded",
}


def nvml_reason(exc: BaseException, what: str) -> str:
    """A plain-words reason for an NVML query about ``what`` that raised ``exc`` (an NVMLError or anything else a
    query raised)."""
    name = type(exc).__name__
    words = _NVML_WORDS.get(name.removeprefix("NVMLError_"))
    if words is None:
        try:
            text = str(exc) or name
        except Exception:  # pynvml's __str__ asks the library, which may be the thing that failed
            text = name
        words = f"NVML error ({text})" if name.startswith("NVMLError") else f"unexpected answer ({name}: {text})"
    return f"{what}: {words}"


def start_reason(exc: BaseException) -> str:
    """Why ``nvmlInit`` failed, in plain words."""
    name = type(exc).__name__
    if isinstance(exc, ImportError):
        return "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
    if "LibraryNotFound" in name:
        return "no NVIDIA driver (its NVML library, libnvidia-ml.so, is missing)"
    if "DriverNotLoaded" in name:
        return "the NVIDIA driver is installed but not loaded (is a GPU present? try nvidia-smi)"
    return nvml_reason(exc, "NVML could not start")


def attempt(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, or None when NVML refuses (NVMLError_NotSupported & co. per query: a missing answer)."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - every NVML refusal is a missing figure
        return None


def text(v: Any) -> str:
    """NVML strings come as ``bytes`` from older bindings."""
    return v.decode() if isinstance(v, bytes) else str(v)


def acquire() -> Any:
    """``nvmlInit`` (reference-counted) and the ``pynvml`` module; raises :class:`NvmlUnavailable` with the
    reason. Pair with :func:`release`."""
    try:
        import pynvml
    except ImportError as exc:
        raise NvmlUnavailable(start_reason(exc)) from None
    try:
        with _lock:
            pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - no driver or library: a normal answer without the GPU
        raise NvmlUnavailable(start_reason(exc)) from None
    return pynvml


def release(nvml: Any) -> None:
    """``nvmlShutdown`` for one :func:`acquire`; never raises."""
    if nvml is None:
        return
    try:
        with _lock:
            nvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - a driver gone meanwhile: nothing left to release
        pass


@contextmanager
def session() -> Iterator[Any]:
    """``with nvml.session() as n:`` — NVML started for the block (raises :class:`NvmlUnavailable` before it)."""
    n = acquire()
    try:
        yield n
    finally:
        release(n)


def shared() -> tuple[Any, str | None]:
    """(``pynvml`` initialised once for the whole process and kept, None) — or (None, the reason) when NVML cannot
    start; the first answer is kept either way (a driver does not appear while the panel runs)."""
    global _shared, _shared_error
    if _shared is None and _shared_error is None:
        try:
            n = acquire()
        except NvmlUnavailable as exc:
            with _lock:
                if _shared is None and _shared_error is None:
                    _shared_error = str(exc)
        else:
            with _lock:
                if _shared is None:
                    _shared, n = n, None
            release(n)                  # another thread won the race: give this init back
    return _shared, _shared_error


def device_count(nvml: Any) -> int:
    return int(nvml.nvmlDeviceGetCount())


def handle(nvml: Any, index: int) -> Any:
    return nvml.nvmlDeviceGetHandleByIndex(index)


LIVE_FIELDS = ("vram_used_bytes", "vram_total_bytes", "util_pct", "temp_c", "power_w", "pcie_rx_mb_s",
               "pcie_tx_mb_s", "pcie_gen", "pcie_width")


def live_readings(nvml: Any, h: Any, which: Iterable[str] = LIVE_FIELDS) -> dict[str, float | None]:
    """The live figures of one GPU (:data:`LIVE_FIELDS`, or the ``which`` of them asked for: each PCIe throughput
    query takes NVML ~20 ms), each read on its own: one the driver refuses is None."""
    want = set(which)
    out: dict[str, float | None] = {}

    def num(fn: Callable[..., Any], *args: Any, scale: float = 1.0) -> float | None:
        v = attempt(fn, h, *args)
        try:
            return float(v) * scale if v is not None else None
        except (TypeError, ValueError):
            return None

    if want & {"vram_used_bytes", "vram_total_bytes"}:
        mem = attempt(nvml.nvmlDeviceGetMemoryInfo, h)
        out["vram_used_bytes"] = float(mem.used) if mem is not None else None
        out["vram_total_bytes"] = float(mem.total) if mem is not None else None
    if "util_pct" in want:
        util = attempt(nvml.nvmlDeviceGetUtilizationRates, h)
        out["util_pct"] = float(util.gpu) if util is not None else None
    if "temp_c" in want:
        out["temp_c"] = num(nvml.nvmlDeviceGetTemperature, nvml.NVML_TEMPERATURE_GPU)
    if "power_w" in want:
        out["power_w"] = num(nvml.nvmlDeviceGetPowerUsage, scale=1e-3)          # mW → W
    # KB/s → MB/s (10^3 B × 10^-6)
    if "pcie_rx_mb_s" in want:
        out["pcie_rx_mb_s"] = num(nvml.nvmlDeviceGetPcieThroughput, nvml.NVML_PCIE_UTIL_RX_BYTES, scale=1e-3)
    if "pcie_tx_mb_s" in want:
        out["pcie_tx_mb_s"] = num(nvml.nvmlDeviceGetPcieThroughput, nvml.NVML_PCIE_UTIL_TX_BYTES, scale=1e-3)
    if "pcie_gen" in want:
        out["pcie_gen"] = num(nvml.nvmlDeviceGetCurrPcieLinkGeneration)
    if "pcie_width" in want:
        out["pcie_width"] = num(nvml.nvmlDeviceGetCurrPcieLinkWidth)
    return {k: out.get(k) for k in LIVE_FIELDS if k in want}


__all__ = ["LIVE_FIELDS", "NvmlUnavailable", "acquire", "attempt", "device_count", "handle", "live_readings",
           "nvml_reason", "release", "session", "shared", "start_reason", "text"]
