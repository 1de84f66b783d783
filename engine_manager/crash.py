"""How an engine ended, and why, in plain words with a fix (crash classification).

:func:`classify_exit` reads the exit status and *this run's* log lines: the engine adapter's own signatures first,
then generic ones (SIGKILL → the OOM killer, port in use, driver too old, CUDA out of memory, placement refused,
bad arguments, host RAM), else "unknown" with the last log lines. This module never imports Qt.
"""

from __future__ import annotations

import re
import signal

from .engine_state import ExitInfo
from .engines.base import Engine, FailureHint

#: causes that another try cannot fix by itself: no auto-restart for these
PERMANENT_CAUSES = {"port_in_use", "driver_too_old", "placement_refused", "bad_arguments", "bad_engine_flag",
                    "model_missing", "spawn_failed",
                    # Strata's own refusals (engines/strata.py): the same start fails the same way
                    "expert_cache_oom", "cuda_libs_missing", "engine_ready_timeout", "ple_gguf_missing",
                    "pack_arch_unsupported", "release_python_missing"}


# -- crash classification -----------------------------------------------------------------------------------

def _oom_hint() -> FailureHint:
    return FailureHint(
        "oom_killed",
        "The engine was killed by SIGKILL — most likely by the kernel's out-of-memory killer (the host ran out of "
        "RAM).",
        "Check with `journalctl -k --since '15 min ago' | grep -i -E 'out of memory|killed process'` (or "
        "`sudo dmesg -T | grep -i -E 'oom|killed process'`). If it was the OOM killer: close other programs, lower "
        "slots or context_length, or re-plan so fewer experts are held in RAM; `dsv41 doctor` shows the RAM the "
        "model needs.")


GENERIC_PATTERNS: list[tuple[re.Pattern[str], FailureHint]] = [
    (re.compile(r"address already in use|EADDRINUSE|errno 98\b|port \d+ (?:is )?(?:already )?in use", re.I),
     FailureHint("port_in_use", "The engine could not open its port: another program is using it.",
                 "Stop the other program (`ss -ltnp` shows who holds the port), or choose another port with "
                 "`dsv41 settings set port <N>` (DSV41_PORT).")),
    (re.compile(r"driver version is insufficient|insufficient ?driver|cudaErrorInsufficientDriver|"
                r"driver (?:is )?too old|requires (?:an )?(?:nvidia )?driver", re.I),
     FailureHint("driver_too_old", "The NVIDIA driver is too old for this engine (it needs 580.65 or newer, "
                 "CUDA 13).",
                 "Update the NVIDIA driver to 580.65 or newer and reboot; `nvidia-smi` shows the installed "
                 "version.")),
    (re.compile(r"CUDA out of memory|cudaMalloc\w* failed|cudaErrorMemoryAllocation|CUDA error: out of memory|"
                r"out of (?:device|GPU|VRAM) memory|failed to allocate .*(?:CUDA|VRAM|device)", re.I),
     FailureHint("cuda_oom", "The GPU ran out of memory (CUDA out of memory / cudaMalloc failed).",
                 "Keep fewer experts in VRAM: raise vram_reserve_mib, lower slots or context_length, or re-plan "
                 "(Placement tab / `dsv41 plan`); close other programs using the GPU (`nvidia-smi` lists them).")),
    (re.compile(r"placement (?:was )?refused|plan (?:was )?refused|refus\w* (?:the )?(?:plan|placement|expert "
                r"profile)|profile .*(?:does not match|mismatch)", re.I),
     FailureHint("placement_refused", "The engine refused the placement: the plan or expert profile does not fit "
                 "this model or GPU.",
                 "Re-plan on the Placement tab (or `dsv41 plan`) and start again; check that the expert profile was "
                 "made for this model.")),
    (re.compile(r"unrecognized arguments|error: argument|usage: .*\n?.*error:", re.I),
     FailureHint("bad_arguments", "The engine refused its command line (an option it does not know).",
                 "The engine release may not match this panel: update it (`dsv41 download engine`) or choose "
                 "another engine.")),
    (re.compile(r"std::bad_alloc|MemoryError|Cannot allocate memory|ENOMEM", re.I),
     FailureHint("ram_oom", "The engine could not allocate host memory (RAM).",
                 "Free RAM (close other programs), lower slots or context_length, or re-plan so fewer experts are "
                 "held in RAM.")),
]


def classify_exit(engine: Engine | None, exit: ExitInfo, log_tail: list[str]) -> FailureHint:
    """The cause of an exit in plain words with a fix. The engine's own signatures are consulted first."""
    tail = list(log_tail)[-200:]
    if exit.silent_s is not None:
        return FailureHint(
            "engine_silent",
            f"The engine stopped answering: no reply to its health check for {exit.silent_s:.0f} s while its "
            "process was still alive (hung), so the panel stopped it.",
            "Look at the last log lines; if it hangs again, lower the load (slots) or report the log. "
            "Auto-restart (when on) starts it again.")
    if exit.keeper_killed:
        return FailureHint(
            "keeper_killed",
            "The engine's keeper process (which writes its log) was killed, so the engine was stopped with it.",
            "Start it again; if this repeats, check what kills processes on this machine "
            "(`journalctl -k | grep -i killed`).")
    engine_lines = [ln for ln in tail if not ln.startswith("[dsv41")]
    if engine is not None:
        try:
            hint = engine.classify_failure(exit.returncode, engine_lines)
        except Exception:  # an adapter bug must not hide the crash itself
            hint = None
        if hint is not None:
            return hint
    if exit.signal == signal.SIGKILL:
        return _oom_hint()
    for line in reversed(engine_lines):
        for pat, hint in GENERIC_PATTERNS:
            if pat.search(line):
                return hint
    last = "\n".join(engine_lines[-20:]) or "(the log is empty)"
    what = exit.words()
    if exit.signal == signal.SIGSEGV:
        title = "The engine crashed (segmentation fault)."
    elif exit.signal == signal.SIGABRT:
        title = "The engine aborted (SIGABRT: an internal check failed)."
    elif exit.returncode == 0:
        title = "The engine exited on its own (exit code 0) without being asked to stop."
    else:
        title = f"The engine exited unexpectedly ({what})."
    return FailureHint("unknown", title,
                       f"The last lines of its log say:\n{last}\n\nThe whole log: `dsv41 logs` or the Log tab.")
