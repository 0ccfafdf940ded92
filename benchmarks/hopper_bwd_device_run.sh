#!/usr/bin/env bash
# One device call for the Gluon Hopper backward: environment, a per-variant smoke check (each in
# its own process under a time limit, so a variant that hangs cannot take the run with it), the
# backward's GPU tests (4 pytest-xdist workers), then the benchmark of the variants that passed.
#
#   bash benchmarks/hopper_bwd_device_run.sh OUT_DIR [TEST_TIMEOUT_S] [BENCH_TIMEOUT_S]
#
# Writes OUT_DIR/{env.txt,smoke.log,tests.log,bench.json,bench.log}. HOPPER_BWD_VARIANTS="a b"
# limits the smoke check and the benchmark to those variants; HOPPER_BWD_BENCH_EXTRA="c d" adds
# variants to the benchmark without a smoke check (ones measured before); HOPPER_BWD_TESTS
# overrides the pytest selection; HOPPER_BWD_BENCH_ARGS adds benchmark arguments.
set -u
out=${1:?usage: hopper_bwd_device_run.sh OUT_DIR [TEST_TIMEOUT_S] [BENCH_TIMEOUT_S]}
test_timeout=${2:-200}
bench_timeout=${3:-220}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-.}
export PYTHONUNBUFFERED=1

{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "cudnn", torch.backends.cudnn.version())'
} >"$out/env.txt" 2>&1
cat "$out/env.txt"

variants=${HOPPER_BWD_VARIANTS:-$(python3 -c 'from hf_flash.kernels.hopper.attention_bwd import VARIANTS; print(" ".join(VARIANTS))')}
ok=()
for v in $variants; do
  if timeout 120 python3 - "$v" >>"$out/smoke.log" 2>&1 <<'PY'
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
  then ok+=("$v"); echo "smoke ok: $v"; else echo "smoke FAILED: $v (rc $?)"; tail -n 5 "$out/smoke.log"; fi
done
echo "variants passing the smoke check: ${ok[*]:-none}"

tests=${HOPPER_BWD_TESTS:-tests/hopper/test_hopper_attention_bwd_gpu.py tests/ops/test_flash_attn_gpu.py::test_forward_path_choice_on_hopper tests/ops/test_flash_attn_gpu.py::test_compile_inductor_fullgraph}
timeout "$test_timeout" python3 -m pytest $tests -q -m gpu -p no:cacheprovider -n 4 >"$out/tests.log" 2>&1
echo "tests rc $?"; tail -n 15 "$out/tests.log"

ok+=(${HOPPER_BWD_BENCH_EXTRA:-})
if [ ${#ok[@]} -gt 0 ]; then
  # HOPPER_BWD_BENCH_ARGS: extra benchmark arguments (e.g. "--head-dims 128 --rounds 3")
  timeout "$bench_timeout" python3 benchmarks/hopper_attention_bwd.py "$out/bench.json" --variants "${ok[@]}" \
    ${HOPPER_BWD_BENCH_ARGS:-} 2>&1 | tee "$out/bench.log" | tail -n 40
fi
