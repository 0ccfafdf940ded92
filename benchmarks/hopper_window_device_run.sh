#!/usr/bin/env bash
# One device call for sliding windows and softcap on the Gluon Hopper kernels: environment, the
# backward smoke check with a window per default variant (each in its own process under a time
# limit: a wrong turn in the ordered dQ's counters hangs, and must not take the run with it),
# the GPU tests of windows and softcap, then the window / softcap rows of benchmarks/attention.py.
#
#   bash benchmarks/hopper_window_device_run.sh OUT_DIR [STEPS]
#
# STEPS: comma-separated from smoke,tests,alltests,bench (default smoke,tests,bench). alltests runs
# every Hopper GPU test and the int64 addressing tests. WINDOW_BENCH_ARGS replaces the benchmark's
# arguments (default: d128 and d64, window and softcap masks, S = 8K, 16K, 32K, hf_flash beside
# hf_flash_triton, sdpa, sdpa_cudnn and flex).
set -u
out=${1:?usage: hopper_window_device_run.sh OUT_DIR [STEPS]}
steps=",${2:-smoke,tests,bench},"
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-.}
export PYTHONUNBUFFERED=1

bash "$(dirname "$0")/hopper_env.sh" >"$out/env.txt" 2>&1
cat "$out/env.txt"

if [[ $steps == *,smoke,* ]]; then
  variants=$(python3 -c 'from hf_flash.kernels.hopper import attention_bwd as hb; print(" ".join(sorted(set(hb.DEFAULT.values()) | set(hb.VARLEN_DEFAULT.values()))))')
  for v in $variants; do
    for left in 100 1000; do
      if timeout 120 python3 benchmarks/diagnostics/hopper_bwd_smoke.py "$v" --window "$left" >>"$out/smoke.log" 2>&1
      then echo "smoke ok: $v window $left"; else echo "smoke FAILED: $v window $left (rc $?)"; tail -n 5 "$out/smoke.log"; fi
    done
  done
fi

if [[ $steps == *,tests,* ]]; then
  timeout 280 python3 -m pytest tests/hopper -q -m gpu -p no:cacheprovider -n 4 -k "window or softcap or Window" \
    >"$out/tests.log" 2>&1
  echo "tests rc $?"; tail -n 15 "$out/tests.log"
fi

if [[ $steps == *,alltests,* ]]; then
  timeout 420 python3 -m pytest tests/hopper tests/ops/test_flash_attn_gpu.py -q -m gpu -p no:cacheprovider -n 4 \
    -k "not window and not softcap and not Window and not 2_31" >"$out/alltests.log" 2>&1
  echo "alltests rc $?"; tail -n 15 "$out/alltests.log"
  timeout 150 python3 -m pytest tests/ops/test_flash_attn_gpu.py -q -m gpu -p no:cacheprovider -k "2_31" \
    >"$out/int64.log" 2>&1
  echo "int64 rc $?"; tail -n 5 "$out/int64.log"
fi

if [[ $steps == *,bench,* ]]; then
  args=${WINDOW_BENCH_ARGS:-"--masks window softcap --head-dims 128 64 --seqlens 8192 16384 32768 --providers hf_flash hf_flash_triton sdpa sdpa_cudnn flex"}
  timeout 300 python3 benchmarks/attention.py --out "$out" $args 2>&1 | tee "$out/bench.log" | tail -n 45
fi
