"""The doctor's verdicts as a table (pass / warn / fail with the figure and what to do), for the Engine ▸ Check
this machine dialog and the first-run wizard."""

from __future__ import annotations

import html

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QLabel,
    QPushButton,
    QScrollArea,
    QVBoxLayout,
)

from engine_manager import doctor

MARKS = {"pass": ("✓", "#1b7f2a"), "warn": ("!", "#9a6a00"), "fail": ("✗", "#b3261e"), "info": ("i", "#1f5fa8")}


def verdicts_html(vs: list[doctor.Verdict]) -> str:
    rows = []
    for v in vs:
        mark, color = MARKS.get(v.status, ("?", "black"))
        advice = html.escape(v.advice) if v.status != "pass" else ""
        rows.append(f"<tr><td style='color:{color}; font-weight:bold; padding-right:6px'>{mark}</td>"
                    f"<td style='padding-right:10px'><b>{html.escape(v.title)}</b></td>"
                    f"<td style='padding-right:10px'>{html.escape(v.figure)}</td><td>{advice}</td></tr>")
    return ("<table cellspacing='0' cellpadding='3'><tr><th></th><th align='left'>Requirement</th>"
            "<th align='left'>Found</th><th align='left'>What to do</th></tr>" + "".join(rows) + "</table>")


def summary_text(vs: list[doctor.Verdict]) -> str:
    s = doctor.summary(vs)
    return f"{s['pass']} passed, {s['warn']} warning(s), {s['fail']} failed."


class DoctorDialog(QDialog):
    def __init__(self, report, settings, parent=None):
        super().__init__(parent)
        self.setWindowTitle("This machine against DeepSeek-V4.1-Flash's needs")
        self.resize(900, 460)
        self.verdicts = doctor.verdicts(report, settings)
        self.text = doctor.render_text(report, self.verdicts)
        lay = QVBoxLayout(self)
        head = QLabel(html.escape(self.text.split("\n\n", 1)[0]).replace("\n", "<br>"))
        head.setTextFormat(Qt.TextFormat.RichText)
        head.setWordWrap(True)
        lay.addWidget(head)
        self.table = QLabel(verdicts_html(self.verdicts))
        self.table.setObjectName("doctorVerdicts")
        self.table.setTextFormat(Qt.TextFormat.RichText)
        self.table.setWordWrap(True)
        self.table.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
        self.table.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setWidget(self.table)
        lay.addWidget(scroll, 1)
        lay.addWidget(QLabel(summary_text(self.verdicts)))
        bb = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        copy = QPushButton("Copy as text")
        copy.setToolTip("The same report as `dsv41 doctor` prints")
        copy.clicked.connect(self._copy)
        bb.addButton(copy, QDialogButtonBox.ButtonRole.ActionRole)
        bb.rejected.connect(self.reject)
        lay.addWidget(bb)

    def _copy(self) -> None:
        from PySide6.QtGui import QGuiApplication
        QGuiApplication.clipboard().setText(self.text)
