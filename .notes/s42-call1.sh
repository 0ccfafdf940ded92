set -x
L=$OUT
B=kv2x64-m64-s2
M=kv2x64-m128-s2
PYTHONPATH=. timeout 230 python benchmarks/attention.py --out $L/short --providers hf_flash sdpa --head-dims 128 64 --masks causal full --seqlens 512 1024 2048 --rounds 3 --min-calls 5 > $L/short.log 2>&1
echo "short rc $?"
PYTHONPATH=. timeout 110 python benchmarks/hopper_attention_bwd.py $L/ab-d128c.json --no-triton-backward --head-dims 128 --masks causal --seqlens 512 1024 2048 --variants $B-dqwldfpsxa-dn $B-dqwldfpsxa-dn-e $B-dqwldfpsxa-dn-kf2 --rounds 5 > $L/ab-d128c.log 2>&1
echo "d128c rc $?"
PYTHONPATH=. timeout 140 python benchmarks/hopper_attention_bwd.py $L/ab-d64.json --no-triton-backward --head-dims 64 --masks causal full --seqlens 512 1024 2048 --variants $M-dqwlds $M-dqwlds-kf $M-dqwldsb --rounds 5 > $L/ab-d64.log 2>&1
echo "d64 rc $?"
PYTHONPATH=. timeout 60 python benchmarks/hopper_attention_bwd.py $L/ab-256.json --no-triton-backward --head-dims 128 --masks full --seqlens 256 --variants $B-dqwldfpsbrr $B-dqwldfpsbrr-kf-ts-e --rounds 5 > $L/ab-256.log 2>&1
echo "256 rc $?"
grep -A20 "^bwd /" $L/ab-*.log
