"""The scripted engine's text: a small built-in corpus, and a reply that echoes the question's topic.

Replies are deterministic for a given question (seeded by its hash), made of a short "reasoning" part (streamed
as ``reasoning_content``) and an answer (streamed as ``content``). A token is a word with its trailing space.
"""

from __future__ import annotations

import hashlib
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
    "That is the gist of it; ask again for more detail.",
]

_TOKEN = re.compile(r"\S+\s*")


def topic_of(text: str, max_words: int = 5) -> str:
    """A few content words of the question, in order: what the reply echoes."""
    words = re.findall(r"[A-Za-z0-9][A-Za-z0-9'_.-]*", text or "")
    picked = [w.strip(".'") for w in words if w.lower() not in _STOP and len(w) > 1]
    return " ".join(picked[:max_words]) or "your question"


def _seed(text: str) -> int:
    return int.from_bytes(hashlib.sha256((text or "").encode("utf-8", "replace")).digest()[:8], "little")


def script(question: str, reasoning: bool = True, reply_tokens: int | None = None) -> tuple[list[str], list[str]]:
    """(reasoning pieces, answer pieces) for a question. ``reply_tokens`` forces the total length (pieces
    cycle through the corpus), as a benchmark wants."""
    topic = topic_of(question)
    seed = _seed(question)
    n_reason = 2 + seed % 3 if reasoning else 0
    n_answer = 4 + (seed >> 8) % 4
    r_lines = [REASONING[0]] + [REASONING[1 + (seed >> (4 * i)) % (len(REASONING) - 1)] for i in range(n_reason - 1)]
    a_lines = [ANSWER[0]] + [ANSWER[1 + (seed >> (3 * i + 16)) % (len(ANSWER) - 1)] for i in range(n_answer - 1)]
    r_text = " ".join(s.format(topic=topic) for s in r_lines[:n_reason]) if n_reason else ""
    a_text = " ".join(s.format(topic=topic) for s in a_lines)
    r_pieces = _TOKEN.findall(r_text + " ") if r_text else []
    a_pieces = _TOKEN.findall(a_text)
    if reply_tokens is not None:
        total = max(1, int(reply_tokens))
        n_r = min(len(r_pieces), total // 4) if reasoning else 0
        r_pieces = r_pieces[:n_r]
        pool = _TOKEN.findall(a_text + " " + " ".join(s.format(topic=topic) for s in ANSWER) + " ")
        out: list[str] = []
        while len(out) < total - n_r:
            out.extend(pool)
        a_pieces = out[: total - n_r]
    if a_pieces:
        a_pieces[-1] = a_pieces[-1].rstrip()
    return r_pieces, a_pieces


def count_tokens(text: str) -> int:
    """Rough prompt token count: about four characters per token, at least one per word."""
    if not text:
        return 0
    return max(len(text) // 4, len(_TOKEN.findall(text)))
