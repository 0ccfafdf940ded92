set -x
L=$OUT
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
PYTHONPATH=. timeout 150 python -m pytest tests/hopper/test_hopper_attention_gpu.py -m gpu -n 8 -q -p no:cacheprovider -k "test_every_variant_matches_reference and (pp-s3-ms or fma-ms or dyn-ms or carry-ms)" > $L/ms-tests.log 2>&1; echo "rc $?"
tail -2 $L/ms-tests.log; grep -E "^FAILED|^ERROR|Error" $L/ms-tests.log | head
PYTHONPATH=. timeout 190 python benchmarks/hopper_attention.py $L/ab-d64.json --variants ws3x4-pp-s3 ws3x4-pp-s3-ms --head-dims 64 --seqlens 1024 2048 4096 8192 16384 --rounds 5 > $L/ab-d64.log 2>&1; echo "rc $?"
tail -12 $L/ab-d64.log
PYTHONPATH=. timeout 200 python benchmarks/hopper_attention.py $L/ab-d128.json --variants ws2x4-overlap-fma ws2x4-overlap-fma-ms ws2x4-overlap-fma-dyn ws2x4-overlap-fma-dyn-ms --head-dims 128 --seqlens 4096 8192 16384 --rounds 5 > $L/ab-d128.log 2>&1; echo "rc $?"
tail -8 $L/ab-d128.log
