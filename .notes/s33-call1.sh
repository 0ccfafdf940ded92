set -x
L=$OUT
python -m pytest tests/hopper/test_hopper_attention_gpu.py -m gpu -n 4 -k hm -q -p no:cacheprovider > $L/hm-tests.log 2>&1; tail -3 $L/hm-tests.log
python -m pytest tests/ops/test_flash_attn.py tests/integration/test_continuous_batching.py -m gpu -n 4 -k "learnable_sink or cuda_graphs" -q -p no:cacheprovider > $L/mended-tests.log 2>&1; tail -3 $L/mended-tests.log
python benchmarks/hopper_attention.py $L/fwd-hm.json --masks causal --rounds 3 --head-dims 128 64 --variants ws2x4-overlap-fma ws2x4-overlap-fma-hm ws2x4-overlap-fma-dyn ws2x4-overlap-fma-dyn-hm ws3x4-pp-s3 ws3x4-pp-s3-hm ws3x4-overlap-fma > $L/fwd-hm.log 2>&1; tail -12 $L/fwd-hm.log
timeout 170 python -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -m gpu -n 4 -k "not every_variant and not ordered_dq and not packed and not 64 and not 256" -q -p no:cacheprovider > $L/bwd-default-tests.log 2>&1; tail -3 $L/bwd-default-tests.log
