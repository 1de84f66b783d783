"""Small persisted UI state (window geometry, splitter sizes, last tab, plot window...).

A plain JSON object in the config dir, written atomically with mode 0600. Qt-free: the GUI stores opaque
strings (base64 of ``saveGeometry()``) and lists of ints here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from . import paths
from .atomic import atomic_write_json, move_aside


def state_file() -> Path:
    return paths.config_dir() / "ui_state.json"


def load() -> dict[str, Any]:
    p = state_file()
    try:
        data = json.loads(p.read_text())
        return data if isinstance(data, dict) else {}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        try:
            move_aside(p, "corrupt")
        except OSError:
            pass
        return {}


def save(update: dict[str, Any]) -> None:
    data = load()
    data.update(update)
    atomic_write_json(state_file(), data)
