set -x
L=$OUT
nvidia-smi --query-gpu=name,clocks.sm --format=csv > $L/env.txt
PYTHONPATH=. timeout 200 python -m pytest tests/ops/test_launch_gpu.py -m gpu -q -p no:cacheprovider -x > $L/launch-tests.log 2>&1; echo "launch tests rc $?"; tail -3 $L/launch-tests.log; grep -E "^(FAILED|ERROR|E )" $L/launch-tests.log | head -20
for d in 64 128; do PYTHONPATH=. timeout 120 python benchmarks/diagnostics/host_ab.py --base .abbase --rounds 15 --head-dim $d > $L/host-ab-d$d.log 2>&1; echo "ab rc $?"; cat $L/host-ab-d$d.log; done
PYTHONPATH=. timeout 100 python benchmarks/diagnostics/attention_host_time.py --seqlen 512 --head-dim 64 --primitives --stages --split > $L/host64.log 2>&1; echo "host rc $?"; cat $L/host64.log | grep -v "^ "
PYTHONPATH=. timeout 200 python -m pytest tests/ops/test_flash_attn_gpu.py tests/integration/test_integration_gpu.py -m gpu -q -p no:cacheprovider -n 4 > $L/api-tests.log 2>&1; echo "api tests rc $?"; tail -3 $L/api-tests.log; grep -E "^(FAILED|ERROR)" $L/api-tests.log | head -20
