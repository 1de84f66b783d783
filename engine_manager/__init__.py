"""dsv41 panel core: every decision and every side effect of the panel, with no Qt.

The GUI (``app``), the CLI (``engine_manager.cli``) and the tests drive the same functions. Long operations are
generators yielding typed progress events (dataclasses).
"""

__version__ = "0.1.0"
