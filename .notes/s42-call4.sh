set -x
L=$OUT
PYTHONPATH=. timeout 360 python benchmarks/attention.py --out $L/bar --providers hf_flash sdpa --head-dims 128 64 --masks causal full --seqlens 4096 8192 16384 32768 --rounds 5 --min-calls 5 > $L/bar.log 2>&1
echo "bar rc $?"; tail -52 $L/bar.log | head -60
PYTHONPATH=. timeout 200 python benchmarks/attention.py --out $L/short --providers hf_flash sdpa --head-dims 128 64 --masks causal full --seqlens 512 1024 2048 --rounds 3 --min-calls 5 > $L/short.log 2>&1
echo "short rc $?"; tail -40 $L/short.log
