set -x
L=$OUT
nproc; cat /proc/cpuinfo | grep "model name" | head -1; cat /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor 2>/dev/null
PYTHONPATH=. timeout 120 python benchmarks/diagnostics/attention_host_time.py --seqlen 512 --split --thread-cost --calls 200 --repeats 7 > $L/split-all.log 2>&1; echo "rc $?"
PYTHONPATH=. timeout 120 taskset -c 3 python benchmarks/diagnostics/attention_host_time.py --seqlen 512 --split --thread-cost --calls 200 --repeats 7 > $L/split-one.log 2>&1; echo "rc $?"
PYTHONPATH=. timeout 100 python benchmarks/diagnostics/host_ab.py --base .abbase --seqlen 512 --rounds 8 > $L/ab-all.log 2>&1; echo "rc $?"
PYTHONPATH=. timeout 100 python benchmarks/diagnostics/host_ab.py --base .abbase --seqlen 512 --rounds 8 --cpus 1 > $L/ab-one.log 2>&1; echo "rc $?"
tail -30 $L/split-all.log; tail -30 $L/split-one.log; tail -8 $L/ab-all.log; tail -8 $L/ab-one.log
