"""The one home for split-GGUF facts: shard file names, the split metadata, and which file is shard 1.

Names: a split's files are ``<stem>-0000N-of-0000M.gguf`` (N 1-based; llama.cpp's ``gguf-split`` and
``gguf.GGUFWriter`` name them so): :data:`SPLIT_RE`, :func:`shard_name`, :func:`parse_shard_name`,
:func:`short_name` (as the CLI and the Downloads tab show one), :func:`strip_shard_suffix`, :func:`first_shard_name`,
:func:`first_shard_files` (a model's shard 1 below a folder, by name) and :func:`find_shards` (for the layout reader).

Shard 1 is read from the split metadata, never from a file name: each file carries ``split.no`` (0-based) and
``split.count``, read by :func:`engine_manager.gguf_header.read_shard_header` (milliseconds, no tensor data).
Strata's engine and packer take the split's *first* shard (``--native SHARD1``, ``tools/iq_pack.py --gguf SHARD1``),
so the panel must name that file whatever the files are called: a renamed download, a replica, a model other than
the seven ``DeepSeek-V4.1-Flash-Q2_K-0000N-of-00007.gguf`` files. :func:`split_problems` says whether a set of files
agrees in its split keys (the download's last check).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import UserError
from .gguf_header import LayoutError, read_shard_header

SPLIT_RE = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_SUFFIX_RE = re.compile(r"-\d{5}-of-\d{5}$")


def shard_name(stem: str, n: int, count: int) -> str:
    """``stem``, shard ``n`` (1-based) of ``count`` → ``<stem>-0000N-of-0000M.gguf``."""
    return f"{stem}-{n:05d}-of-{count:05d}.gguf"


def parse_shard_name(name: str) -> tuple[str, int, int] | None:
    """``<stem>-0000N-of-0000M.gguf`` → ``(stem, N, M)`` (N 1-based); None for a name that is not a shard's."""
    m = SPLIT_RE.match(name)
    return (m.group("stem"), int(m.group("no")), int(m.group("count"))) if m else None


def short_name(name: str) -> str:
    """A shard's name as a table shows it: ``DeepSeek-V4.1-Flash-Q2_K-00003-of-00007.gguf`` → ``shard 3 of 7``;
    any other name unchanged."""
    p = parse_shard_name(name)
    return f"shard {p[1]} of {p[2]}" if p else name


def first_shard_name(name: str) -> str:
    """The name of shard 1 of the split that the shard ``name`` belongs to (``…-00003-of-00007.gguf`` →
    ``…-00001-of-00007.gguf``); any other name unchanged. A guess from the name only: :func:`first_shard` reads
    the metadata."""
    p = parse_shard_name(name)
    return shard_name(p[0], 1, p[2]) if p else name


FIRST_SHARD_GLOB = "*-00001-of-*.gguf"


def first_shard_files(base: os.PathLike | str, max_depth: int = 3) -> list[Path]:
    """Files named as a split's shard 1 in ``base`` or up to ``max_depth`` folders below it (the shallowest level
    that has any, sorted); partial downloads (``.incomplete``) are skipped."""
    base = Path(base)
    for depth in range(max_depth + 1):
        pattern = "/".join(["*"] * depth + [FIRST_SHARD_GLOB])
        hits = sorted(x for x in base.glob(pattern) if SPLIT_RE.match(x.name) and ".incomplete" not in x.name)
        if hits:
            return hits
    return []


def strip_shard_suffix(stem: str) -> str:
    """A shard's file stem without its ``-0000N-of-0000M`` part (``X-00001-of-00007`` → ``X``)."""
    return _SUFFIX_RE.sub("", stem)


class SplitError(UserError):
    """The folder holds no usable split (plain words: what is wrong, what to do)."""


@dataclass(frozen=True)
class Split:
    first: Path                 # the file whose split.no is 0 (or the lone unsplit file)
    shards: tuple[Path, ...]    # every shard, in split.no order
    count: int

    @property
    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.shards)


