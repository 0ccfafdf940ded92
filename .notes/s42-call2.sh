set -x
L=$OUT
B=kv2x64-m64-s2
M=kv2x64-m128-s2
for d in 128 64; do PYTHONPATH=. timeout 60 python benchmarks/diagnostics/attention_host_time.py --seqlen 512 --head-dim $d --profile > $L/host-d$d.log 2>&1; echo "host d$d rc $?"; done
head -8 $L/host-d128.log; head -8 $L/host-d64.log
PYTHONPATH=. timeout 170 python benchmarks/hopper_attention_bwd.py $L/ab-d128c.json --no-triton-backward --head-dims 128 --masks causal --seqlens 512 1024 2048 4096 8192 --variants $B-dqwldfpsxa-dn-e $B-dqwldfpsxa-dn-kf2 $B-dqwldfpsxa-dn-kf2-e --rounds 5 > $L/ab-d128c.log 2>&1
echo "d128c rc $?"
PYTHONPATH=. timeout 130 python benchmarks/hopper_attention_bwd.py $L/ab-d64.json --no-triton-backward --head-dims 64 --masks full --seqlens 512 1024 2048 3072 4096 --variants $M-dqwlds $M-dqwlds-kf --rounds 5 > $L/ab-d64.log 2>&1
echo "d64 rc $?"
grep -A20 "^bwd /" $L/ab-*.log
