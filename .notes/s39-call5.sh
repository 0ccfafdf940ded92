set -x
L=$OUT
HOPPER_NCU_KERNEL='regex:flash_bprop|_attn_bwd_dkdv_kernel' timeout 330 bash benchmarks/hopper_bwd_ncu_device_run.sh $L/ncu "sdpa kv2x64-m64-s2-dqwldfpsbrr kv2x64-m64-s2-dqwldfpsbrr-kf-ts" --full --seqlen 32768 2>&1 | tail -40
