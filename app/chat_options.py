"""What the chat pane sends: the per-request options form (:class:`OptionsForm`) and the composer
(:class:`Composer`: Enter sends, Shift+Enter starts a new line)."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QGridLayout,
    QPlainTextEdit,
    QSizePolicy,
    QSpinBox,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from engine_manager.chat_events import REASONING_EFFORTS, ChatOptions


class OptionsForm(QWidget):
    """A fold-out line "Options: 2048 tokens · …" and, under it, max tokens, temperature, reasoning effort,
    reproducible and the system prompt. :meth:`options` is what the next request sends; :meth:`apply` shows a
    conversation's (its system prompt included: it is kept with the conversation)."""

    def __init__(self, default_max_tokens: int, parent=None):
        super().__init__(parent)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.setSpacing(4)
        self._max_tokens_touched = False
        self.options_toggle = QToolButton()
        self.options_toggle.setObjectName("chatOptionsToggle")
        self.options_toggle.setCheckable(True)
        self.options_toggle.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.options_toggle.setArrowType(Qt.ArrowType.RightArrow)
        self.options_toggle.setAutoRaise(True)
        lay.addWidget(self.options_toggle)
        self.options_box = QWidget()
        self.options_box.setObjectName("chatOptions")
        og = QGridLayout(self.options_box)
        og.setContentsMargins(16, 0, 0, 0)
        self.max_tokens = QSpinBox()
        self.max_tokens.setObjectName("chatMaxTokens")
        self.max_tokens.setRange(1, 1_048_576)
        self.max_tokens.setValue(default_max_tokens)
        self.max_tokens.setSuffix(" tokens")
        self.max_tokens.setToolTip("Most tokens the answer may have (the default is the default_max_tokens "
                                   "setting, DSV41_DEFAULT_MAX_TOKENS)")
        self.temperature = QDoubleSpinBox()
        self.temperature.setObjectName("chatTemperature")
        self.temperature.setRange(-0.05, 2.0)
        self.temperature.setSingleStep(0.05)
        self.temperature.setDecimals(2)
        self.temperature.setSpecialValueText("engine default")
        self.temperature.setValue(-0.05)
        self.temperature.setToolTip("Sampling temperature; 'engine default' sends none")
        self.effort = QComboBox()
        self.effort.setObjectName("chatEffort")
        self.effort.addItem("engine default", None)
        for e in REASONING_EFFORTS:
            self.effort.addItem(e, e)
        self.effort.setToolTip("reasoning_effort: how long the model thinks before answering")
        self.reproducible = QCheckBox("Reproducible")
        self.reproducible.setObjectName("chatReproducible")
        self.reproducible.setToolTip("strata_reproducible: the same answer whatever else is in the batch "
                                     "(slower)")
        # two narrow columns, so the pane stays usable at its minimum width (300 px)
        self.max_tokens.setPrefix("max ")
        self.temperature.setPrefix("temp ")
        self.temperature.setSpecialValueText("temp: default")
        self.effort.setItemText(0, "reasoning: default")
        for i, e in enumerate(REASONING_EFFORTS, start=1):
            self.effort.setItemText(i, f"reasoning: {e}")
        self.system = QPlainTextEdit()
        self.system.setObjectName("chatSystemPrompt")
        self.system.setPlaceholderText("System prompt (optional): how the model should answer in this "
                                       "conversation")
        self.system.setToolTip("Sent as the first message of every request of this conversation, and kept with "
                               "it; empty sends none")
        self.system.setTabChangesFocus(True)
        line = self.system.fontMetrics().lineSpacing()
        self.system.setFixedHeight(3 * line + 2 * int(self.system.document().documentMargin()) + 4)
        og.addWidget(self.max_tokens, 0, 0)
        og.addWidget(self.temperature, 0, 1)
        og.addWidget(self.effort, 1, 0)
        og.addWidget(self.reproducible, 1, 1)
        og.addWidget(self.system, 2, 0, 1, 2)
        for w in (self.max_tokens, self.temperature, self.effort):
            w.setMinimumWidth(60)
            w.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Fixed)
        self.options_box.setVisible(False)
        lay.addWidget(self.options_box)
        self._update_options_label()
        self.options_toggle.toggled.connect(self._toggle_options)
        for w in (self.max_tokens, self.temperature):
            w.valueChanged.connect(self._update_options_label)
        self.max_tokens.valueChanged.connect(self._max_tokens_edited)
        self.effort.currentIndexChanged.connect(self._update_options_label)
        self.reproducible.toggled.connect(self._update_options_label)
        self.system.textChanged.connect(self._update_options_label)

    def options(self) -> ChatOptions:
        t = self.temperature.value()
        system = self.system.toPlainText()
        return ChatOptions(max_tokens=self.max_tokens.value(), temperature=None if t < 0 else round(t, 2),
                           reasoning_effort=self.effort.currentData(), reproducible=self.reproducible.isChecked(),
                           system=system if system.strip() else None)

    def apply(self, opts: dict[str, Any]) -> None:
        """Show the options stored with a conversation (nothing when it has none)."""
        if not opts:
            return
        o = ChatOptions.from_dict(opts)
        for w in (self.max_tokens, self.temperature, self.effort, self.reproducible, self.system):
            w.blockSignals(True)
        if o.max_tokens:
            self.max_tokens.setValue(o.max_tokens)
        self.temperature.setValue(-0.05 if o.temperature is None else o.temperature)
        idx = self.effort.findData(o.reasoning_effort) if o.reasoning_effort else 0
        self.effort.setCurrentIndex(max(0, idx))
        self.reproducible.setChecked(bool(o.reproducible))
        self.system.setPlainText(o.system or "")
        for w in (self.max_tokens, self.temperature, self.effort, self.reproducible, self.system):
            w.blockSignals(False)
        self._update_options_label()

    def _max_tokens_edited(self, _v: int) -> None:
        self._max_tokens_touched = True

    def set_default_max_tokens(self, value: int) -> None:
        """The default_max_tokens setting changed: follow it, unless the user set max tokens here."""
        if not self._max_tokens_touched:
            self.max_tokens.blockSignals(True)
            self.max_tokens.setValue(value)
            self.max_tokens.blockSignals(False)
            self._update_options_label()

    def _toggle_options(self, on: bool) -> None:
        self.options_box.setVisible(on)
        self.options_toggle.setArrowType(Qt.ArrowType.DownArrow if on else Qt.ArrowType.RightArrow)

    def _update_options_label(self, *_a) -> None:
        o = self.options()
        bits = [f"{o.max_tokens} tokens"]
        if o.temperature is not None:
            bits.append(f"temperature {o.temperature:g}")
        if o.reasoning_effort:
            bits.append(f"reasoning {o.reasoning_effort}")
        if o.reproducible:
            bits.append("reproducible")
        if o.system:
            bits.append("system prompt")
        self.options_toggle.setText("Options: " + " · ".join(bits))


