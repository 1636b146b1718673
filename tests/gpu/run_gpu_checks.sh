#!/usr/bin/env bash
# GPU checks of kvstore's CUDA extension, for the GPU machine as it is: no package
# registry reachable, its own python3 (CPython 3.12) with CUDA torch, numpy, anyio,
# pytest, hypothesis already installed.  Never touches the network.
#
#   tests/gpu/run_gpu_checks.sh                full run (tests/gpu/README.md: the device call)
#   tests/gpu/run_gpu_checks.sh --wheels-only  only the offline install of the carried
#                                              wheels and their imports (any machine)
#
# Steps, each timed and printed, each under a time limit (all of them: 450 s, 8 minutes
# with margin on one H200):
#   preflight  (1 s) GPU visible (nvidia-smi), nvcc present, the packages this machine
#              lacks are among the carried wheels; stops at once, saying what is missing
#   wheels     pip install --no-index --no-deps --target <scratch> of those wheels from
#              .gpu-carry/wheels (tests/gpu/prepare_device_wheels.sh made them);
#              PYTHONPATH gets the scratch dir, nothing else on the machine changes
#   imports    every dependency imports and works; torch sees the GPU
#   build      libkvcuda.so (nvcc) into build/cuda/; `kvstore cuda status` says cuda
#   tests      pytest tests/gpu tests/cuda
#   mover      benchmarks/cuda_mover.py: the data mover on a Llama-3-8B-shaped paged cache
#              (32 layers, 8 KV heads, head dim 128, block 16, bf16), an emulated engine
#              step under torch.cuda.set_sync_debug_mode("error"): step time saves on/off,
#              GPU->NVMe and NVMe->GPU GB/s vs pin_memory() copies and fio, FP8 on the GPU;
#              fails on any synchronising call or an FP8 payload unlike the CPU codec's
#   benchmark  benchmarks/cuda_transfer.py: NVMe -> GPU through the page-locked arena vs
#              get_many + torch pin_memory().to('cuda')
# Results: benchmarks/results/cuda_gpu_checks.md (+ cuda_mover.md/.json,
# cuda_transfer.md/.json), written only
# once a GPU was found; with $OUT set (the device tool), those and gpu_checks.log go to
# $OUT, the log as it is written, so a run killed at its limit still returns it.
#
# Environment: PYTHON (python3), KVSTORE_GPU_CARRY (.gpu-carry), KVSTORE_GPU_SITE (scratch
# install target, default $TMPDIR/kvstore-gpu-site), KVSTORE_GPU_DEADLINE_S (450),
# KVSTORE_GPU_FAKE_NO_GPU=1 (act as if no GPU were visible: tests of this script).
#
# Exit status: 0 all passed; 1 a test failed; 2 the benchmark failed; 3 the build failed
# or CUDA is not usable after it; 4 no GPU visible; 5 nvcc missing; 6 a dependency is
# missing from this machine and from the carried wheels, their install failed, or an
# import failed; 7 out of time before a step could start; 8 the mover step failed (a
# synchronising call, an FP8 payload unlike the codec's, or an error).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 6
START=$SECONDS
MODE=full
case "${1:-}" in
    "") ;;
    --wheels-only) MODE=wheels ;;
    *) echo "usage: $0 [--wheels-only]" >&2; exit 6 ;;
esac
PY=${PYTHON:-python3}
CARRY=${KVSTORE_GPU_CARRY:-.gpu-carry}
SITE=${KVSTORE_GPU_SITE:-${TMPDIR:-/tmp}/kvstore-gpu-site}
DEADLINE=${KVSTORE_GPU_DEADLINE_S:-450}
LIST=tests/gpu/device-wheels.txt
RESULTS=benchmarks/results/cuda_gpu_checks.md
# Belt and braces: even a pip that ignored --no-index could not reach an index.
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then LOG=$OUT/gpu_checks.log; else LOG=$(mktemp); fi
: > "$LOG"
STEPS=()

