set -x
L=$OUT
timeout 290 env PYTHONPATH=. python benchmarks/attention.py --out $L/bar --providers hf_flash sdpa --head-dims 128 64 --masks causal full --seqlens 4096 8192 16384 32768 --rounds 3 > $L/bar.log 2>&1; grep -E "issue 15|^ *(64|128) " $L/bar.log | head -40
STEPS=tests TEST_SHARDS=8 SUITE_BUDGET_S=240 STEP_TIMEOUT_S=230 TEST_IDS=benchmarks/results/logs/2026-11-29-s35-call6-test-ids.txt bash scripts/gpu_suite.sh $L/suite > /dev/null 2>&1; tail -25 $L/suite/suite.log
