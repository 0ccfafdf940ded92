set -x
L=$OUT
PYTHONPATH=. timeout 200 python -m pytest tests/hopper/test_hopper_attention_gpu.py -m gpu -n 6 -q -p no:cacheprovider -k "carry" > $L/fwd-tests.log 2>&1; echo "rc $?"
tail -2 $L/fwd-tests.log; grep -E "^FAILED|^ERROR" $L/fwd-tests.log | head
PYTHONPATH=. timeout 300 python benchmarks/hopper_attention.py $L/ab-d128.json --variants ws2x4-overlap-fma ws2x4-overlap-fma-dyn ws2x4-overlap-fma-dyn-carry --head-dims 128 --seqlens 512 1024 2048 4096 8192 16384 --rounds 5 > $L/ab-d128.log 2>&1; echo "rc $?"
tail -16 $L/ab-d128.log