log() { echo "[gpu-checks +$((SECONDS - START))s] $*" | tee -a "$LOG"; }
# seconds a step may take: its own limit, or what is left of the whole run's
budget() {
    local left=$((DEADLINE - (SECONDS - START)))
    [ "$1" -lt "$left" ] && echo "$1" || echo "$left"
}
STEP=""; STEP_T0=0; STEP_LIMIT=0
begin() {
    STEP=$1; STEP_LIMIT=$(budget "$2"); STEP_T0=$SECONDS
    if [ "$STEP_LIMIT" -lt 5 ]; then
        log "out of time before step '$STEP' (limit of the whole run: ${DEADLINE}s)"
        finish 7
    fi
    log "step $STEP: start (limit ${STEP_LIMIT}s)"
}
end() {  # end RC [note]
    local took=$((SECONDS - STEP_T0)) what=ok
    [ "$1" -eq 0 ] || what="exit $1"
    [ "$1" -eq 124 ] && what="timed out after ${STEP_LIMIT}s"
    STEPS+=("| $STEP | $took | $STEP_LIMIT | $what${2:+ ($2)} |")
    log "step $STEP: $what in ${took}s"
}
fail() {  # fail CODE message: a prerequisite is missing; say so and stop
    log "STOP: $2"
    log "exit $1 after $((SECONDS - START))s; nothing else was run"
    finish "$1"
}
WROTE_RESULTS=0
finish() {
    if [ "$WROTE_RESULTS" = 1 ]; then write_results "$1"; fi
    if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
        if [ "$WROTE_RESULTS" = 1 ]; then cp "$RESULTS" "$OUT/"; fi
        if [ -f "$BENCH_MD" ]; then  # this run's benchmark, not an older file
            cp "$BENCH_MD" "$OUT/cuda_transfer.md"
            cp "${BENCH_MD%.md}.json" "$OUT/cuda_transfer.json" 2>/dev/null
        fi
        if [ -f "$MOVER_MD" ]; then
            cp "$MOVER_MD" "$OUT/cuda_mover.md"
            cp "${MOVER_MD%.md}.json" "$OUT/cuda_mover.json" 2>/dev/null
        fi
    else
        rm -f "$LOG"
    fi
    exit "$1"
}
write_results() {
    mkdir -p "$(dirname "$RESULTS")"
    {
        echo "# GPU checks (tests/gpu/run_gpu_checks.sh)"
        echo
        echo "Run $(date -u +%Y-%m-%dT%H:%MZ), $((SECONDS - START)) s in all, exit $1" \
             "(0 all passed, 1 a test failed, 2 the benchmark failed, 3 build/CUDA)."
        echo
        echo "| step | seconds | limit | result |"
        echo "|---|---|---|---|"
        printf '%s\n' "${STEPS[@]}"
        echo
        if [ -f "$MOVER_MD" ]; then
            sed -e 's/^# /## /' "$MOVER_MD"
            echo
        fi
        if [ -f "$BENCH_MD" ]; then
            sed -e 's/^# /## /' "$BENCH_MD"
            echo
        fi
        echo "## Log"
        echo
        echo '```'
        cat "$LOG"
        echo '```'
    } > "$RESULTS.tmp" && mv "$RESULTS.tmp" "$RESULTS"
}
BENCH_MD=$(mktemp -u "${TMPDIR:-/tmp}/cuda_transfer.XXXXXX").md
MOVER_MD=$(mktemp -u "${TMPDIR:-/tmp}/cuda_mover.XXXXXX").md

# ------------------------------------------------------------------ preflight (cheap)
STEP=preflight; STEP_T0=$SECONDS; STEP_LIMIT=$(budget 30)
log "step preflight: mode $MODE, python '$PY', carried files '$CARRY', scratch '$SITE'"
PROBLEMS=()
FIRST=0
problem() { PROBLEMS+=("$2"); [ "$FIRST" -ne 0 ] || FIRST=$1; }

command -v "$PY" >/dev/null 2>&1 || fail 6 "no Python '$PY' on this machine (set PYTHON)"
if [ "$MODE" = full ]; then
    if [ "${KVSTORE_GPU_FAKE_NO_GPU:-0}" = 1 ]; then
        problem 4 "no GPU visible (KVSTORE_GPU_FAKE_NO_GPU=1 pretends so)"
    elif command -v nvidia-smi >/dev/null 2>&1; then
        if GPUS=$(timeout 20 nvidia-smi -L 2>&1) && [ -n "$GPUS" ]; then
            log "GPU: $GPUS"
        else
            problem 4 "no GPU visible: nvidia-smi -L failed or listed none ($GPUS)"
        fi
    elif compgen -G '/dev/nvidia[0-9]*' >/dev/null; then
        log "GPU: $(echo /dev/nvidia[0-9]*) (no nvidia-smi)"
    else
        problem 4 "no GPU visible: no nvidia-smi and no /dev/nvidia0 on this machine"
    fi
    NVCC=$(command -v nvcc || true)
    for home in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda; do
        [ -n "$NVCC" ] && break
        [ -n "$home" ] && [ -x "$home/bin/nvcc" ] && NVCC=$home/bin/nvcc
    done
    if [ -n "$NVCC" ]; then
        log "nvcc: $NVCC ($("$NVCC" --version 2>/dev/null | grep -o 'release [0-9.]*' || echo '?'))"
    else
        problem 5 "nvcc not found (PATH, CUDA_HOME, /usr/local/cuda): the library cannot be built"
    fi
