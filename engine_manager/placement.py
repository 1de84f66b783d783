"""The placement plan: which routed experts live in VRAM (the hot set), what stays in host RAM, and whether this
host can hold the model at all — from the model's headers, the GPU's VRAM, the host's RAM and real routing data.

``plan(layout, hardware, usage, settings) -> Plan``; ``Plan.to_dict()`` is the JSON the engines read
(docs/ARCHITECTURE.md). The memory model, per engine term (the estimates are :class:`PlanSettings`' fields):
VRAM = non-expert weights (every tensor but the routed experts and the embedding lookup tables) + KV cache
(context × slots × blocks × bytes per token-layer; MLA caches its 512-wide latent + 64 rope dims;
:data:`KV_BYTES_PER_VALUE`) + compute buffers + CUDA context + reserve (``vram_reserve_mib``, 700: Strata's default)
+ hot experts (as many as fit, most expected hits per byte first). RAM = every routed expert (the cold ones, and
the hot ones' pinned host copies: the VRAM expert cache is a cache) + CPU-resident lookup tables + pinned staging
+ OS headroom (max(8 GiB, 5 % of RAM)). Each estimate and the calibration on the guides' host (printed by
``tests/test_placement.py::test_calibration_against_the_guides``): benchmarks/results/design_figures.md.
A predicted hit rate comes only from real frequencies (traces, saved observed routing), else it is None ("unknown
until the engine has seen traffic"); a STRP profile only ranks. The plan store and the replica are
:mod:`engine_manager.plans`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from .fmt import GB, GIB, MIB
from .hardware import GpuInfo, HardwareReport, HostInfo, NumaNodeInfo
from .tensor_layout import ModelLayout
from .expert_routing import CoverageCurve, FrequencyTable, Usage, coverage_curve, rank_by_density, write_strp

SCHEMA = 1

REFERENCE_GPU_NAME = "NVIDIA RTX PRO 6000 Blackwell Workstation Edition"
REFERENCE_VRAM_MIB = 97_887
REFERENCE_RAM_BYTES = 280 * GB
HYPOTHETICAL_UUID = "hypothetical-reference-host"
UNKNOWN_HIT_RATE = "unknown until the engine has seen traffic"

# KV bytes per cached value: int8 and q4_0 carry one fp16 scale per 32 values (ggml's Q8_0 / Q4_0 blocks)
KV_BYTES_PER_VALUE = {"int8": 34 / 32, "q4_0": 18 / 32, "k8v4": (34 / 32 + 18 / 32) / 2, "f16": 2.0}


@dataclass(frozen=True)
class PlanSettings:
    """The settings a plan depends on, plus the memory model's estimates (documented in the module docstring)."""

    slots: int = 1
    context_length: int = 32768
    kv_type: str = "int8"
    vram_reserve_mib: int = 700
    gpu_index: int = 0
    cuda_context_mib: int = 640
    compute_base_mib: int = 1632
    compute_per_slot_mib: int = 128
    staging_base_mib: int = 2048
    staging_per_slot_mib: int = 256
    os_headroom_min_bytes: int = 8 * GIB
    os_headroom_share: float = 0.05
    usage_decay: float = 1.0

    @classmethod
    def from_settings(cls, settings: Any = None, **overrides: Any) -> "PlanSettings":
        if settings is None:
            base = cls()
        elif isinstance(settings, PlanSettings):
            base = settings
        else:
            base = cls(slots=settings.slots, context_length=settings.context_length, kv_type=settings.kv_type,
                       vram_reserve_mib=settings.vram_reserve_mib, gpu_index=settings.gpu_index)
        if overrides:
            from dataclasses import replace
            base = replace(base, **overrides)
        return base


@dataclass
class Term:
    name: str
    bytes: int
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "bytes": int(self.bytes), "note": self.note}


@dataclass
class Budget:
    budget_bytes: int
    terms: list[Term]

    @property
    def total_bytes(self) -> int:
        return sum(t.bytes for t in self.terms)

    @property
    def free_bytes(self) -> int:
        return self.budget_bytes - self.total_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"budget_bytes": int(self.budget_bytes), "terms": [t.to_dict() for t in self.terms],
                "total_bytes": int(self.total_bytes), "free_bytes": int(self.free_bytes)}


