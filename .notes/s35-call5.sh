set -x
L=$OUT
timeout 330 python -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -m gpu -n 8 -k "not every_variant and not packed" -q -p no:cacheprovider > $L/bwd-tests.log 2>&1; tail -4 $L/bwd-tests.log
timeout 200 python -m pytest tests/ops/test_flash_attn_gpu.py -m gpu -n 8 -q -p no:cacheprovider > $L/ops-tests.log 2>&1; tail -4 $L/ops-tests.log
