set -x
L=$OUT
nvidia-smi --query-gpu=name --format=csv,noheader
PYTHONPATH=. timeout 150 python benchmarks/diagnostics/host_ab.py --base .abbase --rounds 15 > $L/host-ab.log 2>&1; echo "ab rc $?"
cat $L/host-ab.log
PYTHONPATH=. timeout 360 python -m pytest tests/ops/test_launch_gpu.py -m gpu -n 2 -q -p no:cacheprovider > $L/launch-tests.log 2>&1 &
PYTHONPATH=. timeout 360 python -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -m gpu -n 7 -q -p no:cacheprovider -k "not every_variant and not packed" > $L/bwd-tests.log 2>&1 &
PYTHONPATH=. timeout 360 python -m pytest tests/ops/test_flash_attn_gpu.py -m gpu -n 7 -q -p no:cacheprovider -k "not int64" > $L/ops-tests.log 2>&1 &
wait
PYTHONPATH=. timeout 120 python -m pytest tests/ops/test_flash_attn_gpu.py -m gpu -q -p no:cacheprovider -k "int64" > $L/int64-tests.log 2>&1
for f in launch bwd ops int64; do echo "== $f"; tail -2 $L/$f-tests.log; grep -E "^FAILED|^ERROR" $L/$f-tests.log | head; done
