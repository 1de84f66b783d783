"""The engines the panel drives, behind one interface (:mod:`.base`).

- ``strata``: the deepseek-one-gpu / Strata server (docs/ENGINE_CONTRACT.md §2)
- ``llamacpp``: stock llama.cpp ``llama-server`` (§3)
- ``sim``: the scripted engine, a real separate process that models the offload (§4), labelled simulated
- attached to only: ``vllm``, ``sglang``, ``openai_compat``, ``inferencekey``

:mod:`.registry` lists the names; each engine's facts are its adapter's traits (:class:`.base.Engine`).
"""

from __future__ import annotations

from .base import Engine, FailureHint, LaunchSpec, LogEvent, Readiness, Sample
from .registry import ALIASES, ATTACH_ONLY, STARTABLE, TraitTable, canonical, find_engine, get_engine

ENGINE_NAMES = STARTABLE          # the engines the panel starts (registry.STARTABLE)


__all__ = ["Engine", "FailureHint", "LaunchSpec", "LogEvent", "Readiness", "Sample", "get_engine", "find_engine",
           "canonical", "ENGINE_NAMES", "STARTABLE", "ATTACH_ONLY", "ALIASES", "TraitTable"]
