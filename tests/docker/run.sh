#!/usr/bin/env bash
# End-to-end test of docker/: a real Docker engine, the images built on a local Debian base, the
# compose stack with the S3 stand-in override, an extraction job, and checks from the host.
#
#   sudo bash tests/docker/run.sh                           # opt-in; root; a few minutes
#   FEATURESTORE_DOCKER_TESTS=1 sudo -E bash tests/docker/run.sh   # an engine that cannot start
#                                                            # is a failure, not a skip
#
# No registry is needed (see ../shared/DOCKER-LOCAL.md): the engine is started by hand in a
# temporary directory, the base image comes from the Debian mirror (debootstrap) and the builds
# reach PyPI through host networking. Every step prints what it does; a failing step prints
# "FAIL: <step>: <why>" and the script exits non-zero. On any exit the engine is killed by its
# pid, its mounts are removed and the temporary directory is deleted.
#
# Environment (all optional):
#   FEATURESTORE_DOCKER_TESTS=1        no engine / not root => fail instead of "skipped" (exit 0)
#   FEATURESTORE_DOCKER_TESTS=changed  (.ci/run's default) run only if the docker inputs (docker/,
#                                      pyproject.toml, .dockerignore, tests/docker/) differ from
#                                      those of the last pass on this machine, else "skipped"
#   FEATURESTORE_DOCKER_CACHE=DIR      cache of the debootstrap rootfs tarball, the wheelhouse and
#                                      the last pass's inputs (default /var/cache/featurestore-docker)
#   FEATURESTORE_DOCKER_WHEELHOUSE=0   builds resolve every package on PyPI, as on a user's
#                                      machine (slower); default 1: a wheelhouse made on the host
#                                      with its own pip settings from what the Dockerfiles install
#                                      (tests/docker/wheelhouse.py), served on loopback, and
#                                      builds run pip with --no-index against it
#   FEATURESTORE_DOCKER_SAMPLES=N      images in the synthetic dataset (default 16)
#   FEATURESTORE_DOCKER_KEEP_LOGS=DIR  copy the engine log and the stack's logs there on exit
#   FEATURESTORE_DOCKER_PYTHON=PY      host python with featurestore + s3fs importable
#                                      (default: the repo's .venv, else python3)
set -Eeuo pipefail
{  # The whole script is one brace group: bash parses it before running, so editing this file
   # while a run is in progress cannot change what that run executes.

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
MODE=${FEATURESTORE_DOCKER_TESTS:-0}
STRICT=0; if [ "$MODE" = 1 ]; then STRICT=1; fi
CACHE=${FEATURESTORE_DOCKER_CACHE:-/var/cache/featurestore-docker}
USE_WHEELHOUSE=${FEATURESTORE_DOCKER_WHEELHOUSE:-1}
SAMPLES=${FEATURESTORE_DOCKER_SAMPLES:-16}
SUITE=bookworm                     # Debian 12: Python 3.11 from apt (nothing may need 3.12)
WHEELHOUSE_PY=$REPO/tests/docker/wheelhouse.py  # the packages the Dockerfiles install
MAX_SERVER_LAYERS_MB=${FEATURESTORE_DOCKER_MAX_LAYERS_MB:-270}  # 400 MB target - ~130 MB slim base
DOCKER=/usr/bin/docker             # Debian's CLI, matching the engine (another one on PATH may
                                   # lack buildx)
DATASET=pannuke-synthetic
SPLIT=fold1

D=""
ENGINE_PID=""
HTTP_PID=""
COMPOSE_UP=0

STRICT_VAR=FEATURESTORE_DOCKER_TESTS
. "$REPO/tests/steps.sh"  # step, info, fail, skip, find_python; STEP, T0; the ERR trap

compose() {
  docker-compose -p "$PROJECT" -f "$REPO/docker/compose.yaml" -f "$REPO/docker/compose.test.yaml" "$@"
}

cleanup() {
  local rc=$?
  trap - ERR
  set +e
  printf '\n==> [%4ss] cleanup (exit status so far: %s)\n' "$(( $(date +%s) - T0 ))" "$rc"
  if [ -n "$D" ] && [ -n "${FEATURESTORE_DOCKER_KEEP_LOGS:-}" ]; then
    mkdir -p "$FEATURESTORE_DOCKER_KEEP_LOGS"
    cp "$D"/*.log "$FEATURESTORE_DOCKER_KEEP_LOGS/" 2>/dev/null
    [ "$COMPOSE_UP" = 1 ] && timeout 60 compose --profile extract logs --no-color \
      >"$FEATURESTORE_DOCKER_KEEP_LOGS/compose.log" 2>&1
  fi
  if [ "$COMPOSE_UP" = 1 ]; then
    info "docker-compose down -v"
    timeout 120 compose --profile extract down -v --remove-orphans >/dev/null 2>&1
  fi
  if [ -n "$HTTP_PID" ]; then
    kill "$HTTP_PID" 2>/dev/null; wait "$HTTP_PID" 2>/dev/null
  fi
  if [ -n "$ENGINE_PID" ] && kill -0 "$ENGINE_PID" 2>/dev/null; then
    info "stopping dockerd (pid $ENGINE_PID)"
    kill "$ENGINE_PID"
    for _ in $(seq 60); do kill -0 "$ENGINE_PID" 2>/dev/null || break; sleep 0.5; done
    if kill -0 "$ENGINE_PID" 2>/dev/null; then
      info "dockerd ignored SIGTERM for 30 s: SIGKILL"
      kill -9 "$ENGINE_PID"
    fi
    wait "$ENGINE_PID" 2>/dev/null
  fi
  if [ -n "$D" ]; then
    # Helpers the engine started (containerd, shims) carry $D in their command line: by pid.
    local pid
    for pid in $(pgrep -f -- "$D/" 2>/dev/null); do
      [ "$pid" = "$$" ] && continue
      info "killing leftover engine helper pid $pid"
      kill -9 "$pid" 2>/dev/null
    done
    # Unmount everything under $D, deepest first.
    local mnt
    for mnt in $(awk -v d="$D" 'index($5, d) == 1 {print $5}' /proc/self/mountinfo | sort -r); do
      umount "$mnt" 2>/dev/null || umount -l "$mnt" 2>/dev/null
    done
    info "removing $D"
    rm -rf "$D" 2>/dev/null || { sleep 2; rm -rf "$D"; }
    rm -f "$D.img"
    local left=""
    [ -e "$D" ] && left="$left directory $D;"
    [ -e "$D.img" ] && left="$left image $D.img;"
    awk -v d="$D" 'index($5, d) == 1 {found=1} END {exit !found}' /proc/self/mountinfo \
      && left="$left mounts under $D;"
    [ -n "$ENGINE_PID" ] && kill -0 "$ENGINE_PID" 2>/dev/null && left="$left dockerd $ENGINE_PID;"
    if [ -n "$left" ]; then
      printf 'FAIL: cleanup: left behind:%s\n' "$left" >&2
      [ "$rc" = 0 ] && rc=1
    else
      info "clean: engine stopped, no mounts, $D removed"
    fi
  fi
  printf '==> total %ss, exit %s\n' "$(( $(date +%s) - T0 ))" "$rc"
  exit "$rc"
}
trap cleanup EXIT
trap 'STEP="$STEP (interrupted)"; exit 130' INT TERM

wait_healthy() {  # CONTAINER COMPOSE-FUNCTION: the container's healthcheck passes within 90 s
  local health=""
  [ -n "$1" ] || fail "no server container"
  for _ in $(seq 90); do
    health=$($DOCKER inspect -f '{{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}}' "$1")
    [ "$health" = healthy ] && return 0
    sleep 1
  done
  "$2" logs --no-color --tail 30 >&2
  fail "server container is '$health' after 90 s (logs above)"
}

free_port() {
  "$HOSTPY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# ---------------------------------------------------------------------------------------------
# What the images and this test are made of: a pass is recorded with this digest (taken before
# anything runs), and FEATURESTORE_DOCKER_TESTS=changed skips a run whose inputs already passed.
INPUTS=$(cd "$REPO" && find docker tests/docker pyproject.toml .dockerignore -type f \
           ! -path '*/__pycache__/*' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum \
         | sha256sum | cut -c1-16)
PASSED_RECORD=$CACHE/passed-inputs
if [ "$MODE" = changed ]; then
  step "changed since the last pass? (docker/, pyproject.toml, .dockerignore, tests/docker/)"
  if [ "$(cat "$PASSED_RECORD" 2>/dev/null)" = "$INPUTS" ]; then
    printf 'skipped: inputs %s already passed on this machine (FEATURESTORE_DOCKER_TESTS=1 runs it anyway)\n' "$INPUTS"
    exit 0
  fi
  info "inputs $INPUTS have not passed here yet (last pass: $(cat "$PASSED_RECORD" 2>/dev/null || echo none)): running"
fi

# ---------------------------------------------------------------------------------------------
step "preflight: root, tools, host python"
[ "$(id -u)" = 0 ] || skip "needs root to start a Docker engine (uid $(id -u))"
missing=""
for tool in dockerd docker-compose debootstrap; do command -v "$tool" >/dev/null || missing="$missing $tool"; done
[ -x "$DOCKER" ] || missing="$missing /usr/bin/docker"
if [ -n "$missing" ]; then
  if command -v apt-get >/dev/null; then
    info "installing docker.io docker-compose debootstrap (missing:$missing)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io docker-compose debootstrap \
      >/tmp/featurestore-docker-apt.log 2>&1 \
      || skip "cannot install docker.io docker-compose debootstrap: $(tail -1 /tmp/featurestore-docker-apt.log)"
  else
    skip "missing:$missing and no apt-get to install them"
  fi
fi
info "$($DOCKER --version); $(docker-compose --version)"
find_python HOSTPY FEATURESTORE_DOCKER_PYTHON featurestore s3fs numpy
info "host python: $HOSTPY"
avail_mb=$(df -Pm /tmp | awk 'NR==2 {print $4}')
[ "$avail_mb" -gt 6000 ] || fail "only ${avail_mb} MB free under /tmp; the engine and images need about 6 GB"

# ---------------------------------------------------------------------------------------------
step "start a Docker engine in a temporary directory (no iptables, no default bridge)"
D=$(mktemp -d /tmp/featurestore-docker.XXXXXX)
# The engine's files live on a sparse ext4 image mounted on $D: removing gigabytes of small layer
# files from a filesystem mounted with `discard` (like / here) takes minutes, deleting one image
# file takes a second. Falls back to a plain directory where loop devices are not available.
if truncate -s 24G "$D.img" 2>/dev/null \
   && mkfs.ext4 -q -F -E nodiscard,lazy_itable_init=1,lazy_journal_init=1 "$D.img" >/dev/null 2>&1 \
   && mount -o loop,nodiscard "$D.img" "$D" 2>/dev/null; then
  info "engine files on a loop-mounted ext4 image ($D.img, sparse)"
else
  rm -f "$D.img"
  info "no loop device: engine files directly under $D"
fi
export DOCKER_HOST=unix://$D/docker.sock
dockerd --iptables=false --ip6tables=false --bridge=none --storage-driver=overlay2 \
  --data-root "$D/data" --exec-root "$D/exec" --pidfile "$D/dockerd.pid" -H "$DOCKER_HOST" \
  >"$D/dockerd.log" 2>&1 &
ENGINE_PID=$!
for _ in $(seq 120); do
  $DOCKER info >/dev/null 2>&1 && break
  kill -0 "$ENGINE_PID" 2>/dev/null || break
  sleep 0.5
done
if ! $DOCKER info >/dev/null 2>&1; then
  why=$(grep -iE 'level=(fatal|error)|failed|error' "$D/dockerd.log" | tail -3 | tr '\n' ' ')
  skip "the engine did not start: ${why:-see $(tail -2 "$D/dockerd.log" | tr '\n' ' ')}"
fi
info "dockerd pid $ENGINE_PID, $($DOCKER info --format '{{.ServerVersion}} {{.Driver}} cgroup v{{.CgroupVersion}}')"
# docker-compose v1 shells out to `docker` for BuildKit builds: make it Debian's CLI.
mkdir -p "$D/bin"; ln -s "$DOCKER" "$D/bin/docker"
export PATH="$D/bin:$PATH"

# ---------------------------------------------------------------------------------------------
step "Debian $SUITE base image (debootstrap rootfs, cached in $CACHE)"
ROOTFS_TAR=$CACHE/debian-$SUITE-minbase.tar.gz
mkdir -p "$CACHE"
if [ ! -s "$ROOTFS_TAR" ]; then
  MIRROR=""
  [ -f /etc/apt/sources.list.d/debian.sources ] \
    && MIRROR=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources)
  [ -z "$MIRROR" ] && [ -f /etc/apt/sources.list ] \
    && MIRROR=$(awk '/^deb /{print $2; exit}' /etc/apt/sources.list)
  MIRROR=${MIRROR:-http://deb.debian.org/debian}
  info "debootstrap --variant=minbase $SUITE from $MIRROR (about a minute, once)"
  debootstrap --variant=minbase "$SUITE" "$D/rootfs" "$MIRROR" >"$D/debootstrap.log" 2>&1 \
    || fail "debootstrap failed: $(tail -2 "$D/debootstrap.log" | tr '\n' ' ')"
  rm -rf "$D/rootfs/var/cache/apt/archives/"*.deb
  find "$D/rootfs/var/lib/apt/lists" -mindepth 1 -maxdepth 1 ! -name partial -exec rm -rf {} +
  tar -C "$D/rootfs" -czf "$ROOTFS_TAR.tmp" . && mv "$ROOTFS_TAR.tmp" "$ROOTFS_TAR"
  rm -rf "$D/rootfs"
else
  info "cached rootfs: $ROOTFS_TAR"
fi
gzip -dc "$ROOTFS_TAR" | $DOCKER import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  - featurestore-test/debian:$SUITE >/dev/null
info "featurestore-test/debian:$SUITE: $($DOCKER image inspect -f '{{.Size}}' featurestore-test/debian:$SUITE | awk '{printf "%.0f MB", $1/1e6}')"

# ---------------------------------------------------------------------------------------------
# Python packages for the builds. The images' Dockerfiles take them from PyPI (and torch from
# PyTorch's CPU index, unreachable here), so the test serves a directory on loopback: builds use
# host networking and reach it at 127.0.0.1. TORCH_FIND_LINKS points at it in both modes. What
# goes in it is derived from the Dockerfiles' pip installs (tests/docker/wheelhouse.py), never
# listed here, so a new dependency lands in the wheelhouse and in its cache stamp by itself.
WH_PORT=$(free_port)
WH_URL=http://127.0.0.1:$WH_PORT/
HOST_PYVER=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || echo none)
if [ "$USE_WHEELHOUSE" = 1 ] && [ "$HOST_PYVER" != 3.11 ]; then
  info "host python3 is $HOST_PYVER, not the base's 3.11: no wheelhouse, builds use PyPI"
  USE_WHEELHOUSE=0
fi
if [ "$USE_WHEELHOUSE" = 1 ]; then
  step "wheelhouse for the builds (host pip, cached in $CACHE/wheelhouse-py311)"
  WH=$CACHE/wheelhouse-py311
  stamp=$(python3 "$WHEELHOUSE_PY" stamp) || fail "tests/docker/wheelhouse.py stamp failed (above)"
  if [ "$(cat "$WH/.stamp" 2>/dev/null)" != "$stamp" ]; then
    info "wheelhouse $stamp for (one pip wheel each, a few minutes, once per change):"
    python3 "$WHEELHOUSE_PY" requirements | sed 's/^/      /'
    rm -rf "$WH.tmp"; mkdir -p "$WH.tmp"
    # The torch wheel comes through the host's pip configuration (`pip config list`): on the
    # build machines a find-links directory holds the CPU build of torch 2.13.0.
    python3 "$WHEELHOUSE_PY" build "$WH.tmp" >"$D/wheel.log" 2>&1 \
      || fail "building the wheelhouse: $(grep -E '^pip wheel|ERROR|error:' "$D/wheel.log" | tail -3 | tr '\n' ' ')"
    # One torch, the extract image's: another one (PyPI's CUDA build and its 3 GB of nvidia
    # wheels) means a set was resolved without the image's TORCH_SPEC.
    torch_wheels=$(cd "$WH.tmp" && ls torch-*.whl 2>/dev/null | tr '\n' ' ')
    [ "$(echo "$torch_wheels" | wc -w)" = 1 ] \
      || fail "the wheelhouse must hold one torch wheel, the extract image's; it holds: ${torch_wheels:-none}"
    case "$torch_wheels" in *+cpu*) ;; *) info "note: the torch wheel is not a +cpu build";; esac
    echo "$stamp" >"$WH.tmp/.stamp"
    rm -rf "$WH"; mv "$WH.tmp" "$WH"
  else
    info "cached: $(ls "$WH" | wc -l) wheels ($(du -sh "$WH" | cut -f1))"
  fi
  PIP_ENV="ENV PIP_NO_INDEX=1 PIP_FIND_LINKS=$WH_URL"
else
  step "torch wheel for the extract build (builds resolve everything else on PyPI)"
  WH=$D/torchwheel; mkdir -p "$WH"
  torch_spec=$(python3 "$WHEELHOUSE_PY" arg "$REPO/docker/Dockerfile" TORCH_SPEC)
  python3 -m pip download -q --no-deps -d "$WH" "$torch_spec" >"$D/wheel.log" 2>&1 \
    || fail "pip download $torch_spec: $(tail -2 "$D/wheel.log" | tr '\n' ' ')"
  info "$(ls "$WH")"
  PIP_ENV=""
fi
python3 -m http.server --bind 127.0.0.1 --directory "$WH" "$WH_PORT" >"$D/http.log" 2>&1 &
HTTP_PID=$!
for _ in $(seq 40); do "$HOSTPY" -c "import urllib.request; urllib.request.urlopen('$WH_URL', timeout=2)" 2>/dev/null && break; sleep 0.25; done
info "serving $WH at $WH_URL (pid $HTTP_PID)"

# ---------------------------------------------------------------------------------------------
step "Python base image: python3 python3-venv python3-pip from apt"
mkdir -p "$D/pybase"
# The build machines reach PyPI through a TLS proxy whose CA is in the host's bundle: the test
# base trusts the same bundle (users' python:3.12-slim needs nothing of the kind).
cp /etc/ssl/certs/ca-certificates.crt "$D/pybase/host-ca-bundle.crt"
cat >"$D/pybase/Dockerfile" <<EOF
FROM featurestore-test/debian:$SUITE
COPY host-ca-bundle.crt /etc/ssl/certs/host-ca-bundle.crt
ENV PIP_CERT=/etc/ssl/certs/host-ca-bundle.crt SSL_CERT_FILE=/etc/ssl/certs/host-ca-bundle.crt \\
    REQUESTS_CA_BUNDLE=/etc/ssl/certs/host-ca-bundle.crt
RUN mkdir -p /var/lib/apt/lists/partial && apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \\
      python3 python3-venv python3-pip \\
 && apt-get clean && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin
EOF
pykey=$(cat "$ROOTFS_TAR" "$D/pybase/Dockerfile" "$D/pybase/host-ca-bundle.crt" | sha256sum | cut -c1-16)
PYBASE_TAR=$CACHE/python-base-$pykey.tar
if [ -s "$PYBASE_TAR" ]; then
  $DOCKER load -q -i "$PYBASE_TAR" >/dev/null || fail "docker load $PYBASE_TAR failed"
  info "cached: $PYBASE_TAR"
else
  DOCKER_BUILDKIT=1 $DOCKER build --network host -t featurestore-test/python-apt:3.11 "$D/pybase" \
    >"$D/pybase.log" 2>&1 || fail "python base build failed: $(tail -5 "$D/pybase.log" | tr '\n' ' ')"
  rm -f "$CACHE"/python-base-*.tar
  $DOCKER save -o "$PYBASE_TAR.tmp" featurestore-test/python-apt:3.11 && mv "$PYBASE_TAR.tmp" "$PYBASE_TAR"
fi
# The per-run pip settings (the wheelhouse's loopback URL) go into a thin layer on top.
mkdir -p "$D/pyenv"
printf 'FROM featurestore-test/python-apt:3.11\n%s\n' "$PIP_ENV" >"$D/pyenv/Dockerfile"
DOCKER_BUILDKIT=1 $DOCKER build -q -t featurestore-test/python:3.11 "$D/pyenv" >"$D/pyenv.log" 2>&1 \
  || fail "python base (pip settings) build failed: $(tail -3 "$D/pyenv.log" | tr '\n' ' ')"
BASE_MB=$($DOCKER image inspect -f '{{.Size}}' featurestore-test/python:3.11 | awk '{printf "%.0f", $1/1e6}')
info "featurestore-test/python:3.11: $BASE_MB MB ($($DOCKER run --rm featurestore-test/python:3.11 python3 --version))"

cat >"$D/host_checks.py" <<'PY'
import json
import sys
import urllib.error
import urllib.request

import numpy as np

import featurestore

fs_port, store_url, storage_options, dataset, split, samples = sys.argv[1:7]
samples = int(samples)
on_loop = sys.argv[7:] == ["on-loop"]  # a local store: page-cached items are answered on the event loop
storage_options = json.loads(storage_options)
base = f"http://127.0.0.1:{fs_port}"


def call(path, body=None, headers=None):
    data = None if body is None else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json"} if body is not None else {}
    hdrs.update(headers or {})
    req = urllib.request.Request(base + path, data=data, headers=hdrs,
                                 method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, error.read()


def names(payload, key):
    """The names in a listing, whether it is a list or {key: [...]}, of strings or objects."""
    items = payload.get(key, payload) if isinstance(payload, dict) else payload
    return [item["name"] if isinstance(item, dict) else item for item in items]


def check(cond, what):
    if not cond:
        print(f"    check failed: {what}", file=sys.stderr)
        sys.exit(1)
    print(f"    ok: {what}")


status, _, body = call("/healthz")
check(status == 200, f"GET /healthz -> {status}")
status, _, body = call("/v1/datasets")
datasets = names(json.loads(body), "datasets")
check(status == 200 and dataset in datasets, f"GET /v1/datasets lists {dataset!r}: {datasets}")
status, _, body = call(f"/v1/datasets/{dataset}/encoders")
encoders = names(json.loads(body), "encoders")
check(status == 200 and len(encoders) == 1, f"GET .../encoders: {encoders}")
encoder = encoders[0]
status, _, body = call(f"/v1/datasets/{dataset}/encoders/{encoder}/splits")
splits = names(json.loads(body), "splits")
check(status == 200 and split in splits, f"GET .../splits lists {split!r}: {splits}")
status, _, body = call(f"/v1/features/{dataset}/{encoder}/{split}")
check(status == 200, f"GET split metadata -> {status}")
status, _, body = call("/v1/datasets/no-such-dataset/encoders")
check(status == 404, f"unknown dataset -> {status}")

# What the job wrote, read straight from storage (for S3: the stand-in's published port) with the
# project's own reader.
store = featurestore.open_store(store_url, mode="r", **storage_options)
arr = store.open(dataset, encoder, split)
check(len(arr) == samples, f"storage holds {len(arr)} samples of {arr.sample_shape} {arr.dtype}")

rng = np.random.default_rng(0)
indices = [int(i) for i in rng.permutation(samples)[:8]] + [0, samples - 1, 0]
status, headers, body = call(f"/v1/features/{dataset}/{encoder}/{split}/batch",
                             body={"indices": indices})
check(status == 200, f"POST batch {indices} -> {status}")
expected = arr.read_numpy(indices)
shape = ",".join(str(n) for n in expected.shape)
check(headers.get("X-Shape") == shape, f"X-Shape {headers.get('X-Shape')} == {shape}")
check(headers.get("X-Dtype") == arr.dtype, f"X-Dtype {headers.get('X-Dtype')} == {arr.dtype}")
check(body == expected.tobytes(), f"POST batch: {len(body)} bytes identical to storage's")

status, headers, body = call(f"/v1/features/{dataset}/{encoder}/{split}/batch?start=0&stop={samples}")
expected = arr.read_range(0, samples)
check(status == 200 and body == expected.tobytes(),
      f"GET batch 0:{samples}: {len(body)} bytes identical to storage's")
status, headers, body = call(f"/v1/features/{dataset}/{encoder}/{split}/items/{samples - 1}")
check(status == 200 and body == arr.read_numpy([samples - 1])[0].tobytes(),
      f"GET item {samples - 1}: identical")
if arr.labels is not None:
    status, headers, body = call(f"/v1/features/{dataset}/{encoder}/{split}/batch?labels=true",
                                 body={"indices": indices})
    expected = arr.labels.read_numpy(indices)
    check(status == 200 and body == expected.tobytes()
          and headers.get("X-Shape") == ",".join(str(n) for n in expected.shape),
          f"labels batch {headers.get('X-Shape')} {headers.get('X-Dtype')}: {len(body)} bytes identical")
status, _, _ = call(f"/v1/features/{dataset}/{encoder}/{split}/items/{samples}")
check(status == 416, f"index {samples} out of range -> {status}")
if on_loop:  # the item read above left its chunk mapped and checked: the same read again skips the pool
    counter = "featurestore_data_requests_on_event_loop_total"

    def answered_on_loop():
        text = call("/metrics")[2].decode()
        return int(float(next(line.split()[1] for line in text.splitlines() if line.startswith(counter + " "))))

    before = answered_on_loop()
    status, _, body = call(f"/v1/features/{dataset}/{encoder}/{split}/items/{samples - 1}")
    check(status == 200 and body == arr.read_numpy([samples - 1])[0].tobytes() and answered_on_loop() == before + 1,
          f"GET item {samples - 1} again: identical, answered on the event loop ({counter} {before} -> "
          f"{answered_on_loop()})")
PY

# ---------------------------------------------------------------------------------------------
# Compose settings: a unique project, free host ports, and nothing from the caller's environment
# leaking into the compose file's ${...} defaults.
PROJECT=fsdt$$
FS_PORT=$(free_port)
S3_PORT=$(free_port)
while [ "$S3_PORT" = "$FS_PORT" ]; do S3_PORT=$(free_port); done
unset FEATURESTORE_TOKEN FEATURESTORE_WORKERS FEATURESTORE_MAX_RESPONSE_BYTES MINIO_ROOT_USER \
  MINIO_ROOT_PASSWORD TORCH_SPEC EXTRACT_DATASET EXTRACT_SPLIT EXTRACT_DTYPE EXTRACT_IMAGE_SIZE
export BASE_IMAGE=featurestore-test/python:3.11
export FEATURESTORE_PORT=$FS_PORT MINIO_PORT=$S3_PORT
export TORCH_INDEX_URL=https://pypi.org/simple TORCH_FIND_LINKS=$WH_URL
export EXTRACT_SAMPLES=$SAMPLES
export COMPOSE_DOCKER_CLI_BUILD=1 DOCKER_BUILDKIT=1 COMPOSE_INTERACTIVE_NO_CLI=1

step "build the images with docker-compose (server, extract, S3 stand-in) on $BASE_IMAGE"
tb=$(date +%s)
compose --profile extract build --parallel >"$D/build.log" 2>&1 \
  || fail "docker-compose build failed: $(grep -E 'ERROR|error:|failed' "$D/build.log" | tail -4 | tr '\n' ' ')"
info "built in $(( $(date +%s) - tb )) s"
SERVER_IMAGE=${PROJECT}_server
EXTRACT_IMAGE=${PROJECT}_extract
mb() { $DOCKER image inspect -f '{{.Size}}' "$1" | awk '{printf "%.0f", $1/1e6}'; }
SERVER_MB=$(mb "$SERVER_IMAGE"); EXTRACT_MB=$(mb "$EXTRACT_IMAGE"); STANDIN_MB=$(mb featurestore-s3-standin:test)
LAYERS_MB=$(( SERVER_MB - BASE_MB ))
info "server image:  $SERVER_MB MB  (base $BASE_MB MB + featurestore layers $LAYERS_MB MB)"
info "extract image: $EXTRACT_MB MB (with torch)"
info "S3 stand-in:   $STANDIN_MB MB (test only)"
info "on python:3.12-slim (~125 MB) the server image would be about $(( LAYERS_MB + 125 )) MB (target < 400 MB)"
[ "$LAYERS_MB" -le "$MAX_SERVER_LAYERS_MB" ] \
  || fail "the server image adds $LAYERS_MB MB to its base, over the $MAX_SERVER_LAYERS_MB MB budget"
$DOCKER run --rm --entrypoint python "$SERVER_IMAGE" -c \
  "import importlib.util as u, os; assert u.find_spec('torch') is None; assert os.getuid() != 0; print('    server image: no torch, uid', os.getuid())" \
  || fail "server image check (no torch, non-root) failed"

# ---------------------------------------------------------------------------------------------
step "bring the stack up: minio (S3 stand-in), createbucket, initstore, server"
COMPOSE_UP=1
compose up -d server >"$D/up.log" 2>&1 \
  || fail "docker-compose up failed: $(tail -4 "$D/up.log" | tr '\n' ' ')"
SERVER_CID=$(compose ps -q server)
wait_healthy "$SERVER_CID" compose
info "server container healthy; published on 127.0.0.1:$FS_PORT, S3 on 127.0.0.1:$S3_PORT"
compose ps

# ---------------------------------------------------------------------------------------------
step "run the extraction job (profile extract): $SAMPLES synthetic PanNuke images -> s3://featurestore/store"
te=$(date +%s)
compose --profile extract run --rm extract >"$D/extract.log" 2>&1 || {
  tail -20 "$D/extract.log" >&2
  fail "the extraction job failed (output above)"
}
tail -5 "$D/extract.log" | sed 's/^/    | /'
info "extraction job: $(( $(date +%s) - te )) s"

# ---------------------------------------------------------------------------------------------
step "from the host: /healthz, listings over HTTP, batches compared byte for byte with the bucket"
"$HOSTPY" "$D/host_checks.py" "$FS_PORT" s3://featurestore/store \
  "{\"endpoint_url\": \"http://127.0.0.1:$S3_PORT\", \"key\": \"minioadmin\", \"secret\": \"minioadmin\"}" \
  "$DATASET" "$SPLIT" "$SAMPLES" || fail "host checks failed (above)"

# ---------------------------------------------------------------------------------------------
step "stop the stack (SIGTERM must stop the server quickly) and remove it"
ts=$(date +%s)
compose stop -t 30 server >/dev/null 2>&1 || fail "docker-compose stop server failed"
stop_s=$(( $(date +%s) - ts ))
exit_code=$($DOCKER inspect -f '{{.State.ExitCode}}' "$SERVER_CID")
info "server stopped in ${stop_s} s, exit code $exit_code (uvicorn re-raises SIGTERM: 143 = graceful)"
if compose logs --no-color server 2>/dev/null | grep -q "Finished server process"; then
  info "server log: graceful shutdown (\"Finished server process\")"
else
  fail "no graceful shutdown in the server's log: SIGTERM did not reach uvicorn"
fi
[ "$stop_s" -lt 15 ] || fail "the server took ${stop_s} s to stop: SIGTERM is not reaching uvicorn"
compose --profile extract down -v --remove-orphans >"$D/down.log" 2>&1 \
  || fail "docker-compose down failed: $(tail -3 "$D/down.log" | tr '\n' ' ')"
COMPOSE_UP=0
left=$($DOCKER ps -aq | wc -l)
[ "$left" = 0 ] || fail "$left containers left after down"
info "stack removed (containers, network, volume)"

# ---------------------------------------------------------------------------------------------
step "local-directory variant (docker/compose.local.yaml): extract into a bind mount, serve it"
compose_local() {
  docker-compose -p "$PROJECT" -f "$REPO/docker/compose.yaml" -f "$REPO/docker/compose.local.yaml" "$@"
}
export FEATURESTORE_DATA=$D/localstore
mkdir -p "$FEATURESTORE_DATA"; chown 10001:10001 "$FEATURESTORE_DATA"  # the images' user
COMPOSE_UP=1
compose_local --profile extract run --rm --no-deps extract >"$D/extract-local.log" 2>&1 || {
  tail -20 "$D/extract-local.log" >&2
  fail "the extraction job into $FEATURESTORE_DATA failed (output above)"
}
info "extracted into $FEATURESTORE_DATA ($(du -sh "$FEATURESTORE_DATA" | cut -f1))"
# Served as a store made on the host: root's, readable by all, so the server's uid 10001 may read
# it but not write it (mincore cannot tell it page-cached rows: docs/DOCKER.md).
chown -R 0:0 "$FEATURESTORE_DATA"; chmod -R a+rX,go-w "$FEATURESTORE_DATA"
compose_local up -d --no-deps server >"$D/up-local.log" 2>&1 \
  || fail "docker-compose up --no-deps server failed: $(tail -4 "$D/up-local.log" | tr '\n' ' ')"
SERVER_CID=$(compose_local ps -q server)
wait_healthy "$SERVER_CID" compose_local
"$HOSTPY" "$D/host_checks.py" "$FS_PORT" "$FEATURESTORE_DATA" "{}" "$DATASET" "$SPLIT" "$SAMPLES" on-loop \
  || fail "host checks against the local-directory server failed (above)"
compose_local --profile extract down -v --remove-orphans >"$D/down.log" 2>&1 \
  || fail "docker-compose down failed: $(tail -3 "$D/down.log" | tr '\n' ' ')"
COMPOSE_UP=0
[ "$($DOCKER ps -aq | wc -l)" = 0 ] || fail "containers left after down"

step "passed"
echo "$INPUTS" >"$PASSED_RECORD"
info "recorded: inputs $INPUTS passed ($PASSED_RECORD)"
info "server image $SERVER_MB MB (layers $LAYERS_MB MB over a $BASE_MB MB base), extract image $EXTRACT_MB MB"
exit 0
}
