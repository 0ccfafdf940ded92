#!/usr/bin/env bash
# Device calls for head dim 256 on the Gluon Hopper kernels: environment, then the chosen steps
# (the forward's GPU tests and d256 rows beside the Triton forward, SDPA and FlexAttention; the
# split-D backward's smoke checks, tests and rows; the split-D forms at d128, measured only).
#
#   bash benchmarks/hopper_d256_device_run.sh OUT_DIR [STEPS]
#
# STEPS: comma-separated from tests,bench,packed,bwd,bwdbench,softcap (default tests,bench).
# D256_BENCH_ARGS replaces the dense benchmark's arguments. bwd: the split-D Gluon backward's smoke
# checks and GPU tests; bwdbench: benchmarks/hopper_attention_bwd.py beside the Triton backward and
# SDPA, then the windowed and packed d256 rows of benchmarks/attention.py; softcap: the split-D
# backward's soft-capped GPU tests and the d256 softcap rows beside the Triton kernels and flex;
# splitd128: the split-D forms at head dim 128 (smoke, their GPU tests, then beside the d128
# default and the Triton backward, plain and soft-capped); splitdq: the split-D form with dQ inside
# (kv128-m64-s2-splitd-dqa) beside dqwldf and the unordered dqwl at d128.
set -u
out=${1:?usage: hopper_d256_device_run.sh OUT_DIR [STEPS]}
steps=",${2:-tests,bench},"
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-.}
export PYTHONUNBUFFERED=1

bash "$(dirname "$0")/hopper_env.sh" >"$out/env.txt" 2>&1
head -n 12 "$out/env.txt"

if [[ $steps == *,tests,* ]]; then
  timeout 300 python3 -m pytest tests/hopper/test_hopper_attention_gpu.py tests/ops/test_flash_attn_gpu.py -q -m gpu \
    -p no:cacheprovider -n 4 -k "256 or path_choice" >"$out/tests.log" 2>&1
  echo "tests rc $?"; tail -n 15 "$out/tests.log"
fi

if [[ $steps == *,bench,* ]]; then
  args=${D256_BENCH_ARGS:-"--head-dims 256 --masks causal full softcap --seqlens 4096 8192 16384 --providers hf_flash hf_flash_triton sdpa sdpa_flash flex"}
  timeout 300 python3 benchmarks/attention.py --out "$out" $args 2>&1 | tee "$out/bench.log" | tail -n 40
fi

if [[ $steps == *,packed,* ]]; then
  timeout 240 python3 benchmarks/attention.py --out "$out/packed" --packed --head-dims 256 \
    --packed-providers hf_flash gluon_docorder hf_flash_triton flex 2>&1 | tee "$out/packed.log" | tail -n 25
fi

if [[ $steps == *,bwd,* ]]; then
  # the split-D Gluon backward (kv64-m64-s2-splitd, the d256 default): smoke checks in their own
  # process under a time limit (a barrier-phase bug hangs), without and with a window
  for w in -1 300; do
    if timeout 150 python3 benchmarks/diagnostics/hopper_bwd_smoke.py kv64-m64-s2-splitd --window $w \
      >"$out/bwd-smoke$w.log" 2>&1
    then echo "smoke ok: kv64-m64-s2-splitd window $w"
    else echo "smoke FAILED: kv64-m64-s2-splitd window $w (rc $?)"; tail -n 12 "$out/bwd-smoke$w.log"; exit 1; fi
  done
  timeout 330 python3 -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py tests/ops/test_flash_attn_gpu.py \
    -q -m gpu -p no:cacheprovider -n 4 -k "256 or splitd or path_choice" >"$out/bwd-tests.log" 2>&1
  echo "bwd tests rc $?"; tail -n 8 "$out/bwd-tests.log"
fi

