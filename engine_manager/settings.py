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
import math
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Mapping

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


class SettingField:
    """One setting's declaration: its type (``annotation``), default, words and bounds."""

    __slots__ = ("name", "annotation", "default", "default_factory", "title", "description", "ge", "le",
                 "json_schema_extra", "kind", "choices")

    def __init__(self, default: Any = None, *, default_factory: Callable[[], Any] | None = None, title: str = "",
                 description: str = "", ge: float | None = None, le: float | None = None,
                 json_schema_extra: dict[str, Any] | None = None):
        self.name, self.annotation, self.kind, self.choices = "", None, "", ()
        self.default, self.default_factory = default, default_factory
        self.title, self.description, self.ge, self.le = title, description, ge, le
        self.json_schema_extra: dict[str, Any] = dict(json_schema_extra or {})

    def __repr__(self) -> str:
        return f"SettingField({self.name}: {self.kind})"

    def get_default(self) -> Any:
        return self.default_factory() if self.default_factory is not None else self.default


def setting(default: Any = None, **kw: Any) -> Any:
    """A setting's declaration in the class body (typed ``Any`` so that ``port: int = setting(8090, ...)`` reads as
    the attribute's type)."""
    return SettingField(default, **kw)


class InvalidSetting(ValueError):
    """A value a setting refuses: ``name``, the ``problem`` in words; ``text_rule`` when it is the text rules (not
    UTF-8, too long, not a usable path) that refused it — the message then says why."""

    def __init__(self, name: str, problem: str, text_rule: bool = False):
        super().__init__(f"{name}: {problem}")
        self.name, self.problem, self.text_rule = name, problem, text_rule


