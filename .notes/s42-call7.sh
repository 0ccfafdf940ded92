set -x
L=$OUT
B=kv2x64-m64-s2
PYTHONPATH=. timeout 170 python benchmarks/hopper_attention_bwd.py $L/ab-d128c.json --no-triton-backward --head-dims 128 --masks causal --seqlens 4096 8192 12288 --variants $B-dqwldfpsxa-dn-e $B-dqwldfpsxa-dn-kf2 --rounds 5 > $L/ab-d128c.log 2>&1
echo "rc $?"; grep -v "^+" $L/ab-d128c.log | head -12
