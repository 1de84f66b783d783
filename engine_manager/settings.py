"""The panel's one typed settings model.

Precedence: environment (``DSV41_*``) > the saved file (``settings.json`` in the config dir) > defaults.
The file is written atomically (temp file + rename), mode 0600, and the previous five versions are kept in
``backups/`` beside it. A bad value, from the environment or the file, is refused with a
:class:`SettingsError` naming the setting, the value and what is allowed. A file that is not valid JSON is moved
aside (never deleted), defaults are used, and a notice says where the old file went.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from . import paths
from .engines.registry import ALIASES
from .atomic import atomic_write_json, move_aside, rotate_backup

BACKUPS_KEPT = 5

DEFAULT_MODEL_REPO = "vcruz305/DeepSeek-V4.1-Flash-GGUF"


def _manifest_revision() -> str:
    """The model revision pinned in ``resources/manifests/model.json`` (``main`` if the manifest is absent)."""
    try:
        data = json.loads((paths.resources_dir() / "manifests" / "model.json").read_text())
        return str(data.get("revision") or "main")
    except (OSError, ValueError):
        return "main"


EngineName = Literal["auto", "strata", "llamacpp", "sim"]    # "auto" + engines.registry.STARTABLE (test_engines)
ENGINE_ALIASES = ALIASES            # engines.registry: the other spellings of an engine's name


class Settings(BaseModel):
    """Every setting of the panel. ``json_schema_extra`` carries the environment name and the allowed values
    in words, used for error messages, the CLI and the settings dialog."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # -- the variables the deepseek-one-gpu guides name --------------------------------------------------
    model_dir: Path | None = Field(
        None,
        title="Model folder",
        description="Folder that already holds the model's seven GGUF shards (skips the download)",
        json_schema_extra={"env": "DSV41_MODEL_DIR", "allowed": "a folder path, or empty"},
    )
    cache_dir: Path = Field(
        Path("~/.cache/deepseek-one-gpu"),
        title="Cache folder",
        description="Where downloaded model shards and engine releases are kept",
        json_schema_extra={"env": "DSV41_CACHE_DIR", "allowed": "a folder path"},
    )
    default_max_tokens: int = Field(
        4096,
        title="Default max tokens",
        ge=1,
        le=1_048_576,
        description="max_tokens of a chat request unless the request says otherwise",
        json_schema_extra={"env": "DSV41_DEFAULT_MAX_TOKENS", "allowed": "an integer from 1 to 1048576"},
    )
    server_engine: EngineName = Field(
        "auto",
        title="Engine",
        description="Which engine to run: strata (deepseek-one-gpu), llamacpp (stock llama-server), "
        "sim (the scripted engine; 'mock' is accepted), auto (strata with an NVIDIA GPU, else sim)",
        json_schema_extra={
            "env": "DSV41_SERVER_ENGINE",
            "allowed": "one of auto, strata, llamacpp, sim (or mock, an alias of sim)",
        },
    )
    # -- the engine's server ----------------------------------------------------------------------------
    host: str = Field(
        "127.0.0.1",
        title="Host (loopback)",
        description="Address the engine listens on (loopback only)",
        json_schema_extra={"env": "DSV41_HOST", "allowed": "a loopback address such as 127.0.0.1 or ::1"},
    )
    port: int = Field(
        8090,
        title="Port",
        ge=1024,
        le=65535,
        description="TCP port of the engine's HTTP server",
        json_schema_extra={"env": "DSV41_PORT", "allowed": "an integer from 1024 to 65535"},
    )
    api_key: str = Field(
        "",
        title="API key",
        description="API key the engine requires (generated on first run; shown masked)",
        json_schema_extra={
            "env": "DSV41_API_KEY",
            "allowed": "16 to 256 printable characters without spaces (empty generates one)",
            "secret": True,
        },
    )
    slots: int = Field(
        1,
        title="Slots (users)",
        ge=1,
        le=8,
        description="Concurrent requests the engine serves (batch slots)",
        json_schema_extra={"env": "DSV41_SLOTS", "allowed": "an integer from 1 to 8"},
    )
    context_length: int = Field(
        32768,
        title="Context per slot (tokens)",
        ge=512,
        le=1_048_576,
        description="Maximum context per slot, in tokens",
        json_schema_extra={"env": "DSV41_CONTEXT_LENGTH", "allowed": "an integer from 512 to 1048576"},
    )
    kv_type: Literal["int8", "q4_0", "k8v4"] = Field(
        "int8",
        title="KV cache type",
        description="KV cache type",
        json_schema_extra={"env": "DSV41_KV_TYPE", "allowed": "one of int8, q4_0, k8v4"},
    )
    cpu_numerics: Literal["fork", "gpu"] = Field(
        "fork",
        title="CPU expert numerics",
        description="CPU expert numerics: fork (fast) or gpu (bit-identical batched answers, ~26% slower)",
        json_schema_extra={"env": "DSV41_CPU_NUMERICS", "allowed": "one of fork, gpu"},
    )
    strata_prefill_auto: bool = Field(
        True,
        title="Read prompts in chunks (Strata --prefill auto)",
        description="Pass --prefill auto to the Strata engine, as Strata's setup does (its default reads a prompt "
                    "token by token)",
        json_schema_extra={"env": "DSV41_STRATA_PREFILL_AUTO", "allowed": "true or false"},
    )
    vram_reserve_mib: int = Field(
        700,
        title="VRAM reserve (MiB)",
        ge=0,
        le=65536,
        description="VRAM kept free for CUDA's own use, in MiB",
        json_schema_extra={"env": "DSV41_VRAM_RESERVE_MIB", "allowed": "an integer from 0 to 65536"},
    )
    ready_timeout_s: int = Field(
        7200,
        title="Readiness timeout (s)",
        ge=5,
        le=172_800,
        description="How long to wait for the engine to become ready, in seconds",
        json_schema_extra={"env": "DSV41_READY_TIMEOUT", "allowed": "an integer from 5 to 172800"},
    )
    gpu_index: int = Field(
        0,
        title="GPU index",
        ge=0,
        le=63,
        description="Which GPU (NVML index) the engine uses",
        json_schema_extra={"env": "DSV41_GPU", "allowed": "an integer from 0 to 63"},
    )
    numa_binding: Literal["auto", "off"] = Field(
        "auto",
        title="NUMA binding",
        description="Bind the engine to the GPU's NUMA node (auto) or not (off)",
        json_schema_extra={"env": "DSV41_NUMA", "allowed": "one of auto, off"},
    )
    auto_restart: bool = Field(
        True,
        title="Restart after a crash",
        description="Restart the engine after a crash (with backoff, up to a crash-loop limit)",
        json_schema_extra={"env": "DSV41_AUTO_RESTART", "allowed": "true or false"},
    )
    metrics_hz: float = Field(
        1.0,
        title="Monitor rate (Hz)",
        ge=0.25,
        le=10.0,
        description="How often the monitor polls, in Hz",
        json_schema_extra={"env": "DSV41_METRICS_HZ", "allowed": "a number from 0.25 to 10"},
    )
    desktop_notifications: bool = Field(
        False,
        title="Desktop notifications",
        description="Tell the desktop (tray message, else notify-send) when the engine crashes or stalls, or a "
        "planned-vs-measured check fails",
        json_schema_extra={"env": "DSV41_DESKTOP_NOTIFICATIONS", "allowed": "true or false"},
    )
    # -- the model and the engine binaries -------------------------------------------------------------
    model_repo: str = Field(
        DEFAULT_MODEL_REPO,
        title="Model repository",
        description="Hugging Face repository of the GGUF shards",
        json_schema_extra={"env": "DSV41_MODEL_REPO", "allowed": "owner/name"},
    )
    model_revision: str = Field(
        default_factory=_manifest_revision,
        title="Model revision",
        description="Revision (commit) of the repository to download",
        json_schema_extra={"env": "DSV41_MODEL_REVISION", "allowed": "a branch, tag or 40-hex commit"},
    )
    engine_dir: Path | None = Field(
        None,
        title="Strata engine folder",
        description="Folder of the unpacked Strata engine release (empty: the one downloaded into the cache)",
        json_schema_extra={"env": "DSV41_ENGINE_DIR", "allowed": "a folder path, or empty"},
    )
    llama_server: Path | None = Field(
        None,
        title="llama-server binary",
        description="Path of a llama-server binary (empty: the one from the [llamacpp] extra)",
        json_schema_extra={"env": "DSV41_LLAMA_SERVER", "allowed": "a file path, or empty"},
    )
    llamacpp_model: Path | None = Field(
        None,
        title="GGUF for llama-server",
        description="First shard of the GGUF that llama-server loads (empty: the model folder's)",
        json_schema_extra={"env": "DSV41_LLAMACPP_MODEL", "allowed": "a .gguf file path, or empty"},
    )
    llamacpp_log_verbosity: int = Field(
        4,
        title="llama-server log level",
        ge=3,
        le=5,
        description="llama-server log verbosity: 4 shows buffer placement; 5 adds a line per overridden tensor "
        "(and per token, and the prompts)",
        json_schema_extra={"env": "DSV41_LLAMACPP_LOG_VERBOSITY", "allowed": "an integer from 3 to 5"},
    )
    llamacpp_load_mode: Literal["auto", "mmap", "none", "mlock"] = Field(
        "auto",
        title="llama-server load mode",
        description="How llama-server loads weights: auto (pinned RAM for RAM-resident experts on a GPU build), "
        "mmap, none, mlock",
        json_schema_extra={"env": "DSV41_LLAMACPP_LOAD_MODE", "allowed": "one of auto, mmap, none, mlock"},
    )
    engine_manifest: Path | None = Field(
        None,
        title="Engine release manifest",
        description="Engine release manifest (version, url, size, sha256) instead of the pinned one",
        json_schema_extra={"env": "DSV41_ENGINE_MANIFEST", "allowed": "a .json file path, or empty"},
    )
    sim_args: str = Field(
        "",
        title="Scripted engine flags",
        description="Extra flags for the scripted engine (fault switches, --speed, --skew; see dsv41 sim --help)",
        json_schema_extra={"env": "DSV41_SIM_ARGS", "allowed": "command-line flags of `dsv41 sim`"},
    )
    hf_token: str = Field(
        "",
        title="Hugging Face token",
        description="Hugging Face token for the download (HF_TOKEN in the environment also works)",
        json_schema_extra={"env": "DSV41_HF_TOKEN", "allowed": "a Hugging Face token, or empty", "secret": True},
    )

    # -- validation ----------------------------------------------------------------------------------------
    @field_validator("*", mode="before")
    @classmethod
    def _text(cls, v: Any, info) -> Any:
        """Text no file or environment could sensibly hold is refused for every setting, with the reason (bytes
        that are not UTF-8 made `start --dry-run` fail with PydanticSerializationError; a 300-character folder name
        with an OSError traceback: tests/test_junk_settings.py)."""
        if isinstance(v, Path):
            v = str(v)
        if not isinstance(v, str):
            return v
        if info.field_name in PATH_FIELDS:
            problem = paths.path_problem(v)
        elif paths._has_surrogates(v):
            problem = "it is not valid UTF-8 text"
        elif len(v) > MAX_TEXT:
            problem = f"it is {len(v):,} characters long (at most {MAX_TEXT:,})"
        else:
            problem = None
        if problem:
            raise PydanticCustomError("dsv41_text", problem)
        return v

    @field_validator("server_engine", mode="before")
    @classmethod
    def _alias_engine(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = v.strip().lower()
            return ENGINE_ALIASES.get(v, v)
        return v

    @field_validator("host")
    @classmethod
    def _loopback(cls, v: str) -> str:
        v = v.strip()
        if v == "localhost":
            return v
        try:
            if ipaddress.ip_address(v).is_loopback:
                return v
        except ValueError:
            pass
        raise ValueError("not a loopback address")

    @field_validator("api_key")
    @classmethod
    def _key(cls, v: str) -> str:
        if v and (len(v) < 16 or len(v) > 256 or not v.isprintable() or any(c.isspace() for c in v)):
            raise ValueError("bad API key")
        return v

    @field_validator("model_repo")
    @classmethod
    def _repo(cls, v: str) -> str:
        parts = v.strip().split("/")
        if len(parts) != 2 or not all(parts):
            raise ValueError("not owner/name")
        return v.strip()

    @field_validator("model_revision")
    @classmethod
    def _rev(cls, v: str) -> str:
        v = v.strip()
        if not v or any(c.isspace() for c in v):
            raise ValueError("empty revision")
        return v

    @field_validator("sim_args")
    @classmethod
    def _sim_args(cls, v: str) -> str:
        import shlex
        shlex.split(v)  # unbalanced quotes are refused here, not when the engine starts
        return v.strip()

    @field_validator("model_dir", "engine_dir", "llama_server", "llamacpp_model", "engine_manifest", mode="before")
    @classmethod
    def _empty_path(cls, v: Any) -> Any:
        if v is None or (isinstance(v, str) and not v.strip()):
            return None
        return v

    # -- derived ---------------------------------------------------------------------------------------------
    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir).expanduser()

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def masked(self) -> dict[str, Any]:
        """A JSON-able dict with secrets masked: what may be printed or logged."""
        out: dict[str, Any] = {}
        for name, info in type(self).model_fields.items():
            value = getattr(self, name)
            if _extra(info).get("secret"):
                value = mask_secret(value)
            elif isinstance(value, Path):
                value = str(value)
            out[name] = value
        return out