class Settings:
    """Every setting of the panel, each checked when it is given (``Settings(port=8091)``, :meth:`model_validate`,
    :meth:`model_copy`, an assignment): a value of the wrong kind, out of its range or not one of its choices is
    refused with :class:`InvalidSetting`. A field's ``json_schema_extra`` carries the environment name and the
    allowed values in words, used for error messages, the CLI and the settings dialog.

    Written here rather than as a pydantic model: importing pydantic and building this model took 0.16–0.20 s of
    the window's first step, most of the 0.41 s between the frame and a usable window (2-core machine, see
    benchmarks/results/startup.md, eleventh pass); the checks are ranges, choices and the text rules below."""

    model_fields: typing.ClassVar[dict[str, SettingField]]

    # -- the variables the deepseek-one-gpu guides name --------------------------------------------------
    model_dir: Path | None = setting(
        None,
        title="Model folder",
        description="Folder that already holds the model's seven GGUF shards (skips the download)",
        json_schema_extra={"env": "DSV41_MODEL_DIR", "allowed": "a folder path, or empty"},
    )
    cache_dir: Path = setting(
        Path("~/.cache/deepseek-one-gpu"),
        title="Cache folder",
        description="Where downloaded model shards and engine releases are kept",
        json_schema_extra={"env": "DSV41_CACHE_DIR", "allowed": "a folder path"},
    )
    default_max_tokens: int = setting(
        4096,
        title="Default max tokens",
        ge=1,
        le=1_048_576,
        description="max_tokens of a chat request unless the request says otherwise",
        json_schema_extra={"env": "DSV41_DEFAULT_MAX_TOKENS", "allowed": "an integer from 1 to 1048576"},
    )
    server_engine: EngineName = setting(
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
    host: str = setting(
        "127.0.0.1",
        title="Host (loopback)",
        description="Address the engine listens on (loopback only)",
        json_schema_extra={"env": "DSV41_HOST", "allowed": "a loopback address such as 127.0.0.1 or ::1"},
    )
    port: int = setting(
        8090,
        title="Port",
        ge=1024,
        le=65535,
        description="TCP port of the engine's HTTP server",
        json_schema_extra={"env": "DSV41_PORT", "allowed": "an integer from 1024 to 65535"},
    )
    api_key: str = setting(
        "",
        title="API key",
        description="API key the engine requires (generated on first run; shown masked)",
        json_schema_extra={
            "env": "DSV41_API_KEY",
            "allowed": "16 to 256 printable characters without spaces (empty generates one)",
            "secret": True,
        },
    )
    slots: int = setting(
        1,
        title="Slots (users)",
        ge=1,
        le=8,
        description="Concurrent requests the engine serves (batch slots)",
        json_schema_extra={"env": "DSV41_SLOTS", "allowed": "an integer from 1 to 8"},
    )
    context_length: int = setting(
        32768,
        title="Context per slot (tokens)",
        ge=512,
        le=1_048_576,
        description="Maximum context per slot, in tokens",
        json_schema_extra={"env": "DSV41_CONTEXT_LENGTH", "allowed": "an integer from 512 to 1048576"},
    )
    kv_type: Literal["int8", "q4_0", "k8v4"] = setting(
        "int8",
        title="KV cache type",
        description="KV cache type",
        json_schema_extra={"env": "DSV41_KV_TYPE", "allowed": "one of int8, q4_0, k8v4"},
    )
    cpu_numerics: Literal["fork", "gpu"] = setting(
        "fork",
        title="CPU expert numerics",
        description="CPU expert numerics: fork (fast) or gpu (bit-identical batched answers, ~26% slower)",
        json_schema_extra={"env": "DSV41_CPU_NUMERICS", "allowed": "one of fork, gpu"},
    )
    strata_prefill_auto: bool = setting(
        True,
        title="Read prompts in chunks (Strata --prefill auto)",
        description="Pass --prefill auto to the Strata engine, as Strata's setup does (its default reads a prompt "
                    "token by token)",
        json_schema_extra={"env": "DSV41_STRATA_PREFILL_AUTO", "allowed": "true or false"},
    )
    vram_reserve_mib: int = setting(
        700,
        title="VRAM reserve (MiB)",
        ge=0,
        le=65536,
        description="VRAM kept free for CUDA's own use, in MiB",
        json_schema_extra={"env": "DSV41_VRAM_RESERVE_MIB", "allowed": "an integer from 0 to 65536"},
    )
    ready_timeout_s: int = setting(
        7200,
        title="Readiness timeout (s)",
        ge=5,
        le=172_800,
        description="How long to wait for the engine to become ready, in seconds",
        json_schema_extra={"env": "DSV41_READY_TIMEOUT", "allowed": "an integer from 5 to 172800"},
    )
    gpu_index: int = setting(
        0,
        title="GPU index",
        ge=0,
        le=63,
        description="Which GPU (NVML index) the engine uses",
        json_schema_extra={"env": "DSV41_GPU", "allowed": "an integer from 0 to 63"},
    )
    numa_binding: Literal["auto", "off"] = setting(
        "auto",
        title="NUMA binding",
        description="Bind the engine to the GPU's NUMA node (auto) or not (off)",
        json_schema_extra={"env": "DSV41_NUMA", "allowed": "one of auto, off"},
    )
    auto_restart: bool = setting(
        True,
        title="Restart after a crash",
        description="Restart the engine after a crash (with backoff, up to a crash-loop limit)",
        json_schema_extra={"env": "DSV41_AUTO_RESTART", "allowed": "true or false"},
    )
    metrics_hz: float = setting(
        1.0,
        title="Monitor rate (Hz)",
        ge=0.25,
        le=10.0,
        description="How often the monitor polls, in Hz",
        json_schema_extra={"env": "DSV41_METRICS_HZ", "allowed": "a number from 0.25 to 10"},
    )
    desktop_notifications: bool = setting(
        False,
        title="Desktop notifications",
        description="Tell the desktop (tray message, else notify-send) when the engine crashes or stalls, or a "
        "planned-vs-measured check fails",
        json_schema_extra={"env": "DSV41_DESKTOP_NOTIFICATIONS", "allowed": "true or false"},
    )
    # -- the model and the engine binaries -------------------------------------------------------------
    model_repo: str = setting(
        DEFAULT_MODEL_REPO,
        title="Model repository",
        description="Hugging Face repository of the GGUF shards",
        json_schema_extra={"env": "DSV41_MODEL_REPO", "allowed": "owner/name"},
    )
    model_revision: str = setting(
        default_factory=_manifest_revision,
        title="Model revision",
        description="Revision (commit) of the repository to download",
        json_schema_extra={"env": "DSV41_MODEL_REVISION", "allowed": "a branch, tag or 40-hex commit"},
    )
    engine_dir: Path | None = setting(
        None,
        title="Strata engine folder",
        description="Folder of the unpacked Strata engine release (empty: the one downloaded into the cache)",
        json_schema_extra={"env": "DSV41_ENGINE_DIR", "allowed": "a folder path, or empty"},
    )
    llama_server: Path | None = setting(
        None,
        title="llama-server binary",
        description="Path of a llama-server binary (empty: the one from the [llamacpp] extra)",
        json_schema_extra={"env": "DSV41_LLAMA_SERVER", "allowed": "a file path, or empty"},
    )
    llamacpp_model: Path | None = setting(
        None,
        title="GGUF for llama-server",
        description="First shard of the GGUF that llama-server loads (empty: the model folder's)",
        json_schema_extra={"env": "DSV41_LLAMACPP_MODEL", "allowed": "a .gguf file path, or empty"},
    )
    llamacpp_log_verbosity: int = setting(
        4,
        title="llama-server log level",
        ge=3,
        le=5,
        description="llama-server log verbosity: 4 shows buffer placement; 5 adds a line per overridden tensor "
        "(and per token, and the prompts)",
        json_schema_extra={"env": "DSV41_LLAMACPP_LOG_VERBOSITY", "allowed": "an integer from 3 to 5"},
    )
    llamacpp_load_mode: Literal["auto", "mmap", "none", "mlock"] = setting(
        "auto",
        title="llama-server load mode",
        description="How llama-server loads weights: auto (pinned RAM for RAM-resident experts on a GPU build), "
        "mmap, none, mlock",
        json_schema_extra={"env": "DSV41_LLAMACPP_LOAD_MODE", "allowed": "one of auto, mmap, none, mlock"},
    )
    engine_manifest: Path | None = setting(
        None,
        title="Engine release manifest",
        description="Engine release manifest (version, url, size, sha256) instead of the pinned one",
        json_schema_extra={"env": "DSV41_ENGINE_MANIFEST", "allowed": "a .json file path, or empty"},
    )
    sim_args: str = setting(
        "",
        title="Scripted engine flags",
        description="Extra flags for the scripted engine (fault switches, --speed, --skew; see dsv41 sim --help)",
        json_schema_extra={"env": "DSV41_SIM_ARGS", "allowed": "command-line flags of `dsv41 sim`"},
    )
    hf_token: str = setting(
        "",
        title="Hugging Face token",
        description="Hugging Face token for the download (HF_TOKEN in the environment also works)",
        json_schema_extra={"env": "DSV41_HF_TOKEN", "allowed": "a Hugging Face token, or empty", "secret": True},
    )

    # -- values ----------------------------------------------------------------------------------------------
    def __init__(self, **values: Any):
        fields = type(self).model_fields
        unknown = [n for n in values if n not in fields]
        if unknown:
            raise InvalidSetting(unknown[0], "there is no such setting")
        for name, f in fields.items():
            object.__setattr__(self, name, _check(f, values[name]) if name in values else f.get_default())

    def __setattr__(self, name: str, value: Any) -> None:
        f = type(self).model_fields.get(name)
        if f is None:
            raise AttributeError(f"there is no setting named {name!r}")
        object.__setattr__(self, name, _check(f, value))

    @classmethod
    def model_validate(cls, data: Mapping[str, Any]) -> "Settings":
        """Settings from a mapping of name → value, each value checked; a name that is not a setting is refused."""
        if not isinstance(data, Mapping):
            raise InvalidSetting("settings", f"a mapping of names to values is needed, not {type(data).__name__}")
        return cls(**dict(data))

    def model_copy(self, update: Mapping[str, Any] | None = None) -> "Settings":
        """A copy, with the values of ``update`` checked and put in."""
        return type(self)(**{**self.model_dump(), **dict(update or {})})

    def model_dump(self) -> dict[str, Any]:
        """Name → value, in the declaration's order (paths as ``Path``)."""
        return {name: getattr(self, name) for name in type(self).model_fields}

    def model_dump_json(self) -> str:
        return json.dumps(self.model_dump(), default=str)

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return iter(self.model_dump().items())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Settings):
            return NotImplemented
        return self.model_dump() == other.model_dump()

    __hash__ = None     # type: ignore[assignment]  # mutable, compared by value

    def __repr__(self) -> str:
        return f"Settings({', '.join(f'{k}={v!r}' for k, v in self.masked().items())})"

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


