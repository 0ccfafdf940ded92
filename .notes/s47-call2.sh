set -x
L=$OUT
PYTHONPATH=. timeout 420 python benchmarks/diagnostics/packed_forms.py $L/packed-d64.json --head-dim 64 --forms triton/triton triton/kv2x64-m64-s2 triton/kv2x64-m64-s2-dqa ws3x4-pp-s3/triton ws2x4-overlap-fma/triton --rounds 5 > $L/packed-d64.log 2>&1; echo "rc $?"
tail -22 $L/packed-d64.log
