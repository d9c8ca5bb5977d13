#!/usr/bin/env bash
# Set up (idempotently) and run Slipstream from a source checkout.
#   bash installers/dev.sh app [app options]    the tray app on the bundled default model
#   bash installers/dev.sh test [pytest options] the test suite
#   bash installers/dev.sh engine [args]        the engine CLI (python -m engine ...)
# Everything goes into .venv beside this checkout. The first run builds llama-cpp-python from source
# (about 11 minutes on 2 cores; pip caches the wheel afterwards).
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-app}"; shift || true
PY="${PYTHON:-python3}"
VENV=.venv
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
V="$VENV/bin/python"

extras="engine,app"
[ "$what" = test ] && extras="test"
stamp="$VENV/.slipstream-$extras-$(sha1sum pyproject.toml | cut -c1-12)"
if [ ! -e "$stamp" ]; then
  echo "Slipstream: installing into $VENV (extras: $extras) ..." >&2
  "$V" -m pip install -q --upgrade pip
  # PyTorch: keep one that is already there (e.g. a CUDA build); otherwise the CPU build.
  "$V" -c "import torch" 2>/dev/null || "$V" -m pip install -q "torch==2.13.0"
  # llama.cpp is compiled for this CPU's vector units but without AMX: virtual machines often list AMX
  # without letting programs use it, and llama.cpp then dies with "Illegal instruction".
  if [ "$(uname -m)" = x86_64 ] && [ -z "${CMAKE_ARGS:-}" ]; then
    flags="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
    for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI avx512f:AVX512 \
                avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
      grep -qw "${pair%%:*}" /proc/cpuinfo && flags="$flags -DGGML_${pair##*:}=ON"
    done
    export CMAKE_ARGS="$flags"
  fi
  "$V" -m pip install -q -e ".[$extras]"
  touch "$stamp"
fi

case "$what" in
  app)
    # Qt's X11 plugin links system libraries a fresh Debian/Ubuntu may lack (libxcb-cursor0, ...): install
    # them where this may (root, or sudo without a password), else name them and stop.
    xcb=""
    case "${QT_QPA_PLATFORM:-xcb}" in xcb*) [ -z "${WAYLAND_DISPLAY:-}" ] && xcb=1 ;; esac
    [ -z "${DISPLAY:-}" ] && ! command -v xvfb-run >/dev/null && xcb=""
    if [ -n "$xcb" ] && [ "$(uname)" = Linux ] && command -v apt-get >/dev/null; then
      need="$("$V" -m app.platform_check)"
      if [ -n "$need" ]; then
        sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo -n"
        echo "Slipstream: installing the display's system libraries: $need" >&2
        if ! { $sudo apt-get install -y -q $need >/dev/null || { $sudo apt-get update -q >/dev/null &&
               $sudo apt-get install -y -q $need >/dev/null; }; }; then
          echo "Slipstream: could not install them; run: sudo apt-get install $need" >&2; exit 1
        fi
      fi
    fi
    if [ -z "${DISPLAY:-}${WAYLAND_DISPLAY:-}" ] && [ "$(uname)" = Linux ]; then
      if command -v xvfb-run >/dev/null; then exec xvfb-run -a "$V" -m app --show-chat "$@"; fi
      echo "Slipstream: no display found; running offscreen (set DISPLAY to see the window)" >&2
      export QT_QPA_PLATFORM=offscreen
    fi
    exec "$V" -m app --show-chat "$@" ;;
  test)
    export QT_QPA_PLATFORM=offscreen
    exec "$V" -m pytest -q "$@" ;;
  engine)
    exec "$V" -m engine "$@" ;;
  *) echo "usage: bash installers/dev.sh app|test|engine [args]" >&2; exit 2 ;;
esac
