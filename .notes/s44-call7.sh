set -x
L=$OUT
PYTHONPATH=. timeout 230 python benchmarks/attention.py --out $L/short --providers hf_flash sdpa --head-dims 128 64 --masks causal full --seqlens 512 1024 2048 --rounds 3 --min-calls 5 > $L/short.log 2>&1; echo "short rc $?"
grep -B2 -A50 "TFLOP/s" $L/short.log | head -70
