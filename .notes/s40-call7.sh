set -x
L=$OUT
PYTHONPATH=. timeout 240 python benchmarks/attention.py --out $L/bar --providers hf_flash sdpa --head-dims 64 --masks full --seqlens 4096 8192 16384 --rounds 5 --min-calls 5 > $L/bar.log 2>&1
echo "bar rc $?"; grep -E "^ *64 " $L/bar.log | head -12
