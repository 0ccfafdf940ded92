set -x
L=$OUT
python -m pytest tests/hopper/test_hopper_attention_gpu.py -m gpu -n 4 -k cb -q -p no:cacheprovider > $L/cb-tests.log 2>&1; tail -3 $L/cb-tests.log
python benchmarks/hopper_attention.py $L/fwd-cb.json --masks causal --rounds 5 --head-dims 64 --variants ws3x4-pp-s3 ws3x4-pp-s3-cb ws3x4-pp-s3-hm ws3x4-pp-s3-hm-cb ws2x4-overlap-fma-dyn > $L/fwd-cb.log 2>&1; grep "^d64" $L/fwd-cb.log
HOPPER_NCU_TARGET=fwd timeout 200 bash benchmarks/hopper_bwd_ncu_device_run.sh $L/ncu-cb "ws3x4-pp-s3 ws3x4-pp-s3-cb" --head-dim 64 --seqlen 4096 2>&1 | grep -E "^ncu|Duration|Elapsed|Compute"
