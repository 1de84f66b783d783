"""What a chat stream carries, with no client attached: the request options and the typed events of one streamed
answer (deltas, finish reason, the engine's usage and timings, our own :class:`StreamStats`).

:mod:`engine_manager.chat` (the client) yields these, :mod:`engine_manager.chat_turn` (one recorded turn) and
:mod:`engine_manager.history` (which stores ``StreamStats`` with an answer) read them; this module imports neither,
so the client, the turn and the history import in one direction only. Everything here is re-exported by
:mod:`engine_manager.chat`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

REASONING_EFFORTS = ("none", "low", "medium", "high")   # "none": answer without thinking
# Our tok/s needs tokens spread over at least this long: a burst read in one go has no meaningful rate (None).
MIN_RATE_SPAN_S = 0.25


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
    # the conversation's system prompt: sent as the first message (never a body key), kept with the conversation's
    # options so that a conversation continued later (the pane, `dsv41 chat --conversation`) keeps it
    system: str | None = None

    def body_fields(self) -> dict[str, Any]:
        """The request-body keys these options add (all top-level, never nested under ``extra_body``; the system
        prompt is a message, not a key)."""
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
        if not d["system"]:
            d.pop("system")
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "ChatOptions":
        d = dict(d or {})
        known = {k: d[k] for k in ("max_tokens", "temperature", "top_p", "reasoning_effort", "reproducible",
                                   "seed", "extra") if k in d}
        system = d.get("system")
        return cls(**known, system=system if isinstance(system, str) and system.strip() else None)


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

    def end_note(self, max_tokens: int | None, *, gui: bool = False) -> str | None:
        """Why an answer that ended by itself ended early, in words (None: it simply finished). ``gui`` names the
        window's Options instead of ``--max-tokens``. "length": the count decides — an engine also says it when its
        context is full (Strata's fit_max_tokens shortens max_tokens to the room left), and Strata when a reply
        repeats one token 256 times in a row or its thinking loops (serve/server.py@2291cb3 Service.run).
        "time_limit": the InferenceKey backend answered before the worker's limit per request
        (engine_manager.inferencekey.backend REQUEST_LIMIT_S)."""
        if self.finish_reason == "time_limit":
            return ("answered before the InferenceKey worker's time limit per request: ask for fewer tokens"
                    + (" in Options" if gui else " (--max-tokens)"))
        if self.finish_reason != "length":
            return None
        limit = (f"max tokens ({max_tokens})" if max_tokens else "max tokens") if gui else \
            (f"--max-tokens {max_tokens}" if max_tokens else "--max-tokens")
        if not max_tokens or self.tokens >= max_tokens:
            return (f"cut at {limit}: raise it in Options for a longer answer" if gui else
                    f"stopped at {limit}: raise it for a longer answer")
        return (f"the engine ended the answer at {self.tokens} tokens, before {limit}, saying \"length\": its "
                f"context was full, or (Strata) the reply repeated one token 256 times in a row or its thinking "
                f"looped; the engine's log says which")


@dataclass(frozen=True, slots=True)
class StreamDone:
    stats: StreamStats


ChatEvent = StreamOpened | ReasoningDelta | ContentDelta | FinishReason | UsageInfo | TimingsInfo | StreamDone
