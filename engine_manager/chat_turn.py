"""One chat turn recorded into the history: :func:`run_turn` (the CLI and the GUI both drive it).

Once the engine accepted the request it stores the user's message, streams the answer through
:class:`engine_manager.chat.ChatClient`, saves the partial answer as it arrives (throttled, so a killed process loses
at most about half a second) and marks how it ended; a request refused before that leaves the history as it was.

Imports go one way: this module uses :mod:`engine_manager.chat` and :mod:`engine_manager.history`; neither imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Generator

from .chat import DEFAULT_READ_TIMEOUT_S, FIRST_TOKEN_DEADLINE_S, CancelToken, ChatClient, ChatError
from .chat_events import (
    ChatEvent,
    ChatOptions,
    ContentDelta,
    ReasoningDelta,
    StreamDone,
    StreamOpened,
    StreamStats,
)
from .errors import UserError
from .history import STATUS_COMPLETE, STATUS_ERROR, STATUS_INTERRUPTED, STATUS_STOPPED, AnswerRecorder

if TYPE_CHECKING:
    from .engine_state import RunningEngine


@dataclass(frozen=True)
class TurnStarted:
    """The engine accepted the request (HTTP 200, an event stream): the turn is in the history now."""

    conversation_id: int
    assistant_message_id: int
    user_message_id: int | None
    messages: list                          # history.Message list as stored now (the answer is the last one)


@dataclass(frozen=True)
class TurnEnded:
    conversation_id: int | None             # None: the turn would have created it, and nothing was kept
    assistant_message_id: int | None        # None when nothing was kept
    status: str                             # history status: complete, stopped, interrupted, error
    error: str | None
    error_kind: str | None
    stats: StreamStats
    content: str
    reasoning: str
    saved: bool = True                      # False: the history is as it was before the turn (see run_turn)


def _plan_context(store, conversation_id: int | None, mode: str, user_text: str | None,
                  edit_message_id: int | None) -> list[dict[str, str]]:
    """The messages a turn sends, read without changing the history; raises ValueError / HistoryError when the
    turn cannot be asked at all."""
    if mode == "send":
        if not user_text or not user_text.strip():
            raise ValueError("nothing to send: the message is empty")
        if conversation_id is not None:
            store.get_conversation(conversation_id)         # HistoryError (in plain words) when it is gone
        prior = store.context_messages(conversation_id) if conversation_id is not None else []
        return [*prior, {"role": "user", "content": user_text}]
    if conversation_id is None:
        raise ValueError(f"{mode} needs a saved conversation")
    msgs = store.get_conversation(conversation_id).messages
    if mode == "regenerate":
        last_user = next((m for m in reversed(msgs) if m.role == "user"), None)
        if last_user is None:
            raise ValueError("nothing to regenerate: the conversation has no message of yours")
        store.refuse_if_streaming(conversation_id, after=last_user.id)
        return store.context_messages(conversation_id, through_id=last_user.id)
    if mode == "edit":
        if edit_message_id is None or not user_text or not user_text.strip():
            raise ValueError("edit needs the message and its new text")
        target = next((m for m in msgs if m.id == edit_message_id), None)
        if target is None:
            raise ValueError(f"message {edit_message_id} is not in conversation {conversation_id}")
        if target.role != "user":
            raise ValueError("only your own messages can be edited and sent again")
        store.refuse_if_streaming(conversation_id, after=edit_message_id)
        before = store.context_messages(conversation_id, through_id=edit_message_id)[:-1]
        return [*before, {"role": "user", "content": user_text}]
    raise ValueError(f"unknown mode {mode!r}")


def run_turn(store, conversation_id: int | None, *, engine: RunningEngine,
             options: ChatOptions | None = None, user_text: str | None = None, mode: str = "send",
             edit_message_id: int | None = None, cancel: CancelToken | None = None, model: str | None = None,
             read_timeout_s: float = DEFAULT_READ_TIMEOUT_S, flush_interval_s: float = 0.5,
             engine_alive: Callable[[], bool] | None = None, system_prompt: str | None = None,
             first_token_deadline_s: float = FIRST_TOKEN_DEADLINE_S,
             ) -> Generator[TurnStarted | ChatEvent | TurnEnded, None, None]:
    """One chat turn, recorded. ``mode``: ``send`` (append ``user_text``), ``regenerate`` (replace the answers
    after the last user message) or ``edit`` (replace message ``edit_message_id`` with ``user_text`` and what
    followed it). ``conversation_id=None`` creates a conversation. The engine is ``engine`` (the
    :class:`~engine_manager.engine_state.RunningEngine` handle; an engine reached by URL alone is
    ``RunningEngine(base_url, api_key)``).

    Nothing is written until the engine has accepted the request (HTTP 200 with an event stream): a request that
    fails before that (nothing listens, 401, 409, 503, 400 …) leaves the history exactly as it was (no new
    conversation, no question, no earlier answer dropped) and ends with ``TurnEnded(saved=False)`` — the caller
    still has the question (the pane puts it back in the composer; the CLI has it on its command line). Once
    accepted, the writes happen (conversation, question, the dropped answers of regenerate / edit) and
    :class:`TurnStarted` is yielded; the answer is then saved as it streams (at most every ``flush_interval_s``
    seconds, and at the end). A new question whose answer then fails before a single token arrived is taken back
    out again (the conversation too, when this turn created it): ``saved=False`` as well.

    The system prompt is ``options.system`` (``system_prompt``, when given, replaces it; ``""`` removes it): sent
    as the first message and kept with the conversation's options, so a conversation continued later keeps it.

    Yields the stream's events, :class:`TurnStarted` right after :class:`StreamOpened`, and :class:`TurnEnded`
    last — always, also on errors (``TurnEnded.error``), so a caller never has to catch a :class:`ChatError`.
    Raises ValueError / ``HistoryError`` before anything is sent when the turn cannot be asked at all.
    """
    url, key = engine.base_url, engine.api_key
    options = options or ChatOptions()
    if system_prompt is not None:
        options = replace(options, system=system_prompt if system_prompt.strip() else None)
    cancel = cancel or CancelToken()
    context = _plan_context(store, conversation_id, mode, user_text, edit_message_id)
    if options.system:
        context = [{"role": "system", "content": options.system}, *context]

    created = False
    user_id: int | None = None
    recorder: AnswerRecorder | None = None
    n_reasoning = n_content = 0          # deltas seen: the token count if the stream ends without stats

    def accept() -> TurnStarted:
        nonlocal conversation_id, created, user_id, recorder
        if conversation_id is None:
            conversation_id = store.create_conversation(options=options.to_dict())
            created = True
        if mode == "send":
            user_id = store.add_message(conversation_id, "user", user_text)
        elif mode == "regenerate":
            user_id = store.drop_trailing_answers(conversation_id)
        else:
            store.edit_message(conversation_id, edit_message_id, user_text)
            user_id = edit_message_id
        store.set_conversation_options(conversation_id, options.to_dict())
        recorder = store.begin_answer(conversation_id, options=options.to_dict(), model=model)
        return TurnStarted(conversation_id, recorder.message_id, user_id, store.messages(conversation_id))

    stats = StreamStats()
    status, error, error_kind = STATUS_COMPLETE, None, None
    client = ChatClient(url, key, model=model, read_timeout_s=read_timeout_s, engine_alive=engine_alive,
                        first_token_deadline_s=first_token_deadline_s)
    events = client.stream(context, options, cancel)
    try:
        for ev in events:
            if isinstance(ev, StreamOpened):
                started = accept()
                yield started
                yield ev
                continue
            # the recorder is there from StreamOpened on: the client yields it before any delta
            if isinstance(ev, ContentDelta):
                n_content += 1
                if recorder is not None:
                    recorder.add_content(ev.text)
            elif isinstance(ev, ReasoningDelta):
                n_reasoning += 1
                if recorder is not None:
                    recorder.add_reasoning(ev.text)
            elif isinstance(ev, StreamDone):
                stats = ev.stats
            if recorder is not None and recorder.due(flush_interval_s):
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
        stats = exc.stats or stats
        status = STATUS_INTERRUPTED if recorder is not None and recorder.has_text else STATUS_ERROR
    except GeneratorExit:
        if recorder is not None:
            recorder.finish(STATUS_INTERRUPTED, StreamStats(reasoning_chunks=n_reasoning, content_chunks=n_content,
                                                            completion_tokens=n_reasoning + n_content).to_dict(),
                            "The answer's reader went away.")
        raise
    except UserError as exc:     # e.g. the history refused the writes (another program streams an answer there)
        error, error_kind = str(exc), "refused"
        status = STATUS_INTERRUPTED if recorder is not None and recorder.has_text else STATUS_ERROR
    except Exception as exc:  # noqa: BLE001 - anything else still ends the turn and is recorded
        # in words, never Python's own text ("'str' object has no attribute 'get'") in the history or a terminal
        error, error_kind = (f"The panel could not handle the engine's answer (an internal error, "
                             f"{exc.__class__.__name__}). What arrived is kept; ask again, and report it if it "
                             f"happens again."), "internal"
        status = STATUS_INTERRUPTED if recorder is not None and recorder.has_text else STATUS_ERROR
    finally:
        events.close()
        client.close()
    if stats.reasoning_chunks + stats.content_chunks < n_reasoning + n_content:
        stats.reasoning_chunks, stats.content_chunks = n_reasoning, n_content
    if recorder is None:
        # refused before the engine accepted it: nothing was written (or the writes failed half-way: undone)
        if created:
            try:
                store.delete(conversation_id)
            except UserError:
                pass
            conversation_id = None
        yield TurnEnded(conversation_id, None, status, error, error_kind, stats, "", "", saved=False)
        return
    if mode == "send" and status in (STATUS_ERROR, STATUS_STOPPED) and not recorder.has_text:
        # accepted, then failed (or stopped) before one token arrived: take the question back out
        recorder.finish(status, stats.to_dict(), error)
        if created:
            store.delete(conversation_id)
            conversation_id = None
        else:
            store.delete_messages(conversation_id, [m for m in (user_id, recorder.message_id) if m is not None])
        yield TurnEnded(conversation_id, None, status, error, error_kind, stats, "", "", saved=False)
        return
    recorder.finish(status, stats.to_dict(), error)
    yield TurnEnded(conversation_id, recorder.message_id, status, error, error_kind, stats, recorder.content,
                    recorder.reasoning)
