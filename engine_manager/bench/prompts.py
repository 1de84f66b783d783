"""Deterministic prompts for the benchmark.

A prompt is made of words drawn from a fixed vocabulary by a seeded generator, so the same ``(seed, words)`` gives
the same text on every machine and every run. Engines count tokens their own way, so the bench never trusts a
word count: the warm-up request measures the engine's tokens per word (its ``usage.prompt_tokens`` for a known
prompt, less the chat template's overhead measured with a one-word prompt), later prompts are sized with that ratio,
and every request's ``usage.prompt_tokens`` is checked against the length it was meant to have
(:func:`length_check`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# Plain everyday English words (no digits, no punctuation): every tokenizer splits them into few tokens. They are
# chosen to name no topic of the scripted engine's corpus (sim/corpus.py), so its routing is the general one the
# guides' table was measured with (a prompt about experts or NUMA would route through a drifted topic).
VOCABULARY = (
    "the quiet river runs past old stone houses where children play in the garden after school while their "
    "parents walk slowly along the road to the market and buy bread fruit and fresh fish for dinner a small dog "
    "sleeps under the wooden table near the window as the evening light turns golden over the green hills and "
    "the village bell rings twice before the rain begins to fall softly on the roofs people talk about the "
    "weather the harvest and the long summer days that are coming back again with warm winds and bright skies"
).split()

PROMPT_TOLERANCE = 0.10      # a prompt whose engine-counted length is off by more than this is flagged


def words(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(VOCABULARY) for _ in range(max(1, int(n_words))))


def messages(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@dataclass
class TokenRatio:
    """How the engine counts: ``prompt_tokens ≈ overhead + per_word · words``."""

    per_word: float = 1.0
    overhead: int = 0
    measured: bool = False

    def words_for(self, tokens: int) -> int:
        return max(1, int(round((tokens - self.overhead) / max(self.per_word, 1e-6))))

    def expected(self, n_words: int) -> int:
        return int(round(self.overhead + self.per_word * n_words))

    def to_dict(self) -> dict:
        return {"per_word": round(self.per_word, 4), "overhead": self.overhead, "measured": self.measured}


def calibrate(short_tokens: int | None, long_tokens: int | None, long_words: int) -> TokenRatio:
    """The ratio from two measured requests: a one-word prompt (the template overhead) and a ``long_words``
    prompt. Missing figures (an engine that reports no usage) leave the 1-token-per-word guess, marked unmeasured."""
    if not short_tokens or not long_tokens or long_tokens <= short_tokens or long_words <= 1:
        return TokenRatio()
    per_word = (long_tokens - short_tokens) / (long_words - 1)
    return TokenRatio(per_word=per_word, overhead=max(0, int(round(short_tokens - per_word))), measured=True)


def length_check(wanted: int, got: int | None) -> dict:
    """``{"wanted", "got", "ratio", "ok"}``: ``ok`` None when the engine did not say."""
    if got is None or wanted <= 0:
        return {"wanted": wanted, "got": got, "ratio": None, "ok": None}
    ratio = got / wanted
    return {"wanted": wanted, "got": got, "ratio": round(ratio, 4), "ok": abs(ratio - 1.0) <= PROMPT_TOLERANCE}
