"""One verifying TLS context for every HTTP client the panel makes.

httpx builds a fresh context for each ``Client`` (and each ``HTTPTransport``) it is not handed one for, loading the
CA bundle each time: 43 ms of CPU per client on this project's 2-core machine against 0.1 ms with one shared
context (benchmarks/results/gui_load.txt: the overview strip's polls cost 3.2 % of a core before). A context is
safe to share between threads. ``verify(v)`` maps the usual ``verify`` argument onto it: True → the shared
context; False or a CA path → unchanged."""

from __future__ import annotations

import functools
from typing import Any


@functools.lru_cache(maxsize=1)
def tls_context() -> Any:
    """The shared context, as httpx itself would make it (its CA bundle, its defaults)."""
    import httpx

    return httpx.create_ssl_context()


def verify(v: Any = True) -> Any:
    """What to pass as httpx's ``verify``: the shared context for True, anything else as given."""
    return tls_context() if v is True else v
