"""The scripted engine's text: canned, labelled answers from a small curated corpus, one set of sentences per topic.

A question is classified into one of :data:`TOPICS` by its words (a topic's keywords; ``general`` when none
match). The reply is made of that topic's own sentences only: a short "reasoning" part (streamed as
``reasoning_content``) and an answer (streamed as ``content``) that opens with :data:`LABEL` (the reply says it was
not computed by a model). Every sentence is a whole, grammatical sentence written for its topic: nothing is
spliced from the question. Replies are deterministic for a given question (seeded by its hash), and a reply never
repeats a sentence until it has used every sentence of its topic. A token is a word with its trailing space.

Each topic also has its own routing distribution in the offload model (:attr:`Topic.routing`): a conversation
about the GPU's memory routes to other experts than one about Python code, so a session that changes topic makes
the adaptive tier swap experts. ``general`` routes through distribution 0, the one the shipped
profile (and the planner's ``expected_frequencies``) is made for; the other topics move part of each layer's
favourites elsewhere.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass

LABEL = "This is a canned answer from the scripted engine: no model computed it, and its speed is simulated."
CLOSER = "Ask again if you want more detail on any of these points."   # only ever the last sentence


@dataclass(frozen=True)
class Topic:
    name: str
    routing: int                     # index of the topic's routing distribution in the offload model
    keywords: tuple[str, ...]        # lower-case words (or word stems ending in '*') that point to the topic
    reasoning: tuple[str, ...]
    answer: tuple[str, ...]


TOPICS: tuple[Topic, ...] = (
    Topic(
        "offload", 1,
        ("expert*", "vram", "gpu*", "offload*", "pcie", "cache*", "moe", "mixture", "hot", "swap*", "routing",
         "router", "layer*", "placement", "memory", "weights", "quantiz*", "q2_k", "gguf", "model", "models"),
        ("The question is about how the model's experts are placed between the GPU and system memory.",
         "The key fact is that each token uses only a few experts in every layer.",
         "The answer should explain the hot set and what happens on a miss.",
         "A number or two will make the trade-off concrete."),
        ("A mixture-of-experts layer sends each token to six of its three hundred and eighty-four experts.",
         "The experts that are used most often are kept in VRAM, and the rest stay in pinned system memory.",
         "With the reference placement, about nine in ten expert lookups are served from the GPU.",
         "An expert that is not in VRAM is computed by CPU threads that read its weights from RAM.",
         "The adaptive tier copies newly popular experts over PCIe and evicts the ones that went quiet.",
         "A larger expert cache raises the hit rate, but it leaves less VRAM for the context.",
         "The planner ranks experts by how often the routing trace saw them and fills the cache in that order.",
         "One expert at Q2_K takes about twelve mebibytes, so every thousand experts need about twelve GiB."),
    ),
    Topic(
        "host", 2,
        ("numa", "cpu*", "thread*", "core*", "socket*", "bind*", "ram", "bandwidth", "latency", "node*", "pin*",
         "hugepage*", "affinity", "numactl", "bios"),
        ("The question is about the host side: the CPU, its memory and how the engine is bound to them.",
         "The CPU computes every expert that misses the GPU, so its memory bandwidth matters.",
         "The answer should say what binding does and how to check it."),
        ("Binding the engine to the GPU's NUMA node keeps the CPU experts' memory traffic on the local node.",
         "Without the binding, part of the expert weights is read across the socket link, which is slower.",
         "On the reference workstation the binding raised one user's decode rate from about 53 to 63 tokens "
         "per second.",
         "The engine pins the cold experts in RAM, so the host needs about two hundred and eighty gigabytes.",
         "The CPU expert pool is limited by memory bandwidth more than by the number of cores.",
         "The panel probes each binding strategy by running it before it chooses one."),
    ),
    Topic(
        "setup", 3,
        ("install*", "download*", "driver*", "cuda", "setup", "start*", "stop*", "port", "settings", "config*",
         "update*", "version", "release", "disk", "shard*", "error*", "crash*", "log*", "fail*"),
        ("The question is about getting the engine installed and running.",
         "The answer should list the steps in order and say how to check each one.",
         "The common failures are worth naming with their fixes."),
        ("The model comes as seven GGUF shards, about two hundred and sixty-five gigabytes in all.",
         "A download that stops can be resumed, and every shard is checked against its published hash.",
         "The engine release needs NVIDIA driver 580.65 or newer, which brings CUDA 13.",
         "The doctor command checks the GPU, the driver, the memory and the disk before the first start.",
         "The first start reads the model's weights into memory, so it takes longer than later starts.",
         "When the engine stops on its own, the log tab shows its last lines and the likely cause."),
    ),
    Topic(
        "code", 4,
        ("python", "code", "function", "program*", "script*", "bug*", "debug*", "compile*", "class", "java*",
         "rust", "sql", "regex", "algorithm*", "sort*", "list", "string", "loop*", "api", "json"),
        ("The question asks for code or about code.",
         "A short, working example is better than a long description.",
         "The answer should say which edge cases the code handles."),
        ("A real model would write the code here; this scripted engine only shows how an answer streams.",
         "Start with the smallest function that does the job, then add a test that calls it.",
         "Name the inputs and outputs clearly, and handle the empty case first.",
         "Run the code on a small example before using it on real data.",
         "When something fails, read the whole error message: it usually names the line and the cause.",
         "Keep each function short enough that its purpose fits in one sentence."),
    ),
    Topic(
        "general", 0,
        (),
        ("The question is a general one.",
         "A short, plain answer fits best here.",
         "The reply should stay friendly and to the point."),
        ("A real model would answer this question here; the scripted engine only shows how a reply streams.",
         "The reply arrives token by token, at the speed the offload model predicts.",
         "Every figure shown while it streams is modelled, not measured.",
         "You can start the real engine with the Start button on the left once the model has been downloaded.",
         "The chat history keeps this conversation, so you can search it and export it later."),
    ),
)
GENERAL = TOPICS[-1]
_BY_NAME = {t.name: t for t in TOPICS}

_TOKEN = re.compile(r"\S+\s*")
_WORD = re.compile(r"[a-z0-9][a-z0-9_]*")


def topic_of(text: str) -> Topic:
    """The topic whose keywords the question's words match most (the earliest topic on a tie); ``general``
    when none match."""
    words = _WORD.findall((text or "").lower())
    best, score = GENERAL, 0
    for t in TOPICS:
        n = 0
        for w in words:
            for k in t.keywords:
                if (w.startswith(k[:-1]) if k.endswith("*") else w == k):
                    n += 1
                    break
        if n > score:
            best, score = t, n
    return best


def topic_named(name: str) -> Topic:
    return _BY_NAME[name]


def _seed(text: str) -> int:
    return int.from_bytes(hashlib.sha256((text or "").encode("utf-8", "replace")).digest()[:8], "little")


def _picks(rng: random.Random, pool: tuple[str, ...] | list[str], n: int) -> list[str]:
    """``n`` sentences of ``pool`` without repeating one until all were used (a fresh order each round), and never
    the same sentence twice in a row across rounds."""
    out: list[str] = []
    while len(out) < n:
        order = rng.sample(list(pool), len(pool))
        if out and len(order) > 1 and order[0] == out[-1]:
            order.append(order.pop(0))
        out.extend(order)
    return out[:n]


def script(question: str, reasoning: bool = True, reply_tokens: int | None = None) -> tuple[list[str], list[str]]:
    """(reasoning pieces, answer pieces) for a question, from its topic's sentences: deterministic per question
    (seeded by its hash), no sentence repeated within a reply until every sentence of the topic was used.
    ``reply_tokens`` forces the total length (the answer runs on through fresh orderings of the topic's
    sentences), as a benchmark wants."""
    topic = topic_of(question)
    rng = random.Random(_seed(question))
    n_reason = min(len(topic.reasoning), 2 + rng.randrange(2)) if reasoning else 0
    n_answer = min(len(topic.answer), 3 + rng.randrange(3))
    close = rng.random() < 0.5
    r_lines = [topic.reasoning[0]] + _picks(rng, topic.reasoning[1:], n_reason - 1) if n_reason else []
    total = max(1, int(reply_tokens)) if reply_tokens is not None else 0
    picks = _picks(rng, topic.answer, n_answer + (total // 4 + len(topic.answer) if reply_tokens is not None else 0))
    r_text = " ".join(r_lines)
    r_pieces = _TOKEN.findall(r_text + " ") if r_text else []
    if reply_tokens is None:
        a_pieces = _TOKEN.findall(" ".join([LABEL, *picks[:n_answer], *([CLOSER] if close else [])]))
    else:
        n_r = min(len(r_pieces), total // 4) if reasoning else 0
        r_pieces = r_pieces[:n_r]
        a_pieces = _TOKEN.findall(" ".join([LABEL, *picks]) + " ")
        while len(a_pieces) < total - n_r:          # (only a corpus of very short sentences gets here)
            a_pieces += a_pieces
        a_pieces = a_pieces[: total - n_r]
    if a_pieces:
        a_pieces[-1] = a_pieces[-1].rstrip()
    return r_pieces, a_pieces


def sentences(text: str) -> list[str]:
    """A reply split back into its sentences (for tests and the conformance check)."""
    return [s for s in re.split(r"(?<=[.!?])\s+", (text or "").strip()) if s]


def count_tokens(text: str) -> int:
    """Rough prompt token count: about four characters per token, at least one per word."""
    if not text:
        return 0
    return max(len(text) // 4, len(_TOKEN.findall(text)))
