set -x
L=$OUT
bash benchmarks/hopper_env.sh > $L/env.txt 2>&1; cat $L/env.txt
PYTHONPATH=. timeout 240 python -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -m gpu -q -p no:cacheprovider -n 8 -k "(test_default_variant or test_8191 or test_results_repeat or test_ordered_dq_repeats or test_ordered_dq_needs or test_public_function or test_cuda_graph_capture_forward or test_compile_fullgraph or test_windows_match or test_windowed_public) and not 256 and not 128" > $L/tests.log 2>&1; echo "tests rc $?"
tail -3 $L/tests.log; grep -E "^FAILED|^ERROR" $L/tests.log | head; grep -E "^E " $L/tests.log | head -5
PYTHONPATH=. timeout 300 python benchmarks/attention.py --out $L/bar64 --providers hf_flash sdpa --head-dims 64 --masks causal full --seqlens 4096 8192 16384 32768 --rounds 5 --min-calls 5 > $L/bar64.log 2>&1; echo "bar rc $?"
grep -A40 "TFLOP/s" $L/bar64.log | head -44
