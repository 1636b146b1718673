#!/usr/bin/env bash
# GPU checks of kvstore's CUDA extension, for a machine with an NVIDIA GPU and nvcc.
#
#   tests/gpu/run_gpu_checks.sh            (from anywhere; runs in the repository root)
#
# 1. finds a Python with kvstore's dependencies, else creates .venv-gpu (torch==2.13.0
#    first: a bare torch requirement pulls a multi-GB CUDA build; a CPU torch is enough,
#    the checks use the library's own device allocations when torch has no CUDA);
# 2. builds libkvcuda.so (default architectures) into build/cuda/ and points
#    KVSTORE_CUDA_LIB at it;
# 3. runs tests/gpu (kernels vs kvstore.codecs / torch reference, pinned arena, eventfd
#    completion, open/close leak check) and tests/cuda (build, fallback, loader, hygiene);
# 4. runs the NVMe -> GPU benchmark (benchmarks/cuda_transfer.py).
# Results: benchmarks/results/cuda_gpu_checks.md (+ cuda_transfer.md/.json), also
# copied to $OUT when that is set.  Budget: well under 8 minutes on one H200.
# Exit status: 0 all passed, 1 a test failed, 2 the benchmark failed, 3 setup failed.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 3
START=$SECONDS
RESULTS=benchmarks/results/cuda_gpu_checks.md
LOG=$(mktemp)
log() { echo "[gpu-checks +$((SECONDS - START))s] $*" | tee -a "$LOG"; }

DEPS="import torch, numpy, anyio, lmdb, zstandard, crc32c, pytest, hypothesis, trio"
PY=${PYTHON:-python3}
if ! "$PY" -c "$DEPS" 2>/dev/null; then
    if [ -x .venv-gpu/bin/python ] && .venv-gpu/bin/python -c "$DEPS" 2>/dev/null; then
        PY=.venv-gpu/bin/python
    else
        log "no Python with kvstore's dependencies: creating .venv-gpu"
        python3 -m venv --system-site-packages .venv-gpu || exit 3
        .venv-gpu/bin/pip install -q torch==2.13.0 \
            || { log "cannot install torch==2.13.0 (offline?); install it and rerun"; exit 3; }
        .venv-gpu/bin/pip install -q -e '.[test]' \
            || { log "cannot install kvstore's test dependencies"; exit 3; }
        PY=.venv-gpu/bin/python
    fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
log "python: $("$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available())')"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$LOG"

mkdir -p build/cuda
export KVSTORE_CUDA_LIB="$PWD/build/cuda/libkvcuda.so"
log "building $KVSTORE_CUDA_LIB"
"$PY" -m kvstore cuda build --out "$KVSTORE_CUDA_LIB" 2>&1 | tee -a "$LOG"
[ "${PIPESTATUS[0]}" -eq 0 ] || { log "build failed"; exit 3; }
STATUS=$("$PY" -m kvstore cuda status)
log "$STATUS"
case "$STATUS" in cuda:*) ;; *) log "CUDA not usable; the GPU tests would all skip"; exit 3 ;; esac

log "pytest tests/gpu tests/cuda"
timeout 300 "$PY" -m pytest tests/gpu tests/cuda -q -p no:cacheprovider -rs \
    -o tmp_path_retention_policy=none 2>&1 | tee "$LOG.pytest"
RC_TEST=${PIPESTATUS[0]}
cat "$LOG.pytest" >> "$LOG"

log "benchmark"
timeout 240 "$PY" benchmarks/cuda_transfer.py --volume-mib 2048 --reps 3 2>&1 | tee -a "$LOG"
RC_BENCH=${PIPESTATUS[0]}

mkdir -p "$(dirname "$RESULTS")"
{
    echo "# GPU checks (tests/gpu/run_gpu_checks.sh)"
    echo
    echo "Run $(date -u +%Y-%m-%dT%H:%MZ), $((SECONDS - START)) s; tests exit $RC_TEST, benchmark exit $RC_BENCH."
    echo
    echo '```'
    cat "$LOG"
    echo '```'
} > "$RESULTS"
log "results in $RESULTS"
if [ -n "${OUT:-}" ]; then
    cp "$RESULTS" "$OUT/" 2>/dev/null
    cp benchmarks/results/cuda_transfer.* "$OUT/" 2>/dev/null
fi
rm -f "$LOG" "$LOG.pytest"
[ "$RC_TEST" -eq 0 ] || exit 1
[ "$RC_BENCH" -eq 0 ] || exit 2
exit 0
