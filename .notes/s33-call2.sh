set -x
L=$OUT
python benchmarks/diagnostics/pass_timeline.py --mask full --seqlen 4096 --json $L/timeline-4k.json > $L/timeline-4k.log 2>&1; grep -E "^==|^  (fwd|bwd)" $L/timeline-4k.log
python benchmarks/diagnostics/pass_timeline.py --mask full --seqlen 32768 --calls 5 --json $L/timeline-32k.json > $L/timeline-32k.log 2>&1; grep -E "^==|^  (fwd|bwd)" $L/timeline-32k.log
python benchmarks/hopper_attention.py $L/fwd-hm64.json --masks causal --rounds 3 --head-dims 64 --seqlens 16384 32768 65536 --variants ws3x4-pp-s3 ws3x4-pp-s3-hm > $L/fwd-hm64.log 2>&1; grep "^d64" $L/fwd-hm64.log
HOPPER_NCU_TARGET=fwd HOPPER_NCU_KERNEL='regex:flash_fprop|_attn_fwd_kernel' timeout 200 bash benchmarks/hopper_bwd_ncu_device_run.sh $L/ncu-fwd64 "sdpa ws3x4-pp-s3 ws2x4-overlap-fma" --head-dim 64 --seqlen 4096 2>&1 | tail -30
HOPPER_NCU_KERNEL='regex:flash_bprop|_attn_bwd_dkdv_kernel' timeout 200 bash benchmarks/hopper_bwd_ncu_device_run.sh $L/ncu-bwd32k "sdpa kv2x64-m64-s2-dqwldfpsbrr" --full --seqlen 32768 2>&1 | tail -30
