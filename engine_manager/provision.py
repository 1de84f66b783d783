"""Provisioning: turn the verified model shards into the pack the Strata engine loads, with the release's own tool.

As Strata's setup does (Niko1221/Strata ``setup.py``, native-pack branch), :func:`provision` runs the release's
``tools/iq_pack.py --gguf SHARD1 --out PACK`` once, with the release's Python (the panel never re-implements it);
the pack holds ``index.txt``, ``dense.bin``, ``conversions.json``, ``native_experts.txt`` and ``tokenizer/`` (the
server refuses ``--engine strata`` without ``tokenizer/vocab.json``: ``serve/server.py`` ``main()``). Shard 1 is
found from the split metadata (:mod:`engine_manager.gguf_split`); the tool's output becomes
:class:`ProvisionEvent` s (a line, and progress with an ETA from the ``  layer L ...`` lines it prints).
A pack counts as made only by the panel's **own sentinel**: Strata's setup trusts ``native_experts.txt`` existing,
but ``iq_pack.py`` writes ``dense.bin``, ``index.txt`` and the tokenizer in place, so a killed run leaves files that
exist and are wrong. The tool writes into a staging folder, renamed into place only after it exited 0, then
``.dsv41-provisioned.json`` (the source shards' and every pack file's size; atomic, 0600); a pack whose sentinel is
missing, unreadable or no longer matches is made again. Qt-free: the CLI (``dsv41 prepare``, ``dsv41 start --engine
strata``), the supervisor's start path and the GUI (through ``app.workers.run_generator``) all run :func:`provision`.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Generator

from .atomic import atomic_write_json, ensure_private_dir
from .release_check import UPGRADE_RELEASE
from .errors import UserError
from .eventbase import Event
from .fmt import bytes_si, duration
from .gguf_split import Split, find_split, strip_shard_suffix

SENTINEL = ".dsv41-provisioned.json"
MARKER = "dsv41-strata-pack/1"
STEP = "pack"
TOOL = Path("tools") / "iq_pack.py"
# Strata's completion marker, published last through a temporary name (tools/iq_pack.py main()), and what the
# server needs at start (serve/server.py main(): tokenizer/vocab.json; setup.py's config names PACK/tokenizer)
REQUIRED = ("native_experts.txt", "index.txt", "tokenizer/vocab.json")


class ProvisionError(UserError):
    """Provisioning failed; ``str()`` says what the tool said and what to do. ``cause`` (a short id) and ``fix``
    (what to do) when the failure is a known one (e.g. the tool refused the model's architecture)."""

    def __init__(self, message: str, cause: str | None = None, fix: str | None = None, summary: str | None = None):
        super().__init__(message)
        self.cause = cause
        self.fix = fix
        self.summary = summary or message       # what happened, without the fix (a caller that shows the fix apart)


# the release's tool refusing the model itself: another try, more disk or a new download cannot help
TOOL_REFUSALS = [
    # tools/iq_pack.py @d4e6823 main(): print(f"unsupported architecture {arch!r}"), exit 1 (qwen4exp, glm5-next)
    (re.compile(r"unsupported architecture '[^']{0,64}'"), "pack_arch_unsupported",
     "This release's iq_pack cannot prepare this model: " + UPGRADE_RELEASE[0].lower() + UPGRADE_RELEASE[1:]),
    # iq_pack.py @d4e6823 imports numpy at its top (strata_tokenizer.py: regex): run without the release's own
    # .venv packages it stops with Python's "No module named 'X'"
    (re.compile(r"No module named '[\w.]{1,64}'"), "release_python_missing",
     "The release's Python lacks a package its tools import: run Strata's setup in the release folder again "
     "(it makes the .venv with every package), or install the named package into the release's .venv."),
]


@dataclass(frozen=True)
class ProvisionEvent(Event):
    """One thing provisioning has to say. ``phase``: ``check`` (is it needed, and why), ``start`` (the tool
    runs: ``argv``, ``pid``), ``output`` (a line the tool printed), ``progress`` (``done`` of ``total`` with
    ``fraction`` and ``eta_s``), ``done`` (``skipped`` when the pack was already there)."""

    kind: ClassVar[str] = "provision"
    phase: str
    text: str
    step: str = STEP
    pack_dir: str | None = None
    argv: list[str] | None = None
    pid: int | None = None
    done: int | None = None
    total: int | None = None
    fraction: float | None = None
    eta_s: float | None = None
    elapsed_s: float | None = None
    skipped: bool = False



# ------------------------------------------------------------------------------------------------ where
def _safe_name(text: str) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._") or "model"
    return name[:120]


def model_key(shard1: Path) -> str:
    """The pack folder's name for a model: shard 1's name without ``.gguf`` and the ``-0000N-of-0000M`` part."""
    stem = shard1.name[:-5] if shard1.name.endswith(".gguf") else shard1.name
    return _safe_name(strip_shard_suffix(stem))


def packs_dir() -> Path:
    from . import paths

    return paths.data_dir() / "packs"


def pack_dir_for(shard1: Path) -> Path:
    """``<data dir>/packs/<model>``: where the pack of the model whose shard 1 is ``shard1`` lives."""
    return packs_dir() / model_key(Path(shard1))


# ------------------------------------------------------------------------------------------------ sentinel
def _pack_files(pack: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for root, dirs, files in os.walk(pack, followlinks=False):
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(root, d))]
        for f in files:
            p = Path(root) / f
            rel = p.relative_to(pack).as_posix()
            if rel == SENTINEL or p.is_symlink():
                continue
            out[rel] = p.stat().st_size
    return dict(sorted(out.items()))


