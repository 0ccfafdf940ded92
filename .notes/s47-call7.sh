set -x
L=$OUT
PYTHONPATH=. timeout 300 python -m pytest tests/ops/test_flash_attn_gpu.py -m gpu -q -p no:cacheprovider -k "int64" --durations=5 > $L/int64-tests.log 2>&1; echo "rc $?"
tail -12 $L/int64-tests.log; grep -E "^FAILED|^ERROR|^E " $L/int64-tests.log | head -20
PYTHONPATH=. timeout 100 python benchmarks/diagnostics/packed_forms.py $L/smoke.json --head-dim 64 --forms triton/triton ws3x4-pp-s3/kv2x64-m64-s2 --rounds 1 > $L/smoke.log 2>&1; echo "rc $?"
tail -4 $L/smoke.log
