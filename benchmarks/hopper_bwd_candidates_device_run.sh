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
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "cudnn", torch.backends.cudnn.version())'
} >"$out/env.txt" 2>&1

smoke() {
  timeout "${SMOKE_TIMEOUT:-120}" python3 - "$1" <<'PY'
import sys, torch
from hf_flash.kernels import flash_bwd, flash_fwd
from hf_flash.kernels.hopper import attention_bwd as hb
from hf_flash.reference import GRAD_FACTOR, allowed_error, attention_ref, max_abs_err
v = sys.argv[1]
hb.DEFAULT.update({(d, c): v for d in hb.VARIANTS[v].head_dims for c in (False, True)})
worst = 0.0
for d in hb.VARIANTS[v].head_dims:
    for causal in (False, True):
        q = torch.randn(2, 1025, 8, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(2, 1100, 2, d, device="cuda", dtype=torch.bfloat16)
        vv = torch.randn_like(k)
        dout = torch.randn_like(q)
        opts = dict(softmax_scale=d**-0.5, causal=causal, window_left=-1, window_right=0 if causal else -1,
                    softcap=0.0, alibi_slopes=None, dropout_p=0.0, cu_seqlens_q=None, cu_seqlens_k=None,
                    max_seqlen_q=1025, max_seqlen_k=1100, rng_state=None)
        out = torch.empty_like(q)
        lse = torch.empty(2, 8, 1025, device="cuda")
        flash_fwd.flash_attn_forward(q, k, vv, out, lse, **opts)
        dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, vv))
        assert flash_bwd.backward_path(q, k, vv, out, dout, dk, dv, varlen=False, **opts) == "hopper"
        flash_bwd.flash_attn_backward(dout, None, q, k, vv, out, lse, dq, dk, dv, **opts)
        torch.cuda.synchronize()
        leaves = [t.clone().requires_grad_() for t in (q, k, vv)]
        g = torch.autograd.grad(attention_ref(*leaves, causal=causal), leaves, dout.float())
        glp = torch.autograd.grad(attention_ref(*leaves, causal=causal, upcast=False), leaves, dout)
        for name, a, r, lp in zip(("dq", "dk", "dv"), (dq, dk, dv), g, glp):
            err, budget = max_abs_err(a, r), max_abs_err(lp, r)
            print(f"{v} d{d} causal={causal} {name}: err {err:.2e} (bf16 reference {budget:.2e})", flush=True)
            worst = max(worst, err / allowed_error(budget, GRAD_FACTOR, torch.bfloat16))
sys.exit(0 if worst <= 1.0 else 1)
PY
}
for v in $cands; do smoke "$v" >"$out/smoke-$v.tmp" 2>&1 & done
wait
ok=()
for v in $cands; do
  if grep -q "causal=True dq" "$out/smoke-$v.tmp" && ! grep -qiE "error|Traceback" "$out/smoke-$v.tmp"; then
    # the python exit code is lost in the background; re-derive it from the errors it printed
    python3 - "$out/smoke-$v.tmp" <<'PY' && ok+=("$v")
import re, sys, torch
from hf_flash.reference import GRAD_FACTOR, allowed_error
lines = [l for l in open(sys.argv[1]) if " err " in l]
worst = max(float(re.search(r"err (\S+)", l).group(1)) / allowed_error(float(re.search(r"reference (\S+)\)", l).group(1)), GRAD_FACTOR, torch.bfloat16) for l in lines)
sys.exit(0 if lines and worst <= 1.0 else 1)
PY
  fi
  { echo "== $v"; cat "$out/smoke-$v.tmp"; } >>"$out/smoke.log"; rm -f "$out/smoke-$v.tmp"
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
