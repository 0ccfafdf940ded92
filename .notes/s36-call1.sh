set -x
L=$OUT
F=clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active
nvidia-smi --query-gpu=$F --format=csv -c 1 > $L/smi-probe.txt 2>&1 || F=clocks.sm,clocks.mem,power.draw,temperature.gpu
nvidia-smi -q -d POWER,CLOCK >> $L/smi-probe.txt 2>&1
nvidia-smi --query-gpu=timestamp,$F --format=csv,noheader -lms 20 > $L/clocks.csv & SMI=$!
for s in 4096 8192; do PYTHONPATH=. timeout 150 python benchmarks/diagnostics/pass_timeline.py --head-dim 128 --mask full --seqlen $s --calls 60 --providers hf_flash sdpa --json $L/tl-$s.json > $L/tl-$s.log 2>&1; done
kill $SMI
grep "^==" $L/tl-*.log
PYTHONPATH=. timeout 200 python -m pytest -q -x tests/hopper/test_hopper_attention_bwd_gpu.py -k "dqwldsb or dqwlds-kf" > $L/tests.log 2>&1; tail -3 $L/tests.log
PYTHONPATH=. timeout 200 python benchmarks/hopper_attention_bwd.py $L/d64full.json --variants kv2x64-m128-s2-dqwlds kv2x64-m128-s2-dqwldsb kv2x64-m128-s2-dqwlds-kf --head-dims 64 --rounds 3 --masks full --seqlens 4096 8192 16384 32768 --no-triton-backward > $L/d64full.log 2>&1; grep "^d" $L/d64full.log | head -20
