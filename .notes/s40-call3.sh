set -x
L=$OUT
T="python -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -m gpu -n 8 -q -p no:cacheprovider"
PYTHONPATH=. timeout 150 $T -k "every_variant and (kf2-sd or dqwlds-sd)" > $L/tests-sd.log 2>&1; echo "tests rc $?"; tail -2 $L/tests-sd.log
grep -E "^FAILED|^ERROR" $L/tests-sd.log | head
B=kv2x64-m64-s2
AB="python benchmarks/hopper_attention_bwd.py"
PYTHONPATH=. timeout 150 $AB $L/ab-kf2.json --no-triton-backward --head-dims 128 --masks causal --seqlens 16384 32768 --variants $B-dqwldfpsxa-dn-kf2 $B-dqwldfpsxa-dn-kf2-sd --rounds 4 > $L/ab-kf2.log 2>&1
echo "ab rc $?"; grep -E "^d" $L/ab-kf2.log | head -3
PYTHONPATH=. timeout 100 $AB $L/ab-dn.json --no-triton-backward --head-dims 128 --masks causal --seqlens 2048 8192 --variants $B-dqwldfpsxa-dn $B-dqwldfpsxa-dn-sd --rounds 4 > $L/ab-dn.log 2>&1
echo "ab rc $?"; grep -E "^d" $L/ab-dn.log | head -3
PYTHONPATH=. timeout 180 $AB $L/ab-d64.json --no-triton-backward --head-dims 64 --masks causal full --seqlens 4096 16384 --variants kv2x64-m128-s2-dqwlds kv2x64-m128-s2-dqwlds-sd --rounds 4 > $L/ab-d64.log 2>&1
echo "ab rc $?"; grep -E "^d" $L/ab-d64.log | head -5
