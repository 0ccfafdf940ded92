#!/usr/bin/env bash
# memory_peak.py at a few (shape, tokens, checkpointing) points, then (optionally) one recipe point
# of benchmarks/long_context_search.py:  OUT=... bash benchmarks/diagnostics/memory_peak_device_run.sh
#   POINTS="llama-8b:65536:offload:8192 llama-8b:131072:recompute" SEARCH="llama-8b:262144"
# (POINTS: shape:tokens:checkpointing[:tiled-MLP chunk, 0 off, auto])
set -u
cd "$(dirname "$0")/../.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
for point in ${POINTS:-llama-8b:16384:offload}; do
    IFS=: read -r shape tokens ckpt tiled <<<"$point"
    timeout 200 python benchmarks/diagnostics/memory_peak.py --shape "$shape" --tokens "$tokens" \
        --checkpointing "$ckpt" --tiled-mlp "${tiled:-auto}" --out "$OUT" 2>&1 | grep -v Warning | tail -24
done
if [ -n "${SEARCH:-}" ]; then
    timeout 420 python benchmarks/long_context_search.py --points "$SEARCH" --steps 1 --timeout 400 \
        --out "$OUT" 2>&1 | grep -v "^ "
fi
