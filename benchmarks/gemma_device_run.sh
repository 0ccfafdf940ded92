#!/usr/bin/env bash
# One device call for head dim 256 models end to end: benchmarks/e2e_train.py's Gemma 2/3 families
# (LoRA step, 1.2B-sized, head dim 256) beside transformers' sdpa (Gemma 3 only: its sdpa path
# refuses the softcap) and flex_attention. The kernel-level d256 rows (soft-capped too) are
# benchmarks/hopper_d256_device_run.sh's.
#
#   bash benchmarks/gemma_device_run.sh OUT_DIR
set -u
out=${1:?usage: gemma_device_run.sh OUT_DIR}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-.}
export PYTHONUNBUFFERED=1

bash "$(dirname "$0")/hopper_env.sh" >"$out/env.txt" 2>&1
head -n 3 "$out/env.txt"
timeout "${E2E_TIMEOUT_S:-380}" python3 benchmarks/e2e_train.py --out "$out/e2e" --families gemma3 gemma2 \
  --workloads S=4K S=16K S=32K packed --providers hf_flash sdpa flex_attention 2>&1 | tee "$out/e2e.log" | tail -n 30
