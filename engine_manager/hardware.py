"""What this machine has: NVIDIA GPUs through NVML (nvidia-ml-py), the host through psutil and sysfs.

No GPU, no driver or no NVML library is a normal result with its reason (``HardwareReport.gpu_error``), never an
exception; so is every NVML query that fails: a GPU that cannot be read at all (no handle, no memory figures) is
left out with its reason in ``gpu_error``, a GPU missing only its name, UUID or bus id keeps placeholders and says so
in ``GpuInfo.error`` (:func:`nvml_reason` words NVML's errors). The report round-trips through JSON
(``to_dict``/``from_dict``) so a probe taken on another machine (``tests/data/doctor-h200.json``) can be rendered
anywhere.

The GPU's NUMA node: NVML's ``nvmlDeviceGetNumaNodeId`` where it answers; else sysfs
``/sys/bus/pci/devices/<bus id>/numa_node`` (NVML names the domain with 8 hex digits, sysfs with 4); -1 there
means unknown. Then NVML's memory affinity at node scope (what ``nvidia-smi topo -m`` prints as NUMA Affinity);
finally, on a host with one NUMA node, that node. ``numa_node_source`` says which answered.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from . import fmt, nvml

# psutil and platform are imported by the probes that use them: the window's first step imports this module for
# its values (HardwareReport) and probes on a worker later (psutil with platform: ~15 ms of that step)

SYSFS = Path("/sys")


def parse_cpulist(text: str) -> list[int]:
    """``"0-3,8,10-11"`` → ``[0, 1, 2, 3, 8, 10, 11]``."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            a, b = part.split("-", 1)
            cpus.extend(range(int(a), int(b) + 1))
        else:
            cpus.append(int(part))
    return cpus


def format_cpulist(cpus: list[int]) -> str:
    """Inverse of :func:`parse_cpulist`: ``[0,1,2,3,8]`` → ``"0-3,8"``."""
    return fmt.ranges(cpus, dash="-", sep=",", empty="")


def sysfs_bus_id(nvml_bus_id: str) -> str:
    """NVML ``00000000:00:06.0`` → sysfs ``0000:00:06.0`` (lower case)."""
    b = nvml_bus_id.strip().lower()
    dom, _, rest = b.partition(":")
    if len(dom) > 4:
        dom = dom[-4:]
    return f"{dom}:{rest}"


@dataclass
class GpuInfo:
    index: int
    name: str
    uuid: str
    pci_bus_id: str
    vram_total_bytes: int
    vram_free_bytes: int
    vram_used_bytes: int
    driver_version: str
    cuda_driver_version: str | None
    compute_capability: str | None
    pcie_gen_current: int | None = None
    pcie_gen_max: int | None = None
    pcie_width_current: int | None = None
    pcie_width_max: int | None = None
    numa_node: int | None = None
    numa_node_source: str = "unknown"
    numa_cpus: list[int] = field(default_factory=list)
    error: str | None = None            # what NVML could not say about this GPU (its name, UUID or bus id)


@dataclass
class NumaNodeInfo:
    id: int
    cpus: list[int]
    mem_total_bytes: int | None
    mem_free_bytes: int | None


@dataclass
class HostInfo:
    hostname: str
    os: str
    ram_total_bytes: int
    ram_available_bytes: int
    cores_logical: int
    cores_physical: int | None
    numa_nodes: list[NumaNodeInfo]
    disk_path: str
    disk_free_bytes: int | None
    disk_total_bytes: int | None
    numactl: str | None
    taskset: str | None


@dataclass
class HardwareReport:
    gpus: list[GpuInfo]
    gpu_error: str | None
    host: HostInfo
    nvml_version: str | None = None
    probed_at: float = field(default_factory=time.time)

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpus)

    def gpu(self, index: int = 0) -> GpuInfo | None:
        for g in self.gpus:
            if g.index == index:
                return g
        return None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "HardwareReport":
        host = dict(d["host"])
        host["numa_nodes"] = [NumaNodeInfo(**_known(NumaNodeInfo, n)) for n in host.get("numa_nodes", [])]
        return cls(
            gpus=[GpuInfo(**_known(GpuInfo, g)) for g in d.get("gpus", [])],
            gpu_error=d.get("gpu_error"),
            host=HostInfo(**_known(HostInfo, host)),
            nvml_version=d.get("nvml_version"),
            probed_at=d.get("probed_at", 0.0),
        )


