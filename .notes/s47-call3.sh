set -x
L=$OUT
PYTHONPATH=. timeout 250 python benchmarks/diagnostics/packed_forms.py $L/packed-d64-causal.json --head-dim 64 --forms triton/kv2x64-m64-s2 ws3x4-pp-s3/kv2x64-m64-s2 ws3x4-pp-s3/kv2x64-m64-s2-dqa --rounds 5 > $L/packed-d64-causal.log 2>&1; echo "rc $?"
tail -9 $L/packed-d64-causal.log
PYTHONPATH=. timeout 250 python benchmarks/diagnostics/packed_forms.py $L/packed-d64-full.json --head-dim 64 --non-causal --forms triton/triton triton/kv2x64-m64-s2 triton/kv2x64-m64-s2-dqa ws2x4-overlap-fma/triton ws2x4-pp/triton --rounds 5 > $L/packed-d64-full.log 2>&1; echo "rc $?"
grep -v "^{" $L/packed-d64-full.log | tail -20
