set -x
L=$OUT
PYTHONPATH=. timeout 200 python benchmarks/hopper_attention.py $L/ab-split.json --head-dims 128 64 --masks full --seqlens 4096 8192 16384 32768 --rounds 5 --variants ws2x4-overlap-fma-dyn ws2x4-overlap-fma-dyn:nosplit ws2x4-overlap-fma ws2x4-overlap-fma:nosplit ws3x4-pp-s3 ws3x4-pp-s3:nosplit > $L/ab-split.log 2>&1; echo "ab rc $?"
grep -E "^d" $L/ab-split.log | head -10
T="python -m pytest -m gpu -n 8 -q -p no:cacheprovider"
PYTHONPATH=. timeout 280 $T tests/hopper/test_hopper_attention_gpu.py > $L/tests-fwd.log 2>&1; echo "fwd tests rc $?"; tail -3 $L/tests-fwd.log
PYTHONPATH=. timeout 150 $T tests/ops/test_flash_attn_gpu.py > $L/tests-api.log 2>&1; echo "api tests rc $?"; tail -3 $L/tests-api.log
grep -E "FAILED|Error" $L/tests-fwd.log $L/tests-api.log | head -10