# -- the checks ------------------------------------------------------------------------------------------------

_TRUE, _FALSE = {"1", "true", "yes", "on", "t", "y"}, {"0", "false", "no", "off", "f", "n"}
_INT = re.compile(r"[+-]?[0-9]+")


def _kind(annotation: Any) -> tuple[str, tuple[Any, ...]]:
    if typing.get_origin(annotation) is Literal:
        return "choice", typing.get_args(annotation)
    if annotation in (bool, int, float, str, Path):
        return annotation.__name__.lower(), ()
    if set(typing.get_args(annotation)) == {Path, type(None)}:
        return "optional_path", ()
    raise TypeError(f"no check for settings of type {annotation!r}")


def _text_rules(f: SettingField, v: Any) -> Any:
    """Text no file or environment could sensibly hold is refused for every setting, with the reason (bytes that
    are not UTF-8 made `start --dry-run` fail when the settings were written out; a 300-character folder name with
    an OSError traceback: tests/test_junk_settings.py)."""
    if isinstance(v, Path):
        v = str(v)
    if not isinstance(v, str):
        return v
    if f.kind in ("path", "optional_path"):
        problem = paths.path_problem(v)
    elif paths._has_surrogates(v):
        problem = "it is not valid UTF-8 text"
    elif len(v) > MAX_TEXT:
        problem = f"it is {len(v):,} characters long (at most {MAX_TEXT:,})"
    else:
        problem = None
    if problem:
        raise InvalidSetting(f.name, problem, text_rule=True)
    return v


