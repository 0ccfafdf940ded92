set -x
L=$OUT
PYTHONPATH=. timeout 180 python -m pytest tests/ops/test_flash_attn_gpu.py -m gpu -n 8 -q -p no:cacheprovider -k int64 --durations=5 > $L/int64-n8.log 2>&1; echo "rc $?"
tail -9 $L/int64-n8.log; grep -E "^FAILED|^ERROR" $L/int64-n8.log | head
