"""The one reader of Prometheus text pages (Strata's ``/metrics`` as text, llama-server's ``/metrics``), on
prometheus_client's own parser (``prometheus_client.parser.text_string_to_metric_families``).

:func:`read_samples` gives every sample as ``(name, labels, value)``, under the name the page wrote
(``vllm:request_success_total``, and llama-server's ``llamacpp:n_tokens_max`` counter without ``_total``); NaN (an
exporter without a value) and ±Inf are dropped (a figure that is not a number is missing, never a value). A page
the parser refuses is read line by line, so one bad line costs that line, not the page.
"""

from __future__ import annotations

import math
from typing import Iterator

from prometheus_client.parser import text_string_to_metric_families


def _parse(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    written: set[str] | None = None
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name
            # the parser renames a counter's sample that lacks "_total" to "<name>_total" (the OpenMetrics form);
            # llama-server writes such counters (llamacpp:n_tokens_max): keep the name the page wrote
            if family.type == "counter" and name == family.name + "_total":
                if written is None:
                    written = {ln.split("{", 1)[0].split()[0] for ln in text.splitlines()
                               if ln.strip() and not ln.lstrip().startswith("#")}
                if name not in written and family.name in written:
                    name = family.name
            yield name, dict(s.labels), float(s.value)


LINE_CAP = 64 * 1024     # no sample line is this long (names and label values are short): one that is, is no sample


def read_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of the page as ``(name, labels, value)``, NaN and ±Inf dropped. A line past ``LINE_CAP`` is
    left out before parsing (the parser takes ~8 times a line's size in memory: a 14 MB one-line answer cost the
    panel 110 MB)."""
    if any(len(line) > LINE_CAP for line in text.split("\n")):
        text = "\n".join(line for line in text.split("\n") if len(line) <= LINE_CAP)
    try:
        rows = list(_parse(text))
    except ValueError:                # a malformed line: read the page line by line, keep what parses
        rows = []
        for line in text.splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            try:
                rows += list(_parse(line + "\n"))
            except ValueError:
                continue
    return [(n, lab, v) for n, lab, v in rows if math.isfinite(v)]


def summed(text: str) -> dict[str, float]:
    """``{name: value}``, labels dropped and values summed over label sets; a name whose sum is past what a float
    holds (1e308 + 1e308) is left out (missing), so one absurd series costs that figure, not the page."""
    out: dict[str, float] = {}
    for name, _labels, v in read_samples(text):
        out[name] = out.get(name, 0.0) + v
    return {k: v for k, v in out.items() if math.isfinite(v)}


def labelled(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """``{name: [(labels, value), ...]}`` for every sample."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for name, labels, v in read_samples(text):
        out.setdefault(name, []).append((labels, v))
    return out


def series_key(name: str, labels: dict[str, str]) -> str:
    """``name{a="x",b="y"}`` (labels sorted), or ``name`` without labels: one key per series."""
    if not labels:
        return name
    inner = ",".join('{}="{}"'.format(k, v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n"))
                     for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def by_series(text: str) -> dict[str, float]:
    """``{series_key: value}``: each labelled series on its own (the last one wins if a page repeats it)."""
    return {series_key(n, lab): v for n, lab, v in read_samples(text)}


__all__ = ["by_series", "labelled", "read_samples", "series_key", "summed"]
