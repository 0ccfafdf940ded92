set -x
L=$OUT
timeout 150 env PYTHONPATH=. python -m pytest tests/ops/test_flash_attn_gpu.py -m gpu -n 8 -q -p no:cacheprovider > $L/api-tests.log 2>&1; echo "api tests rc $?"; tail -3 $L/api-tests.log
STEPS=tests TEST_SHARDS=8 SUITE_BUDGET_S=175 STEP_TIMEOUT_S=175 TEST_IDS=benchmarks/results/logs/2026-11-29-s35-call6-test-ids.txt bash scripts/gpu_suite.sh $L/suite > /dev/null 2>&1; tail -8 $L/suite/suite.log
