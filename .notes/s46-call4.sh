set -x
L=$OUT
PYTHONPATH=. timeout 60 python benchmarks/diagnostics/attention_host_time.py --seqlen 512 --device-time > $L/host-512.log 2>&1; cat $L/host-512.log
PYTHONPATH=. timeout 480 python benchmarks/attention.py --out $L/bar --providers hf_flash sdpa --head-dims 128 64 --masks causal full --seqlens 4096 8192 16384 32768 --rounds 5 --min-calls 5 > $L/bar.log 2>&1; echo "bar rc $?"
grep -A60 "TFLOP/s" $L/bar.log | head -64
