set -x
L=$OUT
python -m pytest tests/hopper/test_hopper_attention_gpu.py -m gpu -n 8 -k "pp-dyn-s3" -q -p no:cacheprovider > $L/ppdyns3-tests.log 2>&1; tail -2 $L/ppdyns3-tests.log
B=kv2x64-m64-s2
PYTHONPATH=. python benchmarks/diagnostics/pass_timeline.py --head-dim 128 --mask causal --seqlen 4096 --providers --calls 20 --bwd-variants $B-dqwldfpsxa-dn $B-dqwldfpsxa-dn-sf --json $L/tl-d128c4k.json > $L/tl-d128c4k.log 2>&1; grep -E "==|bwd |_attn_bwd|fill|zero|Fill" $L/tl-d128c4k.log | head -30
PYTHONPATH=. python benchmarks/diagnostics/pass_timeline.py --head-dim 128 --mask full --seqlen 8192 --providers --calls 20 --bwd-variants $B-dqwldfpsbrr $B-dqwldfpsbrr-sf --json $L/tl-d128f8k.json > $L/tl-d128f8k.log 2>&1; grep -E "==|bwd |_attn_bwd|fill|zero|Fill" $L/tl-d128f8k.log | head -30
PYTHONPATH=. python benchmarks/diagnostics/pass_timeline.py --head-dim 64 --mask causal --seqlen 4096 --providers --calls 20 --bwd-variants kv2x64-m128-s2-dqwlds kv2x64-m128-s2-dqwlds-sf --json $L/tl-d64c4k.json > $L/tl-d64c4k.log 2>&1; grep -E "==|bwd |_attn_bwd|fill|zero|Fill" $L/tl-d64c4k.log | head -30
python benchmarks/hopper_attention.py $L/fwd-ppdyn3.json --rounds 5 --head-dims 64 --masks causal --seqlens 3584 4096 4608 5120 --variants ws3x4-pp-s3 ws2x4-pp-dyn ws2x4-pp-dyn-s3 > $L/fwd-ppdyn3.log 2>&1; grep "^d" $L/fwd-ppdyn3.log | head -12
