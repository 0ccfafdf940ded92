set -x
L=$OUT
for d in 128 64; do PYTHONPATH=. timeout 60 python benchmarks/diagnostics/attention_host_time.py --seqlen 512 --head-dim $d --stages > $L/host-d$d.log 2>&1; echo "host d$d rc $?"; done
cat $L/host-d128.log $L/host-d64.log
PYTHONPATH=. timeout 420 python -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -m gpu -n 8 -q -p no:cacheprovider -k "not every_variant and not packed" > $L/bwd-tests.log 2>&1; echo "tests rc $?"; tail -3 $L/bwd-tests.log
grep -E "^FAILED|^ERROR" $L/bwd-tests.log | head
