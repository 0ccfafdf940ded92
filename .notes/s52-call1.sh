set -x
L=$OUT
bash benchmarks/hopper_env.sh > $L/env.txt 2>&1; cat $L/env.txt
PYTHONPATH=. timeout 150 python benchmarks/diagnostics/attention_host_time.py --seqlen 512 --head-dim 64 --stages --primitives --floor --split --device-time --profile > $L/host64.log 2>&1; echo "host64 rc $?"
PYTHONPATH=. timeout 100 python benchmarks/diagnostics/attention_host_time.py --seqlen 512 --head-dim 128 --stages --primitives --floor --split --device-time > $L/host128.log 2>&1; echo "host128 rc $?"
grep -v "^ " $L/host64.log | head -80; tail -5 $L/host128.log
PYTHONPATH=. timeout 250 python benchmarks/attention.py --out $L/short --providers hf_flash sdpa --head-dims 64 128 --masks causal full --seqlens 512 1024 2048 --rounds 5 --min-calls 5 > $L/short.log 2>&1; echo "short rc $?"
tail -40 $L/short.log
