set -x
L=$OUT
bash benchmarks/hopper_env.sh > $L/env.txt 2>&1; cat $L/env.txt
PYTHONPATH=. timeout 260 python -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -m gpu -q -p no:cacheprovider -n 8 -k "dqwlds-dn" > $L/tests.log 2>&1; echo "tests rc $?"
tail -3 $L/tests.log; grep -E "^FAILED|^ERROR" $L/tests.log | head; grep -E "^E " $L/tests.log | head -5
PYTHONPATH=. timeout 280 python benchmarks/hopper_attention_bwd.py $L/dn64.json --head-dims 64 --masks causal --seqlens 1024 2048 4096 8192 16384 32768 --variants kv2x64-m128-s2-dqwlds kv2x64-m128-s2-dqwlds-dn kv2x64-m128-s2-dqwlds-dn-kf2 kv2x64-m128-s2-dqwlds-dn-kf4 --library-default --no-triton-backward --rounds 5 > $L/dn64.log 2>&1; echo "bench rc $?"
tail -45 $L/dn64.log
