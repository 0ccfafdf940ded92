set -x
L=$OUT
T="python -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -m gpu -n 8 -q -p no:cacheprovider"
PYTHONPATH=. timeout 150 $T -k "kf2-ts" > $L/tests-kf2ts.log 2>&1; echo "tests rc $?"; tail -2 $L/tests-kf2ts.log
grep -E "^FAILED|^ERROR" $L/tests-kf2ts.log | head
B=kv2x64-m64-s2-dqwldfpsbrr
PYTHONPATH=. timeout 250 python benchmarks/hopper_attention_bwd.py $L/ab.json --no-triton-backward --head-dims 128 --masks full --seqlens 8192 16384 32768 --variants $B-kf-ts $B-kf2-ts --rounds 4 > $L/ab.log 2>&1
echo "ab rc $?"; grep -E "^d" $L/ab.log | head -8
