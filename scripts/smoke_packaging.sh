#!/usr/bin/env bash
# Build the wheel and the one-folder bundle, then smoke-test both on this machine:
#   dsv41 --version, dsv41 doctor --json, dsv41 start --engine sim, dsv41 chat "hi", dsv41 stop,
#   and the window under Xvfb with --screenshot PNG (checked to be a non-empty PNG).
# The wheel goes into a fresh virtual environment (not editable); the bundle runs with no Python of ours on PATH.
#
#   ./scripts/smoke_packaging.sh [--wheel-only|--bundle-only] [--keep DIR] [--screenshot-to DIR]
#
# Needs the project's .venv (./scripts/test creates it); installs PyInstaller into it (the [packaging] extra) if
# missing. Prints the time each part took. Exit 0 when every check passed.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
py="$root/.venv/bin/python"
do_wheel=1 do_bundle=1 keep="" shots=""
while [ $# -gt 0 ]; do
  case "$1" in
    --wheel-only) do_bundle=0 ;;
    --bundle-only) do_wheel=0 ;;
    --keep) keep="$2"; shift ;;
    --screenshot-to) shots="$2"; shift ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "smoke_packaging: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[ -x "$py" ] || { echo "smoke_packaging: $py is missing; run ./scripts/test once first (it creates .venv)" >&2; exit 2; }
command -v xvfb-run >/dev/null || { echo "smoke_packaging: xvfb-run is missing (apt-get install xvfb xauth)" >&2; exit 2; }

work="${keep:-$(mktemp -d -t dsv41-smoke-XXXXXX)}"
mkdir -p "$work"
[ -n "$keep" ] || trap 'rm -rf "$work"' EXIT
t0=$(date +%s)
say() { printf '[smoke %4ss] %s\n' "$(( $(date +%s) - t0 ))" "$*"; }
fail() { say "FAILED: $*"; exit 1; }

# smoke DIR_WITH_EXECUTABLES LABEL: the CLI round trip and the window, each with its own config/data dirs and port
smoke() {
  local bin="$1" label="$2" home="$work/home-$2"
  rm -rf "$home"; mkdir -p "$home"
  local port
  port="$("$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  # a clean environment: no DSV41_* from the caller; the project's .venv is NOT on PATH
  local -a envv=(env -i "HOME=$home" "PATH=/usr/local/bin:/usr/bin:/bin" "LANG=C.UTF-8"
                 "DSV41_CONFIG_DIR=$home/config" "DSV41_DATA_DIR=$home/data" "DSV41_CACHE_DIR=$home/cache"
                 "DSV41_PORT=$port" "XDG_RUNTIME_DIR=$home/run")
  mkdir -p -m 0700 "$home/run"
  "${envv[@]}" "$bin/dsv41" --version || fail "$label: dsv41 --version"
  "${envv[@]}" "$bin/dsv41" doctor --json > "$home/doctor.json" || fail "$label: dsv41 doctor --json"
  "$py" -c 'import json,sys; json.load(open(sys.argv[1]))' "$home/doctor.json" || fail "$label: doctor's JSON"
  say "$label: --version and doctor --json ok"
  "${envv[@]}" "$bin/dsv41" start --engine sim > "$home/start.out" 2>&1 || { cat "$home/start.out"; fail "$label: start --engine sim"; }
  say "$label: dsv41 start --engine sim: ready on port $port"
  local rc=0
  "${envv[@]}" "$bin/dsv41" chat "hi" > "$home/chat.out" 2>&1 || rc=$?
  [ "$rc" = 0 ] && [ -s "$home/chat.out" ] || { cat "$home/chat.out"; "${envv[@]}" "$bin/dsv41" stop || true; fail "$label: chat (exit $rc)"; }
  say "$label: dsv41 chat \"hi\" answered: $(head -c 80 "$home/chat.out" | tr '\n' ' ')"
  "${envv[@]}" "$bin/dsv41" stop || fail "$label: dsv41 stop"
  say "$label: dsv41 stop ok"
  local png="$home/window.png" s1 s2
  s1=$(date +%s.%N)
  # no DISPLAY: dsv41-panel re-runs itself under xvfb-run (app/main.py)
  "${envv[@]}" "$bin/dsv41-panel" --screenshot "$png" --screenshot-delay 2 > "$home/panel.out" 2>&1 \
    || { cat "$home/panel.out"; fail "$label: dsv41-panel --screenshot"; }
  s2=$(date +%s.%N)
  QT_QPA_PLATFORM=offscreen "$py" - "$png" <<'PYEOF' || fail "$label: the screenshot is empty"
import sys
from PySide6.QtGui import QImage
img = QImage(sys.argv[1])
assert not img.isNull() and img.width() >= 400 and img.height() >= 300, f"not a window-sized picture: {img.size()}"
colours = {img.pixel(x, y) for x in range(0, img.width(), 7) for y in range(0, img.height(), 7)}
assert len(colours) > 8, f"a blank picture ({len(colours)} colours)"
PYEOF
  say "$label: window screenshot $(stat -c %s "$png") bytes, dsv41-panel ran $("$py" -c "import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 1))" "$s1" "$s2") s (incl. 2 s delay)"
  [ -z "$shots" ] || { mkdir -p "$shots"; cp "$png" "$shots/panel-$label.png"; }
}

if [ "$do_wheel" = 1 ]; then
  say "building the wheel (pip wheel . --no-deps)"
  rm -rf "$work/wheel"; "$py" -m pip wheel "$root" --no-deps -q -w "$work/wheel"
  whl=$(ls "$work"/wheel/dsv41_panel-*.whl)
  say "installing $(basename "$whl") into a fresh virtual environment"
  "$py" -m venv "$work/venv"
  "$work/venv/bin/pip" install -q "$whl"
  smoke "$work/venv/bin" wheel
fi
if [ "$do_bundle" = 1 ]; then
  "$py" -c 'import PyInstaller' 2>/dev/null || "$root/.venv/bin/pip" install -q "pyinstaller>=6.10"
  say "building the one-folder bundle (pyinstaller packaging/dsv41-panel.spec)"
  "$root/.venv/bin/pyinstaller" --noconfirm --log-level WARN --distpath "$work/dist" --workpath "$work/build" \
    "$root/packaging/dsv41-panel.spec"
  say "bundle: $(du -sh "$work/dist/dsv41-panel" | cut -f1)"
  smoke "$work/dist/dsv41-panel" bundle
fi
say "all packaging smoke checks passed"
