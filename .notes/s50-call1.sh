set -x
L=$OUT
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
PYTHONPATH=. timeout 200 python -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -m gpu -q -p no:cacheprovider -n 8 -k "test_softcap_split_d_candidate or (test_every_variant and splitd)" > $L/tests.log 2>&1; echo "rc $?"
tail -3 $L/tests.log; grep -E "^FAILED|^ERROR" $L/tests.log | head; grep -E "^E " $L/tests.log | head -5
PYTHONPATH=. timeout 300 python benchmarks/hopper_attention_bwd.py $L/cap128.json --head-dims 128 --softcap 50 --seqlens 4096 16384 --variants kv64-m64-s2-splitd+dq2x64-n64-s3 --library-default --rounds 3 > $L/cap128.log 2>&1; echo "rc $?"
tail -30 $L/cap128.log
