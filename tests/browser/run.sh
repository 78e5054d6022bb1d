#!/usr/bin/env bash
# End-to-end test of the web page in a real headless Chromium (Debian's `chromium` package)
# against a real `featurestore serve` on 127.0.0.1: tests/browser/test_browser.py.
#
#   bash tests/browser/run.sh                                 # opt-in; installs chromium if root
#   FEATURESTORE_BROWSER_TESTS=1 bash tests/browser/run.sh    # no browser / cannot install => fail
#
# Every step prints what it does; a failing step prints "FAIL: <step>: <why>" and exits non-zero.
# Screenshots of every page visited are kept in FEATURESTORE_BROWSER_SHOTS (default
# /tmp/featurestore-browser-shots): look at them.
#
# Environment (all optional):
#   FEATURESTORE_BROWSER_TESTS=1      no chromium and no way to install it => fail, not "skipped"
#   FEATURESTORE_BROWSER_SHOTS=DIR    where the screenshots go
#   FEATURESTORE_BROWSER_PYTHON=PY    python with featurestore[server,dev] importable
#                                     (default: the repo's .venv, else python3)
set -Eeuo pipefail
{  # one brace group: bash parses the whole script before running it

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
MODE=${FEATURESTORE_BROWSER_TESTS:-0}
STRICT=0; if [ "$MODE" = 1 ]; then STRICT=1; fi
SHOTS=${FEATURESTORE_BROWSER_SHOTS:-/tmp/featurestore-browser-shots}

STRICT_VAR=FEATURESTORE_BROWSER_TESTS
. "$REPO/tests/steps.sh"  # step, info, fail, skip, find_python; STEP, T0; the ERR trap

# ---------------------------------------------------------------------------------------------
step "preflight: chromium, host python"
if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    info "no chromium: installing it (tests/browser/install.sh)"
    bash "$REPO/tests/browser/install.sh" || skip "cannot install chromium (above)"
  else
    skip "no chromium on PATH and not root: run 'sudo bash tests/browser/install.sh' first"
  fi
fi
BROWSER=$(command -v chromium || command -v chromium-browser)
info "browser: $BROWSER ($("$BROWSER" --version 2>/dev/null | head -1))"
find_python PY FEATURESTORE_BROWSER_PYTHON featurestore server uvicorn websockets.sync.client pytest
info "python: $PY"

# ---------------------------------------------------------------------------------------------
step "the page in headless Chromium (tests/browser/test_browser.py); screenshots in $SHOTS"
rm -rf "$SHOTS"; mkdir -p "$SHOTS"
cd "$REPO"
FEATURESTORE_BROWSER_TESTS=1 FEATURESTORE_BROWSER_SHOTS="$SHOTS" \
  "$PY" -m pytest -q -p no:cacheprovider tests/browser/test_browser.py \
  || fail "the browser test failed (above); screenshots so far in $SHOTS"
for shot in "$SHOTS"/*.png; do
  info "screenshot: $shot ($(( $(stat -c %s "$shot") / 1024 )) KiB)"
done

step "passed"
printf '==> total %ss\n' "$(( $(date +%s) - T0 ))"
exit 0
}
