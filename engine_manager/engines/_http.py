"""The one home of the engines' shared HTTP facts: the readiness (health) probe and the key header.

Every engine the panel drives answers ``GET /health`` without a key (Strata's ``serve/server.py`` ``do_GET``,
llama-server, the scripted engine). What an answer means:
* no connection (refused, reset) or a timeout → **loading**: an engine opens its port only once it can answer
  (Strata after READY; llama-server at once, with 503 while it loads), and a host busy loading answers late;
* HTTP 503 → loading (llama-server: ``{"error": {"message": "Loading model"}}``);
* HTTP 200 → ready, where ``needs_loaded`` also asks for a JSON ``loaded: true`` (Strata's ``loaded: false`` is a
  lazy server or one whose engine died: up, **never ready**) and ``expect_service`` for a ``service`` naming the
  engine (else another program holds the port);
* anything else → **failed**, with the port named: most often another server answers there.
Callers: the adapters' ``readiness`` (:mod:`.strata`, :mod:`.llamacpp`, :mod:`.sim`), the scripted engine's launcher
(:class:`engine_manager.sim.launch.SimProcess.wait_ready`); the supervisor and the ``dsv41`` CLI use it through the
adapters or directly with :func:`probe_health`.
"""

from __future__ import annotations

import heapq
import itertools
import os
import threading
import time
from typing import Any

from ..fmt import MB
from .base import Readiness

HEALTH_PATH = "/health"
PROBE_TIMEOUT_S = 5.0
NOT_STRATA = "not a Strata server"

# Caps on what a server may send (an endless body once grew the panel past 1 GB in seconds). Real answers are far
# smaller: Strata's /metrics with ?requests=all keeps 500 requests (serve/server.py@2291cb3 Service.metrics), well
# under 1 MB; vLLM's Prometheus page with per-GPU histograms is a few hundred kB.
SMALL_BODY_CAP = 1 * MB        # /health, /v1/models, /props, /slots, error bodies
METRICS_BODY_CAP = 16 * MB     # /metrics (JSON or Prometheus text)
SSE_LINE_CAP = 1 * MB          # one line of a server-sent event stream
REQUEST_DEADLINE_S = 10.0      # one whole request, headers and body (httpx's timeout is per read, not overall)


class AnswerTooLarge(Exception):
    """The server sent more than the cap allows; the message names the URL and the cap."""


class AnswerTooSlow(Exception):
    """The whole answer did not arrive within the deadline (a server dripping bytes keeps each read alive)."""


def _too_slow(url: str, deadline_s: float) -> AnswerTooSlow:
    return AnswerTooSlow(f"the answer at {url} did not arrive within {deadline_s:g} s; the server is too slow or "
                         "stalled")


def _socket_of(r: Any) -> Any:
    """The socket under a streamed response (httpcore's ``network_stream`` extension), or None."""
    try:
        return r.extensions["network_stream"].get_extra_info("socket")
    except Exception:  # noqa: BLE001 - a transport without one (a test double): the per-read timeout still holds
        return None


def _cut(sock: Any, fired: threading.Event) -> None:
    """The deadline passed: shut the socket down, which wakes a read blocked in it (closing would not)."""
    import socket       # here: the adapters import this module on the engine column's first step (socket: 3–7 ms)

    fired.set()
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except (OSError, ValueError, AttributeError):
        pass


class _Deadlines:
    """One daemon thread that cuts the sockets of capped requests whose deadline has passed (:func:`_cut`), for
    every request of the process.

    Written by hand: a ``threading.Timer`` per request started and ended a thread each time (the engine poll, the
    health check and the overview strip make ~2 requests a second while the panel monitors). With one shared
    thread a capped GET of 30 kB on loopback costs 1.30 ms of CPU instead of 1.60 ms
    (``benchmarks/deadline_cost.py``, alternating rounds in one run). The standard library's ``sched`` cannot be
    woken for an earlier deadline while it waits for a later one."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        """Empty, no thread: made so, and in a child after ``fork()`` (its parent's thread and lock are not its)."""
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Any, threading.Event]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def add(self, delay_s: float, sock: Any, fired: threading.Event) -> int:
        """Cut ``sock`` (and set ``fired``) ``delay_s`` from now unless :meth:`cancel` comes first; a handle."""
        with self._cond:
            n = next(self._seq)
            heapq.heappush(self._heap, (time.monotonic() + delay_s, n, sock, fired))
            if self._thread is None or not self._thread.is_alive():     # first use
                self._thread = threading.Thread(target=self._run, name="http-deadlines", daemon=True)
                self._thread.start()
            elif self._heap[0][1] == n:
                self._cond.notify()                     # earlier than what the thread waits for
            return n

    def cancel(self, handle: int) -> None:
        """The request is over: forget its deadline (and its socket) now."""
        with self._cond:
            entry = next((e for e in self._heap if e[1] == handle), None)
            if entry is not None:
                self._heap.remove(entry)
                heapq.heapify(self._heap)

    def pending(self) -> int:
        with self._cond:
            return len(self._heap)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    self._cond.wait(max(0.0, self._heap[0][0] - time.monotonic()) if self._heap else None)
                _, _, sock, fired = heapq.heappop(self._heap)
            _cut(sock, fired)


_DEADLINES = _Deadlines()
os.register_at_fork(after_in_child=_DEADLINES._reset)


