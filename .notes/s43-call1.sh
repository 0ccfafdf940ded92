set -x
L=$OUT
nvidia-smi --query-gpu=name --format=csv,noheader
for r in 1 2; do PYTHONPATH=. timeout 150 python benchmarks/diagnostics/attention_host_time.py --seqlen 512 --head-dim 128 --primitives --stages > $L/host-prims-$r.log 2>&1; echo "rc $?"; done
cat $L/host-prims-1.log $L/host-prims-2.log