PATH_FIELDS = frozenset(n for n, f in Settings.model_fields.items()
                         if "Path" in str(f.annotation))
MAX_TEXT = 4096                     # characters in any text setting (a key, a token, flags, a repository name)

# The settings an engine reads when it starts (its command line, its environment, the files made for it): a change
# reaches a running engine only at its next start. The others act at once (auto_restart, metrics_hz,
# desktop_notifications) or concern the downloads (cache_dir, model_repo, model_revision, engine_manifest, hf_token)
# or the next start's wait (ready_timeout_s).
RESTART_FIELDS = frozenset({
    "server_engine", "host", "port", "api_key", "slots", "context_length", "kv_type", "cpu_numerics",
    "vram_reserve_mib", "gpu_index", "numa_binding", "model_dir", "engine_dir", "llama_server", "llamacpp_model",
    "llamacpp_log_verbosity", "llamacpp_load_mode", "sim_args", "default_max_tokens", "strata_prefill_auto",
})


def restart_needed(changed) -> list[str]:
    """Of the settings ``changed`` (names), the titles of those that take effect at the engine's next start, in
    the model's order."""
    return [f.title or n for n, f in Settings.model_fields.items() if n in RESTART_FIELDS and n in set(changed)]


API_KEY_PREFIX = "dsv41-"


