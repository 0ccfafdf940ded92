set -x
L=$OUT
B=kv2x64-m64-s2
PYTHONPATH=. timeout 120 python benchmarks/hopper_attention_bwd.py $L/ab-short.json --no-triton-backward --head-dims 128 --masks full --seqlens 512 1024 --variants $B-dqwldfpsbrr $B-dqwldfpsbrr-kf-ts-e --rounds 5 > $L/ab-short.log 2>&1
echo "ab rc $?"; grep -E "^d" $L/ab-short.log | head -2
