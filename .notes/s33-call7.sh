set -x
L=$OUT
timeout 100 python -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -m gpu -n 4 -k "dn-kf" -q -p no:cacheprovider > $L/kf-tests.log 2>&1; tail -3 $L/kf-tests.log
timeout 150 python benchmarks/hopper_attention_bwd.py $L/bwd-dnkf.json --variants kv2x64-m64-s2-dqwldfpsxa-dn kv2x64-m64-s2-dqwldfpsxa-dn-kf2 kv2x64-m64-s2-dqwldfpsxa-dn-kf4 --head-dims 128 --rounds 3 --masks causal --seqlens 16384 32768 > $L/bwd-dnkf.log 2>&1; tail -8 $L/bwd-dnkf.log
