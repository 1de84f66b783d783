"""OpenAI chat-completions client for the engine (Strata, llama-server or the scripted engine), streaming.

``ChatClient.stream(messages, options, cancel)`` posts ``/v1/chat/completions`` with ``stream: true`` and yields
typed events (:mod:`engine_manager.chat_events`, re-exported here): :class:`StreamOpened`, :class:`ReasoningDelta`,
:class:`ContentDelta`, :class:`FinishReason`, :class:`UsageInfo`, :class:`TimingsInfo`, and :class:`StreamDone`
last with :class:`StreamStats` measured on our side beside the engine's figures. Anything that goes wrong raises
:class:`ChatError` in plain words (the engine's message for HTTP errors, an error frame, a lost connection, a dead
engine, a stall); the API key is masked wherever a server echoes it. What a server sends is bounded
(``SSE_LINE_CAP``, ``SMALL_BODY_CAP``, ``max_tokens`` plus a margin); impossible figures are missing, not errors.

Cancel: :class:`CancelToken.cancel` (any thread) shuts the stream's socket down, waking a blocked read at once; the
stream ends with ``StreamDone(stats.cancelled=True)``. Fields OpenAI does not define (``ChatOptions.extra``…) are
top-level keys of the body, where Strata and llama-server read them. SSE is parsed by ``httpx-sse`` (a few µs per
event: ``benchmarks/chat_latency.py``). :func:`engine_target` / :func:`check_target` say whether the engine at an
address is the one the panel started before a request (and the key) is sent there.
"""

from __future__ import annotations

import json
import math
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Generator, Iterator, Mapping, Sequence, cast

import httpx
from httpx_sse import EventSource, SSEError

from .cancel import CancelToken
from .chat_events import (  # noqa: F401 - re-exported: engine_manager.chat is where callers find them
    MIN_RATE_SPAN_S,
    REASONING_EFFORTS,
    ChatEvent,
    ChatOptions,
    ContentDelta,
    FinishReason,
    ReasoningDelta,
    StreamDone,
    StreamOpened,
    StreamStats,
    TimingsInfo,
    UsageInfo,
)
from .engines._http import (
    REQUEST_DEADLINE_S,
    SMALL_BODY_CAP,
    SSE_LINE_CAP,
    AnswerTooLarge,
    AnswerTooSlow,
    bearer_headers,
    get_capped,
)
from .engines import STARTABLE, get_engine
from .engines.base import mask_in
from .errors import UserError
from .inferencekey import endpoint as ik_endpoint
from .inferencekey.endpoint import endpoint_ref
from .tunnel import transport_for
from .fmt import MB
from .tls import verify as tls_verify

if TYPE_CHECKING:
    from .engine_state import RunningEngine

DEFAULT_CONNECT_TIMEOUT_S = 5.0
# The longest an engine may go without a token once it has started answering (its keep-alives and empty frames do
# not count then: a server that only pings would otherwise hold a chat for ever).
DEFAULT_READ_TIMEOUT_S = 120.0
# Before the first token, Strata's ": keep-alive" comments do count: it sends one every 10 s while the request waits
# its turn or the engine reads the prompt (serve/server.py@2291cb3 Service.run, QUEUE_BEAT_S and the engine's
# heartbeat), which on a slow PC takes minutes. Not for ever, though: the first token must come within this long
# (or within the read timeout, when that is longer).
FIRST_TOKEN_DEADLINE_S = 600.0
# A stream that goes on past max_tokens is cut there, plus this margin (one delta is one token for Strata,
# llama-server and the scripted engine; a few more can come: a held-back stop-string tail, a parser's flush).
TOKEN_MARGIN_MIN = 64
TOKEN_MARGIN_SHARE = 0.25
NO_MAX_TOKENS = 1_048_576          # no max_tokens sent: the engine's own cap is its context, at most this
CHARS_PER_TOKEN_CAP = 256          # a token's text is a few characters; this many per token is never a real answer


# ------------------------------------------------------------------------------------------------ errors
class ChatError(UserError):
    """A chat request failed. ``str()`` is the message for a person; ``kind`` is for code:

    ``unreachable`` (nothing listens), ``bad_request`` (400), ``auth`` (401), ``busy`` (409), ``unavailable`` (503,
    or the panel's engine is still starting), ``http`` (another status), ``stream_error`` (an error frame
    mid-stream), ``connection_lost``, ``engine_died``, ``stalled`` (no token for the read timeout: silence, or only
    keep-alives and empty frames), ``protocol`` (not an event stream / not JSON / a frame of the wrong shape),
    ``too_large`` (a line or event past its cap), ``overrun`` (tokens past max_tokens and its margin: cut off);
    before sending (:func:`check_target`): ``not_ours`` (a program the panel did not start holds the
    port), ``key_mismatch`` (the panel's engine runs with another key), ``unknown`` (the status cannot be read:
    nothing is sent).
    """

    def __init__(self, kind: str, message: str, *, status: int | None = None, engine_message: str | None = None):
        super().__init__(message)
        self.kind, self.status, self.engine_message = kind, status, engine_message
        self.stats: StreamStats | None = None      # set by ChatClient.stream: what arrived before it failed

    @property
    def message(self) -> str:
        return str(self)


