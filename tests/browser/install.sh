#!/usr/bin/env bash
# Install the headless browser for the opt-in end-to-end test of the web page (tests/browser/run.sh):
# Debian's `chromium` package (no Google download, no snap; works offline once installed).
#
#   sudo bash tests/browser/install.sh        # root; apt-get; about a minute
#
# Prints the browser's path and version on success; exits non-zero with one line on failure.
set -euo pipefail
find_browser() { command -v chromium || command -v chromium-browser || true; }
if [ -n "$(find_browser)" ]; then
  echo "chromium already installed: $(find_browser) ($("$(find_browser)" --version 2>/dev/null))"
  exit 0
fi
[ "$(id -u)" = 0 ] || { echo "FAIL: installing chromium needs root (sudo bash $0)" >&2; exit 1; }
command -v apt-get >/dev/null || { echo "FAIL: no apt-get: install chromium with your package manager" >&2; exit 1; }
LOG=$(mktemp /tmp/featurestore-chromium-apt.XXXXXX.log)
export DEBIAN_FRONTEND=noninteractive
if ! { apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core >"$LOG" 2>&1 \
       || { apt-get update -q >>"$LOG" 2>&1 \
            && apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core >>"$LOG" 2>&1; }; }; then
  echo "FAIL: apt-get install chromium: $(tail -1 "$LOG")" >&2
  exit 1
fi
rm -f "$LOG"
echo "installed: $(find_browser) ($("$(find_browser)" --version 2>/dev/null))"
