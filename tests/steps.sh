# Sourced by the end-to-end scripts (tests/browser/run.sh, tests/docker/run.sh): the timed step
# log, one-line failures naming the step, and the skip their FEATURESTORE_*_TESTS=1 makes a failure.
# Set STRICT (1: a skip fails) and STRICT_VAR (that variable's name, for the messages) first.
STEP="start"
T0=$(date +%s)

step() { STEP="$*"; printf '\n==> [%4ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }
info() { printf '    %s\n' "$*"; }
fail() { printf 'FAIL: %s: %s\n' "$STEP" "$*" >&2; exit 1; }
skip() {
  if [ "$STRICT" = 1 ]; then
    printf 'FAIL: %s: %s (%s=1, so this is a failure)\n' "$STEP" "$*" "$STRICT_VAR" >&2
    exit 1
  fi
  printf 'skipped: %s: %s (set %s=1 to make this a failure)\n' "$STEP" "$*" "$STRICT_VAR"
  exit 0
}
trap 'rc=$?; printf "FAIL: %s: command exited %s at line %s: %s\n" "$STEP" "$rc" "$LINENO" "$BASH_COMMAND" >&2' ERR

# find_python OUT VAR MODULE...: sets OUT to the python named by $VAR, else the repo's .venv python,
# else python3; fails in one line unless it imports every MODULE.
find_python() {
  local out=$1 var=$2 py
  shift 2
  py=${!var:-}
  if [ -z "$py" ]; then
    if [ -x "$REPO/.venv/bin/python" ]; then py=$REPO/.venv/bin/python; else py=python3; fi
  fi
  "$py" -c "import $(IFS=,; echo "$*")" 2>/dev/null \
    || fail "python $py cannot import $* (pip install -e '.[dev]')"
  printf -v "$out" '%s' "$py"
}
