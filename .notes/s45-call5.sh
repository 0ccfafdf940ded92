set -x
L=$OUT
PYTHONPATH=. timeout 150 python -m pytest tests/hopper/test_hopper_attention_gpu.py -m gpu -n 6 -q -p no:cacheprovider -k "default_variant_matches_reference or carry or many_items or dynamic_schedule or repeat_bitwise or non_contiguous or rows_without_keys" > $L/fwd-tests.log 2>&1; echo "rc $?"
tail -2 $L/fwd-tests.log; grep -E "^FAILED|^ERROR" $L/fwd-tests.log | head
PYTHONPATH=. timeout 90 python -m pytest tests/ops/test_launch_gpu.py -m gpu -n 4 -q -p no:cacheprovider > $L/launch-tests.log 2>&1; echo "rc $?"
tail -2 $L/launch-tests.log; grep -E "^FAILED|^ERROR" $L/launch-tests.log | head
PYTHONPATH=. timeout 200 python -m pytest tests/ops/test_flash_attn_gpu.py -m gpu -n 7 -q -p no:cacheprovider -k "not int64" > $L/api-tests.log 2>&1; echo "rc $?"
tail -2 $L/api-tests.log; grep -E "^FAILED|^ERROR" $L/api-tests.log | head
PYTHONPATH=. timeout 100 python benchmarks/attention.py --out $L/bar --providers hf_flash sdpa --head-dims 128 --masks full --seqlens 4096 8192 --rounds 5 --min-calls 5 > $L/bar.log 2>&1; echo "bar rc $?"
grep -A12 "TFLOP/s" $L/bar.log | head -16
PYTHONPATH=. timeout 170 python benchmarks/attention.py --out $L/short --providers hf_flash sdpa --head-dims 128 64 --masks causal full --seqlens 512 1024 2048 --rounds 3 --min-calls 5 > $L/short.log 2>&1; echo "short rc $?"
grep -A40 "TFLOP/s" $L/short.log | head -44
