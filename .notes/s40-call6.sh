set -x
L=$OUT
PYTHONPATH=. timeout 300 python benchmarks/hopper_attention_bwd.py $L/ab-d64.json --no-triton-backward --head-dims 64 --masks full --seqlens 4096 8192 16384 --variants kv2x64-m128-s2-dqwlds kv2x64-m128-s2-dqwlds-sd --rounds 5 > $L/ab-d64.log 2>&1
echo "ab rc $?"; grep -E "^d" $L/ab-d64.log | head -4
