set -x
L=$OUT
nvidia-smi --query-gpu=name,clocks.sm --format=csv > $L/env.txt
PYTHONPATH=. timeout 200 python -m pytest tests/hopper/test_hopper_attention_gpu.py -m gpu -q -p no:cacheprovider -n 6 -k "pf or item_counters" > $L/pf-tests.log 2>&1; echo "pf tests rc $?"; tail -3 $L/pf-tests.log; grep -E "^(FAILED|ERROR)" $L/pf-tests.log | head
PYTHONPATH=. timeout 220 python benchmarks/hopper_attention.py $L/pf.json --variants ws2x4-overlap-fma-dyn-carry ws2x4-overlap-fma-dyn-carry-pf ws2x4-overlap-fma-dyn ws2x4-overlap-fma-dyn-pf --seqlens 512 1024 2048 --head-dims 64 128 --masks causal full --rounds 5 > $L/pf.log 2>&1; echo "pf bench rc $?"; grep "^d" $L/pf.log
HOPPER_NCU_TARGET=fwd HOPPER_NCU_TAG=-ours timeout 120 bash benchmarks/hopper_bwd_ncu_device_run.sh $L/ncu "ws2x4-overlap-fma-dyn-carry" --seqlen 512 --head-dim 64 > $L/ncu-ours.log 2>&1; echo "ncu ours rc $?"; tail -5 $L/ncu-ours.log
HOPPER_NCU_TARGET=fwd HOPPER_NCU_KERNEL=regex:fprop HOPPER_NCU_TAG=-sdpa timeout 120 bash benchmarks/hopper_bwd_ncu_device_run.sh $L/ncu sdpa --seqlen 512 --head-dim 64 > $L/ncu-sdpa.log 2>&1; echo "ncu sdpa rc $?"; tail -5 $L/ncu-sdpa.log
