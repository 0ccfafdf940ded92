set -x
L=$OUT
nvidia-smi --query-gpu=name --format=csv,noheader
for d in 128 64; do PYTHONPATH=. timeout 150 python benchmarks/diagnostics/host_ab.py --base .abbase --rounds 16 --head-dim $d > $L/host-ab-d$d.log 2>&1; echo "ab rc $?"; cat $L/host-ab-d$d.log; done
PYTHONPATH=. timeout 330 python -m pytest tests/hopper/test_hopper_attention_gpu.py -m gpu -n 8 -q -p no:cacheprovider > $L/fwd-tests.log 2>&1 &
PYTHONPATH=. timeout 330 python -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -m gpu -n 6 -q -p no:cacheprovider -k "packed and not every_variant" > $L/bwd-packed-tests.log 2>&1 &
wait
for f in fwd bwd-packed; do echo "== $f"; tail -2 $L/$f-tests.log; grep -E "^FAILED|^ERROR" $L/$f-tests.log | head; done
