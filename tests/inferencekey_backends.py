"""Backends the InferenceKey tests serve through the SDK's runtime (``--backend inferencekey_backends:Class``, with
this folder on PYTHONPATH, as a worker puts an artifact's root there)."""

from engine_manager.inferencekey.backend import DeepSeekOneGpuBackend


class ShortLimit(DeepSeekOneGpuBackend):
    """The worker's per-request limit made short, so that a test sees an answer cut before it."""

    REQUEST_LIMIT_S = 12.0
    LIMIT_MARGIN_S = 2.0
