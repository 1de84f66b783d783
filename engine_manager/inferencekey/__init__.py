"""The InferenceKey custom backend, built on the panel's core (no Qt).

An InferenceKey worker runs a *custom backend* through the SDK's own runtime
(``python -m inferencekey.backend.serve --port P --backend module:Class``, inferencekey/backend/serve.py ``main``):
``setup()`` once, then ``process(job)`` per request. :mod:`.backend` holds the class
(:class:`~engine_manager.inferencekey.backend.DeepSeekOneGpuBackend`); it checks the machine, downloads, plans,
binds and starts the engine through the same :class:`~engine_manager.session.EngineSession` the desktop panel uses,
so the panel on that machine sees the engine the worker started. :mod:`.artifact` packages it with the SDK's
``package_backend`` (the artifact's root is this repository's ``engine_manager/`` package, without Qt, weights or
binaries, plus ``requirements.txt`` and ``manifest.json``), publishes it and builds the workload for ``deploy``.
:mod:`.watchdog` stops the engine when the backend's process is gone, whatever ended it.

The SDK (``pip install 'dsv41-panel[inferencekey]'``) is imported only here and by ``dsv41 inferencekey``: the
panel and the rest of the core work without it.
"""

from __future__ import annotations

#: the slug the backend is published and deployed under, and its task type (inferencekey/backend/base.py
#: TASK_TYPES; a workload's task_type must match the backend's: docs/.../guides/custom-backends.mdx, "Use it in a
#: workload")
SLUG = "deepseek-v41-flash-one-gpu"
TASK_TYPE = "text2text"
#: ``module:Class`` as the SDK's loader reads it (inferencekey/backend/serve.py ``load_backend``): the worker puts
#: the unpacked artifact's root on PYTHONPATH (inferencekey/backend/packaging.py ``_collect_code_members``), and the
#: root holds ``engine_manager/``
ENTRYPOINT = "engine_manager.inferencekey.backend:DeepSeekOneGpuBackend"
#: the model the workload names (the platform shows it; the backend itself downloads the GGUF shards)
MODEL = "DeepSeek-V4.1-Flash"
