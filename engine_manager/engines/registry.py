"""The one list of the engines the panel knows, and how a name becomes its adapter.

Every engine fact lives on its adapter (:class:`.base.Engine`'s traits); code outside this package reads them
through :func:`get_engine` (a name that must be known) or :func:`find_engine` (any name: one not listed here
gets the base class's defaults), never by comparing a name. A new attach-only adapter is its module plus one line
here (and one in :data:`DETECTION_ORDER`); a startable one also adds its name to ``settings.EngineName``.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from .base import Engine, LaunchSpec, Readiness, Sample

#: started and stopped by the panel (the supervisor), in the engine chooser's order; each has a module of its name
STARTABLE = ("strata", "llamacpp", "sim")
#: attached to, never started by the panel
ATTACH_ONLY = ("vllm", "sglang", "openai_compat", "inferencekey")
ALL = STARTABLE + ATTACH_ONLY
#: other spellings of a name (``mock``: the guides' word for the scripted engine)
ALIASES = {"mock": "sim"}
#: the order in which :func:`engine_manager.connections.detect` asks the adapters whether a server is theirs
#: (:meth:`.base.Engine.recognise`): the specific before the generic (the scripted engine's ``strata-sim`` before
#: Strata's ``strata…``, any named server before a plain OpenAI-compatible one). InferenceKey is told by its URL.
DETECTION_ORDER = ("sim", "strata", "llamacpp", "vllm", "sglang", "openai_compat")

_LOADED: dict[str, Engine] = {}


def canonical(name: str) -> str:
    """``name`` with an alias resolved (``mock`` → ``sim``); any other name as given."""
    return ALIASES.get(name, name)


def get_engine(name: str) -> Engine:
    """The adapter of ``name`` (an alias works); ValueError for a name not listed here."""
    name = canonical(name)
    eng = _LOADED.get(name)
    if eng is None:
        if name not in ALL:
            raise ValueError(f"unknown engine {name!r}: choose one of {', '.join(STARTABLE)}")
        eng = _LOADED[name] = importlib.import_module(f"{__package__}.{name}").ENGINE
    return eng


class UnknownEngine(Engine):
    """What the panel knows of an engine whose name is not listed (``unknown``, a state file's old name, None):
    the base class's traits. It is never started or polled."""

    name = ""
    label = "an engine the panel does not know"

    def build_launch(self, settings: Any, plan: dict[str, Any] | None, workdir: Path) -> LaunchSpec:
        raise ValueError("an engine the panel does not know cannot be started")

    def readiness(self, client: Any, spec: LaunchSpec) -> Readiness:
        return Readiness("failed", "an engine the panel does not know")

    def poll(self, client: Any, spec: LaunchSpec, previous: Sample | None) -> Sample:
        return Sample(t=time.time(), engine=spec.engine)


UNKNOWN = UnknownEngine()


def find_engine(name: str | None) -> Engine:
    """The adapter of ``name``, or :data:`UNKNOWN` (the base class's traits) for a name not listed here."""
    try:
        return get_engine(name) if name else UNKNOWN
    except ValueError:
        return UNKNOWN


class TraitTable(Mapping[str, Any]):
    """A read-only table ``name → one trait`` over the listed engines, read from the adapters when asked (so a
    module may hold one without importing every adapter): ``TraitTable("kind_label")["vllm"]`` is
    ``get_engine("vllm").kind_label``."""

    def __init__(self, trait: str, names: tuple[str, ...] = ALL):
        self.trait, self.names = trait, names

    def __getitem__(self, name: str) -> Any:
        if name not in self.names:
            raise KeyError(name)
        return getattr(get_engine(name), self.trait)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def __repr__(self) -> str:
        return f"TraitTable({self.trait!r}, {self.names!r})"
