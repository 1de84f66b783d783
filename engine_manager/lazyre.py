"""Regular expressions compiled when first used, not when their module is imported.

The engine adapters (:mod:`engine_manager.engines.strata`, :mod:`engine_manager.engines.llamacpp`) hold some fifty
patterns for their logs; the window's first step imports both adapters (the engine column's choice of engine) and
uses none of the patterns. Compiling them at import was 14 ms of that step (2-core machine, the two modules'
import timed with ``re.compile`` eager, then deferred, four runs each: 35–41 against 22–28 ms). The standard
library compiles only eagerly (``re.compile``) or per call through its cache (``re.search(pattern, ...)``), so
this module is a few lines of its own.
"""

from __future__ import annotations

import re
from typing import Any, cast


class _Lazy:
    """Stands in for the compiled pattern: the first attribute asked for compiles it, and every attribute read
    then is the compiled pattern's own (kept on this object, so later reads cost nothing extra)."""

    def __init__(self, pattern: str, flags: int) -> None:
        self._args = (pattern, flags)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):        # copy, pickle and the like ask for dunders: not the pattern's
            raise AttributeError(name)
        value = getattr(re.compile(*self._args), name)
        setattr(self, name, value)
        return value

    def __repr__(self) -> str:
        return f"lazy_re({self._args[0]!r})"


def lazy_re(pattern: str, flags: int = 0) -> re.Pattern[str]:
    """``re.compile(pattern, flags)``, done when the pattern is first used."""
    return cast("re.Pattern[str]", _Lazy(pattern, flags))
