set -x
L=$OUT
T="python -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -m gpu -n 8 -q -p no:cacheprovider"
PYTHONPATH=. timeout 170 $T -k "brr-pp" > $L/tests-pp.log 2>&1; echo "pp tests rc $?"; tail -3 $L/tests-pp.log
B=kv2x64-m64-s2-dqwldfpsbrr
PYTHONPATH=. timeout 400 python benchmarks/hopper_attention_bwd.py $L/ab-d128full.json --no-triton-backward --head-dims 128 --masks full --seqlens 4096 8192 16384 32768 --variants $B $B-pp1 $B-pp2 $B-pp3 --rounds 4 > $L/ab-d128full.log 2>&1
echo "== ab rc $?"; grep -E "^d" $L/ab-d128full.log | head -12
