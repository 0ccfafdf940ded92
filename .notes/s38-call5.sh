set -x
L=$OUT
F=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu
nvidia-smi --query-gpu=$F --format=csv,noheader -lms 20 > $L/clocks.csv & SMI=$!
PYTHONPATH=. timeout 300 python benchmarks/attention.py --out $L/rep1000 --providers hf_flash sdpa --head-dims 128 --masks full --seqlens 8192 16384 32768 --rounds 3 --rep-ms 1000 > $L/rep1000.log 2>&1; echo "rep1000 rc $?"
grep -E "^ *128 " $L/rep1000.log | head -12
PYTHONPATH=. timeout 150 python benchmarks/diagnostics/pass_timeline.py --head-dim 128 --mask full --seqlen 32768 --calls 20 --providers hf_flash sdpa --json $L/tl-32k.json > $L/tl-32k.log 2>&1; echo "tl rc $?"
kill $SMI
grep -E "^==|fwd\+bwd|call" $L/tl-32k.log | head -30
