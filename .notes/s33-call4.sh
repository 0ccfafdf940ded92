set -x
L=$OUT
python benchmarks/hopper_attention_bwd.py $L/bwd-kf.json --variants kv2x64-m64-s2-dqwldfpsbrr kv2x64-m64-s2-dqwldfpsbrr-kf kv2x64-m64-s2-dqwldfpsbrr-kf4 --head-dims 128 --rounds 5 --masks full --seqlens 2048 4096 > $L/bwd-kf.log 2>&1; tail -12 $L/bwd-kf.log
python benchmarks/attention.py --out $L/bar --providers hf_flash sdpa --head-dims 128 64 --masks causal full --seqlens 4096 8192 16384 32768 --rounds 3 > $L/bar.log 2>&1; tail -45 $L/bar.log
