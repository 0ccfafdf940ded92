#!/usr/bin/env bash
# One device call for the Gluon Hopper forward: environment, a per-variant smoke check (each in
# its own process under a time limit, so a variant that hangs cannot take the run with it), the
# GPU tests (4 pytest-xdist workers: compilation is CPU-bound), then the benchmark of the
# variants that passed the smoke check.
#
#   bash benchmarks/hopper_device_run.sh OUT_DIR [TEST_TIMEOUT_S] [BENCH_TIMEOUT_S]
#
# Writes OUT_DIR/{env.txt,smoke.log,tests.log,tests_outcomes.log,bench.json,bench.log}.
# HOPPER_VARIANTS="a b ..." limits the smoke check and the benchmark to those variants;
# HOPPER_TESTS="EXPR" limits the tests to pytest -k EXPR (default: every test of tests/hopper);
# HOPPER_HEAD_DIMS="128" limits the benchmark's head dims.
set -u
out=${1:?usage: hopper_device_run.sh OUT_DIR [TEST_TIMEOUT_S] [BENCH_TIMEOUT_S]}
test_timeout=${2:-240}
bench_timeout=${3:-300}
mkdir -p "$out"
export PYTHONPATH=.
export PYTHONUNBUFFERED=1

bash "$(dirname "$0")/hopper_env.sh" >"$out/env.txt" 2>&1
cat "$out/env.txt"

variants=${HOPPER_VARIANTS:-$(python3 -c 'from hf_flash.kernels.hopper.attention_fwd import VARIANTS; print(" ".join(VARIANTS))')}
ok=()
for v in $variants; do
  if timeout 90 python3 - "$v" >>"$out/smoke.log" 2>&1 <<'EOF'
import sys, torch
from hf_flash.kernels.hopper import attention_fwd as hk
from hf_flash.reference import FWD_FACTOR, allowed_error, attention_ref, max_abs_err
v = sys.argv[1]
worst = 0.0
for d in hk.VARIANTS[v].head_dims:
    for causal in (False, True):
        q = torch.randn(2, 1025, 8, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(2, 1100, 2, d, device="cuda", dtype=torch.bfloat16)
        vv = torch.randn_like(k)
        out = torch.full_like(q, float("nan"))
        lse = torch.full((2, 8, 1025), float("nan"), device="cuda")
        hk.hopper_attention_forward(q, k, vv, out, lse, softmax_scale=d**-0.5, causal=causal, variant=v)
        torch.cuda.synchronize()
        ref = attention_ref(q, k, vv, causal=causal)
        lp = attention_ref(q, k, vv, causal=causal, upcast=False)
        err, budget = max_abs_err(out, ref), max_abs_err(lp, ref)
        print(f"{v} d{d} causal={causal}: err {err:.2e} (bf16 reference {budget:.2e})", flush=True)
        worst = max(worst, err / allowed_error(budget, FWD_FACTOR, torch.bfloat16))
sys.exit(0 if worst <= 1.0 else 1)
EOF
  then ok+=("$v"); echo "smoke ok: $v"; else echo "smoke FAILED: $v (rc $?)"; fi
done
echo "variants passing the smoke check: ${ok[*]:-none}"

HF_FLASH_TEST_LOG="$out/tests_outcomes.log" timeout "$test_timeout" \
  python3 -m pytest tests/hopper -q -m gpu -p no:cacheprovider -n 4 ${HOPPER_TESTS:+-k "$HOPPER_TESTS"} \
  >"$out/tests.log" 2>&1
echo "tests rc $?"; tail -n 5 "$out/tests.log"

if [ ${#ok[@]} -gt 0 ]; then
  timeout "$bench_timeout" python3 benchmarks/hopper_attention.py "$out/bench.json" --variants "${ok[@]}" \
    ${HOPPER_HEAD_DIMS:+--head-dims $HOPPER_HEAD_DIMS} \
    2>&1 | tee "$out/bench.log" | tail -n 40
fi
