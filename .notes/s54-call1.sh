# (s54 call 1 = s53 call 3 re-run after the carried-variable fix) the stream and carry-hm forms
set -x
L=$OUT
nvidia-smi --query-gpu=name,clocks.sm --format=csv > $L/env.txt
# a short first check: a hang here means the stream protocol is still wrong (stop, do not debug on device time)
PYTHONPATH=. timeout 60 python -m pytest tests/hopper/test_hopper_attention_gpu.py -m gpu -q -p no:cacheprovider -k "bitwise and (stream or carry-hm)" > $L/tests-quick.log 2>&1; echo "quick tests rc $?"; tail -3 $L/tests-quick.log; grep -E "^E " $L/tests-quick.log | head -20
PYTHONPATH=. timeout 150 python -m pytest tests/hopper/test_hopper_attention_gpu.py -m gpu -q -p no:cacheprovider -n 8 -k "(carry-hm or stream) and not per_stream" > $L/tests.log 2>&1; echo "tests rc $?"; tail -3 $L/tests.log; grep -E "^(FAILED|ERROR)" $L/tests.log | head; grep -E "^E " $L/tests.log | head -20
PYTHONPATH=. timeout 130 python benchmarks/hopper_attention.py $L/d64c.json --variants ws2x4-overlap-fma-dyn-carry ws2x4-overlap-fma-dyn-stream ws2x4-overlap-fma-dyn-carry-hm --seqlens 512 1024 2048 4096 --head-dims 64 --masks causal --rounds 5 > $L/d64c.log 2>&1; echo "d64c rc $?"; grep "^d" $L/d64c.log
PYTHONPATH=. timeout 70 python benchmarks/hopper_attention.py $L/d64f.json --variants ws2x4-overlap-fma-dyn-carry ws2x4-overlap-fma-dyn-stream --seqlens 512 1024 2048 --head-dims 64 --masks full --rounds 5 > $L/d64f.log 2>&1; echo "d64f rc $?"; grep "^d" $L/d64f.log
