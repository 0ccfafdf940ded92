# (s54 call 2) host time of the public path, where it goes (B=1, 512 queries, causal)
set -x
L=$OUT
nvidia-smi --query-gpu=name,clocks.sm --format=csv > $L/env.txt
for d in 64 128; do
PYTHONPATH=. timeout 200 python benchmarks/diagnostics/attention_host_time.py --seqlen 512 --head-dim $d --stages --primitives --floor --profile > $L/host-d$d.log 2>&1; echo "host d$d rc $?"
done
grep -v "^ *[0-9]* *[0-9.]* *[0-9.]* *[0-9.]* *[0-9.]* .*:[0-9]*(" $L/host-d64.log | head -80
