"""The hardware probe: no-GPU path on this machine (real NVML library lookup), the JSON round trip of a real H200
probe, and sysfs NUMA parsing on a real directory tree."""

from __future__ import annotations

import json

from engine_manager import hardware
from engine_manager.hardware import HardwareReport, format_cpulist, parse_cpulist, sysfs_bus_id


def test_no_gpu_is_a_result_with_a_reason(tmp_path):
    report = hardware.probe(tmp_path)
    if report.has_gpu:  # pragma: no cover - only on a GPU machine
        assert report.gpu_error is None
        return
    assert report.gpus == []
    assert report.gpu_error and ("NVIDIA" in report.gpu_error or "NVML" in report.gpu_error)
    assert report.host.ram_total_bytes > 0 and report.host.cores_logical >= 1
    assert report.host.numa_nodes and report.host.numa_nodes[0].cpus
    assert report.host.disk_free_bytes and report.host.disk_free_bytes > 0


def test_report_round_trips_through_json(data_dir):
    raw = json.loads((data_dir / "doctor-h200.json").read_text())["hardware"]
    report = HardwareReport.from_dict(raw)
    g = report.gpu(0)
    assert g.name == "NVIDIA H200" and g.vram_total_bytes // 2**20 == 143_771
    assert g.pci_bus_id == "00000000:00:06.0"
    assert HardwareReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report


def test_cpulists():
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert format_cpulist([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    assert parse_cpulist("") == []


def test_bus_id_nvml_to_sysfs():
    assert sysfs_bus_id("00000000:00:06.0") == "0000:00:06.0"
    assert sysfs_bus_id("00000000:3B:00.0") == "0000:3b:00.0"


def test_numa_nodes_from_a_sysfs_tree(tmp_path):
    base = tmp_path / "devices" / "system" / "node"
    for n, cpus, kb in [(0, "0-7", 1000), (1, "8-15", 2000)]:
        d = base / f"node{n}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
        (d / "meminfo").write_text(f"Node {n} MemTotal:       {kb} kB\nNode {n} MemFree:        {kb // 2} kB\n")
    nodes = hardware.numa_nodes(tmp_path)
    assert [(x.id, x.cpus[0], x.cpus[-1], x.mem_total_bytes) for x in nodes] == [
        (0, 0, 7, 1000 * 1024), (1, 8, 15, 2000 * 1024)]
    pci = tmp_path / "bus" / "pci" / "devices" / "0000:00:06.0"
    pci.mkdir(parents=True)
    (pci / "numa_node").write_text("1\n")

    class NoNumaNvml:  # the sysfs fallback only needs a module-like object without nvmlDeviceGetNumaNodeId
        pass

    assert hardware._gpu_numa(NoNumaNvml(), None, "00000000:00:06.0", nodes, tmp_path) == (1, "sysfs")
    (pci / "numa_node").write_text("-1\n")
    assert hardware._gpu_numa(NoNumaNvml(), None, "00000000:00:06.0", nodes, tmp_path) == (None, "unknown")
    assert hardware._gpu_numa(NoNumaNvml(), None, "00000000:00:06.0", nodes[:1], tmp_path) == (0, "single-node")


def test_nvml_errors_become_reasons():
    """Every NVML failure is worded as a reason (the probe never lets one escape). The exceptions are pynvml's own
    classes, made the way pynvml raises them (NVMLError(code) picks the subclass)."""
    import pynvml
    lost = pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
    assert type(lost).__name__ == "NVMLError_GpuIsLost"
    r = hardware.nvml_reason(lost, "GPU 1")
    assert r.startswith("GPU 1: ") and "fallen off the bus" in r and "reboot" in r
    perm = hardware.nvml_reason(pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION), "GPU 0")
    assert "permission" in perm and "/dev/nvidia" in perm
    # an error without words of its own still names NVML and its code or text
    other = hardware.nvml_reason(pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN), "counting the GPUs")
    assert other.startswith("counting the GPUs: NVML error (") and other.endswith(")")
    odd = hardware.nvml_reason(AttributeError("no busId"), "PCI bus id")
    assert odd == "PCI bus id: unexpected answer (AttributeError: no busId)"


