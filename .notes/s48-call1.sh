set -x
L=$OUT
PYTHONPATH=. timeout 260 python -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -m gpu -q -p no:cacheprovider -n 8 -k "test_dq_every or test_dq_repeats or packed" > $L/tests.log 2>&1; echo "rc $?"
tail -5 $L/tests.log; grep -E "^FAILED|^ERROR" $L/tests.log | head -20; grep -E "^E " $L/tests.log | head -20
PYTHONPATH=. timeout 150 python benchmarks/diagnostics/packed_forms.py $L/packed-d128.json --head-dim 128 --forms ws2x4-overlap-fma/kv2x64-m64-s2+triton ws2x4-overlap-fma/kv2x64-m64-s2+dq2x64-n64-s3 ws2x4-overlap-fma/kv2x64-m64-s2+dq2x64-n64-s2 --rounds 5 --profile 5 > $L/packed-d128.log 2>&1; echo "rc $?"
grep -v "^{" $L/packed-d128.log | tail -30
PYTHONPATH=. timeout 170 python benchmarks/diagnostics/packed_forms.py $L/packed-d64.json --head-dim 64 --forms ws3x4-pp-s3/kv2x64-m64-s2+triton ws3x4-pp-s3/kv2x64-m64-s2+dq2x64-n64-s3 ws3x4-pp-s3/kv2x64-m64-s2+dq2x64-n128-s2 ws3x4-pp-s3/kv2x64-m64-s2+dq3x64-n64-s3 --rounds 5 --profile 5 > $L/packed-d64.log 2>&1; echo "rc $?"
grep -v "^{" $L/packed-d64.log | tail -36
