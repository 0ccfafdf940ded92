# (s54 call 5) mma_sum again, the ones read K-major (call 4: illegal addresses / wrong sums with an MN-major [BLOCK_N, 8] view)
set -x
L=$OUT
nvidia-smi --query-gpu=name,clocks.sm --format=csv > $L/env.txt
PYTHONPATH=. timeout 60 python -m pytest tests/hopper/test_hopper_attention_gpu.py -m gpu -q -p no:cacheprovider -k "test_every_variant_matches_reference and carry-ms" > $L/tests-quick.log 2>&1; rc=$?; echo "quick rc $rc"; tail -3 $L/tests-quick.log; grep -E "^E " $L/tests-quick.log | head -8
[ $rc = 0 ] || exit 1
PYTHONPATH=. timeout 150 python -m pytest tests/hopper/test_hopper_attention_gpu.py -m gpu -q -p no:cacheprovider -n 8 -k "fma-ms or carry-ms or dyn-ms or s3-ms" > $L/tests.log 2>&1; echo "tests rc $?"; tail -3 $L/tests.log; grep -E "^(FAILED|ERROR)" $L/tests.log | head; grep -E "^E " $L/tests.log | head -10
PYTHONPATH=. timeout 200 python benchmarks/hopper_attention.py $L/d64.json --variants ws2x4-overlap-fma-dyn-carry ws2x4-overlap-fma-dyn-carry-ms ws3x4-pp-s3 ws3x4-pp-s3-ms --seqlens 512 1024 4096 16384 --head-dims 64 --masks causal full --rounds 3 > $L/d64.log 2>&1; echo "d64 rc $?"; grep "^d" $L/d64.log
PYTHONPATH=. timeout 150 python benchmarks/hopper_attention.py $L/d128.json --variants ws2x4-overlap-fma ws2x4-overlap-fma-ms ws2x4-overlap-fma-dyn ws2x4-overlap-fma-dyn-ms --seqlens 4096 16384 --head-dims 128 --masks causal full --rounds 3 > $L/d128.log 2>&1; echo "d128 rc $?"; grep "^d" $L/d128.log
