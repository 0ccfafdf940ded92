set -x
L=$OUT
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
PYTHONPATH=. timeout 90 python -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -m gpu -q -p no:cacheprovider -k "packed_cuda_graph" > $L/tests-graph.log 2>&1; echo "rc $?"
tail -3 $L/tests-graph.log; grep -E "^FAILED|^ERROR|^E " $L/tests-graph.log | head
PYTHONPATH=. timeout 440 python -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -m gpu -q -p no:cacheprovider -n 14 --durations=15 > $L/tests-bwd.log 2>&1; echo "rc $?"
tail -22 $L/tests-bwd.log; grep -E "^FAILED|^ERROR" $L/tests-bwd.log | head -20; grep -E "^E " $L/tests-bwd.log | head -10
