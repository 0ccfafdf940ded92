#!/usr/bin/env bash
# One device call that takes new Gluon backward variants from "compiles" to "may be the default":
#   1. a smoke check per candidate (each in its own process, in parallel, under a time limit, so a
#      variant that hangs cannot take the run with it; gradients against the fp32 oracle),
#   2. the benchmark (benchmarks/hopper_attention_bwd.py) of the baseline beside the candidates
#      that passed, with the Triton backward and SDPA,
#   3. the pick: the candidate whose slowest point against the baseline (backward TFLOP/s) is best,
#   4. Nsight Compute on the pick (benchmarks/hopper_bwd_ncu_device_run.sh, one launch),
#   5. the backward's GPU tests with the pick as DEFAULT (a pytest plugin patches DEFAULT in every
#      xdist worker): the default-variant, public-function, bitwise-repeat, CUDA-graph and compile
#      tests run it; plus every candidate's own variant tests.
#
#   bash benchmarks/hopper_bwd_candidates_device_run.sh OUT_DIR BASELINE "CANDIDATE ..."
#
# Writes OUT_DIR/{env.txt,smoke.log,bench.json,bench.log,pick.txt,tests.log,ncu.tar.gz}.
# HOPPER_BWD_BENCH_ARGS: benchmark arguments (default "--head-dims 128 --rounds 2").
set -u
out=${1:?usage: OUT_DIR BASELINE "CANDIDATES"}
base=${2:?baseline variant}
cands=${3:?candidate variants}
export PYTHONPATH=${PYTHONPATH:-.}
export PYTHONUNBUFFERED=1
mkdir -p "$out"
t0=$(date +%s)
el() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
bash "$(dirname "$0")/hopper_env.sh" >"$out/env.txt" 2>&1

for v in $cands; do
  ( timeout "${SMOKE_TIMEOUT:-120}" python3 benchmarks/diagnostics/hopper_bwd_smoke.py "$v" >"$out/smoke-$v.tmp" 2>&1
    echo $? >"$out/smoke-$v.rc" ) &
done
wait
ok=()
for v in $cands; do
  [ "$(cat "$out/smoke-$v.rc")" = 0 ] && ok+=("$v")
  { echo "== $v (rc $(cat "$out/smoke-$v.rc"))"; cat "$out/smoke-$v.tmp"; } >>"$out/smoke.log"
  rm -f "$out/smoke-$v.tmp" "$out/smoke-$v.rc"
done
el "smoke ok: ${ok[*]:-none} (of $cands)"

timeout "${BENCH_TIMEOUT:-240}" python3 benchmarks/hopper_attention_bwd.py "$out/bench.json" --variants "$base" "${ok[@]}" \
  ${HOPPER_BWD_BENCH_ARGS:---head-dims 128 --rounds 2} >"$out/bench.log" 2>&1
el "bench rc $?"; tail -n 12 "$out/bench.log"

pick=$(python3 - "$out/bench.json" "$base" "${ok[@]}" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
base, cands = sys.argv[2], sys.argv[3:]
pts = {}
for r in rows:
    if "bwd_tflops" in r:
        pts.setdefault((r["head_dim"], r["causal"], r["seqlen"]), {})[r["provider"]] = r["bwd_tflops"]
best, best_min = base, 0.0
for c in cands:
    ratios = [p["hopper:" + c] / p["hopper:" + base] for p in pts.values() if "hopper:" + c in p and "hopper:" + base in p]
    if ratios:
        lo, mean = min(ratios), sum(ratios) / len(ratios)
        print(f"{c}: vs {base} min {lo:.3f} mean {mean:.3f} over {len(ratios)} points", file=sys.stderr)
        if lo > best_min:
            best, best_min = c, lo
print(best)
PY
)
el "pick: $pick"; echo "$pick" >"$out/pick.txt"

if [ "$pick" != "$base" ]; then
  HOPPER_NCU_TAG= timeout 90 bash benchmarks/hopper_bwd_ncu_device_run.sh "$out" "$pick" >/dev/null 2>&1
  el "ncu rc $?"
fi

# pytest plugin: DEFAULT (both causal settings) -> the pick, in the main process and every worker
plug=$(mktemp -d)
cat >"$plug/bwd_default_pick.py" <<PY
from hf_flash.kernels.hopper import attention_bwd as hb
hb.DEFAULT.update({(128, False): "$pick", (128, True): "$pick"})
PY
sel=""; for v in $cands; do sel="$sel or $v"; done
PYTHONPATH="$PYTHONPATH:$plug" timeout "${TEST_TIMEOUT:-170}" python3 -m pytest -p bwd_default_pick \
  tests/hopper/test_hopper_attention_bwd_gpu.py tests/ops/test_flash_attn_gpu.py::test_forward_path_choice_on_hopper \
  tests/ops/test_flash_attn_gpu.py::test_compile_inductor_fullgraph \
  -k "(${sel# or }) or not (every_variant or ordered_dq or many_steps)" -q -m gpu -p no:cacheprovider -n 6 \
  >"$out/tests.log" 2>&1
el "tests (DEFAULT = $pick) rc $?"; tail -n 6 "$out/tests.log"
