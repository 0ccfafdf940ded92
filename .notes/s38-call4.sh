set -x
L=$OUT
timeout 440 env PYTHONPATH=. python benchmarks/attention.py --out $L/bar --providers hf_flash sdpa --head-dims 128 64 --masks causal full --seqlens 4096 8192 16384 32768 --rounds 5 > $L/bar.log 2>&1; echo "bar rc $?"; grep -E "^ *(64|128) " $L/bar.log | head -50
