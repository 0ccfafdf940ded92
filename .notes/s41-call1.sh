set -x
L=$OUT
T="python -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -m gpu -n 8 -q -p no:cacheprovider"
PYTHONPATH=. timeout 200 $T -k "(every_variant or ordered_dq_repeats or tail_pieces) and (kf-ts-e or dn-e or dqwlds-e)" > $L/tests-e.log 2>&1; echo "tests rc $?"; tail -2 $L/tests-e.log
grep -E "^FAILED|^ERROR" $L/tests-e.log | head
B=kv2x64-m64-s2
AB="python benchmarks/hopper_attention_bwd.py"
PYTHONPATH=. timeout 230 $AB $L/ab-full.json --no-triton-backward --head-dims 128 --masks full --seqlens 4096 8192 16384 32768 --variants $B-dqwldfpsbrr-kf-ts $B-dqwldfpsbrr-kf-ts-e --rounds 5 > $L/ab-full.log 2>&1
echo "ab rc $?"; grep -E "^d" $L/ab-full.log | head -8
PYTHONPATH=. timeout 100 $AB $L/ab-d64.json --no-triton-backward --head-dims 64 --masks full --seqlens 4096 16384 --variants kv2x64-m128-s2-dqwlds kv2x64-m128-s2-dqwlds-e --rounds 5 > $L/ab-d64.log 2>&1
echo "ab rc $?"; grep -E "^d" $L/ab-d64.log | head -5
PYTHONPATH=. timeout 90 $AB $L/ab-causal.json --no-triton-backward --head-dims 128 --masks causal --seqlens 4096 16384 --variants $B-dqwldfpsxa-dn $B-dqwldfpsx-dn-e --rounds 4 > $L/ab-causal.log 2>&1
echo "ab rc $?"; grep -E "^d" $L/ab-causal.log | head -5
