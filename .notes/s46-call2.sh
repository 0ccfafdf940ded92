set -x
L=$OUT
PYTHONPATH=. timeout 150 python -m pytest tests/hopper/test_hopper_attention_gpu.py -m gpu -n 6 -q -p no:cacheprovider -k "dyn or carry or item_counters or repeat_bitwise or default_variant_matches_reference or many_items" > $L/fwd-tests.log 2>&1; echo "rc $?"
tail -2 $L/fwd-tests.log; grep -E "^FAILED|^ERROR" $L/fwd-tests.log | head
PYTHONPATH=. timeout 120 python -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py tests/ops/test_launch_gpu.py -m gpu -n 4 -q -p no:cacheprovider -k "graph or compile or plan or launch" > $L/graph-tests.log 2>&1; echo "rc $?"
tail -2 $L/graph-tests.log; grep -E "^FAILED|^ERROR" $L/graph-tests.log | head
for s in 512 256; do PYTHONPATH=. timeout 60 python benchmarks/diagnostics/attention_host_time.py --seqlen $s > $L/host-$s.log 2>&1; cat $L/host-$s.log; done
PYTHONPATH=. timeout 170 python benchmarks/attention.py --out $L/short --providers hf_flash sdpa --head-dims 128 64 --masks causal full --seqlens 512 1024 2048 --rounds 3 --min-calls 5 > $L/short.log 2>&1; echo "short rc $?"
grep -A40 "TFLOP/s" $L/short.log | head -44
