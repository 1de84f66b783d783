"""Settings: precedence env > file > defaults, validation messages, atomic 0600 save with backups, corrupt-file
recovery."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from engine_manager import paths
from engine_manager.settings import (
    BACKUPS_KEPT, Settings, SettingsError, field_env, load_settings, mask_secret, resolve_engine, save_settings,
)


def test_defaults_match_the_guides(monkeypatch):
    monkeypatch.delenv("DSV41_CACHE_DIR")       # conftest points it at a temp dir; the default is what is checked
    loaded = load_settings()
    s = loaded.settings
    assert loaded.sources["cache_dir"] == "default"
    assert s.cache_dir == Path("~/.cache/deepseek-one-gpu")
    assert s.cache_path == Path.home() / ".cache" / "deepseek-one-gpu"
    assert s.default_max_tokens == 4096
    assert s.host == "127.0.0.1" and s.port == 8090
    assert s.ready_timeout_s == 7200
    assert s.model_repo == "vcruz305/DeepSeek-V4.1-Flash-GGUF"
    assert s.slots == 1 and s.cpu_numerics == "fork"


def test_guides_variable_names():
    assert field_env("model_dir") == "DSV41_MODEL_DIR"
    assert field_env("cache_dir") == "DSV41_CACHE_DIR"
    assert field_env("default_max_tokens") == "DSV41_DEFAULT_MAX_TOKENS"
    assert field_env("server_engine") == "DSV41_SERVER_ENGINE"


def test_api_key_generated_once_and_kept(isolated_dirs):
    first = load_settings()
    key = first.settings.api_key
    assert len(key) >= 32
    again = load_settings()
    assert again.settings.api_key == key
    assert key not in json.dumps(first.settings.masked())
    assert mask_secret(key).startswith(key[:4]) and key[5:] not in mask_secret(key)


def test_precedence_env_over_file_over_default():
    loaded = load_settings()
    loaded = save_settings(loaded, {"slots": 4, "port": 9001})
    assert loaded.settings.slots == 4 and loaded.sources["slots"] == "file"
    env = dict(os.environ, DSV41_SLOTS="6")
    both = load_settings(env=env)
    assert both.settings.slots == 6 and both.sources["slots"] == "env"
    assert both.settings.port == 9001 and both.sources["port"] == "file"
    assert both.sources["context_length"] == "default"


def test_mock_is_an_alias_of_sim():
    env = dict(os.environ, DSV41_SERVER_ENGINE="mock")
    assert load_settings(env=env).settings.server_engine == "sim"


@pytest.mark.parametrize("var,value,allowed", [
    ("DSV41_DEFAULT_MAX_TOKENS", "-5", "from 1 to 1048576"),
    ("DSV41_SLOTS", "9", "from 1 to 8"),
    ("DSV41_PORT", "80", "from 1024 to 65535"),
    ("DSV41_SERVER_ENGINE", "vllm", "one of auto, strata, llamacpp, sim"),
    ("DSV41_HOST", "0.0.0.0", "loopback"),
    ("DSV41_CPU_NUMERICS", "cpu", "one of fork, gpu"),
    ("DSV41_METRICS_HZ", "50", "from 0.25 to 10"),
    ("DSV41_AUTO_RESTART", "maybe", "true or false"),
])
def test_bad_env_value_names_variable_value_and_allowed(var, value, allowed):
    with pytest.raises(SettingsError) as ei:
        load_settings(env=dict(os.environ, **{var: value}))
    msg = str(ei.value)
    assert var in msg and value in msg and allowed in msg


def test_bad_file_value_is_refused_naming_the_file():
    p = paths.settings_file()
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"slots": 42}))
    with pytest.raises(SettingsError) as ei:
        load_settings()
    msg = str(ei.value)
    assert "slots=42" in msg and "from 1 to 8" in msg and str(p) in msg
    assert p.exists()  # a bad value is refused, the file is left for the user to fix


def test_corrupt_file_is_moved_aside_and_defaults_used():
    p = paths.settings_file()
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("{ not json")
    loaded = load_settings()
    assert loaded.settings.slots == 1
    aside = [q for q in p.parent.iterdir() if q.name.startswith("settings.json.corrupt-")]
    assert len(aside) == 1 and aside[0].read_text() == "{ not json"
    assert any(str(aside[0]) in n for n in loaded.notices)


def test_file_is_owner_only_and_atomic_with_five_backups():
    loaded = load_settings()
    p = loaded.path
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    for i in range(8):
        loaded = save_settings(loaded, {"slots": (i % 8) + 1})
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    backups = sorted((p.parent / "backups").iterdir())
    assert len(backups) == BACKUPS_KEPT
    assert all(stat.S_IMODE(b.stat().st_mode) == 0o600 for b in backups)
    # the newest backup is the version before the last save
    assert json.loads(backups[-1].read_text())["slots"] == 7
    assert not [q for q in p.parent.iterdir() if q.name.endswith(".tmp")]


def test_save_refuses_bad_value_and_keeps_old_file():
    loaded = save_settings(load_settings(), {"slots": 3})
    before = loaded.path.read_text()
    with pytest.raises(SettingsError):
        save_settings(loaded, {"slots": 0})
    assert loaded.path.read_text() == before


def test_unknown_keys_are_ignored_with_a_notice():
    p = paths.settings_file()
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"slots": 2, "from_the_future": 1}))
    loaded = load_settings()
    assert loaded.settings.slots == 2
    assert any("from_the_future" in n for n in loaded.notices)


def test_resolve_engine_auto():
    s = Settings()
    assert resolve_engine(s, has_gpu=False) == "sim"
    assert resolve_engine(s, has_gpu=True) == "strata"
    assert resolve_engine(Settings(server_engine="llamacpp"), has_gpu=False) == "llamacpp"


def test_a_value_being_saved_is_refused_without_blaming_the_file():
    loaded = load_settings()
    with pytest.raises(SettingsError) as ei:
        save_settings(loaded, {"slots": 9})
    msg = str(ei.value)
    assert "Nothing was saved" in msg and str(loaded.path) not in msg


def test_unknown_setting_names_the_closest():
    with pytest.raises(SettingsError) as ei:
        save_settings(load_settings(), {"max_tokens": 100})
    msg = str(ei.value)
    assert "no setting named 'max_tokens'" in msg and "default_max_tokens" in msg and "dsv41 settings list" in msg


def test_settings_path_and_list_work_while_a_value_is_refused():
    import subprocess
    import sys

    env = dict(os.environ, DSV41_DEFAULT_MAX_TOKENS="-5")
    for args, expect in ((["path"], "settings.json"), (["list"], "DSV41_DEFAULT_MAX_TOKENS")):
        r = subprocess.run([sys.executable, "-m", "engine_manager", "settings", *args], env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and expect in r.stdout, r.stderr
    r = subprocess.run([sys.executable, "-m", "engine_manager", "settings", "show"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "DSV41_DEFAULT_MAX_TOKENS" in r.stderr


# -- junk in folder variables and text settings, stop with a bad setting, private folders ----------------

def _cli(*args: str, env: dict | None = None, envb: dict | None = None):
    """``python -m engine_manager ARGS`` as a real process; ``envb``: variables given as raw bytes."""
    import subprocess
    import sys

    e = {os.fsencode(k): os.fsencode(v) for k, v in (env or os.environ).items()}
    for k, v in (envb or {}).items():
        e[os.fsencode(k)] = v
    return subprocess.run([sys.executable, "-m", "engine_manager", *args], env=e, capture_output=True,
                          timeout=120)


def test_an_over_long_config_dir_is_refused_naming_the_variable(tmp_path):
    """Item 10: a 300-character folder name in DSV41_CONFIG_DIR was an OSError (ENAMETOOLONG) traceback."""
    env = dict(os.environ, DSV41_CONFIG_DIR=str(tmp_path / ("c" * 300)))
    for args in (["settings", "show"], ["settings", "path"], ["status"]):
        r = _cli(*args, env=env)
        err = r.stderr.decode()
        assert r.returncode == 2 and "Traceback" not in err, err
        assert "DSV41_CONFIG_DIR" in err and "at most 255" in err, err


@pytest.mark.parametrize("var", ["DSV41_CACHE_DIR", "DSV41_ENGINE_DIR", "DSV41_ENGINE_MANIFEST", "DSV41_SIM_ARGS",
                                 "DSV41_DATA_DIR", "DSV41_MODEL_REPO"])
def test_bytes_that_are_not_utf8_are_refused_naming_the_variable(var):
    """Item 10: `start --dry-run` failed with PydanticSerializationError on such bytes."""
    r = _cli("start", "--dry-run", envb={var: b"/tmp/bad\xff\xfename"})
    err = r.stderr.decode()
    assert "Traceback" not in err, err
    assert r.returncode == 2 and var in err and "not valid UTF-8" in err and "\\xff\\xfe" in err, err


def test_a_huge_value_is_refused_and_shown_cut():
    with pytest.raises(SettingsError) as ei:
        load_settings(env={"DSV41_SIM_ARGS": "x" * 100_000})
    msg = str(ei.value)
    assert "DSV41_SIM_ARGS" in msg and "100,000 characters" in msg and len(msg) < 600


def test_lenient_loading_skips_a_bad_value_and_says_so():
    p = paths.settings_file()
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"slots": 99, "port": 9000}))
    with pytest.raises(SettingsError):
        load_settings()
    loaded = load_settings(lenient=True, generate_key=False)
    assert loaded.settings.slots == 1 and loaded.settings.port == 9000
    assert any("slots=99" in n for n in loaded.notices)


def test_stop_works_with_an_unrelated_bad_setting_in_the_file():
    """Item 14: `"slots": 99` in the settings file made `dsv41 stop` exit 2 without stopping anything."""
    p = paths.settings_file()
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"slots": 99}))
    r = _cli("stop")
    err = r.stderr.decode()
    assert r.returncode == 0 and "Traceback" not in err, err
    assert "slots=99" in err                       # said, not hidden
    r = _cli("status")
    assert r.returncode == 2 and "slots=99" in r.stderr.decode()    # everything else still refuses it


def test_the_panels_folders_are_made_private(tmp_path, monkeypatch):
    """Item 4 (folders): the data folder is created 0700, and existing config/data/logs/runs folders that were
    0755 (``mkdir(parents=True)`` gave parents the umask's mode) are tightened."""
    data = tmp_path / "share" / "dsv41"
    monkeypatch.setenv("DSV41_DATA_DIR", str(data))
    load_settings()
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    for d in (paths.config_dir(), data, data / "logs", data / "runs"):
        d.mkdir(exist_ok=True)
        d.chmod(0o755)
    elsewhere = tmp_path / "not-ours"
    elsewhere.mkdir(mode=0o755)
    elsewhere.chmod(0o755)
    (data / "logs").rmdir()
    (data / "logs").symlink_to(elsewhere)          # a link is left alone: its target is not the panel's
    load_settings()
    for d in (paths.config_dir(), data, data / "runs"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    assert stat.S_IMODE(elsewhere.stat().st_mode) == 0o755


def test_settings_set_fixes_the_value_the_file_has_wrong():
    """With `"slots": 99` in the file every command refused it, `dsv41 settings set slots 2` included: the way the
    message offers to fix it did not work. Setting that very value now does; setting another still refuses."""
    p = paths.settings_file()
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"slots": 99}))
    r = _cli("settings", "set", "port", "9001")
    assert r.returncode == 2 and "slots=99" in r.stderr.decode()
    r = _cli("settings", "set", "slots", "2")
    assert r.returncode == 0, r.stderr.decode()
    assert json.loads(p.read_text())["slots"] == 2


