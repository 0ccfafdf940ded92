set -x
L=$OUT
PYTHONPATH=. timeout 150 python benchmarks/hopper_attention.py $L/ab-d128.json --variants ws2x4-overlap-fma ws2x4-overlap-fma-dyn ws2x4-overlap-fma-dyn-carry --head-dims 128 --masks full --seqlens 2048 4096 8192 --rounds 5 > $L/ab-d128.log 2>&1; echo "rc $?"
tail -8 $L/ab-d128.log
PYTHONPATH=. timeout 120 python benchmarks/attention.py --out $L/bar4k --providers hf_flash sdpa --head-dims 128 --masks full --seqlens 4096 --rounds 5 --min-calls 5 > $L/bar4k.log 2>&1; echo "bar rc $?"
grep -A6 "TFLOP/s" $L/bar4k.log | head -8
