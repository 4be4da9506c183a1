#!/bin/sh
# Make sure Debian's headless-capable Chromium is at /usr/bin/chromium for the UI test
# (tests/ui/). Quiet and idempotent: does nothing when it is already there. Playwright
# drives this browser through its executable path; no browser is ever downloaded by
# Playwright itself (never `playwright install`).
set -eu
CHROMIUM=/usr/bin/chromium
if [ -x "$CHROMIUM" ]; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_chromium.sh: $CHROMIUM is missing and apt-get is not available;" >&2
    echo "  install Chromium so that $CHROMIUM exists, then rerun 'make test-ui'." >&2
    exit 1
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo"
    else
        echo "install_chromium.sh: need root (or sudo) to apt-get install chromium" >&2
        exit 1
    fi
fi
echo "install_chromium.sh: installing Debian's chromium package (one time)"
export DEBIAN_FRONTEND=noninteractive
LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT
# fonts-dejavu-core: without any font the screenshots show boxes instead of text
if ! { $SUDO apt-get update -qq && \
       $SUDO apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core; } \
       >"$LOG" 2>&1; then
    cat "$LOG" >&2
    echo "install_chromium.sh: apt-get failed (log above)" >&2
    exit 1
fi
if [ ! -x "$CHROMIUM" ]; then
    echo "install_chromium.sh: apt-get finished but $CHROMIUM is still missing" >&2
    exit 1
fi