def _source_sizes(split: Split) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in split.shards}


def pack_state(pack: Path, split: Split) -> tuple[bool, str]:
    """(ready, why): the pack is ready only when the panel's sentinel is there, names this model's shards with
    their sizes, and every file it lists still has its recorded size."""
    pack = Path(pack)
    if pack.is_symlink():
        return False, f"{pack} is a symbolic link; the panel makes its own pack there"
    sentinel = pack / SENTINEL
    if not sentinel.is_file():
        if (pack / "native_experts.txt").exists():
            return False, ("the pack exists but the panel never saw it finish (no completion record): an earlier "
                           "run may have been stopped part-way, so it is made again")
        return False, "the model has not been prepared for the Strata engine yet"
    try:
        rec = json.loads(sentinel.read_text())
    except (OSError, ValueError) as exc:
        return False, f"its completion record cannot be read ({exc}), so it is made again"
    if not isinstance(rec, dict) or rec.get("marker") != MARKER or not isinstance(rec.get("files"), dict):
        return False, "its completion record is not the panel's, so it is made again"
    if rec.get("source") != _source_sizes(split):
        return False, "the model's shards changed since the pack was made, so it is made again"
    if rec.get("shard1_path") not in (None, str(split.first.absolute())):
        return False, (f"the pack was made from another copy of the model ({rec.get('shard1_path')}), so it is made "
                       "again")
    for rel, size in rec["files"].items():
        p = pack / rel
        try:
            if p.is_symlink() or p.stat().st_size != size:
                return False, f"{rel} in the pack changed since it was made, so the pack is made again"
        except OSError:
            return False, f"{rel} is missing from the pack, so the pack is made again"
    missing = [r for r in REQUIRED if r not in rec["files"]]
    if missing:
        return False, f"the pack lacks {', '.join(missing)}, so it is made again"
    return True, "the pack is ready"


def needs_provision(pack: Path, model_path: os.PathLike | str) -> tuple[bool, str]:
    ready, why = pack_state(pack, find_split(model_path))
    return (not ready), why


# ------------------------------------------------------------------------------------------------ output
# bounded: a tool line with a 5,000-digit number must not reach int() (Python refuses over 4,300 digits)
_LAYER = re.compile(r"^\s*layer\s+(\d{1,6})\b", re.I)
_COUNT = re.compile(r"(?<!\d)(\d{1,12})\s*(?:/|of)\s*(\d{1,12})(?!\d)")


def _n_layers(split: Split) -> int | None:
    """The model's block count from shard 1's header (``<arch>.block_count``), for the tool's layer lines."""
    try:
        from .gguf_header import read_shard_header

        md = read_shard_header(split.first).metadata
        arch = md.get("general.architecture")
        n = md.get(f"{arch}.block_count")
        return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None
    except Exception:  # noqa: BLE001 - progress only
        return None


def parse_progress(line: str, n_layers: int | None) -> tuple[int, int] | None:
    """(done, total) from one line of the tool's output, or None. ``  layer L ...`` (``iq_pack.py`` ``main()``,
    printed every 8 layers while ``experts.bin`` is written) counts as L+1 of the model's layers; ``N/M`` or
    ``N of M`` counts as it says."""
    m = _LAYER.match(line)
    if m and n_layers:
        return min(int(m.group(1)) + 1, n_layers), n_layers
    m = _COUNT.search(line)
    if m:
        done, total = int(m.group(1)), int(m.group(2))
        if 0 <= done <= total and total > 0:
            return done, total
    return None


_EXC_LINE = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception|Exit)\b")
_WRAPPER = re.compile(r"CalledProcessError|^subprocess\.")


