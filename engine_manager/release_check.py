"""A Strata engine release as Strata's setup lays it out, found and checked in one place.

The layout (Niko1221/Strata ``setup.py`` @28c47b1 ``get_prebuilt``, ``pip_install``, ``cuda_lib_dirs``, ``main``):
- ``engine/strata`` (and ``strata-vision``) with ``engine/BUILD.json`` (``version``, ``cuda``, ``archs`` as ints,
  ``ptx``; a locally compiled engine's says ``source: "local"`` and ``cuda_dirs``), whose version the server reads
  (``serve/server.py`` @2291cb3 ``StrataEngine.__init__``);
- ``.venv``: the Python that runs ``serve/server.py`` and ``tools/iq_pack.py`` (jinja2, regex, numpy, ...) and
  NVIDIA's CUDA 13 wheels (setup's ``CUDA_WHEELS``). :func:`cuda_lib_dirs` finds the folders holding
  ``libcublas.so.13*`` under ``site-packages/nvidia``; setup writes them as the config's ``lib_dirs``
  (``meta.get("cuda_dirs") or cuda_lib_dirs()``), which the server's ``child_env`` puts first on ``LD_LIBRARY_PATH``;
- ``serve/server.py`` and ``tools/iq_pack.py``.
:func:`check_release` returns typed results (:class:`ReleaseCheck`) that ``dsv41 doctor``, the adapter's preflight
and a GUI "use a release I already have" can all show. Never imports Qt.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from .atomic import LinkRefused, read_bytes_nofollow

#: where a release keeps its engine binary: Strata's setup layout first (engine/strata), then older layouts
ENGINE_BINARIES = ("engine/strata", "bin/strata", "build/bin/strata", "build/strata", "strata", "bin/strata-engine")
VENV_PYTHONS = (".venv/bin/python", ".venv/bin/python3")
SERVER = Path("serve") / "server.py"
TOOL = Path("tools") / "iq_pack.py"
BUILD_JSON = "BUILD.json"
BUILD_JSON_MAX_BYTES = 64 * 1024
CUBLAS_GLOB = "libcublas.so.13*"      # setup.py cuda_lib_dirs() on Linux
MAX_LIB_DIRS = 16
#: what the server, its tokenizer and iq_pack import from the release's .venv (serve/frontend.py: jinja2;
#: tools/strata_tokenizer.py: regex; tools/iq_pack.py @d4e6823: numpy at the top)
SERVER_NEEDS = ("jinja2", "regex", "numpy")
SETUP_HINT = ("run Strata's setup in the release folder (`./setup.sh`, which creates .venv with the server's "
              "packages and NVIDIA's CUDA libraries), or `python3 -m venv .venv && .venv/bin/pip install jinja2 "
              "regex numpy nvidia-cublas==13.0.2.14 nvidia-cuda-runtime==13.0.96` there")

#: what to do when the release's own tools refuse the model (upstream Strata packs and runs Qwen/GLM models only)
UPGRADE_RELEASE = ("Use the deepseek-one-gpu engine release, which runs DeepSeek-V4.1-Flash (`dsv41 download engine "
                   "--url URL` with its archive's address, or `dsv41 download engine --from DIR` with its unpacked "
                   "folder); downloading this release again does not help.")

Status = Literal["pass", "warn", "fail", "info"]


class ReleaseError(ValueError):
    """The release cannot be used as it is; ``str()`` says what and what to do."""


@dataclass(frozen=True)
class BuildInfo:
    """``engine/BUILD.json``, validated (every field optional except that it is a JSON object)."""

    path: str
    version: str | None = None
    cuda: str | None = None
    archs: tuple[int, ...] = ()
    ptx: bool = False
    source: str | None = None
    lib_dirs: tuple[str, ...] = ()

    def arch_text(self) -> str:
        return ", ".join(f"sm_{a}" for a in self.archs) + (" (+PTX)" if self.ptx and self.archs else "")

    def summary(self) -> str:
        """``version 0.1.42, CUDA 13.0, sm_120`` (what is known)."""
        parts = [f"version {self.version}" if self.version else "version unknown"]
        if self.cuda:
            parts.append(f"CUDA {self.cuda}")
        if self.archs:
            parts.append(self.arch_text())
        if self.source == "local":
            parts.append("built on this machine")
        return ", ".join(parts)

    def runs_on(self, compute_capability: str | None) -> bool | None:
        """Whether this build has code for a GPU of ``compute_capability`` ("12.0"): its arch is listed, or the
        build carries PTX and the GPU is newer than every listed arch (setup.py ``get_prebuilt``). None: unknown."""
        if not compute_capability or not self.archs:
            return None
        try:
            major, minor = compute_capability.split(".")
            arch = int(major) * 10 + int(minor)
        except ValueError:
            return None
        return arch in self.archs or (self.ptx and arch > max(self.archs))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _short_str(v: Any, limit: int = 64) -> str | None:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        v = str(v)
    if not isinstance(v, str):
        return None
    v = "".join(c for c in v.strip() if c.isprintable())
    return v[:limit] or None


def read_build_json(path: os.PathLike | str) -> BuildInfo:
    """``BUILD.json`` read without following a link, at most 64 KiB, each field checked; :class:`ReleaseError`
    (plain words) when it cannot be used."""
    path = Path(path)
    try:
        raw = read_bytes_nofollow(path, BUILD_JSON_MAX_BYTES + 1)
    except LinkRefused as exc:
        raise ReleaseError(str(exc)) from None
    except OSError as exc:
        raise ReleaseError(f"{path} cannot be read ({exc.strerror or exc})") from None
    if len(raw) > BUILD_JSON_MAX_BYTES:
        raise ReleaseError(f"{path} is larger than {BUILD_JSON_MAX_BYTES // 1024} KiB: not a release's BUILD.json")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ReleaseError(f"{path} is not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ReleaseError(f"{path} is not a JSON object")
    archs_raw = doc.get("archs")
    archs: tuple[int, ...] = ()
    if isinstance(archs_raw, list):
        archs = tuple(int(a) for a in archs_raw[:32]
                      if isinstance(a, int) and not isinstance(a, bool) and 0 < a < 10_000)
    dirs_raw = doc.get("lib_dirs") or doc.get("cuda_dirs")
    dirs = tuple(str(d)[:4096] for d in dirs_raw[:MAX_LIB_DIRS] if isinstance(d, str) and d.strip()) \
        if isinstance(dirs_raw, list) else ()
    return BuildInfo(path=str(path), version=_short_str(doc.get("version")), cuda=_short_str(doc.get("cuda")),
                     archs=archs, ptx=doc.get("ptx") is True, source=_short_str(doc.get("source")), lib_dirs=dirs)


# ------------------------------------------------------------------------------------------------ finding
def engine_binary(release: os.PathLike | str) -> Path:
    """The release's engine binary: ``engine/strata`` first (Strata's setup), then the older layouts; the first
    that exists, else ``engine/strata`` (preflight then says it is missing)."""
    release = Path(release)
    for rel in ENGINE_BINARIES:
        p = release / rel
        if p.is_file():
            return p
    return release / ENGINE_BINARIES[0]


def build_info(release: os.PathLike | str) -> tuple[BuildInfo | None, str | None]:
    """(BUILD.json beside the engine binary, or None; why it could not be read, or None)."""
    path = engine_binary(release).parent / BUILD_JSON
    if not path.exists() and not path.is_symlink():
        return None, None
    try:
        return read_build_json(path), None
    except ReleaseError as exc:
        return None, str(exc)


def release_python(release: os.PathLike | str) -> Path | None:
    """The release's own ``.venv`` Python (never the panel's: inside the one-folder bundle ``sys.executable`` is
    the panel itself), or None when the release has none."""
    for rel in VENV_PYTHONS:
        p = Path(release) / rel
        if p.is_file() and os.access(p, os.X_OK):
            return p
    return None


def site_packages(release: os.PathLike | str) -> list[Path]:
    venv = Path(release) / ".venv"
    out: list[Path] = []
    for lib in ("lib", "lib64"):
        d = venv / lib
        if d.is_dir() and not d.is_symlink():
            out += sorted(p for p in d.glob("python3*/site-packages") if p.is_dir())
    return list(dict.fromkeys(out))


def cuda_lib_dirs(release: os.PathLike | str, build: BuildInfo | None = None) -> list[str]:
    """The folders the engine's CUDA libraries are in, as setup.py finds them: a locally built engine's
    ``BUILD.json`` ``cuda_dirs`` (those that exist), else the folders holding ``libcublas.so.13*`` under the
    ``.venv``'s ``site-packages/nvidia`` (``nvidia/cu13/lib``)."""
    if build is not None and build.lib_dirs:
        found = [d for d in build.lib_dirs if Path(d).is_dir()]
        if found:
            return found
    dirs: list[str] = []
    for sp in site_packages(release):
        nv = sp / "nvidia"
        if not nv.is_dir():
            continue
        for hit in sorted(nv.rglob(CUBLAS_GLOB)):
            if str(hit.parent) not in dirs:
                dirs.append(str(hit.parent))
            if len(dirs) >= MAX_LIB_DIRS:
                return dirs
    return dirs


