"""OpenAI chat-completions client for the engine (Strata, llama-server or the scripted engine), streaming.

``ChatClient.stream(messages, options, cancel)`` posts ``/v1/chat/completions`` with ``stream: true`` and yields
typed events as the Server-Sent Events arrive:

- :class:`StreamOpened` once the engine answered 200 with an event stream,
- :class:`ReasoningDelta` for ``delta.reasoning_content`` (the model's thinking),
- :class:`ContentDelta` for ``delta.content`` (the answer),
- :class:`FinishReason`, :class:`UsageInfo`, :class:`TimingsInfo` when the engine reports them,
- :class:`StreamDone` last, with :class:`StreamStats` measured on our side (time to first token, tok/s) beside the
  engine's own figures.

Anything that goes wrong raises :class:`ChatError` whose ``str()`` says in plain words what happened and what to do:
HTTP 400 / 401 / 409 / 503 with the engine's own message, an ``{"error": ...}`` frame in the middle of the stream,
the connection lost, the engine process gone, no data for longer than the read timeout.

Cancel: :class:`CancelToken.cancel` may be called from any thread. It shuts the stream's socket down, which wakes a
read blocked inside httpx at once (a plain flag would wait for the next token, or forever on a stalled engine); the
stream then ends with ``StreamDone(stats.cancelled=True)``.

Fields OpenAI does not define (``reasoning_effort``, ``strata_reproducible``, anything in ``ChatOptions.extra``) are
sent as top-level JSON keys of the request body, which is where Strata and llama-server read them.

The SSE framing is parsed by ``httpx-sse`` (a well-kept parser; it handles comments such as Strata's
``: keep-alive``, multi-line data and CRLF). Parsing costs a few microseconds per event, measured by
``benchmarks/chat_latency.py`` (far below a token's ~16 ms at 63 tok/s), so there is no reason to hand-write one.

:func:`run_turn` is one chat turn recorded into :mod:`engine_manager.history`: it stores the user's message, streams
the answer, saves the partial answer as it arrives (throttled, so a killed process loses at most about half a
second) and marks how it ended. The CLI and the GUI both drive it.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import httpx
from httpx_sse import EventSource, SSEError

from .errors import UserError

REASONING_EFFORTS = ("none", "low", "medium", "high")   # "none": answer without thinking
DEFAULT_CONNECT_TIMEOUT_S = 5.0
# Our tok/s needs tokens spread over at least this long: a burst read in one go has no meaningful rate (None).
MIN_RATE_SPAN_S = 0.25
# Strata sends ": keep-alive" comments while it reads a long prompt, so silence this long means a stalled engine.
DEFAULT_READ_TIMEOUT_S = 120.0


# ----------------------------------------------------------------------------------------------- options
@dataclass
class ChatOptions:
    """Per-request options. ``None`` means "leave it to the engine" and is not sent."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    reasoning_effort: str | None = None
    reproducible: bool = False           # Strata's strata_reproducible: bit-identical batched answers
    seed: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)   # more top-level body keys, sent as they are

    def body_fields(self) -> dict[str, Any]:
        """The request-body keys these options add (all top-level, never nested under ``extra_body``)."""
        out: dict[str, Any] = {}
        if self.max_tokens is not None:
            out["max_tokens"] = int(self.max_tokens)
        if self.temperature is not None:
            out["temperature"] = float(self.temperature)
        if self.top_p is not None:
            out["top_p"] = float(self.top_p)
        if self.reasoning_effort:
            out["reasoning_effort"] = str(self.reasoning_effort)
        if self.reproducible:
            out["strata_reproducible"] = True
        if self.seed is not None:
            out["seed"] = int(self.seed)
        out.update(self.extra)
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if not d["extra"]:
            d.pop("extra")
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "ChatOptions":
        d = dict(d or {})
        known = {k: d[k] for k in ("max_tokens", "temperature", "top_p", "reasoning_effort", "reproducible",
                                   "seed", "extra") if k in d}
        return cls(**known)


# ------------------------------------------------------------------------------------------------ events
@dataclass(frozen=True, slots=True)
class StreamOpened:
    status: int
    t: float                               # time.perf_counter() when the headers arrived


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    text: str
    t: float                               # time.perf_counter() when this chunk was parsed


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str
    t: float


