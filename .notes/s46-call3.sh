set -x
L=$OUT
PYTHONPATH=. timeout 60 python -m pytest tests/hopper/test_hopper_attention_gpu.py -m gpu -q -p no:cacheprovider -k "item_counters" > $L/counter-test.log 2>&1; echo "rc $?"
tail -2 $L/counter-test.log
PYTHONPATH=. timeout 230 python -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -m gpu -n 7 -q -p no:cacheprovider -k "default_variant_matches_reference or ordered_dq or public_function or cuda_graph or 8191" > $L/bwd-tests.log 2>&1; echo "rc $?"
tail -2 $L/bwd-tests.log; grep -E "^FAILED|^ERROR" $L/bwd-tests.log | head
PYTHONPATH=. timeout 200 python -m pytest tests/ops/test_flash_attn_gpu.py -m gpu -n 7 -q -p no:cacheprovider -k "not int64" > $L/api-tests.log 2>&1; echo "rc $?"
tail -2 $L/api-tests.log; grep -E "^FAILED|^ERROR" $L/api-tests.log | head
PYTHONPATH=. timeout 60 python benchmarks/diagnostics/attention_host_time.py --seqlen 512 > $L/host-512.log 2>&1; cat $L/host-512.log
