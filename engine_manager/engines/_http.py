"""The one home of the engines' shared HTTP facts: the readiness (health) probe and the key header.

Every engine the panel drives answers ``GET /health`` without a key (Strata's ``serve/server.py`` ``do_GET``,
llama-server, the scripted engine). What an answer means:

* no connection (refused, reset) → **loading**: an engine opens its port only once it is far enough to answer
  (Strata's eager mode after the engine printed READY; llama-server at once, with 503 while it loads);
* a timeout → loading (a host busy loading tens of GB answers late);
* HTTP 503 → loading (llama-server: ``{"error": {"message": "Loading model"}}``);
* HTTP 200 → ready, where ``needs_loaded`` asks more: a JSON object whose ``loaded`` is ``true`` (Strata's
  ``loaded: false`` is a lazy server, or one whose engine died: up, but **never ready**), and, with
  ``expect_service``, whose ``service`` names the engine (else another program holds the port);
* anything else → **failed**, with the port named: most often another server answers there.

Callers: the engine adapters' ``readiness`` (:mod:`.strata`, :mod:`.llamacpp`, :mod:`.sim`), the scripted engine's
launcher (:class:`engine_manager.sim.launch.SimProcess.wait_ready`); the supervisor and ``dsv41`` CLI use it
through the adapters or directly with :func:`probe_health`.
"""

from __future__ import annotations

from typing import Any

from .base import Readiness

HEALTH_PATH = "/health"
PROBE_TIMEOUT_S = 5.0
NOT_STRATA = "not a Strata server"


def bearer_headers(api_key: str | None) -> dict[str, str]:
    """``Authorization: Bearer KEY`` (every engine accepts it; Strata also ``x-api-key``), or none without a key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def error_message(r: Any) -> str:
    """The ``error`` (or ``error.message``) of a JSON error answer, or ``""``."""
    try:
        e = r.json().get("error")
        return str(e.get("message")) if isinstance(e, dict) else str(e or "")
    except (ValueError, AttributeError):
        return ""


def probe_health(client: Any, base_url: str, *, path: str = HEALTH_PATH, port: int | None = None,
                 needs_loaded: bool = False, expect_service: str | None = None, service_hint: str | None = None,
                 timeout_s: float = PROBE_TIMEOUT_S) -> Readiness:
    """One readiness check: ``GET base_url + path`` with the ``httpx.Client`` ``client`` (no key: health is open).

    Returns a :class:`~engine_manager.engines.base.Readiness`: ``loading`` (no connection, a timeout, HTTP 503,
    or — with ``needs_loaded`` — a server that is up while its model is not), ``ready``, or ``failed`` (another
    answer: another program on the port; its words say which and what to do). ``needs_loaded``: the body must be
    a JSON object with ``loaded: true`` (Strata and the scripted engine). ``expect_service``: its ``service`` must
    be exactly that, else ``failed`` ("not a Strata server on port N ..."). ``service_hint``: a service that does
    not start with it is only noted in the detail. Never raises for an engine's answer or its absence."""
    import httpx

    where = port if port is not None else base_url
    try:
        r = client.get(base_url.rstrip("/") + path, timeout=timeout_s)
    except httpx.ConnectError:
        return Readiness("loading", "connection refused: still loading")
    except httpx.TimeoutException:
        return Readiness("loading", f"{path} did not answer within {timeout_s:g} s (busy loading?)")
    except httpx.HTTPError as exc:
        return Readiness("loading", f"{path}: {exc.__class__.__name__}: {exc}")
    if r.status_code == 503:
        return Readiness("loading", f"HTTP 503: {error_message(r) or 'engine starting'}")
    if r.status_code != 200:
        said = error_message(r)
        return Readiness("failed", f"{path} answered HTTP {r.status_code}: "
                                   + (said if said else f"is another server on port {where}?"))
    if not needs_loaded and not expect_service:
        return Readiness("ready", "ok")
    try:
        body = r.json()
    except ValueError:
        return Readiness("failed", f"{path} did not answer JSON: is another server on port {where}?")
    if not isinstance(body, dict):
        return Readiness("failed", f"{path} answered an unexpected document")
    svc = body.get("service")
    if expect_service and svc != expect_service:
        what = f"its {path} says service {svc!r}" if svc is not None else f"its {path} names no service"
        strata = expect_service == "strata"
        return Readiness("failed", f"{NOT_STRATA if strata else 'not the expected server'} on port {where}: {what} "
                                   f"({'Strata' if strata else 'the engine'} answers {expect_service!r}). Stop the "
                                   "other server or choose another port in Settings.")
    if needs_loaded and body.get("loaded") is not True:
        why = "not loaded" if body.get("loaded") is False else f"status {body.get('status')!r}, no loaded flag"
        return Readiness("loading", f"engine {why}: loading or unloaded (the server is up, the model is not)")
    detail = f"{svc or 'engine'} ready: {body.get('model') or '?'}"
    if service_hint and svc and not str(svc).startswith(service_hint):
        detail += f" (note: service is {svc!r}, expected {service_hint!r})"
    return Readiness("ready", detail)


__all__ = ["HEALTH_PATH", "NOT_STRATA", "PROBE_TIMEOUT_S", "bearer_headers", "error_message", "probe_health"]
