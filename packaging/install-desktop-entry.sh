#!/usr/bin/env bash
# Put "dsv41 panel" in the desktop's application menu for the current user: the .desktop file and the icon, under
# ${XDG_DATA_HOME:-~/.local/share}. Works from a clone (packaging/install-desktop-entry.sh: points at the clone's
# .venv/bin/dsv41-panel) and from the one-folder bundle (dsv41-panel/install-desktop-entry.sh: points at the
# bundle's dsv41-panel), or for any installed dsv41-panel with --exe PATH (a wheel or pipx install).
#   install-desktop-entry.sh [--exe PATH]     install (again: replaces the entry)
#   install-desktop-entry.sh --remove         remove the entry and the icon (and the folders it made, if empty)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
data="${XDG_DATA_HOME:-$HOME/.local/share}"
apps="$data/applications"
icons="$data/icons/hicolor/scalable/apps"

if [ "${1:-}" = "--remove" ]; then
  rm -f "$apps/dsv41-panel.desktop" "$icons/dsv41-panel.svg"
  # update-desktop-database's cache, when it is all that is left (it lists only this folder's .desktop files)
  [ "$(ls -A "$apps" 2>/dev/null)" = "mimeinfo.cache" ] && rm -f "$apps/mimeinfo.cache"
  # the folders this script may have made, only if nothing else is in them
  for d in "$icons" "$data/icons/hicolor/scalable" "$data/icons/hicolor" "$data/icons" "$apps"; do
    rmdir "$d" 2>/dev/null || true
  done
  command -v update-desktop-database >/dev/null && update-desktop-database "$apps" 2>/dev/null || true
  echo "removed the dsv41 panel menu entry"
  exit 0
fi

if [ -x "$here/dsv41-panel" ] && [ -d "$here/_internal/resources" ]; then      # inside the bundle
  exe="$here/dsv41-panel"; res="$here/_internal/resources"
else                                                                          # a clone: packaging/..
  root="$(cd "$here/.." && pwd)"
  exe="$root/.venv/bin/dsv41-panel"; res="$root/resources"
fi
if [ "${1:-}" = "--exe" ]; then
  [ -n "${2:-}" ] || { echo "--exe needs the path of dsv41-panel" >&2; exit 2; }
  exe="$(cd "$(dirname "$2")" && pwd)/$(basename "$2")"
elif [ -n "${1:-}" ]; then
  echo "unknown option $1 (use --exe PATH or --remove)" >&2; exit 2
fi
[ -x "$exe" ] || { echo "$exe is not there: in a clone run ./scripts/panel first (it creates it); for an" \
                        "installed panel give its path with --exe PATH" >&2; exit 2; }
[ -f "$res/dsv41-panel.desktop" ] && [ -f "$res/dsv41-panel.svg" ] || {
  echo "the panel's resources are not in $res (a broken checkout or bundle?)" >&2; exit 2; }
case "$exe" in *[\"\`\$\\\|\&]*) echo "the path $exe has a character a desktop entry cannot hold; move it" >&2; exit 2 ;; esac

mkdir -p "$apps" "$icons"
# each file written to a temporary name in its folder, then renamed over the old one: never written through a
# symbolic link planted at the final name (mv replaces the link itself)
tmp="$(mktemp "$icons/.dsv41-panel.svg.XXXXXX")"
cat "$res/dsv41-panel.svg" > "$tmp"; chmod 0644 "$tmp"; mv -f "$tmp" "$icons/dsv41-panel.svg"
tmp="$(mktemp "$apps/.dsv41-panel.desktop.XXXXXX")"
sed "s|^Exec=.*|Exec=\"$exe\"|" "$res/dsv41-panel.desktop" > "$tmp"; chmod 0644 "$tmp"
mv -f "$tmp" "$apps/dsv41-panel.desktop"
command -v update-desktop-database >/dev/null && update-desktop-database "$apps" 2>/dev/null || true
echo "installed $apps/dsv41-panel.desktop (runs $exe) and its icon; remove with $0 --remove"
