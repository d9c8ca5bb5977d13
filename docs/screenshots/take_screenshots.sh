#!/usr/bin/env bash
# Take the screenshots under Xvfb with trayer as the system tray (apt-get install xvfb trayer).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
python="${PYTHON:-python}"
display=":${SCREENSHOT_DISPLAY:-97}"
Xvfb "$display" -screen 0 1600x1000x24 -nolisten tcp & xvfb=$!
trap 'kill $tray $xvfb 2>/dev/null || true' EXIT
sleep 1
DISPLAY="$display" trayer --edge top --align right --widthtype request --height 28 --tint 0x16181d \
    --transparent true --alpha 0 & tray=$!
sleep 1
export SLIPSTREAM_DATA_DIR="$(mktemp -d)" SLIPSTREAM_CONFIG_DIR="$(mktemp -d)"
DISPLAY="$display" QT_QPA_PLATFORM=xcb "$python" "$here/take_screenshots.py"
