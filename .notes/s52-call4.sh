set -x
L=$OUT
PYTHONPATH=. timeout 230 python -m pytest tests/integration -m gpu -q -p no:cacheprovider -n 4 > $L/integration.log 2>&1; echo "integration rc $?"; tail -3 $L/integration.log; grep -E "^(FAILED|ERROR)" $L/integration.log | head -20
PYTHONPATH=. timeout 70 python -m pytest tests/ops/test_kvcache.py tests/ops/test_rotary.py -m gpu -q -p no:cacheprovider -n 4 > $L/kv-rotary.log 2>&1; echo "kv rc $?"; tail -3 $L/kv-rotary.log; grep -E "^(FAILED|ERROR)" $L/kv-rotary.log | head -20
PYTHONPATH=. timeout 100 python -m pytest tests/hopper/test_hopper_attention_gpu.py -m gpu -q -p no:cacheprovider -n 8 > $L/hopper-fwd.log 2>&1; echo "hopper fwd rc $?"; tail -3 $L/hopper-fwd.log; grep -E "^(FAILED|ERROR)" $L/hopper-fwd.log | head -20