def _int(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def find_split(path: os.PathLike | str) -> Split:
    """The split at ``path``: a folder of ``.gguf`` files, or any one of its files (its folder is searched).

    Every ``.gguf`` file's header is read; the file with ``split.no`` 0 is shard 1, and the shards 0 ..
    ``split.count``-1 must all be there, once each. A folder with a single file without split keys is a model of
    one file. Raises :class:`SplitError` otherwise."""
    p = Path(path).expanduser()
    folder = p if p.is_dir() else p.parent
    if not folder.is_dir():
        raise SplitError(f"The model folder {folder} does not exist. Download the model (`dsv41 download`) or set "
                         "DSV41_MODEL_DIR to the folder that holds its .gguf files.")
    files = sorted(x for x in folder.iterdir() if x.name.endswith(".gguf") and x.is_file())
    if not files:
        raise SplitError(f"There are no .gguf files in {folder}. Download the model (`dsv41 download`) or set "
                         "DSV41_MODEL_DIR to the folder that holds its shards.")
    by_no: dict[int, list[Path]] = {}
    counts: dict[Path, int] = {}
    unsplit: list[Path] = []
    for f in files:
        try:
            md = read_shard_header(f).metadata
        except LayoutError as exc:
            raise SplitError(f"Cannot read the GGUF header of {f}: {exc}") from None
        no, cnt = _int(md.get("split.no")), _int(md.get("split.count"))
        if no is None and cnt is None:
            unsplit.append(f)
            continue
        if no is None or cnt is None or cnt < 1 or not 0 <= no < cnt:
            raise SplitError(f"{f} has unusable split metadata (split.no={md.get('split.no')!r}, "
                             f"split.count={md.get('split.count')!r}). The file is damaged or not part of this "
                             "model: download it again.")
        by_no.setdefault(no, []).append(f)
        counts[f] = cnt
    if not by_no:
        if len(unsplit) == 1:
            return Split(unsplit[0], (unsplit[0],), 1)
        raise SplitError(f"{folder} holds {len(unsplit)} .gguf files and none is part of a split (no split.no / "
                         "split.count metadata). Keep one model per folder.")
    firsts = by_no.get(0, [])
    if not firsts:
        raise SplitError(f"Shard 1 (split.no 0) of the model in {folder} is missing. Download it again "
                         "(`dsv41 download` resumes).")
    if len(firsts) > 1:
        names = ", ".join(x.name for x in firsts)
        raise SplitError(f"Several files in {folder} say they are shard 1 ({names}). Keep one model per folder.")
    first = firsts[0]
    count = counts[first]
    shards: list[Path] = []
    for i in range(count):
        got = [f for f in by_no.get(i, []) if counts[f] == count]
        if not got:
            raise SplitError(f"Shard {i + 1} of {count} (split.no {i}) of the model in {folder} is missing. "
                             "Download it (`dsv41 download` resumes).")
        if len(got) > 1:
            raise SplitError(f"Several files in {folder} say they are shard {i + 1} of {count}: "
                             + ", ".join(x.name for x in got) + ". Keep one model per folder.")
        shards.append(got[0])
    return Split(first, tuple(shards), count)


def first_shard(path: os.PathLike | str) -> Path:
    """Shard 1 of the split at ``path`` (see :func:`find_split`)."""
    return find_split(path).first


def find_shards(path: os.PathLike | str) -> list[Path]:
    """The shard files of the model at ``path`` (a folder, the first shard, any shard, or a single .gguf), in order.
    Raises :class:`LayoutError` for a missing shard or a folder with no model or several models."""
    p = Path(path).expanduser()
    if p.is_dir():
        files = sorted(x for x in p.iterdir() if x.name.endswith(".gguf") and x.is_file())
        if not files:
            raise LayoutError(p, "no .gguf files in this folder",
                              "Download the model (dsv41 download) or point --model-dir at the folder with its shards")
        firsts = [x for x in files if (m := SPLIT_RE.match(x.name)) and int(m.group("no")) == 1]
        singles = [x for x in files if not SPLIT_RE.match(x.name)]
        if len(firsts) == 1:
            p = firsts[0]
        elif len(firsts) > 1:
            names = ", ".join(x.name for x in firsts)
            raise LayoutError(p, f"several models in one folder ({names})",
                              "Keep one model per folder, or pass the first shard's path")
        elif len(singles) == 1:
            return singles
        else:
            shards = [x.name for x in files if SPLIT_RE.match(x.name)]
            if shards:
                m = SPLIT_RE.match(shards[0])
                assert m
                raise LayoutError(p / shard_name(m.group("stem"), 1, int(m.group("count"))),
                                  f"shard 1 of {int(m.group('count'))} is missing",
                                  "Download the missing shard (dsv41 download resumes)")
            raise LayoutError(p, f"several .gguf files and none is a split's first shard ({len(files)} files)",
                              "Point at the model's file directly")
    elif not p.exists():
        raise LayoutError(p, "file not found", "Check the path, or download the model (dsv41 download)")
    m = SPLIT_RE.match(p.name)
    if not m:
        return [p]
    count = int(m.group("count"))
    if count < 1 or count > 9999:
        raise LayoutError(p, f"absurd shard count {count} in the file name")
    stem = m.group("stem")
    out = []
    for i in range(1, count + 1):
        q = p.with_name(shard_name(stem, i, count))
        if not q.is_file():
            raise LayoutError(q, f"shard {i} of {count} is missing",
                              "Download the missing shard (dsv41 download resumes), or check the folder")
        out.append(q)
    return out


def split_problems(files: list[Path]) -> list[str]:
    """Problems with the split keys of ``files`` (in shard order); empty when they agree: every file says
    ``split.count`` = len(files), its own ``split.no`` (0-based) matching its place, and one ``split.tensors.count``.
    Uses :func:`engine_manager.gguf_header.read_shard_header` (the planner's header reader)."""
    problems: list[str] = []
    totals: set[int] = set()
    for i, p in enumerate(files):
        try:
            md = read_shard_header(p).metadata
        except LayoutError as exc:
            problems.append(str(exc))
            continue
        no, count, tcount = md.get("split.no"), md.get("split.count"), md.get("split.tensors.count")
        if len(files) > 1 and (no is None or count is None):
            problems.append(f"{p.name}: no split.no / split.count keys — not a shard of a split GGUF")
            continue
        if count is not None and int(count) != len(files):
            problems.append(f"{p.name}: split.count is {count}, the set has {len(files)} files")
        if no is not None and int(no) != i:
            problems.append(f"{p.name}: split.no is {no} (shard {int(no) + 1}), but it is named as shard {i + 1}")
        if tcount is not None:
            totals.add(int(tcount))
    if len(totals) > 1:
        problems.append(f"the shards disagree about split.tensors.count ({sorted(totals)}): they come from "
                        "different splits")
    return problems