def test_gpu_reason_says_which_gpus_were_left_out():
    lost = hardware.nvml_reason(OSError("gone"), "GPU 1")
    assert hardware.gpu_reason(2, 2, []) is None
    assert hardware.gpu_reason(0, 0, []) == "the NVIDIA driver is loaded but reports no GPU"
    some = hardware.gpu_reason(2, 1, [lost])
    assert some.startswith("1 of 2 GPUs could not be read") and lost in some
    none = hardware.gpu_reason(1, 0, [lost])
    assert none.startswith("NVML counts 1 GPU(s) but none could be read") and lost in none


def test_a_gpu_error_survives_the_json_round_trip(data_dir):
    raw = json.loads((data_dir / "doctor-h200.json").read_text())["hardware"]
    assert "error" not in raw["gpus"][0]                       # probes saved before the field still load
    report = HardwareReport.from_dict(raw)
    assert report.gpu(0).error is None
    report.gpus[0].error = "UUID: NVML error (Unknown Error)"
    again = HardwareReport.from_dict(json.loads(json.dumps(report.to_dict())))
    assert again.gpu(0).error == "UUID: NVML error (Unknown Error)"


# ------------------------------------------------------------------------------------------------ engine_manager.nvml
def test_one_nvml_wrapper_for_the_probe_the_status_bar_and_the_monitor():
    """hardware.probe, sysstat.read and the Monitor's NvmlSource all go through engine_manager.nvml, so they agree:
    with no driver all three say so in the same plain words; with a GPU all three read the same device."""
    from engine_manager import nvml, sysstat
    from engine_manager.metrics.sources import NvmlSource

    report = hardware.probe()
    shared, why = nvml.shared()
    assert nvml.shared() == (shared, why)            # initialised once, kept
    st = sysstat.read()
    src = NvmlSource(0)
    try:
        if shared is None:
            assert why and report.gpu_error == why and "Traceback" not in why
            assert st.gpus == [] and st.gpu_error == f"no NVIDIA GPU: {why}"
            assert src.unavailable == f"no NVIDIA GPU: {why}"
            try:
                with nvml.session():
                    raise AssertionError("NVML started where the probe found no driver")
            except nvml.NvmlUnavailable as exc:
                assert str(exc) == why
            return
        # a GPU machine: the probe, the status bar and the monitor see the same GPU 0
        assert report.gpus and len(st.gpus) == len(report.gpus) == nvml.device_count(shared)
        g = report.gpu(0)
        assert g.numa_node_source in ("nvml", "sysfs", "nvml-affinity", "single-node", "unknown")
        assert st.gpus[0].vram_total_bytes == g.vram_total_bytes
        assert st.gpus[0].util_pct is not None and 0 <= st.gpus[0].util_pct <= 100
        v = src.read().values
        assert v["nvml_vram_total_bytes"] == g.vram_total_bytes
        assert 0 < v["nvml_vram_used_bytes"] <= v["nvml_vram_total_bytes"]
        assert v["gpu_pcie_gen"] and v["gpu_pcie_gen"] >= 1 and v["gpu_pcie_width"] and v["gpu_pcie_width"] >= 1
        assert v["nvml_pcie_rx_mb_s"] is not None and v["nvml_pcie_rx_mb_s"] >= 0
        # a session inside the monitor's hold and the process-wide one: NVML counts them; all still read
        with nvml.session() as n:
            assert nvml.live_readings(n, nvml.handle(n, 0), ("vram_total_bytes",)) == {
                "vram_total_bytes": float(g.vram_total_bytes)}
        assert src.read().values["nvml_vram_total_bytes"] == g.vram_total_bytes
        assert sysstat.read().gpus[0].vram_total_bytes == g.vram_total_bytes
    finally:
        src.close()


def test_nvml_words_live_in_one_place():
    """hardware's reasons are engine_manager.nvml's (one table of NVML's error classes)."""
    import pynvml

    from engine_manager import nvml

    err = pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
    assert hardware.nvml_reason(err, "GPU 0") == nvml.nvml_reason(err, "GPU 0")
    assert "fallen off the bus" in nvml.nvml_reason(err, "GPU 0")
    assert nvml.start_reason(ImportError("pynvml")).startswith("nvidia-ml-py is not installed")
    lib_missing = pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    assert "libnvidia-ml.so" in nvml.start_reason(lib_missing)