@dataclass(frozen=True, slots=True)
class FinishReason:
    reason: str


@dataclass(frozen=True, slots=True)
class UsageInfo:
    prompt_tokens: int | None
    completion_tokens: int | None
    total_tokens: int | None


@dataclass(frozen=True, slots=True)
class TimingsInfo:
    """The engine's own timings (llama.cpp names), as the last chunk reports them."""

    prompt_n: int | None
    prompt_ms: float | None
    prompt_per_second: float | None
    predicted_n: int | None
    predicted_ms: float | None
    predicted_per_second: float | None


@dataclass
class StreamStats:
    """What one streamed answer measured. Times in seconds from sending the request; None = not seen."""

    ttft_s: float | None = None             # first token of any kind (reasoning or answer)
    first_content_s: float | None = None    # first token of the answer proper
    duration_s: float | None = None         # request sent → stream ended
    reasoning_chunks: int = 0
    content_chunks: int = 0
    tok_s: float | None = None              # measured here: chunks after the first / time since the first
                                            # (None when they all came within MIN_RATE_SPAN_S)
    completion_tokens: int | None = None    # the engine's usage, else our chunk count
    prompt_tokens: int | None = None
    engine_tok_s: float | None = None       # timings.predicted_per_second
    engine_prompt_tok_s: float | None = None
    finish_reason: str | None = None
    cancelled: bool = False
    timings: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "StreamStats":
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in dict(d or {}).items() if k in names})

    @property
    def tokens(self) -> int:
        if self.completion_tokens is not None:
            return self.completion_tokens
        return self.reasoning_chunks + self.content_chunks

    def summary(self) -> str:
        """``412 tokens · 18.4 tok/s · first token 0.61 s`` (units always, unknowns left out)."""
        parts = [f"{self.tokens} tokens"]
        if self.tok_s is not None:
            parts.append(f"{self.tok_s:.1f} tok/s")
        if self.engine_tok_s is not None:
            parts.append(f"engine {self.engine_tok_s:.1f} tok/s")
        if self.ttft_s is not None:
            parts.append(f"first token {self.ttft_s:.2f} s")
        return " · ".join(parts)


@dataclass(frozen=True, slots=True)
class StreamDone:
    stats: StreamStats


ChatEvent = StreamOpened | ReasoningDelta | ContentDelta | FinishReason | UsageInfo | TimingsInfo | StreamDone


# ------------------------------------------------------------------------------------------------ errors
class ChatError(UserError):
    """A chat request failed. ``str()`` is the message for a person; ``kind`` is for code:

    ``unreachable`` (nothing listens), ``bad_request`` (400), ``auth`` (401), ``busy`` (409), ``unavailable`` (503),
    ``http`` (another status), ``stream_error`` (an error frame mid-stream), ``connection_lost``, ``engine_died``,
    ``stalled`` (read timeout), ``protocol`` (not an event stream / not JSON).
    """

    def __init__(self, kind: str, message: str, *, status: int | None = None, engine_message: str | None = None):
        super().__init__(message)
        self.kind, self.status, self.engine_message = kind, status, engine_message

    @property
    def message(self) -> str:
        return str(self)


def _engine_message(payload: Any) -> str | None:
    """The human part of ``{"error": {"message": ..., "type": ...}}`` / ``{"error": "..."}`` / ``{"detail": ...}``."""
    if isinstance(payload, Mapping):
        err = payload.get("error", payload.get("detail", payload.get("message")))
        if isinstance(err, Mapping):
            msg = err.get("message") or err.get("detail") or err.get("type") or err.get("code")
            typ = err.get("type") or err.get("code")
            if msg and typ and str(typ) not in str(msg):
                return f"{msg} ({typ})"
            return str(msg) if msg else json.dumps(err)[:500]
        if err is not None:
            return str(err)
    if isinstance(payload, str) and payload.strip():
        return payload.strip()[:500]
    return None


