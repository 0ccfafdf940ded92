set -x
L=$OUT
PYTHONPATH=. timeout 260 python -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -m gpu -q -p no:cacheprovider -n 8 -k "256 or packed or test_dq_every or test_dq_repeats or m64-s2-64 or m64-s2-128" > $L/tests-bwd.log 2>&1; echo "rc $?"
tail -3 $L/tests-bwd.log; grep -E "^FAILED|^ERROR" $L/tests-bwd.log | head -20; grep -E "^E " $L/tests-bwd.log | head -10
timeout 100 env PYTHONPATH=. python benchmarks/hopper_attention_bwd.py $L/d256w.json --head-dims 256 --seqlens 16384 --masks causal --window 1024 --variants kv64-m64-s2-splitd+triton kv64-m64-s2-splitd+dq2x64-n32-s3 --no-triton-backward --rounds 3 > $L/d256w.log 2>&1; echo "rc $?"; tail -6 $L/d256w.log
PYTHONPATH=. timeout 150 python -m pytest tests/ops/test_flash_attn_gpu.py -m gpu -q -p no:cacheprovider -n 8 -k "varlen and not int64" > $L/tests-api.log 2>&1; echo "rc $?"
tail -3 $L/tests-api.log; grep -E "^FAILED|^ERROR" $L/tests-api.log | head -20
