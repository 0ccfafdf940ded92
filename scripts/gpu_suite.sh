#!/usr/bin/env bash
# Every GPU test and benchmark in one go, results into one folder:
#
#   bash scripts/gpu_suite.sh OUTDIR [--quick]
#
# Steps, in order (pick some with STEPS, e.g. STEPS="tests attention"):
#   tests          pytest tests -m "gpu or integration" in TEST_SHARDS (default 6) parallel
#                  processes                            -> OUTDIR/gpu-tests.log
#                  (TEST_K: a pytest -k expression; PYTEST_ARGS: more pytest arguments;
#                  TEST_PART=k/m: part k (0-based) of m, so m calls run the whole suite: the
#                  tests no longer fit one 600-second call, nor two: use three;
#                  TEST_IDS=FILE: only the node ids listed in FILE, one per line, e.g. what
#                  an earlier part left unrun)
#   attention decode rope e2e_generate e2e_train e2e_finetune
#                  benchmarks/<step>.py --out OUTDIR    -> OUTDIR/<step>-<gpu>.json
#                  (steps whose script does not exist yet are skipped)
#   sweep          benchmarks/attention.py --sweep-configs (only when named in STEPS)
#   profile_decode benchmarks/diagnostics/profile_decode.py (only when named in STEPS): where a
#                  DynamicCache decode step spends host and device time, hf_flash beside sdpa
#   profile_train  benchmarks/diagnostics/profile_train_step.py (only when named in STEPS): host
#                  vs device time of a LoRA training step, hf_flash beside sdpa
#   study          python -m hf_flash.recipes.long_context_study (only when named in STEPS; --quick
#                  unless STUDY_FULL=1)                  -> OUTDIR/study.tar (plots, table)
#   report         benchmarks/report.py                 -> OUTDIR/BENCHMARKS.md
# Extra arguments per benchmark: <STEP>_ARGS, e.g. ATTENTION_ARGS="--masks causal".
#
# Output is kept to a handful of files, because the GPU machine returns at most 8: every step's
# output goes to OUTDIR/suite.log (and to stdout), the JUnit XML, the result JSON files and
# BENCHMARKS.md. If that still makes more than 8 files, the JSON files are packed into
# OUTDIR/results.tar.gz at the end.
#
# Wheels carried in .whl/ (scripts/fetch_device_wheels.sh; the GPU machine has no package
# registry, e.g. liger-kernel for the loss comparison) are installed into /tmp/hf_flash_site and
# put on PYTHONPATH first.
#
# Time: the whole suite stays inside SUITE_BUDGET_S seconds (default 570, under one 600-second
# device call): each step runs under `timeout` with what is left (at most STEP_TIMEOUT_S,
# default 600), keeping REPORT_RESERVE_S (default 20) for the report. A step that fails or
# times out is logged and the suite goes on; benchmarks write their JSON as they go.
set -u -o pipefail

if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
    echo "usage: bash scripts/gpu_suite.sh OUTDIR [--quick]" >&2
    exit 2
fi
OUTDIR=$1
shift
QUICK=""
for arg in "$@"; do
    case $arg in
        --quick) QUICK="--quick" ;;
        *) echo "unknown argument: $arg" >&2; exit 2 ;;
    esac
done

cd "$(dirname "$0")/.."
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
LOG="$OUTDIR/suite.log"
: >"$LOG"

