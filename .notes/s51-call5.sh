set -x
L=$OUT
bash benchmarks/hopper_env.sh > $L/env.txt 2>&1; cat $L/env.txt
PYTHONPATH=. timeout 400 python benchmarks/hopper_attention_bwd.py $L/kf4.json --head-dims 128 --masks causal --seqlens 512 1024 2048 4096 8192 16384 32768 --variants kv2x64-m64-s2-dqwldfpsxa-dn-kf2 kv2x64-m64-s2-dqwldfpsxa-dn-kf4 kv2x64-m64-s2-dqwldfpsxa-dn --library-default --no-triton-backward --rounds 5 > $L/kf4.log 2>&1; echo "bench rc $?"
tail -25 $L/kf4.log