# ------------------------------------------------------------------------------------------------ checking
@dataclass(frozen=True)
class ReleaseCheck:
    id: str
    title: str
    status: Status
    figure: str
    fix: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def python_imports(python: Path, modules: tuple[str, ...] = SERVER_NEEDS, timeout_s: float = 30.0
                   ) -> tuple[bool, str]:
    """(ok, what it said): runs ``python -c`` importing ``modules`` (no shell, a bounded answer)."""
    import subprocess       # here, not at the top: the engine column reads the release's facts on its first step

    code = "import " + ", ".join(modules)
    from .procs import run_capped

    try:
        cp = run_capped([str(python), "-c", code], timeout=timeout_s, cap=1 << 20,
                        env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")})
    except (OSError, subprocess.SubprocessError) as exc:
        return False, f"{python} could not be run ({exc})"
    if cp.returncode == 0:
        return True, ""
    if cp.cut:
        return False, f"{python} did not answer within {timeout_s:g} s (or wrote more than 1 MB)"
    out = (cp.stderr or cp.stdout).decode("utf-8", "replace")
    said = [ln.strip() for ln in out.splitlines() if ln.strip()]
    return False, (said[-1] if said else f"exit code {cp.returncode}")[:300]


def _driver_cuda_ok(build_cuda: str | None, driver_cuda: str | None) -> bool | None:
    def ver(s: str | None) -> tuple[int, int] | None:
        try:
            parts = (s or "").split(".")
            return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
        except ValueError:
            return None
    b, d = ver(build_cuda), ver(driver_cuda)
    return None if b is None or d is None else d >= b


def check_release(release: os.PathLike | str, *, compute_capability: str | None = None,
                  driver_cuda: str | None = None, run_python: bool = True) -> list[ReleaseCheck]:
    """Every check of a release folder, each with its fix: folder, engine binary (present, executable),
    BUILD.json (readable; its CUDA vs the driver's, its archs vs this GPU), the ``.venv`` Python (present, runs,
    imports the server's needs), the CUDA wheels' library folder, ``serve/server.py`` and ``tools/iq_pack.py``."""
    release = Path(release).expanduser()
    out: list[ReleaseCheck] = []
    get = ("Choose an unpacked Strata release (`dsv41 download engine --from DIR`, or the Downloads tab's \"Use an "
           "engine release I already have…\") or download one by its URL (`dsv41 download engine --url URL`)")
    if not release.is_dir():
        return [ReleaseCheck("release", "Strata engine release", "fail", f"{release} does not exist", get + ".")]
    exe = engine_binary(release)
    if not exe.is_file():
        out.append(ReleaseCheck("engine_binary", "Engine binary", "fail", f"none in {release} (looked for "
                                f"{', '.join(ENGINE_BINARIES[:3])}, …)",
                                f"The release has no engine binary. {get}; Strata's setup puts it at "
                                "engine/strata."))
    elif not os.access(exe, os.X_OK):
        out.append(ReleaseCheck("engine_binary", "Engine binary", "fail", f"{exe} is not executable",
                                f"Make it executable: `chmod +x {exe}`."))
    else:
        out.append(ReleaseCheck("engine_binary", "Engine binary", "pass", str(exe)))
    build, why = build_info(release)
    if build is None:
        out.append(ReleaseCheck("build_json", "Engine BUILD.json", "fail" if why else "warn",
                                why or f"no {BUILD_JSON} beside {exe.name}",
                                ("Download the engine release again: its BUILD.json says which CUDA and GPUs the "
                                 "engine was built for.") if why else
                                "Without BUILD.json the engine's CUDA version and GPU architectures are unknown "
                                "(Strata's prebuilt zip has one beside engine/strata)."))
    else:
        out.append(ReleaseCheck("build_json", "Engine BUILD.json", "pass", build.summary()))
        ok = _driver_cuda_ok(build.cuda, driver_cuda)
        if ok is False:
            out.append(ReleaseCheck("build_cuda", "CUDA of the engine vs the driver", "fail",
                                    f"engine built with CUDA {build.cuda}, the driver supports CUDA {driver_cuda}",
                                    f"Update the NVIDIA driver to one that supports CUDA {build.cuda} (580.65 or "
                                    "newer for CUDA 13), reboot, and start again."))
        elif ok:
            out.append(ReleaseCheck("build_cuda", "CUDA of the engine vs the driver", "pass",
                                    f"engine CUDA {build.cuda}, driver CUDA {driver_cuda}"))
        fits = build.runs_on(compute_capability)
        if fits is False:
            out.append(ReleaseCheck("build_arch", "GPU architecture of the engine", "fail",
                                    f"engine built for {build.arch_text()}; this GPU is "
                                    f"sm_{(compute_capability or '').replace('.', '')}",
                                    "This engine build has no code for this GPU: build the engine for it (Strata's "
                                    "`./setup.sh --build`) or use a release built for it."))
        elif fits:
            out.append(ReleaseCheck("build_arch", "GPU architecture of the engine", "pass",
                                    f"{build.arch_text()} runs on sm_{(compute_capability or '').replace('.', '')}"))
    py = release_python(release)
    if py is None:
        out.append(ReleaseCheck("venv", "The release's Python (.venv)", "fail", f"no {release / '.venv'}",
                                "The server and iq_pack run with the release's own Python: " + SETUP_HINT + "."))
    elif run_python:
        ok_imp, said = python_imports(py)
        if ok_imp:
            out.append(ReleaseCheck("venv", "The release's Python (.venv)", "pass",
                                    f"{py} imports {', '.join(SERVER_NEEDS)}"))
        else:
            out.append(ReleaseCheck("venv", "The release's Python (.venv)", "fail", f"{py}: {said}",
                                    "Install the server's packages into the release's .venv: "
                                    f"`{py} -m pip install {' '.join(SERVER_NEEDS)}` (or run Strata's setup "
                                    "again)."))
    else:
        out.append(ReleaseCheck("venv", "The release's Python (.venv)", "pass", str(py)))
    libs = cuda_lib_dirs(release, build)
    if libs:
        out.append(ReleaseCheck("cuda_libs", "CUDA libraries for the engine", "pass", ", ".join(libs)))
    elif build is not None and build.source == "local":
        out.append(ReleaseCheck("cuda_libs", "CUDA libraries for the engine", "warn",
                                "BUILD.json names no existing CUDA library folder",
                                "A locally built engine loads the CUDA toolkit's libraries: check that the toolkit "
                                "is still installed (`nvcc --version`)."))
    else:
        out.append(ReleaseCheck("cuda_libs", "CUDA libraries for the engine", "fail",
                                f"no {CUBLAS_GLOB} under {release / '.venv'}/lib/python3*/site-packages/nvidia",
                                "The prebuilt engine loads NVIDIA's CUDA 13 libraries from the release's .venv: "
                                + (f"`{py} -m pip install nvidia-cublas==13.0.2.14 nvidia-cuda-runtime==13.0.96`"
                                   if py else SETUP_HINT) + "."))
    elsewhere = nearby_release(release)
    for rel, what in ((SERVER, "Strata's server"), (TOOL, "The pack tool (iq_pack)")):
        p = release / rel
        fix = (f"This looks like part of a release: choose {elsewhere} instead." if elsewhere is not None else
               f"The release is incomplete. {get}.")
        out.append(ReleaseCheck(rel.stem, what, "pass" if p.is_file() else "fail",
                                str(p) if p.is_file() else f"{p} is missing",
                                "" if p.is_file() else fix))
    return out


def nearby_release(folder: os.PathLike | str) -> Path | None:
    """When ``folder`` is not itself a release but the folder above it is (the user chose the release's
    ``engine/``), or exactly one folder inside it is (an archive unpacked into a folder of its own): that folder.
    None otherwise. Only looks one level up and down."""
    folder = Path(folder)
    if (folder / SERVER).is_file():
        return None
    if (folder.parent / SERVER).is_file() and folder.parent != folder:
        return folder.parent
    try:
        inside = [d for d in folder.iterdir() if d.is_dir() and not d.is_symlink() and (d / SERVER).is_file()]
    except OSError:
        return None
    return inside[0] if len(inside) == 1 else None


def usable(checks: list[ReleaseCheck]) -> bool:
    """A release the panel may use: no check failed (warnings are shown, not blocking)."""
    return bool(checks) and not any(c.status == "fail" for c in checks)


def gpu_facts(gpu_index: int = 0) -> tuple[str | None, str | None]:
    """(compute capability, the driver's CUDA version) of GPU ``gpu_index`` as NVML reports them, for
    :func:`check_release`; (None, None) on a machine without an NVIDIA GPU (those checks are then skipped)."""
    from .hardware import probe_gpus

    gpus, _, _ = probe_gpus()
    gpu = next((g for g in gpus if g.index == gpu_index), gpus[0] if gpus else None)
    return (gpu.compute_capability, gpu.cuda_driver_version) if gpu is not None else (None, None)


def problems(checks: list[ReleaseCheck]) -> list[str]:
    """The failed checks as plain sentences (what is wrong: what to do)."""
    return [f"{c.title}: {c.figure}. {c.fix}" for c in checks if c.status == "fail"]


def engine_release_facts(engine_name: str, settings: Any) -> str | None:
    """What an engine's adapter says about the release it would start (``release_summary``: Strata's
    engine/BUILD.json version, CUDA, architectures), or None when it says nothing. One small file read, no process."""
    from .engines import get_engine

    try:
        eng = get_engine(engine_name)
    except Exception:  # noqa: BLE001 - an unknown engine name has no release to describe
        return None
    facts = getattr(eng, "release_summary", None)
    try:
        return facts(settings) if facts is not None else None
    except Exception:  # noqa: BLE001 - a report line must not break the caller
        return None
