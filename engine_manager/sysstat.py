"""Quick whole-machine readings for the status bar: RAM, CPU, and per GPU utilisation and VRAM.

Cheap and blocking at worst for a few ms (NVML can block longer on a busy driver, so the GUI calls this off its
thread). NVML is initialised once per process and kept.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import psutil


@dataclass
class GpuStat:
    index: int
    util_pct: float | None
    vram_used_bytes: int | None
    vram_total_bytes: int | None
    temperature_c: float | None = None


@dataclass
class SysStat:
    ram_used_bytes: int
    ram_total_bytes: int
    cpu_pct: float
    gpus: list[GpuStat] = field(default_factory=list)
    gpu_error: str | None = None


_lock = threading.Lock()
_nvml = None
_nvml_error: str | None = None


def _nvml_module():
    global _nvml, _nvml_error
    with _lock:
        if _nvml is None and _nvml_error is None:
            try:
                import pynvml
                pynvml.nvmlInit()
                _nvml = pynvml
            except Exception as exc:  # no driver / library: a normal answer
                _nvml_error = f"no NVIDIA GPU ({type(exc).__name__})"
        return _nvml


def read() -> SysStat:
    vm = psutil.virtual_memory()
    st = SysStat(vm.total - vm.available, vm.total, psutil.cpu_percent(interval=None))
    nvml = _nvml_module()
    if nvml is None:
        st.gpu_error = _nvml_error
        return st
    try:
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            try:
                util = float(nvml.nvmlDeviceGetUtilizationRates(h).gpu)
            except Exception:
                util = None
            try:
                mem = nvml.nvmlDeviceGetMemoryInfo(h)
                used, total = int(mem.used), int(mem.total)
            except Exception:
                used = total = None
            try:
                temp = float(nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU))
            except Exception:
                temp = None
            st.gpus.append(GpuStat(i, util, used, total, temp))
    except Exception as exc:
        st.gpu_error = f"NVML error: {exc}"
    return st
