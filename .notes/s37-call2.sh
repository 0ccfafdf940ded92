set -x
L=$OUT
B=kv2x64-m64-s2
T="python -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -m gpu -n 8 -q -p no:cacheprovider"
# the default-path tests first (the A/B is worth nothing if the new form is wrong)
PYTHONPATH=. timeout 150 $T -k "default_variant or 8191" > $L/tests-default.log 2>&1; echo "default tests rc $?"; tail -2 $L/tests-default.log
grep -q " passed" $L/tests-default.log && ! grep -q "failed" $L/tests-default.log || exit 3
ab() {
  tag=$1; shift
  PYTHONPATH=. timeout 170 python benchmarks/hopper_attention_bwd.py /tmp/ab-$tag.json --no-triton-backward "$@" > /tmp/ab-$tag.log 2>&1
  echo "== $tag rc $?"; grep -E "^d|hopper:|sdpa" /tmp/ab-$tag.log | head -20
}
ab d128full --head-dims 128 --masks full --seqlens 4096 8192 32768 --variants $B-dqwldfpsbrr $B-dqwldfpsbrr-sx --rounds 4
ab d128causal --head-dims 128 --masks causal --seqlens 4096 16384 --variants $B-dqwldfpsxa-dn $B-dqwldfpsxa-dn-sx --rounds 4
ab d64 --head-dims 64 --masks causal full --seqlens 4096 16384 --variants kv2x64-m128-s2-dqwlds kv2x64-m128-s2-dqwlds-sx --rounds 3
tar -czf $L/ab.tgz -C /tmp $(cd /tmp && ls ab-*)
PYTHONPATH=. timeout 240 $T -k "not every_variant and not default_variant and not 8191" > $L/tests-rest.log 2>&1; echo "rest tests rc $?"; tail -3 $L/tests-rest.log
