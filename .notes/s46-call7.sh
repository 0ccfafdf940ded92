set -x
L=$OUT
PYTHONPATH=. timeout 170 python -m pytest tests/integration -m gpu -n 6 -q -p no:cacheprovider > $L/integration-tests.log 2>&1; echo "rc $?"
tail -2 $L/integration-tests.log; grep -E "^FAILED|^ERROR" $L/integration-tests.log | head