def _of_kind(f: SettingField, v: Any) -> Any:
    """``v`` as the setting's type: numbers and true/false also from their text (the environment's values are
    text); nothing else is converted."""
    k = f.kind
    if k == "bool":
        if isinstance(v, bool):
            return v
        if isinstance(v, (int, float)) and v in (0, 1):
            return bool(v)
        if isinstance(v, str) and v.strip().lower() in _TRUE | _FALSE:
            return v.strip().lower() in _TRUE
        raise InvalidSetting(f.name, "not true or false")
    if k == "int":
        if isinstance(v, int) and not isinstance(v, bool):
            return v
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, str) and _INT.fullmatch(v.strip()) and len(v.strip()) <= 20:
            return int(v.strip())
        raise InvalidSetting(f.name, "not a whole number")
    if k == "float":
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out = float(v)
        elif isinstance(v, str) and len(v) <= 64:
            try:
                out = float(v.strip())
            except ValueError:
                raise InvalidSetting(f.name, "not a number") from None
        else:
            raise InvalidSetting(f.name, "not a number")
        if not math.isfinite(out):
            raise InvalidSetting(f.name, "not a finite number")
        return out
    if k == "str":
        if isinstance(v, str):
            return v
        raise InvalidSetting(f.name, "not text")
    if k in ("path", "optional_path"):
        if isinstance(v, str):
            return Path(v)
        raise InvalidSetting(f.name, "not a path")
    if isinstance(v, str) and v in f.choices:
        return v
    raise InvalidSetting(f.name, f"not one of {', '.join(map(str, f.choices))}")


