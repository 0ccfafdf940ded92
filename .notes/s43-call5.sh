set -x
L=$OUT
nvidia-smi --query-gpu=name --format=csv,noheader
PYTHONPATH=. timeout 170 python benchmarks/attention.py --out $L/short --providers hf_flash sdpa --head-dims 128 64 --masks causal full --seqlens 512 1024 --rounds 3 --min-calls 5 > $L/short.log 2>&1; echo "short rc $?"
grep -A40 "TFLOP/s" $L/short.log
PYTHONPATH=. timeout 60 python benchmarks/diagnostics/attention_host_time.py --seqlen 512 --head-dim 128 --thread-cost --calls 100 > $L/thread-cost.log 2>&1; echo "thread rc $?"; grep -A6 "thread cost" $L/thread-cost.log
PYTHONPATH=. timeout 120 python benchmarks/diagnostics/host_ab.py --base .abbase --rounds 16 --head-dim 128 > $L/host-ab.log 2>&1; echo "ab rc $?"; cat $L/host-ab.log
PYTHONPATH=. timeout 200 python -m pytest tests/ops/test_launch_gpu.py -m gpu -n 3 -q -p no:cacheprovider > $L/launch-tests.log 2>&1 &
PYTHONPATH=. timeout 200 python -m pytest tests/ops/test_flash_attn_gpu.py -m gpu -n 4 -q -p no:cacheprovider -k "sink" > $L/sink-tests.log 2>&1 &
wait
for f in launch sink; do echo "== $f"; tail -2 $L/$f-tests.log; grep -E "^FAILED|^ERROR" $L/$f-tests.log | head; done
