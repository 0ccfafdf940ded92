set -x
L=$OUT
timeout 210 env PYTHONPATH=. python -m pytest tests/hopper/test_hopper_attention_gpu.py -m gpu -n 8 -q -p no:cacheprovider --maxfail=3 > $L/fwd-tests.log 2>&1; echo "fwd tests rc $?"; tail -3 $L/fwd-tests.log
timeout 370 env PYTHONPATH=. python benchmarks/attention.py --out $L/bar --providers hf_flash sdpa --head-dims 128 64 --masks causal full --seqlens 4096 8192 16384 32768 --rounds 4 > $L/bar.log 2>&1; echo "bar rc $?"; grep -E "issue 15|^ *(64|128) " $L/bar.log | head -40
ls -la $L $L/bar
