set -x
L=$OUT
for r in 1 2; do PYTHONPATH=. timeout 150 python benchmarks/diagnostics/attention_host_time.py --seqlen 512 --thread-parts --calls 200 --repeats 5 > $L/parts-$r.log 2>&1; echo "rc $?"; done
tail -12 $L/parts-1.log; tail -12 $L/parts-2.log
