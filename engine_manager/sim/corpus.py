"""The scripted engine's text: a small built-in corpus, and a reply that echoes the question's topic.

Replies are deterministic for a given question (seeded by its hash), made of a short "reasoning" part (streamed
as ``reasoning_content``) and an answer (streamed as ``content``); a reply never repeats a sentence until it has
used every sentence of the corpus. A token is a word with its trailing space.
"""

from __future__ import annotations

import hashlib
import random
import re

_STOP = set("""a an the and or but if then else of to in on at for from by with about as is are was were be been
being do does did can could would should will shall may might must it its this that these those what which who
whom whose why how when where there here i me my we our you your he she they them their please tell explain
describe give show write make let us just some any more most very much many few into over under than also not no
yes so such only own same other each both all hi hello hey thanks thank""".split())

REASONING = [
    "The user asks about {topic}.",
    "I should answer plainly and keep it short.",
    "Start from what is known, then say what follows from it.",
    "A mixture-of-experts model only runs a few experts for each token, so most of its weights sit idle.",
    "The experts that are used most can live in VRAM and the rest in system RAM.",
    "Check that the answer is consistent with the question before writing it.",
    "An example will make it concrete.",
]

ANSWER = [
    "Here is a short answer about {topic}.",
    "This reply comes from the scripted engine: no model computed it, and its speed is simulated.",
    "A mixture-of-experts layer routes every token to a handful of its experts, here six of three hundred "
    "and eighty-four.",
    "Keeping the most used experts on the GPU means about nine in ten expert lookups never leave VRAM.",
    "The remaining experts are computed by CPU threads from pinned system memory.",
    "When several users decode at once they share one step, so the total rate rises while each user's falls.",
    "Binding the engine to the GPU's NUMA node keeps the CPU experts' memory traffic local.",
    "A hot set that follows the traffic swaps experts over PCIe when the topic changes.",
    "On {topic}, the practical advice is to measure first and change one thing at a time.",
]
CLOSER = "That is the gist of it; ask again for more detail."      # only ever the last sentence

_TOKEN = re.compile(r"\S+\s*")


def topic_of(text: str, max_words: int = 5) -> str:
    """A few content words of the question, in order: what the reply echoes."""
    words = re.findall(r"[A-Za-z0-9][A-Za-z0-9'_.-]*", text or "")
    picked = [w.strip(".'") for w in words if w.lower() not in _STOP and len(w) > 1]
    return " ".join(picked[:max_words]) or "your question"


def _seed(text: str) -> int:
    return int.from_bytes(hashlib.sha256((text or "").encode("utf-8", "replace")).digest()[:8], "little")


def _picks(rng: random.Random, pool: list[str], n: int) -> list[str]:
    """``n`` sentences of ``pool`` without repeating one until all were used (a fresh order each round), and never
    the same sentence twice in a row across rounds."""
    out: list[str] = []
    while len(out) < n:
        order = rng.sample(pool, len(pool))
        if out and len(order) > 1 and order[0] == out[-1]:
            order.append(order.pop(0))
        out.extend(order)
    return out[:n]


def script(question: str, reasoning: bool = True, reply_tokens: int | None = None) -> tuple[list[str], list[str]]:
    """(reasoning pieces, answer pieces) for a question: deterministic per question (seeded by its hash), no
    sentence repeated within a reply until every sentence of the corpus was used. ``reply_tokens`` forces the total
    length (the answer runs on through fresh orderings of the corpus), as a benchmark wants."""
    topic = topic_of(question)
    rng = random.Random(_seed(question))
    n_reason = 2 + rng.randrange(3) if reasoning else 0
    n_answer = 4 + rng.randrange(4)
    close = rng.random() < 0.5
    r_lines = ([REASONING[0]] + _picks(rng, REASONING[1:], n_reason - 1)) if n_reason else []
    total = max(1, int(reply_tokens)) if reply_tokens is not None else 0
    # one stream of picks: a forced length continues the same reply (its first sentences are the normal reply's)
    picks = _picks(rng, ANSWER[1:], n_answer - 1 + (total // 4 + len(ANSWER) if reply_tokens is not None else 0))
    a_lines = [ANSWER[0]] + picks[:n_answer - 1] + ([CLOSER] if close else [])
    r_text = " ".join(s.format(topic=topic) for s in r_lines)
    r_pieces = _TOKEN.findall(r_text + " ") if r_text else []
    if reply_tokens is None:
        a_pieces = _TOKEN.findall(" ".join(s.format(topic=topic) for s in a_lines))
    else:
        n_r = min(len(r_pieces), total // 4) if reasoning else 0
        r_pieces = r_pieces[:n_r]
        a_pieces = _TOKEN.findall(" ".join(s.format(topic=topic) for s in [ANSWER[0], *picks]) + " ")
        while len(a_pieces) < total - n_r:          # (only a corpus of very short sentences gets here)
            a_pieces += a_pieces
        a_pieces = a_pieces[: total - n_r]
    if a_pieces:
        a_pieces[-1] = a_pieces[-1].rstrip()
    return r_pieces, a_pieces


def count_tokens(text: str) -> int:
    """Rough prompt token count: about four characters per token, at least one per word."""
    if not text:
        return 0
    return max(len(text) // 4, len(_TOKEN.findall(text)))
