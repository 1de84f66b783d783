"""sha256 of a file: the one implementation (downloads verify with it, the local test hub serves with it)."""

from __future__ import annotations

import hashlib
import os
from typing import Callable

from .cancel import Cancelled, CancelToken
from .fmt import MIB


def sha256_file(path: os.PathLike | str, progress: Callable[[int], None] | None = None,
                cancel: CancelToken | None = None, bufsize: int = 8 * MIB) -> str:
    """sha256 of a file, reading into one reused buffer (hashlib releases the GIL on each update). ``progress``
    gets the bytes hashed so far; a cancelled ``cancel`` raises :class:`~engine_manager.cancel.Cancelled`."""
    h = hashlib.sha256()
    buf = bytearray(bufsize)
    mv = memoryview(buf)
    done = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(mv[:n])
            done += n
            if progress is not None:
                progress(done)
            if cancel is not None and cancel.cancelled:
                raise Cancelled(cancel.reason)
    return h.hexdigest()
