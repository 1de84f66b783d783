#!/usr/bin/env bash
# Put "dsv41 panel" in the desktop's application menu for the current user: the .desktop file (pointing at this
# checkout's .venv) and the icon, under ~/.local/share. Undo with --remove.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
apps="${XDG_DATA_HOME:-$HOME/.local/share}/applications"
icons="${XDG_DATA_HOME:-$HOME/.local/share}/icons/hicolor/scalable/apps"
if [ "${1:-}" = "--remove" ]; then
  rm -f "$apps/dsv41-panel.desktop" "$icons/dsv41-panel.svg"
  echo "removed the dsv41 panel menu entry"
  exit 0
fi
exe="$root/.venv/bin/dsv41-panel"
[ -x "$exe" ] || { echo "run ./scripts/panel first (it creates $exe)" >&2; exit 1; }
mkdir -p "$apps" "$icons"
install -m 0644 "$root/resources/dsv41-panel.svg" "$icons/dsv41-panel.svg"
sed "s|^Exec=.*|Exec=$exe|" "$root/resources/dsv41-panel.desktop" > "$apps/dsv41-panel.desktop"
chmod 0644 "$apps/dsv41-panel.desktop"
command -v update-desktop-database >/dev/null && update-desktop-database "$apps" 2>/dev/null || true
echo "installed $apps/dsv41-panel.desktop"
