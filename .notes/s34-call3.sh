set -x
L=$OUT
python -m pytest tests/hopper/test_hopper_attention_gpu.py -m gpu -n 4 -k "px2 or px4 or px8" -q -p no:cacheprovider > $L/px-tests.log 2>&1; tail -3 $L/px-tests.log
python benchmarks/hopper_attention.py $L/fwd-px64.json --rounds 3 --head-dims 64 --variants ws3x4-pp-s3 ws3x4-pp-s3-px2 ws3x4-pp-s3-px4 ws3x4-pp-s3-px8 > $L/fwd-px64.log 2>&1; grep "^d" $L/fwd-px64.log | head -20
python benchmarks/hopper_attention.py $L/fwd-px128.json --rounds 3 --head-dims 128 --variants ws2x4-overlap-fma ws2x4-overlap-fma-px4 ws2x4-overlap-fma-px8 ws2x4-overlap-fma-dyn ws2x4-overlap-fma-dyn-px4 > $L/fwd-px128.log 2>&1; grep "^d" $L/fwd-px128.log | head -20
HOPPER_NCU_TARGET=fwd timeout 150 bash benchmarks/hopper_bwd_ncu_device_run.sh $L/ncu-px "ws3x4-pp-s3-px4" --head-dim 64 --seqlen 4096 2>&1 | grep -E "^ncu|Duration|Elapsed|Compute"
