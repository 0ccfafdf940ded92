set -x
L=$OUT
timeout 280 python -m pytest tests/hopper/test_hopper_attention_gpu.py -m gpu -n 8 -q -p no:cacheprovider --maxfail=3 > $L/fwd-tests.log 2>&1; echo "tests rc $?"; tail -4 $L/fwd-tests.log
grep -q " passed" $L/fwd-tests.log && ! grep -q "failed" $L/fwd-tests.log || exit 3
for i in 1 2; do
  (cd ab_old && PYTHONPATH=. python benchmarks/hopper_attention.py /tmp/old$i.json --rounds 3 --head-dims 64 --masks causal --seqlens 4096 8192 16384 --variants ws3x4-pp-s3) > $L/old$i.log 2>&1; grep "^d" $L/old$i.log | head -3
  PYTHONPATH=. python benchmarks/hopper_attention.py /tmp/new$i.json --rounds 3 --head-dims 64 --masks causal --seqlens 4096 8192 16384 --variants ws3x4-pp-s3 > $L/new$i.log 2>&1; grep "^d" $L/new$i.log | head -3
done
