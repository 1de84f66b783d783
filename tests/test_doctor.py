"""Doctor verdicts: this machine (no GPU), the real H200 probe, and the CLI's exit codes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from engine_manager import doctor
from engine_manager.hardware import HardwareReport
from engine_manager.settings import Settings

GB = 10**9


def _run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "engine_manager", *args], capture_output=True, text=True,
                          env=env or os.environ.copy(), timeout=60)


def _by_id(vs):
    return {v.id: v for v in vs}


def test_h200_fixture_verdicts(data_dir):
    saved = json.loads((data_dir / "doctor-h200.json").read_text())
    report = HardwareReport.from_dict(saved["hardware"])
    vs = _by_id(doctor.verdicts(report, Settings()))
    assert vs["gpu"].status == "pass" and "143,771 MiB" in vs["gpu"].figure
    assert vs["driver"].status == "pass" and "580.159.04" in vs["driver"].figure
    assert vs["arch"].status == "warn" and "sm_90" in vs["arch"].figure
    assert vs["pcie"].status == "pass" and "gen5 x16" in vs["pcie"].figure
    assert vs["ram"].status == "fail"          # 126 GiB against ~280 GB
    assert vs["numa"].status == "pass" and "one NUMA node" in vs["numa"].figure
    # the verdicts the machine itself printed are the ones we compute from its probe today
    assert {v["id"]: v["status"] for v in saved["verdicts"]} == {k: v.status for k, v in vs.items()}


def test_verdict_thresholds(data_dir):
    raw = json.loads((data_dir / "doctor-h200.json").read_text())["hardware"]
    raw["host"]["ram_total_bytes"] = 300 * GB
    raw["host"]["disk_free_bytes"] = 100 * GB
    raw["gpus"][0]["driver_version"] = "575.51.03"
    raw["gpus"][0]["vram_total_bytes"] = 48 * 2**30
    raw["gpus"][0]["numa_node"] = None
    raw["gpus"][0]["numa_node_source"] = "unknown"
    vs = _by_id(doctor.verdicts(HardwareReport.from_dict(raw), Settings()))
    assert vs["ram"].status == "pass"
    assert vs["disk"].status == "fail" and "DSV41_CACHE_DIR" in vs["disk"].advice
    assert vs["driver"].status == "fail" and "580.65" in vs["driver"].advice
    assert vs["gpu"].status == "warn"
    assert vs["numa"].status == "warn" and "nvidia-smi topo -m" in vs["numa"].advice


def test_doctor_json_here_reports_no_gpu_with_reason():
    r = _run("doctor", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    if out["hardware"]["gpus"]:  # pragma: no cover - only on a GPU machine
        return
    assert out["hardware"]["gpu_error"]
    gpu = next(v for v in out["verdicts"] if v["id"] == "gpu")
    assert gpu["status"] == "fail" and out["hardware"]["gpu_error"] in gpu["figure"]
    assert out["settings"]["api_key"].endswith("chars)")  # masked


def test_doctor_from_h200_fixture_reports_that_gpu(data_dir):
    r = _run("doctor", "--from-json", str(data_dir / "doctor-h200.json"))
    assert r.returncode == 0, r.stderr
    assert "NVIDIA H200" in r.stdout and "143,771 MiB" in r.stdout and "[PASS]" in r.stdout


def test_bad_setting_exits_2_naming_variable_and_range():
    r = _run("doctor", env=dict(os.environ, DSV41_DEFAULT_MAX_TOKENS="-5"))
    assert r.returncode == 2
    assert "DSV41_DEFAULT_MAX_TOKENS" in r.stderr and "1 to 1048576" in r.stderr


def _counts(text: str) -> tuple[int, int, int]:
    """(passed, warnings, failed) from the summary line."""
    m = re.search(r"^(\d+) passed, (\d+) warnings, (\d+) failed$", text, re.M)
    assert m, text
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def _marks(text: str) -> tuple[int, int, int]:
    lines = text.splitlines()
    return tuple(sum(ln.startswith(f"[{s}]") for ln in lines) for s in ("PASS", "WARN", "FAIL"))


def test_doctor_reports_even_when_things_fail(data_dir, tmp_path):
    raw = json.loads((data_dir / "doctor-h200.json").read_text())
    raw["hardware"]["host"]["ram_total_bytes"] = 16 * GB
    raw["hardware"]["gpus"][0]["driver_version"] = "535.54.03"
    weak = tmp_path / "weak.json"
    weak.write_text(json.dumps(raw))
    r = _run("doctor", "--from-json", str(weak))
    assert r.returncode == 0, r.stderr
    fails = [ln for ln in r.stdout.splitlines() if ln.startswith("[FAIL]")]
    assert any("RAM" in ln and "16" in ln for ln in fails) and any("driver" in ln and "535.54.03" in ln for ln in fails)
    assert _counts(r.stdout) == _marks(r.stdout) and _counts(r.stdout)[2] >= 2
    # this machine, whatever it has: exit 0 and a summary that counts the verdicts printed
    r = _run("doctor")
    assert r.returncode == 0, r.stderr
    assert _counts(r.stdout) == _marks(r.stdout) and sum(_marks(r.stdout)) >= 5


def test_from_json_missing_or_malformed_is_a_plain_error(tmp_path):
    missing = tmp_path / "nope.json"
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"verdicts": []}))
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"hardware": {"gpus": []}}))
    for f, words in [(missing, "file not found"), (bad, "not a JSON file"), (other, 'no "hardware" object'),
                     (broken, "the saved probe is incomplete or damaged (no 'host' in it)")]:
        r = _run("doctor", "--from-json", str(f))
        assert r.returncode == 1, (f, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr
        assert r.stderr.startswith(f"dsv41: {f}: {words}") and "dsv41 doctor --json" in r.stderr
