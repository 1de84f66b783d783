"""Quick whole-machine readings for the status bar: RAM, CPU, and per GPU utilisation and VRAM.

Cheap and blocking at worst for a few ms (NVML can block longer on a busy driver, so the GUI calls this off its
thread). NVML is initialised once per process and kept (:func:`engine_manager.nvml.shared`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import psutil

from . import nvml


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


_FIELDS = ("util_pct", "vram_used_bytes", "vram_total_bytes", "temp_c")


def read() -> SysStat:
    vm = psutil.virtual_memory()
    st = SysStat(vm.total - vm.available, vm.total, psutil.cpu_percent(interval=None))
    n, why = nvml.shared()
    if n is None:
        st.gpu_error = f"no NVIDIA GPU: {why}"
        return st
    try:
        for i in range(nvml.device_count(n)):
            v = nvml.live_readings(n, nvml.handle(n, i), _FIELDS)
            used, total = v["vram_used_bytes"], v["vram_total_bytes"]
            st.gpus.append(GpuStat(i, v["util_pct"], int(used) if used is not None else None,
                                   int(total) if total is not None else None, v["temp_c"]))
    except Exception as exc:  # noqa: BLE001 - a GPU lost between count and read: said, not raised
        st.gpu_error = nvml.nvml_reason(exc, "reading the GPUs")
    return st
