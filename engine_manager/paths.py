"""Where the panel keeps its files.

- config dir (settings.json and its backups): ``DSV41_CONFIG_DIR`` or the platform config dir.
- data dir (engine state file, logs, metric recordings, chat history, plans): ``DSV41_DATA_DIR`` or the
  platform data dir.
- cache dir (model shards, engine releases): the ``cache_dir`` setting (``DSV41_CACHE_DIR``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import platformdirs

APP_NAME = "dsv41-panel"


def config_dir() -> Path:
    env = os.environ.get("DSV41_CONFIG_DIR")
    return Path(env).expanduser() if env else Path(platformdirs.user_config_dir(APP_NAME))


def data_dir() -> Path:
    env = os.environ.get("DSV41_DATA_DIR")
    return Path(env).expanduser() if env else Path(platformdirs.user_data_dir(APP_NAME))


def settings_file() -> Path:
    return config_dir() / "settings.json"


def logs_dir() -> Path:
    return data_dir() / "logs"


def runs_dir() -> Path:
    return data_dir() / "runs"


def resources_dir() -> Path:
    """The ``resources/`` folder: beside the source tree, else under ``<prefix>/share/dsv41-panel``."""
    if getattr(sys, "frozen", False):  # a PyInstaller bundle (packaging/dsv41-panel.spec)
        return Path(getattr(sys, "_MEIPASS", Path(sys.executable).parent)) / "resources"
    here = Path(__file__).resolve().parent.parent / "resources"
    if here.is_dir():
        return here
    shared = Path(sys.prefix) / "share" / APP_NAME / "resources"
    return shared
