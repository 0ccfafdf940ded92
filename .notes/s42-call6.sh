set -x
L=$OUT
PYTHONPATH=. timeout 100 python benchmarks/diagnostics/attention_host_time.py --seqlen 512 --head-dim 128 --device-time --calls 100 --repeats 3 > $L/host-dev.log 2>&1; echo "rc $?"; cat $L/host-dev.log
