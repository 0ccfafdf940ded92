set -x
L=$OUT
T="python -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -m gpu -n 8 -q -p no:cacheprovider"
PYTHONPATH=. timeout 300 $T -k "not every_variant and not packed" > $L/bwd-tests.log 2>&1; echo "bwd tests rc $?"; tail -2 $L/bwd-tests.log
grep -E "^FAILED|^ERROR" $L/bwd-tests.log | head
PYTHONPATH=. timeout 200 python -m pytest tests/ops/test_flash_attn_gpu.py -m gpu -n 8 -q -p no:cacheprovider > $L/ops-tests.log 2>&1; echo "ops tests rc $?"; tail -2 $L/ops-tests.log
grep -E "^FAILED|^ERROR" $L/ops-tests.log | head
