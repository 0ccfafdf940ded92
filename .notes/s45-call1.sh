set -x
L=$OUT
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv
PYTHONPATH=. timeout 120 python -m pytest tests/ops/test_launch_gpu.py tests/ops/test_call_plans.py -m gpu -n 4 -q -p no:cacheprovider > $L/launch-tests.log 2>&1; echo "rc $?"
tail -2 $L/launch-tests.log; grep -E "^FAILED|^ERROR" $L/launch-tests.log | head
PYTHONPATH=. timeout 200 python -m pytest tests/ops/test_flash_attn_gpu.py -m gpu -n 7 -q -p no:cacheprovider -k "not int64" > $L/api-tests.log 2>&1; echo "rc $?"
tail -2 $L/api-tests.log; grep -E "^FAILED|^ERROR" $L/api-tests.log | head
PYTHONPATH=. timeout 150 python -m pytest tests/integration -m gpu -n 6 -q -p no:cacheprovider > $L/integration-tests.log 2>&1; echo "rc $?"
tail -2 $L/integration-tests.log; grep -E "^FAILED|^ERROR" $L/integration-tests.log | head
