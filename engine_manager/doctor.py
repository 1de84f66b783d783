"""``dsv41 doctor``: the hardware probe judged against what the target model needs.

Requirements come from the deepseek-one-gpu guides (docs/ENGINE_CONTRACT.md §1): driver ≥ 580.65 (CUDA 13), a GPU
with its VRAM (the reference card is a 96 GB RTX PRO 6000, 97,887 MiB), ~280 GB RAM, ~300 GB free disk,
numactl, and a known NUMA node for the GPU. Each verdict is pass / warn / fail with the figure and what to do.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from .hardware import HardwareReport, format_cpulist
from .fmt import GB, GIB, MIB
from .settings import Settings

Status = Literal["pass", "warn", "fail", "info"]

MIN_DRIVER = (580, 65)
REFERENCE_VRAM_MIB = 97_887           # RTX PRO 6000, the guides' card
MIN_USEFUL_VRAM_MIB = 24 * 1024       # below this the non-expert part + KV hardly fits; the planner decides
RAM_NEEDED_BYTES = 280 * 10**9
DISK_NEEDED_BYTES = 300 * 10**9
MODEL_BYTES = 264_500_000_000
ENGINE_RELEASE_ARCH = "12.0"          # engine release v0.1.0 is prebuilt for sm_120


@dataclass
class Verdict:
    id: str
    title: str
    status: Status
    figure: str
    advice: str = ""


def _driver_tuple(v: str) -> tuple[int, ...] | None:
    nums = re.findall(r"\d+", v or "")
    return tuple(int(n) for n in nums[:3]) if nums else None


def _model_on_disk(settings: Settings) -> int:
    """How many of the seven shards sit in ``model_dir`` (by name; verification is the download's job)."""
    if not settings.model_dir:
        return 0
    d = Path(settings.model_dir).expanduser()
    return len(list(d.glob("*-0000[1-7]-of-00007.gguf"))) if d.is_dir() else 0


def verdicts(report: HardwareReport, settings: Settings) -> list[Verdict]:
    out: list[Verdict] = []
    gpu = report.gpu(settings.gpu_index) or (report.gpus[0] if report.gpus else None)

    # GPU and driver ---------------------------------------------------------------------------------------
    if gpu is None:
        out.append(Verdict("gpu", "NVIDIA GPU", "fail", f"none: {report.gpu_error or 'unknown reason'}",
                           "The real engine needs an NVIDIA GPU. Without one the panel runs the scripted engine "
                           "(labelled simulated) so everything else can be tried."))
        out.append(Verdict("driver", "NVIDIA driver ≥ 580.65", "fail", "no driver",
                           "Install the NVIDIA driver 580.65 or newer (CUDA 13)."))
    else:
        vram_mib = gpu.vram_total_bytes // MIB
        fig = f"{gpu.name}, {vram_mib:,} MiB VRAM ({gpu.vram_total_bytes / GIB:.1f} GiB), bus {gpu.pci_bus_id}"
        if vram_mib >= REFERENCE_VRAM_MIB * 0.98:
            out.append(Verdict("gpu", "NVIDIA GPU with its VRAM", "pass", fig,
                               "At least the guides' 96 GB card: the reference placement fits."))
        elif vram_mib >= MIN_USEFUL_VRAM_MIB:
            out.append(Verdict("gpu", "NVIDIA GPU with its VRAM", "warn", fig,
                               "Less VRAM than the guides' 96 GB card: fewer experts fit on the GPU and decoding "
                               "is slower. Run `dsv41 plan` to see the hot set this card holds."))
        else:
            out.append(Verdict("gpu", "NVIDIA GPU with its VRAM", "fail", fig,
                               "Too little VRAM for the non-expert part, the KV cache and a useful hot set."))
        dv = _driver_tuple(gpu.driver_version)
        cuda = f", CUDA {gpu.cuda_driver_version}" if gpu.cuda_driver_version else ""
        if dv and dv[:2] >= MIN_DRIVER:
            out.append(Verdict("driver", "NVIDIA driver ≥ 580.65", "pass", f"{gpu.driver_version}{cuda}"))
        else:
            out.append(Verdict("driver", "NVIDIA driver ≥ 580.65", "fail", f"{gpu.driver_version or '?'}{cuda}",
                               "Update the NVIDIA driver to 580.65 or newer (CUDA 13); the engine refuses older."))
        cc = gpu.compute_capability
        if cc and cc != ENGINE_RELEASE_ARCH:
            out.append(Verdict("arch", "GPU architecture of the engine release", "warn", f"sm_{cc.replace('.', '')}",
                               f"The prebuilt engine release targets sm_{ENGINE_RELEASE_ARCH.replace('.', '')} "
                               "(RTX PRO 6000 Blackwell). On this GPU build the engine from source for your "
                               "architecture, or run stock llama.cpp (engine llamacpp)."))
        elif cc:
            out.append(Verdict("arch", "GPU architecture of the engine release", "pass", f"sm_{cc.replace('.', '')}"))
        gen, width = gpu.pcie_gen_current, gpu.pcie_width_current
        if gen is not None and width is not None:
            link = f"PCIe gen{gen} x{width} (max gen{gpu.pcie_gen_max} x{gpu.pcie_width_max})"
            ok = gen >= 4 and width >= 16
            out.append(Verdict("pcie", "PCIe link for expert swaps", "pass" if ok else "warn", link,
                               "" if ok else "Expert swaps cross PCIe: a slower link lowers tok/s. Check the slot "
                               "(an idle GPU may also report a lower link generation to save power)."))

    # Host ---------------------------------------------------------------------------------------------------
    ram = report.host.ram_total_bytes
    fig = f"{ram / GB:.0f} GB total ({ram / GIB:.0f} GiB), {report.host.ram_available_bytes / GB:.0f} GB available"
    if ram >= RAM_NEEDED_BYTES * 0.96:
        out.append(Verdict("ram", "RAM ≈ 280 GB", "pass", fig))
    else:
        out.append(Verdict("ram", "RAM ≈ 280 GB", "fail" if ram < RAM_NEEDED_BYTES * 0.8 else "warn", fig,
                           f"The cold experts live in pinned RAM: about {RAM_NEEDED_BYTES / GB:.0f} GB is needed, "
                           f"{max(0, RAM_NEEDED_BYTES - ram) / GB:.0f} GB more than this host has. "
                           "`dsv41 plan` shows whether the minimum layout fits."))

    shards = _model_on_disk(settings)
    free = report.host.disk_free_bytes
    where = report.host.disk_path
    if shards == 7:
        out.append(Verdict("disk", "Disk for the model", "pass",
                           f"all 7 shards present in {settings.model_dir} (download skipped)"))
    elif free is None:
        out.append(Verdict("disk", "≈ 300 GB free disk", "warn", f"could not measure free space at {where}",
                           "Check that the cache folder is on a mounted, writable disk."))
    else:
        fig = f"{free / GB:.0f} GB free at {where}"
        if free >= DISK_NEEDED_BYTES:
            out.append(Verdict("disk", "≈ 300 GB free disk", "pass", fig))
        else:
            out.append(Verdict("disk", "≈ 300 GB free disk", "fail" if free < MODEL_BYTES else "warn", fig,
                               f"The model is {MODEL_BYTES / GB:.1f} GB; free {(DISK_NEEDED_BYTES - free) / GB:.0f} GB "
                               "more, or set DSV41_CACHE_DIR to a bigger disk, or DSV41_MODEL_DIR to a folder that "
                               "already holds the shards."))

    if report.host.numactl:
        out.append(Verdict("numactl", "numactl present", "pass", report.host.numactl))
    else:
        out.append(Verdict("numactl", "numactl present", "warn",
                           "not found" + (f"; taskset at {report.host.taskset}" if report.host.taskset else ""),
                           "Install numactl (apt-get install numactl) so the engine's memory and threads stay "
                           "on the GPU's NUMA node; the guides measured ~53 → 63 tok/s from binding."))

    nodes = report.host.numa_nodes
    if gpu is None:
        out.append(Verdict("numa", "GPU NUMA node known", "info", f"{len(nodes)} NUMA node(s); no GPU",
                           "Binding matters only with a GPU."))
    elif gpu.numa_node is None:
        out.append(Verdict("numa", "GPU NUMA node known", "warn",
                           f"unknown (NVML and sysfs give no node; {len(nodes)} nodes)",
                           "Find it with `nvidia-smi topo -m` (NUMA Affinity) and bind by hand; the panel will "
                           "not guess on a multi-node host."))
    else:
        cpus = format_cpulist(gpu.numa_cpus) if gpu.numa_cpus else "?"
        note = {"single-node": " (the host has one NUMA node, so binding cannot matter)",
                "nvml-affinity": " (from NVML's memory affinity)", "sysfs": " (from sysfs)", "nvml": " (from NVML)"}
        out.append(Verdict("numa", "GPU NUMA node known", "pass",
                           f"node {gpu.numa_node}, CPUs {cpus}{note.get(gpu.numa_node_source, '')}"))
    return out


def release_verdicts(report: HardwareReport, settings: Settings) -> list[Verdict]:
    """The Strata engine release on this machine, as Strata's setup lays it out (one core check:
    :func:`engine_manager.release_check.check_release`): engine binary, BUILD.json (its CUDA vs this driver, its
    architectures vs this GPU), the release's .venv Python and the server's packages, the CUDA wheels, the server and
    iq_pack. A release that is not installed is one verdict (info without a GPU, warn with one)."""
    from .engines.strata import StrataEngine
    from .release_check import check_release

    release = StrataEngine().engine_dir(settings)
    gpu = report.gpu(settings.gpu_index) or (report.gpus[0] if report.gpus else None)
    if not release.is_dir():
        return [Verdict("release", "Strata engine release", "warn" if gpu is not None else "info",
                        f"not installed ({release} does not exist)",
                        "Get it (`dsv41 download engine --from DIR` or `--url URL`) or set DSV41_ENGINE_DIR to an "
                        "unpacked Strata release (only the strata engine needs it).")]
    checks = check_release(release, compute_capability=gpu.compute_capability if gpu else None,
                           driver_cuda=gpu.cuda_driver_version if gpu else None)
    return [Verdict(f"release_{c.id}", c.title, c.status, c.figure, c.fix) for c in checks]


def summary(vs: list[Verdict]) -> dict[str, int]:
    out = {"pass": 0, "warn": 0, "fail": 0, "info": 0}
    for v in vs:
        out[v.status] += 1
    return out


def report_dict(report: HardwareReport, settings: Settings, vs: list[Verdict] | None = None) -> dict[str, Any]:
    vs = verdicts(report, settings) if vs is None else vs
    return {
        "hardware": report.to_dict(),
        "verdicts": [asdict(v) for v in vs],
        "summary": summary(vs),
        "settings": settings.masked(),
    }


SYMBOL = {"pass": "PASS", "warn": "WARN", "fail": "FAIL", "info": "INFO"}


def render_text(report: HardwareReport, vs: list[Verdict]) -> str:
    lines = []
    h = report.host
    lines.append(f"Host {h.hostname}: {h.os}, {h.cores_logical} CPUs, {h.ram_total_bytes / GIB:.1f} GiB RAM, "
                 f"{len(h.numa_nodes)} NUMA node(s)")
    if report.gpus:
        for g in report.gpus:
            lines.append(f"GPU {g.index}: {g.name}, {g.vram_total_bytes // MIB:,} MiB, driver {g.driver_version}, "
                         f"bus {g.pci_bus_id}, NUMA node {g.numa_node if g.numa_node is not None else 'unknown'}")
    else:
        lines.append(f"GPU: none — {report.gpu_error}")      # the reason says it once (it used to repeat "no GPU")
    lines.append("")
    width = max(len(v.title) for v in vs) if vs else 10
    for v in vs:
        lines.append(f"[{SYMBOL[v.status]}] {v.title:<{width}}  {v.figure}")
        if v.advice and v.status != "pass":
            lines.append(f"       {'':<{width}}  → {v.advice}")
    s = summary(vs)
    lines.append("")
    lines.append(f"{s['pass']} passed, {s['warn']} warnings, {s['fail']} failed")
    return "\n".join(lines)