def http_error(status: int, body_text: str, base_url: str) -> ChatError:
    try:
        payload: Any = json.loads(body_text) if body_text else None
    except ValueError:
        payload = body_text
    msg = _engine_message(payload)
    said = f" The engine said: {msg.rstrip('.')}." if msg else ""
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
        text = (f"The engine is busy (HTTP 409): all its slots are answering other requests.{said} Wait for an "
                f"answer to finish, or start the engine with more slots.")
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
class CancelToken:
    """Cancel a stream from any thread. Callbacks registered by the stream run once, on :meth:`cancel`."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self.reason: str = "stopped"

    def cancel(self, reason: str = "stopped") -> None:
        with self._lock:
            if self._event.is_set():
                return
            self.reason = reason
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            try:
                cb()
            except Exception:  # noqa: BLE001 - a closing socket may complain; cancel must not
                pass

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def on_cancel(self, cb: Callable[[], None]) -> None:
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(cb)
                return
        cb()

    def remove(self, cb: Callable[[], None]) -> None:
        with self._lock:
            try:
                self._callbacks.remove(cb)
            except ValueError:
                pass


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
            with httpx.Client(trust_env=False, timeout=timeout_s) as c:
                c.get(base_url.rstrip("/") + "/health")
            return True
        except httpx.HTTPError:
            if i + 1 < tries:
                time.sleep(0.2)
    return False


def _num(d: Mapping[str, Any], key: str, cast=float):
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return cast(v)


class ChatClient:
    """A chat client for one engine. Thread-safe: each :meth:`stream` opens its own connection (no keep-alive
    pool), so that cancel can shut exactly that connection's socket."""

    def __init__(self, base_url: str, api_key: str | None, *, model: str | None = None,
                 connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
                 read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
                 engine_alive: Callable[[], bool] | None = None):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.engine_alive = engine_alive
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(
            base_url=self.base_url, headers=headers, trust_env=False,
            timeout=httpx.Timeout(connect=connect_timeout_s, read=read_timeout_s, write=30.0, pool=5.0),
            limits=httpx.Limits(max_keepalive_connections=0),
        )
        self.read_timeout_s = read_timeout_s

    # -- plumbing ---------------------------------------------------------------------------------------
    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "ChatClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def health(self, timeout_s: float = 3.0) -> dict[str, Any]:
        """``GET /health`` as a dict; raises :class:`ChatError` (``unreachable`` / ``http``)."""
        try:
            r = self._http.get("/health", timeout=timeout_s)
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from exc
        if r.status_code != 200:
            raise http_error(r.status_code, r.text, self.base_url)
        try:
            data = r.json()
        except ValueError:
            data = {}
        return data if isinstance(data, dict) else {}

    def _unreachable(self, exc: BaseException) -> ChatError:
        return ChatError(
            "unreachable",
            f"No engine answers at {self.base_url} ({exc.__class__.__name__}). Start the engine (Start in the panel, "
            f"or `dsv41 engine start`) and wait until it says ready.",
        )

    def _broken(self, exc: BaseException, got_any: bool) -> ChatError:
        alive = self.engine_alive() if self.engine_alive is not None else _engine_answers(self.base_url)
        where = "while answering" if got_any else "before answering"
        if not alive:
            return ChatError("engine_died",
                             f"The engine stopped {where} (its port {self.base_url} no longer answers). What arrived "
                             f"is kept; look at the engine's log for why, start it again, then press Regenerate.")
        return ChatError("connection_lost",
                         f"The connection to the engine was lost {where} ({exc.__class__.__name__}: {exc}). What "
                         f"arrived is kept; press Regenerate to ask again.")

    def request_body(self, messages: Sequence[Mapping[str, Any]], options: ChatOptions | None = None) -> dict:
        body: dict[str, Any] = {"messages": [dict(m) for m in messages], "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.model:
            body["model"] = self.model
        body.update((options or ChatOptions()).body_fields())
        return body

    # -- the stream -------------------------------------------------------------------------------------
    def stream(self, messages: Sequence[Mapping[str, Any]], options: ChatOptions | None = None,
               cancel: CancelToken | None = None) -> Iterator[ChatEvent]:
        """Post the chat and yield events as they arrive (see the module docstring)."""
        cancel = cancel or CancelToken()
        stats = StreamStats()
        body = self.request_body(messages, options)
        sockets: list[socket.socket] = []

        def trace(name: str, info: dict[str, Any]) -> None:
            # httpcore reports the new connection: keep its socket so cancel can shut it down mid-read.
            if name == "connection.connect_tcp.complete":
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
        got_any = False
        saw_end = False
        t_first: float | None = None
        t_last: float | None = None
        n_chunks = 0
        try:
            try:
                with self._http.stream("POST", "/v1/chat/completions", json=body,
                                       headers={"Accept": "text/event-stream", "Cache-Control": "no-store"},
                                       extensions={"trace": trace}) as response:
                    if response.status_code != 200:
                        text = response.read().decode("utf-8", "replace")
                        raise http_error(response.status_code, text, self.base_url)
                    yield StreamOpened(response.status_code, time.perf_counter())
                    source = EventSource(response)
                    for sse in source.iter_sse():
                        data = sse.data
                        if not data:
                            continue
                        if data.strip() == "[DONE]":
                            saw_end = True
                            break
                        now = time.perf_counter()
                        try:
                            chunk = json.loads(data)
                        except ValueError as exc:
                            raise ChatError("protocol", f"The engine sent a frame that is not JSON: {data[:200]!r}"
                                            ) from exc
                        if not isinstance(chunk, dict):
                            continue
                        if "error" in chunk:
                            msg = _engine_message(chunk) or "no details"
                            raise ChatError(
                                "stream_error",
                                f"The engine reported an error {'while answering' if got_any else 'before answering'}:"
                                f" {msg}. What arrived is kept; press Regenerate to try again.",
                                engine_message=msg)
                        for choice in chunk.get("choices") or ():
                            delta = choice.get("delta") or {}
                            r = delta.get("reasoning_content") or delta.get("reasoning")
                            c = delta.get("content")
                            if r or c:
                                n_chunks += 1
                                t_last = now
                                if t_first is None:
                                    t_first = now
                                    stats.ttft_s = now - t0
                                got_any = True
                            if r:
                                stats.reasoning_chunks += 1
                                yield ReasoningDelta(r, now)
                            if c:
                                stats.content_chunks += 1
                                if stats.first_content_s is None:
                                    stats.first_content_s = now - t0
                                yield ContentDelta(c, now)
                            fr = choice.get("finish_reason")
                            if fr:
                                stats.finish_reason = str(fr)
                                yield FinishReason(str(fr))
                        usage = chunk.get("usage")
                        if isinstance(usage, Mapping):
                            u = UsageInfo(_num(usage, "prompt_tokens", int), _num(usage, "completion_tokens", int),
                                          _num(usage, "total_tokens", int))
                            stats.prompt_tokens = u.prompt_tokens
                            stats.completion_tokens = u.completion_tokens
                            yield u
                        timings = chunk.get("timings")
                        if isinstance(timings, Mapping):
                            ti = TimingsInfo(_num(timings, "prompt_n", int), _num(timings, "prompt_ms"),
                                             _num(timings, "prompt_per_second"), _num(timings, "predicted_n", int),
                                             _num(timings, "predicted_ms"), _num(timings, "predicted_per_second"))
                            stats.timings = dict(timings)
                            stats.engine_tok_s = ti.predicted_per_second
                            stats.engine_prompt_tok_s = ti.prompt_per_second
                            yield ti
                        if cancel.cancelled:
                            break
                    if not saw_end and not cancel.cancelled and stats.finish_reason is None:
                        # A body that just ends (no [DONE], no finish_reason) is a server that went away.
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
                        f"kept; look at the engine's state and log, then press Regenerate.") from exc
            except httpx.TransportError as exc:
                if cancel.cancelled:
                    stats.cancelled = True
                else:
                    raise self._broken(exc, got_any) from exc
        finally:
            cancel.remove(on_cancel)
        if cancel.cancelled:
            stats.cancelled = True
        end = time.perf_counter()
        stats.duration_s = end - t0
        if n_chunks >= 2 and t_first is not None and t_last is not None and t_last - t_first >= MIN_RATE_SPAN_S:
            stats.tok_s = (n_chunks - 1) / (t_last - t_first)
        if stats.completion_tokens is None:
            stats.completion_tokens = n_chunks if not stats.cancelled else None
        yield StreamDone(stats)

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