def new_api_key() -> str:
    """A fresh engine API key, the one format the panel generates: ``dsv41-`` and 43 URL-safe characters (256
    random bits), which the ``api_key`` setting accepts."""
    return API_KEY_PREFIX + secrets.token_urlsafe(32)


def mask_secret(value: str | None) -> str:
    """``dsv41-abcdef…`` → ``dsv4…(49 chars)``; never the whole secret."""
    if not value:
        return ""
    return f"{paths.shown(value[:4])}…({len(value)} chars)"


def _extra(info: FieldInfo) -> dict[str, Any]:
    """A settings field's ``json_schema_extra`` (env, allowed, secret): always a dict here, never pydantic's
    callable form."""
    extra = info.json_schema_extra
    return extra if isinstance(extra, dict) else {}


def field_env(name: str) -> str:
    return str(_extra(Settings.model_fields[name])["env"])


def field_allowed(name: str) -> str:
    return str(_extra(Settings.model_fields[name])["allowed"])


ENV_TO_FIELD = {field_env(n): n for n in Settings.model_fields}
# Every DSV41_* variable the panel's settings read: the settings' own, then the folders of engine_manager.paths.
ALL_ENV_VARS = tuple(ENV_TO_FIELD) + paths.ENV_VARS


class SettingsError(ValueError):
    """A setting's value was refused. ``str()`` is the message for the user."""

    def __init__(self, setting: str, value: Any, allowed: str, source: str, env: str | None = None,
                 path: Path | None = None, reason: str | None = None):
        self.setting, self.value, self.allowed, self.source, self.env = setting, value, allowed, source, env
        shown = mask_secret(str(value)) if _is_secret(setting) else paths.shown(value)
        if reason:
            allowed = f"{allowed} ({reason})"
        if source == "unknown":
            super().__init__(f"There is no setting named {setting!r}. {allowed}")
            return
        if source == "env":
            head = f"{env or setting}={shown!s}"
            tail = f"It is set in the environment: fix or unset {env} and try again."
        elif source == "file":
            head = f"{setting}={shown!s}"
            tail = f"It is set in {path or paths.settings_file()}: fix or remove it there."
        else:  # a value being saved (the settings dialog, `dsv41 settings set`): nothing was written
            head, tail = f"{setting}={shown!s}", "Nothing was saved."
        super().__init__(f"{head} is not allowed: {setting} must be {allowed}. {tail}")


