set -x
L=$OUT
PYTHONPATH=. timeout 90 python benchmarks/diagnostics/attention_host_time.py --seqlen 512 --head-dim 128 --stages --sync-check > $L/host-d128.log 2>&1; echo "host rc $?"; cat $L/host-d128.log
PYTHONPATH=. timeout 240 python -m pytest tests/ops/test_flash_attn_gpu.py -m gpu -n 8 -q -p no:cacheprovider > $L/ops-tests.log 2>&1; echo "ops tests rc $?"; tail -3 $L/ops-tests.log
grep -E "^FAILED|^ERROR" $L/ops-tests.log | head
PYTHONPATH=. timeout 150 python benchmarks/hopper_attention.py $L/fwd-d64.json --head-dims 64 --masks causal full --seqlens 1024 2048 --variants ws2x4-overlap-fma-dyn ws2x4-pp-dyn ws3x4-pp-s3 --rounds 5 > $L/fwd-d64.log 2>&1; echo "fwd rc $?"; grep -v "^+" $L/fwd-d64.log | tail -12
