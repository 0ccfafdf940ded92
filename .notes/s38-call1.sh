set -x
L=$OUT
T="python -m pytest tests/hopper/test_hopper_attention_bwd_gpu.py -m gpu -n 8 -q -p no:cacheprovider"
PYTHONPATH=. timeout 150 $T -k "every_variant and (brr-nf or brr-b8 or brr-b32)" > $L/tests-variants.log 2>&1; echo "variant tests rc $?"; tail -2 $L/tests-variants.log
ab() {
  tag=$1; shift
  PYTHONPATH=. timeout 400 python benchmarks/hopper_attention_bwd.py $L/ab-$tag.json --no-triton-backward "$@" > $L/ab-$tag.log 2>&1
  echo "== $tag rc $?"; grep -E "^d" $L/ab-$tag.log | head -12
}
B=kv2x64-m64-s2-dqwldfpsbrr
ab d128full --head-dims 128 --masks full --seqlens 8192 16384 32768 --variants $B $B-nf $B-b8 $B-b32 --rounds 4
