set -x
L=$OUT
PYTHONPATH=. timeout 200 python benchmarks/diagnostics/packed_forms.py $L/packed-d64-fwd-forms.json --head-dim 64 --forms ws3x4-pp-s3/kv2x64-m64-s2 ws3x4-pp/kv2x64-m64-s2 ws3x4-overlap-fma/kv2x64-m64-s2 ws2x4-pp/kv2x64-m64-s2 --rounds 5 > $L/packed-d64-fwd-forms.log 2>&1; echo "rc $?"
grep "^d64" $L/packed-d64-fwd-forms.log
