set -x
L=$OUT
PYTHONPATH=. timeout 150 python benchmarks/diagnostics/packed_forms.py $L/dnp-causal.json --head-dim 128 --forms ws2x4-overlap-fma/kv2x64-m64-s2 ws2x4-overlap-fma/kv2x64-m64-s2-dqwld-dnp --rounds 5 > $L/dnp-causal.log 2>&1; echo "rc $?"
grep "^d128" $L/dnp-causal.log
PYTHONPATH=. timeout 150 python benchmarks/diagnostics/packed_forms.py $L/dnp-full.json --head-dim 128 --non-causal --forms ws2x4-overlap-fma/kv2x64-m64-s2-dqwld ws2x4-overlap-fma/kv2x64-m64-s2-dqwld-dnp --rounds 5 > $L/dnp-full.log 2>&1; echo "rc $?"
grep "^d128" $L/dnp-full.log