class SettingsFileError(SettingsError):
    """The settings file cannot be read at all (permissions, a folder in its place...)."""

    def __init__(self, path: Path, exc: OSError, verb: str = "read"):
        self.setting, self.value, self.allowed, self.source, self.env = "", str(path), "", "file", None
        ValueError.__init__(self, f"The settings file {path} cannot be {verb} ({exc.strerror or exc}). Fix its "
                                  "permissions, or point DSV41_CONFIG_DIR at another folder.")


def unknown_setting(name: str, value: Any = None) -> SettingsError:
    """The error for a name that is not a setting, with the closest names and where to see them all."""
    import difflib

    names = list(Settings.model_fields)
    by_env = {field_env(n).lower(): n for n in names}
    close = difflib.get_close_matches(name.lower(), names + list(by_env), n=3, cutoff=0.5)
    close = list(dict.fromkeys(by_env.get(c, c) for c in close))
    hint = f"Did you mean {' or '.join(close)}? " if close else ""
    return SettingsError(name, value, hint + "`dsv41 settings list` shows every setting.", "unknown")


def _is_secret(name: str) -> bool:
    info = Settings.model_fields.get(name)
    return bool(info and _extra(info).get("secret"))


Source = Literal["env", "file", "default"]


@dataclass
class LoadedSettings:
    settings: Settings
    sources: dict[str, Source]
    file_values: dict[str, Any]
    path: Path
    notices: list[str] = field(default_factory=list)

    def env_locked(self, name: str) -> bool:
        return self.sources.get(name) == "env"


