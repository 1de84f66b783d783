"""The Benchmark: the guides' experiments on this machine, side by side with the published figures.

Qt-free; the CLI (``dsv41 bench``), the Benchmark tab (``app/bench_view.py``) and the tests drive the same code:

- :mod:`.runner` — :func:`run_bench` (a generator of typed progress events): per configuration the engine is
  (re)started through the supervisor, warmed up, then measured at 1/4/8 concurrent streams (repeats, median and
  spread) and with the long-prompt experiment; the engine that ran before is put back at the end or on cancel;
- :mod:`.streams` — concurrent streamed requests, a timestamp per token, the client's own CPU cost;
- :mod:`.prompts` — deterministic prompts, sized from the engine's own token counts and checked against them;
- :mod:`.results` — the result document (schema ``dsv41-bench`` v1), the table beside the guides', JSON + CSV
  under the data dir, history and compare;
- :mod:`.stats` — median, spread and ratios of repeats.
"""

from .results import SCHEMA, SCHEMA_VERSION, bench_dir, compare, findings, history, load, save
from .config import BASELINE, PRESET_WORDS, PRESETS, BenchConfig, parse_config
from .runner import (
    BenchDone,
    BenchNote,
    BenchPhase,
    BenchProgress,
    BenchSpec,
    run_and_save,
    run_bench,
)

__all__ = [
    "BASELINE", "PRESETS", "PRESET_WORDS", "BenchConfig", "BenchDone", "BenchNote", "BenchPhase", "BenchProgress",
    "BenchSpec", "SCHEMA", "SCHEMA_VERSION", "bench_dir", "compare", "findings", "history", "load", "parse_config",
    "run_and_save", "run_bench",
    "save",
]
