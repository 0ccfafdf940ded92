set -x
L=$OUT
PYTHONPATH=. timeout 150 python -m pytest tests/ops/test_launch_gpu.py -m gpu -q -p no:cacheprovider -n 8 > $L/tests-launch.log 2>&1; echo "rc $?"
tail -3 $L/tests-launch.log; grep -E "^FAILED|^ERROR" $L/tests-launch.log | head; grep -E "^E " $L/tests-launch.log | head -5
PYTHONPATH=. timeout 120 python -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -m gpu -q -p no:cacheprovider -n 8 -k "softcap or test_dq_every_variant_matches" > $L/tests-softcap.log 2>&1; echo "rc $?"
tail -2 $L/tests-softcap.log; grep -E "^FAILED|^ERROR" $L/tests-softcap.log | head
PYTHONPATH=.:hostab_base timeout 150 python benchmarks/diagnostics/host_ab.py --base hostab_base --head-dim 256 --seqlen 512 > $L/host_ab_d256.log 2>&1; echo "rc $?"
tail -12 $L/host_ab_d256.log
