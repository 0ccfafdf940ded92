set -x
L=$OUT
T="python -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -m gpu -n 8 -q -p no:cacheprovider"
PYTHONPATH=. timeout 200 $T -k "(every_variant and sd) or (tail_pieces and kf-ts-sd)" > $L/tests-sd.log 2>&1; echo "tests rc $?"; tail -2 $L/tests-sd.log
grep -E "^FAILED|^ERROR" $L/tests-sd.log | head
B=kv2x64-m64-s2
PYTHONPATH=. timeout 200 python benchmarks/hopper_attention_bwd.py $L/ab-full.json --no-triton-backward --head-dims 128 --masks full --seqlens 8192 16384 32768 --variants $B-dqwldfpsbrr-kf-ts $B-dqwldfpsbrr-kf-ts-sd --rounds 4 > $L/ab-full.log 2>&1
echo "ab rc $?"; grep -E "^d" $L/ab-full.log | head -8
PYTHONPATH=. timeout 150 python benchmarks/hopper_attention_bwd.py $L/ab-causal.json --no-triton-backward --head-dims 128 --masks causal --seqlens 4096 16384 --variants $B-dqwldfpsxa-dn $B-dqwldfpsxa-dn-sd --rounds 4 > $L/ab-causal.log 2>&1
echo "ab rc $?"; grep -E "^d" $L/ab-causal.log | head -8
