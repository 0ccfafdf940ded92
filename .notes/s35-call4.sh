set -x
L=$OUT
B=kv2x64-m64-s2
python benchmarks/hopper_attention_bwd.py $L/ab-causal.json --variants $B-dqwldfpsxa-dn $B-dqwldfpsxa-dn-sf --head-dims 128 --rounds 11 --masks causal --seqlens 4096 8192 --no-triton-backward > $L/ab-causal.log 2>&1; grep "^d" $L/ab-causal.log | head -4
python benchmarks/hopper_attention_bwd.py $L/ab-full.json --variants $B-dqwldfpsbrr $B-dqwldfpsbrr-sf --head-dims 128 --rounds 11 --masks full --seqlens 8192 --no-triton-backward > $L/ab-full.log 2>&1; grep "^d" $L/ab-full.log | head -4
python benchmarks/hopper_attention_bwd.py $L/ab-d64.json --variants kv2x64-m128-s2-dqwlds kv2x64-m128-s2-dqwlds-sf --head-dims 64 --rounds 11 --masks causal --seqlens 4096 --no-triton-backward > $L/ab-d64.log 2>&1; grep "^d" $L/ab-d64.log | head -4