def _known(cls: type, d: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in d.items() if k in names}


# -- host ------------------------------------------------------------------------------------------------

def numa_nodes(sysfs: Path = SYSFS) -> list[NumaNodeInfo]:
    base = sysfs / "devices" / "system" / "node"
    nodes: list[NumaNodeInfo] = []
    if base.is_dir():
        for d in sorted(base.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
            try:
                cpus = parse_cpulist((d / "cpulist").read_text())
            except (OSError, ValueError):
                cpus = []
            total = free = None
            try:
                for line in (d / "meminfo").read_text().splitlines():
                    parts = line.split()
                    if len(parts) >= 4 and parts[2] == "MemTotal:":
                        total = int(parts[3]) * 1024
                    elif len(parts) >= 4 and parts[2] == "MemFree:":
                        free = int(parts[3]) * 1024
            except (OSError, ValueError):
                pass
            nodes.append(NumaNodeInfo(int(d.name[4:]), cpus, total, free))
    if not nodes:  # no sysfs NUMA info (containers, other OSes): one node with every CPU
        import psutil

        vm = psutil.virtual_memory()
        nodes.append(NumaNodeInfo(0, list(range(psutil.cpu_count() or 1)), vm.total, vm.available))
    return nodes


def _existing_parent(p: Path) -> Path:
    p = p.expanduser()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def probe_host(disk_path: Path, sysfs: Path = SYSFS) -> HostInfo:
    import platform

    import psutil

    vm = psutil.virtual_memory()
    target = _existing_parent(Path(disk_path))
    free: int | None
    total: int | None
    try:
        du = shutil.disk_usage(target)
        free, total = du.free, du.total
    except OSError:
        free = total = None
    return HostInfo(
        hostname=socket.gethostname(),
        os=f"{platform.system()} {platform.release()}",
        ram_total_bytes=vm.total,
        ram_available_bytes=vm.available,
        cores_logical=psutil.cpu_count(logical=True) or 1,
        cores_physical=psutil.cpu_count(logical=False),
        numa_nodes=numa_nodes(sysfs),
        disk_path=str(Path(disk_path).expanduser()),
        disk_free_bytes=free,
        disk_total_bytes=total,
        numactl=shutil.which("numactl"),
        taskset=shutil.which("taskset"),
    )


# -- GPUs --------------------------------------------------------------------------------------------------

_s = nvml.text
_try = nvml.attempt
nvml_reason = nvml.nvml_reason      # the words for NVML's errors live in engine_manager.nvml


def _gpu_numa(lib, handle, bus_id: str, nodes: list[NumaNodeInfo], sysfs: Path) -> tuple[int | None, str]:
    getter = getattr(lib, "nvmlDeviceGetNumaNodeId", None)
    if getter is not None:
        v = _try(getter, handle)
        if isinstance(v, int) and v >= 0:
            return v, "nvml"
    try:
        v = int((sysfs / "bus" / "pci" / "devices" / sysfs_bus_id(bus_id) / "numa_node").read_text().strip())
        if v >= 0:
            return v, "sysfs"
    except (OSError, ValueError):
        pass
    affinity = getattr(lib, "nvmlDeviceGetMemoryAffinity", None)
    scope = getattr(lib, "NVML_AFFINITY_SCOPE_NODE", 0)
    if affinity is not None and len(nodes) > 1:
        words = _try(affinity, handle, max(1, (max(n.id for n in nodes) // 64) + 1), scope)
        if words:
            bits = [w * 64 + b for w, word in enumerate(words) for b in range(64) if (int(word) >> b) & 1]
            if len(bits) == 1:
                return bits[0], "nvml-affinity"
    if len(nodes) == 1:
        return nodes[0].id, "single-node"
    return None, "unknown"


def gpu_reason(count: int, n_read: int, failures: list[str]) -> str | None:
    """``HardwareReport.gpu_error`` from what NVML said: how many GPUs it counted, how many could be read, and the
    reasons (:func:`nvml_reason`) of those that could not. None when every GPU was read."""
    if failures and not n_read:
        return f"NVML counts {count} GPU(s) but none could be read: " + "; ".join(failures)
    if failures:
        return f"{len(failures)} of {count} GPUs could not be read and are left out: " + "; ".join(failures)
    if not n_read:
        return "the NVIDIA driver is loaded but reports no GPU"
    return None


def _read_gpu(lib, i: int, driver: str, cuda_s: str | None, nodes: list[NumaNodeInfo], sysfs: Path) -> GpuInfo:
    """GPU ``i``. Without a handle or its memory figures there is no GPU to plan for (raises); a missing name, UUID
    or bus id is a placeholder and a reason in ``GpuInfo.error``."""
    h = lib.nvmlDeviceGetHandleByIndex(i)
    mem = lib.nvmlDeviceGetMemoryInfo(h)
    problems: list[str] = []

    def soft(what: str, fn, default: str) -> str:
        try:
            return _s(fn(h))
        except Exception as exc:
            problems.append(nvml_reason(exc, what))
            return default

    bus = soft("PCI bus id", lambda h: lib.nvmlDeviceGetPciInfo(h).busId, "")
    name = soft("name", lib.nvmlDeviceGetName, f"NVIDIA GPU {i} (name unknown)")
    uuid = soft("UUID", lib.nvmlDeviceGetUUID, "")
    cc = _try(lib.nvmlDeviceGetCudaComputeCapability, h)
    node, src = _gpu_numa(lib, h, bus, nodes, sysfs)
    node_cpus = next((n.cpus for n in nodes if n.id == node), []) if node is not None else []
    return GpuInfo(
        index=i,
        name=name,
        uuid=uuid,
        pci_bus_id=bus,
        vram_total_bytes=int(mem.total),
        vram_free_bytes=int(mem.free),
        vram_used_bytes=int(mem.used),
        driver_version=driver,
        cuda_driver_version=cuda_s,
        compute_capability=f"{cc[0]}.{cc[1]}" if cc else None,
        pcie_gen_current=_try(lib.nvmlDeviceGetCurrPcieLinkGeneration, h),
        pcie_gen_max=_try(lib.nvmlDeviceGetMaxPcieLinkGeneration, h),
        pcie_width_current=_try(lib.nvmlDeviceGetCurrPcieLinkWidth, h),
        pcie_width_max=_try(lib.nvmlDeviceGetMaxPcieLinkWidth, h),
        numa_node=node,
        numa_node_source=src,
        numa_cpus=list(node_cpus),
        error="; ".join(problems) or None,
    )


def probe_gpus(sysfs: Path = SYSFS, nodes: list[NumaNodeInfo] | None = None
               ) -> tuple[list[GpuInfo], str | None, str | None]:
    """(gpus, reason when there are none or some could not be read, NVML version). Never raises for NVML."""
    try:
        n = nvml.acquire()
    except nvml.NvmlUnavailable as exc:
        return [], str(exc), None
    nodes = nodes if nodes is not None else numa_nodes(sysfs)
    try:
        nvml_version = _s(_try(n.nvmlSystemGetNVMLVersion) or "") or None
        driver = _s(_try(n.nvmlSystemGetDriverVersion) or "")
        cuda = _try(n.nvmlSystemGetCudaDriverVersion)
        cuda_s = f"{cuda // 1000}.{(cuda % 1000) // 10}" if isinstance(cuda, int) else None
        try:
            count = nvml.device_count(n)
        except Exception as exc:
            return [], nvml_reason(exc, "counting the GPUs"), nvml_version
        gpus: list[GpuInfo] = []
        failures: list[str] = []
        for i in range(count):
            try:
                gpus.append(_read_gpu(n, i, driver, cuda_s, nodes, sysfs))
            except Exception as exc:  # a GPU lost mid-probe is a reason, not a traceback
                failures.append(nvml_reason(exc, f"GPU {i}"))
        return gpus, gpu_reason(count, len(gpus), failures), nvml_version
    finally:
        nvml.release(n)


def probe(disk_path: Path | None = None, sysfs: Path = SYSFS) -> HardwareReport:
    """Probe GPUs and host. ``disk_path`` is where free disk is measured (the cache dir)."""
    disk_path = Path(disk_path) if disk_path else Path(os.path.expanduser("~"))
    host = probe_host(disk_path, sysfs)
    gpus, err, ver = probe_gpus(sysfs, host.numa_nodes)
    return HardwareReport(gpus=gpus, gpu_error=err, host=host, nvml_version=ver)