ENGINE_MESSAGE_CHARS = 500        # the engine's own words quoted in a message: at most this much


def _words(v: Any) -> str:
    """A value from an engine's error, as words: text as it is, anything else as compact JSON (never Python's
    repr), cut to ENGINE_MESSAGE_CHARS."""
    if isinstance(v, str):
        text = v
    else:
        try:
            text = json.dumps(v, ensure_ascii=False, default=str)
        except (ValueError, TypeError, RecursionError):
            text = "(an error the engine described in a form that cannot be read)"
    text = text.strip()
    return text if len(text) <= ENGINE_MESSAGE_CHARS else text[:ENGINE_MESSAGE_CHARS] + "…"


def _engine_message(payload: Any) -> str | None:
    """The human part of ``{"error": {"message": ..., "type": ...}}`` / ``{"error": "..."}`` / ``{"detail": ...}``."""
    if isinstance(payload, Mapping):
        err = payload.get("error", payload.get("detail", payload.get("message")))
        if isinstance(err, Mapping):
            msg = err.get("message") or err.get("detail") or err.get("type") or err.get("code")
            typ = err.get("type") or err.get("code")
            if msg and typ and _words(typ) not in _words(msg):
                return _words(f"{_words(msg)} ({_words(typ)})")
            return _words(msg) if msg else _words(err)
        if err is not None:
            return _words(err)
    if isinstance(payload, str) and payload.strip():
        return _words(payload)
    return None


def _loads(text: str) -> Any:
    """``json.loads`` that raises only ValueError (a 100,000-deep nesting is a RecursionError in the parser)."""
    try:
        return json.loads(text)
    except RecursionError as exc:
        raise ValueError("nested too deeply") from exc


def http_error(status: int, body_text: str, base_url: str, secrets: Sequence[str] = ()) -> ChatError:
    """The :class:`ChatError` for an HTTP error answer; any of ``secrets`` (the API key) the body echoes is masked
    in the message."""
    body_text = mask_in(body_text or "", [s for s in secrets if s])
    try:
        payload: Any = _loads(body_text) if body_text else None
    except ValueError:
        payload = body_text
    msg = _engine_message(payload)
    said = f" The engine said: {msg.rstrip('.')}." if msg else ""
    head = (body_text or "").lstrip()[:200].lower()
    if head.startswith(("<!doctype html", "<html", "<head", "<body")):
        # a web page (a plain web server, a proxy): its markup says nothing a person needs here
        msg = None
        said = (f" It answered with a web page, not with an engine's JSON: is {base_url} really the engine's "
                f"address? Check what listens there (`dsv41 status`).")
    if status == 400:
        text = (f"The engine refused the request (HTTP 400).{said} Check the request options (max tokens must fit "
                f"the context; tool calls are not supported) and try again.")
        kind = "bad_request"
    elif status == 401:
        text = (f"The engine at {base_url} refused the API key (HTTP 401).{said} The key in the panel's settings "
                f"(api_key / DSV41_API_KEY) must be the one the engine was started with: restart the engine from "
                f"the panel, or fix the key.")
        kind = "auth"
    elif status == 409:
        # Strata queues chat requests (first in, first out) and answers 409 model_busy only to /v1/load and
        # /v1/unload (serve/server.py _post @2291cb3): a 409 here comes from an engine loading or unloading its model
        text = (f"The engine is busy (HTTP 409): it is loading or unloading its model, or it is not a Strata "
                f"engine that queues requests.{said} Try again in a moment.")
        kind = "busy"
    elif status == 503:
        text = (f"The engine is not ready to answer (HTTP 503): it is still loading, or it died.{said} Look at the "
                f"engine's state and log; start it again if it stopped.")
        kind = "unavailable"
    else:
        text = f"The engine answered HTTP {status}.{said}"
        kind = "http"
    return ChatError(kind, text, status=status, engine_message=msg)


# ------------------------------------------------------------------------------------------------ cancel
def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


# ------------------------------------------------------------------------------------------------ client
def _engine_answers(base_url: str, timeout_s: float = 1.0, tries: int = 2) -> bool:
    """Does anything still answer ``GET /health`` at ``base_url``? (A bare TCP connect is not enough: the kernel
    accepts connections for a process that is being killed until its listening socket is finally closed.)"""
    for i in range(tries):
        try:
            with httpx.Client(trust_env=False, timeout=timeout_s, verify=tls_verify(),
                              transport=transport_for(base_url)) as c:
                get_capped(c, base_url.rstrip("/") + "/health", deadline_s=timeout_s)
            return True
        except (AnswerTooLarge, AnswerTooSlow):
            return True                    # something answers there, too much or too slowly: it is not gone
        except httpx.HTTPError:
            if i + 1 < tries:
                time.sleep(0.2)
    return False


NUMBER_MAX = 1e12       # a token count or a rate past this is no measurement (a server's 10**400 or 1e999)