def _loopback(v: str) -> str:
    v = v.strip()
    if v == "localhost":
        return v
    try:
        if ipaddress.ip_address(v).is_loopback:
            return v
    except ValueError:
        pass
    raise ValueError("not a loopback address")


def _key(v: str) -> str:
    if v and (len(v) < 16 or len(v) > 256 or not v.isprintable() or any(c.isspace() for c in v)):
        raise ValueError("bad API key")
    return v


def _repo(v: str) -> str:
    parts = v.strip().split("/")
    if len(parts) != 2 or not all(parts):
        raise ValueError("not owner/name")
    return v.strip()


def _rev(v: str) -> str:
    v = v.strip()
    if not v or any(c.isspace() for c in v):
        raise ValueError("empty revision")
    return v


def _sim_args(v: str) -> str:
    import shlex
    shlex.split(v)  # unbalanced quotes are refused here, not when the engine starts
    return v.strip()


# after the type and range: the rules of single settings
_AFTER: dict[str, Callable[[Any], Any]] = {"host": _loopback, "api_key": _key, "model_repo": _repo,
                                           "model_revision": _rev, "sim_args": _sim_args}


def _check(f: SettingField, v: Any) -> Any:
    """``v`` checked as setting ``f``: its value as the setting holds it, or :class:`InvalidSetting`."""
    if f.kind == "optional_path" and (v is None or (isinstance(v, str) and not v.strip())):
        return None
    if f.name == "server_engine" and isinstance(v, str):
        v = v.strip().lower()
        v = ENGINE_ALIASES.get(v, v)
    v = _of_kind(f, _text_rules(f, v))
    if (f.ge is not None and v < f.ge) or (f.le is not None and v > f.le):
        raise InvalidSetting(f.name, f"out of range ({f.ge} to {f.le})")
    rule = _AFTER.get(f.name)
    if rule is not None:
        try:
            v = rule(v)
        except ValueError as exc:
            raise InvalidSetting(f.name, str(exc)) from None
    return v


def _collect_fields(cls: type) -> dict[str, SettingField]:
    """The class body's ``setting(...)`` declarations, in order, each told its name and type; the class keeps
    them in ``model_fields`` only (an instance holds the values)."""
    hints = typing.get_type_hints(cls)
    out: dict[str, SettingField] = {}
    for name, value in list(vars(cls).items()):
        if isinstance(value, SettingField):
            value.name, value.annotation = name, hints[name]
            value.kind, value.choices = _kind(value.annotation)
            out[name] = value
            delattr(cls, name)
    return out


Settings.model_fields = _collect_fields(Settings)


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
    import secrets

    return API_KEY_PREFIX + secrets.token_urlsafe(32)


def mask_secret(value: str | None) -> str:
    """``dsv41-abcdef…`` → ``dsv4…(49 chars)``; never the whole secret."""
    if not value:
        return ""
    return f"{paths.shown(value[:4])}…({len(value)} chars)"


def _extra(info: SettingField) -> dict[str, Any]:
    """A setting's ``json_schema_extra``: env, allowed, secret."""
    return info.json_schema_extra


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
    f = Settings.model_fields.get(name)
    if f is None:
        raise unknown_setting(name, value)
    try:
        return _check(f, value)
    except InvalidSetting as exc:
        reason = exc.problem if exc.text_rule else None
        raise SettingsError(name, value, field_allowed(name), source, field_env(name), path, reason) from exc


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
