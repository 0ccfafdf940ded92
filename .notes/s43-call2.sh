set -x
L=$OUT
nvidia-smi --query-gpu=name --format=csv,noheader
for r in 1 2; do
  (cd .base && PYTHONPATH=. timeout 100 python benchmarks/diagnostics/attention_host_time.py --seqlen 512 --head-dim 128 --split --stages > $L/host-base-$r.log 2>&1); echo "base rc $?"
  PYTHONPATH=. timeout 100 python benchmarks/diagnostics/attention_host_time.py --seqlen 512 --head-dim 128 --split --stages > $L/host-new-$r.log 2>&1; echo "new rc $?"
done
for f in base-1 new-1 base-2 new-2; do echo "=== $f"; cat $L/host-$f.log; done
PYTHONPATH=. timeout 330 python -m pytest tests/ops/test_launch_gpu.py -m gpu -n 4 -q -p no:cacheprovider > $L/launch-tests.log 2>&1 &
PYTHONPATH=. timeout 330 python -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -m gpu -n 6 -q -p no:cacheprovider -k "not every_variant and not packed" > $L/bwd-tests.log 2>&1 &
PYTHONPATH=. timeout 330 python -m pytest tests/ops/test_flash_attn_gpu.py -m gpu -n 6 -q -p no:cacheprovider > $L/ops-tests.log 2>&1 &
wait
for f in launch bwd ops; do echo "== $f"; tail -3 $L/$f-tests.log; grep -E "^FAILED|^ERROR" $L/$f-tests.log | head; done
