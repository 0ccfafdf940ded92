set -x
L=$OUT
python benchmarks/hopper_attention.py $L/fwd-one.json --rounds 3 --head-dims 128 64 --variants ws2x4-overlap-fma ws2x4-overlap-fma-one ws2x4-overlap-fma-dyn ws2x4-overlap-fma-dyn-one ws3x4-pp-s3 ws3x4-pp-s3-one > $L/fwd-one.log 2>&1; grep "^d" $L/fwd-one.log | head -40
timeout 290 python -m pytest tests/hopper/test_hopper_attention_gpu.py -m gpu -n 8 -q -p no:cacheprovider > $L/fwd-tests.log 2>&1; echo "tests rc $?"; tail -5 $L/fwd-tests.log
