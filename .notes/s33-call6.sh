set -x
L=$OUT
timeout 200 python -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -m gpu -n 4 -k "not every_variant and not ordered_dq and not packed and not 64 and not 256" -q -p no:cacheprovider > $L/bwd-default-tests.log 2>&1; tail -3 $L/bwd-default-tests.log
PYTHONPATH=. python benchmarks/attention.py --out $L/bar --providers hf_flash sdpa --head-dims 128 --masks causal full --seqlens 4096 8192 16384 32768 --rounds 3 > $L/bar.log 2>&1; grep -E "^ *128 |issue 15" $L/bar.log
timeout 200 python -m pytest tests/ops/test_flash_attn_gpu.py -m gpu -n 8 -q -p no:cacheprovider > $L/ops-tests.log 2>&1; tail -5 $L/ops-tests.log
