#!/usr/bin/env bash
# Nsight Compute on the Gluon backward (or forward) kernel at one point (one launch per variant):
# sections (speed of light, compute/memory workload, warp state, scheduler, launch, occupancy, source
# counters for per-instruction stall sampling) plus the tensor-pipe, L2-reduction and DRAM metrics
# this ncu knows; exports details, raw metrics and the SASS source page as text.
#
#   bash benchmarks/hopper_bwd_ncu_device_run.sh OUT_DIR "VARIANT ..." [POINT ARGS ...]
#
# POINT ARGS go to benchmarks/diagnostics/hopper_bwd_ncu.py (default: d128 causal S=16K); with
# HOPPER_NCU_TARGET=fwd the forward kernel is profiled instead (the target's --forward);
# HOPPER_NCU_KERNEL replaces the kernel filter (e.g. regex:flash_fprop for the variant sdpa:
# cuDNN's forward kernel). Writes
# OUT_DIR/ncu$HOPPER_NCU_TAG.tar.gz (reports, text exports and the log) and prints a summary. Clocks are left as found
# (--clock-control none).
set -u
out=${1:?usage: hopper_bwd_ncu_device_run.sh OUT_DIR "VARIANTS" [POINT ARGS]}
variants=${2:?variants}
shift 2
export PYTHONPATH=${PYTHONPATH:-.}
export PYTHONUNBUFFERED=1
target=benchmarks/diagnostics/hopper_bwd_ncu.py kernel=regex:_attn_bwd_dkdv_kernel
if [ "${HOPPER_NCU_TARGET:-bwd}" = fwd ]; then
  kernel=regex:_attn_fwd_kernel
  set -- --forward "$@"
fi
kernel=${HOPPER_NCU_KERNEL:-$kernel}
work=$(mktemp -d)
log="$work/ncu.log"
mkdir -p "$out"
{
  which ncu; ncu --version | tail -n 2
  # HOPPER_NCU_TIME=1: time each variant's kernel first (outside ncu)
  if [ -n "${HOPPER_NCU_TIME:-}" ]; then
    for v in $variants; do timeout 120 python3 $target "$v" --time "$@"; done
  fi
} >>"$log" 2>&1
timeout 60 ncu --query-metrics >"$work/query-metrics.txt" 2>&1
metrics=$(python3 - "$work/query-metrics.txt" <<'PY'
import re, sys
names = [l.split()[0] for l in open(sys.argv[1]) if re.match(r"^[a-z]+__\S+", l)]
out = []
for n in names:
    if re.search(r"(gmma|tensor_op|xu|fma|alu).*cycles_active$", n) and n.startswith("sm__pipe"):
        out.append(n + ".avg.pct_of_peak_sustained_active")
    elif re.match(r"lts__t_(sectors|requests)(_srcunit_\w+)?_op_(red|atom)$", n):
        out += [n + ".sum", n + ".sum.per_second"]
    elif n in ("dram__bytes_read", "dram__bytes_write", "lts__t_bytes", "smsp__inst_executed_op_shared_st",
               "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld",
               "smsp__inst_executed_pipe_tma", "sm__inst_executed_pipe_xu", "sm__cycles_active", "lts__throughput",
               "dram__throughput"):
        out += [n + ".sum", n + ".sum.per_second"] if n.startswith(("dram__bytes", "lts__t_bytes")) else [n + (".avg.pct_of_peak_sustained_elapsed" if n.endswith("throughput") else ".sum")]
print(",".join(out))
PY
)
echo "metrics: $metrics" >>"$log"
for v in $variants; do
  sections="--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis
    --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section SchedulerStats --section LaunchStats
    --section Occupancy --section SourceCounters --section InstructionStats"
  # one pass set: the sections plus the metrics found above; without the metrics if ncu refuses them
  timeout 200 ncu --clock-control none -k $kernel --launch-skip 1 --launch-count 1 $sections \
    ${metrics:+--metrics "$metrics"} -f -o "$work/$v" python3 $target "$v" "$@" >>"$log" 2>&1
  rc=$?
  echo "ncu $v rc $rc" >>"$log"
  if [ $rc -ne 0 ] && [ -n "$metrics" ]; then
    timeout 200 ncu --clock-control none -k $kernel --launch-skip 1 --launch-count 1 $sections \
      -f -o "$work/$v" python3 $target "$v" "$@" >>"$log" 2>&1
    echo "ncu (sections only) $v rc $?" >>"$log"
  fi
  for r in "$work/$v"; do
    [ -f "$r.ncu-rep" ] || continue
    ncu -i "$r.ncu-rep" --page details --print-units base >"$r.details.txt" 2>&1
    ncu -i "$r.ncu-rep" --page raw --csv --print-units base >"$r.raw.csv" 2>&1
  done
  [ -f "$work/$v.ncu-rep" ] && { ncu -i "$work/$v.ncu-rep" --page source --csv --print-source sass >"$work/$v.source.csv" 2>&1 \
    || ncu -i "$work/$v.ncu-rep" --page source --csv >"$work/$v.source.csv" 2>&1; }
  cat "$work/$v.details.txt" >>"$log" 2>/dev/null
done
grep -iE "gmma|op_red|tensor" "$work/query-metrics.txt" >"$work/query-metrics-grep.txt"
ls -la "$work" >>"$log"
tar -czf "$out/ncu${HOPPER_NCU_TAG:-}.tar.gz" -C "$work" .
# a summary on stdout: the headline numbers of each report
grep -E "rc |Duration|Registers Per|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|DRAM Throughput|Executed Ipc A|Warp Cycles Per Issued|No Eligible|Issued Warp Per|Shared.*Bank|==PROF==|==ERROR==|==WARNING==" "$log" | cut -c1-200 | head -n 80
