"""``dsv41 settings``: show (secrets masked), set, or locate the settings."""

from __future__ import annotations

import json

from .. import paths
from ..settings import Settings, SettingsError, field_allowed, field_env, load_settings, save_settings


def register(sub) -> None:
    p = sub.add_parser("settings", help="show or change settings",
                       description="Show the effective settings and where each comes from (env > file > default), "
                                   "set one in the saved file, or print the file's path.")
    sp = p.add_subparsers(dest="action")
    show = sp.add_parser("show", help="print the effective settings (default)")
    show.add_argument("--json", action="store_true")
    st = sp.add_parser("set", help="save a setting to the settings file")
    st.add_argument("name", help="setting name (e.g. slots) or its variable (e.g. DSV41_SLOTS)")
    st.add_argument("value")
    sp.add_parser("path", help="print the settings file's path")
    sp.add_parser("list", help="list every setting with its variable and allowed values")
    p.set_defaults(func=run)


def _field_name(name: str) -> str:
    if name in Settings.model_fields:
        return name
    for n in Settings.model_fields:
        if field_env(n) == name.upper():
            return n
    return name


def shown_value(value) -> str:
    """A setting's value for people: "(not set)" for an unset folder or file (never Python's ``None``), "(empty)"
    for empty text, booleans as the settings file writes them (true, false)."""
    if value is None:
        return "(not set)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if value == "":
        return "(empty)"
    return str(value)


def run(args, ctx) -> int:
    action = args.action or "show"
    # `path` and `list` work without loading the settings, so they help even when a bad value is refused
    if action == "path":
        print(paths.settings_file())
        return 0
    if action == "list":
        w1 = max(len(n) for n in Settings.model_fields)
        w2 = max(len(field_env(n)) for n in Settings.model_fields)
        for n, info in Settings.model_fields.items():
            print(f"{n:<{w1}}  {field_env(n):<{w2}}  {field_allowed(n)}")
            print(f"{'':<{w1}}  {info.title}: {info.description}")
        return 0
    if action == "set":
        name = _field_name(args.name)
        try:
            loaded = ctx.loaded
        except SettingsError as exc:
            if exc.source != "file" or exc.setting != name:
                raise
            # the value being set is the one refused in the file: setting it is how to fix it
            loaded = load_settings(lenient=True, generate_key=False)
        new = save_settings(loaded, {name: args.value})
        if new.env_locked(name):
            print(f"saved, but {field_env(name)} in the environment overrides it")
        print(f"{name} = {shown_value(new.settings.masked()[name])}  (saved to {new.path})")
        return 0
    loaded = ctx.loaded
    masked = loaded.settings.masked()
    if getattr(args, "json", False):
        print(json.dumps({"settings": masked, "sources": loaded.sources, "path": str(loaded.path)}, indent=2))
        return 0
    w = max(len(n) for n in masked)
    for n, v in masked.items():
        src = loaded.sources[n]
        print(f"{n:<{w}}  {shown_value(v):<40} [{src}{': ' + field_env(n) if src == 'env' else ''}]")
    print(f"\nfile: {loaded.path}")
    return 0
