set -x
L=$OUT
timeout 290 env PYTHONPATH=. python benchmarks/attention.py --out $L/bar --providers hf_flash sdpa --head-dims 128 64 --masks causal full --seqlens 4096 8192 16384 32768 --rounds 3 > $L/bar.log 2>&1; grep -E "issue 15|^ *(64|128) " $L/bar.log | head -40
timeout 250 env PYTHONPATH=. python -m pytest tests/ops/test_flash_attn_gpu.py -m gpu -n 8 -q -p no:cacheprovider > $L/api-tests.log 2>&1; echo "api tests rc $?"; tail -3 $L/api-tests.log
