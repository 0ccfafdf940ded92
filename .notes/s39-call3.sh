set -x
L=$OUT
PYTHONPATH=. timeout 330 python -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -m gpu -n 8 -k "not every_variant and not packed" -q -p no:cacheprovider > $L/bwd-tests.log 2>&1; echo "bwd rc $?"; tail -3 $L/bwd-tests.log
grep -E "^FAILED|^ERROR" $L/bwd-tests.log | head -20
PYTHONPATH=. timeout 220 python -m pytest tests/ops/test_flash_attn_gpu.py -m gpu -n 8 -q -p no:cacheprovider > $L/ops-tests.log 2>&1; echo "ops rc $?"; tail -3 $L/ops-tests.log
grep -E "^FAILED|^ERROR" $L/ops-tests.log | head -20
