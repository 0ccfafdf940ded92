set -x
L=$OUT
T="python -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -m gpu -n 8 -q -p no:cacheprovider"
PYTHONPATH=. timeout 200 $T -k "tail_pieces or ordered_dq_repeats or (every_variant and kf-ts) or default_variant" > $L/tests-final.log 2>&1; echo "tests rc $?"; tail -2 $L/tests-final.log
grep -E "^FAILED|^ERROR" $L/tests-final.log | head