class Composer(QPlainTextEdit):
    """Enter sends, Shift+Enter starts a new line, Esc stops the answer (or cancels an edit)."""

    submitted = Signal()
    escape = Signal()
    MIN_LINES, MAX_LINES = 2, 8

    def __init__(self, parent=None):
        super().__init__(parent)
        self.document().documentLayout().documentSizeChanged.connect(self._fit)
        self._fit()

    def _fit(self, *_a) -> None:
        """Grow with the text from 2 to 8 lines, then scroll."""
        lines = max(1, int(self.document().size().height()))   # a plain-text layout measures in lines
        lines = min(max(lines, self.MIN_LINES), self.MAX_LINES)
        m = self.contentsMargins()
        h = (lines * self.fontMetrics().lineSpacing() + 2 * int(self.document().documentMargin())
             + m.top() + m.bottom() + 2)
        self.setFixedHeight(h)

    def keyPressEvent(self, e):  # noqa: N802 - Qt's name
        if e.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
            mods = e.modifiers()
            if mods & Qt.KeyboardModifier.ShiftModifier:
                self.insertPlainText("\n")
                return
            if not mods & (Qt.KeyboardModifier.AltModifier | Qt.KeyboardModifier.MetaModifier):
                self.submitted.emit()
                return
        if e.key() == Qt.Key.Key_Escape:
            self.escape.emit()
            return
        super().keyPressEvent(e)

