"""The series the monitor keeps: one column per measured quantity, with its unit and where it comes from.

Columns are fixed (a recording's CSV header never changes mid-run). ``NaN`` in the store and an empty cell in a
recording mean *missing*: the source did not answer, failed, or does not exist on this machine — never zero.

Naming follows the house convention: the unit is in the name (``_tok_s``, ``_bytes``, ``_mb_s``, ``_pct``,
``_w``, ``_c``); rates are 0..1. MB is 10^6 bytes (NVML reports KB/s × 1000).

Raw columns keep each source's own reading (``engine_*`` from the engine's metric endpoints, ``nvml_*`` from the
GPU driver, ``log_*`` from the engine's log, host figures from psutil). The *effective* columns the plots draw
(``vram_used_bytes``, ``pcie_rx_mb_s``, ``swaps_per_s`` …) are derived by the hub from them, with the rule in
:func:`engine_manager.metrics.hub.derive`: a real engine prefers the driver's figures, a simulated engine its own
modelled figures (the real GPU, if any, is not what the scripted engine models).
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_SLOTS = 8


@dataclass(frozen=True)
class Column:
    name: str
    unit: str            # as shown on an axis / card: "tok/s", "", "B", "MB/s", "%", "W", "°C", "1/s"
    label: str           # plain words
    source: str          # engine | nvml | host | log | derived


def _c(name: str, unit: str, label: str, source: str) -> Column:
    return Column(name, unit, label, source)


ENGINE_COLUMNS: tuple[Column, ...] = (
    _c("decode_tok_s", "tok/s", "decode, all slots", "engine"),
    _c("prefill_tok_s", "tok/s", "prefill (prompt reading)", "engine"),
    *(_c(f"slot{i}_tok_s", "tok/s", f"decode, slot {i}", "engine") for i in range(MAX_SLOTS)),
    _c("hit_rate", "", "the engine's hit rate: GPU hits / expert lookups (experts read over PCIe excluded)",
       "engine"),
    _c("hit_rate_last", "", "the engine's hit rate of the newest finished request", "engine"),
    _c("engine_pcie_share", "", "share of routed expert picks read over PCIe (engine)", "engine"),
    _c("engine_swaps_per_s", "1/s", "expert swaps (engine)", "engine"),
    _c("swaps_total", "", "expert swaps since start", "engine"),
    _c("engine_swap_mb_s", "MB/s", "swap traffic (engine)", "engine"),
    _c("engine_pcie_rx_mb_s", "MB/s", "PCIe host→GPU (engine)", "engine"),
    _c("engine_pcie_tx_mb_s", "MB/s", "PCIe GPU→host (engine)", "engine"),
    _c("engine_vram_used_bytes", "B", "VRAM used (engine)", "engine"),
    _c("engine_vram_total_bytes", "B", "VRAM total (engine)", "engine"),
    _c("engine_ram_used_bytes", "B", "RAM used (engine)", "engine"),
    _c("engine_ram_total_bytes", "B", "RAM total (engine)", "engine"),
    _c("slots_busy", "", "slots busy (active users)", "engine"),
    _c("slots_total", "", "slots", "engine"),
    _c("queued", "", "requests queued", "engine"),
    _c("requests_total", "", "requests since start", "engine"),
    _c("tokens_generated_total", "", "tokens generated since start", "engine"),
)

NVML_COLUMNS: tuple[Column, ...] = (
    _c("nvml_vram_used_bytes", "B", "VRAM used (driver)", "nvml"),
    _c("nvml_vram_total_bytes", "B", "VRAM total (driver)", "nvml"),
    _c("gpu_util_pct", "%", "GPU utilisation", "nvml"),
    _c("nvml_pcie_rx_mb_s", "MB/s", "PCIe host→GPU (driver)", "nvml"),
    _c("nvml_pcie_tx_mb_s", "MB/s", "PCIe GPU→host (driver)", "nvml"),
    _c("gpu_power_w", "W", "GPU power", "nvml"),
    _c("gpu_temp_c", "°C", "GPU temperature", "nvml"),
    _c("gpu_pcie_gen", "", "PCIe generation (current)", "nvml"),
    _c("gpu_pcie_width", "", "PCIe lanes (current)", "nvml"),
)

HOST_COLUMNS: tuple[Column, ...] = (
    _c("ram_used_bytes", "B", "host RAM used", "host"),
    _c("ram_total_bytes", "B", "host RAM total", "host"),
    _c("cpu_total_pct", "%", "CPU, all cores", "host"),
    _c("cpu_bound_pct", "%", "CPU, the engine's bound cores", "host"),
    _c("cpu_rest_pct", "%", "CPU, the other cores", "host"),
    _c("engine_rss_bytes", "B", "engine process tree RSS", "host"),
    _c("engine_cpu_pct", "%", "engine process tree CPU (100 = one core)", "host"),
)

LOG_COLUMNS: tuple[Column, ...] = (
    _c("log_swaps_per_s", "1/s", "expert swaps (log)", "log"),
    _c("log_swap_mb_s", "MB/s", "swap traffic (log)", "log"),
    _c("log_hit_rate", "", "the engine's hit rate, newest decode line of its log", "log"),
    _c("log_pcie_share", "", "share of routed picks read over PCIe, newest decode line of its log", "log"),
    _c("log_vram_share", "", "share of routed picks served from VRAM, newest decode line of its log", "log"),
)

DERIVED_COLUMNS: tuple[Column, ...] = (
    _c("vram_share", "", "observed share of routed expert picks served from VRAM", "derived"),
    _c("pcie_share", "", "observed share of routed expert picks read over PCIe", "derived"),
    _c("hit_rate_rolling", "", "observed VRAM share of routed picks over the last minute", "derived"),
    _c("prefill_live_tok_s", "tok/s", "prefill while a prompt is being read (empty otherwise)", "derived"),
    _c("swaps_per_s", "1/s", "expert swaps", "derived"),
    _c("swap_mb_s", "MB/s", "swap traffic over PCIe", "derived"),
    _c("pcie_rx_mb_s", "MB/s", "PCIe host→GPU", "derived"),
    _c("pcie_tx_mb_s", "MB/s", "PCIe GPU→host", "derived"),
    _c("vram_used_bytes", "B", "VRAM used", "derived"),
    _c("vram_total_bytes", "B", "VRAM total", "derived"),
)

ALL_COLUMNS: tuple[Column, ...] = ENGINE_COLUMNS + NVML_COLUMNS + HOST_COLUMNS + LOG_COLUMNS + DERIVED_COLUMNS
COLUMN_NAMES: tuple[str, ...] = tuple(c.name for c in ALL_COLUMNS)
BY_NAME: dict[str, Column] = {c.name: c for c in ALL_COLUMNS}
SLOT_COLUMNS: tuple[str, ...] = tuple(f"slot{i}_tok_s" for i in range(MAX_SLOTS))

assert len(set(COLUMN_NAMES)) == len(COLUMN_NAMES)
