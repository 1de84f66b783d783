"""Where the panel keeps its files.

- config dir (settings.json and its backups): ``DSV41_CONFIG_DIR`` or the platform config dir.
- data dir (engine state file, logs, metric recordings, chat history, plans): ``DSV41_DATA_DIR`` or the
  platform data dir.
- cache dir (model shards, engine releases): the ``cache_dir`` setting (``DSV41_CACHE_DIR``).
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import platformdirs

from .errors import UserError

APP_NAME = "dsv41-panel"

# The variables read here (the settings' own variables are in engine_manager.settings: settings.ALL_ENV_VARS).
ENV_VARS = ("DSV41_CONFIG_DIR", "DSV41_DATA_DIR")

NAME_MAX = 255                      # bytes in one file or folder name (Linux, macOS)
PATH_MAX = 4095                     # bytes in a path (Linux PATH_MAX 4096 with its NUL)


class PathVariableError(UserError, ValueError):
    """A folder variable (``DSV41_CONFIG_DIR``, ``DSV41_DATA_DIR``) holds something no folder can be named by. The
    CLI exits 2 with this message; the GUI shows it."""

    def __init__(self, env: str, value: str, problem: str):
        self.env, self.value, self.problem = env, value, problem
        super().__init__(f"{env}={shown(value)} cannot be used: {problem}. Fix or unset {env} and try again.")


def shown(value: object, limit: int = 80) -> str:
    """A value as it may be printed: bytes that are not UTF-8 shown escaped (``\\xff``), long text cut."""
    text = value if isinstance(value, str) else str(value)
    if _has_surrogates(text):
        try:    # undecodable bytes from the environment (surrogateescape) show as the bytes they were
            text = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        except UnicodeEncodeError:
            text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(text) > limit:
        text = f"{text[:limit - 20]}…({len(text):,} characters)"
    return text


def _has_surrogates(text: str) -> bool:
    try:
        text.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def path_problem(text: str) -> str | None:
    """Why ``text`` cannot name a file or folder here (in words), or None when it can."""
    if _has_surrogates(text):
        return "it is not valid UTF-8 text"
    if "\0" in text:
        return "it holds a NUL character"
    n = len(text.encode("utf-8"))
    if n > PATH_MAX:
        return f"it is {n:,} bytes long; a path may be at most {PATH_MAX:,}"
    for part in text.split("/"):
        k = len(part.encode("utf-8"))
        if k > NAME_MAX:
            return f"the name {shown(part, 40)!r} in it is {k:,} bytes long; a file or folder name may be at most " \
                   f"{NAME_MAX}"
    return None


def env_path(env: str) -> Path | None:
    """The folder named by the variable ``env`` (``~`` expanded), None when unset or empty; a
    :class:`PathVariableError` when it cannot name a folder."""
    value = os.environ.get(env)
    if not value:
        return None
    problem = path_problem(value)
    if problem:
        raise PathVariableError(env, value, problem)
    try:
        return Path(value).expanduser()
    except RuntimeError as exc:     # ~user of a user that does not exist
        raise PathVariableError(env, value, f"{exc} ({value.split('/')[0]} is not a known home folder)") from None


def check_env() -> None:
    """Refuse a folder variable that cannot be used, before anything is read or written (PathVariableError)."""
    for env in ENV_VARS:
        env_path(env)


def config_dir() -> Path:
    return env_path("DSV41_CONFIG_DIR") or Path(platformdirs.user_config_dir(APP_NAME))


def data_dir() -> Path:
    return env_path("DSV41_DATA_DIR") or Path(platformdirs.user_data_dir(APP_NAME))


def settings_file() -> Path:
    return config_dir() / "settings.json"


def logs_dir() -> Path:
    return data_dir() / "logs"


def runs_dir() -> Path:
    return data_dir() / "runs"


def tighten(path: Path) -> None:
    """Make a folder the panel owns owner-only (0700): only a real folder (not a link: its target is not the panel's)
    that belongs to this user."""
    try:
        st = os.lstat(path)
        home = Path.home().resolve()
    except (FileNotFoundError, NotADirectoryError, RuntimeError):
        return
    if home == Path(path).resolve() or home.is_relative_to(Path(path).resolve()):
        return      # a variable pointed at the home folder (or above it): not the panel's to close
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)


def ensure_private_dirs() -> None:
    """Create the data folder 0700 and tighten the folders the panel owns (config, data, logs, runs) to 0700 where
    they exist (they were created 0755 by ``mkdir(parents=True)``). A folder that cannot be made
    is a :class:`PathVariableError` in plain words."""
    check_env()
    d = data_dir()
    try:
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        for p in (config_dir(), d, logs_dir(), runs_dir()):
            tighten(p)
    except OSError as exc:
        env = "DSV41_DATA_DIR" if os.environ.get("DSV41_DATA_DIR") else None
        where = exc.filename or d
        problem = f"the folder {where} cannot be made private to you ({exc.strerror or exc})"
        if env:
            raise PathVariableError(env, os.environ[env], problem) from None
        raise PathVariableError("DSV41_DATA_DIR", str(d), problem + "; set DSV41_DATA_DIR to a folder you can "
                                "write") from None


def resources_dir() -> Path:
    """The ``resources/`` folder: beside the source tree, else under ``<prefix>/share/dsv41-panel``."""
    if getattr(sys, "frozen", False):  # a PyInstaller bundle (packaging/dsv41-panel.spec)
        return Path(getattr(sys, "_MEIPASS", Path(sys.executable).parent)) / "resources"
    # a clone (editable install): beside the packages; a wheel installed into a venv or by pipx: <venv>/share/...
    # (pyproject's data-files); `pip install --user`: <user base>/share/...; a system install: <prefix>/share/...
    import site
    candidates = [Path(__file__).resolve().parent.parent / "resources"]
    candidates += [Path(base) / "share" / APP_NAME / "resources"
                   for base in (sys.prefix, getattr(site, "USER_BASE", None) or "", sys.base_prefix, "/usr/local",
                                "/usr") if base]
    for c in candidates:
        if (c / "manifests").is_dir():
            return c
    return candidates[1]       # where a wheel puts them (the error that follows names this folder)