# ------------------------------------------------------------------------------------------------ one turn
@dataclass(frozen=True)
class TurnStarted:
    conversation_id: int
    assistant_message_id: int
    user_message_id: int | None
    messages: list                          # history.Message list as stored now (the answer is the last one)


@dataclass(frozen=True)
class TurnEnded:
    conversation_id: int
    assistant_message_id: int
    status: str                             # history status: complete, stopped, interrupted, error
    error: str | None
    error_kind: str | None
    stats: StreamStats
    content: str
    reasoning: str


def run_turn(store, conversation_id: int | None, *, base_url: str, api_key: str | None,
             options: ChatOptions | None = None, user_text: str | None = None, mode: str = "send",
             edit_message_id: int | None = None, cancel: CancelToken | None = None, model: str | None = None,
             read_timeout_s: float = DEFAULT_READ_TIMEOUT_S, flush_interval_s: float = 0.5,
             engine_alive: Callable[[], bool] | None = None, system_prompt: str | None = None,
             ) -> Iterator[TurnStarted | ChatEvent | TurnEnded]:
    """One chat turn, recorded. ``mode``: ``send`` (append ``user_text``), ``regenerate`` (drop the answers after
    the last user message and ask again) or ``edit`` (replace message ``edit_message_id`` with ``user_text``, drop
    what followed it, ask again). ``conversation_id=None`` creates a conversation.

    Yields :class:`TurnStarted`, then the stream's events, then :class:`TurnEnded` — always, also on errors (which
    are in ``TurnEnded.error``), so a caller never has to catch. The answer is saved as it streams: at most every
    ``flush_interval_s`` seconds, and at the end.
    """
    from .history import (
        STATUS_COMPLETE,
        STATUS_ERROR,
        STATUS_INTERRUPTED,
        STATUS_STOPPED,
    )

    options = options or ChatOptions()
    cancel = cancel or CancelToken()
    if conversation_id is None:
        conversation_id = store.create_conversation(options=options.to_dict())
    user_id = None
    if mode == "send":
        if not user_text or not user_text.strip():
            raise ValueError("nothing to send: the message is empty")
        user_id = store.add_message(conversation_id, "user", user_text)
    elif mode == "regenerate":
        user_id = store.drop_trailing_answers(conversation_id)
        if user_id is None:
            raise ValueError("nothing to regenerate: the conversation has no message of yours")
    elif mode == "edit":
        if edit_message_id is None or not user_text or not user_text.strip():
            raise ValueError("edit needs the message and its new text")
        store.edit_message(conversation_id, edit_message_id, user_text)
        user_id = edit_message_id
    else:
        raise ValueError(f"unknown mode {mode!r}")
    store.set_conversation_options(conversation_id, options.to_dict())
    context = store.context_messages(conversation_id)
    if system_prompt:
        context = [{"role": "system", "content": system_prompt}, *context]
    recorder = store.begin_answer(conversation_id, options=options.to_dict(), model=model)
    yield TurnStarted(conversation_id, recorder.message_id, user_id, store.messages(conversation_id))

    stats = StreamStats()
    status, error, error_kind = STATUS_COMPLETE, None, None
    client = ChatClient(base_url, api_key, model=model, read_timeout_s=read_timeout_s, engine_alive=engine_alive)
    try:
        for ev in client.stream(context, options, cancel):
            if isinstance(ev, ContentDelta):
                recorder.add_content(ev.text)
            elif isinstance(ev, ReasoningDelta):
                recorder.add_reasoning(ev.text)
            elif isinstance(ev, StreamDone):
                stats = ev.stats
            if recorder.due(flush_interval_s):
                recorder.flush()
            yield ev
        if stats.cancelled:
            if cancel.reason == "shutdown":
                status, error = STATUS_INTERRUPTED, "The panel was closed while the answer streamed."
            else:
                status, error = STATUS_STOPPED, "Stopped by you."
            error_kind = "cancelled"
    except ChatError as exc:
        error, error_kind = str(exc), exc.kind
        status = STATUS_INTERRUPTED if recorder.has_text else STATUS_ERROR
    except GeneratorExit:
        recorder.finish(STATUS_INTERRUPTED, stats.to_dict(), "The answer's reader went away.")
        client.close()
        raise
    except Exception as exc:  # noqa: BLE001 - anything else still ends the turn and is recorded
        error, error_kind = f"{exc.__class__.__name__}: {exc}", "internal"
        status = STATUS_INTERRUPTED if recorder.has_text else STATUS_ERROR
    finally:
        client.close()
    recorder.finish(status, stats.to_dict(), error)
    yield TurnEnded(conversation_id, recorder.message_id, status, error, error_kind, stats, recorder.content,
                    recorder.reasoning)
