set -x
L=$OUT
nvidia-smi --query-gpu=name,clocks.sm --format=csv > $L/env.txt
PYTHONPATH=. timeout 150 python -m pytest tests/hopper/test_hopper_attention_gpu.py -m gpu -q -p no:cacheprovider -n 6 -k "carry-hm" > $L/hm-tests.log 2>&1; echo "hm tests rc $?"; tail -3 $L/hm-tests.log; grep -E "^(FAILED|ERROR)" $L/hm-tests.log | head
PYTHONPATH=. timeout 240 python benchmarks/hopper_attention.py $L/hm.json --variants ws2x4-overlap-fma-dyn-carry ws2x4-overlap-fma-dyn-carry-hm ws2x4-overlap-fma-dyn ws2x4-overlap-fma-dyn-hm --seqlens 512 1024 2048 4096 --head-dims 64 128 --masks causal --rounds 5 > $L/hm.log 2>&1; echo "hm bench rc $?"; grep "^d" $L/hm.log
HOPPER_NCU_TARGET=fwd HOPPER_NCU_TAG=-hm timeout 120 bash benchmarks/hopper_bwd_ncu_device_run.sh $L/ncu "ws2x4-overlap-fma-dyn-carry-hm" --seqlen 512 --head-dim 64 > $L/ncu-hm.log 2>&1; echo "ncu hm rc $?"; tail -5 $L/ncu-hm.log