def _printable(text: str, limit: int = 300) -> str:
    """A tool's line made safe to show: control characters (terminal escapes) dropped, length capped."""
    text = "".join(c for c in text if c.isprintable())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def first_error_line(lines: list[str]) -> str:
    """The tool's own first words about what went wrong: a refusal it prints (``unsupported architecture 'X'``), else
    the first exception line that is not a wrapper's (``CalledProcessError`` names a child that failed, not why),
    else its last line."""
    text = [ln.strip() for ln in lines if ln.strip()]
    for ln in text:
        if any(rx.search(ln) for rx, _c, _f in TOOL_REFUSALS):
            return _printable(ln)
    for ln in text:
        if _EXC_LINE.match(ln) and not _WRAPPER.search(ln):
            return _printable(ln)
    return _printable(text[-1]) if text else ""


def _plain_failure(rc: int, lines: list[str], tool: Path) -> ProvisionError:
    said = first_error_line(lines)
    how = f"exit code {rc}"
    if rc < 0:
        try:
            how = f"killed by signal {-rc} ({signal.Signals(-rc).name})"
        except ValueError:
            how = f"killed by signal {-rc}"
    head = (f"Preparing the model for the Strata engine failed: the release's {tool.name} stopped with {how}"
            + (f" and said: {said}" if said else " and printed nothing"))
    for rx, cause, fix in TOOL_REFUSALS:
        if rx.search(said):
            return ProvisionError(f"{head}. {fix}", cause=cause, fix=fix, summary=f"{head}.")
    return ProvisionError(head + ". Check that every model shard is downloaded and verified (`dsv41 download` "
                          "resumes and verifies), that the disk has room for the pack, then run `dsv41 prepare` "
                          "again.")


def _links_in(root: Path) -> list[str]:
    """Every symbolic link inside ``root`` (files and folders), relative to it."""
    out: list[str] = []
    for base, dirs, files in os.walk(root, followlinks=False):
        for name in [*dirs, *files]:
            p = Path(base) / name
            if p.is_symlink():
                out.append(p.relative_to(root).as_posix())
        dirs[:] = [d for d in dirs if not (Path(base) / d).is_symlink()]
    return sorted(out)


# ------------------------------------------------------------------------------------------------ run
def tool_argv(python: str, release: Path, shard1: Path, out: Path) -> list[str]:
    """``<release python> <release>/tools/iq_pack.py --gguf SHARD1 --out OUT`` (Strata ``setup.py``, native
    pack)."""
    return [python, str(release / TOOL), "--gguf", str(shard1), "--out", str(out)]


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            proc.kill()
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def provision(release: os.PathLike | str, model_path: os.PathLike | str, *, python: str | None = None,
              pack: os.PathLike | str | None = None, force: bool = False
              ) -> Generator[ProvisionEvent, None, Path]:
    """Make the Strata pack of the model at ``model_path`` (its folder or any shard) with ``release``'s own
    ``tools/iq_pack.py``, unless the panel's sentinel says it is there and unchanged. Yields
    :class:`ProvisionEvent` s; returns the pack folder. Raises :class:`ProvisionError` (plain words) when the
    release has no tool or the tool fails. Closing the generator kills the tool."""
    release = Path(release).expanduser()
    split = find_split(model_path)
    pack = Path(pack) if pack is not None else pack_dir_for(split.first)
    ready, why = pack_state(pack, split)
    if ready and not force:
        yield ProvisionEvent("done", f"The model's Strata pack is ready ({pack}).", pack_dir=str(pack), skipped=True)
        return pack
    if ready:                                   # forced: say so, not "the pack is ready" before packing again
        why = "made again as asked (--force)"
    yield ProvisionEvent("check", f"Preparing the model for the Strata engine: {why}.", pack_dir=str(pack))
    tool = release / TOOL
    if not tool.is_file():
        raise ProvisionError(f"The engine release in {release} has no {TOOL} (the tool that prepares the model's "
                             "pack). Get the engine release again (`dsv41 download engine --from DIR` or `--url URL`) "
                             "or set DSV41_ENGINE_DIR to an unpacked Strata release.")
    if python is None:                  # the release's own .venv, never the panel's interpreter (the bundle's panel)
        from .release_check import SETUP_HINT, release_python

        found = release_python(release)
        if found is None:
            raise ProvisionError(f"The engine release in {release} has no .venv: its {TOOL} runs with the "
                                 f"release's own Python. To make it, {SETUP_HINT}; then run `dsv41 prepare` again.")
        python = str(found)
    ensure_private_dir(pack.parent)
    lock = _lock(pack)          # one provisioning of a pack at a time (the GUI, `dsv41 prepare`, a start)
    try:
        return (yield from _run_tool(release, split, pack, python, tool))
    finally:
        os.close(lock)


