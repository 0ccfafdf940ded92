set -x
L=$OUT
T="python -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -m gpu -n 8 -q -p no:cacheprovider"
PYTHONPATH=. timeout 200 $T -k "tail_pieces or (every_variant and kf-ts) or default_variant" > $L/tests-tail.log 2>&1; echo "tests rc $?"; tail -2 $L/tests-tail.log
grep -E "^FAILED|^ERROR" $L/tests-tail.log | head
B=kv2x64-m64-s2
PYTHONPATH=. timeout 330 python benchmarks/hopper_attention_bwd.py $L/ab.json --no-triton-backward --head-dims 128 --masks full --seqlens 16384 32768 --variants $B-dqwldfpsbrr-kf-ts $B-dqwldfpsrr-kf-ts $B-dqwldfpsb64rr-kf-ts $B-dqwlfpsrr-kf-ts --rounds 4 > $L/ab.log 2>&1
echo "ab rc $?"; grep -E "^d" $L/ab.log | head -8; tail -4 $L/ab.log
