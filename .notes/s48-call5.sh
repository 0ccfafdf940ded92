set -x
L=$OUT
PYTHONPATH=. timeout 200 python -m pytest tests/integration -m gpu -n 6 -q -p no:cacheprovider > $L/integration-tests.log 2>&1; echo "rc $?"
tail -2 $L/integration-tests.log; grep -E "^FAILED|^ERROR" $L/integration-tests.log | head
PYTHONPATH=. timeout 300 python benchmarks/e2e_train.py --families llama --providers hf_flash sdpa flex_attention --workloads "padded 8x<=4K" "packed 8x<=4K" --out $L/e2e > $L/e2e.log 2>&1; echo "rc $?"
tail -12 $L/e2e.log