def _lock(pack: Path) -> int:
    path = pack.parent / f".{pack.name}.lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise ProvisionError(f"Cannot open the lock file {path} ({exc.strerror or exc}); a symbolic link or a wrong "
                             "file is in the way: remove it and try again.") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ProvisionError(f"Another dsv41 (the panel, `dsv41 prepare` or `dsv41 start`) is preparing {pack.name} "
                             "right now. Wait for it to finish, then try again.") from None
    return fd


def _run_tool(release: Path, split: Split, pack: Path, python: str, tool: Path
              ) -> Generator[ProvisionEvent, None, Path]:
    staging = pack.parent / f".{pack.name}.partial"
    if staging.is_symlink():
        staging.unlink()
    elif staging.exists():
        shutil.rmtree(staging)
    ensure_private_dir(staging)
    argv = tool_argv(python, release, split.first, staging)
    n_layers = _n_layers(split)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DSV41_KEEPER", "STRATA_API_KEY"))}
    env["PYTHONUNBUFFERED"] = "1"
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(argv, cwd=str(release), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=env, close_fds=True, start_new_session=True)
    except OSError as exc:
        raise ProvisionError(f"Could not run the release's {TOOL} with {python}: {exc}. Check the engine release "
                             "(DSV41_ENGINE_DIR) and its Python.") from None
    yield ProvisionEvent("start", f"Running the release's {TOOL.name} on {split.first.name} "
                                  f"({split.count} shard{'s' * (split.count != 1)}) …",
                         pack_dir=str(pack), argv=argv, pid=proc.pid)
    lines: deque[str] = deque(maxlen=40)
    first: list[str] = []               # the tool's first lines too: its first error may be long before the end
    n_lines = 0
    assert proc.stdout is not None
    try:
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\r\n")[:4096]
            lines.append(line)
            n_lines += 1
            if len(first) < 200:
                first.append(line)
            elapsed = time.monotonic() - t0
            yield ProvisionEvent("output", line, pack_dir=str(pack), pid=proc.pid, elapsed_s=elapsed)
            got = parse_progress(line, n_layers)
            if got:
                done, total = got
                frac = done / total
                eta = elapsed * (1 - frac) / frac if frac > 0 else None
                yield ProvisionEvent("progress", f"{done} of {total}", pack_dir=str(pack), pid=proc.pid,
                                     done=done, total=total, fraction=frac, eta_s=eta, elapsed_s=elapsed)
        rc = proc.wait()
    finally:
        _kill(proc)             # a closed generator (cancel, Ctrl+C) leaves no tool running
        proc.stdout.close()
    if rc != 0:
        raise _plain_failure(rc, first + (list(lines) if n_lines > len(first) else []), tool)
    links = _links_in(staging)
    if links:                           # as the state files: a link is refused, never followed or trusted
        raise ProvisionError(f"The release's {TOOL.name} wrote {', '.join(links[:3])} in the pack as a symbolic "
                             "link; the panel accepts only plain files there (a link can point anywhere and change "
                             "later). Use a release whose tool writes the pack's files itself, then run `dsv41 "
                             "prepare` again.")
    missing = [r for r in REQUIRED if not (staging / r).is_file()]
    if missing:
        raise ProvisionError(f"The release's {TOOL.name} exited without error but did not write "
                             f"{', '.join(missing)} in the pack. The release may be incomplete: download it again "
                             "(`dsv41 download engine --from DIR` or `--url URL`).")
    files = _pack_files(staging)
    if pack.is_symlink():
        pack.unlink()
    elif pack.exists():
        shutil.rmtree(pack)
    os.replace(staging, pack)
    atomic_write_json(pack / SENTINEL, {"marker": MARKER, "step": STEP, "tool": [str(a) for a in argv[1:2]],
                                        "shard1": split.first.name, "shard1_path": str(split.first.absolute()),
                                        "source": _source_sizes(split),
                                        "files": files, "finished_at": time.time()})
    yield ProvisionEvent("done", f"The model's Strata pack is ready ({pack}, {bytes_si(sum(files.values()))}, "
                                 f"{time.monotonic() - t0:.1f} s).", pack_dir=str(pack),
                         elapsed_s=time.monotonic() - t0)
    return pack


def describe(ev: ProvisionEvent) -> str | None:
    """One line for a person (CLI), or None for events a terminal need not show."""
    if ev.phase == "progress":
        eta = f", about {duration(ev.eta_s)} left" if ev.eta_s is not None else ""
        return f"preparing: {ev.done} of {ev.total} ({ev.fraction:.0%}){eta}"
    if ev.phase == "output":
        return f"  | {ev.text}"
    return ev.text

