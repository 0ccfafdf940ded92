set -x
L=$OUT
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv,noheader
PYTHONPATH=. timeout 560 python benchmarks/attention.py --out $L/bar --providers hf_flash sdpa --head-dims 128 64 --masks causal full --seqlens 4096 8192 16384 32768 --rounds 5 --min-calls 5 > $L/bar.log 2>&1; echo "rc $?"
tail -45 $L/bar.log
