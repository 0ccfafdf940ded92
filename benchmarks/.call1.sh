set -u
O=$OUT
export PYTHONPATH=.
HOPPER_VARIANTS="ws2x4-overlap-fma ws2x4-overlap-fma-dyn ws2x4-overlap-fma-n192" HOPPER_TESTS="n192 or default_variant" HOPPER_HEAD_DIMS=128 \
  timeout 420 bash benchmarks/hopper_device_run.sh $O/run 150 260 2>&1 | tail -n 45
HOPPER_NCU_TARGET=fwd HOPPER_NCU_TIME=1 timeout 150 bash benchmarks/hopper_bwd_ncu_device_run.sh $O/ncu "ws2x4-overlap-fma ws2x4-overlap-fma-n192" --full 2>&1 | tail -n 30
