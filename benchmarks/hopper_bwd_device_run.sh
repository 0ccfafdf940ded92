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
# overrides the pytest selection (files or node ids), HOPPER_BWD_TESTS_K adds a pytest -k
# expression; HOPPER_BWD_BENCH_ARGS adds benchmark arguments.
set -u
out=${1:?usage: hopper_bwd_device_run.sh OUT_DIR [TEST_TIMEOUT_S] [BENCH_TIMEOUT_S]}
test_timeout=${2:-200}
bench_timeout=${3:-220}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-.}
export PYTHONUNBUFFERED=1

bash "$(dirname "$0")/hopper_env.sh" >"$out/env.txt" 2>&1
cat "$out/env.txt"

variants=${HOPPER_BWD_VARIANTS:-$(python3 -c 'from hf_flash.kernels.hopper.attention_bwd import VARIANTS; print(" ".join(VARIANTS))')}
ok=()
for v in $variants; do
  if timeout 120 python3 benchmarks/diagnostics/hopper_bwd_smoke.py "$v" >>"$out/smoke.log" 2>&1
  then ok+=("$v"); echo "smoke ok: $v"; else echo "smoke FAILED: $v (rc $?)"; tail -n 5 "$out/smoke.log"; fi
done
echo "variants passing the smoke check: ${ok[*]:-none}"

tests=${HOPPER_BWD_TESTS:-tests/hopper/test_hopper_attention_bwd_gpu.py tests/ops/test_flash_attn_gpu.py::test_forward_path_choice_on_hopper tests/ops/test_flash_attn_gpu.py::test_compile_inductor_fullgraph}
timeout "$test_timeout" python3 -m pytest $tests -q -m gpu -p no:cacheprovider -n 4 \
  ${HOPPER_BWD_TESTS_K:+-k "$HOPPER_BWD_TESTS_K"} >"$out/tests.log" 2>&1
echo "tests rc $?"; tail -n 15 "$out/tests.log"

ok+=(${HOPPER_BWD_BENCH_EXTRA:-})
if [ ${#ok[@]} -gt 0 ]; then
  # HOPPER_BWD_BENCH_ARGS: extra benchmark arguments (e.g. "--head-dims 128 --rounds 3")
  timeout "$bench_timeout" python3 benchmarks/hopper_attention_bwd.py "$out/bench.json" --variants "${ok[@]}" \
    ${HOPPER_BWD_BENCH_ARGS:-} 2>&1 | tee "$out/bench.log" | tail -n 40
fi
