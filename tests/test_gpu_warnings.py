"""GPU warnings (engine_manager.gpu_warnings): the hysteresis over sequences of readings (pure logic: raised only
after N readings over in a row, cleared only after M readings below a lower threshold, so a reading that wavers
never flaps), thresholds relative to the card's own limits, the NVML reading path on this machine (no GPU: a calm
reason and no warning; on a GPU machine: real figures), `dsv41 status --json`'s "warnings", and the status bar's
amber label."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine_manager import gpu_warnings as gw
from engine_manager.gpu_warnings import GpuReading, GpuWarnings, GpuWatch

ROOT = Path(__file__).resolve().parents[1]


def temps(*values, slowdown=90.0, index=0):
    return [GpuReading(index, temp_c=t, slowdown_c=slowdown, shutdown_c=95.0) for t in values]


def run(hyst: GpuWarnings, readings) -> list[list[str]]:
    """The active warnings' keys after each reading."""
    return [[w.key for w in hyst.feed([r], t=float(i))] for i, r in enumerate(readings)]


def test_temperature_raises_after_three_in_a_row_and_clears_after_five_below_the_lower_threshold():
    h = GpuWarnings()
    # over = slowdown − 5 = 85 °C; a reading under it breaks the run
    seen = run(h, temps(80, 86, 86, 84, 86, 86))
    assert all(s == [] for s in seen)
    assert run(h, temps(86)) == [["temperature"]]
    w = h.active[0]
    assert w.gpu == 0 and "90 °C" in w.meaning and "slows itself down" in w.meaning and "95 °C" in w.meaning
    assert "86 °C" in w.title and "fans" in w.fix and "nothing is stopped" in w.fix
    # 84 °C is below the raise threshold but not below the clear one (90 − 8 = 82): it stays
    assert run(h, temps(84, 83, 84, 83, 84, 83, 84)) == [["temperature"]] * 7
    # four below, one back in the band: the count starts over
    assert run(h, temps(81, 81, 81, 81, 83, 81, 81, 81, 81)) == [["temperature"]] * 9
    assert run(h, temps(81)) == [[]]


def test_a_wavering_reading_never_flaps():
    h = GpuWarnings()
    assert all(s == [] for s in run(h, temps(*([86, 80] * 30))))           # never three over in a row
    run(h, temps(86, 86, 86))
    assert all(s == ["temperature"] for s in run(h, temps(*([81, 84] * 30))))   # never five below in a row


def test_power_needs_fifteen_readings_at_98_percent_of_the_enforced_limit():
    h = GpuWarnings()

    def power(*watts):
        return [GpuReading(0, power_w=p, power_limit_w=700.0) for p in watts]

    assert run(h, power(*[690] * 14)) == [[]] * 14                          # 98.6 %, 14 times (28 s in the bar)
    assert run(h, power(690)) == [["power"]]
    w = h.active[0]
    assert "690 of 700 W" in w.title and "nvidia-smi -q -d POWER" in w.fix
    assert run(h, power(660, 640, 640, 640, 640)) == [["power"]] * 5        # 94 % is not below 93 %
    assert run(h, power(640)) == [[]]
    # the limit is the card's: the same 690 W is nothing on a 1000 W card
    assert run(GpuWarnings(), [GpuReading(0, power_w=690.0, power_limit_w=1000.0)] * 10) == [[]] * 10


def test_clock_slowdown_reasons():
    def reasons(mask, n):
        return [GpuReading(0, reasons=mask)] * n

    h = GpuWarnings()
    assert run(h, reasons(gw.SW_POWER_CAP, 10)) == [[]] * 10               # at its power cap: the power rule's
    assert run(h, reasons(gw.HW_THERMAL | gw.HW_SLOWDOWN, 3))[-1] == ["thermal_slowdown"]
    h = GpuWarnings()
    assert run(h, reasons(gw.HW_POWER_BRAKE, 3))[-1] == ["power_brake"]
    assert "power cables" in h.active[0].fix
    assert run(h, reasons(0, 4))[-1] == ["power_brake"] and run(h, reasons(0, 1)) == [[]]
    h = GpuWarnings()
    assert run(h, reasons(gw.SW_THERMAL, 3))[-1] == ["thermal_slowdown"]


