set -x
L=$OUT
python -m pytest tests/hopper/test_hopper_attention_gpu.py -m gpu -n 4 -k "s3-tr or fma-tr or dyn-tr or hm-tr" -q -p no:cacheprovider > $L/tr-tests.log 2>&1; tail -3 $L/tr-tests.log
python benchmarks/hopper_attention.py $L/fwd-tr.json --rounds 3 --head-dims 128 64 --variants ws2x4-overlap-fma ws2x4-overlap-fma-tr ws2x4-overlap-fma-dyn ws2x4-overlap-fma-dyn-tr ws3x4-pp-s3 ws3x4-pp-s3-tr > $L/fwd-tr.log 2>&1; grep "^d" $L/fwd-tr.log | head -40
HOPPER_NCU_TARGET=fwd timeout 200 bash benchmarks/hopper_bwd_ncu_device_run.sh $L/ncu-tr "ws3x4-pp-s3 ws3x4-pp-s3-tr" --head-dim 64 --seqlen 4096 2>&1 | grep -E "^ncu|Duration|Elapsed|Compute"
