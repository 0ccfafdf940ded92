set -x
L=$OUT
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
PYTHONPATH=. timeout 90 python benchmarks/diagnostics/forward_spread.py --shapes 128:causal:16384 --variants ws2x4-overlap-fma-hm ws2x4-overlap-fma-dyn --rounds 16 --out $L/spread-c16k > $L/spread-c16k.log 2>&1; echo "rc $?"
PYTHONPATH=. timeout 90 python benchmarks/diagnostics/forward_spread.py --shapes 128:full:8192 128:full:16384 --variants ws2x4-overlap-fma-dyn ws2x4-overlap-fma --rounds 16 --out $L/spread-f > $L/spread-f.log 2>&1; echo "rc $?"
cat $L/spread-c16k.log $L/spread-f.log
PYTHONPATH=. timeout 100 python -m pytest tests/ops/test_launch_gpu.py -m gpu -n 4 -q -p no:cacheprovider > $L/launch-tests.log 2>&1; echo "rc $?"
tail -2 $L/launch-tests.log; grep -E "^FAILED|^ERROR" $L/launch-tests.log | head
PYTHONPATH=. timeout 300 python -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -m gpu -n 7 -q -p no:cacheprovider -k "not every_variant and not packed" > $L/bwd-tests.log 2>&1; echo "rc $?"
tail -2 $L/bwd-tests.log; grep -E "^FAILED|^ERROR" $L/bwd-tests.log | head