def _figure(v: Any) -> int | float | None:
    """A figure an engine reported, or None: not a number, not finite (``1e999`` parses as inf, ``NaN`` as nan),
    negative or past NUMBER_MAX are missing, never an error."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if v < 0 or v > NUMBER_MAX:
        return None
    return v


def _num(d: Mapping[str, Any], key: str, cast: Callable[[Any], Any] = float) -> Any:
    v = _figure(d.get(key))
    return None if v is None else cast(v)


def _clean_timings(timings: Mapping[str, Any]) -> dict[str, Any]:
    """The engine's ``timings`` as they are kept with an answer: named figures only (see :func:`_figure`)."""
    out: dict[str, Any] = {}
    for k, v in list(timings.items())[:64]:
        f = _figure(v)
        if isinstance(k, str) and len(k) <= 64 and f is not None:
            out[k] = f
    return out


def token_limit(max_tokens: int | None) -> int:
    """How many tokens a stream may bring before it is cut off: ``max_tokens`` plus a margin."""
    n = max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else NO_MAX_TOKENS
    return n + max(TOKEN_MARGIN_MIN, int(n * TOKEN_MARGIN_SHARE))


@dataclass
class _Chunk:
    """What one chunk of an answer carries, checked: texts are strings, the rest of the right type or absent."""

    reasoning: list[str]
    content: list[str]
    finish: str | None
    usage: Mapping[str, Any] | None
    timings: Mapping[str, Any] | None


def _malformed(what: str, v: Any, expected: str) -> ChatError:
    kind = {dict: "an object", list: "a list", str: "text", int: "a number", float: "a number",
            bool: "true or false"}.get(type(v), "something else")
    return ChatError("protocol", f"The engine sent a malformed answer: {what} is {kind}, not {expected} as in "
                                 "OpenAI's chat API. What arrived is kept; is this an OpenAI-compatible engine?")


def parse_chunk(chunk: Any, *, message_key: str = "delta") -> _Chunk:
    """One chunk of a streamed answer (``message_key="delta"``), or a whole non-streamed answer (``"message"``),
    checked. Raises :class:`ChatError` ``protocol`` in plain words for a chunk of the wrong shape (never a Python
    error: a ``content`` that is an object or a list, ``choices`` that is not a list …)."""
    if not isinstance(chunk, Mapping):
        raise _malformed("a frame", chunk, "an object")
    out = _Chunk([], [], None, None, None)
    choices = chunk.get("choices")
    if choices is None:
        choices = []
    if not isinstance(choices, list):
        raise _malformed("`choices`", choices, "a list")
    for i, choice in enumerate(choices[:16]):
        if not isinstance(choice, Mapping):
            raise _malformed(f"`choices[{i}]`", choice, "an object")
        delta = choice.get(message_key)
        if delta is None:
            delta = {}
        if not isinstance(delta, Mapping):
            raise _malformed(f"`choices[{i}].{message_key}`", delta, "an object")
        for key, into in (("reasoning_content", out.reasoning), ("reasoning", out.reasoning),
                          ("content", out.content)):
            v = delta.get(key)
            if v is None:
                continue
            if not isinstance(v, str):
                raise _malformed(f"`choices[{i}].{message_key}.{key}`", v, "text")
            if v and (key != "reasoning" or not delta.get("reasoning_content")):
                into.append(v)
        fr = choice.get("finish_reason")
        if fr is not None and not isinstance(fr, str):
            raise _malformed(f"`choices[{i}].finish_reason`", fr, "text")
        if fr:
            out.finish = fr[:64]
    usage, timings = chunk.get("usage"), chunk.get("timings")
    out.usage = usage if isinstance(usage, Mapping) else None
    out.timings = timings if isinstance(timings, Mapping) else None
    return out


class _Watch:
    """One stream's limits, checked on every piece of text that arrives (keep-alive comments too, which the SSE
    parser never hands on): a line or an event longer than :data:`SSE_LINE_CAP`, no token for the read timeout once
    the answer began, no first token within the first-token deadline. Raises :class:`ChatError`."""

    def __init__(self, url: str, read_timeout_s: float, first_token_s: float):
        self.url, self.read_timeout_s, self.first_token_s = url, read_timeout_s, first_token_s
        self.t0 = time.monotonic()
        self.last_token: float | None = None
        self.line = 0                 # characters since the last line end
        self.event = 0                # characters since the last blank line (an event's end)
        self.prev = ""

    def token(self) -> None:
        self.last_token = time.monotonic()

    def check_time(self) -> None:
        now = time.monotonic()
        if self.last_token is None:
            if now - self.t0 > self.first_token_s:
                raise ChatError(
                    "stalled",
                    f"The engine sent no token within {self.first_token_s:.0f} s of the question, only keep-alives "
                    f"or empty frames: a request ahead of this one takes that long, or the engine is stuck. "
                    f"Nothing arrived; ask again when it is free, or look at the engine's state and log.")
        elif now - self.last_token > self.read_timeout_s:
            raise ChatError(
                "stalled",
                f"The engine sent no token for {self.read_timeout_s:.0f} s while answering (only keep-alives or "
                f"empty frames); it may be stuck. What arrived is kept; look at the engine's state and log.")

    def feed(self, text: str) -> None:
        i = max(text.rfind("\n"), text.rfind("\r"))
        self.line = len(text) - i - 1 if i >= 0 else self.line + len(text)
        both = self.prev + text
        j = max(both.rfind("\n\n"), both.rfind("\r\r"), both.rfind("\n\r"))   # a line end right after one
        self.event = len(both) - j - 2 if j >= 0 else self.event + len(text)
        self.prev = text[-1:]
        if self.line > SSE_LINE_CAP or self.event > SSE_LINE_CAP:
            what = "a line" if self.line > SSE_LINE_CAP else "an event"
            raise ChatError("too_large",
                            f"The answer at {self.url} sent {what} longer than {SSE_LINE_CAP / MB:g} MB, which no "
                            f"engine sends; stopped reading it. What arrived is kept. Is that really the engine's "
                            f"address?")
        self.check_time()


