set -x
L=$OUT
B=kv2x64-m64-s2-dqwldfpsbrr
PYTHONPATH=. timeout 400 python benchmarks/hopper_attention_bwd.py $L/ab-d128full.json --no-triton-backward --head-dims 128 --masks full --seqlens 8192 16384 32768 --variants $B $B-kf --rounds 5 > $L/ab-d128full.log 2>&1
echo "== ab rc $?"; grep -E "^d" $L/ab-d128full.log | head -12