def test_missing_figures_move_nothing_and_no_limit_means_no_guess():
    h = GpuWarnings()
    run(h, temps(86, 86))
    run(h, [GpuReading(0, temp_c=None, slowdown_c=90.0)])                    # not read: the run goes on
    assert run(h, temps(86)) == [["temperature"]]
    run(h, [GpuReading(0)] * 20)                                              # nothing read: nothing cleared
    assert [w.key for w in h.active] == ["temperature"]
    # no threshold from NVML: no temperature warning at any temperature
    assert run(GpuWarnings(), temps(120, 120, 120, 120, slowdown=None)) == [[]] * 4
    # the top of normal operation when the slowdown threshold is not given
    h = GpuWarnings()
    run(h, [GpuReading(0, temp_c=84.0, max_operating_c=87.0)] * 3)
    assert "normal operating range" in h.active[0].meaning


def test_each_gpu_has_its_own_history():
    h = GpuWarnings()
    for i in range(3):
        h.feed([*temps(86, index=0), *temps(70, index=1)], t=float(i))
    assert [(w.gpu, w.key) for w in h.active] == [(0, "temperature")]
    assert h.active[0].title.startswith("GPU 0 ")


def test_status_burst_reads_as_many_times_as_the_slowest_rule_needs():
    reads, sleeps = [], []

    def read():
        reads.append(1)
        return [GpuReading(0, power_w=699.0, power_limit_w=700.0)], None

    report = gw.status_report(interval_s=0.01, sleep=sleeps.append, read=read)
    # the power rule's 15 readings are capped at the burst's 5: every one of them at the limit
    assert [w.key for w in report.warnings] == ["power"] and len(reads) == 5 and sleeps == [0.01] * 4
    assert report.to_dict()["warnings"][0]["title"].startswith("GPU 0 at its power limit")
    spike = iter([699.0, 500.0, 699.0, 699.0, 699.0])
    report = gw.status_report(interval_s=0.01, sleep=lambda _s: None,
                              read=lambda: ([GpuReading(0, power_w=next(spike), power_limit_w=700.0)], None))
    assert report.warnings == []


def test_the_nvml_path_here():
    """This machine's NVML (the real library lookup): without a GPU, a calm reason and no warning, at once."""
    readings, note = gw.read_gpus()
    if readings:  # pragma: no cover - only on a GPU machine
        r = readings[0]
        assert r.temp_c is not None and 0 < r.temp_c < 120 and r.power_limit_w and r.power_limit_w > 50
        assert r.slowdown_c is None or r.slowdown_c > 50
        return
    assert note and note.startswith("no NVIDIA GPU: ") and "Traceback" not in note
    slept = []
    report = gw.status_report(sleep=slept.append)
    assert report.warnings == [] and report.note == note and slept == []
    assert GpuWatch().poll().warnings == []


def test_dsv41_status_json_has_warnings():
    cp = subprocess.run([sys.executable, "-m", "engine_manager", "status", "--json"], capture_output=True,
                        text=True, timeout=60, cwd=str(ROOT))
    assert cp.returncode == 0, cp.stderr
    st = json.loads(cp.stdout)
    assert isinstance(st["warnings"], list)
    if st["warnings_note"] is not None and st["warnings_note"].startswith("no NVIDIA GPU"):
        assert st["warnings"] == []
        assert "warning:" not in subprocess.run([sys.executable, "-m", "engine_manager", "status"],
                                                capture_output=True, text=True, timeout=60, cwd=str(ROOT)).stdout


@pytest.mark.gui
def test_the_status_bar_shows_active_warnings_in_amber(app_ctx, shown, qtbot):
    from app.statusbar import LiveStatusBar

    script = [[GpuReading(0, temp_c=87.0, slowdown_c=90.0)]] * 3 + [[GpuReading(0, temp_c=70.0, slowdown_c=90.0)]] * 5
    bar = LiveStatusBar(app_ctx)
    bar.timer.stop()
    bar.gpu_watch = GpuWatch(read=lambda: (script.pop(0), None))
    shown(bar, 900, 30)
    for i in range(3):
        bar.show_warnings(bar.gpu_watch.poll(t=float(i)))
    assert bar.warning_label.isVisible()
    assert bar.warning_label.text() == "⚠ GPU 0 is hot (87 °C)"
    assert "#fff4e5" in bar.warning_label.styleSheet()
    tip = bar.warning_label.toolTip()
    assert "It is within 3 °C of 90 °C" in tip and "fans" in tip
    for _ in range(4):
        bar.show_warnings(bar.gpu_watch.poll())
        assert bar.warning_label.isVisible()                  # cleared only after five readings below
    bar.show_warnings(bar.gpu_watch.poll())
    assert not bar.warning_label.isVisible() and bar.warnings == []
    # this machine's own reading through the bar's worker: no GPU, no label
    bar.gpu_watch = GpuWatch()
    bar.refresh()
    qtbot.waitUntil(lambda: not bar.tasks.running("read"), timeout=10000)
    if not gw.read_gpus()[0]:
        assert not bar.warning_label.isVisible()
