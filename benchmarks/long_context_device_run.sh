#!/usr/bin/env bash
# Issue 16's GPU work in device calls of <= 10 minutes:
#   bash benchmarks/long_context_device_run.sh OUT long     the tests/training GPU tests, then the
#                                                           8B shape at 256K and 128K (one step each)
#   bash benchmarks/long_context_device_run.sh OUT planner  the 1.2B shape at 512K (one step), then
#                                                           the planner against today's recipe
#                                                           (memory_plan fixed) at 32K and 64K
#   bash benchmarks/long_context_device_run.sh OUT liger    (carry .whl: scripts/fetch_device_wheels.sh)
#                                                           the training GPU tests (Liger's too), the
#                                                           int64 tests past 2^31 elements, then the
#                                                           8B shape at 32K with and without Liger
#   bash benchmarks/long_context_device_run.sh OUT points   (carry .whl) the int64 attention test, then
#                                                           the 8B shape at 128K and 192K (one step)
# Logs and long_context_search-<gpu>.json land in OUT.
set -u
OUT=${1:?usage: long_context_device_run.sh OUT long|planner}
WHAT=${2:?usage: long_context_device_run.sh OUT long|planner}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/env.txt"
free -g | tee -a "$OUT/env.txt"
case $WHAT in
    long)
        timeout 170 python -m pytest tests/training -m gpu -q -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/training-gpu-tests.log"
        timeout 400 python benchmarks/long_context_search.py --points llama-8b:262144,llama-8b:131072 \
            --steps 1 --timeout 330 --out "$OUT" 2>&1 | tee "$OUT/search-long.log" | grep -v "^ "
        ;;
    planner)
        timeout 310 python benchmarks/long_context_search.py --points llama-1.2b:524288 \
            --steps 1 --timeout 290 --out "$OUT/big" 2>&1 | tee "$OUT/search-big.log" | grep -v "^ "
        timeout 250 python benchmarks/long_context_search.py --points llama-1.2b:32768,llama-8b:65536 \
            --steps 3 --fixed --timeout 110 --out "$OUT/planner" 2>&1 | tee "$OUT/search-planner.log" | grep -v "^ "
        ;;
    liger)
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/liger_kernel-*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
        timeout 240 python -m pytest tests/training/test_training_gpu.py "tests/ops/test_flash_attn_gpu.py::test_past_2_31_elements_int64_addressing" \
            "tests/ops/test_rotary.py::test_past_2_31_elements_gpu" -q -p no:cacheprovider -rfE 2>&1 | tail -25 | tee "$OUT/gpu-tests.log"
        timeout 300 python benchmarks/long_context_search.py --points llama-8b:32768 --steps 3 --liger both \
            --timeout 140 --out "$OUT/liger" 2>&1 | tee "$OUT/search-liger.log" | grep -v "^ "
        ;;
    points)
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/liger_kernel-*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
        timeout 150 python -m pytest "tests/ops/test_flash_attn_gpu.py::test_past_2_31_elements_int64_addressing" \
            -q -p no:cacheprovider -rfE 2>&1 | tail -25 | tee "$OUT/int64-tests.log"
        timeout 420 python benchmarks/long_context_search.py --points llama-8b:131072,llama-8b:196608 --steps 1 \
            --timeout 250 --out "$OUT/points" 2>&1 | tee "$OUT/search-points.log" | grep -v "^ "
        ;;
    *) echo "unknown step $WHAT" >&2; exit 2 ;;
esac
