set -x
L=$OUT
PYTHONPATH=. timeout 120 python -m pytest tests/pretrained -m gpu -q -p no:cacheprovider > $L/pretrained-tests.log 2>&1; echo "rc $?"
tail -2 $L/pretrained-tests.log; grep -E "^FAILED|^ERROR" $L/pretrained-tests.log | head
PYTHONPATH=. timeout 220 python -m pytest tests/ops/test_flash_attn_gpu.py -m gpu -n 8 -q -p no:cacheprovider > $L/api-tests.log 2>&1; echo "rc $?"
tail -2 $L/api-tests.log; grep -E "^FAILED|^ERROR" $L/api-tests.log | head
