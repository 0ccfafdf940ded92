set -x
L=$OUT
timeout 200 env PYTHONPATH=. python benchmarks/attention.py --out $L/bar --providers hf_flash sdpa --head-dims 128 --masks causal full --seqlens 4096 8192 16384 32768 --rounds 3 --min-calls 5 > $L/bar.log 2>&1; echo "bar rc $?"; grep -E "^ *128 " $L/bar.log | head -30
