"""Which file of a split GGUF is shard 1 — read from the split metadata, never from a file name.

A split GGUF's files each carry ``split.no`` (0-based) and ``split.count`` (llama.cpp's ``gguf-split`` and
``gguf.GGUFWriter`` write them; :mod:`engine_manager.layout` explains the format). Strata's engine and its packer
take the split's *first* shard (``--native SHARD1``, ``tools/iq_pack.py --gguf SHARD1``), so the panel must name
that file whatever the files are called: a renamed download, a replica, a model other than the seven
``DeepSeek-V4.1-Flash-Q2_K-0000N-of-00007.gguf`` files. The headers are read with the project's own header reader
(:func:`engine_manager.layout.read_shard_header`: milliseconds per shard, no tensor data).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .errors import UserError
from .layout import LayoutError, read_shard_header


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
