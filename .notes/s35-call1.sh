set -x
L=$OUT
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
python -m pytest tests/hopper/test_hopper_attention_gpu.py -m gpu -n 8 -k "pp-dyn" -q -p no:cacheprovider > $L/ppdyn-tests.log 2>&1; tail -3 $L/ppdyn-tests.log
python benchmarks/hopper_attention.py $L/fwd-ppdyn.json --rounds 3 --head-dims 64 128 --variants ws3x4-pp-s3 ws2x4-pp ws2x4-overlap-fma-dyn ws2x4-pp-dyn > $L/fwd-ppdyn.log 2>&1; grep "^d" $L/fwd-ppdyn.log | head -40
