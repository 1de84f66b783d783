"""The shared state of the window's parts: settings, the hardware probe, and signals that connect the panels.

Panels never reach into each other; they talk through one ``AppContext``.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QObject, Signal

from engine_manager.hardware import HardwareReport
from engine_manager.settings import LoadedSettings, resolve_engine, save_settings


class AppContext(QObject):
    settingsChanged = Signal(object)        # LoadedSettings
    hardwareChanged = Signal(object)        # HardwareReport
    planChanged = Signal(object)            # the placement plan (dict) or None
    engineStateChanged = Signal(object)     # the supervisor's state event
    engineLog = Signal(object)              # engine_manager.supervisor.LogLines: new engine log lines (batched)
    engineReady = Signal(str, str)          # base_url, api_key
    engineStopped = Signal()
    sampleArrived = Signal(object)          # engine_manager.engines.base.Sample
    statusMessage = Signal(str, int)        # text, timeout ms
    requestStart = Signal()                 # any panel may ask the engine panel to start the engine
    requestTab = Signal(str)                # ask the main window to show a tab by name

    def __init__(self, loaded: LoadedSettings, hardware: HardwareReport | None = None, parent=None):
        super().__init__(parent)
        self.loaded = loaded
        self.hardware = hardware
        self.plan: dict[str, Any] | None = None
        self.base_url: str | None = None
        self.api_key: str | None = None
        self.supervisor = None              # set by the engine panel

    @property
    def settings(self):
        return self.loaded.settings

    @property
    def has_gpu(self) -> bool:
        return bool(self.hardware and self.hardware.has_gpu)

    def engine_name(self) -> str:
        return resolve_engine(self.settings, self.has_gpu)

    def update_settings(self, updates: dict[str, Any]) -> LoadedSettings:
        self.loaded = save_settings(self.loaded, updates)
        self.settingsChanged.emit(self.loaded)
        return self.loaded

    def set_hardware(self, report: HardwareReport) -> None:
        self.hardware = report
        self.hardwareChanged.emit(report)

    def set_plan(self, plan: dict[str, Any] | None) -> None:
        self.plan = plan
        self.planChanged.emit(plan)

    def set_ready(self, base_url: str | None, api_key: str | None) -> None:
        self.base_url, self.api_key = base_url, api_key
        if base_url and api_key:
            self.engineReady.emit(base_url, api_key)
        else:
            self.engineStopped.emit()
