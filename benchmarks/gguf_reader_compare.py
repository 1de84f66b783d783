"""Time (and memory) of ``gguf.GGUFReader`` against the panel's own header reader
(:func:`engine_manager.gguf_header.read_shard_header`) on one GGUF file; the figures quoted in
``engine_manager/gguf_header.py`` come from this. Run it in a fresh process so the memory figures mean something:

    .venv/bin/python benchmarks/gguf_reader_compare.py MODEL_DIR/…-00001-of-00007.gguf
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_manager.fmt import MIB  # noqa: E402
from engine_manager.gguf_header import read_shard_header  # noqa: E402


def _rss() -> int:
    import psutil
    return psutil.Process().memory_info().rss


def compare_with_gguf_reader(path: os.PathLike | str) -> dict[str, float]:
    """Time (and memory) of ``gguf.GGUFReader`` vs :func:`read_shard_header` on one file. Run in a fresh process
    (``benchmarks/gguf_reader_compare.py FILE``) so the memory figures mean something."""
    import gc

    import gguf
    path = Path(path)
    gc.collect()
    r0 = _rss()
    t0 = time.perf_counter()
    h = read_shard_header(path)
    t1 = time.perf_counter()
    r1 = _rss()
    del h
    gc.collect()
    r2 = _rss()
    t2 = time.perf_counter()
    reader = gguf.GGUFReader(path)
    n = len(reader.tensors)
    t3 = time.perf_counter()
    r3 = _rss()
    return {"struct_s": t1 - t0, "struct_rss_mib": (r1 - r0) / MIB, "gguf_reader_s": t3 - t2,
            "gguf_reader_rss_mib": (r3 - r2) / MIB, "tensors": n}



def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Time gguf.GGUFReader against the panel's header reader on one file.")
    ap.add_argument("path", help="a GGUF file (a model's shard 1 is the interesting one)")
    a = ap.parse_args(argv)
    r = compare_with_gguf_reader(a.path)
    print(f"struct reader:    {r['struct_s']:.3f} s, +{r['struct_rss_mib']:.0f} MiB RSS")
    print(f"gguf.GGUFReader:  {r['gguf_reader_s']:.3f} s, +{r['gguf_reader_rss_mib']:.0f} MiB RSS "
          f"({r['tensors']} tensors)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
