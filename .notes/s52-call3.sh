set -x
L=$OUT
nvidia-smi --query-gpu=name,clocks.sm --format=csv > $L/env.txt
for d in 64 128; do PYTHONPATH=. timeout 100 python benchmarks/diagnostics/host_ab.py --base .abbase --rounds 15 --head-dim $d > $L/host-ab-d$d.log 2>&1; echo "ab rc $?"; cat $L/host-ab-d$d.log; done
PYTHONPATH=. timeout 60 python benchmarks/diagnostics/attention_host_time.py --seqlen 512 --head-dim 64 --primitives --stages > $L/host64.log 2>&1; echo "host rc $?"; grep -v "^ " $L/host64.log
PYTHONPATH=. timeout 120 python benchmarks/attention.py --out $L/short --providers hf_flash sdpa --head-dims 64 128 --masks causal full --seqlens 512 1024 --rounds 5 --min-calls 5 > $L/short.log 2>&1; echo "short rc $?"; tail -20 $L/short.log
PYTHONPATH=. timeout 260 python -m pytest tests/ops/test_launch_gpu.py tests/ops/test_flash_attn_gpu.py tests/integration/test_integration_gpu.py -m gpu -q -p no:cacheprovider -n 6 > $L/gpu-tests.log 2>&1; echo "gpu tests rc $?"; tail -3 $L/gpu-tests.log; grep -E "^(FAILED|ERROR)" $L/gpu-tests.log | head -20
