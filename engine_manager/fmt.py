"""How numbers read in the CLI and the GUI: durations, byte counts, ETAs and integer ranges — and the byte units.

The units live here and nowhere else: ``KIB``/``MIB``/``GIB`` (powers of 1024: memory, VRAM, tensor sizes) and
``KB``/``MB``/``GB`` (powers of 1000: download sizes, disks and RAM as they are sold).
"""

from __future__ import annotations

import math
from typing import Iterable

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
KB = 10**3
MB = 10**6
GB = 10**9


def nice_ceil(x: float) -> float:
    """The smallest of 1, 1.5, 2, 2.5, 3, 4, 5, 6, 8 × 10^k that is ≥ x (x > 0): a plot's scale, a step of it."""
    if x <= 0:
        return 1.0
    k = math.floor(math.log10(x))
    for m in (1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0):
        if m * 10**k >= x * (1 - 1e-12):
            return m * 10**k
    return 10.0 ** (k + 1)


def gib(n: float, digits: int = 1) -> str:
    """``12.3 GiB`` (powers of 1024)."""
    return f"{n / GIB:.{digits}f} GiB"


def mib(n: float, digits: int = 0) -> str:
    """``1,632 MiB`` (powers of 1024, thousands separated)."""
    return f"{n / MIB:,.{digits}f} MiB"


def duration(s: float | None) -> str:
    """``42.3 s``, ``3 min 07 s``, ``2 h 05 min``; ``—`` when unknown."""
    if s is None:
        return "—"
    s = max(0.0, float(s))
    if s < 60:
        return f"{s:.1f} s"
    m, sec = divmod(int(s), 60)
    if m < 60:
        return f"{m} min {sec:02d} s"
    h, m = divmod(m, 60)
    return f"{h} h {m:02d} min"


def uptime(s: float) -> str:
    """How long something has run, to the minute: ``under a minute``, ``3 min``, ``2 h 05 min``."""
    m = int(max(0.0, float(s)) // 60)
    if m < 1:
        return "under a minute"
    return f"{m} min" if m < 60 else f"{m // 60} h {m % 60:02d} min"


def clock(s: float | None) -> str:
    """An ETA as ``mm:ss`` or ``h:mm:ss``; ``--:--`` when unknown."""
    if s is None:
        return "--:--"
    s = int(max(0, s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m:02d}:{sec:02d}"


def bytes_si(n: float | None) -> str:
    """``1.2 GB`` (powers of 1000, as download sizes and disks are quoted); ``?`` when unknown."""
    if n is None:
        return "?"
    n = float(n)
    for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.1f} {unit}"
    return f"{int(n)} B"


def ranges(xs: Iterable[int], dash: str = "–", sep: str = ", ", empty: str = "none") -> str:
    """``[0, 1, 2, 3, 8, 10, 11]`` → ``0–3, 8, 10–11`` (sorted, duplicates dropped)."""
    s = sorted(set(xs))
    out: list[str] = []
    i = 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and s[j + 1] == s[j] + 1:
            j += 1
        out.append(str(s[i]) if i == j else f"{s[i]}{dash}{s[j]}")
        i = j + 1
    return sep.join(out) if out else empty


def terminal_safe(text: str, keep_newlines: bool = True) -> str:
    """``text`` with every control or unprintable character written as an escape (``\\x1b``, ``\\u2028``), so words
    from a server, a file or a release tool cannot set a terminal's title, clear its screen or fake a line. Tabs
    become a space; newlines stay where ``keep_newlines`` (else ``\\n``)."""
    out = []
    for c in text:
        if c.isprintable() or (c == "\n" and keep_newlines):
            out.append(c)
        elif c == "\t":
            out.append(" ")
        else:
            o = ord(c)
            out.append(f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}")
    return "".join(out)

