#!/usr/bin/env bash
# One device call for the Gluon Hopper backward's packed (varlen) calls: environment, a smoke check
# in its own process under a time limit (a hang cannot take the run with it), the GPU tests (the
# packed backward's, then the public varlen tests; 4 pytest-xdist workers), then the packed rows
# of benchmarks/attention.py (Gluon against Triton backward, d128).
#
#   bash benchmarks/hopper_bwd_varlen_device_run.sh OUT_DIR [TEST_TIMEOUT_S] [BENCH_TIMEOUT_S]
#
# Writes OUT_DIR/{env.txt,smoke.log,tests.log,bench.log} and OUT_DIR/attention_packed-<gpu>.json.
# HOPPER_TEST_K="expr": pytest's -k expression for the backward test file (default "packed");
# HOPPER_DENSE=1 also runs the rest of that file (the dense backward) at the end; SKIP_SMOKE=1 skips
# the smoke check; then benchmarks/hopper_bwd_varlen.py times the packed backward alone (Gluon
# variants against Triton) after the packed rows.
set -u
out=${1:?usage: hopper_bwd_varlen_device_run.sh OUT_DIR [TEST_TIMEOUT_S] [BENCH_TIMEOUT_S]}
test_timeout=${2:-120}
bench_timeout=${3:-120}
mkdir -p "$out"
export PYTHONPATH=.
export PYTHONUNBUFFERED=1

bash "$(dirname "$0")/hopper_env.sh" >"$out/env.txt" 2>&1
cat "$out/env.txt"

smoke=0
[ "${SKIP_SMOKE:-0}" = 1 ] || timeout 120 python3 - >"$out/smoke.log" 2>&1 <<'PY'
import time
import torch
from hf_flash.kernels import flash_bwd, flash_fwd
from hf_flash.reference import GRAD_FACTOR, allowed_error, attention_varlen_ref, max_abs_err

def cu_of(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")

worst = 0.0
cases = [([1, 97, 0, 1025, 300, 64, 129], None, 8, 2), ([50, 200, 1, 0, 300], [120, 200, 77, 64, 97], 8, 2),
         ([1, 97, 0, 1025, 300, 64, 129], None, 8, 1)]
for lens_q, lens_k, h, hk in cases:
    lens_k = lens_k or lens_q
    for causal in (False, True):
        for dtype in (torch.bfloat16, torch.float16):
            t0 = time.time()
            cq, ck = cu_of(lens_q), cu_of(lens_k)
            q = torch.randn(sum(lens_q), h, 128, device="cuda", dtype=dtype)
            k = torch.randn(sum(lens_k), hk, 128, device="cuda", dtype=dtype)
            v = torch.randn_like(k)
            dout = torch.randn_like(q)
            opts = dict(softmax_scale=128**-0.5, causal=causal, window_left=-1, window_right=0 if causal else -1,
                        softcap=0.0, alibi_slopes=None, dropout_p=0.0)
            lens = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
            out = torch.empty_like(q)
            lse = torch.empty(h, q.shape[0], device="cuda")
            flash_fwd.flash_attn_forward(q, k, v, out, lse, rng_state=None, **lens, **opts)
            grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
            path = flash_bwd.backward_path(q, k, v, out, dout, grads[1], grads[2], varlen=True, **opts)
            flash_bwd.flash_attn_backward(dout, None, q, k, v, out, lse, *grads, rng_state=None, **lens, **opts)
            torch.cuda.synchronize()
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            ref = torch.autograd.grad(attention_varlen_ref(*leaves, cq, ck, causal=causal), leaves, dout.float())
            lp = torch.autograd.grad(attention_varlen_ref(*leaves, cq, ck, causal=causal, upcast=False), leaves, dout)
            msg = []
            for name, g, r, l in zip(("dq", "dk", "dv"), grads, ref, lp):
                err, budget = max_abs_err(g, r), max_abs_err(l, r)
                worst = max(worst, err / allowed_error(budget, GRAD_FACTOR, dtype))
                msg.append(f"{name} {err:.2e}/{budget:.2e} nan {torch.isnan(g).sum().item()}")
            print(f"{path} q{lens_q} k{lens_k} h{h}/{hk} causal={causal} {str(dtype)[6:]}: " + ", ".join(msg)
                  + f" ({time.time() - t0:.1f}s)", flush=True)
print(f"worst err / allowed {worst:.3f}")
raise SystemExit(0 if worst <= 1.0 else 1)
PY
rc=$?
[ "${SKIP_SMOKE:-0}" = 1 ] || { smoke=$rc; echo "smoke rc $smoke"; cat "$out/smoke.log"; }

if [ $smoke -eq 0 ]; then
  # (the -k expression would deselect the public varlen tests: a second pytest run takes them)
  timeout "$test_timeout" python3 -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -k "${HOPPER_TEST_K:-packed}" \
    -q -m gpu -p no:cacheprovider -n 4 >"$out/tests.log" 2>&1
  echo "tests rc $?"; tail -n 25 "$out/tests.log"
  timeout "$test_timeout" python3 -m pytest tests/ops/test_flash_attn_gpu.py::test_varlen \
    tests/ops/test_flash_attn_gpu.py::test_forward_path_choice_on_hopper \
    -q -m gpu -p no:cacheprovider -n 4 >"$out/tests_varlen.log" 2>&1
  echo "public varlen tests rc $?"; tail -n 5 "$out/tests_varlen.log"
  timeout "$bench_timeout" python3 benchmarks/hopper_bwd_varlen.py --rounds 3 --out "$out" 2>&1 \
    | tee "$out/bench_bwd.log" | tail -n 12
  timeout "$bench_timeout" python3 benchmarks/attention.py --packed --head-dims 128 --rounds 3 \
    --packed-providers hf_flash hf_flash_triton_bwd hf_flash_gluon_varlen hf_flash_gluon_varlen_triton_bwd hf_flash_triton \
    --out "$out" 2>&1 | tee "$out/bench.log" | tail -n 25
  if [ "${HOPPER_DENSE:-0}" = 1 ]; then
    # what is left of a 340 s call (DEADLINE_S)
    left=$(( ${DEADLINE_S:-340} - SECONDS )); [ $left -gt 10 ] || left=10
    timeout "$left" python3 -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -k "not packed" \
      -q -m gpu -p no:cacheprovider -n 4 >"$out/tests_dense.log" 2>&1
    echo "dense tests rc $?"; tail -n 15 "$out/tests_dense.log"
  fi
fi
