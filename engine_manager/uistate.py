"""Small persisted UI state (window geometry, splitter sizes, last tab, plot window...).

A plain JSON object in the config dir, written atomically with mode 0600. Qt-free: the GUI stores opaque
strings (base64 of ``saveGeometry()``) and lists of ints here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import paths
from .atomic import atomic_write_json, move_aside, read_json_capped
from .figures import measured_int

MAX_BYTES = 1 << 20         # a few window states and choices take a few kB; a larger file is not this panel's
# the parts of the window's control column filled after its first paint (the hardware probe's report, the saved
# connections' list), whose heights are kept for the next start (pixels, within these bounds)
COLUMN_PARTS = ("banner", "watching")
COLUMN_HEIGHT_BOUNDS = (1, 2000)


def state_file() -> Path:
    return paths.config_dir() / "ui_state.json"


def load() -> dict[str, Any]:
    p = state_file()
    try:            # never through a link, a regular file only, at most MAX_BYTES
        data = read_json_capped(p, MAX_BYTES)
        return data if isinstance(data, dict) else {}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError):     # (100,000 nested brackets raise RecursionError)
        try:
            move_aside(p, "corrupt")
        except OSError:
            pass
        return {}


def save(update: dict[str, Any]) -> None:
    data = load()
    data.update(update)
    atomic_write_json(state_file(), data)


# ---- the main window, per screen ------------------------------------------------------------------------------
WINDOWS_KEY = "windows"          # {screen key: {"geometry": base64, "splitter": [ints], "saved_at": epoch s}}
WINDOWS_KEPT = 8                 # screens remembered (the most recently used)


def screen_key(name: str, width: int, height: int) -> str:
    """Which screen a window state belongs to: its name and size (a laptop panel and the monitor beside it, or
    the same connector at another resolution, each keep their own window)."""
    return f"{(name or 'screen').strip()[:80]}:{int(width)}x{int(height)}"


def window_state(key: str) -> dict[str, Any]:
    """The window state saved for the screen ``key`` (empty when none): only well-formed values."""
    entry = (load().get(WINDOWS_KEY) or {})
    entry = entry.get(key) if isinstance(entry, dict) else None
    if not isinstance(entry, dict):
        return {}
    out: dict[str, Any] = {}
    if isinstance(entry.get("geometry"), str) and len(entry["geometry"]) < 4096:
        out["geometry"] = entry["geometry"]
    sp = entry.get("splitter")
    if isinstance(sp, list) and 0 < len(sp) <= 8 and all(isinstance(s, int) and 0 <= s < 100_000 for s in sp):
        out["splitter"] = list(sp)
    return out


def save_window_state(key: str, geometry: str, splitter: list[int], now: float | None = None) -> None:
    """Remember the window for the screen ``key``; the least recently saved screens beyond
    :data:`WINDOWS_KEPT` are forgotten."""
    import time

    windows = load().get(WINDOWS_KEY)
    windows = dict(windows) if isinstance(windows, dict) else {}
    windows[key] = {"geometry": geometry, "splitter": [int(s) for s in splitter],
                    "saved_at": time.time() if now is None else now}

    def when(k: str) -> float:
        v = windows[k].get("saved_at") if isinstance(windows[k], dict) else None
        return float(v) if isinstance(v, (int, float)) else 0.0
    keep = sorted(windows, key=when, reverse=True)[:WINDOWS_KEPT]
    save({WINDOWS_KEY: {k: windows[k] for k in keep}})


def fit_rect(size: tuple[int, int], available: tuple[int, int, int, int],
             frame: tuple[int, int] = (0, 0)) -> tuple[int, int, int, int]:
    """A window of ``size`` (width, height, without its frame) fitted to the screen's ``available`` area (x, y,
    width, height: the screen less panels and docks) and centred in it; ``frame`` is what the window manager adds
    around it (width, height). Returns the window's (x, y, width, height) without the frame."""
    ax, ay, aw, ah = available
    fw, fh = frame
    w = max(1, min(int(size[0]), aw - fw))
    h = max(1, min(int(size[1]), ah - fh))
    x = ax + max(0, (aw - fw - w) // 2)
    y = ay + max(0, (ah - fh - h) // 2)
    return x, y, w, h


def column_heights(state: dict[str, Any]) -> dict[str, int]:
    """The kept heights of the control column's parts (``state["column_heights"]``) that are sane: a known part, a
    whole number of pixels within :data:`COLUMN_HEIGHT_BOUNDS` (``figures.measured_int``); anything else is left
    out."""
    kept = state.get("column_heights")
    if not isinstance(kept, dict):
        return {}
    lo, hi = COLUMN_HEIGHT_BOUNDS
    sane = {k: measured_int(v, lo, hi) for k, v in kept.items() if k in COLUMN_PARTS}
    return {k: v for k, v in sane.items() if v is not None}