export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python}
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/hf_flash_site .whl/*.whl 2>&1 | tee -a "$LOG" &&
        export PYTHONPATH="/tmp/hf_flash_site:$PYTHONPATH"
fi
STEPS=${STEPS:-"tests attention decode rope e2e_generate e2e_train e2e_finetune report"}
BUDGET=${SUITE_BUDGET_S:-570}
STEP_CAP=${STEP_TIMEOUT_S:-600}
RESERVE=${REPORT_RESERVE_S:-20}
START=$SECONDS
SUMMARY=()
FAILED=0

log() { echo "$@" | tee -a "$LOG"; }

# run_step NAME CMD...: run under timeout with the time left, log, record the outcome
run_step() {
    local name=$1
    shift
    local left=$((BUDGET - (SECONDS - START) - RESERVE))
    if [ "$name" = report ]; then left=$((BUDGET - (SECONDS - START))); fi
    if [ "$left" -lt 15 ]; then
        log "=== $name: skipped, suite budget spent"
        SUMMARY+=("$name: skipped (budget)")
        return
    fi
    local limit=$((left < STEP_CAP ? left : STEP_CAP))
    log ""
    log "=== $name (timeout ${limit}s): $*"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    local took=$((SECONDS - t0))
    local what="ok"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        what="TIMEOUT"
    elif [ "$rc" -ne 0 ]; then
        what="FAILED (rc $rc)"
    fi
    [ "$what" = ok ] || FAILED=1
    log "=== $name: $what in ${took}s"
    SUMMARY+=("$name: $what in ${took}s")
}

has_step() { case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

{
    echo "=== hf_flash GPU suite: $(date -u +%FT%TZ), STEPS=\"$STEPS\" ${QUICK}"
    echo "=== git: $(git rev-parse --short HEAD 2>/dev/null || echo '?') $(git status --porcelain 2>/dev/null | wc -l) changed files"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv 2>&1 || echo "nvidia-smi failed"
    $PY - <<'EOF' 2>&1
import importlib, platform
print("python", platform.python_version())
for name in ("torch", "triton", "transformers", "accelerate", "peft", "numpy", "pytest", "liger_kernel"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as e:
        print(name, "missing:", type(e).__name__)
import torch
print("cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
EOF
} | tee -a "$LOG"

if has_step tests; then
    # TEST_SHARDS pytest processes share the GPU: Triton and Inductor compile on the CPU, so the
    # shards overlap their compilation. Each shard logs outcomes as they happen (conftest.py).
    export SHARDS=${TEST_SHARDS:-6} PY OUTDIR TEST_MARKERS TEST_K TEST_TIMEOUT_S PYTEST_ARGS TEST_IDS
    PART=${TEST_PART:-0/1}
    export PART_INDEX=${PART%/*} PART_COUNT=${PART#*/}
    if ! [[ $PART_INDEX =~ ^[0-9]+$ && $PART_COUNT =~ ^[0-9]+$ ]] || ((PART_INDEX >= PART_COUNT)); then
        echo "TEST_PART=$PART: want k/m with 0 <= k < m" >&2
        exit 2
    fi
    : >"$OUTDIR/gpu-tests.log"
    run_tests() {
        local extra=() pids=() i rc=0 target=tests
        if [ -n "${TEST_IDS:-}" ]; then target="@$TEST_IDS"; fi
        if $PY -c "import pytest_timeout" 2>/dev/null; then extra+=(--timeout "${TEST_TIMEOUT_S:-240}"); fi
        if [ -n "${TEST_K:-}" ]; then extra+=(-k "$TEST_K"); fi
        for ((i = 0; i < SHARDS; i++)); do
            # part k of m: this call's SHARDS processes take shards k*SHARDS + i of m*SHARDS
            # shellcheck disable=SC2086  # PYTEST_ARGS is split into words on purpose
            HF_FLASH_SHARD="$((PART_INDEX * SHARDS + i))/$((PART_COUNT * SHARDS))" \
                HF_FLASH_TEST_LOG="$OUTDIR/gpu-tests.log" \
                $PY -m pytest "$target" -m "${TEST_MARKERS:-gpu or integration}" -q -p no:cacheprovider \
                "${extra[@]}" ${PYTEST_ARGS:-} >"$OUTDIR/.shard$i.out" 2>&1 &
            pids+=($!)
        done
        trap 'kill "${pids[@]}" 2>/dev/null' TERM INT
        for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
        for ((i = 0; i < SHARDS; i++)); do tail -n 3 "$OUTDIR/.shard$i.out"; rm -f "$OUTDIR/.shard$i.out"; done
        grep -c "^PASSED" "$OUTDIR/gpu-tests.log" | sed 's/^/passed: /'
        grep "^FAILED\|^ERROR" "$OUTDIR/gpu-tests.log" || true
        return $rc
    }
    export -f run_tests
    run_step tests bash -c run_tests
fi

for bench in attention decode rope e2e_generate e2e_train e2e_finetune; do
    has_step "$bench" || continue
    if [ ! -f "benchmarks/$bench.py" ]; then
        log "=== $bench: skipped, benchmarks/$bench.py does not exist"
        SUMMARY+=("$bench: skipped (no script)")
        continue
    fi
    extra_var="$(echo "$bench" | tr '[:lower:]' '[:upper:]')_ARGS"
    # shellcheck disable=SC2086  # word splitting of the extra arguments is intended
    run_step "$bench" $PY "benchmarks/$bench.py" --out "$OUTDIR" $QUICK ${!extra_var:-}
done

if has_step sweep; then
    run_step sweep $PY benchmarks/attention.py --sweep-configs --out "$OUTDIR" ${ATTENTION_SWEEP_ARGS:-}
fi

if has_step profile_decode; then
    run_step profile_decode $PY benchmarks/diagnostics/profile_decode.py ${PROFILE_DECODE_ARGS:-}
fi

if has_step profile_train; then
    run_step profile_train $PY benchmarks/diagnostics/profile_train_step.py ${PROFILE_TRAIN_ARGS:-}
fi

if has_step study; then
    study_mode="--quick"
    if [ "${STUDY_FULL:-0}" = 1 ]; then study_mode=""; fi
    run_step study $PY -m hf_flash.recipes.long_context_study --out /tmp/hf_flash_study $study_mode
    (cd /tmp/hf_flash_study 2>/dev/null && tar cf "$OUTDIR/study.tar" ./*.png ./*.md ./*.json 2>/dev/null) || true
fi

if has_step report; then
    run_step report $PY benchmarks/report.py --results "$OUTDIR" --md "$OUTDIR/BENCHMARKS.md"
fi

# at most 8 files come back from the GPU machine
nfiles=$(find "$OUTDIR" -type f | wc -l)
if [ "$nfiles" -gt 8 ]; then
    (cd "$OUTDIR" && tar czf results.tar.gz ./*.json && rm -f ./*.json)
    log "=== $nfiles files: packed the JSON results into results.tar.gz"
fi

log ""
log "=== summary ($((SECONDS - START))s)"
for line in "${SUMMARY[@]}"; do log "  $line"; done
log "=== files: $(cd "$OUTDIR" && ls | tr '\n' ' ')"
exit "$FAILED"
