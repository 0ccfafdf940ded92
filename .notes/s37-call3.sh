set -x
L=$OUT
T="python -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -m gpu -n 8 -q -p no:cacheprovider"
PYTHONPATH=. timeout 150 $T -k "default_variant or 8191 or repeats_bitwise or no_zeroed" > $L/tests-default.log 2>&1; echo "default tests rc $?"; tail -2 $L/tests-default.log
grep -q " passed" $L/tests-default.log && ! grep -q "failed" $L/tests-default.log || exit 3
ab() {
  tag=$1; shift
  PYTHONPATH=. timeout 170 python benchmarks/hopper_attention_bwd.py /tmp/ab-$tag.json --no-triton-backward "$@" > /tmp/ab-$tag.log 2>&1
  echo "== $tag rc $?"; grep -E "^d" /tmp/ab-$tag.log | head -12
}
ab d128full --head-dims 128 --masks full --seqlens 4096 8192 32768 --variants kv2x64-m64-s2-dqwldfpsbrr kv2x64-m64-s2-dqwldfpsbrr-kt --rounds 4
ab d64full --head-dims 64 --masks full --seqlens 4096 16384 --variants kv2x64-m128-s2-dqwlds kv2x64-m128-s2-dqwlds-kt --rounds 4
tar -czf $L/ab.tgz -C /tmp $(cd /tmp && ls ab-*)