fi

# Which listed packages does this machine lack?  find_spec does not import anything.
mapfile -t NAMES < <(awk '!/^#/ && NF == 3 {print $1}' "$LIST")
MISSING=$("$PY" -c 'import importlib.util as u, sys
print(" ".join(n for n in sys.argv[1:] if u.find_spec(n) is None))' "${NAMES[@]}") \
    || fail 6 "'$PY' does not run"
WHEELS=()
NO_OPTIONAL=()
for name in $MISSING; do
    read -r req kind < <(awk -v n="$name" '!/^#/ && $1 == n {print $2, $3}' "$LIST")
    dist=${req%%==*}
    ver=${req#*==}
    whl=$(compgen -G "$CARRY/wheels/${dist//-/_}-${ver}-*.whl" | head -1)
    if [ -n "$whl" ]; then
        WHEELS+=("$whl")
    elif [ "$kind" = optional ]; then
        NO_OPTIONAL+=("$req")
    else
        problem 6 "$req is not installed on this machine and not in $CARRY/wheels: run tests/gpu/prepare_device_wheels.sh where PyPI is reachable and carry $CARRY"
    fi
done
log "missing here: ${MISSING:-none}; carried wheels to install: ${#WHEELS[@]}"
[ "${#NO_OPTIONAL[@]}" -eq 0 ] || log "${NO_OPTIONAL[*]}: neither installed nor carried;" \
    "the store uses its thread engine, io_uring is not exercised here"
if [ "${#PROBLEMS[@]}" -gt 0 ]; then
    end "$FIRST"
    for p in "${PROBLEMS[@]}"; do log "missing prerequisite: $p"; done
    fail "$FIRST" "prerequisites missing (above); exit $FIRST"
fi
end 0

# ------------------------------------------------------------------ wheels (offline)
begin wheels 60
rm -rf "$SITE"
mkdir -p "$SITE"
RC=0
if [ "${#WHEELS[@]}" -gt 0 ]; then
    # --isolated: no pip config or PIP_* variable can add an index; --no-index: none is used.
    timeout "$STEP_LIMIT" "$PY" -m pip install --isolated --no-index --no-deps --no-compile \
        --disable-pip-version-check --no-cache-dir -q --target "$SITE" "${WHEELS[@]}" \
        2>&1 | tee -a "$LOG"
    RC=${PIPESTATUS[0]}
fi
end "$RC" "${#WHEELS[@]} wheels"
[ "$RC" -eq 0 ] || fail 6 "offline install of the carried wheels failed (above)"
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
if [ -z "${KVSTORE_TEST_DATA:-}" ] && [ ! -d ../shared/data/kv ] && [ ! -d shared/data/kv ] \
        && [ -f "$CARRY/kv/smollm2_sample_meta.json" ]; then
    export KVSTORE_TEST_DATA="$PWD/$CARRY/kv"
fi

# ------------------------------------------------------------------ imports
begin imports 90
timeout "$STEP_LIMIT" "$PY" - "$MODE" "$SITE" "${NAMES[@]}" <<'EOF' 2>&1 | tee -a "$LOG"
import importlib, importlib.metadata, os, sys, tempfile
mode, site, names = sys.argv[1], os.path.realpath(sys.argv[2]), sys.argv[3:]
full = mode == "full"
mods = (["torch", "numpy", "anyio", "pytest", "hypothesis"] if full else []) + names
failed = []
for name in mods:
    try:
        m = importlib.import_module(name)
    except Exception as e:  # every failure is reported, then the step fails
        if name in ("liburing", "dynamic_import"):
            print(f"{name}: not importable ({e}): the store uses its thread engine")
            continue
        failed.append(name)
        print(f"{name}: IMPORT FAILED: {type(e).__name__}: {e}")
        continue
    where = "carried" if os.path.realpath(m.__file__ or "").startswith(site) else "machine"
    version = getattr(m, "__version__", "")
    if not version:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            version = "?"
    print(f"{name} {version} ({where})")
if failed:
    sys.exit(6)
# each carried package does what kvstore needs of it
import crc32c, lmdb, trio, zstandard
assert crc32c.crc32c(b"123456789") == 0xE3069283
assert zstandard.ZstdDecompressor().decompress(zstandard.ZstdCompressor(level=1).compress(b"kv" * 99)) == b"kv" * 99
with tempfile.TemporaryDirectory() as d:
    env = lmdb.open(d, map_size=1 << 20)
    with env.begin(write=True) as txn:
        txn.put(b"k", b"v")
    with env.begin() as txn:
        assert txn.get(b"k") == b"v"
    env.close()
trio.run(trio.sleep, 0)
print("smoke: crc32c, zstandard, lmdb, trio work")
print(f"python {sys.version.split()[0]} at {sys.executable}")
if full:
    import torch
    import kvstore
    print(f"kvstore from {os.path.dirname(kvstore.__file__)}")
    from kvstore.io.probe import probe
    os.makedirs(".bench-tmp", exist_ok=True)  # where the benchmark's store lives
    p = probe(".bench-tmp")
    print(f"I/O engine here: {p.engine} (O_DIRECT {p.direct}): {p.reason}")
    if not torch.cuda.is_available():
        print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU")
        sys.exit(4)
    print(f"torch {torch.__version__} CUDA {torch.version.cuda}: {torch.cuda.get_device_name(0)}"
          f", {torch.cuda.device_count()} device(s)")
EOF
RC=${PIPESTATUS[0]}
end "$RC"
case "$RC" in
    0) ;;
    4) fail 4 "torch sees no GPU (torch.cuda.is_available() is False)" ;;
    124) fail 6 "imports timed out" ;;
    *) fail 6 "a dependency does not import or work (above)" ;;
