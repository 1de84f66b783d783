"""An InferenceKey endpoint, attached to (never started by the panel): a workload's OpenAI-compatible data plane at
``{base}/endpoint/{project}/{workload}/v1``, called with an ``ik_live_`` key (:mod:`engine_manager.inferencekey.
endpoint` holds the URL's shape, the key check, detection and the backend's answer unwrapped).

The data plane serves ``POST /chat/completions`` and ``POST /embeddings`` and nothing else
(inferencekey-sdk docs/src/content/docs/en/reference/wire-format.mdx, "Data plane"): no health route, no metrics.
So this adapter reads no figure and sends nothing: every load figure is missing (``None``), said so in the sample's
note, and whether the endpoint answers shows when a chat is sent (and in ``dsv41 connections test``). The engine the
worker's backend runs is watched on the worker's own machine, by its own panel, like any engine the panel started.
"""

from __future__ import annotations

import time
from typing import Any

from ..inferencekey.endpoint import NO_STREAMING, endpoint_ref
from .base import Evidence, LaunchSpec, Readiness, Sample
from .openai_compat import OpenAICompatEngine

NOTE = ("an InferenceKey endpoint reports no load figures (its data plane has no metrics route); the worker's own "
        "panel shows its engine")


class InferenceKeyEngine(OpenAICompatEngine):
    name = "inferencekey"
    label = "InferenceKey endpoint (attached)"
    health_paths = ()
    words = "an InferenceKey endpoint"
    kind_label = "InferenceKey endpoint"
    answers_health = False                   # its model: the workload's slug
    chat_note = NO_STREAMING

    def chat_base(self, url: str) -> str:
        """…/endpoint/<project>/<workload>: the chat appends /v1/chat/completions to it."""
        return getattr(endpoint_ref(url), "chat_base", url)

    def recognise(self, ev: Evidence) -> tuple[list[str], list[str]] | None:
        return None                          # told by its URL (inferencekey.endpoint.detect_endpoint), not its answers

    def readiness(self, client: Any, spec: LaunchSpec) -> Readiness:
        return Readiness("ready", "an InferenceKey endpoint has no health route: a chat says whether it answers")

    def poll(self, client: Any, spec: LaunchSpec, previous: Sample | None) -> Sample:
        return Sample(t=time.time(), engine=self.name, extra={"attach_only": True, "note": NOTE})


ENGINE = InferenceKeyEngine()
