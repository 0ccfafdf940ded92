cd /work/main 2>/dev/null || true
export PYTHONPATH=. PYTHONUNBUFFERED=1
for a in "llama-8b 16384 offload" "llama-8b 32768 offload" "llama-8b 32768 keep_attention"; do
  set -- $a
  timeout 150 python benchmarks/diagnostics/memory_peak.py --shape $1 --tokens $2 --checkpointing $3 --out $OUT 2>&1 | grep -v Warning | tail -32
done
