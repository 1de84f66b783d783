"""The engines the panel drives, behind one interface (:mod:`.base`).

- ``strata``: the deepseek-one-gpu / Strata server (docs/ENGINE_CONTRACT.md §2)
- ``llamacpp``: stock llama.cpp ``llama-server`` (§3)
- ``sim``: the scripted engine, a real separate process that models the offload (§4), labelled simulated
"""

from __future__ import annotations

import importlib

from .base import Engine, FailureHint, LaunchSpec, LogEvent, Readiness, Sample

ENGINE_NAMES = ("strata", "llamacpp", "sim")
ATTACH_ONLY_NAMES = ("vllm", "sglang", "openai_compat", "inferencekey")   # attached to, never started by the panel


def get_engine(name: str) -> Engine:
    """The engine object for ``name`` (``mock`` is the guides' alias of ``sim``)."""
    name = {"mock": "sim"}.get(name, name)
    if name not in ENGINE_NAMES + ATTACH_ONLY_NAMES:
        raise ValueError(f"unknown engine {name!r}: choose one of {', '.join(ENGINE_NAMES)}")
    mod = importlib.import_module(f"{__name__}.{name}")
    return mod.ENGINE


__all__ = ["Engine", "FailureHint", "LaunchSpec", "LogEvent", "Readiness", "Sample", "get_engine", "ENGINE_NAMES"]
