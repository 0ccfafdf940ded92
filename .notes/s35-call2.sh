set -x
L=$OUT
python -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -m gpu -n 8 -k "sf or store_first" -q -p no:cacheprovider > $L/sf-tests.log 2>&1; tail -3 $L/sf-tests.log
python benchmarks/hopper_attention_bwd.py $L/bwd-sf-causal.json --variants kv2x64-m64-s2-dqwldfpsxa-dn kv2x64-m64-s2-dqwldfpsxa-dn-sf --head-dims 128 --rounds 3 --masks causal --seqlens 4096 8192 16384 --no-triton-backward > $L/bwd-sf-causal.log 2>&1; tail -8 $L/bwd-sf-causal.log
python benchmarks/hopper_attention_bwd.py $L/bwd-sf-full.json --variants kv2x64-m64-s2-dqwldfpsbrr-kf kv2x64-m64-s2-dqwldfpsbrr-kf-sf kv2x64-m64-s2-dqwldfpsbrr kv2x64-m64-s2-dqwldfpsbrr-sf --head-dims 128 --rounds 3 --masks full --seqlens 4096 8192 32768 --no-triton-backward > $L/bwd-sf-full.log 2>&1; tail -8 $L/bwd-sf-full.log
python benchmarks/hopper_attention_bwd.py $L/bwd-sf-d64.json --variants kv2x64-m128-s2-dqwlds kv2x64-m128-s2-dqwlds-sf --head-dims 64 --rounds 3 --masks causal full --seqlens 4096 8192 --no-triton-backward > $L/bwd-sf-d64.log 2>&1; tail -8 $L/bwd-sf-d64.log
python benchmarks/hopper_attention.py $L/fwd-ppdyn2.json --rounds 5 --head-dims 64 --masks causal --seqlens 2048 3072 4096 6144 --variants ws3x4-pp-s3 ws2x4-overlap-fma-dyn ws2x4-pp-dyn > $L/fwd-ppdyn2.log 2>&1; grep "^d" $L/fwd-ppdyn2.log | head -12
