set -x
L=$OUT
B=kv2x64-m64-s2
AB="python benchmarks/hopper_attention_bwd.py"
PYTHONPATH=. timeout 200 $AB $L/ab-win.json --no-triton-backward --head-dims 128 --masks causal --window 4096 --seqlens 8192 16384 32768 --variants $B-dqwldfpsxa-dn $B-dqwldfpsxa-dn-e --rounds 5 > $L/ab-win.log 2>&1
echo "ab rc $?"; grep -E "^d" $L/ab-win.log | head -3
PYTHONPATH=. timeout 80 $AB $L/ab-1k.json --no-triton-backward --head-dims 128 --masks causal --seqlens 1024 --variants $B-dqwldfpsxa-dn $B-dqwldfpsxa-dn-e --rounds 5 > $L/ab-1k.log 2>&1
echo "ab rc $?"; grep -E "^d" $L/ab-1k.log | head -1