class _WatchedResponse:
    """What httpx-sse's ``EventSource`` reads of a response (its headers and its text), every piece of text
    passed through a :class:`_Watch` first."""

    def __init__(self, response: httpx.Response, watch: _Watch):
        self._response, self._watch = response, watch

    @property
    def headers(self) -> httpx.Headers:
        return self._response.headers

    def iter_text(self) -> Iterator[str]:
        for text in self._response.iter_text():
            self._watch.feed(text)
            yield text


def _read_capped(response: httpx.Response, cap: int, deadline_s: float) -> tuple[str, bool]:
    """At most ``cap`` bytes of ``response``'s body within ``deadline_s``: ``(text, complete)``."""
    end = time.monotonic() + deadline_s
    chunks: list[bytes] = []
    got = 0
    for chunk in response.iter_bytes():
        chunks.append(chunk)
        got += len(chunk)
        if got > cap or time.monotonic() > end:
            return b"".join(chunks)[:cap].decode("utf-8", "replace"), False
    return b"".join(chunks).decode("utf-8", "replace"), True


class ChatClient:
    """A chat client for one engine. Thread-safe: each :meth:`stream` opens its own connection (no keep-alive
    pool), so that cancel can shut exactly that connection's socket."""

    def __init__(self, base_url: str, api_key: str | None, *, model: str | None = None,
                 connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
                 read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
                 engine_alive: Callable[[], bool] | None = None,
                 first_token_deadline_s: float = FIRST_TOKEN_DEADLINE_S):
        self.base_url = base_url.rstrip("/")
        # an InferenceKey endpoint (its URL's shape): asked without streaming, its backend's JSON answer unwrapped
        self.endpoint = endpoint_ref(self.base_url)
        if self.endpoint is not None:
            self.base_url = self.endpoint.chat_base    # given as …/v1 too: /v1/chat/completions is appended below
        self.model = model or (self.endpoint.workload if self.endpoint is not None else None)
        self.engine_alive = engine_alive
        self._secrets = [api_key] if api_key else []
        self.first_token_s = max(read_timeout_s, first_token_deadline_s)
        self._http = httpx.Client(
            base_url=self.base_url, headers=bearer_headers(api_key), trust_env=False, verify=tls_verify(),
            timeout=httpx.Timeout(connect=connect_timeout_s, read=read_timeout_s, write=30.0, pool=5.0),
            limits=httpx.Limits(max_keepalive_connections=0),
            # an SSH forward's URL is reached only through its Unix socket (engine_manager.tunnel)
            transport=transport_for(self.base_url, limits=httpx.Limits(max_keepalive_connections=0)),
        )
        self.read_timeout_s = read_timeout_s

    @classmethod
    def for_engine(cls, running: RunningEngine, **kw: Any) -> "ChatClient":
        """A client for the running engine (:class:`engine_manager.engine_state.RunningEngine`): its address and key;
        ``kw`` as for the constructor (``model``, timeouts, ``engine_alive``)."""
        return cls(running.base_url, running.api_key, **kw)

    # -- plumbing ---------------------------------------------------------------------------------------
    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "ChatClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def health(self, timeout_s: float = 3.0) -> dict[str, Any]:
        """``GET /health`` as a dict; raises :class:`ChatError` (``unreachable`` / ``http`` / ``too_large`` /
        ``stalled``). The answer is read up to SMALL_BODY_CAP within ``timeout_s`` in all."""
        try:
            r = get_capped(self._http, "/health", deadline_s=timeout_s)
        except AnswerTooLarge as exc:
            raise ChatError("too_large", f"{str(exc)[:1].upper()}{str(exc)[1:]}.") from exc
        except AnswerTooSlow as exc:
            raise ChatError("stalled", f"{str(exc)[:1].upper()}{str(exc)[1:]}.") from exc
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from exc
        if r.status_code != 200:
            raise http_error(r.status_code, r.text, self.base_url, self._secrets)
        try:
            data = _loads(r.text)
        except ValueError:
            data = {}
        return data if isinstance(data, dict) else {}

    def _unreachable(self, exc: BaseException) -> ChatError:
        return ChatError(
            "unreachable",
            f"No engine answers at {self.base_url} ({exc.__class__.__name__}). Start the engine (Start in the panel, "
            f"or `dsv41 start`) and wait until it says ready.",
        )

    def _broken(self, exc: BaseException, got_any: bool) -> ChatError:
        alive = self.engine_alive() if self.engine_alive is not None else _engine_answers(self.base_url)
        where = "while answering" if got_any else "before answering"
        if not alive:
            return ChatError("engine_died",
                             f"The engine stopped {where} (its port {self.base_url} no longer answers). What arrived "
                             f"is kept; look at the engine's log for why, then start it again.")
        return ChatError("connection_lost",
                         f"The connection to the engine was lost {where} ({exc.__class__.__name__}: {exc}). What "
                         f"arrived is kept; ask again.")

    def request_body(self, messages: Sequence[Mapping[str, Any]], options: ChatOptions | None = None) -> dict:
        body: dict[str, Any] = {"messages": [dict(m) for m in messages], "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.model:
            body["model"] = self.model
        body.update((options or ChatOptions()).body_fields())
        if self.endpoint is not None:            # its custom backend answers whole (engine_manager.inferencekey)
            body["stream"] = False
            body.pop("stream_options", None)
        return body

    # -- the stream -------------------------------------------------------------------------------------
    def _mask(self, text: str) -> str:
        """``text`` with the API key masked (a server may echo it in an error)."""
        return mask_in(text, self._secrets)

    def stream(self, messages: Sequence[Mapping[str, Any]], options: ChatOptions | None = None,
               cancel: CancelToken | None = None) -> Generator[ChatEvent, None, None]:
        """Post the chat and yield events as they arrive (see the module docstring).

        Limits, so that no server holds a chat for ever or grows it without end: a line or an event of the stream
        past :data:`SSE_LINE_CAP` (``too_large``); no token for ``read_timeout_s`` once the answer began, whatever
        else arrives (``stalled``); no first token within the first-token deadline (``stalled``); more tokens than
        ``max_tokens`` and its margin (:func:`token_limit`), or more text than CHARS_PER_TOKEN_CAP a token
        (``overrun``: the answer is cut off there, what arrived is kept). An answer sent whole as JSON instead of a
        stream is read up to the same size and yielded as one delta."""
        cancel = cancel or CancelToken()
        stats = StreamStats()
        opts = options or ChatOptions()
        body = self.request_body(messages, opts)
        limit = token_limit(opts.max_tokens)
        sockets: list[socket.socket] = []

        def trace(name: str, info: dict[str, Any]) -> None:
            # httpcore reports the new connection: keep its socket so cancel can shut it down mid-read.
            if name in ("connection.connect_tcp.complete", "connection.connect_unix_socket.complete"):
                stream = info.get("return_value")
                sock = stream.get_extra_info("socket") if stream is not None else None
                if sock is not None:
                    sockets.append(sock)
                    if cancel.cancelled:
                        _shutdown(sock)

        def on_cancel() -> None:
            for s in list(sockets):
                _shutdown(s)

        t0 = time.perf_counter()
        if cancel.cancelled:
            stats.cancelled = True
            stats.duration_s = 0.0
            yield StreamDone(stats)
            return
        cancel.on_cancel(on_cancel)
        watch = _Watch(self.base_url, self.read_timeout_s, self.first_token_s)
        got_any = False
        saw_end = False
        saw_usage = False
        t_first: float | None = None
        t_last: float | None = None
        n_chunks = 0
        n_chars = 0

        def events_of(ck: _Chunk) -> Iterator[ChatEvent]:
            nonlocal got_any, saw_usage, t_first, t_last, n_chunks, n_chars
            now = time.perf_counter()
            if ck.reasoning or ck.content:
                n_chunks += 1
                n_chars += sum(map(len, ck.reasoning)) + sum(map(len, ck.content))
                if n_chunks > limit or n_chars > limit * CHARS_PER_TOKEN_CAP:
                    asked = f"max tokens {opts.max_tokens:,}" if opts.max_tokens else "no max tokens"
                    raise ChatError(
                        "overrun",
                        f"The engine went on past the answer's length ({asked}: more than {limit:,} tokens"
                        f"{'' if n_chunks > limit else ' worth of text'} arrived without the end of the answer), so "
                        f"it was cut off there. What arrived is kept.")
                watch.token()
                t_last = now
                if t_first is None:
                    t_first = now
                    stats.ttft_s = now - t0
                got_any = True
            for r in ck.reasoning:
                stats.reasoning_chunks += 1
                yield ReasoningDelta(r, now)
            for c in ck.content:
                stats.content_chunks += 1
                if stats.first_content_s is None:
                    stats.first_content_s = now - t0
                yield ContentDelta(c, now)
            if ck.finish:
                stats.finish_reason = ck.finish
                yield FinishReason(ck.finish)
            if ck.usage is not None:
                u = UsageInfo(_num(ck.usage, "prompt_tokens", int), _num(ck.usage, "completion_tokens", int),
                              _num(ck.usage, "total_tokens", int))
                stats.prompt_tokens = u.prompt_tokens
                stats.completion_tokens = u.completion_tokens
                saw_usage = True
                yield u
            if ck.timings is not None:
                clean = _clean_timings(ck.timings)
                ti = TimingsInfo(_num(clean, "prompt_n", int), _num(clean, "prompt_ms"),
                                 _num(clean, "prompt_per_second"), _num(clean, "predicted_n", int),
                                 _num(clean, "predicted_ms"), _num(clean, "predicted_per_second"))
                stats.timings = clean
                stats.engine_tok_s = ti.predicted_per_second
                stats.engine_prompt_tok_s = ti.prompt_per_second
                yield ti

        try:
            try:
                with self._http.stream("POST", "/v1/chat/completions", json=body,
                                       headers={"Accept": "text/event-stream", "Cache-Control": "no-store",
                                                "Accept-Encoding": "identity"},
                                       extensions={"trace": trace}) as response:
                    if response.status_code != 200:
                        text, _ = _read_capped(response, SMALL_BODY_CAP, REQUEST_DEADLINE_S)
                        raise http_error(response.status_code, text, self.base_url, self._secrets)
                    ctype = response.headers.get("content-type", "").partition(";")[0].strip().lower()
                    if ctype == "application/json":
                        # an answer sent whole (a server that does not stream): read up to what a stream may bring
                        cap = max(SMALL_BODY_CAP, limit * CHARS_PER_TOKEN_CAP)
                        text, whole = _read_capped(response, cap, max(self.first_token_s, REQUEST_DEADLINE_S))
                        if not whole:
                            raise ChatError("too_large", f"The answer at {self.base_url} is larger than "
                                                         f"{cap / MB:g} MB (or did not arrive in time); stopped "
                                                         "reading it.")
                        try:
                            whole_answer = _loads(text)
                        except ValueError as exc:
                            raise ChatError("protocol", "The engine answered with JSON that cannot be read, not "
                                            f"with an event stream. Is {self.base_url} really the engine's "
                                            "address?") from exc
                        if not isinstance(whole_answer, Mapping) or not whole_answer.get("choices"):
                            if isinstance(whole_answer, Mapping) and whole_answer.get("error") is not None:
                                msg = self._mask(_engine_message(whole_answer) or "no details")
                                raise ChatError("stream_error", f"The engine reported an error before answering: "
                                                f"{msg}. What arrived is kept.", engine_message=msg)
                            raise ChatError("protocol", "The engine answered with JSON that is not a chat answer "
                                            f"(no choices), not with an event stream. Is {self.base_url} really the "
                                            "engine's address?")
                        yield StreamOpened(response.status_code, time.perf_counter())
                        inner = None
                        if self.endpoint is not None:
                            whole_answer, inner = ik_endpoint.rewrap(whole_answer)
                        yield from events_of(parse_chunk(whole_answer, message_key="message"))
                        if inner is not None:
                            ik_endpoint.apply_figures(stats, inner)
                            if inner.problem:
                                raise ChatError("protocol", self._mask(inner.problem))
                        saw_end = True
                    else:
                        yield StreamOpened(response.status_code, time.perf_counter())
                        source = EventSource(cast(httpx.Response, _WatchedResponse(response, watch)))
                        for sse in source.iter_sse():
                            data = sse.data
                            if not data:
                                continue
                            if data.strip() == "[DONE]":
                                saw_end = True
                                break
                            try:
                                chunk = _loads(data)
                            except ValueError as exc:
                                raise ChatError("protocol", "The engine sent a frame that is not JSON: "
                                                f"{self._mask(data[:200])!r}") from exc
                            if isinstance(chunk, Mapping) and chunk.get("error") is not None:
                                msg = self._mask(_engine_message(chunk) or "no details")
                                raise ChatError(
                                    "stream_error",
                                    f"The engine reported an error "
                                    f"{'while answering' if got_any else 'before answering'}: {msg}. What arrived "
                                    f"is kept.", engine_message=msg)
                            yield from events_of(parse_chunk(chunk))
                            if cancel.cancelled:
                                break
                    if not saw_end and not saw_usage and not cancel.cancelled:
                        # Strata (HTTP/1.0) ends every answer by closing the connection, after a last chunk that
                        # always carries `usage`, then `data: [DONE]` (serve/server.py @2291cb3 `openai_chunks`,
                        # `Handler._openai`); llama-server sends a usage chunk and [DONE] too. A body that ends
                        # with neither - even after a finish_reason - is an engine that died mid-answer.
                        raise self._broken(httpx.RemoteProtocolError("the stream ended without [DONE]"), got_any)
            except ChatError:
                if cancel.cancelled:
                    stats.cancelled = True
                else:
                    raise
            except SSEError as exc:
                raise ChatError("protocol", f"The engine did not answer with an event stream ({exc}). Is "
                                f"{self.base_url} really the engine's address?") from exc
            except httpx.ConnectError as exc:
                if cancel.cancelled:
                    stats.cancelled = True
                else:
                    raise self._unreachable(exc) from exc
            except httpx.ReadTimeout as exc:
                if cancel.cancelled:
                    stats.cancelled = True
                else:
                    raise ChatError(
                        "stalled",
                        f"The engine sent nothing for {self.read_timeout_s:.0f} s "
                        f"{'while answering' if got_any else 'before answering'}; it may be stuck. What arrived is "
                        f"kept; look at the engine's state and log.") from exc
            except httpx.TransportError as exc:
                if cancel.cancelled:
                    stats.cancelled = True
                else:
                    raise self._broken(exc, got_any) from exc
        except ChatError as err:
            # what arrived before the stream broke: the engine's usage never comes then, so the tokens are counted
            # here (one delta is one token for llama-server, Strata and the scripted engine), or taken from the
            # last timings seen when they say more
            err.stats = self._final_stats(stats, t0, t_first, t_last, n_chunks, broken=True)
            raise
        finally:
            cancel.remove(on_cancel)
        if cancel.cancelled:
            stats.cancelled = True
        yield StreamDone(self._final_stats(stats, t0, t_first, t_last, n_chunks))

    @staticmethod
    def _final_stats(stats: StreamStats, t0: float, t_first: float | None, t_last: float | None, n_chunks: int,
                     broken: bool = False) -> StreamStats:
        stats.duration_s = time.perf_counter() - t0
        if n_chunks >= 2 and t_first is not None and t_last is not None and t_last - t_first >= MIN_RATE_SPAN_S:
            stats.tok_s = (n_chunks - 1) / (t_last - t_first)
        if stats.completion_tokens is None:
            if broken:
                seen = (stats.timings or {}).get("predicted_n")
                seen = seen if isinstance(seen, int) and not isinstance(seen, bool) else 0
                stats.completion_tokens = max(n_chunks, seen)
            else:
                stats.completion_tokens = n_chunks if not stats.cancelled else None
        return stats

    def complete(self, messages: Sequence[Mapping[str, Any]], options: ChatOptions | None = None,
                 cancel: CancelToken | None = None) -> tuple[str, str, StreamStats]:
        """Drain :meth:`stream`: ``(content, reasoning, stats)``."""
        content: list[str] = []
        reasoning: list[str] = []
        stats = StreamStats()
        for ev in self.stream(messages, options, cancel):
            if isinstance(ev, ContentDelta):
                content.append(ev.text)
            elif isinstance(ev, ReasoningDelta):
                reasoning.append(ev.text)
            elif isinstance(ev, StreamDone):
                stats = ev.stats
        return "".join(content), "".join(reasoning), stats


# ------------------------------------------------------------------------------------------------ which engine
@dataclass(frozen=True)
class EngineTarget:
    """Where a chat goes: the address, the key sent there, and where the address came from (in words)."""

    base_url: str
    api_key: str | None
    where: str
    explicit: bool = False                   # named by the user (``dsv41 chat --url``): no ownership check
    engine: RunningEngine | None = field(default=None, compare=False)   # the handle (engine_target fills it)

    def running(self) -> RunningEngine:
        """The :class:`~engine_manager.engine_state.RunningEngine` to talk to: what the supervisor knows of the panel's
        engine, or just the address and key (an engine the panel did not start)."""
        if self.engine is not None:
            return self.engine
        from .engine_state import RunningEngine
        return RunningEngine(self.base_url, self.api_key or "", engine="unknown", started_by_panel=False)


def _handle(st, base_url: str, api_key: str | None, *, simulated: bool = False, pid: int | None = None):
    """The RunningEngine for ``base_url``: from the supervisor's status ``st`` when it is the panel's engine."""
    from .engine_state import RunningEngine
    if st is not None and st.owner == "panel" and _same_url(st.base_url, base_url):
        return RunningEngine.from_status(st, base_url, api_key or "", read_plan=False)
    if simulated:
        return RunningEngine.from_status(None, base_url, api_key or "", engine="sim", pid=pid, read_plan=False)
    return RunningEngine(base_url, api_key or "", engine="unknown", started_by_panel=False)


def engine_status(settings):
    """``EngineSession(settings).status()``: the engine the panel started (from its state file, pid and start time
    verified), or what else holds the settings' port. Raises :class:`ChatError` ``unknown`` when it cannot be read:
    not knowing who holds the port is a reason to send nothing (fail closed), never a reason to send anyway."""
    try:
        from .session import EngineSession
        return EngineSession(settings).status()
    except Exception as exc:  # noqa: BLE001 - any failure to read it means: unknown, so nothing is sent
        raise ChatError(
            "unknown",
            f"Could not tell which program holds the engine's port ({type(exc).__name__}: {exc}), so nothing was "
            f"sent: not your question, not your API key. Look at `dsv41 status` (or the panel's engine column), fix "
            f"what it names, and ask again.") from None


def _port_of(base_url: str) -> int | None:
    try:
        url = httpx.URL(base_url)
    except (httpx.InvalidURL, TypeError, ValueError):
        return None
    if url.port is not None:
        return url.port
    return {"http": 80, "https": 443}.get(url.scheme)


def _same_url(a: str | None, b: str | None) -> bool:
    if not a or not b:
        return False
    return a.rstrip("/") == b.rstrip("/")


def scripted_by_hand(owner: dict[str, Any] | None) -> bool:
    """Is the program on the port the scripted engine run with ``dsv41 sim`` (or ``python -m engine_manager.sim``)
    by this same user? That one was given the settings' key by ``dsv41 sim`` itself, so chatting with it sends
    the key nowhere new."""
    if not owner or not owner.get("pid"):
        return False
    try:
        import getpass
        me = getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name: do not guess
        return False
    if owner.get("user") != me:
        return False
    argv = [str(a) for a in owner.get("cmdline") or []]
    return any(get_engine(n).started_by_hand(argv) for n in STARTABLE)     # Engine.started_by_hand


def _is_loopback(base_url: str) -> bool:
    try:
        host = httpx.URL(base_url).host
    except (httpx.InvalidURL, TypeError, ValueError):
        return False
    return host in ("localhost", "::1") or host.startswith("127.")


def _engine_holds(st, owner: dict[str, Any] | None) -> bool:
    """Is the listener ``owner`` (:func:`engine_manager.supervisor.port_owner`) the engine the panel started and
    that ``st`` verified alive (keeper and engine pid + start time)? Its pid is the engine's, or a process of the
    engine's own process group (the keeper leads it; Linux never hands a live group's id to a new process)."""
    if st is None or st.owner != "panel" or not st.running or not owner or not owner.get("pid"):
        return False
    pid = int(owner["pid"])
    if st.pid and pid == st.pid:
        return True
    if st.pgid:
        import os
        try:
            return os.getpgid(pid) == st.pgid
        except OSError:
            return False
    return False


def check_target(settings, base_url: str, api_key: str | None, *, status=None) -> None:
    """Refuse (:class:`ChatError`) to send a chat, and with it the API key, to ``base_url`` unless the program
    listening there is known to be ours. Checked on the ports the panel counts as its engine's (the settings' port
    and the port of the engine it started), on loopback:

    - the listener is the engine the panel started (its verified pid, or a process of its group): allowed, unless
      that engine runs with another key than the one that would be sent (``key_mismatch``);
    - the scripted engine run by hand (``dsv41 sim``) by this user: allowed;
    - anything else — a program the panel did not start, one the system does not name, or a stranger listening
      where the panel's engine died — ``not_ours``; and when the status cannot be read at all, ``unknown``
      (fail closed). Nothing listening: silent (the request itself then says "No engine answers")."""
    st = status if status is not None else engine_status(settings)
    port = _port_of(base_url)
    ours_ports = {settings.port}
    if st is not None and st.owner == "panel" and st.base_url:
        ours_ports.add(_port_of(st.base_url))
    if port is None or port not in ours_ports or not _is_loopback(base_url):
        return
    from .procs import describe_owner, port_free, port_owner, suggest_port
    host = httpx.URL(base_url).host
    if port_free("127.0.0.1" if host == "localhost" else host, port):
        return                                   # nothing listens: the request says "No engine answers"
    owner = port_owner(host, port)
    if _engine_holds(st, owner):
        if st.key_matches is False and api_key and api_key == settings.api_key:
            raise ChatError(
                "key_mismatch",
                f"The engine the panel started (pid {st.pid}, {st.base_url}) runs with another API key than the one "
                f"in the settings now (api_key / DSV41_API_KEY), so it would refuse this one. Restart it so it "
                f"takes the current key (`dsv41 stop`, then `dsv41 start`; or Stop and Start in the panel), or put "
                f"the old key back.")
        return
    if scripted_by_hand(owner):
        return
    died = ""
    if st is not None and st.owner == "panel" and not st.running:
        died = (f" The engine the panel started there (pid {st.pid}) is not running any more"
                f"{f' ({st.state})' if st.state else ''}; another program took its port.")
    free = suggest_port(settings.host, settings.port)
    raise ChatError(
        "not_ours",
        f"Port {port} is held by {describe_owner(owner)}, not by an engine this panel started, so nothing was "
        f"sent there: not your question, not your API key.{died} Stop that program, or give the panel another port "
        f"(`dsv41 settings set port {free or 'N'}`{', free now' if free else ''}; or Settings in the panel) "
        f"and start the engine there (`dsv41 start`, or Start in the panel).")


def engine_target(settings, url: str | None = None, *, status=None) -> EngineTarget:
    """The engine ``dsv41 chat`` talks to, checked with :func:`check_target` before anything is sent:

    - ``url`` (``--url``): exactly that address, with the settings' key: the user named it;
    - the engine the panel started, when it is ready (its address from the state file, which survives a change
      of the port setting); still starting, or stopping: :class:`ChatError` ``unavailable``, nothing sent;
    - else the settings' host and port (an engine run with ``dsv41 sim``; or nothing, and the request says so).
    """
    if url:
        return EngineTarget(url.rstrip("/"), settings.api_key, "--url", explicit=True,
                            engine=_handle(None, url.rstrip("/"), settings.api_key))
    st = status if status is not None else engine_status(settings)
    if st is not None and st.owner == "panel" and st.running and st.base_url:
        name = st.label or st.engine or "engine"
        if st.state != "ready":
            doing = "is stopping" if st.state == "stopping" else f"is {st.state}, not ready yet"
            raise ChatError(
                "unavailable",
                f"The {name} the panel started {doing}{f' ({st.message})' if st.message else ''}, so nothing was "
                f"sent. Wait until `dsv41 status` says ready, then ask again"
                + (" (or start it again with `dsv41 start`)." if st.state == "stopping" else "."))
        check_target(settings, st.base_url, settings.api_key, status=st)
        where = f"the engine the panel started, {name}" + (" (simulated)" if st.simulated and
                                                           "simul" not in name.lower() else "")
        return EngineTarget(st.base_url, settings.api_key, where,
                            engine=_handle(st, st.base_url, settings.api_key))
    check_target(settings, settings.base_url, settings.api_key, status=st)
    where = "the settings (host, port, api_key)"
    by_hand = st is not None and st.external is not None and scripted_by_hand(st.external)
    if by_hand:
        where = f"the scripted engine run with `dsv41 sim` (pid {st.external.get('pid')})"
    return EngineTarget(settings.base_url, settings.api_key, where,
                        engine=_handle(None, settings.base_url, settings.api_key, simulated=by_hand,
                                       pid=st.external.get("pid") if by_hand else None))
