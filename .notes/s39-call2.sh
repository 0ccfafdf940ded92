set -x
L=$OUT
T="python -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -m gpu -n 8 -q -p no:cacheprovider"
PYTHONPATH=. timeout 200 $T -k "tail_pieces or (every_variant and -ts) or (ordered_dq and -ts)" > $L/tests-ts.log 2>&1; echo "tests rc $?"; tail -3 $L/tests-ts.log
grep -E "FAILED|Error|error" $L/tests-ts.log | head -20
ab() {
  tag=$1; shift
  PYTHONPATH=. timeout 380 python benchmarks/hopper_attention_bwd.py $L/ab-$tag.json --no-triton-backward "$@" > $L/ab-$tag.log 2>&1
  echo "== $tag rc $?"; grep -E "^d" $L/ab-$tag.log | head -14
}
B=kv2x64-m64-s2-dqwldfpsbrr
ab d128full --head-dims 128 --masks full --seqlens 2048 4096 8192 16384 32768 --variants $B $B-kf $B-kf-ts --rounds 5
