#!/usr/bin/env bash
# Prepare, on a machine with PyPI access, what tests/gpu/run_gpu_checks.sh needs on the
# GPU machine, which reaches no registry (tests/gpu/README.md says how to run it there).
#
#   tests/gpu/prepare_device_wheels.sh [--no-liburing] [--no-verify]
#
# Writes .gpu-carry/ in the repository root (git-ignored; name it in the device tool's
# `carry`):
#   wheels/  CPython 3.12 manylinux x86_64 wheels of the packages in
#            tests/gpu/device-wheels.txt, one version each, no dependencies resolved
#            (torch, numpy, anyio, pytest, hypothesis, prometheus-client are already
#            there and are never downloaded); liburing==2024.5.3 has no wheel on PyPI,
#            so it is built here with a local python3.12 when one exists
#            (--no-liburing skips it: the GPU run then uses the thread engine);
#   kv/      the real SmolLM2 K/V sample (../shared/data/kv, ~3 MB) that the FP8 kernel
#            tests compare on: shared/ beside the checkout does not travel.
# Then, with a local python3.12, it checks the set offline: run_gpu_checks.sh
# --wheels-only installs it with --no-index into a scratch target and imports every
# package (--no-verify skips that).
# Exit status: 0 ready; 1 a download, build or the offline check failed.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
CARRY=${KVSTORE_GPU_CARRY:-.gpu-carry}
LIST=tests/gpu/device-wheels.txt
PY=${PYTHON:-python3}
PY312=
LIBURING=1
VERIFY=1
for arg in "$@"; do
    case "$arg" in
        --no-liburing) LIBURING=0 ;;
        --no-verify) VERIFY=0 ;;
        *) echo "usage: $0 [--no-liburing] [--no-verify]" >&2; exit 1 ;;
    esac
done
say() { echo "[prepare] $*"; }

# A CPython 3.12 that runs (a pyenv shim named python3.12 may exist and refuse to run).
for c in ${PYTHON312:-} python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
    if [ -n "$c" ] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
        PY312=$c
        break
    fi
done

LIBURING_REQ=$(awk '!/^#/ && $2 ~ /^liburing==/ {print $2}' "$LIST")
LIBURING_WHL="liburing-${LIBURING_REQ#*==}-cp312-*.whl"
# Start clean (two versions of one package would stop the install there), but keep a
# liburing wheel of the pinned version built before: building it takes minutes.
mkdir -p "$CARRY/wheels"
find "$CARRY/wheels" -mindepth 1 ! -name "$LIBURING_WHL" -delete
rm -rf "$CARRY/kv"
mkdir -p "$CARRY/kv"

mapfile -t BINARY < <(awk -v lu="$LIBURING" '!/^#/ && NF == 3 && $2 !~ /^liburing==/ \
                           && ($3 == "required" || lu == 1) {print $2}' "$LIST")
say "downloading ${#BINARY[@]} wheels for CPython 3.12, manylinux x86_64: ${BINARY[*]}"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 \
    -d "$CARRY/wheels" "${BINARY[@]}" \
    || { say "pip download failed (is PyPI reachable from here?)"; exit 1; }

if [ "$LIBURING" = 0 ]; then
    rm -f "$CARRY"/wheels/$LIBURING_WHL
elif compgen -G "$CARRY/wheels/$LIBURING_WHL" >/dev/null; then
    say "kept $(basename "$CARRY"/wheels/$LIBURING_WHL), built before"
elif [ -n "$PY312" ]; then
    say "building $LIBURING_REQ for CPython 3.12 with $("$PY312" -V 2>&1) (PyPI has only its sdist)"
    if ! "$PY312" -m pip wheel -q --no-deps -w "$CARRY/wheels" "$LIBURING_REQ"; then
        say "building $LIBURING_REQ failed; the GPU run will use the thread engine"
    fi
else
    say "no CPython 3.12 here: $LIBURING_REQ not built; the GPU run will use the thread engine"
fi

DATA=${KVSTORE_TEST_DATA:-}
for d in "$DATA" ../shared/data/kv shared/data/kv; do
    if [ -n "$d" ] && [ -f "$d/smollm2_sample_meta.json" ]; then DATA=$d; break; fi
    DATA=
done
if [ -n "$DATA" ]; then
    # K and V only: the tests do not read Q (another 2.3 MB).
    cp "$DATA"/smollm2_sample_meta.json "$DATA"/smollm2_sample_[KV]_*.npy "$CARRY/kv/"
    chmod u+w "$CARRY"/kv/*
    say "real KV sample copied from $DATA"
else
    say "no real KV sample found (KVSTORE_TEST_DATA, ../shared/data/kv): those GPU tests will skip"
fi

ls -l "$CARRY/wheels"
WHEELS_KB=$(du -sk "$CARRY/wheels" | cut -f1)
TOTAL_KB=$(du -sk "$CARRY" | cut -f1)
TREE_KB=$(git ls-files -z | du -ck --files0-from=- 2>/dev/null | tail -1 | cut -f1)
say "wheels: ${WHEELS_KB} KiB; $CARRY in all: ${TOTAL_KB} KiB; tracked tree: ${TREE_KB} KiB" \
    "(the device tool carries at most 65536 KiB per call)"

if [ "$VERIFY" = 1 ]; then
    if [ -n "$PY312" ]; then
        say "offline check with $PY312: --no-index install into a scratch target, then imports"
        PYTHON=$PY312 KVSTORE_GPU_CARRY=$CARRY tests/gpu/run_gpu_checks.sh --wheels-only \
            || { say "the offline check failed"; exit 1; }
    else
        say "no CPython 3.12 here: the offline install is checked on the GPU machine only"
    fi
fi
say "ready: carry [\"$CARRY\"] (tests/gpu/README.md)"