def _check_one(name: str, value: Any, source: str, path: Path | None = None) -> Any:
    """Validate one value on its own, so the error names exactly this setting."""
    try:
        validated = Settings.model_validate({name: value})
        return getattr(validated, name)
    except ValidationError as exc:
        env = field_env(name) if name in Settings.model_fields else None
        reason = next((e["msg"] for e in exc.errors() if e["type"] == "dsv41_text"), None)
        raise SettingsError(name, value, field_allowed(name), source, env, path, reason) from exc


def _coerce_env(name: str, raw: str) -> Any:
    if name == "auto_restart":
        low = raw.strip().lower()
        if low in {"1", "true", "yes", "on"}:
            return True
        if low in {"0", "false", "no", "off"}:
            return False
        return raw  # let validation refuse it with the standard message
    return raw


def load_settings(env: Mapping[str, str] | None = None, path: Path | None = None,
                  generate_key: bool = True, lenient: bool = False) -> LoadedSettings:
    """Load the effective settings. Raises :class:`SettingsError` for a bad value from env or file, and
    :class:`engine_manager.paths.PathVariableError` for a folder variable that cannot be used.

    ``lenient``: a bad value is skipped (its default is used) with a notice instead of refused — for what must
    always work whatever else is set, such as ``dsv41 stop``."""
    env = os.environ if env is None else env
    if path:
        path = Path(path)
    else:
        paths.ensure_private_dirs()     # the folder variables are checked here, before anything is read
        path = paths.settings_file()
    notices: list[str] = []
    file_values: dict[str, Any] = {}
    try:
        exists = path.exists()
    except OSError as exc:
        raise SettingsFileError(path, exc) from None
    if exists:
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(raw, dict):
                raise ValueError("top level is not an object")
            file_values = raw
        except OSError as exc:
            raise SettingsFileError(path, exc) from None
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            moved = move_aside(path, "corrupt")
            notices.append(
                f"The settings file {path} could not be read ({exc.__class__.__name__}: {exc}); "
                f"it was moved to {moved} and defaults are used."
            )
            file_values = {}
    unknown = sorted(k for k in file_values if k not in Settings.model_fields)
    if unknown:
        notices.append(f"Ignored unknown keys in {path}: {', '.join(unknown)}")
        file_values = {k: v for k, v in file_values.items() if k in Settings.model_fields}

    values: dict[str, Any] = {}
    sources: dict[str, Source] = {}

    def check(name: str, value: Any, source: str, where: Path | None = None) -> None:
        try:
            values[name] = _check_one(name, value, source, where)
            sources[name] = source   # type: ignore[assignment]
        except SettingsError as exc:
            if not lenient:
                raise
            notices.append(f"{exc} (Ignored here: the {'saved or ' if source == 'env' else ''}default value is "
                           "used.)")

    for name, value in file_values.items():
        check(name, value, "file", path)
    for env_name, name in ENV_TO_FIELD.items():
        if env_name in env:
            check(name, _coerce_env(name, env[env_name]), "env")
    settings = Settings.model_validate(values)
    for name in Settings.model_fields:
        sources.setdefault(name, "default")

    loaded = LoadedSettings(settings, sources, dict(file_values), path, notices)
    if generate_key and not settings.api_key:
        key = new_api_key()
        try:
            loaded = save_settings(loaded, {"api_key": key}, env=env)
        except OSError as exc:
            raise SettingsFileError(path, exc, "written") from None
        loaded.notices = notices + loaded.notices
    return loaded


def save_settings(loaded: LoadedSettings, updates: Mapping[str, Any],
                  env: Mapping[str, str] | None = None) -> LoadedSettings:
    """Validate ``updates`` (name → value) on top of the saved file, back up the old file, write the new one
    atomically (0600) and return the reloaded settings. Values set by the environment still win."""
    env = os.environ if env is None else env
    merged = dict(loaded.file_values)
    for name, value in updates.items():
        if name not in Settings.model_fields:
            raise unknown_setting(name, value)
        checked = _check_one(name, value, "input")
        merged[name] = str(checked) if isinstance(checked, Path) else checked
    for k in [k for k, v in merged.items() if v is None]:
        merged.pop(k)
    rotate_backup(loaded.path, loaded.path.parent / "backups", BACKUPS_KEPT)
    atomic_write_json(loaded.path, merged)
    return load_settings(env=env, path=loaded.path, generate_key=False)


def resolve_engine(settings: Settings, has_gpu: bool) -> str:
    """``auto`` → strata with an NVIDIA GPU, else the scripted engine."""
    if settings.server_engine != "auto":
        return settings.server_engine
    return "strata" if has_gpu else "sim"
