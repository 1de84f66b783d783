"""Light or dark: the window follows the desktop's colour scheme (``QStyleHints.colorScheme``, which the
platform theme reports and updates when the desktop switches), or the choice made in View ▸ Theme, remembered in
the UI state.

Dark is Qt's Fusion style with a dark palette, so it looks the same on every desktop, including one whose Qt
platform theme has no dark palette of its own; light (and "follow the desktop" on a light desktop) puts back the
palette the application started with.
"""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication

from engine_manager import uistate

MODES = {"auto": "Follow the desktop", "light": "Light", "dark": "Dark"}
STATE_KEY = "theme"

_original: dict[str, object] = {}       # the application's own style and palette, before any change


def saved_mode() -> str:
    try:
        mode = uistate.load().get(STATE_KEY)
    except (OSError, ValueError):
        return "auto"
    return mode if mode in MODES else "auto"


def save_mode(mode: str) -> None:
    uistate.save({STATE_KEY: mode})


def desktop_is_dark() -> bool:
    return QGuiApplication.styleHints().colorScheme() == Qt.ColorScheme.Dark


def dark_palette() -> QPalette:
    p = QPalette()
    base, window, text, mid = QColor("#1e2126"), QColor("#2a2e35"), QColor("#e6e8eb"), QColor("#3a3f47")
    roles = {
        QPalette.ColorRole.Window: window, QPalette.ColorRole.WindowText: text,
        QPalette.ColorRole.Base: base, QPalette.ColorRole.AlternateBase: QColor("#252930"),
        QPalette.ColorRole.ToolTipBase: QColor("#353a42"), QPalette.ColorRole.ToolTipText: text,
        QPalette.ColorRole.PlaceholderText: QColor("#9aa0a8"), QPalette.ColorRole.Text: text,
        QPalette.ColorRole.Button: QColor("#343942"), QPalette.ColorRole.ButtonText: text,
        QPalette.ColorRole.BrightText: QColor("#ff6b6b"), QPalette.ColorRole.Light: QColor("#4a505a"),
        QPalette.ColorRole.Midlight: QColor("#40454e"), QPalette.ColorRole.Mid: mid,
        QPalette.ColorRole.Dark: QColor("#16181c"), QPalette.ColorRole.Shadow: QColor("#0b0c0e"),
        QPalette.ColorRole.Highlight: QColor("#3d7bd9"), QPalette.ColorRole.HighlightedText: QColor("#ffffff"),
        QPalette.ColorRole.Link: QColor("#7fb2ff"), QPalette.ColorRole.LinkVisited: QColor("#b59cff"),
    }
    for role, color in roles.items():
        p.setColor(role, color)
    grey = QColor("#7d838c")
    for role in (QPalette.ColorRole.WindowText, QPalette.ColorRole.Text, QPalette.ColorRole.ButtonText):
        p.setColor(QPalette.ColorGroup.Disabled, role, grey)
    return p


def is_dark(mode: str) -> bool:
    return mode == "dark" or (mode == "auto" and desktop_is_dark())


def apply(mode: str, app: QApplication | None = None) -> bool:
    """Give the application the ``mode``'s look ("auto": the desktop's). Returns whether it is dark now."""
    app = app or QApplication.instance()
    if app is None:
        return False
    if not _original:
        _original["palette"] = QPalette(app.palette())
        _original["style"] = app.style().name()
    dark = is_dark(mode)
    if dark:
        app.setStyle("Fusion")
        app.setPalette(dark_palette())
    else:
        if app.style().name() != _original["style"]:
            app.setStyle(str(_original["style"]))
        app.setPalette(_original["palette"])           # type: ignore[arg-type]
    app.setProperty("dsv41_dark", dark)
    return dark


def follow_desktop(mode_of) -> None:
    """Re-apply when the desktop switches between light and dark (``mode_of()``: the mode chosen now)."""
    hints = QGuiApplication.styleHints()
    hints.colorSchemeChanged.connect(lambda _scheme: apply(mode_of()))