if [[ $steps == *,bwdbench,* ]]; then
  # the d256 backward beside the Triton backward and SDPA (dense), then windowed and packed rows
  timeout 200 python3 benchmarks/hopper_attention_bwd.py "$out/bwd.json" --variants kv64-m64-s2-splitd --head-dims 256 \
    --seqlens 4096 8192 16384 --rounds 2 2>&1 | tee "$out/bwd.log" | tail -n 8
  timeout 150 python3 benchmarks/attention.py --out "$out/window" --head-dims 256 --masks window --seqlens 8192 16384 \
    --providers hf_flash hf_flash_triton sdpa flex 2>&1 | tee "$out/window.log" | tail -n 14
  timeout 150 python3 benchmarks/attention.py --out "$out/packed" --packed --head-dims 256 \
    --packed-providers hf_flash hf_flash_triton_bwd hf_flash_triton flex 2>&1 | tee "$out/packed.log" | tail -n 14
fi

if [[ $steps == *,softcap,* ]]; then
  timeout 240 python3 -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py tests/ops/test_flash_attn_gpu.py \
    -q -m gpu -p no:cacheprovider -n 4 -k "softcap_at_head_dim_256 or path_choice" >"$out/softcap-tests.log" 2>&1
  echo "softcap tests rc $?"; tail -n 6 "$out/softcap-tests.log"
  timeout 200 python3 benchmarks/attention.py --out "$out/softcap" --head-dims 256 --masks softcap \
    --seqlens 4096 8192 16384 --providers hf_flash hf_flash_triton flex 2>&1 | tee "$out/softcap.log" | tail -n 14
fi

if [[ $steps == *,splitd128,* ]]; then
  for v in kv64-m64-s2-splitd kv128-m64-s2-splitd; do
    if timeout 120 python3 benchmarks/diagnostics/hopper_bwd_smoke.py $v >"$out/smoke-$v.log" 2>&1
    then echo "smoke ok: $v"
    else echo "smoke FAILED: $v (rc $?)"; tail -n 12 "$out/smoke-$v.log"; exit 1; fi
  done
  timeout 200 python3 -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -q -m gpu -p no:cacheprovider -n 4 \
    -k "splitd or (packed and 256) or softcap_at_head_dim_256" >"$out/splitd-tests.log" 2>&1
  echo "split-D tests rc $?"; tail -n 4 "$out/splitd-tests.log"
  timeout 150 python3 benchmarks/hopper_attention_bwd.py "$out/splitd128.json" --head-dims 128 --seqlens 4096 16384 \
    --variants kv2x64-m64-s2-dqwldf kv64-m64-s2-splitd kv128-m64-s2-splitd --rounds 2 2>&1 | tail -n 6
  timeout 120 python3 benchmarks/hopper_attention_bwd.py "$out/splitd128-softcap.json" --head-dims 128 \
    --seqlens 4096 16384 --variants kv64-m64-s2-splitd kv128-m64-s2-splitd --rounds 2 --softcap 30 2>&1 | tail -n 6
fi

if [[ $steps == *,splitdq,* ]]; then
  v=kv128-m64-s2-splitd-dqa
  if timeout 120 python3 benchmarks/diagnostics/hopper_bwd_smoke.py $v >"$out/smoke-$v.log" 2>&1
  then echo "smoke ok: $v"
  else echo "smoke FAILED: $v (rc $?)"; tail -n 12 "$out/smoke-$v.log"; exit 1; fi
  timeout 100 python3 -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -q -m gpu -p no:cacheprovider -n 4 \
    -k "splitd-dqa or many_steps" >"$out/splitdq-tests.log" 2>&1
  echo "split-D dQ tests rc $?"; tail -n 4 "$out/splitdq-tests.log"
  timeout 150 python3 benchmarks/hopper_attention_bwd.py "$out/splitdq.json" --head-dims 128 --seqlens 4096 16384 \
    --variants kv2x64-m64-s2-dqwldf kv2x64-m64-s2-dqwl $v --rounds 1 2>&1 | tail -n 6
fi
