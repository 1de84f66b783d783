"""Placeholder until its issue lands: keeps the main window's arrangement final from the start."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget


class EnginePanel(QWidget):
    def __init__(self, ctx, parent=None):
        super().__init__(parent)
        self.ctx = ctx
        lay = QVBoxLayout(self)
        label = QLabel("Engine controls (start, stop, readiness) arrive with the supervisor.")
        label.setAlignment(Qt.AlignmentFlag.AlignCenter)
        label.setWordWrap(True)
        lay.addWidget(label)