@dataclass
class Shortfall:
    resource: str                   # "vram" | "ram" | "gpu"
    needed_bytes: int
    available_bytes: int
    terms: list[Term]

    @property
    def missing_bytes(self) -> int:
        return max(0, self.needed_bytes - self.available_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {"resource": self.resource, "needed_bytes": int(self.needed_bytes),
                "available_bytes": int(self.available_bytes), "missing_bytes": int(self.missing_bytes),
                "terms": [t.to_dict() for t in self.terms]}


@dataclass
class Plan:
    layout: ModelLayout
    settings: PlanSettings
    hardware_label: str
    hypothetical: bool
    gpu_name: str | None
    vram: Budget
    ram: Budget
    moe_layers: list[int]
    n_experts: int
    expert_bytes: np.ndarray                     # (MoE layers × experts) int64
    order: np.ndarray                            # flat indices into expert_bytes, most useful first
    n_hot: int
    hot_mask: np.ndarray                         # (MoE layers × experts) bool
    counts: np.ndarray | None                    # (MoE layers × experts) routed picks, None without frequencies
    predicted_hit_rate: float | None
    hit_rate_note: str
    coverage: CoverageCurve | None
    llamacpp_cpu_layers: list[int]
    llamacpp_gpu_layers: list[int]
    llamacpp_predicted_hit_rate: float | None
    llamacpp_note: str
    refused: str | None = None
    shortfalls: list[Shortfall] = field(default_factory=list)
    strp_path: Path | None = None
    usage_sources: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    created_at: float = field(default_factory=time.time)

    # -- derived ---------------------------------------------------------------------------------------------
    @property
    def total_experts(self) -> int:
        return int(self.expert_bytes.size)

    @property
    def cold_experts(self) -> int:
        return self.total_experts - self.n_hot

    @property
    def hot_expert_bytes(self) -> int:
        return int(self.expert_bytes.reshape(-1)[self.order[: self.n_hot]].sum())

    @property
    def cold_expert_bytes(self) -> int:
        return int(self.expert_bytes.sum()) - self.hot_expert_bytes

    def ranked_pairs(self) -> list[tuple[int, int]]:
        """Every (block, expert) in the plan's order: the hot set first."""
        ne = self.expert_bytes.shape[1]
        layers = np.asarray(self.moe_layers)
        return list(zip(layers[self.order // ne].tolist(), (self.order % ne).tolist()))

    def hot_set(self) -> list[tuple[int, int]]:
        return self.ranked_pairs()[: self.n_hot]

    def strata_args(self) -> list[str]:
        args = ["--expert-cache", str(self.n_hot), "--vram-reserve-mib", str(self.settings.vram_reserve_mib)]
        if self.strp_path is not None:
            args += ["--expert-profile", str(self.strp_path)]
        return args

    def llamacpp_args(self) -> list[str]:
        if not self.llamacpp_cpu_layers:
            return []
        alt = "|".join(str(x) for x in self.llamacpp_cpu_layers)
        return ["--override-tensor", rf"blk\.({alt})\.ffn_.*_exps\.=CPU"]

    def write_strp(self, path: os.PathLike | str) -> Path:
        """Write the Strata profile (the hot set's pairs in the plan's order; slots = the hot set) and point the plan
        at it. Strata's ``read_expert_profile`` refuses a profile that ranks more pairs than it has slots
        (src/core/expert_cache.cpp @2249c24): every pair of the plan used to be written, and the engine refused
        every saved plan's profile."""
        self.strp_path = write_strp(path, self.ranked_pairs()[: self.n_hot], self.layout.n_layers, self.n_experts,
                                    self.n_hot)
        return self.strp_path

    def summary_line(self) -> str:
        if self.refused:
            return f"Refused: {self.refused}"
        hr = f"{self.predicted_hit_rate:.1%}" if self.predicted_hit_rate is not None else UNKNOWN_HIT_RATE
        return (f"{self.n_hot:,} of {self.total_experts:,} experts in VRAM ({self.hot_expert_bytes / GIB:.1f} GiB), "
                f"{self.cold_experts:,} in RAM; predicted share of expert picks in VRAM: {hr}")

    def to_dict(self) -> dict[str, Any]:
        lay = self.layout
        eb = self.expert_bytes
        d: dict[str, Any] = {
            "schema": SCHEMA,
            "created_at": self.created_at,
            "refused": self.refused,
            "shortfalls": [s.to_dict() for s in self.shortfalls],
            "model": {
                "name": lay.name, "file": str(lay.first_shard), "total_bytes": lay.total_bytes,
                "shards": len(lay.shards), "n_layers": lay.n_layers, "moe_layers": list(self.moe_layers),
                "n_experts": self.n_experts, "n_experts_used": lay.n_experts_used,
                "expert_bytes": int(round(float(eb.mean()))) if eb.size else 0,
                "expert_bytes_by_layer": [int(x) for x in eb.max(axis=1)] if eb.size else [],
                "routed_expert_bytes": int(eb.sum()),
                "bytes_by_kind": lay.bytes_by_kind(),
            },
            "hardware": {"label": self.hardware_label, "hypothetical": self.hypothetical, "gpu": self.gpu_name,
                         "vram_bytes": self.vram.budget_bytes, "ram_bytes": self.ram.budget_bytes},
            "hot_experts": self.n_hot,
            "hot_expert_bytes": self.hot_expert_bytes,
            "cold_experts": self.cold_experts,
            "cold_expert_bytes": self.cold_expert_bytes,
            "total_experts": self.total_experts,
            "predicted_hit_rate": self.predicted_hit_rate,
            "predicted_hit_rate_note": self.hit_rate_note,
            "vram": self.vram.to_dict(),
            "ram": self.ram.to_dict(),
            "hot_set": [list(p) for p in self.hot_set()],
            "strata_args": self.strata_args(),
            "strp_path": str(self.strp_path) if self.strp_path else None,
            "llamacpp_cpu_layers": list(self.llamacpp_cpu_layers),
            "llamacpp_gpu_layers": list(self.llamacpp_gpu_layers),
            "llamacpp_predicted_hit_rate": self.llamacpp_predicted_hit_rate,
            "llamacpp_note": self.llamacpp_note,
            "llamacpp_args": self.llamacpp_args(),
            "coverage": None,
            "usage": {"sources": list(self.usage_sources),
                      "total_picks": float(self.counts.sum()) if self.counts is not None else 0.0,
                      "counts": ([[round(float(x), 3) for x in row] for row in self.counts]
                                 if self.counts is not None else None)},
            "settings": {"slots": self.settings.slots, "context_length": self.settings.context_length,
                         "kv_type": self.settings.kv_type, "vram_reserve_mib": self.settings.vram_reserve_mib},
            "notes": list(self.notes),
        }
        if self.coverage is not None:
            cov: dict[str, Any] = dict(self.coverage.sampled(256))
            cov["chosen"] = {"n_hot": self.n_hot, "hot_bytes": self.hot_expert_bytes,
                             "hit_rate": self.predicted_hit_rate}
            d["coverage"] = cov
        return d


# -- the reference host ---------------------------------------------------------------------------------------------

def reference_hardware(vram_mib: float = REFERENCE_VRAM_MIB, ram_bytes: float = REFERENCE_RAM_BYTES,
                       gpu_name: str = REFERENCE_GPU_NAME) -> HardwareReport:
    """A HardwareReport of the guides' workstation (one 96 GB RTX PRO 6000 Blackwell, 97,887 MiB; 280 GB RAM), or
    of another host with the given sizes: what ``dsv41 plan --vram-gib/--ram-gib`` and the scripted engine plan for.
    Plans made for it are labelled hypothetical."""
    vram = int(vram_mib * MIB)
    ram = int(ram_bytes)
    cpus = list(range(32))
    gpu = GpuInfo(index=0, name=gpu_name, uuid=HYPOTHETICAL_UUID, pci_bus_id="00000000:00:00.0",
                  vram_total_bytes=vram, vram_free_bytes=vram, vram_used_bytes=0, driver_version="580.65.06",
                  cuda_driver_version="13.0", compute_capability="12.0", pcie_gen_current=5, pcie_gen_max=5,
                  pcie_width_current=16, pcie_width_max=16, numa_node=0, numa_node_source="hypothetical",
                  numa_cpus=cpus)
    host = HostInfo(hostname="hypothetical host", os="Linux (hypothetical)", ram_total_bytes=ram,
                    ram_available_bytes=ram, cores_logical=32, cores_physical=16,
                    numa_nodes=[NumaNodeInfo(0, cpus, ram, ram)], disk_path="~", disk_free_bytes=None,
                    disk_total_bytes=None, numactl=None, taskset=None)
    return HardwareReport(gpus=[gpu], gpu_error=None, host=host)


def is_hypothetical(hw: HardwareReport) -> bool:
    return any(g.uuid == HYPOTHETICAL_UUID for g in hw.gpus) or hw.host.hostname == "hypothetical host"


def hypothetical_hardware(base: HardwareReport | None, vram_bytes: int | None, ram_bytes: int | None
                          ) -> HardwareReport:
    """This host with its VRAM and/or RAM replaced (``--vram-gib``/``--ram-gib``); a host without a GPU borrows the
    reference card's VRAM unless one is given."""
    gpu = base.gpus[0] if base and base.gpus else None
    vram = vram_bytes if vram_bytes is not None else (gpu.vram_total_bytes if gpu else REFERENCE_VRAM_MIB * MIB)
    ram = ram_bytes if ram_bytes is not None else (base.host.ram_total_bytes if base else REFERENCE_RAM_BYTES)
    if vram_bytes is None:
        name = gpu.name if gpu else REFERENCE_GPU_NAME
    elif vram_bytes == REFERENCE_VRAM_MIB * MIB:
        name = REFERENCE_GPU_NAME
    else:
        name = f"a {vram / GIB:.0f} GiB GPU"
    return reference_hardware(vram / MIB, ram, gpu_name=name)


# -- the plan -------------------------------------------------------------------------------------------------------

def _kv_bytes(layout: ModelLayout, s: PlanSettings) -> tuple[int, str]:
    hp = layout.hparams
    per_value = KV_BYTES_PER_VALUE.get(s.kv_type, 34 / 32)
    kv_lora = hp.get("attention.kv_lora_rank")
    n_embd = int(hp.get("embedding_length") or 0)
    n_head = int(hp.get("attention.head_count") or 1) if not isinstance(hp.get("attention.head_count"), list) else 1
    if isinstance(kv_lora, int) and kv_lora > 0:
        rope = int(hp.get("rope.dimension_count") or 64)
        values = kv_lora + rope
        how = f"MLA latent {kv_lora} + rope {rope}"
    else:
        n_kv = hp.get("attention.head_count_kv", n_head)
        n_kv = int(n_kv if isinstance(n_kv, int) else n_head)
        k_len = int(hp.get("attention.key_length") or (n_embd // max(1, n_head)))
        v_len = int(hp.get("attention.value_length") or k_len)
        values = n_kv * (k_len + v_len)
        how = f"{n_kv} KV heads × ({k_len} + {v_len})"
    per_token_layer = values * per_value
    n = int(round(s.context_length * s.slots * layout.n_layers * per_token_layer))
    note = (f"{s.context_length:,} tokens × {s.slots} slot(s) × {layout.n_layers} layers × "
            f"{per_token_layer:,.0f} B ({s.kv_type}, {how})")
    return n, note


def _describe(tensors: Iterable[Any]) -> str:
    by: dict[str, int] = {}
    for t in tensors:
        if True:
            label = "output head" if t.name.startswith("output") else t.kind.replace("_", " ")
            by[label] = by.get(label, 0) + t.n_bytes
    return ", ".join(f"{k} {v / GIB:.1f} GiB" for k, v in sorted(by.items(), key=lambda kv: -kv[1]) if v)


def _usage_counts(usage: Any, layout: ModelLayout, moe_layers: list[int], n_experts: int
                  ) -> tuple[np.ndarray | None, list[tuple[int, int]] | None, list[str], list[str]]:
    """(counts over MoE layers × experts or None, ranking or None, sources, notes) from whatever usage is."""
    if usage is None:
        return None, None, [], []
    ranking = None
    sources: list[str] = []
    notes: list[str] = []
    table: FrequencyTable | None = None
    if isinstance(usage, Usage):
        table, ranking, sources, notes = usage.frequencies, usage.ranking, list(usage.sources), list(usage.notes)
    elif isinstance(usage, FrequencyTable):
        table, sources = usage, list(usage.sources)
    else:
        table = FrequencyTable(np.asarray(usage, dtype=np.float64))
    counts = None
    if table is not None and not table.empty:
        c = table.counts
        if c.shape[1] != n_experts:
            raise ValueError(f"routing counts have {c.shape[1]} experts per layer; the model has {n_experts}")
        if c.shape[0] == layout.n_layers:
            counts = c[moe_layers, :]
        elif c.shape[0] == len(moe_layers):
            counts = c
        else:
            raise ValueError(f"routing counts have {c.shape[0]} layers; the model has {layout.n_layers} blocks "
                             f"({len(moe_layers)} MoE)")
        if counts.sum() <= 0:
            counts = None
    return counts, ranking, sources, notes


def _order(counts: np.ndarray | None, ranking: list[tuple[int, int]] | None, eb: np.ndarray,
           moe_layers: list[int]) -> tuple[np.ndarray, str]:
    n_l, n_e = eb.shape
    # tie order with no data: expert-major across layers (expert 0 of every layer, then expert 1, ...)
    tie = (np.arange(n_e)[None, :] * n_l + np.arange(n_l)[:, None]).reshape(-1)
    if counts is not None:
        return rank_by_density(counts, eb, tie), "frequencies"
    if ranking:
        pos = {layer: i for i, layer in enumerate(moe_layers)}
        seen = np.zeros(n_l * n_e, dtype=bool)
        first: list[int] = []
        for layer, e in ranking:
            i = pos.get(layer)
            if i is None or not 0 <= e < n_e:
                continue
            f = i * n_e + e
            if not seen[f]:
                seen[f] = True
                first.append(f)
        rest = rank_by_density(None, eb, tie)
        rest = rest[~seen[rest]]
        return np.concatenate([np.asarray(first, dtype=np.int64), rest]), "profile"
    return rank_by_density(None, eb, tie), "none"


def _fill(order: np.ndarray, eb_flat: np.ndarray, budget: int) -> tuple[np.ndarray, int]:
    """Take pairs in order while they fit; then let smaller later pairs use what is left. Returns (new order with the
    chosen first, number chosen)."""
    if budget <= 0 or order.size == 0:
        return order, 0
    sizes = eb_flat[order]
    cum = np.cumsum(sizes)
    k = int(np.searchsorted(cum, budget, side="right"))
    left = budget - (int(cum[k - 1]) if k else 0)
    if k >= order.size or left < int(sizes[k:].min()):
        return order, k
    extra = []
    for j in range(k, order.size):
        s = int(sizes[j])
        if s <= left:
            extra.append(j)
            left -= s
    if not extra:
        return order, k
    mask = np.zeros(order.size, dtype=bool)
    mask[extra] = True
    tail = order[k:]
    m = mask[k:]
    new = np.concatenate([order[:k], tail[m], tail[~m]])
    return new, k + len(extra)


def plan(layout: ModelLayout, hardware: HardwareReport | None, usage: Usage | FrequencyTable | np.ndarray | None = None,
         settings: Any = None, *, strp_path: os.PathLike | str | None = None,
         hypothetical: bool | None = None) -> Plan:
    """Plan the placement of ``layout`` on ``hardware`` (a HardwareReport: ``hardware.probe()`` for this machine,
    :func:`reference_hardware` for the guides' workstation; None means the latter). ``usage``: routing data (a
    Usage from :func:`routing.load_usage`, a FrequencyTable, or a (blocks or MoE layers) × experts count array) or
    None. ``settings``: a Settings, a PlanSettings or None (defaults). With ``strp_path`` the Strata profile is
    written there (not for a refused plan). Raises ValueError for routing counts of another model's shape."""
    s = PlanSettings.from_settings(settings)
    if hardware is None:
        hardware = reference_hardware()
    hyp = is_hypothetical(hardware) if hypothetical is None else hypothetical
    gpu = hardware.gpu(s.gpu_index) or (hardware.gpus[0] if hardware.gpus else None)
    ram_total = int(hardware.host.ram_total_bytes)
    moe_layers = layout.moe_layers
    eb = layout.expert_bytes_matrix()
    n_experts = int(eb.shape[1]) if eb.size else layout.n_experts
    eb_flat = eb.reshape(-1)
    notes: list[str] = []
    if not moe_layers:
        notes.append("The model has no routed experts: nothing to place; every weight goes to the GPU.")

    # -- VRAM -------------------------------------------------------------------------------------------------------
    gpu_tensors = [t for t in layout.tensors if t.kind != "routed_experts" and not t.lookup]
    gpu_bytes = sum(t.n_bytes for t in gpu_tensors)
    kv, kv_note = _kv_bytes(layout, s)
    compute = (s.compute_base_mib + s.compute_per_slot_mib * s.slots) * MIB
    fixed = [
        Term("non-expert weights", gpu_bytes, _describe(gpu_tensors)),
        Term("KV cache", kv, kv_note),
        Term("compute buffers", compute, f"graphs, prefill chunk and MoE scratch: {s.compute_base_mib:,} MiB + "
                                         f"{s.compute_per_slot_mib} MiB × {s.slots} slot(s) (estimate)"),
        Term("CUDA context", s.cuda_context_mib * MIB, "driver and cuBLAS workspace (estimate)"),
        Term("reserve (--vram-reserve-mib)", s.vram_reserve_mib * MIB, "kept free for CUDA's own use"),
    ]
    vram_total = int(gpu.vram_total_bytes) if gpu else 0
    fixed_sum = sum(t.bytes for t in fixed)
    shortfalls: list[Shortfall] = []
    reasons: list[str] = []
    if gpu is None:
        reason = hardware.gpu_error or "no NVIDIA GPU was found"
        shortfalls.append(Shortfall("gpu", fixed_sum, 0, fixed))
        reasons.append(f"no GPU to plan for ({reason}). Plan for another host with --vram-gib N (and --ram-gib N), "
                       "or run the scripted engine")
    elif fixed_sum > vram_total:
        shortfalls.append(Shortfall("vram", fixed_sum, vram_total, fixed))
        reasons.append(f"VRAM cannot hold the non-expert part + KV cache + reserve: it needs "
                       f"{fixed_sum / GIB:.1f} GiB, the GPU has {vram_total / GIB:.1f} GiB — "
                       f"{(fixed_sum - vram_total) / GIB:.1f} GiB short. Lower the context length or slots, use a "
                       "smaller KV type (q4_0), or use a GPU with more memory")
    expert_budget = max(0, vram_total - fixed_sum) if not shortfalls else 0

    counts, ranking, sources, unotes = _usage_counts(usage, layout, moe_layers, n_experts)
    notes += unotes
    order, basis = _order(counts, ranking, eb, moe_layers)
    order, n_hot = _fill(order, eb_flat, expert_budget)
    hot_bytes = int(eb_flat[order[:n_hot]].sum())
    vram_terms = fixed + [Term("hot experts", hot_bytes,
                               f"{n_hot:,} of {eb_flat.size:,} routed experts "
                               f"({(hot_bytes / n_hot if n_hot else 0) / MIB:.2f} MiB each)")]
    vram = Budget(vram_total, vram_terms)

    # -- RAM ---------------------------------------------------------------------------------------------------------
    cold_bytes = int(eb_flat.sum()) - hot_bytes
    lookup = [t for t in layout.tensors if t.lookup]
    lookup_bytes = sum(t.n_bytes for t in lookup)
    staging = (s.staging_base_mib + s.staging_per_slot_mib * s.slots) * MIB
    headroom = max(s.os_headroom_min_bytes, int(s.os_headroom_share * ram_total))
    ram_terms = [
        Term("cold experts (pinned)", cold_bytes, f"{eb_flat.size - n_hot:,} experts computed by CPU threads"),
        Term("host copies of the hot experts (pinned)", hot_bytes,
             "the VRAM expert cache's backing store: the adaptive tier drops experts from VRAM without copying back"),
        Term("CPU-resident tensors", lookup_bytes,
             "embedding lookup tables: " + (", ".join(sorted({t.name.split('.')[0] if t.layer is None
                                                              else t.name.split('.')[2].rsplit('_', 2)[0]
                                                              for t in lookup})) or "none")),
        Term("pinned staging", staging,
             f"PCIe upload buffers and CPU expert pool activations: "
             f"{s.staging_base_mib:,} MiB + {s.staging_per_slot_mib} MiB × {s.slots} slot(s)"),
        Term("OS headroom", headroom, f"max({s.os_headroom_min_bytes / GIB:.0f} GiB, "
                                      f"{s.os_headroom_share:.0%} of RAM): the OS, page cache, the server"),
    ]
    ram = Budget(ram_total, ram_terms)
    if ram.total_bytes > ram_total:
        shortfalls.append(Shortfall("ram", ram.total_bytes, ram_total, ram_terms))
        reasons.append(f"RAM cannot hold the minimum layout: it needs {ram.total_bytes / GB:.1f} GB "
                       f"({ram.total_bytes / GIB:.1f} GiB), the host has {ram_total / GB:.1f} GB "
                       f"({ram_total / GIB:.1f} GiB) — {(ram.total_bytes - ram_total) / GB:.1f} GB short. Add RAM, "
                       "or use the engine's low-RAM mode "
                       "(--mmap-experts: experts read from disk, much slower)")
    refused = "; ".join(reasons) if reasons else None

    # -- hit rates -----------------------------------------------------------------------------------------------------
    cov = None
    if counts is not None:
        cov = coverage_curve(counts, eb, order)
        pred = cov.at(n_hot) if cov else None
        total = float(counts.sum())
        note = (f"predicted on the planning traffic: {total:,.0f} routed picks in {len(sources) or 1} usage file(s), "
                "the same traffic the ranking was built from, so the share observed on other prompts runs lower "
                "(Strata measured 69.2% against 94.9% predicted at 5,805 pairs) — compare with the Monitor's "
                "observed VRAM share over the last minute")
    else:
        pred = None
        note = UNKNOWN_HIT_RATE + (" (a profile ranks experts but carries no frequencies)" if basis == "profile"
                                   else "")

    # -- llama.cpp at the same budget -------------------------------------------------------------------------------
    layer_bytes = eb.sum(axis=1)
    if counts is not None:
        dens = np.divide(counts.sum(axis=1), layer_bytes, out=np.zeros(len(moe_layers)), where=layer_bytes > 0)
        lorder = np.lexsort((-np.arange(len(moe_layers)), -dens))
    else:
        lorder = np.arange(len(moe_layers))[::-1]          # --n-cpu-moe keeps the first layers on the CPU
    gpu_l: list[int] = []
    left = expert_budget
    for i in lorder:
        if layer_bytes[i] <= left:
            gpu_l.append(int(i))
            left -= int(layer_bytes[i])
    gpu_layers = sorted(moe_layers[i] for i in gpu_l)
    cpu_layers = sorted(set(moe_layers) - set(gpu_layers))
    if counts is not None:
        lpred = float(counts[gpu_l, :].sum() / counts.sum()) if gpu_l else 0.0
        lnote = "from the same routing frequencies"
    elif moe_layers:
        lpred = len(gpu_layers) / len(moe_layers)
        lnote = (f"every token routes {layout.n_experts_used or 'the same number of'} experts in each MoE layer, so "
                 f"the hit rate is the share of MoE layers on the GPU ({len(gpu_layers)} of {len(moe_layers)})")
    else:
        lpred, lnote = None, "no MoE layers"

    hw_label = _hardware_label(hardware, gpu, hyp)
    p = Plan(layout=layout, settings=s, hardware_label=hw_label, hypothetical=hyp,
             gpu_name=gpu.name if gpu else None, vram=vram, ram=ram, moe_layers=moe_layers, n_experts=n_experts,
             expert_bytes=eb, order=order, n_hot=n_hot, hot_mask=_mask(order[:n_hot], eb.shape), counts=counts,
             predicted_hit_rate=pred, hit_rate_note=note, coverage=cov, llamacpp_cpu_layers=cpu_layers,
             llamacpp_gpu_layers=gpu_layers, llamacpp_predicted_hit_rate=lpred, llamacpp_note=lnote,
             refused=refused, shortfalls=shortfalls, usage_sources=sources, notes=notes)
    if basis == "profile":
        notes.append("ordered by the given Strata profile (a ranking; no frequencies)")
    if strp_path is not None and refused is None and moe_layers:
        p.write_strp(strp_path)
    return p


def _mask(flat: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    m = np.zeros(int(np.prod(shape)), dtype=bool)
    m[flat] = True
    return m.reshape(shape)


def _hardware_label(hw: HardwareReport, gpu: GpuInfo | None, hyp: bool) -> str:
    ram = hw.host.ram_total_bytes
    g = f"{gpu.name} ({gpu.vram_total_bytes / MIB:,.0f} MiB)" if gpu else "no GPU"
    r = f"{ram / GB:.0f} GB ({ram / GIB:.0f} GiB) RAM"     # both units: the CLI's sizes are GiB, RAM is sold in GB
    if hyp:
        return f"hypothetical host: {g}, {r}"
    return f"this host ({hw.host.hostname}): {g}, {r}"
