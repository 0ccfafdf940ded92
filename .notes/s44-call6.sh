set -x
L=$OUT
PYTHONPATH=. timeout 120 python -m pytest tests/ops/test_launch_gpu.py -m gpu -n 4 -q -p no:cacheprovider > $L/launch-tests.log 2>&1; echo "rc $?"
tail -2 $L/launch-tests.log; grep -E "^FAILED|^ERROR" $L/launch-tests.log | head
PYTHONPATH=. timeout 80 python benchmarks/diagnostics/host_ab.py --base .abbase --seqlen 512 --rounds 8 > $L/ab-d128.log 2>&1; echo "rc $?"
PYTHONPATH=. timeout 80 python benchmarks/diagnostics/host_ab.py --base .abbase --seqlen 512 --head-dim 64 --rounds 8 > $L/ab-d64.log 2>&1; echo "rc $?"
tail -7 $L/ab-d128.log; tail -7 $L/ab-d64.log
PYTHONPATH=. timeout 200 python -m pytest tests/ops/test_flash_attn_gpu.py -m gpu -n 7 -q -p no:cacheprovider -k "not int64" > $L/api-tests.log 2>&1; echo "rc $?"
tail -2 $L/api-tests.log; grep -E "^FAILED|^ERROR" $L/api-tests.log | head
PYTHONPATH=. timeout 130 python -m pytest tests/integration/test_integration_gpu.py tests/integration/test_models.py -m gpu -n 4 -q -p no:cacheprovider > $L/integration-tests.log 2>&1; echo "rc $?"
tail -2 $L/integration-tests.log; grep -E "^FAILED|^ERROR" $L/integration-tests.log | head
