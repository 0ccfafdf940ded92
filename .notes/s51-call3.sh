set -x
L=$OUT
bash benchmarks/hopper_env.sh > $L/env.txt 2>&1; cat $L/env.txt
PYTHONPATH=. timeout 280 python benchmarks/hopper_attention_bwd.py $L/dn64.json --head-dims 64 --masks causal --seqlens 1024 2048 4096 8192 16384 32768 --variants kv2x64-m128-s2-dqwlds kv2x64-m128-s2-dqwlds-dn kv2x64-m128-s2-dqwlds-dn-kf4 --library-default --no-triton-backward --rounds 5 > $L/dn64.log 2>&1; echo "bench rc $?"
tail -45 $L/dn64.log