esac
if [ "$MODE" = wheels ]; then
    log "offline install and imports ok"
    finish 0
fi
WROTE_RESULTS=1  # a GPU is there: from now on every exit writes the results file

# ------------------------------------------------------------------ build
begin build 120
mkdir -p build/cuda
export KVSTORE_CUDA_LIB="$PWD/build/cuda/libkvcuda.so"
timeout "$STEP_LIMIT" "$PY" -m kvstore cuda build --out "$KVSTORE_CUDA_LIB" 2>&1 | tee -a "$LOG"
RC=${PIPESTATUS[0]}
STATUS=$("$PY" -m kvstore cuda status 2>&1)
log "$STATUS"
end "$RC"
[ "$RC" -eq 0 ] || fail 3 "building libkvcuda.so failed (above)"
case "$STATUS" in cuda:*) ;; *) fail 3 "CUDA not usable after the build: $STATUS" ;; esac

# ------------------------------------------------------------------ tests
begin tests 170
timeout "$STEP_LIMIT" "$PY" -m pytest tests/gpu tests/cuda -q -p no:cacheprovider -rs \
    -o tmp_path_retention_policy=none 2>&1 | tee -a "$LOG"
RC_TEST=${PIPESTATUS[0]}
end "$RC_TEST"

# ------------------------------------------------------------------ mover
begin mover 110
# 8 steps saves off, 8 on (256 MiB of new KV each), 2 GiB saved durably, a 4k-token
# prefix (512 MiB) loaded 3 times: well under a minute on one H200 and an NVMe disk.
timeout "$STEP_LIMIT" "$PY" benchmarks/cuda_mover.py --steps 8 --reps 3 \
    --dir .bench-tmp/mover --out "$MOVER_MD" 2>&1 | tee -a "$LOG"
RC_MOVER=${PIPESTATUS[0]}
end "$RC_MOVER"
if [ -f "$MOVER_MD" ]; then
    cp "$MOVER_MD" benchmarks/results/cuda_mover.md
    cp "${MOVER_MD%.md}.json" benchmarks/results/cuda_mover.json 2>/dev/null
fi

# ------------------------------------------------------------------ benchmark
begin benchmark 100
# 1 GiB x 3 repetitions of 3 paths: ~10 GiB of O_DIRECT reads, under a minute even from
# a disk of 200 MB/s; half that when less time is left.
VOL=1024
[ "$STEP_LIMIT" -ge 90 ] || VOL=512
timeout "$STEP_LIMIT" "$PY" benchmarks/cuda_transfer.py --volume-mib "$VOL" --reps 3 \
    --out "$BENCH_MD" 2>&1 | tee -a "$LOG"
RC_BENCH=${PIPESTATUS[0]}
end "$RC_BENCH" "$VOL MiB"
if [ -f "$BENCH_MD" ]; then
    cp "$BENCH_MD" benchmarks/results/cuda_transfer.md
    cp "${BENCH_MD%.md}.json" benchmarks/results/cuda_transfer.json 2>/dev/null
fi

log "done in $((SECONDS - START))s; results in $RESULTS"
[ "$RC_TEST" -eq 0 ] || finish 1
[ "$RC_MOVER" -eq 0 ] || finish 8
[ "$RC_BENCH" -eq 0 ] || finish 2
finish 0
