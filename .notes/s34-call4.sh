set -x
L=$OUT
python -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -m gpu -n 4 -k "brr-kf2" -q -p no:cacheprovider > $L/kf2-tests.log 2>&1; tail -3 $L/kf2-tests.log
python benchmarks/hopper_attention_bwd.py $L/bwd-kf.json --variants kv2x64-m64-s2-dqwldfpsbrr kv2x64-m64-s2-dqwldfpsbrr-kf kv2x64-m64-s2-dqwldfpsbrr-kf2 --head-dims 128 --rounds 5 --masks full --seqlens 8192 16384 32768 --no-triton-backward > $L/bwd-kf.log 2>&1; tail -12 $L/bwd-kf.log
