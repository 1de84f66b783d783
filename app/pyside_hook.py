"""A cheaper answer to PySide6's question "does this module use PySide6?", asked of every module imported after
PySide6 is (its ``__feature__`` support, ``shibokensupport.feature._mod_uses_pyside``). PySide6 answers with
``inspect.getsource`` and a search for "PySide6"; reading the file's bytes gives the same answer for a ``.py`` file
without ``inspect``'s line splitting. Measured on the panel's start (cProfile of ``MainWindow.build_pages``, 2-core
machine): 646 modules, 0.19 s through ``inspect.getsource``; see benchmarks/results/startup.md."""

from __future__ import annotations

import sys
from types import ModuleType

_MAX_SOURCE = 8 << 20       # a source file larger than this is left to PySide6's own check


def install() -> bool:
    """Replace the check once PySide6 is imported; False when this PySide6 has no such check (nothing done)."""
    feature = sys.modules.get("shibokensupport.feature") or sys.modules.get("PySide6.support.feature")
    original = getattr(feature, "_mod_uses_pyside", None)
    if feature is None or original is None or getattr(original, "dsv41_cheap", False):
        return False

    def uses_pyside(module: ModuleType) -> bool:
        path = getattr(module, "__file__", None)
        if not isinstance(path, str) or not path.endswith(".py"):
            return bool(original(module))
        try:
            with open(path, "rb") as f:
                data = f.read(_MAX_SOURCE + 1)
        except OSError:
            return bool(original(module))
        if len(data) > _MAX_SOURCE:
            return bool(original(module))
        return b"PySide6" in data

    uses_pyside.dsv41_cheap = True  # type: ignore[attr-defined]
    uses_pyside.__wrapped__ = original  # type: ignore[attr-defined]
    feature._mod_uses_pyside = uses_pyside  # type: ignore[attr-defined]
    return True
