#!/usr/bin/env bash
# One device call for head dim 256 models: the soft-capped d256 attention rows (the split-D Gluon
# backward beside the Triton kernels and FlexAttention), then benchmarks/e2e_train.py's Gemma 2/3
# families (LoRA step, 1.2B-sized, head dim 256) beside transformers' sdpa (Gemma 3 only: its
# sdpa path refuses the softcap) and flex_attention.
#
#   bash benchmarks/gemma_device_run.sh OUT_DIR
set -u
out=${1:?usage: gemma_device_run.sh OUT_DIR}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-.}
export PYTHONUNBUFFERED=1

bash "$(dirname "$0")/hopper_env.sh" >"$out/env.txt" 2>&1
head -n 3 "$out/env.txt"
timeout 150 python3 benchmarks/attention.py --out "$out/softcap" --head-dims 256 --masks softcap \
  --seqlens 4096 8192 16384 --providers hf_flash hf_flash_triton flex 2>&1 | tee "$out/softcap.log" | tail -n 12
timeout "${E2E_TIMEOUT_S:-380}" python3 benchmarks/e2e_train.py --out "$out/e2e" --families gemma3 gemma2 \
  --workloads S=4K S=16K S=32K packed --providers hf_flash sdpa flex_attention 2>&1 | tee "$out/e2e.log" | tail -n 30
