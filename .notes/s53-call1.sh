set -x
L=$OUT
nvidia-smi --query-gpu=name,clocks.sm --format=csv > $L/env.txt
PYTHONPATH=. timeout 120 python -m pytest tests/ops/test_launch_gpu.py -m gpu -q -p no:cacheprovider -x > $L/launch-tests.log 2>&1; echo "launch rc $?"; tail -3 $L/launch-tests.log; grep -E "^(FAILED|ERROR)" $L/launch-tests.log | head
PYTHONPATH=. timeout 100 python benchmarks/hopper_attention.py $L/fwd64.json --variants ws2x4-overlap-fma-dyn-carry ws2x4-overlap-fma-dyn ws2x4-pp-dyn ws3x4-pp-s3 --seqlens 512 1024 2048 --head-dims 64 --masks causal --rounds 5 > $L/fwd64.log 2>&1; echo "fwd64 rc $?"; grep "^d64" $L/fwd64.log
PYTHONPATH=. timeout 60 python benchmarks/hopper_attention.py $L/fwd128.json --variants ws2x4-overlap-fma-dyn ws2x4-overlap-fma-dyn-carry --seqlens 512 --head-dims 128 --masks causal --rounds 5 > $L/fwd128.log 2>&1; echo "fwd128 rc $?"; grep "^d128" $L/fwd128.log
PYTHONPATH=. timeout 220 python -m pytest tests/ops/test_flash_attn_gpu.py -m gpu -q -p no:cacheprovider -n 6 > $L/api-tests.log 2>&1; echo "api rc $?"; tail -3 $L/api-tests.log; grep -E "^(FAILED|ERROR)" $L/api-tests.log | head -20
