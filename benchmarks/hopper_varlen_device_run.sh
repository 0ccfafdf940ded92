#!/usr/bin/env bash
# One device call for the Gluon Hopper forward's packed (varlen) calls: environment, a smoke
# check in its own process under a time limit (a hang cannot take the run with it), the GPU tests
# (the Gluon forward's file, dense and packed, and the public varlen tests; 4 pytest-xdist
# workers), then the packed rows of benchmarks/attention.py.
#
#   bash benchmarks/hopper_varlen_device_run.sh OUT_DIR [TEST_TIMEOUT_S] [BENCH_TIMEOUT_S]
#
# Writes OUT_DIR/{env.txt,smoke.log,tests.log,bench.log} and OUT_DIR/attention_packed-<gpu>.json.
# HOPPER_TEST_K="expr" limits the tests to pytest's -k expression; HOPPER_TESTS replaces the public
# varlen tests run beside the Gluon forward's file (paths or node ids).
set -u
out=${1:?usage: hopper_varlen_device_run.sh OUT_DIR [TEST_TIMEOUT_S] [BENCH_TIMEOUT_S]}
test_timeout=${2:-240}
bench_timeout=${3:-180}
mkdir -p "$out"
export PYTHONPATH=.
export PYTHONUNBUFFERED=1

bash "$(dirname "$0")/hopper_env.sh" >"$out/env.txt" 2>&1
cat "$out/env.txt"

timeout 120 python3 - >"$out/smoke.log" 2>&1 <<'PY'
import torch
from hf_flash.kernels.hopper import attention_fwd as hk
from hf_flash.reference import FWD_FACTOR, allowed_error, attention_varlen_ref, max_abs_err
lens = [1, 0, 97, 1025, 300, 2048]
cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
worst = 0.0
for d in (64, 128):
    for causal in (False, True):
        q = torch.randn(sum(lens), 8, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(sum(lens), 2, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        out = torch.full_like(q, float("nan"))
        lse = torch.full((8, sum(lens)), float("nan"), device="cuda")
        hk.hopper_attention_forward(q, k, v, out, lse, softmax_scale=d**-0.5, causal=causal, cu_seqlens_q=cu, cu_seqlens_k=cu)
        torch.cuda.synchronize()
        ref = attention_varlen_ref(q, k, v, cu, cu, causal=causal)
        lp = attention_varlen_ref(q, k, v, cu, cu, causal=causal, upcast=False)
        err, budget = max_abs_err(out, ref), max_abs_err(lp, ref)
        print(f"varlen d{d} causal={causal}: err {err:.2e} (bf16 reference {budget:.2e}) nan {torch.isnan(out).sum().item()}", flush=True)
        worst = max(worst, err / allowed_error(budget, FWD_FACTOR, torch.bfloat16))
raise SystemExit(0 if worst <= 1.0 else 1)
PY
smoke=$?
echo "smoke rc $smoke"; cat "$out/smoke.log"

if [ $smoke -eq 0 ]; then
  timeout "$test_timeout" python3 -m pytest tests/hopper/test_hopper_attention_gpu.py \
    ${HOPPER_TESTS:-tests/ops/test_flash_attn_gpu.py::test_varlen tests/ops/test_flash_attn_gpu.py::test_forward_path_choice_on_hopper} \
    ${HOPPER_TEST_K:+-k "$HOPPER_TEST_K"} -q -m gpu -p no:cacheprovider -n 4 >"$out/tests.log" 2>&1
  echo "tests rc $?"; tail -n 15 "$out/tests.log"
  timeout "$bench_timeout" python3 benchmarks/attention.py --packed --out "$out" 2>&1 | tee "$out/bench.log" | tail -n 25
fi
