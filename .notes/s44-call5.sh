set -x
L=$OUT
for r in 1 2; do PYTHONPATH=. timeout 150 python benchmarks/diagnostics/attention_host_time.py --seqlen 512 --floor --calls 200 --repeats 5 > $L/floor-$r.log 2>&1; echo "rc $?"; done
PYTHONPATH=. timeout 150 python benchmarks/diagnostics/attention_host_time.py --seqlen 512 --head-dim 64 --floor --calls 200 --repeats 5 > $L/floor-d64.log 2>&1; echo "rc $?"
tail -5 $L/floor-1.log; tail -5 $L/floor-2.log; tail -5 $L/floor-d64.log
