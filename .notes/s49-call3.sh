set -x
L=$OUT
PYTHONPATH=. timeout 230 python -m pytest tests/ops/test_flash_attn_gpu.py -m gpu -q -p no:cacheprovider -n 8 > $L/tests-api.log 2>&1; echo "rc $?"
tail -3 $L/tests-api.log; grep -E "^FAILED|^ERROR" $L/tests-api.log | head -20; grep -E "^E " $L/tests-api.log | head -10
PYTHONPATH=. timeout 200 python -m pytest tests/integration -m gpu -n 6 -q -p no:cacheprovider > $L/tests-integration.log 2>&1; echo "rc $?"
tail -3 $L/tests-integration.log; grep -E "^FAILED|^ERROR" $L/tests-integration.log | head
PYTHONPATH=. timeout 150 python benchmarks/e2e_train.py --families gemma2 --providers hf_flash flex_attention --workloads S=4K S=16K --out $L/e2e > $L/e2e.log 2>&1; echo "rc $?"
tail -8 $L/e2e.log