def test_a_folder_variable_pointed_at_home_does_not_close_home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o755)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("DSV41_CONFIG_DIR", str(home))
    load_settings()
    assert stat.S_IMODE(home.stat().st_mode) == 0o755
    assert (home / "settings.json").exists()


def test_every_way_in_checks_the_value_and_says_which_setting():
    """The model checks a value however it arrives — built, validated, copied or assigned — with the setting's
    name in the refusal; numbers and true/false also from text (the environment's values are text), nothing else
    converted; a secret never in the repr."""
    from engine_manager.settings import InvalidSetting

    s = Settings(port="8091", auto_restart="off", metrics_hz=" 2.5 ", model_dir="  ")
    assert (s.port, s.auto_restart, s.metrics_hz, s.model_dir) == (8091, False, 2.5, None)
    for bad in ({"port": 80}, {"port": True}, {"port": "80 90"}, {"metrics_hz": "nan"}, {"kv_type": "int4"},
                {"auto_restart": "maybe"}, {"model_repo": 5}, {"host": "10.0.0.1"}, {"no_such": 1}):
        name = next(iter(bad))
        with pytest.raises(InvalidSetting) as info:
            Settings.model_validate(bad)
        assert info.value.name == name, bad
    with pytest.raises(InvalidSetting):
        s.slots = 9
    with pytest.raises(InvalidSetting):
        s.model_copy(update={"context_length": 10})
    assert s.slots == 1 and s.model_copy(update={"slots": "4"}).slots == 4
    with pytest.raises(AttributeError):
        s.not_a_setting = 1
    key = "k" * 40
    shown = repr(Settings(api_key=key))
    assert key not in shown and mask_secret(key) in shown
    assert Settings(api_key=key) == Settings(api_key=key) != Settings()
