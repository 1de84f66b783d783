"""Fixtures for tests and demos, kept out of the product's own modules.

- :mod:`.hub`: a local Hugging Face hub on 127.0.0.1 (``python -m engine_manager.testing.hub --demo DIR`` serves
  the offline demo: a fake model and engine release, and the ``HF_ENDPOINT`` to use)
- :mod:`.tinymoe`: a deterministic random-weight ``qwen3moe`` GGUF split that llama-server runs
  (``python -m engine_manager.testing.tinymoe DIR``)

Nothing in the product imports this package, except the offline demo that names it.
"""