def get_capped(client: Any, url: str, *, headers: dict[str, str] | None = None, cap: int = SMALL_BODY_CAP,
               deadline_s: float = REQUEST_DEADLINE_S, params: Any = None) -> Any:
    """``GET url`` with ``client`` (an ``httpx.Client``), reading at most ``cap`` bytes of body within ``deadline_s``
    for the whole exchange. Returns an ``httpx.Response`` whose body is read (``.json()``/``.text`` work).
    Raises :class:`AnswerTooLarge` or :class:`AnswerTooSlow` (plain words, the URL named), or httpx's own errors
    for no connection. Redirects are never followed (the client's setting is kept).

    The deadline is for the whole answer: httpx's timeout bounds each read, so a server dripping a byte a second
    would keep it alive for ever; here one shared thread (:class:`_Deadlines`) shuts the connection's socket down
    when the deadline passes."""
    import httpx

    end = time.monotonic() + deadline_s

    def left() -> float:
        rest = end - time.monotonic()
        if rest <= 0:
            raise _too_slow(url, deadline_s)
        return rest

    fired = threading.Event()
    try:
        with client.stream("GET", url, headers=headers, params=params, timeout=httpx.Timeout(left())) as r:
            sock = _socket_of(r)
            deadline = _DEADLINES.add(left(), sock, fired) if sock is not None else None
            try:
                declared = r.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > cap:
                    raise AnswerTooLarge(f"the answer at {url} is larger than {cap / MB:g} MB ({int(declared):,} "
                                         "bytes declared); refusing to read it")
                chunks: list[bytes] = []
                got = 0
                for chunk in r.iter_raw():
                    got += len(chunk)
                    if got > cap:
                        raise AnswerTooLarge(f"the answer at {url} is larger than {cap / MB:g} MB; stopped reading "
                                             "it")
                    chunks.append(chunk)
                    left()
                if fired.is_set():          # the socket was cut: what arrived is not the whole answer
                    raise _too_slow(url, deadline_s)
            except (httpx.HTTPError, OSError, ValueError, AttributeError) as exc:
                if fired.is_set():
                    raise _too_slow(url, deadline_s) from exc
                raise
            finally:
                if deadline is not None:
                    _DEADLINES.cancel(deadline)
            body = b"".join(chunks)
            # iter_raw gives the bytes as sent: decode any content-encoding ourselves, with the cap, and re-wrap
            # without the header (httpx.Response decodes a body it is given with one, without any cap: a gzip
            # bomb of 16 MB would expand to gigabytes there)
            kept: Any = r.headers
            if r.headers.get("content-encoding"):
                body = _decoded(body, r.headers["content-encoding"], cap, url)
                kept = {k: v for k, v in r.headers.items() if k.lower() != "content-encoding"}
            return httpx.Response(r.status_code, headers=kept, content=body, request=r.request)
    except httpx.TimeoutException as exc:
        if time.monotonic() >= end or fired.is_set():
            raise _too_slow(url, deadline_s) from exc
        raise


def deadline_of(client: Any, default: float = REQUEST_DEADLINE_S) -> float:
    """The overall deadline of one request made with ``client``: its read timeout (the caller's own pace: the
    monitor's 2 s, the overview's 3 s), at most ``default``."""
    read = getattr(getattr(client, "timeout", None), "read", None)
    return min(float(read), default) if isinstance(read, (int, float)) and read > 0 else default


def json_body(r: Any) -> Any:
    """The JSON of an answer; ``ValueError`` in plain words for what is not JSON — also for a document nested so
    deeply that Python's parser gives up (``RecursionError``, which is not a ``ValueError``)."""
    try:
        return r.json()
    except RecursionError:
        raise ValueError("the answer nests too deeply to be read as JSON") from None


def _decoded(body: bytes, encoding: str, cap: int, url: str) -> bytes:
    """A gzip/deflate body decompressed with the same cap (a small bomb must not expand past it)."""
    import zlib

    enc = encoding.strip().lower()
    if enc not in ("gzip", "deflate", "x-gzip"):
        return body
    d = zlib.decompressobj(zlib.MAX_WBITS | 32)   # gzip or zlib header, detected
    try:
        out = d.decompress(body, cap + 1)
    except zlib.error:
        import httpx       # the error httpx itself raises for such a body, which every caller already handles

        raise httpx.DecodingError(f"the answer at {url} says it is {enc}-compressed but is not; it cannot be "
                                  "read") from None
    if len(out) > cap or d.unconsumed_tail:
        raise AnswerTooLarge(f"the answer at {url} expands past {cap / MB:g} MB; refusing to read it")
    return out


def bearer_headers(api_key: str | None) -> dict[str, str]:
    """``Authorization: Bearer KEY`` (every engine accepts it; Strata also ``x-api-key``), or none without a key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def error_message(r: Any) -> str:
    """The ``error`` (or ``error.message``) of a JSON error answer, or ``""``."""
    try:
        e = json_body(r).get("error")
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
    try:     # a size cap and an overall deadline: a server dripping bytes or sending for ever holds no one up
        r = get_capped(client, base_url.rstrip("/") + path, cap=SMALL_BODY_CAP, deadline_s=timeout_s)
    except httpx.ConnectError:
        return Readiness("loading", "connection refused: still loading")
    except (httpx.TimeoutException, AnswerTooSlow):
        return Readiness("loading", f"{path} did not answer within {timeout_s:g} s (busy loading?)")
    except (AnswerTooLarge, ValueError) as exc:
        return Readiness("failed", f"{exc}: is another server on port {where}?")
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
        body = json_body(r)
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


__all__ = ["HEALTH_PATH", "METRICS_BODY_CAP", "NOT_STRATA", "PROBE_TIMEOUT_S", "REQUEST_DEADLINE_S", "SMALL_BODY_CAP",
           "SSE_LINE_CAP", "AnswerTooLarge", "AnswerTooSlow", "bearer_headers", "deadline_of", "error_message",
           "get_capped", "json_body", "probe_health"]
