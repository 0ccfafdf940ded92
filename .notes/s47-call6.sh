set -x
L=$OUT
PYTHONPATH=. timeout 200 python benchmarks/diagnostics/packed_forms.py $L/packed-d128-causal.json --head-dim 128 --forms ws2x4-overlap-fma/kv2x64-m64-s2 ws2x4-overlap-fma/kv2x64-m64-s2-dqwld ws2x4-overlap-fma/kv2x64-m64-s2-dqwl ws2x4-pp/kv2x64-m64-s2 --rounds 5 > $L/packed-d128-causal.log 2>&1; echo "rc $?"
grep "^d128" $L/packed-d128-causal.log
PYTHONPATH=. timeout 200 python benchmarks/diagnostics/packed_forms.py $L/packed-d128-full.json --head-dim 128 --non-causal --forms ws2x4-overlap-fma/kv2x64-m64-s2-dqwld ws2x4-overlap-fma/kv2x64-m64-s2 ws2x4-overlap-fma/kv2x64-m64-s2-dqwl ws2x4-pp/kv2x64-m64-s2-dqwld --rounds 5 > $L/packed-d128-full.log 2>&1; echo "rc $?"
grep "^d128" $L/packed-d128-full.log
