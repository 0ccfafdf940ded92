set -x
L=$OUT
T="python -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -m gpu -n 8 -q -p no:cacheprovider"
PYTHONPATH=. timeout 200 $T -k "(every_variant or ordered_dq or tail_pieces) and (brr-e or xa-dn-e or kf2-e)" > $L/tests-e.log 2>&1; echo "tests rc $?"; tail -2 $L/tests-e.log
grep -E "^FAILED|^ERROR" $L/tests-e.log | head
B=kv2x64-m64-s2
AB="python benchmarks/hopper_attention_bwd.py"
PYTHONPATH=. timeout 200 $AB $L/ab-full.json --no-triton-backward --head-dims 128 --masks full --seqlens 2048 8192 16384 32768 --variants $B-dqwldfpsbrr-kf-ts $B-dqwldfpsbrr-kf-ts-e --rounds 5 > $L/ab-full.log 2>&1
echo "ab rc $?"; grep -E "^d" $L/ab-full.log | head -4
PYTHONPATH=. timeout 60 $AB $L/ab-brr.json --no-triton-backward --head-dims 128 --masks full --seqlens 1024 2048 --variants $B-dqwldfpsbrr $B-dqwldfpsbrr-e --rounds 5 > $L/ab-brr.log 2>&1
echo "ab rc $?"; grep -E "^d" $L/ab-brr.log | head -2
PYTHONPATH=. timeout 100 $AB $L/ab-dn.json --no-triton-backward --head-dims 128 --masks causal --seqlens 2048 4096 8192 --variants $B-dqwldfpsxa-dn $B-dqwldfpsxa-dn-e --rounds 5 > $L/ab-dn.log 2>&1
echo "ab rc $?"; grep -E "^d" $L/ab-dn.log | head -3
PYTHONPATH=. timeout 100 $AB $L/ab-kf2.json --no-triton-backward --head-dims 128 --masks causal --seqlens 16384 32768 --variants $B-dqwldfpsxa-dn-kf2 $B-dqwldfpsxa-dn-kf2-e --rounds 5 > $L/ab-kf2.log 2>&1
echo "ab rc $?"; grep -E "^d" $L/ab-kf2.log | head -2
