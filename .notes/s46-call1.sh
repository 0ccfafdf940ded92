set -x
L=$OUT
PYTHONPATH=. timeout 200 python -m pytest tests/hopper/test_hopper_attention_gpu.py -m gpu -n 6 -q -p no:cacheprovider -k "e4 or e8 or e16" > $L/fwd-tests.log 2>&1; echo "rc $?"
tail -2 $L/fwd-tests.log; grep -E "^FAILED|^ERROR" $L/fwd-tests.log | head
PYTHONPATH=. timeout 280 python benchmarks/hopper_attention.py $L/ab-d64.json --variants ws3x4-pp-s3 ws3x4-pp-s3-e16 ws3x4-pp-s3-e8 ws3x4-pp-s3-e4 --head-dims 64 --seqlens 2048 4096 8192 16384 --rounds 5 > $L/ab-d64.log 2>&1; echo "rc $?"
tail -12 $L/ab-d64.log
PYTHONPATH=. timeout 100 python benchmarks/hopper_attention.py $L/ab-carry.json --variants ws2x4-overlap-fma-dyn-carry ws2x4-overlap-fma-dyn-carry-e16 ws3x4-pp-s3-e16 --head-dims 64 --seqlens 512 1024 2048 --rounds 5 > $L/ab-carry.log 2>&1; echo "rc $?"
tail -10 $L/ab-carry.log
