"""The Settings dialog: a form over ``engine_manager.settings.Settings``, validated by the same model and saved
atomically through ``save_settings``. Settings fixed by the environment are shown but locked."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any, Literal

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QCheckBox, QComboBox, QDialog, QDialogButtonBox, QDoubleSpinBox, QFileDialog, QFormLayout, QHBoxLayout,
    QLabel, QLineEdit, QMessageBox, QPushButton, QScrollArea, QSpinBox, QVBoxLayout, QWidget,
)

from engine_manager.settings import (
    Settings, SettingsError, field_allowed, field_env, mask_secret, new_api_key, restart_needed,
)

GROUPS = {
    "Engine": ["server_engine", "host", "port", "api_key", "slots", "context_length", "kv_type", "cpu_numerics",
               "vram_reserve_mib", "gpu_index", "numa_binding", "auto_restart", "desktop_notifications",
               "ready_timeout_s"],
    "Model and files": ["model_dir", "cache_dir", "model_repo", "model_revision", "engine_dir", "llama_server",
                        "llamacpp_model", "engine_manifest", "hf_token"],
    "llama.cpp": ["llamacpp_log_verbosity", "llamacpp_load_mode"],
    "Scripted engine": ["sim_args"],
    "Chat and monitor": ["default_max_tokens", "metrics_hz"],
}


def _literal_choices(annotation: Any) -> list[str] | None:
    if typing.get_origin(annotation) is Literal:
        return [str(a) for a in typing.get_args(annotation)]
    return None


def _bounds(info) -> tuple[float | None, float | None]:
    return info.ge, info.le


class SettingsDialog(QDialog):
    def __init__(self, ctx, parent=None):
        super().__init__(parent)
        self.ctx = ctx
        self.setWindowTitle("Settings")
        self.setMinimumWidth(640)
        self.editors: dict[str, QWidget] = {}
        self.secret_values: dict[str, str] = {}
        self.locked_notes: dict[str, QLabel] = {}
        outer = QVBoxLayout(self)
        self.scroll = scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QScrollArea.Shape.NoFrame)
        inner = QWidget()
        self.inner = inner
        # two columns of groups (Engine | the rest): every setting is in view at 1280×800 without scrolling
        columns = QHBoxLayout(inner)
        columns.setSpacing(24)
        loaded = ctx.loaded
        column_of = {"Engine": 0}
        boxes = [QVBoxLayout(), QVBoxLayout()]
        for group, names in GROUPS.items():
            form_box = boxes[column_of.get(group, 1)]
            title = QLabel(f"<b>{group}</b>")
            form_box.addWidget(title)
            form = QFormLayout()
            form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.ExpandingFieldsGrow)
            form.setVerticalSpacing(6)
            for name in names:
                editor = self._editor(name, getattr(loaded.settings, name))
                info = Settings.model_fields[name]
                tip = f"{info.description}.\nVariable: {field_env(name)}\nAllowed: {field_allowed(name)}"
                field: QWidget = editor
                if loaded.env_locked(name):
                    # greyed alone did not say why: the reason is on screen under the field, and in the tooltip
                    editor.setEnabled(False)
                    why = (f"Locked: set by {field_env(name)} in the environment, which wins over the settings "
                           f"file. Unset {field_env(name)} (and restart the panel) to change it here.")
                    tip = f"{why}\n\n{tip}"
                    field = QWidget()
                    fl = QVBoxLayout(field)
                    fl.setContentsMargins(0, 0, 0, 0)
                    fl.setSpacing(0)
                    fl.addWidget(editor)
                    note = QLabel(f"Locked: set by {field_env(name)} in the environment")
                    note.setObjectName(f"locked_{name}")
                    note.setStyleSheet("QLabel { color: #8a5a00; }")
                    note.setToolTip(why)
                    fl.addWidget(note)
                    field.setToolTip(tip)
                    self.locked_notes[name] = note
                editor.setToolTip(tip)
                self.editors[name] = editor
                label = QLabel(info.title or name.replace("_", " "))
                label.setToolTip(tip)
                form.addRow(label, field)
            form_box.addLayout(form)
            form_box.addSpacing(8)
        for box in boxes:
            box.addStretch(1)
            columns.addLayout(box, 1)
        scroll.setWidget(inner)
        outer.addWidget(scroll, 1)
        self.error_label = QLabel("")
        self.error_label.setObjectName("settingsError")
        self.error_label.setWordWrap(True)
        self.error_label.setStyleSheet("color: #c0392b;")
        outer.addWidget(self.error_label)
        note = QLabel(f"Settings live in {loaded.path} (mode 0600; the last 5 versions are kept in backups/). "
                      "Values set in the environment win and are shown locked.")
        note.setStyleSheet("color: gray;")
        note.setWordWrap(True)
        outer.addWidget(note)
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Save | QDialogButtonBox.StandardButton.Cancel)
        self.buttons.accepted.connect(self.save)
        self.buttons.rejected.connect(self.reject)
        outer.addWidget(self.buttons)
        self._fit_to_screen()

    def _fit_to_screen(self) -> None:
        """The form in full (no scrolling) when the screen has room, else as much of it as the screen allows."""
        screen = (self.parentWidget().screen() if self.parentWidget() is not None else None) or self.screen()
        avail = screen.availableGeometry() if screen is not None else None
        w = max(1000, self.inner.sizeHint().width() + self.scroll.verticalScrollBar().sizeHint().width())
        h = self.inner.sizeHint().height() + 2
        if avail is not None:
            w = min(w, int(avail.width() * 0.92))
            h = min(h, int(avail.height() * 0.92) - 160)       # the buttons, the note and the title bar
        self.scroll.setMinimumSize(w, max(200, h))
        hint = self.sizeHint()             # (adjustSize() would cap it at 2/3 of the screen)
        self.resize(min(hint.width(), avail.width()) if avail is not None else hint.width(),
                    min(hint.height(), avail.height()) if avail is not None else hint.height())

    # -- editors --------------------------------------------------------------------------------------------
    def _editor(self, name: str, value: Any) -> QWidget:
        info = Settings.model_fields[name]
        extra = info.json_schema_extra or {}
        choices = _literal_choices(info.annotation)
        if choices:
            w = QComboBox()
            w.addItems(choices)
            w.setCurrentText(str(value))
            return w
        if info.annotation is bool:
            w = QCheckBox()
            w.setChecked(bool(value))
            return w
        if info.annotation is int:
            w = QSpinBox()
            lo, hi = _bounds(info)
            # Wider than the model's range so that an out-of-range value reaches validation and is explained.
            w.setRange(-2_000_000_000, 2_000_000_000)
            w.setValue(int(value))
            w.setToolTip(f"{lo}–{hi}")
            return w
        if info.annotation is float:
            w = QDoubleSpinBox()
            w.setRange(-1e9, 1e9)
            w.setDecimals(2)
            w.setSingleStep(0.25)
            w.setValue(float(value))
            return w
        if extra.get("secret"):
            self.secret_values[name] = str(value or "")
            box = QWidget()
            lay = QHBoxLayout(box)
            lay.setContentsMargins(0, 0, 0, 0)
            edit = QLineEdit()
            edit.setObjectName(f"edit_{name}")
            edit.setEchoMode(QLineEdit.EchoMode.Password)
            edit.setPlaceholderText(mask_secret(str(value or "")) or "(empty)")
            lay.addWidget(edit, 1)
            if name == "api_key":
                regen = QPushButton("Regenerate")
                regen.clicked.connect(lambda: edit.setText(new_api_key()))
                lay.addWidget(regen)
            box.line_edit = edit  # type: ignore[attr-defined]
            return box
        w = QLineEdit("" if value is None else str(value))
        if "Path" in str(info.annotation):
            box = QWidget()
            lay = QHBoxLayout(box)
            lay.setContentsMargins(0, 0, 0, 0)
            lay.addWidget(w, 1)
            browse = QPushButton("Browse…")
            is_file = name in {"llama_server", "llamacpp_model", "engine_manifest"}
            browse.clicked.connect(lambda: self._browse(w, is_file))
            lay.addWidget(browse)
            box.line_edit = w  # type: ignore[attr-defined]
            return box
        return w

    def _browse(self, edit: QLineEdit, is_file: bool) -> None:
        start = edit.text() or str(Path.home())
        if is_file:
            path, _ = QFileDialog.getOpenFileName(self, "Choose a file", start)
        else:
            path = QFileDialog.getExistingDirectory(self, "Choose a folder", start)
        if path:
            edit.setText(path)

    def value_of(self, name: str) -> Any:
        w = self.editors[name]
        if isinstance(w, QComboBox):
            return w.currentText()
        if isinstance(w, QCheckBox):
            return w.isChecked()
        if isinstance(w, (QSpinBox, QDoubleSpinBox)):
            return w.value()
        edit = getattr(w, "line_edit", w)
        text = edit.text()
        if name in self.secret_values and not text:
            return self.secret_values[name]  # unchanged secret
        return text

    def set_value(self, name: str, value: Any) -> None:
        """Used by tests and by callers that prefill a value."""
        w = self.editors[name]
        if isinstance(w, QComboBox):
            w.setCurrentText(str(value))
        elif isinstance(w, QCheckBox):
            w.setChecked(bool(value))
        elif isinstance(w, (QSpinBox, QDoubleSpinBox)):
            w.setValue(value)
        else:
            getattr(w, "line_edit", w).setText(str(value))

    # -- save -------------------------------------------------------------------------------------------------
    def changes(self) -> dict[str, Any]:
        loaded = self.ctx.loaded
        out: dict[str, Any] = {}
        for name in self.editors:
            if loaded.env_locked(name):
                continue
            new = self.value_of(name)
            old = getattr(loaded.settings, name)
            old_cmp = "" if old is None else (str(old) if isinstance(old, Path) else old)
            if new != old_cmp:
                out[name] = new
        return out

    def save(self) -> None:
        updates = self.changes()
        if not updates:
            self.accept()
            return
        try:
            self.ctx.update_settings(updates)
        except SettingsError as exc:
            self.error_label.setText(str(exc))
            editor = self.editors.get(exc.setting)
            if editor is not None:
                editor.setFocus(Qt.FocusReason.OtherFocusReason)
            return
        self.accept()
        later = restart_needed(updates)
        if later and getattr(self.ctx, "own", None) is not None:      # the panel's own engine runs
            names = ", ".join(later[:-1]) + (" and " if len(later) > 1 else "") + later[-1]
            text = (f"{names} {'takes' if len(later) == 1 else 'take'} effect at the next start of the engine, "
                    "which is running now. Restart it now?")
            self.restart_question = text
            if self.ask_restart(text):
                self.ctx.requestRestart.emit()
            else:
                self.ctx.statusMessage.emit(f"Saved. {names}: at the engine's next start.", 8000)

    def ask_restart(self, text: str) -> bool:
        """"Restart now" or not (a dialog; tests replace this method)."""
        box = QMessageBox(self.parentWidget() or self)
        box.setIcon(QMessageBox.Icon.Question)
        box.setWindowTitle("Restart the engine?")
        box.setText(text)
        yes = box.addButton("Restart now", QMessageBox.ButtonRole.AcceptRole)
        box.addButton("At the next start", QMessageBox.ButtonRole.RejectRole)
        box.setDefaultButton(yes)
        box.exec()
        return box.clickedButton() is yes
